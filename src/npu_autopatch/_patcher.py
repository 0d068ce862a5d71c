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
from ._records import APPLIED, FAILED, OVERRIDDEN, PENDING, REVERTED, SKIPPED, PatchRecord
from ._types import KERNEL_NAMES
from .kernels import KERNELS, choose_variant


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
_placed = {}  # model type -> (module object, ((path, key), ...)) it was applied to
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


def stock_function(obj):
    """The plain function behind a target: itself, or the function a callable module wraps.

    With the ``kernels`` package installed, transformers 5.x turns a function decorated
    with ``use_kernel_forward_from_hub`` into an ``nn.Module`` instance whose ``forward``
    calls the original function; so do not rely on ``inspect.isfunction``.
    """
    if type(obj) is types.FunctionType:
        return obj
    forward = getattr(type(obj), "forward", None)
    for cell in getattr(forward, "__closure__", None) or ():
        if type(cell.cell_contents) is types.FunctionType:
            return cell.cell_contents
    return None


def foreign_holder(obj, module=None):
    """None for the model's own code, else the name of whoever holds the target now.

    Own code is transformers' (or, for a plugin's or a remote-code model, the module's own
    file); anything defined elsewhere was put there by another library.
    """
    function = stock_function(obj)
    if function is not None:
        source = function.__code__.co_filename
        home = _transformers_dir()
        if (home and source.startswith(home)) or source == getattr(module, "__file__", None):
            return None
        return f"{function.__module__}.{function.__qualname__}"
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


def forget(model_type=None):
    """Drop the decisions of a previous enable() (or of one model); call after reverting."""
    if model_type is None:
        _records.clear()
    else:
        _records.pop(model_type, None)


def _plan(model, module, config, npu):
    """Resolve, check and probe every target; swap nothing. Returns (steps, notes)."""
    steps, notes = [], []
    for target in model.targets:
        if config.kernels is not None and target.kernel_name not in config.kernels:
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
            steps.append((key, slot, target.kernel_name, path))  # another model put our kernel here
            continue
        holder = foreign_holder(current, module)
        if holder is not None and not config.force:
            raise _Skip(f"{where} is already replaced by {holder}; pass force=True to replace it anyway")
        kernel = KERNELS.get(target.kernel) or target.kernel  # a built-in name, or a plugin's Kernel
        missing = [op for op in kernel.ops if not hasattr(npu, op)]
        if missing:
            raise _Failure(
                f"torch_npu has no {', '.join(missing)} (needed by {kernel.name}; torch_npu too old?)"
            )
        stock = stock_function(current) or current  # what the kernel must reproduce
        try:
            variant, mismatch = choose_variant(kernel, stock)
        except Exception as exc:
            raise _Failure(
                f"kernel {kernel.name} raised while checking {where}: {type(exc).__name__}: {exc}"
            ) from exc
        if variant is None:
            notes.append(f"{kernel.name} not applied to {where}: {mismatch}")
            continue
        try:
            replacement = variant.build(stock, npu, _ignore_error)
        except Exception as exc:
            raise _Failure(
                f"kernel {kernel.name} raised while building for {where}: {type(exc).__name__}: {exc}"
            ) from exc
        steps.append((key, _Slot(owner, attr, current, replacement, had_own, where), kernel.name, path))
    return steps, notes


def _ignore_error(exc, *tensors):
    """Placeholder on_error until the patcher demotes a target whose fused op raised (#9, #10)."""


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


def _commit(model_type, module, steps):
    """Swap every planned target in; on any error undo the swaps made so far and re-raise."""
    done = []
    try:
        for key, slot, _kernel, _path in steps:
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
    _placed[model_type] = (module, tuple((path, key) for key, _slot, _kernel, path in steps))


