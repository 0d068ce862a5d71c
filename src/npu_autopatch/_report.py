"""``report(model)``: what each module of a live model really runs, ours, stock or someone else's.

status() says what the patcher did to classes and functions; a model can still escape it.
A class another library replaced (Liger-Kernel rebinds the name), an instance whose
``forward`` was captured before patching (accelerate's ``add_hook_to_module``, used by
``cpu_offload`` and ``dispatch_model``, keeps the bound class forward of that moment in
``module._old_forward``: class-level patching never reaches it, and ``disable()`` never
reaches one captured while patched), a model whose config picks another experts
implementation: only the live object tells. So the report reads the model, not the table:

- every module class of ``model.modules()``, with its instance count, as *ours* (one of our
  replacements: a ledger slot's, or a function of this package that carries ``__wrapped__``),
  *stock* (transformers' or torch's own code) or *foreign* (named by its defining module).
  A kernel whose install does more than swap an attribute reads its instances itself
  (``Report.origin``: the moe kernel's 5.x fused experts, which transformers' experts interface
  dispatches by the instance's config);
- the module-level rotary functions (and chunked gated delta rules) of the model's modeling
  modules (and of the user's own modules its classes come from);
- flags: a norm/MLP/experts/rotary-looking target on stock code (named by
  ``_candidates``' patterns) with the reason from status(), a kernel the installed torch_npu
  cannot run (with its requirement), and instances captured before or while patched;
  code of any other origin (the user's own classes, another library's code in transformers'
  place) that a kernel reproduces, as the probes say, with how to patch it.

Imports torch (through ``_candidates``); only imported when a report is asked for.
"""

from __future__ import annotations

import collections
import functools
import sys
from dataclasses import dataclass, field

from . import _candidates, _config, _control, _resolve
from ._records import PatchRecord, ReasonCode, State, describe_calls
from ._state import STATE, locked
from ._table import columns
from .kernels._catalog import SWITCHES

OURS, STOCK, FOREIGN = "ours", "stock", "foreign"
# Modules whose classes are library code, not the user's own (whose rotary functions are listed too).
_LIBRARIES = ("builtins", "torch", "transformers", "npu_autopatch")
_GATED = (ReasonCode.KERNEL_UNSUPPORTED, ReasonCode.OP_MISSING)


@dataclass
class ModuleEntry:
    """One module class of the model: what its code is and what its instances run."""

    name: str  # the class's qualified name
    module: str  # the module that defines the class
    count: int  # instances in the model
    origin: str  # ours / stock / foreign: what the class runs (per instance for 5.x experts)
    via: str  # how: "forward", "moe", "experts interface 'npu_grouped_mm'", ...
    defined_by: str  # the module that defines the code that runs
    kind: str | None = None  # norm / mlp / moe when the name looks like a kernel's target
    kernel: str | None = None  # our kernel, when ours
    runs: dict[str, int] = field(default_factory=dict)  # instances by what they really run


@dataclass
class FunctionEntry:
    """One module-level rotary function or chunked gated delta rule of the model's modeling modules
    (or of the user's own modules its classes come from)."""

    name: str  # "module:function"
    origin: str
    defined_by: str
    kernel: str | None = None


@dataclass
class Flag:
    """Something a user wants to know: a target left stock, a gated kernel, a captured instance,
    code a kernel reproduces that nothing patches."""

    # stock / gated / unpatched / captured-before-patching / captured-while-patched / instance-forward / loss
    kind: str
    subject: str  # the class or function it is about
    message: str
    code: str | None = None  # status()'s reason code, when it has one
    instances: list[str] = field(default_factory=list)  # module names in the model (captured flags)


@dataclass
class Section:
    """A kernel's own table in the report (its ``Report.rows``): the attention kernel's attention
    classes, the implementation their config picks and what computes it."""

    columns: tuple[str, ...]  # the titles of the columns after the first (the class)
    rows: list  # objects whose attributes are the columns


