"""Forwards set on module instances over our kernels: found at the latest when a model first runs.

Class-level patching never reaches an instance whose own ``forward`` attribute was set: LLaMA-Factory's
NPU kernels bind theirs on each RMSNorm, MLP and MoE instance of a built model (``module.forward =
types.MethodType(...)``), and a user may do the same. The ledger cannot see instances, so this module
looks at them: ``record(modules)`` reads each module with a ``forward`` of its own whose class holds a
kernel of ours (its ``forward``, or another attribute it computes through: 5.x experts), follows the
wrappers to the function that runs (_classify._captured), and, when that is another library's code,
notes its holder on the slot (``Slot.bypassed``); status() then says ``overridden`` and names it
(_records), and the WARNING is logged once, on rank 0 (_records._tell).

``watch()`` puts one global forward pre-hook in torch (``register_module_forward_pre_hook``) each
time something is patched (after every import we hook): the first call of a module not seen yet (a
model's outermost module, when it first runs) records it and every module below it, and marks them
seen. Once a model holding one of our kernels has been read, the hook takes itself out, so that a
training loop's module calls do not pay for it (a global hook sends every module call through
torch's slow path) and torch.compile does not warn about it; until then, under torch.compile it
returns at once. A model built and run after that, with no import we hook in between (a second
model of a type already imported), and a forward set after its model first ran, are found by
``report(model)``, which records the model it reads.

Torch is imported by the caller (patching has happened); never at interpreter start.
"""

import sys
import weakref

from . import _log
from ._state import STATE, locked

_SEEN = weakref.WeakSet()  # modules already recorded, in the enable() of _GENERATION
_GENERATION = [None]
_HANDLE = []  # the global pre-hook's handle, once installed


def watch():
    """Install the global forward pre-hook until a model of ours runs (torch is imported by now)."""
    if _HANDLE:
        return
    torch = sys.modules.get("torch")
    if torch is None:
        return
    _HANDLE.append(torch.nn.modules.module.register_module_forward_pre_hook(_first_run))


def _unwatch():
    """Take the pre-hook out (a model holding our kernels was read)."""
    while _HANDLE:
        _HANDLE.pop().remove()


def _first_run(module, args):
    """The pre-hook: record a module (and everything below it) the first time it runs."""
    if not STATE.enabled:
        _unwatch()  # disable() came first: nothing of ours to bypass
        return None
    if sys.modules["torch"].compiler.is_compiling():
        return None
    if _GENERATION[0] != STATE.generation:  # a new enable(): its kernels are new, look again
        _SEEN.clear()
        _GENERATION[0] = STATE.generation
    if module in _SEEN:
        return None
    try:
        modules = list(module.modules())
        _SEEN.update(modules)
        new, ours = record(modules)
        if new:
            sys.modules["npu_autopatch._records"].tell_overrides()
        if ours:
            _unwatch()
    except Exception as exc:  # the user's forward must go on
        _log.warning(f"could not check the instances of {type(module).__qualname__} for forwards: {exc!r}")
    return None


def record(modules):
    """Note on our slots the other libraries' forwards set on these modules' instances: (whether any
    was new, whether any module holds one of our kernels)."""
    from ._classify import Ours  # before the lock: its first import reads the kernels' declarations

    with locked:
        slots = [
            slot
            for slot in STATE.slots.values()
            if slot.kernel is not None
            and isinstance(slot.owner, type)
            and "forward" in vars(slot.owner)
            and slot.current() is slot.replacement
        ]
        if not slots:
            return False, False
        ours = Ours(list(STATE.slots.values()))
        new = held = False
        for module in modules:
            holding = [slot for slot in slots if isinstance(module, slot.owner)]
            held = held or bool(holding)
            if not holding or "forward" not in vars(module):
                continue
            holder = _foreign(module, ours)
            for slot in holding:
                if holder is not None and holder not in slot.bypassed:
                    slot.bypassed[holder] = None
                    new = True
        return new, held


def _foreign(module, ours):
    """The name of the other library's function an instance's own ``forward`` runs, or None when it
    runs ours (through a wrapper: accelerate's hooks and mixed precision) or the model's own code
    (captured before): _classify.origin_of decides, as report(model) does."""
    from ._classify import FOREIGN, _captured, defining_module, function_of, origin_of

    inner = _captured(module)
    function = function_of(inner)
    if origin_of(inner, ours)[0] != FOREIGN or defining_module(function).startswith("npu_autopatch."):
        return None
    return f"{defining_module(function)}.{getattr(function, '__qualname__', type(function).__qualname__)}"
