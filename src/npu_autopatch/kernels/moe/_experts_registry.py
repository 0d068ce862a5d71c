"""How the MoE kernel installs on transformers 5.x: as an experts implementation, not a replaced ``forward``.

transformers 5.x decorates each fused ``*Experts`` class with ``use_experts_implementation``:
its ``forward`` looks up ``config._experts_implementation`` in ``ALL_EXPERTS_FUNCTIONS`` at
every call, and ``model.set_experts_implementation(...)`` switches it. Replacing that
``forward`` would switch the switch off. So the kernel's ``install`` (``Kernel.install``) plugs
into the dispatch instead, with ledger entries the patcher commits all or nothing:

1. the experts class gets our built function as a class attribute (``ATTR``), per class;
2. ``ALL_EXPERTS_FUNCTIONS[DEFAULT]`` (transformers' "grouped_mm", what a model runs when
   nothing was asked for) and ``ALL_EXPERTS_FUNCTIONS[KEY]`` become ``npu_grouped_mm``, which
   runs the class's attribute, else what "grouped_mm" ran before us;
3. each root ``*PreTrainedModel`` class of the patched modeling module notes explicit choices
   in ``get_correct_experts_implementation`` (for status()), and returns what stock returns.

Nothing of ours is written into the user's objects (issue 16): a model's config keeps
transformers' own value, so a model built, saved, pickled or sent to a worker while patched
runs anywhere, and one built elsewhere gets the kernel here, because the kernel is reached at
dispatch time by transformers' own name. An explicit choice wins: another implementation
("eager", "batched_mm", a user's own) is simply not ours; an explicit "grouped_mm" (at load or
through ``set_experts_implementation``) is told apart from the default only in this process
(``STATE.default_experts`` and ``STATE.stock_experts``, weakly keyed by config), so it runs
transformers' function here; in another process it is the default again.
``KEY`` stays a registered name for code that asks for it; disable() leaves it as an alias of
transformers' "grouped_mm", so a model given it keeps running (stock).

The built function's per-instance fallback (contract C4) is what "grouped_mm" ran before us,
never the dispatcher, so it cannot recurse into us.

What report(model) needs of this dispatch lives here too (the kernel's ``Report`` hooks): which
implementation an experts instance runs, why one of a patched class runs another, and that a 5.x
MoE block leaves the computation to the experts module inside it.

The state this keeps across calls is the package's (``_state.STATE``, its one owner): the configs
given the default or an explicit "grouped_mm", the ledger's slots (what "grouped_mm" held before
us), and the note status() adds for a model whose users chose another implementation.
"""

import sys
import types

from ..._state import STATE

KERNEL = "moe"  # the kernel this installs (kernels/moe: MOE)
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
    """The experts implementation behind ``DEFAULT`` and ``KEY`` while patched."""
    return implementation(self)(self, hidden_states, top_k_index, top_k_weights)


def implementation(experts):
    """The function ``npu_grouped_mm`` runs for this experts instance: the kernel, or stock's."""
    forward = getattr(type(experts), ATTR, None)
    if forward is None or asked_for_stock(getattr(experts, "config", None)):
        return transformers_default()
    return forward


def asked_for_stock(config):
    """Whether this config's model was explicitly given transformers' "grouped_mm" in this process."""
    return (
        config is not None
        and getattr(config, "_experts_implementation", None) == DEFAULT
        and STATE.stock_experts.get(id(config)) is config
    )


def transformers_default():
    """What "grouped_mm" ran before we took its entry: transformers' grouped matmul, or whoever
    registered it; never ``npu_grouped_mm`` itself."""
    moe = sys.modules["transformers.integrations.moe"]
    registry = type(moe.ALL_EXPERTS_FUNCTIONS)._global_mapping
    slot = STATE.slots.get((id(registry), DEFAULT))
    function = slot.original if slot is not None else registry.get(DEFAULT)
    return moe.grouped_mm_experts_forward if function in (None, npu_grouped_mm) else function


def fallback(wrapper):
    """The ``stock`` an experts kernel falls back to: what "grouped_mm" ran, not the dispatcher."""
    original = wrapper.__wrapped__

    def experts_stock(self, hidden_states, top_k_index, top_k_weights):
        return transformers_default()(self, hidden_states, top_k_index, top_k_weights)

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


class _AskedFor(set):
    """The experts implementations users asked for a model's experts: the kernel's note in status()
    (``STATE.kernel_notes``, read with ``str()``)."""

    def __str__(self):
        names = ", ".join(f"experts_implementation={name!r}" for name in sorted(self))
        return f"models given {names} run that, not the moe kernel (an explicit choice wins)"


