"""Probe verdicts reused by a structural fingerprint of the stock code: patching without probing.

transformers' modeling files are generated copies, so the hundreds of targets of a release are a
few dozen distinct functions. Two targets with the same fingerprint run the same bytecode with the
same constants and names, call the same module-level transformers helpers (fingerprinted too,
recursively), the same methods of their own class (``self._norm``, the experts' ``_apply_gate``)
and close over the same functions (a decorator's wrapped method): everything a probe exercises.
The probe compares the stock code with the candidate on CPU reference ops, so neither the device
nor the weights enter the verdict, and the same code gets the same verdict.

Two places keep verdicts:

- ``_MEMO``, in process: a reload, ``enable()`` again, or a VLM sharing code with its text model
  never probes the same code twice.
- ``_verdicts.py``, shipped: the variants our CI's probes chose for every target of the model table
  and every candidate of every modeling module, and the refusals of the table's targets, on both
  transformers majors, valid only with the sources they were computed with (``KERNELS_DIGEST``).
  Unknown code is probed live.

A refusal's reason names the class it was found on, so refusals are kept per qualified name too.

``NPU_AUTOPATCH_PROBE=always`` turns both off: every target is probed live.

Regenerate after changing a kernel (tests/test_fingerprint.py fails until then; tools/verdicts.py), with each
venv:
``python -m npu_autopatch.kernels --write [--extra models.py]``; the second run merges into the
first (``--extra``: a file with a dict of ``Model`` to count as table models, e.g. a proposed table).
"""

import dis
import hashlib
import os
import sys
import types
import weakref

from . import _catalog

_SIMPLE = (int, float, complex, str, bytes, bool, type(None))
_DEPTH = 3  # helper functions followed this deep (measured: no two verdicts for one fingerprint)
_FUNCTION = types.FunctionType

# The package whose modules a shipped verdict can depend on (see sources()); the mechanism's own
# modules (the package root's ``_*.py``) are not among them.
_PACKAGE = __name__.rpartition(".")[0].rpartition(".")[0]

# {kernel name: its variants} as the package defines them (kernels/__init__ fills it at import):
# a shipped verdict is for those variant objects, not for a plugin's or a test's replacement.
BUILTIN = {}
_MEMO = {}  # (the kernel's variants, fingerprint[, qualified name if refused]) -> (variant, reason)
_FINGERPRINTS = weakref.WeakKeyDictionary()  # stock function -> fingerprint
_STATE_NAMES = {}  # module name -> the globals its functions assign (``global x``): state, not code
_STORE_GLOBAL = dis.opmap["STORE_GLOBAL"]
_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]
_digest = None


def live_only():
    """Whether the user asked for live probing (``NPU_AUTOPATCH_PROBE=always``)."""
    return os.environ.get("NPU_AUTOPATCH_PROBE", "").strip().lower() == "always"


def owner_of(stock):
    """The module-level class whose method ``stock`` is (as the probes' ``instance`` finds it), or None."""
    fn = getattr(stock, "__wrapped__", stock)
    owner = getattr(fn, "__globals__", {}).get(getattr(fn, "__qualname__", "").rpartition(".")[0])
    return owner if isinstance(owner, type) else None


def _const(h, const):
    if isinstance(const, types.CodeType):
        _code(h, const)
    elif isinstance(const, frozenset):  # its repr's order depends on the string hash seed
        h.update(repr(sorted(map(repr, const))).encode())
    else:
        h.update(repr(const).encode())


def _code(h, code):
    h.update(code.co_code)
    h.update(repr((code.co_argcount, code.co_kwonlyargcount, code.co_flags, code.co_varnames)).encode())
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        _const(h, const)


def _named_by_qualname(fn):
    """Whether a function's name says what it is: importable, and not transformers' (whose code we
    follow, as generated copies share names with different code)."""
    return "<" not in fn.__qualname__ and not (fn.__module__ or "").startswith("transformers.")


def _stock(value):
    """The stock function behind a replacement of ours (the patcher sets ``__wrapped__``), else ``value``.

    A fingerprint is of the code stock runs, whatever of ours is in place when it is taken: a helper
    or a base-class method another target's patch replaced (the default attention's route on
    ``PreTrainedModel``) would otherwise give the same code another fingerprint, and the memo keeps it.
    """
    while isinstance(value, _FUNCTION) and (value.__module__ or "").startswith(_PACKAGE + "."):
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is None:
            break
        value = wrapped
    return value