@dataclass
class CoverageReport:
    """What a live model runs: per module class, per rotary function, and the flags."""

    model: str  # the model's class name
    model_type: str | None
    modules: list[ModuleEntry]
    functions: list[FunctionEntry]
    flags: list[Flag]
    records: dict[str, PatchRecord]  # status() of the models whose modeling modules the model uses
    # Each kernel's own table, by kernel name (see Section); ``report.attention`` is its rows.
    sections: dict[str, Section] = field(default_factory=dict)
    # How the calls of the replacements in those records ran (PatchRecord.calls), per target path.
    calls: dict[str, dict] = field(default_factory=dict)

    def __getattr__(self, name: str) -> list:
        """A kernel's own rows by its name: ``report(model).attention``."""
        section = self.__dict__.get("sections", {}).get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return section.rows

    @property
    def counts(self) -> dict[str, int]:
        """Module instances by what they run, rotary functions by origin, flags."""
        runs = collections.Counter()
        for entry in self.modules:
            runs.update(entry.runs)
        functions = collections.Counter(f.origin for f in self.functions)
        return {
            **{f"modules_{origin}": runs[origin] for origin in (OURS, STOCK, FOREIGN)},
            **{f"functions_{origin}": functions[origin] for origin in (OURS, STOCK, FOREIGN)},
            "flags": len(self.flags),
        }

    def as_dict(self) -> dict:
        """Plain JSON-ready data."""
        return {
            "model": self.model,
            "model_type": self.model_type,
            "counts": self.counts,
            "modules": [vars(e).copy() for e in self.modules],
            "functions": [vars(f).copy() for f in self.functions],
            "flags": [vars(f).copy() for f in self.flags],
            "records": {name: rec.as_dict() for name, rec in self.records.items()},
            **{kernel: [vars(row).copy() for row in s.rows] for kernel, s in self.sections.items()},
            "calls": {
                target: {"fused": c["fused"], "stock": dict(c["stock"])} for target, c in self.calls.items()
            },
        }

    def summary(self) -> str:
        c = self.counts
        return (
            f"{self.model} ({self.model_type}): modules {c['modules_ours']} ours, "
            f"{c['modules_stock']} stock, "
            f"{c['modules_foreign']} foreign; functions {c['functions_ours']} ours, "
            f"{c['functions_stock']} stock, {c['functions_foreign']} foreign; "
            f"{c['flags']} flag{'' if c['flags'] == 1 else 's'}"
        )

    def __str__(self) -> str:
        rows = [("class", "n", "origin", "via", "code from")]
        rows += [(e.name, str(e.count), _runs(e), _via(e), e.defined_by) for e in self.modules]
        functions = [("function", "origin", "code from")]
        functions += [(f.name, f.origin, f.defined_by) for f in self.functions]
        lines = [self.summary(), "", columns(rows)]
        if self.functions:
            lines += ["", columns(functions)]
        for kernel, section in self.sections.items():
            if section.rows:
                table = [(kernel, *section.columns)]
                table += [tuple(str(value) for value in vars(row).values()) for row in section.rows]
                lines += ["", columns(table)]
        if self._called():
            calls = [("target", "calls")]
            calls += [(where, describe_calls(c)) for where, c in self._called().items()]
            lines += ["", columns(calls)]
        if self.flags:
            lines.append("")
            lines += [f"FLAG {_kind(f)}: {f.subject}: {f.message}" for f in self.flags]
        return "\n".join(lines)

    def _called(self) -> dict[str, dict]:
        """The targets whose replacement ran at least once."""
        return {where: c for where, c in self.calls.items() if c["fused"] or c["stock"]}

    def markdown(self) -> str:
        lines = [
            f"**{self.summary()}**",
            "",
            "| class | instances | origin | via | code from |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| `{e.name}` | {e.count} | {_runs(e)} | {_via(e)} | `{e.defined_by}` |" for e in self.modules
        ]
        if self.functions:
            lines += ["", "| function | origin | code from |", "|---|---|---|"]
            lines += [f"| `{f.name}` | {f.origin} | `{f.defined_by}` |" for f in self.functions]
        for kernel, section in self.sections.items():
            if section.rows:
                lines += [
                    "",
                    f"| {' | '.join((kernel, *section.columns))} |",
                    "|---" * (1 + len(section.columns)) + "|",
                ]
                for row in section.rows:
                    first, *rest = (str(value) for value in vars(row).values())
                    lines.append(f"| `{first}` | {' | '.join(rest)} |")
        if self._called():
            lines += ["", "| target | calls |", "|---|---|"]
            lines += [f"| `{where}` | {describe_calls(c)} |" for where, c in self._called().items()]
        if self.flags:
            lines += ["", "| flag | subject | why |", "|---|---|---|"]
            lines += [f"| {_kind(f)} | `{f.subject}` | {f.message} |" for f in self.flags]
        return "\n".join(lines)


