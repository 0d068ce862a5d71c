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

Regenerate after changing a kernel (tests/test_fingerprint.py fails until then), with each venv:
``python -m npu_autopatch.kernels --write [--extra models.py]``; the second run merges into the
first (``--extra``: a file with a dict of ``Model`` to count as table models, e.g. a proposed table).
"""

import hashlib
import os
import sys
import types
import weakref

_SIMPLE = (int, float, complex, str, bytes, bool, type(None))
_DEPTH = 3  # helper functions followed this deep (measured: no two verdicts for one fingerprint)
_FUNCTION = types.FunctionType

# The sources a shipped verdict depends on: the fingerprint, the probes, the reference math, the variants.
_SOURCES = (
    "__init__.py",
    "_fingerprint.py",
    "_probe.py",
    "_reference.py",
    "norm.py",
    "mlp.py",
    "rope.py",
    "moe.py",
)

# {kernel name: its variants} as the package defines them (kernels/__init__ fills it at import):
# a shipped verdict is for those variant objects, not for a plugin's or a test's replacement.
BUILTIN = {}
_MEMO = {}  # (the kernel's variants, fingerprint[, qualified name if refused]) -> (variant, reason)
_FINGERPRINTS = weakref.WeakKeyDictionary()  # stock function -> fingerprint
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


def _value(h, name, value, seen, depth, owner):
    """What a referenced global or closure cell contributes: a helper's own fingerprint, or its name."""
    if isinstance(value, _FUNCTION):
        if value.__module__.startswith("transformers.") and depth > 0 and value not in seen:
            seen.add(value)
            _function(h, value, seen, depth - 1, owner)
        else:
            h.update(f"{name}={value.__module__}.{value.__qualname__}".encode())
    elif isinstance(value, types.ModuleType):
        h.update(f"{name}=module:{value.__name__}".encode())
    elif isinstance(value, _SIMPLE):
        h.update(f"{name}={value!r}".encode())
    elif isinstance(value, type):
        h.update(f"{name}=class:{value.__module__}.{value.__qualname__}".encode())
    else:
        h.update(f"{name}=obj:{type(value).__module__}.{type(value).__qualname__}".encode())


def _function(h, fn, seen, depth, owner):
    _code(h, fn.__code__)
    h.update(repr(fn.__defaults__).encode())
    h.update(repr(sorted((fn.__kwdefaults__ or {}).items())).encode())
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _value(h, "<closure>", contents, seen, depth, owner)
    namespace = fn.__globals__
    for name in fn.__code__.co_names:
        if name in namespace:
            _value(h, name, namespace[name], seen, depth, owner)
        elif owner is not None:
            method = getattr(owner, name, None)  # self._norm(...) in Gemma3RMSNorm.forward
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


def kernels_digest():
    """A digest of the kernels' sources: a shipped verdict is only as good as the probe that made it."""
    global _digest
    if _digest is None:
        here = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.blake2b(digest_size=12)
        h.update(f"python {sys.version_info[0]}.{sys.version_info[1]}".encode())  # bytecode differs
        for name in _SOURCES:
            with open(os.path.join(here, name), "rb") as source:
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
    if kernels_digest() != _verdicts.KERNELS_DIGEST or not all(v in builtin for v in kernel.variants):
        return None  # other kernel code, or a kernel that is not (a narrowing of) ours
    name = _verdicts.VERDICTS.get(kernel.name, {}).get(print_)
    # Not among the allowed variants (a torch_npu too old for it): the next one must be probed.
    variant = next((v for v in kernel.variants if v.name == name), None)
    if variant is not None:
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


# --- the generator ----------------------------------------------------------------------------


def _table_targets(extra=()):
    """(where, kernel, stock) for every target of the built-in model table (and of the ``extra``
    models) in this transformers."""
    import importlib

    from .. import _ledger
    from .._patcher import _transformers_has
    from ..models import MODELS
    from . import KERNELS

    for model in (*MODELS.values(), *extra):
        try:
            module = importlib.import_module(model.module)
        except ImportError:
            continue
        for target in model.targets:
            if target.since is not None and not _transformers_has(target.since):
                continue
            found = _ledger.resolve(module, target.paths)
            if found is not None:
                path, current = found[0], found[3]
                stock = _ledger.stock_function(current) or current
                yield f"{model.model_type}: {path}", KERNELS[target.kernel], stock


def _candidate_targets():
    """(where, kernel, stock) for every name-nominated candidate of every modeling module."""
    import importlib
    import warnings

    from .. import _candidates, _ledger
    from . import KERNELS

    for names in _candidates.modeling_modules().values():
        for name in names:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    module = importlib.import_module(name)
            except Exception:  # an optional library missing: the scan reports those
                continue
            for candidate in _candidates.candidates(module):
                current = _candidates._stock(module, candidate.path)
                stock = _ledger.stock_function(current) or current
                for kernel in _candidates._KERNELS_FOR[candidate.kind]:
                    yield f"{name}: {candidate.path}", KERNELS[kernel], stock


