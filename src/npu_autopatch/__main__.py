"""``python -m npu_autopatch status|check|verify|models|scan|report``: what is patched here, and does it hold.

Also installed as the ``npu-autopatch`` command (pyproject's ``[project.scripts]``).

status  the environment and the state of every supported model in this process.
check   enable patching, import every supported modeling module, print the same table;
        exit status 1 if any model failed, 2 if the environment's selection has a mistake
        (an unknown name, nothing selected) or torch or transformers is missing: a node
        that would train unpatched does not pass. ``--simulate`` first installs the CPU
        stand-in for torch_npu (npu_autopatch.testing), so it runs on any machine.
verify  stock vs patched parity on tiny random models, per model (see tools/verify.py).
models  the supported models, kernels and targets as a markdown table (docs/models.md's).
scan    every modeling module of the installed transformers: which code the kernels
        reproduce, and parity of each model type's tiny model (see tools/scan.py).
report  the tiny model of one model type, built on the CPU stand-in with patching enabled
        before transformers is imported (the lazy path): what each module class runs, ours,
        stock or foreign, and the flags (see _report.py).

Bad input to any command (tools.UsageError, argparse's errors included) is one line on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys

from . import _control, _device
from ._records import PatchRecord, ReasonCode, State, describe_calls
from ._state import STATE
from ._table import columns
from .models import BUILTIN, MODELS
from .testing import DEFAULT, PROFILES
from .tools import Parser, UsageError, known


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


PROG = "python -m npu_autopatch"
COMMANDS = ("status", "check", "models", "verify", "scan", "report")


def _parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="What npu-autopatch patches here, and whether it holds (also installed as the "
        "npu-autopatch command). Each command's --help says more.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, about: str, description: str) -> Parser:
        return commands.add_parser(name, help=about, description=description)

    status_cmd = command(
        "status",
        "environment and per-model state in this process",
        "The environment and the state of every supported model in this process: with NPU_AUTOPATCH=1 "
        "every model reads pending until its modeling module is imported.",
    )
    status_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    check_cmd = command(
        "check",
        "import every supported model with patching on",
        "Turn patching on with the selection in the environment (NPU_AUTOPATCH_*), import every "
        "supported modeling module and print the environment and one row per model. Exit status 1 if "
        "a model failed; 2 if the selection names unknown models or kernels or patches no model, or "
        "torch or transformers is missing.",
    )
    check_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    check_cmd.add_argument("--simulate", action="store_true", help="use the CPU stand-in for torch_npu")
    command(
        "models",
        "the supported models as a markdown table",
        "The supported models, their kernels and targets as a markdown table (docs/models.md's).",
    )
    verify_cmd = command(
        "verify",
        "parity of patched vs stock on tiny models, per model",
        "Stock vs patched on a tiny random model of each supported model (logits and every gradient, "
        "float32 and bfloat16), the rotary shape sweep and the flash-attention cases, on the NPU (or "
        "with --simulate on the CPU stand-in). Exit status 1 on a mismatch.",
    )
    verify_cmd.add_argument(
        "--device", choices=("npu", "cpu"), help="npu, or cpu with --simulate (its default)"
    )
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
        help="use the CPU stand-in (implies --device cpu); PROFILE: the torch_npu release it models "
        f"({', '.join(PROFILES)}; default {DEFAULT.name})",
    )
    command(
        "scan",
        "what the kernels reproduce in the installed transformers (scan --help)",
        "Which code of every modeling module of the installed transformers the kernels reproduce.",
    )
    report_cmd = command(
        "report",
        "what each module of a model type's tiny model runs, on the CPU stand-in",
        "Build a tiny random model of one model type on the CPU stand-in for torch_npu (no NPU is used "
        "or needed), patching enabled before transformers is imported, and say what each module class "
        "runs: ours, stock or foreign, with the flags. For your own model on the NPU, call "
        "npu_autopatch.report(model) in your job.",
    )
    report_cmd.add_argument("--model-type", required=True, help="e.g. qwen3, qwen3_vl, qwen3_moe")
    report_cmd.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default=None,
        help=f"the torch_npu release and device the stand-in models (default {DEFAULT.name})",
    )
    report_cmd.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    report_cmd.add_argument("--no-patch", action="store_true", help="build the model with patching off")
    report_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    report_cmd.add_argument("--markdown", action="store_true", help="markdown tables")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; its exit status. Bad input is one line on stderr and exit status 2, never a
    traceback; a reader that stops early (``models | head``) ends it quietly."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        status = _main(argv)
        sys.stdout.flush()  # a reader gone shows here, not as a traceback at exit
        return status
    except UsageError as exc:
        where = f"{PROG} {argv[0]}" if argv and argv[0] in COMMANDS else PROG
        for line in str(exc).splitlines():
            print(f"{where}: {line}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader closed the pipe: what is left of stdout goes nowhere (Python's own recipe), the
        # exit status says the output was cut.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    missing = _missing_packages(argv)
    if missing:
        raise UsageError(
            f"needs {' and '.join(missing)} installed (npu-autopatch itself depends on wrapt only): "
            "install the torch and transformers your jobs use"
        )
    if argv[:1] == ["scan"]:  # its own parser and options
        from .tools import scan

        return scan.main(argv[1:])
    args = _parser().parse_args(argv)

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

    mistakes = _control.selection_mistakes()
    if mistakes:  # a job would warn and patch less (or nothing): the check fails
        raise UsageError("\n".join(f"configuration error: {line}" for line in mistakes))
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
    """torch and transformers, where the command needs them and they are not installed.

    ``status`` and ``models`` report what is there without them; ``check`` without them would list
    every model absent and pass, a broken node looking fine; ``scan``, ``report`` and ``verify``
    would end in a traceback instead of this one line. ``--help`` answers anyway.
    """
    if not argv or argv[0] not in ("check", "scan", "report", "verify") or {"-h", "--help"} & set(argv):
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
        # transformers is imported here, after enable(): the lazy path
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        from .testing import tiny

        known(
            [args.model_type],
            CONFIG_MAPPING_NAMES,
            f"model type of transformers {_version('transformers')}",
            listed=False,
        )
        try:
            model = tiny.tiny_model(args.model_type, dtype=getattr(torch, args.dtype))
        except tiny.TinyModelError as exc:
            raise UsageError(f"no tiny model of {args.model_type}: {exc}") from None
        coverage = report(model)
    if args.json:
        env = {"profile": npu.PROFILE.name, "torch_npu": npu.__version__, "dtype": args.dtype}
        env["transformers"] = _version("transformers")
        env["patching_enabled"] = not args.no_patch
        env["enabled_before_transformers_import"] = lazy and not args.no_patch
        print(json.dumps({"environment": env, **coverage.as_dict()}, indent=2))
        return 0
    patching = "off" if args.no_patch else "on"
    print(
        f"A tiny random {args.model_type} ({args.dtype}, patching {patching}) on the "
        f"{npu.__doc__.rstrip('.')}, transformers {_version('transformers')}: not your NPU "
        "(npu_autopatch.report(model) in your job reads your model there)."
    )
    print()
    print(coverage.markdown() if args.markdown else coverage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
