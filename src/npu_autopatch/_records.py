"""What status() reports: the states, the reason codes, one PatchRecord per model, and PatchError.

Public and typed (``npu_autopatch.PatchRecord``, ``TargetReason``, ``State``, ``ReasonCode``).
Imported only when status() is asked or a model is patched, never at interpreter start
(dataclasses and enum cost ~10 ms each).
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass, field, replace

from . import _ledger, _log, _resolve
from ._state import STATE, locked


class State(str, enum.Enum):
    """The state of one model type in this process. A ``str``: ``record.state == "applied"`` works."""

    OFF = "off"  # patching is not enabled in this process
    PENDING = "pending"  # enabled and selected; its modeling module has not been imported (again) yet
    ABSENT = "absent"  # its modeling module does not exist in the installed transformers
    APPLIED = "applied"  # every selected target holds our kernel
    PARTIAL = "partial"  # some selected targets hold our kernel, the others (in ``stock``) run stock
    SKIPPED = "skipped"  # deliberately stock: not selected, excluded, no NPU, foreign patch, ...
    FAILED = "failed"  # an error; the model was rolled back and runs stock
    REVERTED = "reverted"  # was patched, then disable() put the originals back
    OVERRIDDEN = "overridden"  # was patched, then another library replaced a target, or the module ran again

    def __str__(self) -> str:
        return self.value

    def __reduce_ex__(
        self, protocol
    ):  # crosses process boundaries as a plain str: the receiver needs no npu_autopatch
        return str, (self.value,)


class ReasonCode(str, enum.Enum):
    """Why a model (or one of its targets) is not simply applied: the machine-readable half of a reason."""

    NOT_ENABLED = "not-enabled"  # off
    WAITING_FOR_IMPORT = "waiting-for-import"  # pending
    IMPORT_FAILED = "import-failed"  # pending: its import raised after we patched it; patched on the next
    MODULE_ABSENT = "module-absent"  # absent
    NOT_SELECTED = "not-selected"  # skipped: not in models=
    EXCLUDED = "excluded"  # skipped: in exclude=
    NO_KERNEL_SELECTED = "no-kernel-selected"  # skipped: kernels= selects none of its targets
    NO_TARGET = "no-target"  # skipped: a discovered module where the probes accepted no candidate
    NO_NPU = "no-npu"  # skipped: torch_npu does not import, or no NPU is visible
    FOREIGN_PATCH = "foreign-patch"  # skipped: another library replaced a target before us (force=True)
    KERNEL_UNSUPPORTED = "kernel-unsupported"  # partial/skipped: the installed torch_npu cannot run it
    MATH_DIFFERS = "math-differs"  # partial/skipped: the probe found the kernel does not reproduce stock
    OP_FAILED = "op-failed"  # partial: a fused op raised at run time; that target runs stock (or its
    # kernel's own fallback: Kernel.fallback) from then on
    TARGET_MISSING = "target-missing"  # failed: renamed or removed in this transformers
    OP_MISSING = "op-missing"  # failed: torch_npu lacks an op the kernel needs
    PROBE_ERROR = "probe-error"  # failed: the kernel raised while being checked
    BUILD_ERROR = "build-error"  # failed: the kernel raised while being built
    SWAP_FAILED = "swap-failed"  # failed: an attribute refused the replacement
    PLUGIN_ERROR = "plugin-error"  # failed: an entry-point plugin did not load
    HOOKS_FAILED = "hooks-failed"  # failed: the import hooks could not be armed
    INTERNAL_ERROR = "internal-error"  # failed: a bug of ours; the model runs stock
    DISABLED = "disabled"  # reverted
    REPLACED_AFTER_US = "replaced-after-us"  # overridden: another library's object now holds a target
    MODULE_REEXECUTED = "module-reexecuted"  # overridden: the module ran again and its new objects run stock

    def __str__(self) -> str:
        return self.value

    def __reduce_ex__(self, protocol):
        return str, (self.value,)


@dataclass(frozen=True)
class TargetReason:
    """Why one selected target runs stock: the code a program reads and the sentence a user reads."""

    code: ReasonCode
    text: str

    def as_dict(self) -> dict:
        """Plain JSON-ready data."""
        return {"code": self.code.value, "text": self.text}


@dataclass(frozen=True)
class PatchRecord:
    """The state of one model type, with the reason (and its code) whenever it is not simply applied.

    ``targets`` are the replaced attributes as ``"module:qualname"``; ``variants`` maps each to
    the kernel variant chosen for it; ``stock_reasons`` maps each selected target left stock to
    its code and why (``stock`` is the same with the codes only); ``shared`` maps targets of
    this model's module that run a kernel held by other models (a class two models share) to
    those models, whatever this model's own state. ``discovered``: the model is not in the
    registry; discovery built it from the candidates the probes accepted, and ``refused``
    maps the candidates they refused to why. ``cause`` is what concerns the model as a
    whole (a failure, a skip), ``notes`` what status() adds to it; ``reason`` reads them all
    as one sentence. ``calls`` maps each target that holds (or held) a replacement of this
    enable() to how its calls ran: ``{"fused": int, "stock": {reason: int}}`` (calls traced by
    torch.compile are not counted; docs/status-and-verify.md).
    """

    model: str
    module: str
    state: State
    cause: str | None = None
    kernels: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    code: ReasonCode | None = None
    variants: dict[str, str] = field(default_factory=dict)
    stock_reasons: dict[str, TargetReason] = field(default_factory=dict)
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)
    discovered: bool = False
    refused: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    calls: dict[str, dict] = field(default_factory=dict)

    @property
    def reason(self) -> str | None:
        """The cause, every target's reason and the notes, as one readable string (None: nothing to say)."""
        parts = (self.cause, *(r.text for r in self.stock_reasons.values()), *self.notes)
        return "; ".join(part for part in parts if part) or None

    @property
    def stock(self) -> dict[str, ReasonCode]:
        """{target left stock: its code}."""
        return {target: reason.code for target, reason in self.stock_reasons.items()}

    def as_dict(self) -> dict:
        """Plain JSON-ready data."""
        return {
            "model": self.model,
            "module": self.module,
            "state": self.state.value,
            "code": None if self.code is None else self.code.value,
            "reason": self.reason,
            "cause": self.cause,
            "kernels": list(self.kernels),
            "targets": list(self.targets),
            "variants": dict(self.variants),
            "stock": {target: reason.code.value for target, reason in self.stock_reasons.items()},
            "stock_reasons": {target: reason.as_dict() for target, reason in self.stock_reasons.items()},
            "shared": {target: list(holders) for target, holders in self.shared.items()},
            "discovered": self.discovered,
            "refused": dict(self.refused),
            "notes": list(self.notes),
            "calls": {
                target: {"fused": c["fused"], "stock": dict(c["stock"])} for target, c in self.calls.items()
            },
        }