def _value(h, name, value, seen, depth, owner, closure=False):
    """What a referenced global or closure cell contributes: a helper's own fingerprint, or its name.

    A closure's functions (a decorator's wrapped method, a factory's arguments) and lambdas or
    local functions are followed wherever they come from: their names do not tell them apart.
    """
    value = _stock(value)
    if isinstance(value, _FUNCTION):
        followed = closure or not _named_by_qualname(value)
        if followed and value not in seen:
            seen.add(value)
            if depth > 0:
                _function(h, value, seen, depth - 1, owner)
            else:
                _code(h, value.__code__)
        else:
            h.update(f"{name}={value.__module__}.{value.__qualname__}".encode())
    elif isinstance(value, _SIMPLE):
        h.update(f"{name}={value!r}".encode())
    elif isinstance(value, type):
        h.update(f"{name}=class:{value.__module__}.{value.__qualname__}".encode())
    # A module or any other object counts by the name the code uses (in co_names), as an unbound
    # name does: transformers' npu_flash_attention binds torch_npu and npu_fusion_attention only
    # on an NPU, and its code must have one fingerprint wherever the module was first imported.


def _stored_globals(code, names):
    """Add to ``names`` the globals ``code`` (and the code nested in it) assigns, read off its bytecode."""
    raw, extended = code.co_code, 0
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | extended
        extended = arg << 8 if op == _EXTENDED_ARG else 0
        if op == _STORE_GLOBAL:
            names.add(code.co_names[arg])
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _stored_globals(const, names)


def _state_names(namespace):
    """The globals of a module that its own functions rebind: transformers' flash-attention helpers are
    None until the first FA2 model loads them (``lazy_import_flash_attention``), so the code reading them
    must count them by name, or its fingerprint would depend on what the process ran before."""
    module = namespace.get("__name__")
    names = _STATE_NAMES.get(module)
    if names is None:
        names = set()
        for value in list(namespace.values()):
            if isinstance(value, _FUNCTION) and value.__globals__ is namespace:
                _stored_globals(value.__code__, names)
        _STATE_NAMES[module] = names
    return names


def _function(h, fn, seen, depth, owner):
    _code(h, fn.__code__)
    h.update(repr(fn.__defaults__).encode())
    h.update(repr(sorted((fn.__kwdefaults__ or {}).items())).encode())
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _value(h, "<closure>", contents, seen, depth, owner, closure=True)
    namespace = fn.__globals__
    state = _state_names(namespace)
    for name in fn.__code__.co_names:
        if name in state:
            h.update(f"{name}=<state>".encode())
        elif name in namespace:
            _value(h, name, namespace[name], seen, depth, owner)
        elif owner is not None:
            method = _stock(getattr(owner, name, None))  # self._norm(...) in Gemma3RMSNorm.forward
            # torch's own (nn.Module.to, ...: also a tensor method's name) count by name, as torch does
            if isinstance(method, _FUNCTION) and method not in seen:
                seen.add(method)
                if method.__module__.startswith("transformers."):
                    _function(h, method, seen, depth - 1, owner)
                else:
                    h.update(f"{name}={method.__module__}.{method.__qualname__}".encode())


def fingerprint(stock):
    """A hex digest of the code ``stock`` runs, or None for what is not a plain function."""
    if type(stock) is not _FUNCTION:
        return None
    digest = _FINGERPRINTS.get(stock)
    if digest is None:
        h = hashlib.blake2b(digest_size=12)
        _function(h, stock, {stock}, _DEPTH, owner_of(stock))
        digest = _FINGERPRINTS[stock] = h.hexdigest()
    return digest


def _is_source(name):
    """Whether module ``name`` is code a verdict depends on: the package's, but not the mechanism's."""
    if not name.startswith(_PACKAGE + "."):
        return False
    return not name[len(_PACKAGE) + 1 :].startswith("_")


