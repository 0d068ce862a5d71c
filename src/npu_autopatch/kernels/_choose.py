"""The built-in kernels, loaded from the catalogue, and the choice of a variant for a stock function.

Imported at patch time only (through ``kernels.KERNELS`` / ``kernels.choose_variant``): it
imports every built-in kernel module, and so torch.
"""

import importlib

from . import _catalog, _fingerprint, _reference
from ._probe import neutral_torch


def builtin_kernels():
    """{name: Kernel} of the built-in kernels, in the catalogue's order, each checked against its line."""
    kernels = {}
    for name, module, attr, switch, on in _catalog.BUILTIN:
        kernel = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
        if (kernel.name, kernel.switch, kernel.switched_on) != (name, switch, on):
            raise RuntimeError(
                f"kernels/_catalog.py says {module}.{attr} is {name!r} (switch {switch!r}, on: {on}); "
                f"it declares {kernel.name!r} (switch {kernel.switch!r}, on: {kernel.switched_on})"
            )
        kernels[name] = kernel
    _fingerprint.BUILTIN.update((name, kernel.variants) for name, kernel in kernels.items())
    return kernels


def golden_ops(kernel=None):
    """The CPU reference math of the torch_npu ops (``_reference``), with ``kernel``'s own reference ops
    (``Kernel.reference``, a plugin's new op) over it: what the probes build candidates on."""
    if kernel is None or not kernel.reference:
        return _reference
    return _WithOwnOps(kernel.reference)


class _WithOwnOps:
    """``_reference`` with a kernel's own reference ops over it."""

    def __init__(self, own):
        vars(self).update(own)

    def __getattr__(self, name):
        return getattr(_reference, name)


def _reraise(exc, *tensors):
    """A probe's on_error: a candidate whose fused op raises is refused, not rescued."""
    raise exc


def choose_variant(kernel, stock, live=False):
    """(variant, None) for the first variant that reproduces ``stock``, else (None, reasons).

    The probes run in ``neutral_torch()``: the verdict does not depend on the torch state
    (meta device, init_empty_weights, default dtype, autocast, ...) the import happens in.
    Code whose fingerprint has a verdict already (this process, or our CI's shipped table)
    is not probed again: see ``_fingerprint``. ``live=True`` probes it anyway, as
    ``NPU_AUTOPATCH_PROBE=always`` does (the verdict generator, which must not set the variable).
    """
    key, known = (None, None) if live else _fingerprint.recall(kernel, stock)
    if known is not None:
        return known
    verdict = _probe_variants(kernel, stock)
    _fingerprint.remember(key, verdict, stock)
    return verdict


def _probe_variants(kernel, stock):
    reasons = []
    with neutral_torch():
        for variant in kernel.variants:
            if variant.probe is None:  # a plugin's kernel that chose to go unchecked
                return variant, None
            candidate = variant.build(stock, golden_ops(kernel), _reraise)
            reason = variant.probe(stock, candidate)
            if reason is None:
                return variant, None
            reasons.append(reason if len(kernel.variants) == 1 else f"{variant.name}: {reason}")
    return None, "; ".join(reasons) or "no variant of this kernel"