def describe_calls(calls: dict) -> str:
    """One target's ``calls`` entry in words: ``{"fused": 3, "stock": {"eval": 1}}`` as
    'fused 3, stock 1 (eval: 1)'."""
    stocked = sum(calls["stock"].values())
    reasons = ", ".join(f"{reason}: {n}" for reason, n in calls["stock"].items())
    return f"fused {calls['fused']}, stock {stocked}" + (f" ({reasons})" if reasons else "")


class PatchError(Exception):
    """Strict mode: a selected model did not end ``applied``. The model has been rolled back.

    Deliberately neither an ImportError nor a RuntimeError: transformers' lazy modules turn
    those into ``ModuleNotFoundError("Could not import module ...")``, and a common ``except
    ImportError:`` fallback would swallow it. So ``from transformers import Qwen3ForCausalLM``
    raises this very exception.
    """


# --- status(): every model's record as things stand now (the caller holds the lock) -------


def live_records():
    """{model type: PatchRecord} of every model known now, each checked against what its module holds
    (status()'s answer; report(model) is _report's, about one live model)."""
    roots = _transformers_roots()
    out = {model_type: _live(model, roots) for model_type, model in list(STATE.models.items())}
    for model_type, model in list(STATE.discovered.items()):  # only those imported: each has a record
        if model_type in STATE.records:
            out[model_type] = _as_discovered(_live(model, roots), STATE.refused.get(model_type, {}))
    return out


