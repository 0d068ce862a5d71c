"""The ledger: every attribute we replaced, what it was, and which models hold it.

Stdlib only: status() reads it without importing torch. Callers hold the package lock.
Finding a target and telling whose code it is belongs to _resolve.

Ownership: two models may share one target object (in transformers 4.57, Qwen2.5-VL uses
qwen2's ``Qwen2RMSNorm``). Each replaced attribute is keyed by (owner object, attribute
name) and records which models hold it. The first model swaps it in, later ones join, and
the original comes back only when the last holder lets go, so ``exclude``, a failure of one
model and ``disable()`` never pull a kernel from under another model. An owner is a class,
a module, or a dict (transformers' experts registry).
"""

import collections

from ._resolve import current, foreign_holder, resolve
from ._state import STATE

ORIGINAL = object()  # Slot(seen=...) default: the plan found the original there

# Why a model's kernels no longer sit on what its module holds (moved()): ``gone`` when the module is
# no longer imported (its import failed after patching), else ``code`` (a ReasonCode value) and ``why``.
Moved = collections.namedtuple("Moved", "gone code why")


class Slot:
    """One attribute we replaced, what it was, and which models rely on it."""

    __slots__ = (
        "attr",
        "bypassed",
        "had_own",
        "holders",
        "kernel",
        "note",
        "original",
        "owner",
        "refresh",
        "replacement",
        "seen",
        "variant",
        "where",
    )

    def __init__(
        self,
        owner,
        attr,
        original,
        replacement,
        had_own,
        where,
        kernel=None,
        variant=None,
        seen=ORIGINAL,
        refresh=None,
        note=None,
    ):
        self.owner = owner  # kept alive so that id(owner) in the ledger key stays valid
        self.attr = attr
        self.original = original
        self.replacement = replacement
        self.had_own = had_own  # False: the class inherited it; restoring means deleting ours
        self.holders = set()
        self.where = where  # the target as status() names it
        self.kernel = kernel  # None for plumbing (transformers' experts registry and its default)
        self.variant = variant
        self.seen = original if seen is ORIGINAL else seen  # what the plan found there (checked at commit)
        self.refresh = refresh  # the kernel's refresh(): a cache of this attribute follows each swap
        self.note = note  # why this variant and not an earlier one (a requirement refused that), or None
        # Who set a ``forward`` of their own on instances of this class, over our kernel ({holder: None},
        # in the order met; _instances): those instances run that code, not ours.
        self.bypassed = {}

    def current(self):
        return current(self.owner, self.attr)


def _put(owner, attr, value):
    if isinstance(owner, dict):
        owner[attr] = value
    else:
        setattr(owner, attr, value)


def _remove(owner, attr):
    if isinstance(owner, dict):
        owner.pop(attr, None)
    else:
        delattr(owner, attr)


def _restore(slot):
    """Put back what ``slot`` replaced, unless another library replaced our kernel meanwhile."""
    if slot.current() is not slot.replacement:
        return
    if slot.had_own:
        _put(slot.owner, slot.attr, slot.original)
    else:
        _remove(slot.owner, slot.attr)
    if slot.refresh is not None:
        slot.refresh()


def release(key, model_type):
    """Drop one holder; restore the original when nobody holds the slot any more.

    If another library replaced our kernel in the meantime, its object stays in place.
    """
    slot = STATE.slots.get(key)
    if slot is None:
        return
    slot.holders.discard(model_type)
    if slot.holders:
        return
    del STATE.slots[key]
    _restore(slot)


def put_back(key, replacement):
    """Put the stock object back at ``key`` for every holder (its kernel failed at run time).

    Returns the slot taken out of the ledger, or None when ``key`` no longer holds
    ``replacement`` (another call put it back first, or disable() came).
    """
    slot = STATE.slots.get(key)
    if slot is None or slot.replacement is not replacement:
        return None
    del STATE.slots[key]
    _restore(slot)
    for model_type in slot.holders:
        held = STATE.held.get(model_type, [])
        if key in held:
            held.remove(key)
    return slot


