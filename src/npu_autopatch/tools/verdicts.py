"""``python -m npu_autopatch.kernels --write``: the shipped verdicts (kernels/_verdicts.py), by live probes.

A tool, not the mechanism: it reads the model table, the candidates and the patcher's choice of
targets (which all import the kernels), so it lives outside the kernels package, and nothing in the
library imports it. It probes live through ``choose_variant(..., live=True)``: the environment
(``NPU_AUTOPATCH_PROBE``) is the user's, and left alone.
"""

import os

from ..kernels._fingerprint import fingerprint, kernels_digest, qualified_name


def table_targets(extra=()):
    """(where, kernel, stock) for every target of the built-in model table (and of the ``extra``
    models) in this transformers."""
    import importlib

    from .. import _resolve
    from .._patcher import present_targets
    from ..kernels import KERNELS
    from ..models import MODELS

    for model in (*MODELS.values(), *extra):
        try:
            module = importlib.import_module(model.module)
        except ImportError:
            continue
        for target in present_targets(model.targets):
            found = _resolve.resolve(module, target.paths)
            if found is not None:
                stock = _resolve.stock_function(found.current) or found.current
                yield f"{model.model_type}: {found.path}", KERNELS[target.kernel], stock


def candidate_targets():
    """(where, kernel, stock) for every name-nominated candidate of every modeling module."""
    import importlib
    import warnings

    from .. import _candidates
    from ..kernels import KERNELS

    for names in _candidates.modeling_modules().values():
        for name in names:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    module = importlib.import_module(name)
            except Exception:  # an optional library missing: the scan reports those
                continue
            for candidate in _candidates.candidates(module):
                stock = _candidates.stock_code(module, candidate.path)
                for kernel in _candidates.kernels_for(candidate.kind):
                    yield f"{name}: {candidate.path}", KERNELS[kernel], stock


def live_verdicts(targets, refusals=None):
    """{kernel: {fingerprint: variant name or None}} by live probes; raises on a fingerprint with two
    verdicts (the fingerprint would then miss something the probe sees). With ``refusals``, the
    reasons of the refused targets go there, {kernel: {"fingerprint module.qualname": reason}}."""
    from ..kernels import choose_variant

    verdicts, where_of = {}, {}
    for where, kernel, stock in targets:
        print_ = fingerprint(stock)
        if print_ is None:
            continue
        try:
            variant, reason = choose_variant(kernel, stock, live=True)
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
    return verdicts


def extra_models(path):
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

    from ..kernels import _verdicts

    parser = argparse.ArgumentParser(prog="python -m npu_autopatch.kernels")
    parser.add_argument("--write", action="store_true", help="merge the verdicts into _verdicts.py")
    parser.add_argument("--extra", help="a Python file defining a dict of Model: table models too")
    args = parser.parse_args(argv)
    refused = {}
    found = live_verdicts(table_targets(extra_models(args.extra) if args.extra else ()), refused)
    for kernel, table in live_verdicts(candidate_targets()).items():
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
    path = os.path.abspath(_verdicts.__file__)
    with open(path + ".tmp", "w") as out:
        out.write(_render(merged, refused, sources))
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
    return 0