def _moved(model_type, module):
    """None while the model's kernels sit on what ``module`` holds now, else why not.

    A module whose body ran again (``importlib.reload``, or an import retried after it
    failed) holds new, stock classes and functions; our kernels sit on the old ones.
    """
    placed_module, placed = _placed[model_type]
    if module is None:
        return "gone"
    if module is not placed_module:
        return f"{module.__name__} was imported again after it was patched; its new objects run stock"
    for path, key in placed:
        found = _resolve(module, (path,))
        if found is None or (id(found[1]), found[2]) != key:
            return f"{module.__name__} was executed again after it was patched; its new objects run stock"
        slot = _slots[key]
        if found[3] is not slot.replacement and foreign_holder(found[3], module) is None:
            return f"{slot.where} holds transformers' own code again (module executed again?)"
    return None


def _load_plugin(model):
    """A plugin's targets, imported now that its module is: a failure fails that model only."""
    try:
        return tuple(model.load(model))
    except Exception as exc:
        raise _Failure(f"{model.load.source} failed to load: {type(exc).__name__}: {exc}") from exc


def apply(model, module, config):
    """Patch one model in an imported module; return its PatchRecord.

    Raises PatchError only in strict mode, after rolling the model back.
    """
    if model.model_type in _held:
        if _moved(model.model_type, module) is None:
            return _records[model.model_type]  # the hook and enable() may both get here
        # The module body ran again: let go of (and restore) its earlier objects, patch the new.
        revert(model.model_type)
    reason = config.wants(model.model_type)
    if reason is not None:
        return record(model, SKIPPED, reason)
    npu, reason = _decide_device()
    if npu is None:
        rec = record(model, SKIPPED, reason)
        return _strict_check(config, rec)
    try:
        if model.load is not None and not model.targets:
            model.targets = _load_plugin(model)
        steps, notes = _plan(model, module, config, npu)
        if not steps:
            raise _Skip("no target matches its kernel's math: " + "; ".join(notes or ["no kernel selected"]))
        _commit(model.model_type, module, steps)
    except _Skip as skip:
        rec = record(model, SKIPPED, str(skip))
        _log.warning(f"{model.model_type}: skipped: {skip}")
        return _strict_check(config, rec)
    except Exception as exc:
        cause = str(exc) if isinstance(exc, _Failure) else f"{type(exc).__name__}: {exc}"
        rec = record(model, FAILED, cause)
        _log.warning(f"{model.model_type}: failed, left stock: {cause}")
        return _strict_check(config, rec)
    used = {kernel for _key, _slot, kernel, _path in steps if kernel is not None}
    kernels = [k for k in (*KERNEL_NAMES, *sorted(used - set(KERNEL_NAMES))) if k in used]
    targets = [slot.where for _key, slot, _kernel, _path in steps]
    rec = record(model, APPLIED, "; ".join(notes) or None, kernels, targets)
    _log.info(f"{model.model_type}: applied {', '.join(kernels)} to {len(targets)} targets")
    return rec


def _strict_check(config, rec):
    if config.strict:
        raise PatchError(f"npu_autopatch strict mode: {rec.model} {rec.state}: {rec.reason}")
    return rec


def revert(model_type):
    """Take one model's kernels out again (other holders of a shared target keep it)."""
    _placed.pop(model_type, None)
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
    """The record, downgraded when what it claims no longer holds.

    'overridden' if another library replaced one of our targets, or the module body ran
    again without being patched; 'pending' if the import failed after we patched it.
    """
    rec = _records.get(model_type)
    if rec is None or rec.state != APPLIED:
        return rec

    def downgraded(state, reason):
        return PatchRecord(rec.model, rec.module, state, reason, rec.kernels, rec.targets)

    patched_module = _placed[model_type][0]  # rec.module may be a pattern (trust_remote_code)
    moved = _moved(model_type, sys.modules.get(patched_module.__name__))
    if moved == "gone":
        return downgraded(
            PENDING,
            f"the import of {rec.module} failed after it was patched (did another library's "
            "post-import hook raise?); it is patched when imported again",
        )
    if moved is not None:
        return downgraded(OVERRIDDEN, moved)
    for key in _held.get(model_type, ()):
        slot = _slots[key]
        now = slot.current()
        if now is not slot.replacement:
            return downgraded(OVERRIDDEN, f"{slot.where} was replaced after us by {foreign_holder(now)}")
    return rec