def live_verdicts(targets, refusals=None):
    """{kernel: {fingerprint: variant name or None}} by live probes; raises on a fingerprint with two
    verdicts (the fingerprint would then miss something the probe sees). With ``refusals``, the
    reasons of the refused targets go there, {kernel: {"fingerprint module.qualname": reason}}."""
    from . import choose_variant

    verdicts, where_of = {}, {}
    os.environ["NPU_AUTOPATCH_PROBE"] = "always"
    try:
        for where, kernel, stock in targets:
            print_ = fingerprint(stock)
            if print_ is None:
                continue
            try:
                variant, reason = choose_variant(kernel, stock)
            except Exception:
                variant = reason = None
            name = None if variant is None else variant.name
            if refusals is not None and variant is None and reason is not None:
                refusals.setdefault(kernel.name, {})[f"{print_} {qualified_name(stock)}"] = reason
            table = verdicts.setdefault(kernel.name, {})
            if print_ in table and table[print_] != name:
                raise RuntimeError(
                    f"{kernel.name}: fingerprint {print_} has two verdicts: {table[print_]} "
                    f"({where_of[kernel.name, print_]}) and {name} ({where})"
                )
            table[print_] = name
            where_of[kernel.name, print_] = where
    finally:
        os.environ.pop("NPU_AUTOPATCH_PROBE", None)
    return verdicts


def _extra_models(path):
    """The ``Model`` values of the first dict of models that the Python file ``path`` defines."""
    import importlib.util

    from .._types import Model

    spec = importlib.util.spec_from_file_location("_extra_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for value in vars(module).values():
        if isinstance(value, dict) and value and all(isinstance(m, Model) for m in value.values()):
            return list(value.values())
    raise SystemExit(f"{path} defines no dict of Model")


def _dict(name, table):
    """``name = {...}`` of {kernel: {key: value}}, as ruff formats it."""
    import json

    quote = json.dumps
    if not table:
        return [f"{name} = {{}}"]
    lines = [f"{name} = {{"]
    for kernel in sorted(table):
        lines.append(f"    {quote(kernel)}: {{")
        lines += [f"        {quote(key)}: {quote(value)}," for key, value in sorted(table[kernel].items())]
        lines.append("    },")
    return [*lines, "}"]


def _render(verdicts, refused, sources):
    """_verdicts.py's text, as ruff would format it."""
    import json

    quote = json.dumps
    lines = [
        *(["# ruff: noqa: E501"] if refused else []),  # the reasons are long
        '"""Shipped probe verdicts (see _fingerprint): VERDICTS {kernel: {fingerprint: variant}} for all',
        "code the probes accept, REFUSED {kernel: {fingerprint module.qualname: reason}} for the targets",
        "of the model table they refuse. Generated by ``python -m npu_autopatch.kernels --write``.",
        '"""',
        "",
        f"KERNELS_DIGEST = {quote(kernels_digest())}",
        "",
        "SOURCES = [" + ", ".join(map(quote, sorted(sources))) + "]",
        "",
        *_dict("VERDICTS", verdicts),
        "",
        *_dict("REFUSED", refused),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    """``--write``: merge this transformers' verdicts into _verdicts.py (a new kernels digest starts
    afresh); without it, print how many targets and fingerprints there are."""
    import argparse

    import transformers

    from . import _verdicts

    parser = argparse.ArgumentParser(prog="python -m npu_autopatch.kernels")
    parser.add_argument("--write", action="store_true", help="merge the verdicts into _verdicts.py")
    parser.add_argument("--extra", help="a Python file defining a dict of Model: table models too")
    args = parser.parse_args(argv)
    refused = {}
    found = live_verdicts(_table_targets(_extra_models(args.extra) if args.extra else ()), refused)
    for kernel, table in live_verdicts(_candidate_targets()).items():
        for print_, name in table.items():
            previous = found.setdefault(kernel, {}).setdefault(print_, name)
            if previous != name:
                raise RuntimeError(f"{kernel}: fingerprint {print_} is {previous} in the table, {name} here")
    accepted = {k: {fp: v for fp, v in table.items() if v is not None} for k, table in found.items()}
    print(
        f"transformers {transformers.__version__}: "
        + ", ".join(f"{k} {len(v)} of {len(found[k])}" for k, v in sorted(accepted.items()))
        + " fingerprints accepted"
    )
    if not args.write:
        return 0
    sources = {f"transformers {transformers.__version__}"}
    merged = {}
    if kernels_digest() == _verdicts.KERNELS_DIGEST:
        sources |= set(_verdicts.SOURCES)
        merged = {k: dict(v) for k, v in _verdicts.VERDICTS.items()}
        for kernel, table in _verdicts.REFUSED.items():
            for where, why in table.items():
                refused.setdefault(kernel, {}).setdefault(where, why)
    for kernel, table in accepted.items():
        for print_, name in table.items():
            previous = merged.setdefault(kernel, {}).setdefault(print_, name)
            if previous != name:
                raise RuntimeError(f"{kernel}: fingerprint {print_} is {previous} in the table, {name} here")
    for kernel, table in found.items():  # refused here, accepted with another transformers
        for print_, name in table.items():
            if name is None and print_ in merged.get(kernel, {}):
                there = merged[kernel][print_]
                raise RuntimeError(f"{kernel}: fingerprint {print_} is refused here, {there} there")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_verdicts.py")
    with open(path + ".tmp", "w") as out:
        out.write(_render(merged, refused, sources))
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
    return 0
