"""A kernel is the unit (issue 26): the mechanism (every package-root ``_*.py`` module) names no
built-in kernel, no torch_npu op and no kernel module; what it needs of a kernel, the kernel declares."""

import ast
import re
from pathlib import Path

import npu_autopatch
from npu_autopatch.kernels import KERNELS, _catalog

PACKAGE = Path(npu_autopatch.__file__).resolve().parent
MECHANISM = sorted(p for p in PACKAGE.glob("_*.py") if not p.name.startswith("__"))
# A torch_npu op's name; ``npu_autopatch`` (ours) is not one.
OP = re.compile(r"\bnpu_(?!autopatch\b)[a-z_]+")


def _docstrings(tree):
    """The docstring nodes of a module and its classes and functions: prose, not a reference."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_of_kernels(source, kernels, ops, modules):
    """[(line, what)] for each place ``source`` names a kernel: a string (docstrings aside) holding a
    kernel's name as a word or a torch_npu op, an identifier that is an op's name, an import of a
    kernel module."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    word = re.compile(r"\b(" + "|".join(map(re.escape, sorted(kernels))) + r")\b")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            for match in (*word.finditer(node.value), *OP.finditer(node.value)):
                found.append((node.lineno, repr(match.group(0))))
        identifiers = []
        if isinstance(node, ast.Name):
            identifiers.append(node.id)
        elif isinstance(node, ast.Attribute):
            identifiers.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            identifiers.append(node.name)
        found += [(node.lineno, name) for name in identifiers if OP.fullmatch(name) or name in ops]
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                parts = f"{node.module or ''}.{alias.name}".strip(".").split(".")
                after = parts[parts.index("kernels") + 1 :] if "kernels" in parts else []
                if after and after[0] in modules:
                    found.append((node.lineno, f"import of kernels.{after[0]}"))
    return sorted(set(found))


def declared():
    """The words that name a built-in kernel, read from the kernels' own declarations."""
    ops = {op for kernel in KERNELS.values() for op in kernel.ops}
    modules = {line[1] for line in _catalog.BUILTIN}
    return set(KERNELS), ops, modules


def test_no_mechanism_module_names_a_kernel():
    kernels, ops, modules = declared()
    assert {"rope", "loss"} <= kernels and "npu_rms_norm" in ops and "attention" in modules  # read, not empty
    assert len(MECHANISM) > 15, MECHANISM
    named = {}
    for path in MECHANISM:
        found = names_of_kernels(path.read_text(), kernels, ops, modules)
        if found:
            named[path.name] = found
    listing = "\n".join(f"{m}:{line}: {what}" for m, places in named.items() for line, what in places)
    assert named == {}, listing


def test_the_check_finds_a_kernel_named_by_the_mechanism():
    kernels, ops, modules = declared()
    source = '''
"""A docstring may say rope and npu_swiglu."""
from .kernels.loss import steps_aside
KIND = "rope"
def f(x):
    return x.npu_rms_norm(f"the {x} attention kernel")
'''
    assert names_of_kernels(source, kernels, ops, modules) == [
        (3, "import of kernels.loss"),
        (4, "'rope'"),
        (6, "'attention'"),
        (6, "npu_rms_norm"),
    ]


def test_the_fingerprinted_sources_are_derived_from_the_kernels():
    """Every built-in kernel's module and what it builds on (a module it imports, the shared loss
    function) is fingerprinted, without a hand list; the mechanism is not."""
    from npu_autopatch.kernels import _fingerprint

    sources = _fingerprint.sources()
    kernel_modules = {f"npu_autopatch.kernels.{line[1]}" for line in _catalog.BUILTIN}
    assert kernel_modules <= set(sources), sorted(kernel_modules - set(sources))
    helpers = {"gated_delta_scan", "_probe", "_reference", "_fingerprint"}
    assert {f"npu_autopatch.kernels.{m}" for m in helpers} | {"npu_autopatch.losses"} <= set(sources)
    assert not [s for s in sources if s.rpartition(".")[2].startswith("_") and s.count(".") == 1], sources
