"""Why a module or function of a live model runs what it runs (``report(model)``'s second job).

From status() (the reason a target was left stock, a kernel the installed torch_npu cannot run, a
kernel not selected), from the kernels' ``Report`` hooks (an explicit choice in an instance's
config, whose code computes the loss) and from the probes (code a kernel reproduces that nothing
patches, with the register() call that would).
"""

from __future__ import annotations

from . import _candidates, _config, _resolve
from ._classify import Flag, code_from, first_answer, instance_stock
from ._records import ReasonCode, State
from ._state import STATE
from .kernels._catalog import SWITCHES

_GATED = (ReasonCode.KERNEL_UNSUPPORTED, ReasonCode.OP_MISSING)


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


def stock_flag(subject, where, module, path, kind, records, hooks, instance=None):
    code, text = _reason_for(where, module, records)
    if code is None and instance is not None:
        why = first_answer(hooks, "stock_reason", instance)
        text = text if why is None else why
    if code is None and text.endswith(("not one of its targets", "not in the model table")):
        try:
            candidate = _candidates.probe(module, _candidates.Candidate(path, kind, module.__name__))
            text = f"{text}; {_probe_note(candidate)}"
            why = instance_stock(hooks.get(candidate.kernel), instance)
            if why is not None:
                text += f"; but {why}: that kernel would run the stock code"
        except Exception as exc:  # a probe that raises says nothing about the model itself
            text = f"{text}; the probe raised {type(exc).__name__}: {exc}"
    if code in _GATED:
        return Flag("gated", subject, f"a kernel the installed torch_npu cannot run: {text}", code.value)
    return Flag("stock", subject, f"runs stock code: {text}", None if code is None else code.value)


def kernel_flags(groups, modules, hooks):
    """The flags the kernels raise about the instances of the classes running them (``Report.flags``:
    the loss kernel says whose code computes the loss), each flag of the kernel's name."""
    flags = []
    for (cls, instances), entry in zip(groups.items(), modules, strict=True):
        hook = hooks.get(entry.kernel)
        if hook is None or hook.flags is None:
            continue
        for name, instance in instances:
            subject = f"{cls.__qualname__} ({name})"
            messages = hook.flags(instance, code_from)
            flags += [Flag(entry.kernel, subject, message) for message in messages]
    return flags


def unpatched_flags(unpatched, modeling, records):
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
