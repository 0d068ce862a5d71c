"""Per-model transactions over one ledger of replaced attributes.

A model's patch is all or nothing: every target is resolved, checked against its owner and
probed against its kernel first (plan); only then are the attributes swapped (commit); if a
swap fails, the swaps already made are undone (rollback). Nothing here ever raises into an
importer, except a PatchError in strict mode, after the rollback.

Ownership: two models may share one target object (in transformers 4.57, Qwen2.5-VL uses
qwen2's ``Qwen2RMSNorm``). The ledger keys each replaced attribute by (owner object,
attribute name) and records which models hold it. The first model swaps it in, later ones
join, and the original comes back only when the last holder lets go, so ``exclude``,
a failure of one model and ``disable()`` never pull a kernel from under another model.

Callers (_control) hold the package lock around every function here.
"""

import os
import sys
import types

from . import _device, _log
from ._errors import PatchError
from ._records import APPLIED, FAILED, OVERRIDDEN, REVERTED, SKIPPED, PatchRecord
from .kernels import KERNELS, choose_variant
from .models import KERNEL_NAMES


class _Slot:
    """One attribute we replaced, what it was, and which models rely on it."""

    __slots__ = ("attr", "had_own", "holders", "original", "owner", "replacement", "where")

    def __init__(self, owner, attr, original, replacement, had_own, where):
        self.owner = owner  # kept alive so that id(owner) in the ledger key stays valid
        self.attr = attr
        self.original = original
        self.replacement = replacement
        self.had_own = had_own  # False: the class inherited it; restoring means deleting ours
        self.holders = set()
        self.where = where

    def current(self):
        return _current(self.owner, self.attr)


_slots = {}  # (id(owner), attr) -> _Slot
_held = {}  # model type -> ledger keys it holds
_records = {}  # model type -> PatchRecord of the last decision
_device_decision = None  # (torch_npu module or None, reason or None), per enable()


class _Failure(Exception):
    """A model cannot be patched; the message names the target and the cause."""


class _Skip(Exception):
    """A model is deliberately left stock; the message says why."""


def _current(owner, attr):
    if isinstance(owner, type):
        return owner.__dict__.get(attr, getattr(owner, attr, None))
    return getattr(owner, attr, None)


def _where(module, owner, path):
    """'module:qualname' of a target, naming the module that really defines the owner."""
    if isinstance(owner, type):
        return f"{owner.__module__}:{owner.__qualname__}.{path.rsplit('.', 1)[-1]}"
    return f"{module.__name__}:{path}"


def _resolve(module, paths):
    """(path, owner, attr, current, had_own) for the first path that exists, else None."""
    for path in paths:
        *owner_path, attr = path.split(".")
        owner = module
        try:
            for name in owner_path:
                owner = getattr(owner, name)
            if isinstance(owner, type):
                had_own = attr in owner.__dict__
                current = owner.__dict__[attr] if had_own else getattr(owner, attr)
            else:
                had_own, current = True, getattr(owner, attr)
        except AttributeError:
            continue
        return path, owner, attr, current, had_own
    return None


def _transformers_dir():
    transformers = sys.modules.get("transformers")
    path = getattr(transformers, "__file__", None)
    return os.path.dirname(path) + os.sep if path else None


def foreign_holder(obj):
    """None for transformers' own code, else the name of whoever holds the target now."""
    if type(obj) is types.FunctionType:
        home = _transformers_dir()
        if home and obj.__code__.co_filename.startswith(home):
            return None
        return f"{obj.__module__}.{obj.__qualname__}"
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__} object"


def _decide_device():
    """torch_npu or None, decided once per enable() at the first hook, logged once."""
    global _device_decision
    if _device_decision is None:
        _device_decision = _device.probe()
        npu, reason = _device_decision
        if npu is None:
            _log.warning(f"NPU kernels not used, models run stock: {reason}")
    return _device_decision


def reset_device():
    global _device_decision
    _device_decision = None


def describe(model, state, reason=None, kernels=(), targets=()):
    return PatchRecord(model.model_type, model.module, state, reason, tuple(kernels), tuple(targets))


def record(model, state, reason=None, kernels=(), targets=()):
    rec = _records[model.model_type] = describe(model, state, reason, kernels, targets)
    return rec


def forget():
    """Drop the decisions of a previous enable(); call after revert_all()."""
    _records.clear()