def _kind(flag: Flag) -> str:
    return f"{flag.kind} ({flag.code})" if flag.code else flag.kind


def _via(entry: ModuleEntry) -> str:
    return f"{entry.via} ({entry.kernel})" if entry.kernel else entry.via


def _runs(entry: ModuleEntry) -> str:
    if set(entry.runs) <= {entry.origin}:
        return entry.origin
    return f"{entry.origin} ({', '.join(f'{n} {origin}' for origin, n in sorted(entry.runs.items()))})"


# --- what a piece of code is -------------------------------------------------------------


class _Ours:
    """Our kernels' slots in the ledger, read once under the lock: what counts as ours."""

    def __init__(self):
        with locked:
            self.slots = [slot for slot in STATE.slots.values() if slot.kernel is not None]
        self.kernels = {id(slot.replacement): slot.kernel for slot in self.slots}


def _function(obj):
    """The plain function a callable runs: unwraps bound methods, partials and callable modules."""
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif hasattr(obj, "__func__"):
            obj = obj.__func__
        else:
            break
    return _resolve.stock_function(obj) or obj


def _defined_by(function) -> str:
    """The module whose code this is (its globals), not the ``__module__`` a decorator copied."""
    namespace = getattr(function, "__globals__", None) or {}
    return namespace.get("__name__") or getattr(function, "__module__", None) or type(function).__module__


def _defined_by_code(code) -> str:
    """The module defining the code a callable runs (``_function`` of it)."""
    return _defined_by(_function(code))


def _origin(obj, ours) -> tuple[str, str, str | None]:
    """(ours/stock/foreign, the module defining the code, our kernel name or None).

    A torch or transformers decorator (``torch.no_grad()``, ``can_return_tuple``) is looked
    through: the code it wraps decides.
    """
    function = _function(obj)
    for _ in range(8):
        module = _defined_by(function)
        if id(function) in ours.kernels:
            return OURS, module, ours.kernels[id(function)]
        wrapped = getattr(function, "__wrapped__", None)
        if module.startswith("npu_autopatch.") and wrapped is not None:
            return OURS, module, None  # a replacement disable() took out of its class, still referenced
        if wrapped is None or not (module == "torch" or module.startswith(("torch.", "transformers."))):
            break
        function = _function(wrapped)
    if module == "torch" or module.startswith("torch."):
        return STOCK, module, None
    if hasattr(function, "__code__") and _resolve.is_own(function):
        return STOCK, module, None
    return FOREIGN, module, None


def _class_origin(cls, ours):
    """(origin, via, defined_by, kernel) of a class's code: its forward, or another method we replaced."""
    origin, defined_by, kernel = _origin(cls.forward, ours)
    if origin != OURS:
        for slot in ours.slots:  # a method other than forward (4.x DeepSeek-V3's ``moe``)
            if (
                isinstance(slot.owner, type)
                and issubclass(cls, slot.owner)
                and slot.attr != "forward"
                and slot.current() is slot.replacement
            ):
                return OURS, slot.attr, _defined_by(slot.replacement), slot.kernel
    return origin, "forward", defined_by, kernel


def _captured(instance):
    """The function an instance-level ``forward`` finally runs, or None if the instance has none.

    accelerate keeps the bound forward it wrapped in ``_old_forward``; other wrappers are
    followed through ``__wrapped__`` (functools.wraps / update_wrapper) down to a bound method.
    """
    if "forward" not in vars(instance):
        return None
    inner = vars(instance).get("_old_forward")
    if inner is None:
        inner = vars(instance)["forward"]
        for _ in range(8):
            wrapped = getattr(inner, "__wrapped__", None)
            if wrapped is None or getattr(inner, "__self__", None) is instance:
                break  # a bound method: its own __wrapped__ is its function's decorator's
            inner = wrapped
    return inner


def _hooker(instance) -> str:
    """Who set the instance's ``forward``, for a flag."""
    hook = vars(instance)["forward"]
    if getattr(hook, "__self__", None) is instance:  # e.g. what remove_hook_from_module leaves
        return "a bound method stored on the instance"
    return f"by {_defined_by_code(hook)}"


# --- why a target is stock ---------------------------------------------------------------


