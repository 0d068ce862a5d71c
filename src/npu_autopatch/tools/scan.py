"""``python -m npu_autopatch scan``: which code of the installed transformers our kernels reproduce.

For every modeling module of the installed transformers (``transformers/models/*/modeling_*.py``,
found from the package directory), the scan imports it, finds the candidate targets by name
(``*RMSNorm*`` classes, ``*MLP``/``*FeedForward`` classes, ``apply_*rotary*`` functions,
``*Experts``/``*SparseMoeBlock``/``*MoE`` classes and their ``moe`` method) and asks the
built-in kernels' probes whether they reproduce each one (``kernels.choose_variant``: the
same check the patcher runs before every swap). Then, for each model type of that module,
it builds the tiny random model and compares it stock and with the confirmed targets patched,
on the CPU stand-in for torch_npu: logits and every gradient, fp32 and bf16, with the fused ops
counted and the targets that really ran counted too. The model, its batch, the training step
and the comparison are ``testing.parity``'s, as in the tests and ``verify``.

It is a command-line tool: it imports every modeling module, which a library must never do
on the user's behalf, so nothing in the library imports this module. The modules are
scanned in child processes, a few package directories each, so that one module that crashes
or hangs costs one batch, and memory stays flat.

``main(argv)`` is the command (``python -m npu_autopatch scan [--json]``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from .._candidates import Candidate, candidates, modeling_modules, probe
from . import Parser, known

DTYPES = ("float32", "bfloat16")
_BATCH_DIRS = 12  # package directories per child process
_CHILD_TIMEOUT = 900


@dataclass
class ModuleScan:
    module: str
    import_error: str | None = None
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def confirmed(self) -> list[Candidate]:
        return [c for c in self.candidates if c.kernel is not None]


@dataclass
class Parity:
    """Stock vs patched for one model type and dtype, on the CPU stand-in."""

    dtype: str
    passed: bool
    state: str = ""
    reason: str | None = None
    logits_error: float | None = None
    grad_error: float | None = None
    worst_tensor: str = ""
    missing_grads: list[str] = field(default_factory=list)
    # bf16 tensors beyond tolerance where patched is as close to the fp32 result as stock is
    rounding: list[str] = field(default_factory=list)
    other_batches: list[bool] = field(default_factory=list)  # bf16 borderline: the other batches
    forward_ops: dict[str, int] = field(default_factory=dict)  # fused-op calls in one forward
    backward_ops: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


@dataclass
class ModelScan:
    model_type: str
    module: str | None = None
    model_class: str | None = None
    targets: list[str] = field(default_factory=list)  # "kernel:path" confirmed in its module
    # target path -> [calls in one patched forward, torch_npu op calls inside them]
    ran: dict[str, list[int]] = field(default_factory=dict)
    parity: list[Parity] = field(default_factory=list)
    error: str | None = None  # why the tiny model could not be built or run

    @property
    def passed(self) -> bool:
        return bool(self.parity) and all(p.passed for p in self.parity)


@dataclass
class ScanResult:
    transformers: str
    modules: list[ModuleScan]
    models: list[ModelScan]
    seconds: float = 0.0
    dtypes: tuple[str, ...] = DTYPES
    errors: dict[str, str] = field(default_factory=dict)  # directory -> why its scan died

    def as_dict(self) -> dict:
        return {
            "transformers": self.transformers,
            "seconds": self.seconds,
            "dtypes": list(self.dtypes),
            "summary": summary(self),
            "modules": [asdict(m) for m in self.modules],
            "models": [asdict(m) for m in self.models],
            "errors": self.errors,
        }


def scan_module(name: str) -> tuple[ModuleScan, object]:
    """(what the scan found in module ``name``, the module or None)."""
    import importlib

    result = ModuleScan(name)
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # an optional dependency missing, or a broken module
        if isinstance(exc, KeyboardInterrupt):
            raise
        result.import_error = f"{type(exc).__name__}: {_short(exc)}"
        return result, None
    result.candidates = [probe(module, c) for c in candidates(module)]
    return result, module


# --- parity of a model type ----------------------------------------------------------------------


def model_types_of(folder: str) -> list[str]:
    """The model types whose config class lives in ``transformers/models/<folder>``."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    types_ = []
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            module = CONFIG_MAPPING[model_type].__module__
        except Exception:  # a config module that cannot be imported here
            continue
        if module.split(".")[-2] == folder:
            types_.append(model_type)
    return types_


