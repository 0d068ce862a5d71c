"""The NPU kernels, each written once and named; the model table says where they go.

Each kernel lives in its own module (norm, mlp, rope, moe, attention, linear_attention,
loss) as a ``Kernel`` with one or more variants (see ``_types.Kernel``). The patcher uses the
first variant whose probe agrees with the stock code, so a target is only ever replaced by code
that reproduces its math, whatever the class is called.

Imported at patch time only: it imports torch, which the modeling module already did.
"""

from .._types import KERNEL_NAMES, Kernel, Variant
from . import _fingerprint, _reference
from ._probe import neutral_torch
from .attention import ATTENTION
from .linear_attention import GATED_DELTA_RULE
from .loss import LOSS
from .mlp import SWIGLU
from .moe import MOE
from .norm import GATED_RMS_NORM, RMS_NORM
from .rope import ROPE

KERNELS = {
    kernel.name: kernel
    for kernel in (RMS_NORM, GATED_RMS_NORM, SWIGLU, ROPE, MOE, ATTENTION, GATED_DELTA_RULE, LOSS)
}
assert tuple(KERNELS) == KERNEL_NAMES, "kernels and _types.KERNEL_NAMES must list the same kernels"
_fingerprint.BUILTIN.update((name, kernel.variants) for name, kernel in KERNELS.items())

__all__ = ["KERNELS", "Kernel", "Variant", "choose_variant", "golden_ops"]


def golden_ops():
    """The CPU reference math of the torch_npu ops (``_reference``): what the probes build candidates on."""
    return _reference


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
            candidate = variant.build(stock, golden_ops(), _reraise)
            reason = variant.probe(stock, candidate)
            if reason is None:
                return variant, None
            reasons.append(reason if len(kernel.variants) == 1 else f"{variant.name}: {reason}")
    return None, "; ".join(reasons) or "no variant of this kernel"
