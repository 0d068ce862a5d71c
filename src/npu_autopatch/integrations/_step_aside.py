"""What the step-aside entries share (verl's, ms-swift's, LLaMA-Factory's): reading another library's
code without running it, running it with some of its globals narrowed, asking which models are ours,
and the one rank-0 INFO line each says.

Stdlib only (the table imports the integrations at interpreter start). The mechanism is reached at call
time through ``sys.modules``, never imported: that would close a cycle through the table.
"""

import sys

OURS = ("pending", "applied", "partial")  # status() states of a model whose targets are ours
FUNCTION = type(lambda: None)
_told = set()  # (framework, stepped aside for, kept) already logged in this process


def reads_global(code, name):
    """Whether ``code`` (or code nested in it: a comprehension, an inner function) loads global ``name``."""
    import dis

    if any(i.opname == "LOAD_GLOBAL" and i.argval == name for i in dis.get_instructions(code)):
        return True
    return any(reads_global(const, name) for const in code.co_consts if isinstance(const, type(code)))


def _stored_globals(code):
    """The global names ``code`` assigns (``global _APPLIED; _APPLIED = True``)."""
    import dis

    return {i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}


def required_arguments(function):
    """Whether ``function`` has a parameter without a default."""
    code = function.__code__
    required = code.co_argcount - len(function.__defaults__ or ())
    keyword_only = set(code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount])
    return required > 0 or bool(keyword_only - set(function.__kwdefaults__ or {}))


def with_globals(stock, overrides):
    """``stock`` as it is, reading ``overrides`` in place of those globals of its module; the module
    is left untouched, but what the function assigns to its module's globals (a flag such as ms-swift's
    ``_APPLIED``) is written back there after each call, as the function itself would have."""
    import functools

    namespace = dict(stock.__globals__)
    namespace.update(overrides)
    narrowed = FUNCTION(stock.__code__, namespace, stock.__name__, stock.__defaults__, stock.__closure__)
    narrowed.__kwdefaults__ = stock.__kwdefaults__
    stored = _stored_globals(stock.__code__)
    if not stored:
        return narrowed

    @functools.wraps(stock)
    def run(*args, **kwargs):
        try:
            return narrowed(*args, **kwargs)
        finally:
            for name in stored:
                if name in namespace:
                    stock.__globals__[name] = namespace[name]

    return run


def states(model_types):
    """{model type: its status() state, as a str} of those of ``model_types`` npu-autopatch knows."""
    records = sys.modules["npu_autopatch"].status()
    return {name: str(records[name].state) for name in model_types if name in records}


def modules_ours():
    """{modeling module name: the model types patched there that are ours (see OURS)}."""
    records = sys.modules["npu_autopatch"].status()
    ours = {}
    for name, record in records.items():
        if str(record.state) in OURS:
            ours.setdefault(record.module, []).append(name)
    return ours


def announce(framework, where, ours, kept):
    """One rank-0 INFO line per distinct outcome: ``framework``'s NPU patch (``where``) steps aside for
    ``ours``; ``kept``: what it still patches. Shown even where the host program set the root logger's
    handlers above INFO while INFO is enabled (_log: ``insist``)."""
    key = (framework, tuple(ours), tuple(kept))
    if key in _told:
        return
    _told.add(key)
    sys.modules["npu_autopatch._log"].info(
        f"{framework}'s NPU patch ({where}) steps aside for {', '.join(ours)}: npu-autopatch patches them; "
        f"{framework}'s still patches: {', '.join(kept) or 'none'} "
        f"(NPU_AUTOPATCH_STEP_ASIDE=0 runs {framework}'s for all)",
        insist=True,
    )


def shape_probe(shape, framework):
    """A step-aside variant's probe: None when the other library's function has the shape the
    replacement relies on (``shape(stock)`` answers None) and the replacement wraps it, else why not.
    Code of another shape is refused with where it is and why, and runs as without us."""

    def probe(stock, candidate):
        why = shape(stock)
        if why is not None:
            where = f"{stock.__module__}.{getattr(stock, '__qualname__', stock)}"
            return f"{where}: {why}; {framework}'s patch runs as without us"
        return None if getattr(candidate, "__wrapped__", None) is stock else "the step-aside does not wrap it"

    return probe