@contextlib.contextmanager
def counting_targets(module, paths, npu):
    """Count, per target (class method or module function), its calls while the block runs and
    the torch_npu op calls made inside them: a target that ran without calling an op ran the
    stock code (a per-instance fallback, e.g. a GELU MLP)."""
    calls, fused = collections.Counter(), collections.Counter()
    restore = []
    for path in paths:
        *owner_path, attr = path.split(".")
        owner = module
        for part in owner_path:
            owner = getattr(owner, part)
        had_own = not isinstance(owner, type) or attr in vars(owner)
        original = vars(owner)[attr] if isinstance(owner, type) and had_own else getattr(owner, attr)

        def counted(*args, _original=original, _path=path, **kwargs):
            calls[_path] += 1
            before = npu.calls.total()
            try:
                return _original(*args, **kwargs)
            finally:
                fused[_path] += npu.calls.total() - before

        setattr(owner, attr, counted)
        restore.append((owner, attr, original, had_own))
    try:
        yield calls, fused
    finally:
        for owner, attr, original, had_own in reversed(restore):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)


def _fused(counter) -> dict[str, int]:
    return {op: n for op, n in sorted(counter.items()) if n}


def check_model(model_type: str, module, confirmed: list[Candidate], npu, dtypes=DTYPES) -> ModelScan:
    """Build the tiny model of ``model_type`` and compare it stock and patched (each dtype).

    The model, its batch, the training step and the comparison are ``testing.parity``'s (its
    OVERRIDES, tolerances and rounding rules), as in the tests and ``verify``. A tiny model that
    cannot be built or whose stock training step fails is an error of the model type (not
    tested), not a parity failure.
    """
    import torch

    from ..testing import parity as harness

    result = ModelScan(model_type, module.__name__)
    result.targets = [f"{c.kernel}:{c.path}" for c in confirmed]
    for dtype_name in dtypes:
        begin = time.perf_counter()
        step = "tiny model"
        try:
            model = harness.tiny_model(model_type, getattr(torch, dtype_name))
            result.model_class = type(model).__name__
            if type(model).__module__ != module.__name__:
                result.error = f"the model class lives in {type(model).__module__}"
                return result
            step = "tiny inputs"
            batch = harness.model_batch(model)
            step = f"stock training step ({dtype_name})"
            stock = harness.forward_backward(model, batch[0], batch[1], **batch[2])
        except Exception as exc:
            result.error = f"{step}: {type(exc).__name__}: {_short(exc)}"
            result.parity = []
            return result
        parity, ran = _parity(model_type, module, confirmed, model, batch, stock, npu, dtype_name)
        result.ran = result.ran or ran
        if _borderline(parity):
            parity.other_batches = _other_batches(model_type, module, confirmed, model, npu, dtype_name)
            parity.passed = all(parity.other_batches)
        parity.seconds = round(time.perf_counter() - begin, 3)
        result.parity.append(parity)
    return result


# Batches (input seeds) tried when a bf16 run is beyond tolerance on the first one only.
_OTHER_SEEDS = (2, 3)


def _borderline(parity: Parity) -> bool:
    """A bf16 run that completed, with every gradient reached, beyond tolerance somewhere."""
    return (
        parity.dtype == "bfloat16"
        and not parity.passed
        and parity.error is None
        and parity.state == "applied"
        and all(m.startswith("over tolerance") for m in parity.missing_grads)
    )


def _other_batches(model_type, module, confirmed, model, npu, dtype_name) -> list[bool]:
    """Whether patched matches stock on two other batches.

    In bf16 a fused kernel that rounds once where the eager code rounds twice can tip a
    near-tie: an MoE router picks another expert for one token (OLMoE on the first tiny
    batch: one token of 16 in layer 1), and that expert's gradient is then far from stock.
    A kernel whose math differs fails on every batch; a tie is an accident of one.
    """
    from ..testing import parity as harness

    passed = []
    for seed in _OTHER_SEEDS:
        batch = harness.model_batch(model, seed)
        stock = harness.forward_backward(model, batch[0], batch[1], **batch[2])
        parity, _ran = _parity(model_type, module, confirmed, model, batch, stock, npu, dtype_name)
        passed.append(parity.passed)
    return passed


