"""Time to patch a model when its modeling module is imported (goal: under 2 ms per model).

1. apply() per model, probes included, once the patcher is warm (median of many runs, the
   model reverted between runs), on the CPU stand-in for torch_npu.
2. The first model of a process: the import of modeling_qwen3 with NPU_AUTOPATCH=1 minus
   without, in fresh interpreters (adds the one-time imports of the patcher, the kernels and
   the golden ops, and the NPU check).
3. ``python -m npu_autopatch check --simulate`` end to end, next to importing the same
   modeling modules without patching.
Run with the venv's python:
    .venv/bin/python benchmarks/patch_time.py
"""

import importlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAND_IN_SITE = Path(__file__).resolve().parents[1] / "tests" / "stand_in_site"
RUNS = 30


def per_model():
    import npu_autopatch
    from npu_autopatch import _ledger, _patcher
    from npu_autopatch._state import STATE
    from npu_autopatch.testing import stand_in

    rows = []
    with stand_in():
        modules = {}
        for model_type, model in STATE.models.items():
            try:
                modules[model_type] = importlib.import_module(model.module)
            except ImportError:
                continue  # not in this transformers
        npu_autopatch.enable()  # patches every imported module once: warm-up (kernels, golden ops, device)
        for model_type, module in modules.items():
            samples = []
            for _ in range(RUNS):
                _ledger.release_all(model_type)
                STATE.records.pop(model_type, None)
                begin = time.perf_counter()
                record = _patcher.apply(STATE.models[model_type], module)
                samples.append(time.perf_counter() - begin)
            median_ms = statistics.median(samples) * 1e3
            rows.append((model_type, median_ms, len(record.targets), record.state.value))
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


def first_model(runs=5):
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
    print(f"apply() per model, warm, median of {RUNS} (CPU stand-in, probes included):")
    for model_type, ms, targets, state in per_model():
        print(f"  {model_type:<14}{ms:7.2f} ms  {targets} targets  {state}")
    off, on = first_model()
    print(
        f"first model of a process (import modeling_qwen3): {off:.0f} ms stock, {on:.0f} ms patched "
        f"(+{on - off:.0f} ms, one-time imports included)"
    )
    check, plain = check_simulate()
    print(
        f"python -m npu_autopatch check --simulate: {check:.2f} s "
        f"(importing the same modules unpatched: {plain:.2f} s)"
    )


if __name__ == "__main__":
    main()