def _plan(model, module, config, npu):
    """Resolve, check and probe every target; swap nothing. Returns (steps, notes)."""
    steps, notes = [], []
    for target in model.targets:
        if config.kernels is not None and target.kernel not in config.kernels:
            continue
        found = _resolve(module, target.paths)
        if found is None:
            raise _Failure(
                f"target {' or '.join(target.paths)} not found in {module.__name__} "
                "(renamed or removed in this transformers version?)"
            )
        path, owner, attr, current, had_own = found
        where = _where(module, owner, path)
        key = (id(owner), attr)
        slot = _slots.get(key)
        if slot is not None and current is slot.replacement:
            steps.append((key, slot, None))  # another model already put our kernel here
            continue
        holder = foreign_holder(current)
        if holder is not None and not config.force:
            raise _Skip(f"{where} is already replaced by {holder}; pass force=True to replace it anyway")
        kernel = KERNELS[target.kernel]
        missing = [op for op in kernel.ops if not hasattr(npu, op)]
        if missing:
            raise _Failure(
                f"torch_npu has no {', '.join(missing)} (needed by {kernel.name}; torch_npu too old?)"
            )
        try:
            variant, mismatch = choose_variant(kernel, current)
        except Exception as exc:
            raise _Failure(
                f"kernel {kernel.name} raised while checking {where}: {type(exc).__name__}: {exc}"
            ) from exc
        if variant is None:
            notes.append(f"{kernel.name} not applied to {where}: {mismatch}")
            continue
        try:
            replacement = variant.build(current, npu)
        except Exception as exc:
            raise _Failure(
                f"kernel {kernel.name} raised while building for {where}: {type(exc).__name__}: {exc}"
            ) from exc
        steps.append((key, _Slot(owner, attr, current, replacement, had_own, where), kernel.name))
    return steps, notes


def _release(key, model_type):
    """Drop one holder; restore the original when nobody holds the slot any more.

    If another library replaced our kernel in the meantime, its object stays in place.
    """
    slot = _slots.get(key)
    if slot is None:
        return
    slot.holders.discard(model_type)
    if slot.holders:
        return
    del _slots[key]
    if slot.current() is not slot.replacement:
        return
    if slot.had_own:
        setattr(slot.owner, slot.attr, slot.original)
    else:
        delattr(slot.owner, slot.attr)


def _commit(model_type, steps):
    """Swap every planned target in; on any error undo the swaps made so far and re-raise."""
    done = []
    try:
        for key, slot, _kernel in steps:
            if key not in _slots:
                setattr(slot.owner, slot.attr, slot.replacement)
                _slots[key] = slot
                if slot.current() is not slot.replacement:  # e.g. a metaclass that rewrites attributes
                    slot.holders.add(model_type)
                    done.append(key)
                    raise _Failure(f"{slot.where} did not keep the replacement after setattr")
            slot.holders.add(model_type)
            done.append(key)
    except BaseException:
        for key in reversed(done):
            _release(key, model_type)
        raise
    _held[model_type] = done


def apply(model, module, config):
    """Patch one model in an imported module; return its PatchRecord.

    Raises PatchError only in strict mode, after rolling the model back.
    """
    if model.model_type in _held:  # already applied: the hook and enable() may both get here
        return _records[model.model_type]
    reason = config.wants(model.model_type)
    if reason is not None:
        return record(model, SKIPPED, reason)
    npu, reason = _decide_device()
    if npu is None:
        rec = record(model, SKIPPED, reason)
        return _strict_check(config, rec)
    try:
        steps, notes = _plan(model, module, config, npu)
        if not steps:
            raise _Skip("no target matches its kernel's math: " + "; ".join(notes or ["no kernel selected"]))
        _commit(model.model_type, steps)
    except _Skip as skip:
        rec = record(model, SKIPPED, str(skip))
        _log.warning(f"{model.model_type}: skipped: {skip}")
        return _strict_check(config, rec)
    except Exception as exc:
        cause = str(exc) if isinstance(exc, _Failure) else f"{type(exc).__name__}: {exc}"
        rec = record(model, FAILED, cause)
        _log.warning(f"{model.model_type}: failed, left stock: {cause}")
        return _strict_check(config, rec)
    kernels = [k for k in KERNEL_NAMES if any(kernel == k for _key, _slot, kernel in steps)]
    targets = [slot.where for _key, slot, _kernel in steps]
    rec = record(model, APPLIED, "; ".join(notes) or None, kernels, targets)
    _log.info(f"{model.model_type}: applied {', '.join(kernels)} to {len(targets)} targets")
    return rec


def _strict_check(config, rec):
    if config.strict:
        raise PatchError(f"npu_autopatch strict mode: {rec.model} {rec.state}: {rec.reason}")
    return rec


def revert(model_type):
    """Take one model's kernels out again (other holders of a shared target keep it)."""
    for key in _held.pop(model_type, ()):
        _release(key, model_type)
    rec = _records.get(model_type)
    if rec is not None and rec.state == APPLIED:
        _records[model_type] = PatchRecord(
            rec.model, rec.module, REVERTED, "disable() restored the originals", rec.kernels, rec.targets
        )


def revert_all():
    for model_type in list(_held):
        revert(model_type)
    reset_device()


def live_record(model_type):
    """The record, downgraded to 'overridden' if another library replaced one of our targets."""
    rec = _records.get(model_type)
    if rec is None or rec.state != APPLIED:
        return rec
    for key in _held.get(model_type, ()):
        slot = _slots[key]
        now = slot.current()
        if now is not slot.replacement:
            return PatchRecord(
                rec.model,
                rec.module,
                OVERRIDDEN,
                f"{slot.where} was replaced after us by {foreign_holder(now)}",
                rec.kernels,
                rec.targets,
            )
    return rec
