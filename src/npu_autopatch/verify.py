"""``python -m npu_autopatch verify``: the parity suite, runnable on a real NPU in one command.

Our tests prove parity against a CPU stand-in written from the torch_npu documentation;
only a machine with an Ascend device can prove it against the real kernels. This runs the
very same check as the project's parity tests (``testing.parity.check_parity``) for every
supported model present in the installed transformers: a tiny random model, forward and
backward stock, then patched on the same weights and inputs, then unpatched again.

It counts the torch_npu ops that ran by wrapping the op attributes of the torch_npu module
for the duration of a run (our kernels look them up at call time), so the count works for
the real module and the stand-in alike; the wrappers are removed afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import platform
import sys
from collections import Counter

from . import _control, _device
from ._table import columns
from .models import MODELS

DTYPES = ("float32", "bfloat16")


@contextlib.contextmanager
def counting_ops(npu):
    """Count calls of every ``npu_*`` op of the torch_npu module while the block runs."""
    calls = Counter()
    originals = {name: getattr(npu, name) for name in dir(npu) if name.startswith("npu_")}

    def counted(name, op):
        def call(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)

        return call

    for name, op in originals.items():
        setattr(npu, name, counted(name, op))
    try:
        yield calls
    finally:
        for name, op in originals.items():
            setattr(npu, name, op)


def present(model_type: str) -> bool:
    """Whether the installed transformers has this model's modeling module."""
    try:
        importlib.import_module(MODELS[model_type].module)
    except ModuleNotFoundError:
        return False
    return True


def environment(npu, device: str, simulated: bool) -> dict:
    """What a bug report needs: versions, CANN where torch_npu exposes it, the device."""

    def version(distribution):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    npu_version = getattr(npu, "version", None)
    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "torch_npu": getattr(npu, "__version__", None) if simulated else version("torch_npu"),
        "cann": getattr(npu_version, "cann", None),
        "device": device,
        "device_name": npu.npu.get_device_name(0) if device == "npu" or simulated else platform.processor(),
        "simulated": simulated,
    }


def run(models, dtypes, device: str, npu, simulated: bool) -> dict:
    """Verify each model in each dtype; leave patching exactly as it was found."""
    import torch

    from .testing.parity import check_parity

    was_enabled = _control.is_enabled()
    results = []
    try:
        for model_type in models:
            if not present(model_type):
                results.append({"model": model_type, "status": "not present"})
                continue
            for dtype_name in dtypes:
                try:
                    with counting_ops(npu) as calls:
                        report = check_parity(model_type, getattr(torch, dtype_name), device=device)
                except Exception as exc:  # one model's crash is that model's failure, not the run's
                    results.append(_crashed(model_type, dtype_name, exc))
                    continue
                results.append(
                    {
                        "model": model_type,
                        "dtype": dtype_name,
                        "status": "pass" if report.passed else "FAIL",
                        "state": report.state,
                        "reason": report.reason,
                        "kernels": list(report.kernels),
                        "ops_called": dict(sorted(calls.items())),
                        "logits_error": report.logits_error,
                        "grad_error": report.grad_error,
                        "worst_tensor": report.worst_tensor,
                        "missing_grads": list(report.missing_grads),
                        "tolerance": report.tolerance,
                        "stock_seconds": report.stock_seconds,
                        "patched_seconds": report.patched_seconds,
                    }
                )
    finally:
        if was_enabled:
            _control.enable()
    return {
        "environment": environment(npu, device, simulated),
        "results": results,
        "passed": all(r["status"] in ("pass", "not present") for r in results),
    }


def _crashed(model_type, dtype_name, exc):
    return {
        "model": model_type,
        "dtype": dtype_name,
        "status": "FAIL",
        "state": "error",
        "reason": f"{type(exc).__name__}: {exc}",
        "kernels": [],
        "ops_called": {},
        "logits_error": float("nan"),
        "grad_error": float("nan"),
        "worst_tensor": "",
        "missing_grads": [],
        "tolerance": 0.0,
        "stock_seconds": float("nan"),
        "patched_seconds": float("nan"),
    }


def why(result: dict) -> str:
    if result["state"] != "applied":
        return f"{result['state']}: {result['reason']}"
    if result["missing_grads"]:
        return f"no gradient reached {', '.join(result['missing_grads'][:3])}"
    worst = max(result["logits_error"], result["grad_error"])
    tensor = "logits" if result["logits_error"] >= result["grad_error"] else result["worst_tensor"]
    return f"{tensor}: error {worst:.1e} > {result['tolerance']:.0e}" if worst > result["tolerance"] else ""


def format_report(report: dict) -> str:
    rows = [("model", "dtype", "result", "logits err", "grad err", "stock s", "patched s", "kernels / why")]
    for r in report["results"]:
        if r["status"] == "not present":
            rows.append((r["model"], "-", "not present", "", "", "", "", ""))
            continue
        rows.append(
            (
                r["model"],
                r["dtype"],
                r["status"],
                f"{r['logits_error']:.1e}",
                f"{r['grad_error']:.1e}",
                f"{r['stock_seconds']:.3f}",
                f"{r['patched_seconds']:.3f}",
                why(r) or ",".join(r["kernels"]),
            )
        )
    env = report["environment"]
    failed = [f"{r['model']}/{r['dtype']}" for r in report["results"] if r["status"] == "FAIL"]
    verdict = (
        f"VERIFIED: patched matches stock for every model on {env['device']} ({env['device_name']})"
        if report["passed"]
        else f"FAILED: {', '.join(failed)} -- please attach `verify --json` output to a bug report"
    )
    return columns(rows) + "\n\n" + verdict


def main(args) -> int:
    """The ``verify`` subcommand (arguments parsed in __main__)."""
    from ._plugins import discover

    discover()  # installed plugins are verified too
    models = args.models.split(",") if args.models else list(MODELS)
    unknown = [m for m in models if m not in MODELS]
    dtypes = args.dtype.split(",")
    bad_dtypes = [d for d in dtypes if d not in DTYPES]
    if unknown or bad_dtypes:
        print(
            f"unknown models {unknown} or dtypes {bad_dtypes}; models: {', '.join(MODELS)}", file=sys.stderr
        )
        return 2
    if args.simulate:
        if args.device != "cpu":
            print("--simulate runs on the CPU stand-in: use --device cpu", file=sys.stderr)
            return 2
        from .testing import stand_in

        with stand_in() as npu:
            report = run(models, dtypes, "cpu", npu, simulated=True)
    elif args.device != "npu":
        print("the NPU kernels run on --device npu; --device cpu needs --simulate", file=sys.stderr)
        return 2
    else:
        npu, reason = _device.probe()
        if npu is None:
            print(f"cannot verify: {reason}; try --device cpu --simulate", file=sys.stderr)
            return 2
        report = run(models, dtypes, args.device, npu, simulated=False)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["passed"] else 1
