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

# Candidate targets by name. The probes, not the names, decide what is patched.
_NORM = re.compile(r"RMSNorm")
_MLP = re.compile(r"(MLP|Mlp|FeedForward|FFN|Ffn)")
_MOE = re.compile(r"(Experts|SparseMoeBlock|SparseMoE|MoE|Moe|MoEBlock|MoeBlock)$")
_ROPE = re.compile(r"^apply_\w*rotary")
# A decoder layer, nominated only in a module with a Gated DeltaNet (linear attention) layer: the
# gated_delta_rule kernel's target (packed sequences kept apart) is the whole layer's forward.
_LAYER = re.compile(r"DecoderLayer$")
# ... and its chunked gated delta rule, which the kernel's chunk-scan variant replaces.
_CHUNK_RULE = "torch_chunk_gated_delta_rule"
_LINEAR_ATTENTION = "GatedDeltaNet"
_KERNELS_FOR = {
    "norm": ("rms_norm", "gated_rms_norm"),
    "mlp": ("swiglu",),
    "rope": ("rope",),
    "moe": ("moe",),
    "linear": ("gated_delta_rule",),
}


@dataclass
class Candidate:
    """A class method or function whose name looks like a target, and what the probes said."""

    path: str  # "Qwen3RMSNorm.forward" or "apply_rotary_pos_emb", in the module's namespace
    kind: str  # norm, mlp, rope, moe, linear
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


def _kind(name: str, obj, linear_attention: bool = False) -> str | None:
    """The kind of target ``name`` looks like; decoder layers only in a linear-attention module."""
    import torch

    if isinstance(obj, type):
        if not issubclass(obj, torch.nn.Module):
            return None
        if linear_attention and _LAYER.search(name):
            return "linear"
        if _NORM.search(name):
            return "norm"
        if _MOE.search(name):
            return "moe"
        if _MLP.search(name) and "Experts" not in name:
            return "mlp"
        return None
    if callable(obj) and _ROPE.match(name):
        return "rope"
    if callable(obj) and linear_attention and name == _CHUNK_RULE:
        return "linear"
    return None


def candidates(module) -> list[Candidate]:
    """The module's targets by name: its classes' ``forward`` (and an MoE block's ``moe``), its
    rotary functions. Classes imported from another transformers module count (4.57's
    Qwen2.5-VL uses qwen2's norm), with the module that defines them."""
    import torch

    found = []
    namespace = vars(module)
    linear_attention = any(_LINEAR_ATTENTION in name for name in namespace)
    for name, obj in sorted(namespace.items()):
        kind = _kind(name, obj, linear_attention)
        if kind is None:
            continue
        home = getattr(obj, "__module__", "") or ""
        if not home.startswith("transformers."):
            continue
        if kind == "rope" or name == _CHUNK_RULE:
            found.append(Candidate(name, kind, home))
            continue
        methods = ["forward"] + (["moe"] if kind == "moe" and callable(getattr(obj, "moe", None)) else [])
        for method in methods:
            if getattr(obj, method) is not torch.nn.Module.forward:  # a forward of its own
                found.append(Candidate(f"{name}.{method}", kind, home))
    return found


def _stock(module, path):
    owner = module
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


def kernels_for(kind: str) -> tuple[str, ...]:
    """The kernels whose probes judge a candidate of this kind (norm, mlp, rope, moe, linear)."""
    return _KERNELS_FOR[kind]


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
    from .kernels import KERNELS, choose_variant

    stock = stock_function(current) or current
    for kernel in kernels_for(candidate.kind):
        try:
            variant, reason = choose_variant(KERNELS[kernel], stock)
        except Exception as exc:  # a probe that raised refuses the candidate, with the error
            variant, reason = None, f"the probe raised {type(exc).__name__}: {exc}"
        if variant is not None:
            candidate.kernel, candidate.variant = kernel, variant.name
            break
        candidate.refused[kernel] = reason
    return candidate