def _as_discovered(rec, refused):
    """A discovered model's record: flagged, with the candidates the probes refused named in a note."""
    note = "discovered outside the model table (probed, no parity test in our CI)"
    if refused:
        note += f"; candidates the probes refused: {', '.join(refused)}"
    return replace(rec, discovered=True, refused=dict(refused), notes=(*rec.notes, note))


def _live(model, roots):
    """The record of ``model`` as things stand now (caller holds the lock)."""
    model_type = model.model_type
    rec = STATE.records.get(model_type)
    if rec is None:
        unwanted = STATE.config.wants(model_type) if STATE.config is not None and STATE.enabled else None
        if not STATE.enabled:
            state, code, reason = State.OFF, "not-enabled", "patching is not enabled"
        elif STATE.arm_error is not None:
            state, code, reason = (
                State.FAILED,
                "hooks-failed",
                f"the import hooks could not be armed: {STATE.arm_error}",
            )
        elif unwanted is not None:
            state, (code, reason) = State.SKIPPED, unwanted
        elif model.family and not _installed(model.module.split(".", 1)[0]):
            library = model.module.split(".", 1)[0]
            state, code, reason = State.ABSENT, "module-absent", f"{library} is not installed"
        elif _absent(model, roots):
            state, code, reason = (
                State.ABSENT,
                "module-absent",
                f"{model.module} is not in the installed transformers",
            )
        else:
            awaited = f"the import of {model.module}"
            if model.family:
                paths = ", ".join(t.paths[0] for t in model.targets)
                awaited = f"the import of the module of {model.module} that defines {paths}"
            state, code, reason = (State.PENDING, "waiting-for-import", f"waiting for {awaited}")
        rec = PatchRecord(model_type, model.module, state, reason, code=ReasonCode(code))
    elif rec.state in (State.APPLIED, State.PARTIAL) and model_type in STATE.placed:
        rec = _downgraded(rec, model_type) or rec
        _tell(rec)
        notes = tuple(filter(None, map(str, STATE.kernel_notes.get(model_type, {}).values())))
        if notes and rec.state in (State.APPLIED, State.PARTIAL):
            rec = replace(rec, notes=(*rec.notes, *notes))
    counted = {
        where: STATE.calls[where].as_dict()
        for where in (*rec.targets, *rec.stock_reasons)
        if where in STATE.calls
    }
    if counted:
        rec = replace(rec, calls=counted)
    module = sys.modules.get(model.module)
    if module is not None and model.targets:
        shared = _ledger.shared_targets(model, module)
        if shared:
            notes = rec.notes
            if rec.state not in (State.APPLIED, State.PARTIAL):  # one that holds kernels: its targets say it
                told = "; ".join(f"{at} (held by {', '.join(holders)})" for at, holders in shared.items())
                notes = (*notes, f"still runs kernels through targets it shares with other models: {told}")
            rec = replace(rec, shared=shared, notes=notes)
    return rec


def tell_overrides():
    """Log every target another library replaced after we patched it, once each (see _tell)."""
    with locked:
        for model_type, rec in list(STATE.records.items()):
            if rec.state in (State.APPLIED, State.PARTIAL) and model_type in STATE.placed:
                _tell(_downgraded(rec, model_type))


def _tell(rec):
    """A WARNING the first time ``rec`` says another library replaced a target of ours (lock held).

    ``replaced-after-us`` means that library's code runs where our kernel was, and nothing else
    would say so unless status() or report() were asked.
    """
    if rec is None or rec.code is not ReasonCode.REPLACED_AFTER_US:
        return
    told = (rec.model, rec.cause.replace(NO_CALLS_YET, ""))  # the evidence may go, the override stays
    if told in STATE.overrides_told:
        return
    STATE.overrides_told.add(told)
    _log.warning(
        f"{rec.model}: overridden (replaced-after-us): {rec.cause}; that code runs there, not our kernel "
        "(status() and report(model) say so)",
        insist=True,
    )


