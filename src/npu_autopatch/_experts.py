"""The MoE kernel as a transformers 5.x experts implementation, not a replaced ``forward``.

transformers 5.x decorates each fused ``*Experts`` class with ``use_experts_implementation``:
its ``forward`` looks up ``config._experts_implementation`` in ``ALL_EXPERTS_FUNCTIONS`` at
every call, and ``model.set_experts_implementation(...)`` switches it. Replacing that
``forward`` would switch the switch off. So we plug into it instead (three ledger slots):

1. the experts class gets our built function as a class attribute (``ATTR``), per class;
2. ``ALL_EXPERTS_FUNCTIONS`` gets one entry, ``KEY``, whose function runs the class's
   attribute (shared by every patched model);
3. each root ``*PreTrainedModel`` class of the patched modeling module answers ``KEY`` from
   ``get_correct_experts_implementation`` when nothing was requested, so models built from
   then on use the kernel by default; an explicit ``experts_implementation`` (at load, or
   ``set_experts_implementation``) wins, and status() says which were asked for.

A model built before patching keeps the implementation it resolved then (transformers'
``grouped_mm``); ``model.set_experts_implementation(KEY)`` switches it. disable() takes our
function out of the registry, but the name stays, as an alias of transformers' own
``grouped_mm``: a model built while patching was on has ``KEY`` in its config and must keep
running (stock) after disable().

The built function's per-instance fallback (contract C4) is transformers' ``grouped_mm``
implementation, never the dispatcher, so it cannot recurse into us.
"""

import sys
import types

from . import _ledger
from ._state import STATE

KEY = "npu_grouped_mm"
ATTR = "_npu_autopatch_experts"
DEFAULT = "grouped_mm"  # what transformers runs when nothing is requested
_GET_CORRECT = "get_correct_experts_implementation"


def interface_of(obj):
    """transformers' experts interface if ``obj`` is a ``use_experts_implementation`` forward, else None."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or type(obj) is not types.FunctionType or getattr(obj, "__wrapped__", None) is None:
        return None
    for cell in obj.__closure__ or ():
        if isinstance(cell.cell_contents, moe.ExpertsInterface):
            return cell.cell_contents
    return None


def npu_grouped_mm(self, hidden_states, top_k_index, top_k_weights):
    """The experts implementation ``KEY``: the kernel patched into this experts class."""
    forward = getattr(type(self), ATTR, None)
    if forward is None:  # a class we did not patch (or took out again), still set to KEY
        # Another library may have rewrapped the forward without keeping ``__wrapped__``.
        forward = _stock(getattr(type(self).forward, "__wrapped__", None))
    return forward(self, hidden_states, top_k_index, top_k_weights)


def _stock(original_forward):
    """transformers' default implementation for a class; its own loop if that is missing."""
    moe = sys.modules["transformers.integrations.moe"]
    return moe.ALL_EXPERTS_FUNCTIONS.get(DEFAULT) or original_forward


def fallback(wrapper):
    """The ``stock`` an experts kernel falls back to: transformers' default, not the dispatcher."""
    original = wrapper.__wrapped__

    def experts_stock(self, hidden_states, top_k_index, top_k_weights):
        return _stock(original)(self, hidden_states, top_k_index, top_k_weights)

    experts_stock.__wrapped__ = original
    return experts_stock


def _root_model_classes(module):
    """The *PreTrainedModel classes of the module that no other of its model classes derives from."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if base is None:
        return []
    mine = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, base) and c.__module__ == module.__name__
    ]
    return [c for c in mine if not any(o is not c and issubclass(c, o) for o in mine)]


def _get_correct(model_type, stock):
    def get_correct_experts_implementation(self, requested_experts):
        if requested_experts is None:
            return KEY
        if requested_experts != KEY:  # an explicit choice wins; status() lists it
            STATE.explicit_experts.setdefault(model_type, set()).add(requested_experts)
        return stock(self, requested_experts)

    get_correct_experts_implementation.__wrapped__ = stock
    return get_correct_experts_implementation


def slots(model_type, module, owner, path, wrapper, interface, kernel_name, variant_name, replacement):
    """The ledger steps (key, slot) and placed paths that install ``replacement`` for one experts class."""
    class_path = path.rsplit(".", 1)[0]
    where = f"{owner.__module__}:{owner.__qualname__}.forward"
    steps = [
        (
            (id(owner), ATTR),
            _ledger.Slot(owner, ATTR, None, replacement, False, where, kernel_name, variant_name),
        )
    ]
    placed = [(f"{class_path}.{ATTR}", (id(owner), ATTR))]
    # One entry for every patched model (joined if already in the ledger). What it held before
    # (nothing, or the alias an earlier disable() left) comes back as the alias.
    registry = type(interface)._global_mapping
    current = registry.get(KEY)
    alias = registry.get(DEFAULT) if current in (None, npu_grouped_mm) else current
    where_key = f"ALL_EXPERTS_FUNCTIONS[{KEY!r}]"
    slot = _ledger.Slot(registry, KEY, alias, npu_grouped_mm, True, where_key, seen=current)
    steps.append(((id(registry), KEY), slot))
    for cls in _root_model_classes(module):
        had_own = _GET_CORRECT in cls.__dict__
        stock = cls.__dict__[_GET_CORRECT] if had_own else getattr(cls, _GET_CORRECT)
        key = (id(cls), _GET_CORRECT)
        slot = _ledger.Slot(
            cls,
            _GET_CORRECT,
            stock,
            _get_correct(model_type, stock),
            had_own,
            f"{cls.__module__}:{cls.__qualname__}.{_GET_CORRECT}",
        )
        steps.append((key, slot))
        placed.append((f"{cls.__name__}.{_GET_CORRECT}", key))
    return steps, placed


def explicit_note(model_type):
    """The note status() adds when users asked for another implementation, else None."""
    asked = sorted(STATE.explicit_experts.get(model_type, ()))
    if not asked:
        return None
    names = ", ".join(f"experts_implementation={name!r}" for name in asked)
    return f"models given {names} run that, not the moe kernel (an explicit choice wins)"
