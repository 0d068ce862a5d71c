"""A shape sweep of every patched rotary function: the shapes real training feeds them, forward and backward.

Whole-model parity runs one tiny batch; the device's rotary kernel refuses shapes by their B, S, N and D
(hicann/ops-transformer rope tilings), so the rotary replacements are also called directly on the shapes
that matter: packed sequences (B = 1, long S), padded batches and B >= S with per-sample positions (a
per-batch cos), many short sequences (B = 32, N = 8, S = 8), decode (S = 1), B*N of 1000 or more, the
[B, S, N, D] layout, partial and interleaved rotary dims, mRoPE, the vision tower's [S, N, D], and a head
dim the kernel cannot take (the replacement must then run stock). The sizes are small, for CPU time; the
shape rules depend on B, S, N and D, not on the size of the tensors. Each case runs stock and patched on the
same inputs and compares the outputs and the gradients of q and k; it also records whether the fused op
ran. The project's tests run it on every stand-in profile; ``verify`` runs it on a real NPU, where a
refusal nobody knew of shows up as a failing case.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .._state import STATE
from ..kernels import KERNELS, choose_variant

# (name, B, S, N, Nk, D, rotary dim, cos batch (1 or "B"), unsqueeze_dim, fused expected). The rotary dim
# None is the variant's: D for the full forms, 16 (or D/2 below 32) for the partial ones.
_SHAPES_4D = [
    ("packed B=1 S=1024", 1, 1024, 2, 1, 64, None, 1, 1, True),
    ("padded per-sample positions", 4, 64, 4, 2, 64, None, "B", 1, True),
    ("many short B=32 N=8 S=8", 32, 8, 8, 8, 32, None, 1, 1, True),
    ("many short, per-sample positions", 32, 8, 8, 8, 32, None, "B", 1, True),
    ("B >= S per-sample positions", 16, 4, 4, 2, 64, None, "B", 1, True),
    ("decode S=1", 4, 1, 4, 2, 64, None, 1, 1, True),
    ("decode S=1 per-sample positions", 4, 1, 4, 2, 64, None, "B", 1, True),
    ("B*N >= 1000", 128, 2, 8, 8, 16, None, 1, 1, True),
    ("small head dim D=16", 8, 16, 4, 2, 16, None, 1, 1, True),
    ("[B, S, N, D] with unsqueeze_dim=2", 4, 16, 4, 2, 64, None, "B", 2, True),
    ("rotary dim 1000: stock", 1, 4, 2, 1, 1000, 1000, 1, 1, False),
]
_VISION_SHAPES = [
    ("vision S=64 N=16 D=80", 64, 16, 80, True),
    ("vision S=1", 1, 2, 80, True),
    ("vision head dim 1000: stock", 4, 1, 1000, False),
]


@dataclass
class SweepCase:
    """One rotary function on one shape in one dtype, stock vs patched."""

    function: str  # module:qualname of the first model that has it
    models: tuple[str, ...]  # every model type whose rotary function has the same code
    variant: str
    shape: str
    dtype: str
    fused_expected: bool
    fused_calls: int = 0
    error: str | None = None  # an exception from the patched call, or a mismatch
    max_error: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.error is None and (self.fused_calls > 0) == self.fused_expected


def _rotary_functions(models=None) -> Iterator[tuple[str, tuple[str, ...], Callable]]:
    """(module:path, model types, stock function) of every rotary target in the installed transformers
    (of ``models`` only, if given), one per distinct code."""
    seen: dict[tuple, list] = {}
    for model_type, model in list(STATE.models.items()):  # the registry: registered models too
        if models is not None and model_type not in models:
            continue
        try:
            module = importlib.import_module(model.module)
        except ImportError:
            continue
        for target in model.targets:
            if target.kernel_name != "rope":
                continue
            for path in target.paths:
                function = getattr(module, path, None)
                code = getattr(function, "__code__", None)
                if code is None:
                    continue
                key = (code.co_code, code.co_names, code.co_varnames)
                if key in seen:
                    seen[key][1].append(model_type)
                else:
                    seen[key] = [f"{model.module}:{path}", [model_type], function]
                break
    for where, models, function in seen.values():
        yield where, tuple(models), function


def _angles(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen) * 3
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _inputs_4d(variant, shape, dtype, gen):
    name, b, s, n, nk, d, rotary, cos_batch, unsqueeze_dim, fused = shape
    if rotary is None:  # partial rotary (Qwen3-Next, Qwen3.5, GLM-4): cos is narrower than the head
        rotary = (16 if d >= 32 else d // 2) if variant in ("partial", "interleave") else d
    cos_b = b if cos_batch == "B" else 1
    layout = (b, n, s, d) if unsqueeze_dim == 1 else (b, s, n, d)
    layout_k = (b, nk, s, d) if unsqueeze_dim == 1 else (b, s, nk, d)
    q = torch.randn(*layout, generator=gen).to(dtype)
    k = torch.randn(*layout_k, generator=gen).to(dtype)
    if variant == "mrope":
        cos, sin = _angles(gen, 3, cos_b, s, rotary)
        half = rotary // 2  # the sections (temporal, height, width) cover half the rotary dim
        section = [half - 2 * (half // 3), half // 3, half // 3]
        args, kwargs = (q, k, cos.to(dtype), sin.to(dtype), section), {"unsqueeze_dim": unsqueeze_dim}
    else:
        cos, sin = _angles(gen, cos_b, s, rotary)
        args, kwargs = (q, k, cos.to(dtype), sin.to(dtype)), {"unsqueeze_dim": unsqueeze_dim}
    return name, args, kwargs, fused


def _inputs_vision(shape, dtype, gen):
    name, s, n, d, fused = shape
    q, k = torch.randn(s, n, d, generator=gen).to(dtype), torch.randn(s, n, d, generator=gen).to(dtype)
    cos, sin = _angles(gen, s, d)
    return name, (q, k, cos, sin), {}, fused


def _tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}


def _run(stock, replacement, args, kwargs, dtype):
    """(max abs error over outputs and q/k gradients, mismatch or None); the patched call may raise."""
    upstream = None
    results = []
    for fn in (stock, replacement):
        q, k = (t.detach().clone().requires_grad_() for t in args[:2])
        out = fn(q, k, *args[2:], **kwargs)
        if upstream is None:
            gen = torch.Generator().manual_seed(7)
            upstream = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in out]
        sum(((o * u).float().sum() for o, u in zip(out, upstream, strict=True)), torch.zeros(())).backward()
        results.append([t.detach() for t in (*out, q.grad, k.grad)])
    worst, mismatch = 0.0, None
    labels = ("q_embed", "k_embed", "grad q", "grad k")
    for label, expected, got in zip(labels, *results, strict=True):
        if expected.shape != got.shape or expected.dtype != got.dtype:
            return (
                worst,
                f"{label}: {tuple(got.shape)} {got.dtype}, stock {tuple(expected.shape)} {expected.dtype}",
            )
        worst = max(worst, (got.float() - expected.float()).abs().max().item())
        if mismatch is None and not torch.allclose(got.float(), expected.float(), **_tolerance(dtype)):
            mismatch = f"{label} differs from stock (max abs error {worst:.2e})"
    return worst, mismatch


def _reraise(exc: BaseException, *tensors: torch.Tensor) -> None:
    raise exc


def sweep(
    npu, dtypes=(torch.float32, torch.bfloat16), device: str = "cpu", calls=None, models=None
) -> list[SweepCase]:
    """Run every rotary function of the installed transformers (of ``models``, if given) on every shape,
    stock vs patched on ``npu``.

    A fused op that raises is a failing case (the replacement's on_error re-raises here, so nothing
    is rescued); a requirement the installed torch_npu misses skips that function's cases. ``calls``
    counts the op calls (default: the stand-in's own ``npu.calls``).
    """
    cases = []
    calls = getattr(npu, "calls", None) if calls is None else calls
    for where, owners, stock in _rotary_functions(models):
        variant, _ = choose_variant(KERNELS["rope"], stock)
        if variant is None:
            continue
        missing = variant.requires(npu) if variant.requires else None
        if missing:
            cases.append(SweepCase(where, owners, variant.name, "-", "-", False, extra={"skipped": missing}))
            continue
        replacement = variant.build(stock, npu, _reraise)
        shapes = _VISION_SHAPES if variant.name == "vision" else _SHAPES_4D
        for dtype in dtypes:
            gen = torch.Generator().manual_seed(0)
            for shape in shapes:
                if variant.name == "vision":
                    name, args, kwargs, fused = _inputs_vision(shape, dtype, gen)
                else:
                    name, args, kwargs, fused = _inputs_4d(variant.name, shape, dtype, gen)
                args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
                case = SweepCase(where, owners, variant.name, name, str(dtype).replace("torch.", ""), fused)
                before = calls["npu_rotary_mul"] if calls is not None else 0
                try:
                    case.max_error, case.error = _run(stock, replacement, args, kwargs, dtype)
                except Exception as exc:  # the report names the case; the sweep goes on
                    case.error = f"{type(exc).__name__}: {exc}"
                case.fused_calls = (calls["npu_rotary_mul"] - before) if calls is not None else int(fused)
                cases.append(case)
    return cases