def _module_of(value):
    if isinstance(value, types.ModuleType):
        return value.__name__
    return getattr(value, "__module__", None) if isinstance(value, (_FUNCTION, type)) else None


def sources():
    """The modules a shipped verdict depends on, derived from the built-in kernels, not listed by hand:
    the modules declaring them (the catalogue's: a family folder's face, such as ``attention``) and
    defining their variants, requirements, fallbacks and refreshes, and every module of the package
    those refer to (the probes' helpers, the reference math, a shared module such as
    ``gated_delta_scan`` or ``losses``), with this fingerprint and the variant chooser. Sorted by name."""
    package = __name__.rpartition(".")[0]
    roots = {__name__, f"{package}._choose"}
    roots.update(f"{package}.{line[1]}" for line in _catalog.BUILTIN)
    for variants in BUILTIN.values():
        for variant in variants:
            functions = (variant.build, variant.probe, variant.requires, variant.probe_live)
            roots.update(_module_of(f) for f in functions)
    found, todo = set(), [name for name in roots if name and _is_source(name)]
    while todo:
        name = todo.pop()
        if name in found or name not in sys.modules:
            continue
        found.add(name)
        for value in vars(sys.modules[name]).values():
            referred = _module_of(value)
            if referred and _is_source(referred) and referred not in found:
                todo.append(referred)
    return sorted(found)


def kernels_digest():
    """A digest of the kernels' sources: a shipped verdict is only as good as the probe that made it."""
    global _digest
    if _digest is None:
        if not BUILTIN:
            raise RuntimeError("the kernels' digest needs the built-in kernels: load kernels.KERNELS first")
        h = hashlib.blake2b(digest_size=12)
        h.update(f"python {sys.version_info[0]}.{sys.version_info[1]}".encode())  # bytecode differs
        for name in sources():
            with open(sys.modules[name].__file__, "rb") as source:
                h.update(source.read().replace(b"\r\n", b"\n"))
        _digest = h.hexdigest()
    return _digest


def qualified_name(stock):
    """module.qualname of the code: a refusal's reason names the class, so it is kept per name."""
    fn = getattr(stock, "__wrapped__", stock)
    return f"{fn.__module__}.{fn.__qualname__}"


def shipped(kernel, print_, stock):
    """The shipped verdict for ``stock`` (fingerprint ``print_``): (variant, None), (None, reason) for
    a refused target of the model table, or None: probe it."""
    from . import _verdicts

    builtin = BUILTIN.get(kernel.name, ())
    if not all(v in builtin for v in kernel.variants) or kernels_digest() != _verdicts.KERNELS_DIGEST:
        return None  # a kernel that is not (a narrowing of) ours, or other kernel code
    name = _verdicts.VERDICTS.get(kernel.name, {}).get(print_)
    # Not among the allowed variants (a torch_npu too old for it): the next one must be probed.
    variant = next((v for v in kernel.variants if v.name == name), None)
    if variant is not None:
        # An earlier variant whose probe depends on an installed package our CI lacks (fla), and
        # that package is here: the CI's verdict did not see it, so probe live.
        earlier = kernel.variants[: kernel.variants.index(variant)]
        if any(v.probe_live is not None and v.probe_live() for v in earlier):
            return None
        return variant, None
    if name is None and tuple(kernel.variants) == builtin:  # the reason lists every variant's
        reason = _verdicts.REFUSED.get(kernel.name, {}).get(f"{print_} {qualified_name(stock)}")
        if reason is not None:
            return None, reason
    return None


def recall(kernel, stock):
    """(key, (variant, reason) or None): a verdict known for this code, and the key to remember one."""
    if live_only():
        return None, None
    print_ = fingerprint(stock)
    if print_ is None:
        return None, None
    key = (tuple(kernel.variants), print_)
    known = _MEMO.get(key) or _MEMO.get((*key, qualified_name(stock)))
    if known is None:
        known = shipped(kernel, print_, stock)
        if known is not None:
            remember(key, known, stock)
    return key, known


def remember(key, verdict, stock):
    if key is not None:
        _MEMO[key if verdict[0] is not None else (*key, qualified_name(stock))] = verdict


def forget():
    """Drop the in-process verdicts (tests)."""
    _MEMO.clear()
    _FINGERPRINTS.clear()
