"""Time to patch a model when its modeling module is imported (goal: under 2 ms per model).

1. apply() per model, probes included, once the patcher is warm (the model reverted between
   runs), on the CPU stand-in for torch_npu: every model of the table (``MODELS`` and what is
   registered), plus the models of ``--extra FILE`` (a file defining a dict of ``Model``, e.g. a
   proposed table). CPU time of the process (``time.process_time``), min and median of 30: the
   machine is shared, and wall time under load measures the neighbours. ``--live`` probes every
   target (``NPU_AUTOPATCH_PROBE=always``: no shipped or remembered verdict), as code that our
   CI never saw is patched.
2. The first model of a process: the import of modeling_qwen3 with NPU_AUTOPATCH=1 minus
   without, in fresh interpreters (adds the one-time imports of the patcher, the kernels and
   the golden ops, and the NPU check).
3. ``python -m npu_autopatch check --simulate`` end to end, next to importing the same
   modeling modules without patching.
Run with the venv's python:
    .venv/bin/python benchmarks/patch_time.py [--extra FILE] [--live] [--only-apply] [--quick]
``--quick``: 2 runs of apply() for three models, the first model once, no ``check`` (it imports every
modeling module); tests/test_benchmarks.py runs it, so that the script keeps working.
"""

import argparse
import importlib
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAND_IN_SITE = Path(__file__).resolve().parents[1] / "tests" / "stand_in_site"
RUNS = 30


QUICK_MODELS = ("llama", "qwen3_moe", "qwen2_5_vl")  # a dense, an MoE and a VL model


def per_model(extra=(), runs=RUNS, only=None):
    """[(model type, min ms, median ms, targets, state)] of apply(); ``only``: these model types."""
    import npu_autopatch
    from npu_autopatch import _ledger, _patcher
    from npu_autopatch._state import STATE
    from npu_autopatch.kernels import _fingerprint
    from npu_autopatch.testing import stand_in

    for model in extra:
        if model.model_type not in STATE.models:
            npu_autopatch.register(model)
    rows = []
    with stand_in():
        modules = {}
        for model_type, model in STATE.models.items():
            if only is not None and model_type not in only:
                continue
            try:
                modules[model_type] = importlib.import_module(model.module)
            except ImportError:
                continue  # not in this transformers
        npu_autopatch.enable()  # patches every imported module once: warm-up (kernels, golden ops, device)
        for model_type, module in modules.items():
            samples = []
            for _ in range(runs):
                _ledger.release_all(model_type)
                STATE.records.pop(model_type, None)
                _fingerprint.forget()  # nothing remembered: as the first patch of that code in a process
                begin = time.process_time()
                record = _patcher.apply(STATE.models[model_type], module)
                samples.append(time.process_time() - begin)
            rows.append(
                (
                    model_type,
                    min(samples) * 1e3,
                    statistics.median(samples) * 1e3,
                    len(record.targets),
                    record.state.value,
                )
            )
        npu_autopatch.disable()
    return rows


FIRST = """
import time, torch, transformers, transformers.modeling_utils
begin = time.perf_counter()
from transformers.models.qwen3 import modeling_qwen3
print(time.perf_counter() - begin)
"""


def fresh(code, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("NPU_AUTOPATCH")}
    base.update(PYTHONPATH=str(STAND_IN_SITE), **env)
    begin = time.perf_counter()
    run = subprocess.run([sys.executable, *code], env=base, capture_output=True, text=True, check=True)
    return time.perf_counter() - begin, run.stdout


def first_model(runs):
    on, off = [], []
    for _ in range(runs):
        off.append(float(fresh(["-c", FIRST], NPU_AUTOPATCH="0")[1]))
        on.append(float(fresh(["-c", FIRST], NPU_AUTOPATCH="1")[1]))
    return statistics.median(off) * 1e3, statistics.median(on) * 1e3


IMPORT_ALL = """
import importlib
from npu_autopatch.models import MODELS
from npu_autopatch.testing import stand_in
with stand_in():
    for model in MODELS.values():
        try:
            importlib.import_module(model.module)
        except ImportError:
            pass
"""


def check_simulate(runs=3):
    check = [fresh(["-m", "npu_autopatch", "check", "--simulate"])[0] for _ in range(runs)]
    plain = [fresh(["-c", IMPORT_ALL])[0] for _ in range(runs)]
    return statistics.median(check), statistics.median(plain)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--extra", help="a Python file defining a dict of Model to measure too")
    parser.add_argument("--live", action="store_true", help="probe every target: no reused verdicts")
    parser.add_argument("--only-apply", action="store_true", help="measure apply() per model only")
    parser.add_argument("--quick", action="store_true", help="3 models, 2 runs, first model once, no check")
    args = parser.parse_args()
    runs, first_runs = (2, 1) if args.quick else (RUNS, 5)
    if args.live:
        os.environ["NPU_AUTOPATCH_PROBE"] = "always"
    from npu_autopatch.tools.verdicts import extra_models  # the generator's reader of the same file

    rows = per_model(
        extra_models(args.extra) if args.extra else (), runs, QUICK_MODELS if args.quick else None
    )
    how = "every target probed live" if args.live else "verdicts reused by fingerprint where known"
    print(f"apply() per model, warm, CPU time min / median of {runs} (CPU stand-in, {how}):")
    for model_type, best, median, targets, state in rows:
        print(f"  {model_type:<18}{best:7.2f} / {median:5.2f} ms  {targets} targets  {state}")
    worst = max(rows, key=lambda row: row[1])
    over = [row[0] for row in rows if row[1] >= 2.0]
    best = [row[1] for row in rows]
    print(
        f"{len(rows)} models: min {min(best):.2f}, median {statistics.median(best):.2f}, "
        f"max {worst[1]:.2f} ms ({worst[0]}); >= 2 ms: {', '.join(over) or 'none'}"
    )
    if args.only_apply:
        return
    off, on = first_model(first_runs)
    print(
        f"first model of a process (import modeling_qwen3): {off:.0f} ms stock, {on:.0f} ms patched "
        f"(+{on - off:.0f} ms, one-time imports included)"
    )
    if args.quick:
        return
    check, plain = check_simulate()
    print(
        f"python -m npu_autopatch check --simulate: {check:.2f} s "
        f"(importing the same modules unpatched: {plain:.2f} s)"
    )


if __name__ == "__main__":
    main()
