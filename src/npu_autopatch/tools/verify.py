"""``python -m npu_autopatch verify``: the parity suite and the rotary shape sweep, on a real NPU.

Our tests prove parity against a CPU stand-in that models the device from its sources; only a
machine with an Ascend device can prove it against the real kernels. This runs the very same
checks as the project's tests: for every supported model present in the installed transformers,
``testing.parity.check_parity`` (a tiny random model, forward and backward stock, then patched on
the same weights and inputs, then unpatched again), and ``testing.rope_sweep`` (every patched
rotary function on the shapes training feeds it, forward and backward), where a shape rule of the
kernel that nobody knew shows up as a failing case. The report also states the decisions taken for
this torch_npu: the op-plugin branch its version maps to, the kernels (and variants) gated and why,
and the rotary layouts the kernels use.

It counts the torch_npu ops that ran by wrapping the op attributes of the torch_npu module
for the duration of a run (our kernels look them up at call time), so the count works for
the real module and the stand-in alike; the wrappers are removed afterwards. Patching is off
while it runs; afterwards the user's selection is enabled again, exactly (``_control.restore``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import json
import platform
import sys
from collections import Counter

from .. import _control, _device
from .._records import PatchError
from .._state import STATE
from .._table import columns
from ..models import INTEGRATIONS
from . import UsageError, known

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
        importlib.import_module(STATE.models[model_type].module)
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
    device_name = npu.npu.get_device_name(0) if device == "npu" or simulated else platform.processor()
    if simulated:  # the SoC name the stand-in answers, and the release and device it models
        device_name = f"{device_name}; {npu.__doc__.rstrip('.')}"
    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "torch_npu": getattr(npu, "__version__", None) if simulated else version("torch_npu"),
        "cann": getattr(npu_version, "cann", None),
        "device": device,
        "device_name": device_name,
        "simulated": simulated,
    }


def decisions(npu) -> dict:
    """What this torch_npu gets: its op-plugin branch, the kernels and variants gated (and why), the
    rotary layouts."""
    from ..kernels import KERNELS
    from ..kernels._requirements import op_plugin_branch
    from ..kernels.rope import LAYOUTS

    version = getattr(npu, "__version__", None)
    gated = {}
    for name, kernel in KERNELS.items():
        if kernel.requires and (reason := kernel.requires(npu)):
            gated[name] = reason
        for variant in kernel.variants:
            if variant.requires and (reason := variant.requires(npu)):
                gated[f"{name}/{variant.name}"] = reason
    return {
        "torch_npu": version,
        "op_plugin": op_plugin_branch(version) or "unknown (version unreadable)",
        "gated": gated,
        "rotary_layouts": LAYOUTS,
    }


def sweep_report(npu, dtypes, device: str, models) -> dict:
    """The rotary shape sweep (testing.rope_sweep) of the models' rotary functions: every case, and
    whether all passed."""
    import torch

    from ..testing.rope_sweep import sweep

    with counting_ops(npu) as calls:
        torch_dtypes = tuple(getattr(torch, d) for d in dtypes)
        cases = sweep(npu, torch_dtypes, device=device, calls=calls, models=models)
    rows = [
        {
            "function": c.function,
            "models": list(c.models),
            "variant": c.variant,
            "shape": c.shape,
            "dtype": c.dtype,
            "status": "skipped" if "skipped" in c.extra else "pass" if c.passed else "FAIL",
            "fused_calls": c.fused_calls,
            "fused_expected": c.fused_expected,
            "max_error": c.max_error,
            "error": c.error or c.extra.get("skipped"),
        }
        for c in cases
    ]
    return {"cases": rows, "passed": all(r["status"] != "FAIL" for r in rows)}


# (case name, causal, window W or None, with sinks): what transformers passes, W = 3 shorter than S = 7.
ATTENTION_CASES = (
    ("causal", True, None, False),
    ("window 3, causal", True, 3, False),
    ("window 3", False, 3, False),
    ("full", False, None, False),
    ("window 3, causal, sinks", True, 3, True),
    ("causal, sinks", True, None, True),
)


def attention_report(npu, dtypes, device: str) -> dict:
    """transformers' Ascend flash-attention functions as the attention kernel builds them for this
    torch_npu, on the device, against eager attention in fp32 on the CPU: a causal batch, sliding
    windows, sinks; BSND (``npu_flash_attn_func``) and TND (the varlen one, two sequences of 7). A case
    passes when it matches and the fused op ran (for sinks: where this torch_npu has ``sink``) without
    raising."""
    import math

    import torch

    from ..kernels import KERNELS
    from ..kernels._requirements import sink_requirement
    from ..kernels.attention import _fused as kernel
    from ..testing.parity import TOLERANCE

    try:
        integration = importlib.import_module("transformers.integrations.npu_flash_attention")
    except Exception as exc:  # transformers without the Ascend integration
        return {"cases": [], "passed": False, "error": f"{type(exc).__name__}: {exc}"}
    fused_sinks = sink_requirement(npu) is None
    names = ("dense", "varlen") if fused_sinks else ("dense_unfused_sinks", "varlen_unfused_sinks")
    variants = {v.name: v for v in KERNELS["attention"].variants}
    functions = {
        "npu_flash_attn_func": (variants[names[0]], integration.npu_flash_attn_func),
        "npu_flash_attn_varlen_func": (variants[names[1]], integration.npu_flash_attn_varlen_func),
    }
    q, k, v, sink = kernel._probe_inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        on = [t.to(device=device, dtype=dtype) for t in (q, k, v)]
        for function, (variant, stock) in functions.items():
            for case, causal, window, sunk in ATTENTION_CASES:
                raised = []
                built = variant.build(inspect.unwrap(stock), npu, _recorder(raised))
                expected = kernel._eager(q, k, v, scale, causal, window, sink if sunk else None)
                kwargs = {
                    "softmax_scale": scale,
                    "causal": causal,
                    "window_size": kernel._window_size(window),
                }
                kwargs["s_aux"] = sink.to(device) if sunk else None
                with counting_ops(npu) as calls:
                    try:
                        if function == "npu_flash_attn_func":
                            got = built(*on, **kwargs)
                        else:
                            cu = torch.tensor([0, 7, 14], dtype=torch.int32, device=device)
                            flat = [t.flatten(0, 1) for t in on]
                            got = built(*flat, cu, cu, 7, 7, **kwargs).view(expected.shape)
                        error = _relative(got.float().cpu(), expected)
                    except Exception as exc:
                        raised.append(exc)
                        error = float("nan")
                fused_expected = fused_sinks or not sunk
                fused = calls["npu_fusion_attention"]
                passed = not raised and error <= TOLERANCE[dtype] and (fused > 0) == fused_expected
                rows.append(
                    {
                        "function": function,
                        "case": case,
                        "dtype": dtype_name,
                        "variant": variant.name,
                        "status": "pass" if passed else "FAIL",
                        "fused_calls": fused,
                        "fused_expected": fused_expected,
                        "max_error": error,
                        "error": f"{type(raised[0]).__name__}: {raised[0]}" if raised else None,
                    }
                )
    return {"cases": rows, "passed": all(r["status"] == "pass" for r in rows)}


def _recorder(raised: list):
    """An on_error that keeps what the fused op raised: a finding of verify, not a silent fallback."""
    return lambda exc, *tensors: raised.append(exc)


def _relative(got, expected) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def run(models, dtypes, device: str, npu, simulated: bool, sweep: bool = True) -> dict:
    """Verify each model in each dtype, then sweep the rotary functions; patching is left off (main()
    puts the user's selection back)."""
    import torch

    from ..testing.parity import check_parity

    chosen = decisions(npu)
    results = []
    for model_type in models:
        if not present(model_type):
            results.append({"model": model_type, "status": "not present"})
            continue
        for dtype_name in dtypes:
            try:
                with counting_ops(npu) as calls:
                    # The patcher gates what this torch_npu cannot run: such a model is
                    # partial (kernel-unsupported), and passes if the rest matches stock.
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
                    "code": report.code,
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
    rope_sweep = sweep_report(npu, dtypes, device, models) if sweep else None
    attention = attention_report(npu, dtypes, device)
    return {
        "environment": environment(npu, device, simulated),
        "decisions": chosen,
        "results": results,
        "rope_sweep": rope_sweep,
        "attention": attention,
        "passed": all(r["status"] in ("pass", "not present") for r in results)
        and (rope_sweep is None or rope_sweep["passed"])
        and attention["passed"],
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
    lines = [columns(rows), "", *_decision_lines(report["decisions"])]
    if report["rope_sweep"] is not None:
        lines += _sweep_lines(report["rope_sweep"])
        failed += [
            f"rope sweep: {r['variant']} {r['shape']} {r['dtype']}"
            for r in report["rope_sweep"]["cases"]
            if r["status"] == "FAIL"
        ]
    lines += _attention_lines(report["attention"])
    failed += [
        f"attention: {r['function']} {r['case']} {r['dtype']}" for r in _failed(report["attention"]["cases"])
    ]
    verdict = (
        f"VERIFIED: patched matches stock for every model on {env['device']} ({env['device_name']})"
        if report["passed"]
        else f"FAILED: {', '.join(failed)} -- please attach `verify --json` output to a bug report"
    )
    return "\n".join([*lines, "", verdict])


def _decision_lines(chosen: dict) -> list[str]:
    lines = [f"torch_npu {chosen['torch_npu']}: op-plugin {chosen['op_plugin']}"]
    if not chosen["gated"]:
        lines.append("gated: nothing (every kernel can run on this torch_npu)")
    lines += [f"gated: {name}: {reason}" for name, reason in chosen["gated"].items()]
    lines += [f"rotary layout {name}: {text}" for name, text in chosen["rotary_layouts"].items()]
    return lines


def _sweep_lines(rope_sweep: dict) -> list[str]:
    cases = rope_sweep["cases"]
    ran = [c for c in cases if c["status"] != "skipped"]
    fused = sum(1 for c in ran if c["fused_calls"])
    passed = len(ran) - len(_failed(cases))
    lines = [f"rotary shape sweep: {len(ran)} cases, {passed} pass, the fused op ran in {fused}"]
    for c in _failed(cases):
        why = c["error"] or ("no fused op ran" if c["fused_expected"] else "the fused op ran, not stock")
        lines.append(f"  FAIL {c['variant']} {c['shape']} {c['dtype']} ({', '.join(c['models'])}): {why}")
    skipped = [c for c in cases if c["status"] == "skipped"]
    lines += [f"  skipped {c['variant']} ({', '.join(c['models'])}): {c['error']}" for c in skipped]
    return lines


def _attention_lines(attention: dict) -> list[str]:
    if "error" in attention:
        return [f"attention cases: not run: {attention['error']}"]
    cases = attention["cases"]
    fused = sum(1 for c in cases if c["fused_calls"])
    variants = ", ".join(sorted({c["variant"] for c in cases}))
    passed = len(cases) - len(_failed(cases))
    lines = [f"attention (FA2 on the NPU, {variants}): {len(cases)} cases, {passed} pass, fused in {fused}"]
    for c in _failed(cases):
        why = c["error"] or f"error {c['max_error']:.1e}, fused calls {c['fused_calls']}"
        lines.append(f"  FAIL {c['function']} {c['case']} {c['dtype']}: {why}")
    return lines


def _failed(cases: list[dict]) -> list[dict]:
    return [c for c in cases if c["status"] == "FAIL"]


def verifiable() -> list[str]:
    """The model types verify can check: the registry's models (the table's and the installed
    plugins'), not the integrations (transformers' Ascend attention module, the default attention's
    routing, verl's step-aside), which no tiny model of theirs proves."""
    _control.discover_plugins()  # installed plugins are verified too
    return [m for m in STATE.models if m not in INTEGRATIONS]


def main(args) -> int:
    """The ``verify`` subcommand (arguments parsed in __main__)."""
    models = verifiable()
    if args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        for name in names:
            if name in INTEGRATIONS:
                raise UsageError(
                    f"{name} is not verifiable: it is an integration, no model of its own (verify the "
                    "models it serves)"
                )
        models = known(names, models, "model")
    dtypes = known([d.strip() for d in args.dtype.split(",")], DTYPES, "dtype")
    device = args.device or ("cpu" if args.simulate else "npu")
    if args.simulate:
        from ..testing import PROFILES, stand_in

        if device != "cpu":
            raise UsageError("--simulate runs on the CPU stand-in: leave out --device npu")
        profile = None if args.simulate is True else args.simulate
        if profile is not None:
            known([profile], PROFILES, "stand-in profile")
        provider = stand_in(profile=profile)
    elif device != "npu":
        raise UsageError("the NPU kernels run on --device npu; --device cpu needs --simulate")
    else:
        npu, reason = _device.probe()
        if npu is None:
            raise UsageError(f"cannot verify: {reason}; try --simulate (the CPU stand-in)")
        provider = contextlib.nullcontext(npu)
    selection = _control.selection()
    try:
        with provider as npu:
            report = run(models, dtypes, device, npu, simulated=bool(args.simulate))
    finally:  # after the stand-in is gone: the selection is the user's, on their torch_npu
        _restore(selection)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def _restore(selection) -> None:
    """Put the user's selection back; under strict mode its failure here is a note, not the result.

    A strict selection re-applied on a node that cannot patch (no torch_npu, with ``--simulate``)
    raises PatchError. That is what the user's own imports would raise, not what verify measured:
    the report it computed is still printed (and ``--json`` stays parseable), the error goes to
    stderr. Strict's errors are for the import that triggered a patch or for enable().
    """
    try:
        _control.restore(selection)
    except PatchError as exc:
        print(f"note: your strict selection, put back after verify, raised: {exc}", file=sys.stderr)