def _get_correct(model_type, stock):
    def get_correct_experts_implementation(self, requested_experts):
        configs = _configs(self.config)
        # A submodel built on its parent's config is asked again with the value its parent's
        # default wrote there: that is still the default, not a choice.
        defaulted = STATE.default_experts.get(id(configs[0])) is configs[0]
        explicit = requested_experts is not None and not (requested_experts == DEFAULT and defaulted)
        if explicit and requested_experts != KEY:  # an explicit choice wins; status() lists it
            notes = STATE.kernel_notes.setdefault(model_type, {})
            notes.setdefault(KERNEL, _AskedFor()).add(requested_experts)
        for config in configs:
            STATE.default_experts.pop(id(config), None)
            STATE.stock_experts.pop(id(config), None)
            if not explicit:
                STATE.default_experts[id(config)] = config
            elif requested_experts == DEFAULT:
                STATE.stock_experts[id(config)] = config
        return stock(self, requested_experts)

    get_correct_experts_implementation.__wrapped__ = stock
    return get_correct_experts_implementation


def _configs(config):
    """A config and its sub-configs (a VL model's text config holds the experts' setting)."""
    found, stack = [], [config]
    while stack:
        config = stack.pop()
        if config is not None and all(config is not seen for seen in found):
            found.append(config)
            stack += [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]
    return found


# --- the kernel's install (Kernel.install) -----------------------------------------------


def install(target, build, slot):
    """The ledger entries that install the kernel for a 5.x experts class, through transformers'
    experts registry; None for any other target (4.x's sparse blocks: their attribute is swapped)."""
    interface = interface_of(target.current)
    if interface is None:
        return None
    replacement = build(fallback(target.current))
    class_path = target.path.rsplit(".", 1)[0]
    entries = [slot(target.owner, ATTR, None, replacement, False, target.where, path=f"{class_path}.{ATTR}")]
    # Two registry entries for every patched model (joined if already in the ledger): transformers'
    # default name, and ours. What KEY held before (nothing, or the alias an earlier disable()
    # left) comes back as transformers' "grouped_mm", so a model given KEY keeps running.
    registry = type(interface)._global_mapping
    for name in (DEFAULT, KEY):
        current = registry.get(name)
        original = transformers_default() if current in (None, npu_grouped_mm) else current
        where = f"ALL_EXPERTS_FUNCTIONS[{name!r}]"
        entries.append(
            slot(registry, name, original, npu_grouped_mm, True, where, plumbing=True, seen=current)
        )
    for cls in _root_model_classes(target.module):
        had_own = _GET_CORRECT in cls.__dict__
        stock = cls.__dict__[_GET_CORRECT] if had_own else getattr(cls, _GET_CORRECT)
        entries.append(
            slot(
                cls,
                _GET_CORRECT,
                stock,
                _get_correct(target.model_type, stock),
                had_own,
                f"{cls.__module__}:{cls.__qualname__}.{_GET_CORRECT}",
                path=f"{cls.__name__}.{_GET_CORRECT}",
                plumbing=True,
            )
        )
    return entries


# --- what report(model) shows of it (Report hooks) ----------------------------------------


def origin(instance, origin_of, defined_by):
    """(origin, via, defined_by, kernel) of a 5.x experts instance, by the implementation its config
    selects; None for any other module (the report reads its class)."""
    forward = type(instance).forward
    interface = interface_of(forward)
    if interface is None:
        return None
    selected = getattr(getattr(instance, "config", None), "_experts_implementation", None)
    via = f"experts interface {selected!r}"
    try:
        function = interface.get_interface(selected, forward.__wrapped__) if selected != "eager" else None
    except Exception:  # an implementation nobody registered: the model's forward raises
        return "foreign", via, "unregistered", None
    if function is None:
        return "stock", via, defined_by(forward.__wrapped__), None
    if function is npu_grouped_mm:
        chosen = implementation(instance)
        if chosen is getattr(type(instance), ATTR, None):
            code_origin, code_from, kernel = origin_of(chosen)
            return code_origin, via, code_from, kernel or KERNEL
        return "stock", via + f" (runs {DEFAULT!r} of transformers)", defined_by(chosen), None
    code_origin, code_from, _kernel = origin_of(function)
    return code_origin, via, code_from, None


def stock_reason(instance):
    """Why an experts instance of a class that holds the kernel runs another implementation: its
    config's explicit choice, and how to switch back; None for any other module."""
    if getattr(type(instance), ATTR, None) is None or interface_of(type(instance).forward) is None:
        return None
    config = getattr(instance, "config", None)
    selected = getattr(config, "_experts_implementation", None)
    switch = KEY if asked_for_stock(config) else DEFAULT
    return (
        f"its config selects {selected!r} (an explicit choice wins); "
        f"model.set_experts_implementation({switch!r}) switches it to the moe kernel"
    )


def delegates(instance, kind_of):
    """Whether an MoE-looking module contains another MoE-looking module (5.x: the block routes, its
    fused experts module computes and is reported itself)."""
    kind = kind_of(instance)
    return any(kind_of(sub) == kind for name, sub in instance.named_modules() if name)
