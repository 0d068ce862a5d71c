"""Which code of a modeling module looks like a kernel's target, and whether its probe agrees.

Shared by ``python -m npu_autopatch scan`` (every modeling module) and opt-in discovery (a
module the table does not know, when it is imported). Names only nominate candidates; the
kernels' probes (``kernels.choose_variant``, the check the patcher runs before every swap)
decide.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ._state import STATE
from ._types import Kernel


@dataclass
class Candidate:
    """A class method or function whose name looks like a target, and what the probes said."""

    path: str  # "Qwen3RMSNorm.forward" or "apply_rotary_pos_emb", in the module's namespace
    kind: str  # the kind of its Pattern: norm, mlp, rope, moe, linear, or a plugin kernel's
    defined_in: str  # the module that defines it (another one for an imported class)
    kernel: str | None = None  # the kernel whose probe accepted it
    variant: str | None = None
    refused: dict[str, str] = field(default_factory=dict)  # kernel -> why its probes refused


def transformers_dir() -> str:
    """The installed transformers package directory, found without importing transformers."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("transformers is not installed")
    return next(iter(spec.submodule_search_locations))


def modeling_modules(root: str | None = None) -> dict[str, list[str]]:
    """{package directory: [modeling module names]} from ``transformers/models/*/modeling_*.py``.

    4.x TensorFlow and Flax modules are left out: our kernels are torch code. ``os.scandir``
    reads the entry types with the names (no stat per entry): discovery lists ~540 directories
    when transformers is imported.
    """
    models = os.path.join(root or transformers_dir(), "models")
    found = {}
    with os.scandir(models) as folders:
        for folder in sorted((entry for entry in folders if entry.is_dir()), key=lambda entry: entry.name):
            with os.scandir(folder.path) as files:
                names = sorted(
                    f"transformers.models.{folder.name}.{entry.name[:-3]}"
                    for entry in files
                    if entry.name.startswith("modeling_")
                    and entry.name.endswith(".py")
                    and not entry.name.startswith(("modeling_tf_", "modeling_flax_"))
                )
            if names:
                found[folder.name] = names
    return found


def kernels() -> dict[str, Kernel]:
    """{name: Kernel} of every kernel known here: the built-in ones, then the Kernels the registered
    models name (a plugin's, register()'s), each name once (their patterns nominate candidates, their
    ``Report`` adds to report())."""
    from .kernels import KERNELS

    found = dict(KERNELS)
    for model in list(STATE.models.values()):
        for target in model.targets:
            if isinstance(target.kernel, Kernel):
                found.setdefault(target.kernel.name, target.kernel)
    return found


def _patterns(known=None):
    return [pattern for kernel in (known or kernels()).values() for pattern in kernel.candidates]


def kind_of(name: str, obj, namespace=(), patterns=None) -> str | None:
    """The kind of candidate ``name`` (a class or function of a module whose names are ``namespace``)
    looks like by the kernels' patterns, first match in the kernels' order; None for none."""
    import torch

    is_class = isinstance(obj, type)
    if is_class and not issubclass(obj, torch.nn.Module):
        return None
    if not is_class and not callable(obj):
        return None
    for pattern in _patterns() if patterns is None else patterns:
        wanted = pattern.classes if is_class else pattern.functions
        if wanted is None or not re.search(wanted, name):
            continue
        if is_class and pattern.not_named is not None and re.search(pattern.not_named, name):
            continue
        if pattern.only_beside is not None and not any(pattern.only_beside in other for other in namespace):
            continue
        return pattern.kind
    return None


def candidates(module) -> list[Candidate]:
    """The module's targets by name (the kernels' ``Pattern``s): a class's methods of the pattern that
    it defines itself (``forward``, an MoE block's ``moe``), a function itself. Classes imported from
    another transformers module count (4.57's Qwen2.5-VL uses qwen2's norm), with the module that
    defines them."""
    import torch

    found = []
    namespace = vars(module)
    patterns = _patterns()
    methods_of = {}
    for pattern in patterns:
        methods_of.setdefault(pattern.kind, pattern.methods)
    for name, obj in sorted(namespace.items()):
        kind = kind_of(name, obj, namespace, patterns)
        if kind is None:
            continue
        home = getattr(obj, "__module__", "") or ""
        if not home.startswith("transformers."):
            continue
        if not isinstance(obj, type):
            found.append(Candidate(name, kind, home))
            continue
        for method in methods_of[kind]:
            code = getattr(obj, method, None)
            if callable(code) and code is not getattr(torch.nn.Module, method, None):  # its own
                found.append(Candidate(f"{name}.{method}", kind, home))
    return found


def _stock(module, path):
    owner = module
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


def kernels_for(kind: str) -> tuple[str, ...]:
    """The kernels whose probes judge a candidate of this kind: the ones with a pattern of that kind."""
    return tuple(name for name, kernel in kernels().items() if any(p.kind == kind for p in kernel.candidates))


def stock_code(module, path: str):
    """The stock function at ``path`` of ``module``, unwrapped as the probes see it (the scan and the
    verdict generator probe it too)."""
    from ._resolve import stock_function

    current = _stock(module, path)
    return stock_function(current) or current


def probe(module, candidate: Candidate) -> Candidate:
    """Ask each kernel of the candidate's kind whether one of its variants reproduces it."""
    return probe_code(_stock(module, candidate.path), candidate)


def probe_code(current, candidate: Candidate) -> Candidate:
    """``probe`` for code in hand (``current``, what the candidate's path holds), wherever it lives."""
    from ._resolve import stock_function
    from .kernels import choose_variant

    stock = stock_function(current) or current
    known = kernels()
    for kernel in kernels_for(candidate.kind):
        try:
            variant, reason = choose_variant(known[kernel], stock)
        except Exception as exc:  # a probe that raised refuses the candidate, with the error
            variant, reason = None, f"the probe raised {type(exc).__name__}: {exc}"
        if variant is not None:
            candidate.kernel, candidate.variant = kernel, variant.name
            break
        candidate.refused[kernel] = reason
    return candidate
