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

import sys

from .._types import Kernel, Variant

TABLE = "NPU_PATCHES"  # verl's table: model type -> the function that patches that model
OURS = ("pending", "applied", "partial")  # status() states of a model whose targets are ours
_FUNCTION = type(lambda: None)
_told = set()  # (stepped aside for, kept) pairs already logged in this process


def _reads_global(code, name):
    """Whether ``code`` (or code nested in it: a comprehension, an inner function) loads global ``name``."""
    import dis

    if any(i.opname == "LOAD_GLOBAL" and i.argval == name for i in dis.get_instructions(code)):
        return True
    return any(_reads_global(const, name) for const in code.co_consts if isinstance(const, type(code)))


def _shape(stock):
    """None if ``stock`` is verl's apply_npu_patches as this step-aside knows it, else why not."""
    if type(stock) is not _FUNCTION:
        return f"it is a {type(stock).__name__}, not a plain function"
    code = stock.__code__
    required = code.co_argcount - len(stock.__defaults__ or ())
    keyword_only = set(code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount])
    if required > 0 or keyword_only - set(stock.__kwdefaults__ or {}):
        return "it takes required arguments"
    if not _reads_global(code, TABLE):
        return f"it does not read its table as the global {TABLE}"
    table = stock.__globals__.get(TABLE)
    if not isinstance(table, dict) or not all(isinstance(k, str) and callable(v) for k, v in table.items()):
        return f"its module's {TABLE} is not a dict of model type -> patch function"
    return None


def probe(stock, candidate):
    """None when verl's function has the shape the replacement relies on, else why not."""
    why = _shape(stock)
    if why is not None:
        where = f"{stock.__module__}.{getattr(stock, '__qualname__', stock)}"
        return f"{where}: {why}; verl's patch runs as without us"
    return None if getattr(candidate, "__wrapped__", None) is stock else "the step-aside does not wrap it"


def _ours(table):
    """(the model types of ``table`` npu-autopatch patches in this process, those absent from this
    transformers): see the module docstring. verl's patch tries the absent ones as without us."""
    records = sys.modules["npu_autopatch"].status()
    states = {name: str(records[name].state) for name in table if name in records}
    return [n for n in table if states.get(n) in OURS], {n for n in table if states.get(n) == "absent"}


def _with_table(stock, table):
    """verl's function as it is, reading ``table`` as its NPU_PATCHES (its module is left untouched)."""
    namespace = dict(stock.__globals__)
    namespace[TABLE] = table
    narrowed = _FUNCTION(stock.__code__, namespace, stock.__name__, stock.__defaults__, stock.__closure__)
    narrowed.__kwdefaults__ = stock.__kwdefaults__
    return narrowed


def _announce(stock, ours, kept):
    """One rank-0 INFO line per distinct outcome (verl calls apply_npu_patches once per engine);
    ``kept``: the model types verl's patch still patches (those this transformers has)."""
    key = (tuple(ours), tuple(kept))
    if key in _told:
        return
    _told.add(key)
    where = f"{stock.__module__}.{stock.__qualname__}"
    sys.modules["npu_autopatch._log"].info(
        f"verl's NPU patch ({where}) steps aside for {', '.join(ours)}: npu-autopatch patches them; "
        f"verl's still patches: {', '.join(kept) or 'none'} (NPU_AUTOPATCH_STEP_ASIDE=0 runs verl's for all)"
    )


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
            run = _with_table(stock, {name: table[name] for name in kept}) if ours else stock
            if ours:
                _announce(stock, ours, [name for name in kept if name not in absent])
        except Exception as exc:
            on_error(exc)
            return stock(*args, **kwargs)
        return run(*args, **kwargs)

    return apply_npu_patches


STEP_ASIDE = Kernel(
    "step_aside", (), [Variant("verl_npu_patches", build, probe)], switch="step_aside", switched_on=True
)