def _parity(model_type, module, confirmed, model, batch, stock, npu, dtype_name):
    """(Parity, {target path: [calls, op calls inside]}) of one patched run against ``stock``:
    the confirmed targets registered as a model of their own, the step and the comparison
    ``testing.parity``'s, the fused ops counted in the forward and the backward apart."""
    import torch

    import npu_autopatch

    from ..testing import parity as harness

    key = f"scan:{model_type}"
    targets = [npu_autopatch.Target(c.kernel, c.path) for c in confirmed]
    paths = [c.path for c in confirmed]
    input_ids, labels, inputs = batch
    try:
        npu_autopatch.register(key, targets=targets, module=module.__name__, replace=True)
        npu_autopatch.enable(models=[key])
        record = npu_autopatch.status()[key]
        model.zero_grad(set_to_none=True)
        with counting_targets(module, paths, npu) as (calls, fused):
            before = collections.Counter(npu.calls)
            output = harness.forward(model, input_ids, **inputs)
            middle = collections.Counter(npu.calls)
            patched = harness.backward(model, output, labels)
            after = collections.Counter(npu.calls)
    except Exception as exc:
        return Parity(dtype_name, False, error=f"patched run: {type(exc).__name__}: {_short(exc)}"), {}
    finally:
        npu_autopatch.disable()
        npu_autopatch.unregister(key)
    report = harness.report_of(record, getattr(torch, dtype_name))
    try:
        harness.compare(report, stock, patched)
        harness.closer_to_fp32(report, model, batch, stock, patched)
    except Exception as exc:  # e.g. a patched gradient of another shape than stock's
        return Parity(dtype_name, False, error=f"comparison: {type(exc).__name__}: {_short(exc)}"), {}
    parity = Parity(
        dtype_name,
        report.passed,
        state=report.state,
        reason=report.reason,
        logits_error=report.logits_error,
        grad_error=report.grad_error,
        worst_tensor=report.worst_tensor,
        missing_grads=[*report.missing_grads, *(f"over tolerance: {name}" for name in report.over_tolerance)],
        rounding=list(report.rounding),
        forward_ops=_fused(middle - before),
        backward_ops=_fused(after - middle),
    )
    return parity, {path: [calls[path], fused[path]] for path in paths}


# --- the worker (one child process, a few package directories) ----------------------------------


def _worker(folders: list[str], dtypes, parity: bool) -> None:
    """Scan these package directories and print one JSON line per module and per model type."""
    import torch

    torch.set_num_threads(1)
    from ..testing import stand_in

    layout = modeling_modules()
    with stand_in() as npu:
        for folder in folders:
            scanned = {}
            for name in layout.get(folder, ()):
                result, module = scan_module(name)
                scanned[name] = (result, module)
                _emit("module", asdict(result))
            if parity:
                for model_type in model_types_of(folder):
                    _emit("model", asdict(_check_type_safely(model_type, scanned, npu, dtypes)))
            _emit("done", {"folder": folder})


def _check_type_safely(model_type, scanned, npu, dtypes) -> ModelScan:
    """_check_type, with whatever it raises recorded on the model type instead of ending the child."""
    try:
        return _check_type(model_type, scanned, npu, dtypes)
    except Exception as exc:
        return ModelScan(model_type, error=f"scan error: {type(exc).__name__}: {_short(exc)}")


def _check_type(model_type, scanned, npu, dtypes) -> ModelScan:
    """Find the model type's modeling module (its model class's) and run its parity."""
    from ..testing import parity as harness
    from ..testing import tiny

    try:
        config = harness.tiny_config(model_type)
        trained = tiny.trained_config(config)
        found = tiny.model_class(trained, by_name=trained is not config)
    except Exception as exc:
        return ModelScan(model_type, error=f"tiny config: {type(exc).__name__}: {_short(exc)}")
    if found is None:
        return ModelScan(model_type, error="no auto model class takes its config")
    name = found[1].__module__
    result, module = scanned.get(name, (None, None))
    if module is None:
        return ModelScan(model_type, name, found[1].__name__, error="its modeling module did not import")
    confirmed = result.confirmed
    if not confirmed:
        return ModelScan(model_type, name, found[1].__name__, error="no target confirmed by the probes")
    return check_model(model_type, module, confirmed, npu, dtypes)


def _emit(kind, payload) -> None:
    print(json.dumps({"kind": kind, **payload}, default=str), flush=True)