def commit(model_type, module, steps, placed_paths):
    """Swap every step's replacement in; on any error undo the swaps made so far and re-raise.

    ``steps`` are (key, slot) pairs; a key already in the ledger is joined, not swapped.
    A model that already holds slots (its module ran again) keeps them: the objects of the
    earlier execution, still used by models built before, stay patched.
    """
    done = []
    try:
        for key, slot in steps:
            existing = STATE.slots.get(key)
            if (
                existing is not None
                and existing is not slot
                and existing.current() is not existing.replacement
            ):
                _drop_stale(key)  # the module ran again and rebound the name: that slot restores nothing
            if key not in STATE.slots:
                _put(slot.owner, slot.attr, slot.replacement)
                STATE.slots[key] = slot
                if slot.refresh is not None:
                    slot.refresh()
                if slot.current() is not slot.replacement:  # e.g. a metaclass that rewrites attributes
                    slot.holders.add(model_type)
                    done.append(key)
                    raise SwapRefused(f"{slot.where} did not keep the replacement after setattr")
            STATE.slots[key].holders.add(model_type)
            done.append(key)
    except BaseException:
        for key in reversed(done):
            if key not in STATE.held.get(model_type, ()):
                release(key, model_type)
        raise
    held = STATE.held.setdefault(model_type, [])
    held.extend(key for key in done if key not in held)
    STATE.placed[model_type] = (module, tuple(placed_paths))


def _drop_stale(key):
    """Forget a slot whose attribute no longer holds our replacement (its module ran again)."""
    slot = STATE.slots.pop(key)
    for model_type in slot.holders:
        held = STATE.held.get(model_type, [])
        if key in held:
            held.remove(key)


class SwapRefused(Exception):
    """An attribute did not keep the replacement."""


def release_all(model_type):
    """Take one model's kernels out again (other holders of a shared target keep it)."""
    STATE.placed.pop(model_type, None)
    for key in STATE.held.pop(model_type, ()):
        release(key, model_type)


def moved(model_type, module):
    """None while the model's kernels sit on what ``module`` holds now, else why not (a ``Moved``).

    A module whose body ran again unpatched (``importlib.reload`` or an import retried while
    patching was off) holds new, stock objects. Another library may also have rebound a
    name to its own class or function (Liger-Kernel's ``apply_liger_kernel_to_*``).
    """
    placed_module, placed = STATE.placed[model_type]
    if module is None:
        return Moved(True, None, None)
    name = placed_module.__name__
    if module is not placed_module:
        return Moved(
            False,
            "module-reexecuted",
            f"{name} was imported again after it was patched; its new objects run stock",
        )
    replaced = []  # every target another library rebound, named with its holder
    for path, key in placed:
        found = resolve(module, (path,))
        slot = STATE.slots.get(key)
        if found is None or slot is None:
            continue
        if (id(found.owner), found.attr) != key or found.current is not slot.replacement:
            holder = foreign_holder(found.current, module, found.owner)
            if holder is not None:
                replaced.append(f"{name}:{path} was replaced after us by {holder}")
                continue
            if replaced:
                continue  # told with the others; a module run again is what its first move says
            if (id(found.owner), found.attr) != key:
                why = f"{name} was executed again after it was patched; its new objects run stock"
                return Moved(False, "module-reexecuted", why)
            why = f"{slot.where} holds transformers' own code again (module executed again?)"
            return Moved(False, "module-reexecuted", why)
    if replaced:
        return Moved(False, "replaced-after-us", "; ".join(replaced))
    return None


def shared_targets(model, module):
    """{target: models holding it} for this model's targets that run a kernel it does not hold."""
    shared = {}
    for target in model.targets:
        found = resolve(module, target.paths)
        if found is None:
            continue
        key = (id(found.owner), found.attr)
        slot = STATE.slots.get(key)
        if slot is not None and found.current is slot.replacement and model.model_type not in slot.holders:
            shared[slot.where] = tuple(sorted(slot.holders))
    return shared