def _reason_for(where, module, records):
    """(code, text) of why ``where`` ("module:qualname") runs stock, from status(), or (None, text)."""
    for rec in records.values():
        reason = rec.stock_reasons.get(where)
        if reason is not None:
            return reason.code, reason.text
    for rec in records.values():
        if rec.module != module.__name__:
            continue
        if rec.state not in (State.APPLIED, State.PARTIAL):
            return rec.code, f"{rec.model} is {rec.state.value}: {rec.reason}"
        target = _target_at(STATE.models.get(rec.model), module, where)
        if target is None:
            return None, f"{rec.model} is {rec.state.value}, but this is not one of its targets"
        config = STATE.config
        switch = getattr(target.kernel, "switch", None) or SWITCHES.get(target.kernel_name)
        if config is not None and switch is not None and not config.selects(target.kernel):
            off = "switched off" if getattr(target.kernel, "switched_on", False) else "opt-in"
            return ReasonCode.NO_KERNEL_SELECTED, (
                f"the {target.kernel_name} kernel is {off}: enable({switch}=True) or "
                f"{_config.switch_variable(switch)}=1"
            )
        kernels = config.kernels if config is not None else None
        if kernels is not None and not config.selects(target.kernel):
            return ReasonCode.NO_KERNEL_SELECTED, (
                f"the {target.kernel_name} kernel is not selected (enable(kernels=...) or "
                f"NPU_AUTOPATCH_KERNELS: {', '.join(sorted(kernels))})"
            )
        if target.since is not None:
            return None, f"its {target.kernel_name} target is left out before transformers {target.since}"
        return None, f"{rec.model} is {rec.state.value}: {rec.reason}"
    return None, f"{module.__name__} is not in the model table"


def _target_at(model, module, where):
    """The Target of ``model`` that resolves to ``where`` in ``module``, or None."""
    for target in getattr(model, "targets", None) or ():
        found = _resolve.resolve(module, target.paths)
        if found is not None and _resolve.where(module, found.owner, found.path) == where:
            return target
    return None


def _probe_note(candidate):
    """What the probes said about an untargeted candidate: the kernel that fits, or why none."""
    if candidate.kernel is not None:
        return (
            f"the probes say {candidate.kernel} reproduces it ({candidate.variant}): "
            "enable(discover=True) or NPU_AUTOPATCH_DISCOVER=1 patches it"
        )
    refused = "; ".join(f"{kernel}: {_short(why)}" for kernel, why in candidate.refused.items())
    return f"no kernel reproduces it ({refused})"


def _short(text, limit=160):
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stock_flag(subject, where, module, path, kind, records, hooks, instance=None):
    code, text = _reason_for(where, module, records)
    if code is None and instance is not None:
        why = _hooked(hooks, "stock_reason", instance)
        text = text if why is None else why
    if code is None and text.endswith(("not one of its targets", "not in the model table")):
        try:
            candidate = _candidates.probe(module, _candidates.Candidate(path, kind, module.__name__))
            text = f"{text}; {_probe_note(candidate)}"
            why = _instance_stock(hooks.get(candidate.kernel), instance)
            if why is not None:
                text += f"; but {why}: that kernel would run the stock code"
        except Exception as exc:  # a probe that raises says nothing about the model itself
            text = f"{text}; the probe raised {type(exc).__name__}: {exc}"
    if code in _GATED:
        return Flag("gated", subject, f"a kernel the installed torch_npu cannot run: {text}", code.value)
    return Flag("stock", subject, f"runs stock code: {text}", None if code is None else code.value)


# --- the report --------------------------------------------------------------------------


def _report_hooks():
    """{kernel name: its Report} of every kernel that declares one (built in, or a registered model's)."""
    return {
        name: kernel.report for name, kernel in _candidates.kernels().items() if kernel.report is not None
    }


def _instance_stock(hook, instance):
    """Why ``instance`` runs the stock code though its class runs the kernel of ``hook``, or None."""
    if hook is None or hook.instance_stock is None or instance is None:
        return None
    return hook.instance_stock(instance)