def _short(exc, limit=300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the whole scan ------------------------------------------------------------------------------


def scan(
    folders: list[str] | None = None,
    dtypes=DTYPES,
    parity: bool = True,
    python: str | None = None,
    progress=None,
) -> ScanResult:
    """Scan the installed transformers (or only ``folders``), in child processes."""
    import importlib.metadata

    begin = time.perf_counter()
    layout = modeling_modules()
    todo = [f for f in (folders or layout) if f in layout]
    modules, models, errors = [], [], {}
    for start in range(0, len(todo), _BATCH_DIRS):
        batch = todo[start : start + _BATCH_DIRS]
        for line in _run_batch(batch, dtypes, parity, python or sys.executable):
            if line["kind"] == "module":
                modules.append(_module_from(line))
            elif line["kind"] == "model":
                models.append(_model_from(line))
            elif line["kind"] == "error":
                errors[line["folder"]] = line["error"]
        if progress is not None:
            progress(f"{min(start + _BATCH_DIRS, len(todo))}/{len(todo)} directories")
    version = importlib.metadata.version("transformers")
    seconds = round(time.perf_counter() - begin, 1)
    return ScanResult(version, modules, models, seconds, tuple(dtypes), errors)


def _run_batch(batch, dtypes, parity, python) -> list[dict]:
    """The JSON lines of one child. A child that dies or hangs is started again on the
    directories after the one it was in, which gets an ``error`` line."""
    lines, pending = [], list(batch)
    while pending:
        command = [python, "-m", "npu_autopatch.tools.scan", "--worker", "--dtype", ",".join(dtypes)]
        command += ([] if parity else ["--no-parity"]) + pending
        env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_AUTOPATCH")}
        env["TRANSFORMERS_VERBOSITY"] = "error"
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=_CHILD_TIMEOUT, env=env)
            out, failure = run.stdout, None if run.returncode == 0 else f"exit status {run.returncode}"
            detail = run.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            failure, detail = f"no answer within {_CHILD_TIMEOUT} s", ""
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        lines += got
        if failure is None:
            break
        done = {line["folder"] for line in got if line["kind"] == "done"}
        culprit = next((f for f in pending if f not in done), pending[-1])
        message = f"the scan's child process died in this directory ({failure}): {_short(detail[-600:])}"
        lines.append({"kind": "error", "folder": culprit, "error": message})
        pending = pending[pending.index(culprit) + 1 :]
    return lines


def from_dict(data: dict) -> ScanResult:
    """The ScanResult of a ``--json`` output, to render it again (``markdown(from_dict(...))``)."""
    return ScanResult(
        data["transformers"],
        [_module_from(m) for m in data["modules"]],
        [_model_from(m) for m in data["models"]],
        data["seconds"],
        tuple(data["dtypes"]),
        data.get("errors", {}),
    )


def _module_from(line) -> ModuleScan:
    candidates = [Candidate(**c) for c in line.get("candidates", [])]
    return ModuleScan(line["module"], line.get("import_error"), candidates)


def _model_from(line) -> ModelScan:
    line = {k: v for k, v in line.items() if k != "kind"}
    line["parity"] = [Parity(**p) for p in line.get("parity", [])]
    return ModelScan(**line)


# --- rendering ----------------------------------------------------------------------------------


def counts(result: ScanResult) -> dict[str, int]:
    confirmed = [c for m in result.modules for c in m.confirmed]
    with_candidates = [m for m in result.modules if m.candidates]
    by_kernel = collections.Counter(c.kernel for c in confirmed)
    tested = [m for m in result.models if m.parity]
    return {
        "modules": len(result.modules),
        "import_errors": sum(m.import_error is not None for m in result.modules),
        "modules_with_candidates": len(with_candidates),
        "modules_with_targets": sum(bool(m.confirmed) for m in result.modules),
        "candidates": sum(len(m.candidates) for m in result.modules),
        "targets": len(confirmed),
        **{f"targets_{k}": by_kernel[k] for k in ("rms_norm", "gated_rms_norm", "swiglu", "rope", "moe")},
        "model_types": len(result.models),
        "model_types_tested": len(tested),
        "model_types_passed": sum(m.passed for m in tested),
    }


def summary(result: ScanResult) -> str:
    """The one line docs/models.md quotes."""
    c = counts(result)
    return (
        f"transformers {result.transformers}: {c['modules']} modeling modules, "
        f"{c['modules_with_targets']} with a target our kernels reproduce ({c['targets']} targets: "
        f"{c['targets_rms_norm']} rms_norm, {c['targets_gated_rms_norm']} gated_rms_norm, "
        f"{c['targets_swiglu']} swiglu, {c['targets_rope']} rope, {c['targets_moe']} moe); "
        f"{c['model_types_passed']} of {c['model_types_tested']} model types with targets pass parity "
        f"on the CPU stand-in ({'+'.join(result.dtypes)})"
    )