def _downgraded(rec, model_type):
    """The record downgraded when what it claims no longer holds, else None."""
    placed_module = STATE.placed[model_type][0]
    moved = _ledger.moved(model_type, sys.modules.get(placed_module.__name__))
    if moved is not None and moved.gone:
        return replace(
            rec,
            state=State.PENDING,
            code=ReasonCode.IMPORT_FAILED,
            cause=f"the import of {placed_module.__name__} failed after it was patched (did another "
            "library's post-import hook raise?); it is patched when imported again",
        )
    if moved is not None and moved.code != ReasonCode.REPLACED_AFTER_US.value:
        return replace(rec, state=State.OVERRIDDEN, code=ReasonCode(moved.code), cause=moved.why)
    overridden = [moved.why] if moved is not None else []  # every target whose code is another's now
    named = moved.why if moved is not None else ""  # those the module's own names already told
    latest = {key for _path, key in STATE.placed[model_type][1]}
    for key in STATE.held.get(model_type, ()):
        slot = STATE.slots.get(key)
        if slot is None or key not in latest:
            continue
        now = slot.current()
        if now is not slot.replacement:
            if slot.where not in named:
                told = f"{slot.where} was replaced after us by {_resolve.foreign_holder(now)}"
                overridden.append(_with_calls(slot.where, told))
            continue
        forward = _replaced_forward(slot)
        if forward is not None:
            overridden.append(_with_calls(slot.where, forward))
        if slot.bypassed:
            holders = ", ".join(slot.bypassed)
            overridden.append(
                _with_calls(
                    slot.where, f"{slot.where} is bypassed by a forward set on its instances by {holders}"
                )
            )
    if not overridden:
        return None
    return replace(
        rec,
        state=State.OVERRIDDEN,
        code=ReasonCode.REPLACED_AFTER_US,
        cause="; ".join(dict.fromkeys(overridden)),
    )


def _replaced_forward(slot):
    """Why ``slot``'s kernel no longer runs when it sits on another attribute of a module class (5.x
    experts: the attribute transformers' experts interface dispatches to; 4.x DeepSeek-V3's ``moe``)
    whose ``forward`` another library replaced after us (ms-swift's experts forward), else None."""
    owner = slot.owner
    if slot.kernel is None or not isinstance(owner, type) or slot.attr == "forward":
        return None
    forward = vars(owner).get("forward")
    if forward is None:
        return None  # no module class of its own (PreTrainedModel's bookkeeping methods)
    holder = _resolve.foreign_holder(forward, sys.modules.get(owner.__module__))
    if holder is None:
        return None
    where = f"{owner.__module__}:{owner.__qualname__}.forward"
    return f"{where} was replaced after us by {holder}, so {slot.where} no longer runs our kernel"


NO_CALLS_YET = " (our kernel there: 0 calls so far)"


def _with_calls(where, text):
    """``text`` with the fused-call count of the replacement at ``where`` when it is 0 (the evidence
    that another library's code ran in its place, once the model ran), else as it is."""
    calls = STATE.calls.get(where)
    if calls is not None and calls.fused == 0 and not calls.stock:
        return text + NO_CALLS_YET
    return text


def _transformers_roots():
    """The directories transformers' package lives in, found without importing it (or None)."""
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        return list(getattr(transformers, "__path__", ()))
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("transformers")
    return list(spec.submodule_search_locations or ()) if spec is not None else []


def _installed(package):
    """Whether a top-level package is imported or importable (found on sys.path, not imported)."""
    if sys.modules.get(package) is not None:
        return True
    import importlib.machinery

    return importlib.machinery.PathFinder.find_spec(package) is not None


def _absent(model, roots):
    """Whether a transformers.models.* module is missing from the installed transformers."""
    parts = model.module.split(".")
    if parts[:2] != ["transformers", "models"] or "*" in model.module:
        return False
    for root in roots:
        base = os.path.join(root, *parts[1:])
        if os.path.exists(base + ".py") or os.path.isdir(base):
            return False
    return True
