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

One job per module: ``_classify`` reads what each class and function runs, ``_explain`` says why
(the flags), and this one holds the report's data, renders it, and runs the two in ``report()``.
The entries and flags are defined in ``_classify`` and importable from here, as before.

Imports torch (through ``_candidates``); only imported when a report is asked for.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field

from . import _candidates, _control, _instances
from ._classify import (
    FOREIGN,
    OURS,
    STOCK,
    Flag,
    FunctionEntry,
    ModuleEntry,
    Ours,
    delegates,
    module_entry,
    origin_of,
    report_hooks,
)
from ._explain import kernel_flags, stock_flag, unpatched_flags
from ._records import PatchRecord, describe_calls
from ._table import columns

__all__ = [
    "FOREIGN",
    "OURS",
    "STOCK",
    "CoverageReport",
    "Flag",
    "FunctionEntry",
    "ModuleEntry",
    "Section",
    "report",
]

# Modules whose classes are library code, not the user's own (whose rotary functions are listed too).
_LIBRARIES = ("builtins", "torch", "transformers", "npu_autopatch")


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


def report(model) -> CoverageReport:
    """What ``model`` (a live ``torch.nn.Module``) runs: ours, stock or foreign, per class and
    rotary function, and the flags (see this module's docstring)."""
    _instances.record(list(model.modules()))  # a forward set on an instance over ours: status() says so
    records = _control.status()
    ours = Ours()
    hooks = report_hooks()
    groups: dict[type, list[tuple[str, object]]] = {}
    for name, instance in model.named_modules(remove_duplicate=True):
        groups.setdefault(type(instance), []).append((name or "<root>", instance))
    modules, flags, modeling, own = [], [], {}, {}
    claimed = set()  # the classes whose instances a kernel's install reaches (Report.origin)
    for cls, instances in groups.items():
        entry, entry_flags, reached = module_entry(cls, instances, ours, hooks)
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
        if entry.origin == STOCK and entry.runs.get(STOCK) and cls.__module__ not in modeling:
            # a shared module's class an entry that is no model type left stock (transformers.activations)
            where = f"{cls.__module__}:{cls.__qualname__}.forward"
            if any(where in record.stock_reasons for record in records.values()):
                module = sys.modules[cls.__module__]
                path = f"{cls.__qualname__}.forward"
                flags.append(stock_flag(cls.__qualname__, where, module, path, None, records, hooks))
                continue
        if entry.kind is None or entry.origin == OURS:
            continue
        if delegates(hooks, entry.kind, instances[0][1]):
            continue  # 5.x's MoE block routes, its fused experts module (reported itself) computes
        path = f"{cls.__qualname__}.forward"
        if entry.origin == STOCK and cls.__module__ in modeling:
            if entry.runs.get(STOCK):  # captured ones are flagged apart
                where = f"{cls.__module__}:{path}"
                module = modeling[cls.__module__]
                flags.append(
                    stock_flag(
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
            origin, defined_by, kernel = origin_of(obj, ours)
            where = f"{module_name}:{name}"
            functions.append(FunctionEntry(where, origin, defined_by, kernel))
            if origin == STOCK and module_name in modeling:
                flags.append(stock_flag(where, where, module, name, kind, records, hooks))
            elif origin != OURS:
                unpatched.append((where, module_name, name, obj, kind))
    flags += unpatched_flags(unpatched, modeling, records)
    flags += kernel_flags(groups, modules, hooks)
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
