"""``python -m npu_autopatch status|check|verify|models|scan|report``: what is patched here, and does it hold.

status  the environment and the state of every supported model in this process.
check   enable patching, import every supported modeling module, print the same table;
        exit status 1 if any model failed. ``--simulate`` first installs the CPU stand-in
        for torch_npu (npu_autopatch.testing), so it runs on any machine.
verify  stock vs patched parity on tiny random models, per model (see tools/verify.py).
models  the supported models, kernels and targets as a markdown table (docs/models.md's).
scan    every modeling module of the installed transformers: which code the kernels
        reproduce, and parity of each model type's tiny model (see tools/scan.py).
report  the tiny model of one model type, built on the CPU stand-in with patching enabled
        before transformers is imported (the lazy path): what each module class runs, ours,
        stock or foreign, and the flags (see _report.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys

from . import _control, _device
from ._records import PatchRecord, ReasonCode, State, describe_calls
from ._state import STATE
from ._table import columns
from .models import BUILTIN, MODELS


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(simulated: bool = False) -> dict:
    """Versions from package metadata, and whether torch_npu sees an NPU (imports torch_npu)."""
    npu, reason = _device.probe()
    if npu is not None:
        name = npu.npu.get_device_name(0) if hasattr(npu.npu, "get_device_name") else "npu"
        if simulated:  # the stand-in says which release and device it models
            name = f"{name}; {npu.__doc__.rstrip('.')}"
        device = f"yes ({name})"
    else:
        device = f"no: {reason}"
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "torch_npu": getattr(npu, "__version__", None) if simulated else _version("torch_npu"),
        "npu_visible": device,
        "simulated": simulated,
        "patching_enabled": _control.is_enabled(),
    }


def _import_all() -> dict[str, PatchRecord]:
    """Import every supported modeling module with patching on; note the absent ones."""
    absent = {}
    _control.discover_plugins()  # installed plugins are checked too
    for model_type, model in list(STATE.models.items()):
        if model.family:
            continue  # another library's module, found by what it defines: never imported by us
        try:
            importlib.import_module(model.module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and model.module.startswith(exc.name):
                version = _version("transformers")
                absent[model_type] = PatchRecord(
                    model_type,
                    model.module,
                    State.ABSENT,
                    f"not present in transformers {version}",
                    code=ReasonCode.MODULE_ABSENT,
                )
            else:
                absent[model_type] = _import_failed(model, exc)
        except Exception as exc:  # strict mode's PatchError, or a broken modeling module
            absent[model_type] = _import_failed(model, exc)
    report = _control.status()
    report.update(absent)
    return report


def _import_failed(model, exc) -> PatchRecord:
    code = ReasonCode.INTERNAL_ERROR if type(exc).__name__ != "PatchError" else ReasonCode.IMPORT_FAILED
    return PatchRecord(model.model_type, model.module, State.FAILED, f"import failed: {exc!r}", code=code)


def format_table(report: dict[str, PatchRecord]) -> str:
    """One row per model, then one row per target it left stock, with that target's code and why,
    and one per target whose replacement ran, with how its calls went."""
    rows = [("model", "state", "code", "kernels", "reason")]
    for r in report.values():
        about_model = "; ".join(part for part in (r.cause, *r.notes) if part)
        code = r.code.value if r.code else "-"
        rows.append((r.model, r.state.value, code, ",".join(r.kernels) or "-", about_model))
        rows += [("", "", reason.code.value, "", reason.text) for reason in r.stock_reasons.values()]
        called = {where: c for where, c in r.calls.items() if c["fused"] or c["stock"]}
        rows += [("", "", "calls", "", f"{where}: {describe_calls(c)}") for where, c in called.items()]
    return columns(rows)


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def models_markdown() -> str:
    """The supported-models table of docs/models.md, generated from the model table."""
    lines = [
        "| model type | kernels | targets (`a` / `b`: whichever the installed version has) | transformers |",
        "|---|---|---|---|",
    ]
    for model in (MODELS[name] for name in BUILTIN):
        targets = "<br>".join(
            f"{t.kernel_name}: {' / '.join(f'`{path}`' for path in t.paths)}"
            + (f" (from {t.since})" if t.since and _release(t.since) > _release(model.since) else "")
            for t in model.targets
        )
        lines.append(f"| {model.model_type} | {', '.join(model.kernels)} | {targets} | >= {model.since} |")
    return "\n".join(lines)


def _print(env: dict, report: dict[str, PatchRecord], as_json: bool) -> None:
    if as_json:
        print(
            json.dumps({"environment": env, "models": {k: r.as_dict() for k, r in report.items()}}, indent=2)
        )
        return
    for key, value in env.items():
        print(f"{key + ':':<18}{value}")
    print()
    print(format_table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npu_autopatch", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    status_cmd = commands.add_parser("status", help="environment and per-model state in this process")
    status_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    check_cmd = commands.add_parser("check", help="import every supported model with patching on")
    check_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    check_cmd.add_argument("--simulate", action="store_true", help="use the CPU stand-in for torch_npu")
    commands.add_parser("models", help="the supported models as a markdown table")
    verify_cmd = commands.add_parser("verify", help="parity of patched vs stock on tiny models, per model")
    verify_cmd.add_argument("--device", choices=("npu", "cpu"), default="npu")
    verify_cmd.add_argument("--models", help="comma list of model types (default: every supported model)")
    verify_cmd.add_argument("--dtype", default="float32,bfloat16", help="comma list: float32,bfloat16")
    verify_cmd.add_argument(
        "--json", action="store_true", help="the report and environment, for a bug report"
    )
    verify_cmd.add_argument(
        "--simulate",
        nargs="?",
        const=True,
        metavar="PROFILE",
        help="use the CPU stand-in (with --device cpu); PROFILE: the torch_npu release it models "
        "(a2-newest, the default; a2-2.7.1; a2-2.6.0; 950-newest)",
    )
    commands.add_parser("scan", help="what the kernels reproduce in the installed transformers (scan --help)")
    report_cmd = commands.add_parser("report", help="what each module of a model type's tiny model runs")
    report_cmd.add_argument("--model-type", required=True, help="e.g. qwen3, qwen3_vl, qwen3_moe")
    report_cmd.add_argument(
        "--profile",
        default=None,
        help="the stand-in's torch_npu release and device: a2-newest (default), a2-2.7.1, a2-2.6.0, "
        "950-newest",
    )
    report_cmd.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    report_cmd.add_argument("--no-patch", action="store_true", help="build the model with patching off")
    report_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    report_cmd.add_argument("--markdown", action="store_true", help="markdown tables")
    argv = sys.argv[1:] if argv is None else argv
    missing = _missing_packages(argv)
    if missing:
        print(
            f"python -m npu_autopatch {argv[0]} needs {' and '.join(missing)} installed "
            "(npu-autopatch itself depends on wrapt only): install the torch and transformers your jobs use",
            file=sys.stderr,
        )
        return 2
    if argv[:1] == ["scan"]:  # its own parser and options
        from .tools import scan

        return scan.main(argv[1:])
    args = parser.parse_args(argv)

    if args.command == "verify":
        from .tools import verify

        return verify.main(args)

    if args.command == "report":
        return _report_command(args)

    if args.command == "models":
        print(models_markdown())
        return 0

    if args.command == "status":
        _control.discover_plugins()  # so that installed plugins are listed before they are imported
        _print(environment(), _control.status(), args.json)
        return 0

    if args.simulate:
        from .testing import stand_in

        with stand_in():
            _control.enable()
            report = _import_all()
            env = environment(simulated=True)
    else:
        _control.enable()
        report = _import_all()
        env = environment()
    _print(env, report, args.json)
    return 1 if any(r.state == State.FAILED for r in report.values()) else 0


def _missing_packages(argv: list[str]) -> list[str]:
    """torch and transformers, where the command builds or scans models and they are not installed.

    ``status``, ``models`` and ``check`` on a node report what is there without them; the commands
    that run the stand-in or the installed transformers' code would end in a traceback instead of
    this one line.
    """
    simulated = "--simulate" in argv or any(arg.startswith("--simulate=") for arg in argv)
    if not (argv[:1] in (["scan"], ["report"]) or simulated):
        return []
    return [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]


def _report_command(args) -> int:
    """Build the tiny model on the CPU stand-in, patching enabled before transformers is imported."""
    import torch

    from ._report import report
    from .testing import stand_in

    with stand_in(profile=args.profile) as npu:
        lazy = "transformers" not in sys.modules
        if not args.no_patch:
            _control.enable()
        from .testing import tiny  # transformers is imported here, after enable(): the lazy path

        model = tiny.tiny_model(args.model_type, dtype=getattr(torch, args.dtype))
        coverage = report(model)
    if args.json:
        env = {"profile": npu.PROFILE.name, "torch_npu": npu.__version__, "dtype": args.dtype}
        env["transformers"] = _version("transformers")
        env["patching_enabled"] = not args.no_patch
        env["enabled_before_transformers_import"] = lazy and not args.no_patch
        print(json.dumps({"environment": env, **coverage.as_dict()}, indent=2))
    else:
        print(coverage.markdown() if args.markdown else coverage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