def _parity_cell(model: ModelScan) -> str:
    if model.error:
        return f"not run: {model.error}"
    cells = []
    for p in model.parity:
        if p.passed:
            cells.append(f"{p.dtype} pass")
        else:
            why = p.error or p.reason or ", ".join(p.missing_grads[:2]) or p.worst_tensor
            cells.append(f"{p.dtype} FAIL ({why})")
    return "; ".join(cells)


def _ran_cell(model: ModelScan) -> str:
    """Which targets the tiny model did not exercise, or ran without calling a fused op."""
    never = [path for path, (calls, _ops) in model.ran.items() if calls == 0]
    stock = [path for path, (calls, ops) in model.ran.items() if calls and not ops]
    notes = (["never: " + ", ".join(never)] if never else []) + (
        ["ran stock code: " + ", ".join(stock)] if stock else []
    )
    return "; ".join(notes) or ("all, fused" if model.ran else "")


def _ops_cell(model: ModelScan) -> str:
    first = next((p for p in model.parity if p.forward_ops), None)
    return ", ".join(f"{op.removeprefix('npu_')} {n}" for op, n in first.forward_ops.items()) if first else ""


def markdown(result: ScanResult) -> str:
    """The scan as markdown: the summary line, the model types, the refused candidates."""
    lines = [f"# npu-autopatch scan of transformers {result.transformers}", "", summary(result), ""]
    lines += [
        "## Model types with a target our kernels reproduce",
        "",
        "| model type | module | targets (kernel: path) | ran in the tiny model | parity "
        "| fused ops per forward |",
        "|---|---|---|---|---|---|",
    ]
    for model in sorted(result.models, key=lambda m: m.model_type):
        if not model.targets:
            continue
        ran = _ran_cell(model)
        targets = "<br>".join(f"`{t}`" for t in model.targets)
        module = (model.module or "").removeprefix("transformers.models.")
        cells = (model.model_type, module, targets, ran, _parity_cell(model), _ops_cell(model))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Candidates no kernel reproduces",
        "",
        "| module | candidate | why not |",
        "|---|---|---|",
    ]
    for module in result.modules:
        for c in module.candidates:
            if c.kernel is None:
                why = "; ".join(f"{k}: {r}" for k, r in c.refused.items())
                lines.append(f"| {module.module.removeprefix('transformers.models.')} | `{c.path}` | {why} |")
    failed = [m for m in result.modules if m.import_error]
    if failed:
        lines += ["", "## Modules that did not import", ""]
        lines += [f"- {m.module}: {m.import_error}" for m in failed]
    if result.errors:
        lines += ["", "## Directories whose scan died", ""]
        lines += [f"- {folder}: {error}" for folder, error in result.errors.items()]
    lines += ["", f"Scanned in {result.seconds:.0f} s."]
    return "\n".join(lines) + "\n"


def to_json(result: ScanResult) -> str:
    return json.dumps(result.as_dict(), indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    """``python -m npu_autopatch scan``; exit status 1 if a model type with targets fails parity."""
    parser = Parser(
        prog="python -m npu_autopatch scan",
        description="Which code of the installed transformers the kernels reproduce: every modeling "
        "module's candidate targets probed, then each model type's tiny model stock vs patched on the "
        "CPU stand-in for torch_npu (no NPU used). Exit status 1 if a model type with targets fails.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--dirs", help="comma list of transformers/models directories (default: all)")
    parser.add_argument("--dtype", default=",".join(DTYPES), help="comma list: float32,bfloat16")
    parser.add_argument("--no-parity", action="store_true", help="probe the candidates only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("folders", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dtypes = tuple(d.strip() for d in args.dtype.split(",") if d.strip())
    known(dtypes or ("",), DTYPES, "dtype")
    if args.worker:
        _worker(args.folders, dtypes, not args.no_parity)
        return 0
    folders = [f.strip() for f in args.dirs.split(",") if f.strip()] if args.dirs else None
    # A typo would scan nothing, and pass.
    known(folders or (), modeling_modules(), "directory in transformers/models", listed=False)
    result = scan(folders, dtypes, not args.no_parity, progress=lambda m: print(m, file=sys.stderr))
    print(to_json(result) if args.json else markdown(result))
    return 1 if any(m.parity and not m.passed for m in result.models) else 0


if __name__ == "__main__":
    sys.exit(main())