def report(model) -> CoverageReport:
    """What ``model`` (a live ``torch.nn.Module``) runs: ours, stock or foreign, per class and
    rotary function, and the flags (see this module's docstring)."""
    records = _control.status()
    ours = _Ours()
    hooks = _report_hooks()
    groups: dict[type, list[tuple[str, object]]] = {}
    for name, instance in model.named_modules(remove_duplicate=True):
        groups.setdefault(type(instance), []).append((name or "<root>", instance))
    modules, flags, modeling, own = [], [], {}, {}
    claimed = set()  # the classes whose instances a kernel's install reaches (Report.origin)
    for cls, instances in groups.items():
        entry, entry_flags, reached = _entry(cls, instances, ours, hooks)
        modules.append(entry)
        flags += entry_flags
        if reached:
            claimed.add(cls)
        home = sys.modules.get(cls.__module__)
        if home is None:
            continue
        if cls.__module__.startswith(("transformers.models.", "transformers_modules.")):
            modeling[cls.__module__] = home
        elif not cls.__module__.startswith(_LIBRARIES):
            own[cls.__module__] = home
    relevant = {k: r for k, r in records.items() if r.module in modeling}
    unpatched = []  # (subject, module name, path, code, kind): code no kernel of ours runs
    for (cls, instances), entry in zip(groups.items(), modules, strict=True):
        if entry.kind is None or entry.origin == OURS:
            continue
        if _delegates(hooks, entry.kind, instances[0][1]):
            continue  # 5.x's MoE block routes, its fused experts module (reported itself) computes
        path = f"{cls.__qualname__}.forward"
        if entry.origin == STOCK and cls.__module__ in modeling:
            if entry.runs.get(STOCK):  # captured ones are flagged apart
                where = f"{cls.__module__}:{path}"
                module = modeling[cls.__module__]
                flags.append(
                    _stock_flag(
                        cls.__qualname__,
                        where,
                        module,
                        path,
                        entry.kind,
                        records,
                        hooks,
                        instances[0][1],
                    )
                )
        elif entry.runs.get(entry.origin) and cls not in claimed:
            unpatched.append((cls.__qualname__, cls.__module__, path, cls.forward, entry.kind))
    functions = []
    for module_name, module in {**modeling, **own}.items():
        for name, obj in sorted(vars(module).items()):
            if isinstance(obj, type):
                continue
            kind = _candidates.kind_of(name, obj, vars(module))  # rope, the chunked gated delta rule
            if kind is None:
                continue
            origin, defined_by, kernel = _origin(obj, ours)
            where = f"{module_name}:{name}"
            functions.append(FunctionEntry(where, origin, defined_by, kernel))
            if origin == STOCK and module_name in modeling:
                flags.append(_stock_flag(where, where, module, name, kind, records, hooks))
            elif origin != OURS:
                unpatched.append((where, module_name, name, obj, kind))
    flags += _unpatched_flags(unpatched, modeling, records)
    flags += _kernel_flags(groups, modules, hooks)
    config = getattr(model, "config", None)
    sections = {
        kernel: Section(hook.columns, list(hook.rows(groups, records)))
        for kernel, hook in hooks.items()
        if hook.rows is not None
    }
    return CoverageReport(
        type(model).__qualname__,
        getattr(config, "model_type", None),
        modules,
        functions,
        flags,
        relevant,
        sections,
        {where: c for rec in relevant.values() for where, c in rec.calls.items()},
    )


def _kernel_flags(groups, modules, hooks):
    """The flags the kernels raise about the instances of the classes running them (``Report.flags``:
    the loss kernel says whose code computes the loss), each flag of the kernel's name."""
    flags = []
    for (cls, instances), entry in zip(groups.items(), modules, strict=True):
        hook = hooks.get(entry.kernel)
        if hook is None or hook.flags is None:
            continue
        for name, instance in instances:
            subject = f"{cls.__qualname__} ({name})"
            messages = hook.flags(instance, _defined_by_code)
            flags += [Flag(entry.kernel, subject, message) for message in messages]
    return flags


def _unpatched_flags(unpatched, modeling, records):
    """Flags for code of any origin that a kernel reproduces (the probes say so) and that no kernel of
    ours runs: another library's code in transformers' place, or the user's own classes and functions."""
    reproduced = []
    for subject, module_name, path, code, kind in unpatched:
        try:
            candidate = _candidates.probe_code(code, _candidates.Candidate(path, kind, module_name))
        except Exception:  # code the probes cannot even read is not a kernel's target
            continue
        if candidate.kernel is not None:
            reproduced.append((subject, candidate))
    by_module = {}  # the user's module -> its reproduced targets: one register() call each
    for _subject, candidate in reproduced:
        if candidate.defined_in not in modeling:
            by_module.setdefault(candidate.defined_in, []).append(candidate)
    flags = []
    for subject, candidate in reproduced:
        found = f"the probes say {candidate.kernel} reproduces it ({candidate.variant})"
        home = candidate.defined_in
        if home in modeling:  # transformers' class or function, holding another library's code
            code, text = _reason_for(f"{home}:{candidate.path}", modeling[home], records)
            if code is None:
                text += "; enable(discover=True, force=True) patches it"
            flags.append(Flag("unpatched", subject, f"{found}: {text}", None if code is None else code.value))
        else:
            call = _register_call(home, by_module[home])
            flags.append(Flag("unpatched", subject, f"{found}, but nothing patches it: {call}"))
    return flags


