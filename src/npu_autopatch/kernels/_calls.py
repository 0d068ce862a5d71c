"""How a replacement reports each call: ``fused()`` or ``stock(reason, *tensors)``, into its ``Calls``.

The patcher hands each replacement a ``Calls`` (``on_error.calls``, see ``_types.Calls``); a build
outside the patcher (a probe's candidate, ``verify``) gets one nobody reads. Both functions do
nothing while torch.compile traces the replacement: dynamo would guard on the count's value and
compile the graph again at every call (``fullgraph=True`` would fail on the report's logging), so
compiled calls are not counted. Eager, ``fused()`` costs ``is_compiling()`` and one increment.
"""

import torch

from .._types import Calls


def counters(on_error, routine=()):
    """(fused(), stock(reason, *tensors)) of the replacement that gets ``on_error``.

    ``reason`` is a short rule (``"eval"``) or a function returning one, called only here, so that
    a reason built from shapes costs nothing on the fused path; ``tensors`` are the call's inputs,
    whose shapes the mostly-stock WARNING names (formatted only if it fires). ``routine``: the
    kernel's reasons that are the caller's own choice (``eval``, ``no labels``): counted, and never
    the cause of that WARNING.
    """
    routine = frozenset(routine)
    calls = getattr(on_error, "calls", None)
    if not isinstance(calls, Calls):
        calls = Calls()
    compiling = torch.compiler.is_compiling

    def fused():
        if not compiling():
            calls.fused += 1

    def stock(reason, *tensors):
        if not compiling():
            calls.went_stock(reason, tensors, routine)

    return fused, stock
