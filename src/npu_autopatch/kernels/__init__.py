"""The NPU kernels, each written once and named; the model table says where they go.

Each kernel is one unit, in its own module (norm, mlp, rope, attention, linear_attention, loss) or
package when it grows (moe, with its install through transformers 5.x's experts registry): a
``Kernel`` declaring its ops, requirements, variants, candidate patterns and, where it has them,
its install, report and opt-in switch (see ``_types.Kernel``). ``_catalog`` names the built-in ones
without importing them. The patcher uses the first variant whose probe agrees with
the stock code, so a target is only ever replaced by code that reproduces its math, whatever the
class is called.

This package's own import is light (interpreter start reads ``_catalog`` through it): the kernel
modules import torch, so ``KERNELS``, ``choose_variant`` and ``golden_ops`` are loaded on first
use (PEP 562), at patch time, when the modeling module has imported torch already.
"""

__all__ = ["KERNELS", "Kernel", "Variant", "choose_variant", "golden_ops"]


def __getattr__(name):
    if name == "KERNELS":
        from ._choose import builtin_kernels

        value = builtin_kernels()
    elif name in ("choose_variant", "golden_ops"):
        from . import _choose

        value = getattr(_choose, name)
    elif name in ("Kernel", "Variant"):
        from .. import _types

        value = getattr(_types, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