def _register_call(module_name, candidates):
    """The register() call that patches ``candidates`` of the user's module ``module_name``."""
    model_type = module_name.rpartition(".")[2].strip("_").lower() or "my_model"
    targets = ", ".join(f"npu_autopatch.Target({c.kernel!r}, {c.path!r})" for c in candidates)
    return f"npu_autopatch.register({model_type!r}, module={module_name!r}, targets=[{targets}])"


def _hooked(hooks, name, *args):
    """The first answer other than None of the kernels' Report hook ``name`` (``stock_reason``,
    ``origin``) to ``args``, else None."""
    for hook in hooks.values():
        function = getattr(hook, name)
        if function is not None:
            answer = function(*args)
            if answer is not None:
                return answer
    return None


def _delegates(hooks, kind, instance):
    """Whether a module that looks like a kernel's target of ``kind`` leaves the computation to one
    inside it (``Report.delegates`` of the kernels judging that kind)."""
    if kind is None:
        return False

    def kind_of(module):
        return _candidates.kind_of(type(module).__name__, type(module))

    return any(
        hooks[name].delegates(instance, kind_of)
        for name in _candidates.kernels_for(kind)
        if name in hooks and hooks[name].delegates is not None
    )


def _entry(cls, instances, ours, hooks):
    """The ModuleEntry of one class and the flags of its captured instances."""
    kind = _candidates.kind_of(cls.__name__, cls, vars(sys.modules.get(cls.__module__, sys)))
    forward = cls.forward
    claimed = False  # an instance a kernel's install reaches, read by that kernel (Report.origin)
    class_origin = None
    runs = collections.Counter()
    captured: dict[tuple[str, str, str], list[str]] = {}
    fallback: dict[str, list[str]] = {}  # why -> instances the kernel leaves to the stock code (Report)
    for name, instance in instances:
        read = _hooked(hooks, "origin", instance, lambda code: _origin(code, ours), _defined_by_code)
        claimed = read is not None
        if not claimed:
            class_origin = class_origin or _class_origin(cls, ours)
            read = class_origin
        origin, via, defined_by, kernel = read
        runs_origin = origin
        why = _instance_stock(hooks.get(kernel), instance) if origin == OURS else None
        if why is not None:
            runs_origin = STOCK
            fallback.setdefault(why, []).append(name)
        inner = _captured(instance)
        if inner is not None:
            inner_origin, inner_module, _kernel = _origin(inner, ours)
            runs_origin = inner_origin
            differs = inner_origin != origin or inner_origin == FOREIGN  # not e.g. an older build of ours
            if differs and _function(inner) is not _function(forward) and not claimed:
                if inner_origin == STOCK and origin == OURS:
                    kind_of = "captured-before-patching"
                elif inner_origin == OURS:
                    kind_of = "captured-while-patched"
                else:
                    kind_of = "instance-forward"
                captured.setdefault((kind_of, _hooker(instance), inner_module), []).append(name)
        runs[runs_origin] += 1
    flags = []
    for (kind_of, hooker, inner_module), names in captured.items():
        message = {
            "captured-before-patching": (
                f"instance forward captured before patching ({hooker}): runs stock, not our "
                f"{kernel or 'kernel'}; class-level patching never reaches it"
            ),
            "captured-while-patched": (
                f"instance forward captured while patched ({hooker}): still runs our kernel "
                + ("after disable()" if origin == STOCK else f"instead of the class's {defined_by}")
            ),
            "instance-forward": (
                f"instance forward set {hooker} runs code from {inner_module}, not the class's ({defined_by})"
            ),
        }[kind_of]
        flags.append(Flag(kind_of, cls.__qualname__, f"{len(names)} instance(s): {message}", None, names))
    for why, names in fallback.items():
        message = f"{len(names)} instance(s) run stock code: {why}"
        flags.append(Flag("stock", cls.__qualname__, message, None, names))
    entry = ModuleEntry(
        cls.__qualname__, cls.__module__, len(instances), origin, via, defined_by, kind, kernel, dict(runs)
    )
    return entry, flags, claimed
