"""verl's own NPU patch steps aside for the models npu-autopatch patches.

verl ships an NPU patch of its own (0.9.1: ``verl/models/transformers/npu_patch.py``) for nine
model types: ``apply_npu_patches()`` runs every entry of its module-level table ``NPU_PATCHES``
(model type -> a function that imports that modeling module and assigns verl's NPU functions to
its classes and functions). verl's FSDP engine calls it as it starts (``FSDPEngine.__init__`` ->
``apply_npu_fsdp_patches`` -> ``apply_npu_patches``), after our import hooks patched those modules:
without this, verl's code silently replaced our kernels (with its failure modes: a rotary the device
refuses at small head dims, an experts backward that raises on torch_npu 2.6.0, no fallback).

The target is verl's ``apply_npu_patches``, in whichever verl module defines it (models.py:
``module="verl.*"``, a family found by what it defines; verl is never imported by us). The
replacement runs verl's very function (its code, defaults and module namespace) with its table
narrowed to the model types npu-autopatch does not patch in this process, so those keep verl's
patch as before and ours keep our kernels. "We patch" is decided at each call from ``status()``:
a model ``pending``, ``applied`` or ``partial`` is ours; one not selected, excluded, skipped (no
NPU, another library's patch first) or failed keeps verl's. One rank-0 INFO line names verl and
the models it stepped aside for.

The probe checks the shape of verl's code this relies on (a function with no required argument
that reads its table as the global ``NPU_PATCHES``, directly or in code nested in it, a dict of
model type -> callable). Code of another shape is refused with the reason and verl's patch runs
as without us. ``enable(step_aside=False)`` / ``NPU_AUTOPATCH_STEP_ASIDE=0`` leaves it alone.

Like a plugin's kernel it reaches the package only at call time, through ``sys.modules`` (the
package is loaded by then: it built the replacement): an import of the mechanism here would close
a cycle through the table (tests/test_structure.py).
"""

from .._types import Kernel, Variant
from ._step_aside import (
    FUNCTION,
    OURS,
    announce,
    reads_global,
    required_arguments,
    shape_probe,
    states,
    with_globals,
)

TABLE = "NPU_PATCHES"  # verl's table: model type -> the function that patches that model


def _shape(stock):
    """None if ``stock`` is verl's apply_npu_patches as this step-aside knows it, else why not."""
    if type(stock) is not FUNCTION:
        return f"it is a {type(stock).__name__}, not a plain function"
    if required_arguments(stock):
        return "it takes required arguments"
    if not reads_global(stock.__code__, TABLE):
        return f"it does not read its table as the global {TABLE}"
    table = stock.__globals__.get(TABLE)
    if not isinstance(table, dict) or not all(isinstance(k, str) and callable(v) for k, v in table.items()):
        return f"its module's {TABLE} is not a dict of model type -> patch function"
    return None


def _ours(table):
    """(the model types of ``table`` npu-autopatch patches in this process, those absent from this
    transformers): see the module docstring. verl's patch tries the absent ones as without us."""
    found = states(table)
    return [n for n in table if found.get(n) in OURS], {n for n in table if found.get(n) == "absent"}


def build(stock, npu, on_error):
    """verl's apply_npu_patches, run with its table narrowed to the model types we do not patch.

    ``npu`` is not used: no fused op runs here. If narrowing the table raises (a bug of ours),
    ``on_error`` puts verl's function back and this call runs it whole; what verl's own code
    raises is verl's and passes through.
    """
    import functools

    @functools.wraps(stock)
    def apply_npu_patches(*args, **kwargs):
        try:
            table = stock.__globals__[TABLE]
            ours, absent = _ours(table)
            kept = [name for name in table if name not in ours]
            run = with_globals(stock, {TABLE: {name: table[name] for name in kept}}) if ours else stock
            if ours:
                where = f"{stock.__module__}.{stock.__qualname__}"
                announce("verl", where, ours, [name for name in kept if name not in absent])
        except Exception as exc:
            on_error(exc)
            return stock(*args, **kwargs)
        return run(*args, **kwargs)

    return apply_npu_patches


STEP_ASIDE = Kernel(
    "step_aside",
    (),
    [Variant("verl_npu_patches", build, shape_probe(_shape, "verl"))],
    switch="step_aside",
    switched_on=True,
)
