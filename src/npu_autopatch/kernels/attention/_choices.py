"""What the default route decided for each model config, and the reasons it gives: the record
report() reads (who chose the implementation), ``disable()``/``enable()`` follow (the route's refresh)
and pickling reads (a routed config carries stock's choice out of the process).
"""

import threading
import weakref

_ROUTED = "flash_attention_2"
# Why a model keeps transformers' default (the reasons status() counts; all but the last are the
# caller's or transformers' own and never warned about).
CHOSEN = "an explicit choice"
NOT_NPU = "no NPU"
NO_FA2 = "no flash attention in transformers"
NOT_TRANSFORMERS = "not transformers' own code"
NOT_SELECTED = "model not selected"
KNOWN_FAILURE = "transformers' FA2 path fails for it"
DROPS_BIDIRECTIONAL = "FA2 drops its bidirectional mask"
INSIDE_NO_FA2 = "inside a model without flash attention"
LEFT_STOCK = "model left stock"
KERNEL_OFF = "attention kernel not applied"
# Why a call of a routed model runs stock sdpa rather than the flash path (decided per call).
MASK_4D = "attention call with a 4-D mask"
_ROUTINE = (
    CHOSEN, NOT_NPU, NO_FA2, DROPS_BIDIRECTIONAL, NOT_TRANSFORMERS, NOT_SELECTED, KNOWN_FAILURE,
    INSIDE_NO_FA2, MASK_4D,
)  # fmt: skip


class _Choices:
    """The default-attention decision per model config, while the config lives: for report() (who
    chose the implementation) and for disable()/enable() (``_refresh_routed``: a routed config goes
    back to stock's default when the route is taken out, and to FA2 when it is put back).

    Held in the attention family, which alone writes and reads it, not in the package state: like
    ``HOST_ENDS`` it is a cache of facts about the user's objects, keyed weakly (a config is
    unhashable: keyed by id, the entry dropped when the config dies).
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.reduced: set[type] = set()  # the config classes ``_portable`` registered a reducer for

    def note(self, config, routed: bool, why: str | None, stock_choice: str, model) -> None:
        key = id(config)

        def forget(ref, key=key):
            with self._lock:
                if self._by_id.get(key, (None,))[0] is ref:
                    del self._by_id[key]

        with self._lock:
            self._by_id[key] = (weakref.ref(config, forget), routed, why, stock_choice, weakref.ref(model))

    def of(self, config):
        """(routed, why not, stock's choice) for this config, or None if no decision was seen."""
        entry = self._by_id.get(id(config))
        return entry[1:4] if entry is not None and entry[0]() is config else None

    def decided_by(self, config):
        """The model whose build took this config's decision (None once it is gone, or if none)."""
        entry = self._by_id.get(id(config))
        return entry[4]() if entry is not None and entry[0]() is config else None

    def routed(self):
        """[(config, stock's choice)] of the live routed configs."""
        with self._lock:
            entries = list(self._by_id.values())
        return [
            (ref(), stock_choice)
            for ref, routed, _why, stock_choice, _model in entries
            if routed and ref() is not None
        ]


CHOICES = _Choices()


def _portable_reduce(config):
    """How a routed config's class pickles while the route is in place (``copyreg``: pickle,
    ``torch.save``, Ray, spawn and ``copy.deepcopy`` read it): as stock would, with stock's choice in
    place of ours. Nothing of ours may outlive the process in the user's objects: a routed model
    saved whole or sent to a worker must run where there is no NPU (or no npu-autopatch), and
    ``"flash_attention_2"`` there means the flash-attn package. A deep copy in this process is not
    routed again either (it runs stock's choice: correct, not the lean path)."""
    reduced = list(object.__reduce_ex__(config, 2))
    decision, state = CHOICES.of(config), reduced[2]
    routed = decision is not None and decision[0] and isinstance(state, dict)
    if routed and state.get("_attn_implementation_internal") == _ROUTED:
        reduced[2] = {**state, "_attn_implementation_internal": decision[2]}
    return tuple(reduced)


def _portable(classes, on: bool) -> None:
    """Register ``_portable_reduce`` for these config classes (``on``), or take every one of ours out;
    a class someone else registered a reducer for is left to them."""
    import copyreg

    for cls in classes if on else list(CHOICES.reduced):
        held = copyreg.dispatch_table.get(cls)
        if on and held is None:
            copyreg.pickle(cls, _portable_reduce)
            CHOICES.reduced.add(cls)
        elif not on:
            CHOICES.reduced.discard(cls)
            if held is _portable_reduce:
                del copyreg.dispatch_table[cls]


def _chosen(config, implementation) -> str:
    """Who chose a config's attention implementation, in words, for report()."""
    decision = CHOICES.of(config)
    if decision is None:
        return "the user, or before npu-autopatch"
    routed, why, stock_choice = decision
    if routed and implementation == _ROUTED:
        return f"default, routed from {stock_choice} by npu-autopatch (packed documents kept apart)"
    if routed or why == CHOSEN:
        return "the user"  # routed once, then set_attn_implementation() or a config shared with another model
    return f"transformers' default ({why})"
