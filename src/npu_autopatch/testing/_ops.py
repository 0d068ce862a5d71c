"""The stand-in's ops: the device's checks on top of the reference math, per op, and their backward math.

What each op computes comes from ``npu_autopatch.kernels._reference`` (the one definition the probes
use too) or, for the ops no kernel calls, from the op-plugin golden tests as written here. What the
device REFUSES is added on top, each rule with its source: the CANN kernels' host-side tiling
checks (hicann/ops-transformer), the op-plugin adapters (Ascend/op-plugin, per release branch), and
where no source check exists, the op documentation (``torch_npu_ops.md`` §N, op-plugin's docs).
What changed between release lines is a field of the profile (_profiles.py). _library.py registers
these functions as torch.library ops, one namespace per profile.

Two kinds of error are raised on purpose:

* ``RuntimeError``: the real op rejects the call, as ``TORCH_CHECK`` or a failed tiling does on the device.
* ``NotImplementedError``: the call is valid on the device but this stand-in does not model it (quantisation,
  drop/pad routing, ...), so a test must not pass by accident.

Where the device leaves memory uninitialised (an output it allocates with ``empty`` and never writes), the
stand-in fills it with NaN, the worst case, so that a caller trusting it fails the parity tests.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..kernels import _reference
from ._profiles import Profile

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# §2: the (x, gamma) dtype pairs of Atlas A2/A3 (op-plugin docs, torch_npu-npu_rms_norm.md).
_RMS_NORM_DTYPE_PAIRS = frozenset(
    {
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    }
)

# §7: non-quantised grouped_matmul, bias dtype by x dtype.
_GMM_BIAS_DTYPE = {torch.float16: torch.float16, torch.bfloat16: torch.float32, torch.float32: torch.float32}

_INT32_MAX = 2**31 - 1


def _check(condition: bool, message: str) -> None:
    """Raise like the device's TORCH_CHECK (or a failed tiling) does."""
    if not condition:
        raise RuntimeError(message)


def _unsupported(condition: bool, message: str) -> None:
    """Refuse a path the device supports but the stand-in does not model."""
    if condition:
        raise NotImplementedError(f"torch_npu stand-in: {message}")


def not_implemented_message(name: str) -> str:
    # autogradNotImplementedFallback names the op by its schema name; the device's namespace is npu.
    return f"derivative for npu::{name} is not implemented"


def uninitialised(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Memory the device allocates and never writes: NaN here, so that nothing can rely on it."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# RMSNorm family (§2, §3)
# ----------------------------------------------------------------------------------------------------


def _check_norm_args(name: str, x: Tensor, gamma: Tensor) -> None:
    _check(
        1 <= gamma.dim() <= x.dim() and tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]),
        f"{name}: gamma shape {tuple(gamma.shape)} must equal the trailing dims of input {tuple(x.shape)}",
    )


def _check_rms_norm(name: str, x: Tensor, gamma: Tensor) -> None:
    # op-plugin docs, (beta)torch_npu-npu_rms_norm.md: input 2-8-D; empty and non-contiguous tensors are fine.
    _check(2 <= x.dim() <= 8, f"{name}: input must be 2-8-D, got {x.dim()}-D")
    _check_norm_args(name, x, gamma)
    _check(
        (x.dtype, gamma.dtype) in _RMS_NORM_DTYPE_PAIRS,
        f"{name}: unsupported (input, gamma) dtypes ({x.dtype}, {gamma.dtype})",
    )


def rms_norm(profile: Profile, input: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple[Tensor, Tensor]:
    _check_rms_norm("npu_rms_norm", input, gamma)
    # Whether the kernel rounds x*rstd before the gamma multiply for bf16 is UNKNOWN; the golden's single
    # cast is used (the reference).
    return _reference.npu_rms_norm(input, gamma, epsilon)


def _sum_leading(t: Tensor, n: int) -> Tensor:
    # sum(dim=()) would reduce every dim, so an empty leading set must stay unreduced.
    return t.sum(dim=tuple(range(n))) if n else t


def rms_norm_backward(
    profile: Profile, dy: Tensor, input: Tensor, gamma: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """(dx [x.dtype], dgamma [fp32, gamma.shape]), the golden of test_npu_rms_norm_backward.py."""
    x = input
    _check(
        dy.shape == x.shape, f"npu_rms_norm_backward: dy shape {tuple(dy.shape)} != input {tuple(x.shape)}"
    )
    _check_norm_args("npu_rms_norm_backward", x, gamma)
    xf, dyf, gf = x.float(), dy.float(), gamma.float()
    norm_dims = tuple(range(-gamma.dim(), 0))
    dgamma = _sum_leading(dyf * xf * rstd, x.dim() - gamma.dim())
    inner = (rstd.pow(3) * dyf * gf * xf).sum(dim=norm_dims, keepdim=True)
    dx = dyf * gf * rstd - xf * inner / gamma.numel()
    return dx.to(x.dtype), dgamma


def gemma_rms_norm(
    profile: Profile, input: Tensor, gamma: Tensor, epsilon: float = 1e-06
) -> tuple[Tensor, Tensor]:
    """y = x*rstd*(1+gamma) in fp32; no autograd kernel on any branch (generic fallback)."""
    # The dtype table is documented for npu_rms_norm only (UNKNOWN here); the same pairs are enforced.
    _check_rms_norm("npu_gemma_rms_norm", input, gamma)
    _, rstd = _reference.npu_rms_norm(input, gamma, epsilon)
    return (input.float() * rstd * (1.0 + gamma.float())).to(input.dtype), rstd


def add_rms_norm(
    profile: Profile, x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-06
) -> tuple[Tensor, Tensor, Tensor]:
    """Residual add then RMSNorm: (y, rstd, x1 + x2); the sum is rounded to the input dtype first."""
    _check(x1.dtype in _FLOATS, f"npu_add_rms_norm: unsupported dtype {x1.dtype}")
    # Broadcasting between x1 and x2 is undocumented (UNKNOWN): equal shapes and dtypes are required.
    _check(
        x2.dtype == x1.dtype and x2.shape == x1.shape,
        f"npu_add_rms_norm: x2 {tuple(x2.shape)}/{x2.dtype} must match x1 {tuple(x1.shape)}/{x1.dtype}",
    )
    _check(gamma.dtype == x1.dtype, f"npu_add_rms_norm: gamma dtype {gamma.dtype} must equal x1's {x1.dtype}")
    _check(1 <= x1.dim() <= 8, f"npu_add_rms_norm: input must be 1-8-D, got {x1.dim()}-D")
    _check(x1.numel() > 0, "npu_add_rms_norm: empty tensors are not supported")
    _check_norm_args("npu_add_rms_norm", x1, gamma)
    x = x1 + x2
    y, rstd = _reference.npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


# ----------------------------------------------------------------------------------------------------
# SwiGLU (§4)
# ----------------------------------------------------------------------------------------------------


def _check_swiglu(name: str, x: Tensor, dim: int) -> None:
    # op-plugin docs, (beta)torch_npu-npu_swiglu.md: 1-8-D, even along dim, contiguous, not empty.
    _check(x.dtype in _FLOATS, f"{name}: unsupported dtype {x.dtype}")
    _check(1 <= x.dim() <= 8, f"{name}: input must be 1-8-D, got {x.dim()}-D")
    _check(-x.dim() <= dim < x.dim(), f"{name}: dim {dim} out of range for a {x.dim()}-D input")
    _check(x.numel() > 0, f"{name}: empty input is not supported")
    _check(x.is_contiguous(), f"{name}: input must be contiguous")
    _check(x.shape[dim] % 2 == 0, f"{name}: size {x.shape[dim]} along dim {dim} must be even")


def swiglu(profile: Profile, input: Tensor, dim: int = -1) -> Tensor:
    _check_swiglu("npu_swiglu", input, dim)
    return _reference.npu_swiglu(input, dim)


def swiglu_backward(profile: Profile, grad_output: Tensor, input: Tensor, dim: int = -1) -> Tensor:
    """The golden of test_npu_swiglu_backward.py, fp32 inside."""
    _check_swiglu("npu_swiglu_backward", input, dim)
    a, b = input.float().chunk(2, dim)
    _check(
        grad_output.shape == a.shape,
        f"npu_swiglu_backward: grad shape {tuple(grad_output.shape)} != {tuple(a.shape)}",
    )
    g = grad_output.float()
    s = torch.sigmoid(a)
    da = g * b * (s + a * s * (1 - s))
    db = g * a * s
    return torch.cat((da, db), dim).to(input.dtype)


# ----------------------------------------------------------------------------------------------------
# RoPE (§5): the CANN RotaryPositionEmbedding kernels' tiling, hicann/ops-transformer posembedding/
# ----------------------------------------------------------------------------------------------------

# Atlas A2 vector cores: 48 on the 910B1/B2, 40 on the 910B3/B4. CheckBnsdBlockSkip refuses more
# shapes the more cores there are; the stand-in takes the strictest part.
AIV_CORES = 48
# rope_rotate_half_tiling.cpp D_LENGTH_LIMIT / rope_half_grad_tiling.cpp D_THRESHOLD: D > 896 is refused.
ROTARY_D_LIMIT = 896


def half_forward_layout(x: Sequence[int], r: Sequence[int]) -> tuple[str, int, int, int]:
    """(tiling mode, broadcastFirstDim, broadcastSecondDim, totalSLines) of a half-mode forward:
    rope_rotate_half_tiling.cpp ChooseTilingMode, case by case. The layout is never given: it is
    inferred from which of the first three dims of r (cos) differ from x's."""
    x0, x1, x2 = x[:3]
    r0, r1, r2 = r[:3]
    if (r0, r1, r2) == (x0, x1, x2):
        return "NO_BROADCAST", 1, 1, x0 * x1 * x2
    if r0 == r1 == r2 == 1:  # S = 1: BND; totalSLines is only set when one of x's dims is 1
        lines = x1 * x2 if x0 == 1 else x0 * x2 if x1 == 1 else x0 * x1 if x2 == 1 else 0
        return "BND", 1, 1, lines
    if x0 != r0 and x1 != r1:
        return "BNSD", x0, x1, x2
    if x0 != r0 and x2 != r2:
        return "BSND", x0, x2, x1
    if x1 != r1 and x2 != r2:
        return "SBND", x1, x2, x0
    if x0 != r0 and (r1 == 1 or r2 == 1):  # x B1SD or BS1D
        return "BSND", x0, 1, x1 * x2
    if x1 != r1 and r2 == 1:  # x SB1D
        return "SBND", x1, 1, x0
    if r2 != x2 and r0 == x0 and r1 == x1:  # r BS1D or SB1D
        return "SBND", 1, x2, x0 * x1
    if r1 != x1 and r0 == x0 and r2 == x2:  # r B1SD
        return "R_B1SD", x0, x1, x2
    return "UNKNOWN", 0, 0, 0


def bnsd_block_skip(b: int, n: int, s: int, d: int, itemsize: int) -> bool:
    """rope_rotate_half_tiling.cpp CheckBnsdBlockSkip: whether a BNSD-layout call is refused.

    D/2 32-byte aligned: B*N > 8*S; otherwise 2*B*N > ceil(S / cores) and D < 80."""
    aligned = (d // 2) % (32 // itemsize) == 0
    if aligned:
        return b * n > 8 * s
    return 2 * b * n > -(-s // AIV_CORES) and d < 80


def half_backward_layout(x: Sequence[int], r: Sequence[int]) -> str | None:
    """rope_half_grad_tiling.cpp RopeHalfGradSelectLayout: the (x, cos) pairs the backward takes."""
    x0, x1, x2 = x[:3]
    c0, c1, c2 = r[:3]
    if (x0, x1, x2) == (c0, c1, c2):
        return "BSND"  # no broadcast
    if x0 != 1 and c0 == 1 and x1 == c1 and c2 == 1:
        return "BSND"  # x BSND, cos 1S1D
    if x0 == c0 and x1 == c1 and c2 == 1 and x0 < x1:
        return "BSND"  # x BSND, cos BS1D, B < S
    if x0 != 1 and c0 == 1 and c1 == 1 and x2 == c2:
        return "BNSD"  # x BNSD, cos 11SD
    if x0 == c0 and c1 == 1 and x2 == c2 and x0 < x2:
        return "BNSD"  # x BNSD, cos B1SD, B < S
    if x0 == c0 and x1 != 1 and c1 == 1 and c2 == 1:
        return "SBND"  # x SBND, cos S11D
    if x0 == c0 and x1 == c1 and c2 == 1:
        return "SBND"  # x SBND, cos SB1D
    return None


def interleave_forward_layout(x: Sequence[int], r: Sequence[int]) -> tuple[str, int, int] | None:
    """rope_interleaved_tiling.cpp TilingSplit: (layout, batch, heads), or None (refused)."""
    x0, x1, x2 = x[:3]
    c0, c1, c2 = r[:3]
    if c1 == 1 and c2 == 1 and x0 == c0:
        return "SBND", 1, x1 * x2
    if c0 == 1 and c2 == 1 and x1 == c1:
        return "BSND", x0, x2
    if c0 == 1 and c1 == 1 and x2 == c2:
        return "BNSD", x0 * x1, 1
    return None


def interleave_backward_layout(x: Sequence[int], r: Sequence[int]) -> str | None:
    """rope_interleaved_grad_tiling.cpp TilingLayoutSplit: the (x, cos) pairs the backward takes."""
    x0, x1, x2 = x[:3]
    c0, c1, c2 = r[:3]
    if c0 == 1 and c2 == 1 and x1 == c1:
        return "BSND"
    if c0 == 1 and c1 == 1 and x2 == c2:
        return "BNSD"
    if c1 == 1 and c2 == 1 and x0 == c0:
        return "SBND"
    return None


def _check_rotary_common(name: str, x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> None:
    # RotaryMulKernelNpuOpApi.cpp: only 'half' and 'interleave' ('quarter', 'interleave-half': Ascend 950).
    _check(
        mode in ("half", "interleave"),
        f"{name}: The rotary_mode of npu_rotary_mul should be half or interleave, but got {mode}",
    )
    # rope_rotate_half_tiling.cpp CheckShapeSupport "the input shape must be 4-dimensional";
    # rope_interleaved_tiling.cpp CheckInputShape; rope_half_grad_tiling.cpp "only support 4-d input".
    # (op-plugin >= 26.0.0 calls aclnnRotaryPositionEmbeddingV2 where CANN has it; its 3-D support is
    # documented but untested upstream and its rules are not published: UNKNOWN, modelled as V1.)
    _check(
        x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4,
        f"{name}: the input shape must be 4-dimensional, got x {tuple(x.shape)}, cos {tuple(r1.shape)}",
    )
    for t in (x, r1, r2):
        _check(
            t.dtype in _FLOATS, f"{name}: only supports float, float16 and bfloat16 data type, got {t.dtype}"
        )
    _check(
        r1.shape == r2.shape, f"{name}: cos shape {tuple(r1.shape)} and sin shape {tuple(r2.shape)} differ"
    )
    d = x.shape[-1]
    _check(r1.shape[-1] == d, f"{name}: input last dim (head_dim) should be equal, x {d}, cos {r1.shape[-1]}")
    _check(d % 2 == 0, f"{name}: input last dim (head_dim) {d} must be an even number")
    _check(d <= ROTARY_D_LIMIT, f"{name}: input last dim (head_dim) {d} should be at most {ROTARY_D_LIMIT}")
    # The kernels read r at the broadcast positions; torch's broadcasting rule is the least they need.
    _check(
        all(r1.shape[i] in (1, x.shape[i]) for i in range(3)),
        f"{name}: cos {tuple(r1.shape)} does not broadcast to input {tuple(x.shape)}",
    )


def check_rotary_forward(x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> None:
    name = "npu_rotary_mul"
    _check_rotary_common(name, x, r1, r2, mode)
    xs, rs, d = tuple(x.shape), tuple(r1.shape), x.shape[-1]
    needs_grad = r1.requires_grad or r2.requires_grad  # (the kernel runs below autograd: no grad mode)
    if mode == "half":
        layout, b, n, lines = half_forward_layout(xs, rs)
        _check(layout != "UNKNOWN", f"{name}: unknow input layout, unable to calculate: x {xs}, cos {rs}")
        _check(lines > 0, f"{name}: cos {rs} broadcasts over every dim of x {xs}: no layout (S lines unset)")
        _check(
            not (layout == "BNSD" and bnsd_block_skip(b, n, lines, d, x.element_size())),
            f"{name}: when input is BNSD layout and B * N is large or D is not aligned, please do not use "
            f"RotaryPositionEmbedding fusion operator (x {xs}, cos {rs}, B*N={b * n}, S={lines}, D={d})",
        )
        # Documented only (torch_npu-npu_rotary_mul.md, aclnnRotaryPositionEmbedding.md), read as the
        # tiling's broadcast dims: B, N < 1000; B*N <= 1024 when cos/sin need gradients.
        _check(b < 1000 and n < 1000, f"{name}: half mode needs B < 1000 and N < 1000, got B={b}, N={n}")
        _check(not needs_grad or b * n <= 1024, f"{name}: B*N={b * n} must be <= 1024 when r1/r2 need grad")
    else:
        found = interleave_forward_layout(xs, rs)
        _check(
            found is not None, f"{name}: The shape of the input x {xs}, cos and sin {rs} is not supported."
        )
        _, batch, heads = found
        _check(d < ROTARY_D_LIMIT, f"{name}: interleave mode needs D < {ROTARY_D_LIMIT}, got {d}")  # doc
        _check(batch * heads < 1000, f"{name}: interleave mode needs B*N < 1000, got {batch * heads}")  # doc


def check_rotary_backward(grad: Tensor, x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> None:
    name = "npu_rotary_mul_backward"
    _check_rotary_common(name, x, r1, r2, mode)
    _check(grad.shape == x.shape, f"{name}: grad {tuple(grad.shape)} != input {tuple(x.shape)}")
    xs, rs = tuple(x.shape), tuple(r1.shape)
    layout = half_backward_layout(xs, rs) if mode == "half" else interleave_backward_layout(xs, rs)
    _check(layout is not None, f"{name}: invalid shape! x shape: {xs} and cos shape: {rs}")


def rotary_mul(
    profile: Profile,
    input: Tensor,
    r1: Tensor,
    r2: Tensor,
    rotary_mode: str = "half",
    rotate: Tensor | None = None,
) -> Tensor:
    check_rotary_forward(input, r1, r2, rotary_mode)
    if rotate is not None:
        d = input.shape[-1]
        _check(
            tuple(rotate.shape) == (d, d),
            f"npu_rotary_mul: rotate must be [{d}, {d}], got {tuple(rotate.shape)}",
        )
    return _reference.npu_rotary_mul(input, r1, r2, rotary_mode, rotate)


def _rotate_adjoint(y: Tensor, mode: str) -> Tensor:
    """The transpose of the rotation: <rotate(x), y> == <x, rotate_adjoint(y)>."""
    if mode == "half":
        y1, y2 = y.chunk(2, -1)
        return torch.cat((y2, -y1), -1)
    return torch.stack((y[..., 1::2], -y[..., ::2]), -1).reshape(y.shape)


def rotary_mul_backward(
    profile: Profile, grad: Tensor, input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half"
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dr1, dr2) in x's dtype, dr1/dr2 summed to r1/r2's shape (test_npu_rotary_mul_backward.py)."""
    check_rotary_backward(grad, input, r1, r2, rotary_mode)
    g = grad.to(input.dtype)
    dx = g * r1.to(input.dtype) + _rotate_adjoint(g * r2.to(input.dtype), rotary_mode)
    dr1 = (g * input).sum_to_size(r1.shape)
    dr2 = (g * _reference.rotate_by_mode(input, rotary_mode)).sum_to_size(r2.shape)
    return dx, dr1, dr2


def _check_apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str, mode: str) -> None:
    name = "npu_apply_rotary_pos_emb"
    _check(mode == "half", f"{name}: rotary_mode {mode!r} is not supported on Atlas A2/A3; only 'half'")
    # C++ layout mapping: SBND -> 2, BNSD -> 3, TND -> 4, anything else (BSND, 'BSH', ...) -> BSND.
    code = {"SBND": 2, "BNSD": 3, "TND": 4}.get(layout, 1)
    _check(code in (1, 4), f"{name}: layout {layout!r} is not supported on Atlas A2/A3; only BSND and TND")
    ndim = 4 if code == 1 else 3
    for t in (q, k, cos, sin):
        _check(t.dim() == ndim, f"{name}: layout {layout!r} needs {ndim}-D tensors, got {tuple(t.shape)}")
    _check(
        q.dtype in _FLOATS and all(t.dtype == q.dtype for t in (k, cos, sin)),
        f"{name}: query, key, cos and sin must share one dtype among fp16/bf16/fp32",
    )
    d = q.shape[-1]
    _check(d in (64, 128), f"{name}: head dim D must be 64 or 128, got {d}")
    lead = tuple(q.shape[: ndim - 2])
    _check(
        tuple(k.shape[: ndim - 2]) == lead and k.shape[-1] == d,
        f"{name}: key {tuple(k.shape)} does not match query {tuple(q.shape)}",
    )
    expected = (*lead, 1, d)
    _check(
        tuple(cos.shape) == expected and tuple(sin.shape) == expected,
        f"{name}: cos/sin must be exactly {expected} (no broadcasting), got {tuple(cos.shape)}",
    )


def apply_rotary_pos_emb(
    profile: Profile,
    query: Tensor,
    key: Tensor,
    cos: Tensor,
    sin: Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
) -> tuple[Tensor, Tensor]:
    """RoPE on query and key IN PLACE (ApplyRotaryPosEmbNpuOpApi.cpp returns std::tie(query, key))."""
    _check_apply_rope(query, key, cos, sin, layout, rotary_mode)
    new_query = _reference.npu_rotary_mul(query, cos, sin)
    new_key = _reference.npu_rotary_mul(key, cos, sin)
    query.copy_(new_query)
    key.copy_(new_key)
    return query, key


# ----------------------------------------------------------------------------------------------------
# Fusion attention (§6.1)
# ----------------------------------------------------------------------------------------------------

_FA_RANKS = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4, "TND": 3}  # layout -> rank of query, key and value
_FA_COMPRESSED = 2048  # side of the compressed mask that sparse modes 2-4 take
_FA_STATS = 8  # softmax_max/softmax_sum repeat each row's value 8 times in their last dim


@dataclass(frozen=True)
class _FaGeometry:
    """The sizes of one call. TND is computed as a single batch of T tokens with block-diagonal segments."""

    layout: str
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    v_dim: int
    segments: tuple[tuple[int, int, int, int], ...] | None  # TND: (q_start, q_end, kv_start, kv_end)


@functools.cache
def _fa_compressed_mask() -> Tensor:
    """triu(ones(2048, 2048), 1): the mask HF (get_attn_mask_npu) and the docs pass for sparse modes 2-4."""
    return torch.ones(_FA_COMPRESSED, _FA_COMPRESSED, dtype=torch.bool).triu(1)


def _fa_segments(
    name: str, qlen: Sequence[int] | None, kvlen: Sequence[int] | None, tq: int, tkv: int
) -> tuple[tuple[int, int, int, int], ...]:
    """TND segments from the cumulative end offsets (no leading 0); trailing batches with both ends 0 are
    disabled."""
    _check(
        bool(qlen) and bool(kvlen) and len(qlen) == len(kvlen),
        f"{name}: the size of actual_seq_qlen and actual_seq_kvlen must be the same and cannot be empty.",
    )
    ends = [(int(q), int(kv)) for q, kv in zip(qlen, kvlen, strict=True)]
    while ends and ends[-1] == (0, 0):
        ends.pop()
    segments, q0, kv0 = [], 0, 0
    for q1, kv1 in ends:
        _check(
            q1 >= q0 and kv1 >= kv0,
            f"{name}: actual_seq_qlen {list(qlen)} and actual_seq_kvlen {list(kvlen)} must be cumulative "
            "(non-decreasing) end offsets",
        )
        segments.append((q0, q1, kv0, kv1))
        q0, kv0 = q1, kv1
    _check(q0 <= tq and kv0 <= tkv, f"{name}: actual_seq lists end at {q0}/{kv0}, past T = {tq}/{tkv}")
    _unsupported(q0 < tq or kv0 < tkv, f"{name}: tokens past the last actual_seq offset (undefined)")
    return tuple(segments)


def _fa_geometry(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    head_num: int,
    layout: str,
    qlen: Sequence[int] | None,
    kvlen: Sequence[int] | None,
) -> _FaGeometry:
    rank = _FA_RANKS[layout]
    for label, t in (("query", q), ("key", k), ("value", v)):
        _check(t.dim() == rank, f"{name}: layout {layout} needs a {rank}-D {label}, got {tuple(t.shape)}")
    _check(q.dtype in _FLOATS, f"{name}: unsupported dtype {q.dtype}")
    _check(
        k.dtype == q.dtype and v.dtype == q.dtype,
        f"{name}: query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}",
    )
    _check(
        k.shape[:-1] == v.shape[:-1],
        f"{name}: key {tuple(k.shape)} and value {tuple(v.shape)} must match outside the last dim",
    )
    _check(1 <= head_num <= 256, f"{name}: head_num={head_num} must be in 1..256")
    if layout in ("BSH", "SBH"):
        hq, hk, hv = q.shape[-1], k.shape[-1], v.shape[-1]
        _check(
            hq > 0 and hq % head_num == 0, f"{name}: query hidden size {hq} is not head_num={head_num} heads"
        )
        d = hq // head_num
        kv_heads = hk // d
        _check(
            kv_heads > 0 and hk == kv_heads * d and hv % kv_heads == 0,
            f"{name}: key/value hidden sizes {hk}/{hv} are not whole heads of D={d}",
        )
        heads, dv = head_num, hv // kv_heads
        batch_dim, seq_dim = (0, 1) if layout == "BSH" else (1, 0)
    else:
        heads_dim, seq_dim, batch_dim = {"BSND": (2, 1, 0), "BNSD": (1, 2, 0), "TND": (1, 0, 0)}[layout]
        heads, kv_heads, d, dv = q.shape[heads_dim], k.shape[heads_dim], q.shape[-1], v.shape[-1]
        _check(heads == head_num, f"{name}: query has {heads} heads but head_num={head_num}")
        _check(k.shape[-1] == d, f"{name}: query and key head dims differ ({d} vs {k.shape[-1]})")
    _check(1 <= d <= 768, f"{name}: head dim D={d} must be in 1..768")
    _check(1 <= dv <= d, f"{name}: value head dim {dv} must be in 1..D={d}")
    _check(
        kv_heads > 0 and heads % kv_heads == 0,
        f"{name}: {heads} query heads are not a multiple of {kv_heads} key/value heads",
    )
    q_len, kv_len = q.shape[seq_dim], k.shape[seq_dim]
    _check(q_len > 0 and kv_len > 0, f"{name}: empty sequences are not supported")
    if layout == "TND":
        segments = _fa_segments(name, qlen, kvlen, q_len, kv_len)
        return _FaGeometry(layout, 1, heads, kv_heads, q_len, kv_len, dv, segments)
    _unsupported(
        qlen is not None or kvlen is not None,
        f"{name}: actual_seq_qlen/actual_seq_kvlen with layout {layout}",
    )
    batch = q.shape[batch_dim]
    _check(
        batch > 0 and k.shape[batch_dim] == batch,
        f"{name}: query and key batch sizes differ or are empty ({batch} vs {k.shape[batch_dim]})",
    )
    return _FaGeometry(layout, batch, heads, kv_heads, q_len, kv_len, dv, None)


def _fa_check_options(
    name: str,
    geo: _FaGeometry,
    dtype: torch.dtype,
    pse: Tensor | None,
    mask: Tensor | None,
    keep_prob: float,
    sparse_mode: int,
    inner_precise: int,
    softmax_layout: str,
    unmodelled: dict[str, Any],
) -> None:
    tnd = geo.segments is not None
    _check(0 < keep_prob <= 1, f"{name}: The keep_prob value must be in range of (0, 1], but got {keep_prob}")
    _unsupported(
        keep_prob != 1, f"{name}: dropout (keep_prob={keep_prob}) needs the device's Philox generator"
    )
    _check(
        sparse_mode in ((0, 1, 2, 3, 4, 6, 7, 8) if tnd else range(7)),
        f"{name}: The sparse_mode value must be in range of {'[0,5) or (5,8]' if tnd else '[0,6]'}, but got "
        f"{sparse_mode}",
    )
    _unsupported(sparse_mode >= 5, f"{name}: sparse_mode {sparse_mode} (prefix and outer-split modes)")
    given = sorted(k for k, value in unmodelled.items() if value is not None)
    _unsupported(bool(given), f"{name}: {', '.join(given)}")
    # inner_precise only changes how fully masked rows are computed; they give 0 here whatever its value.
    _unsupported(inner_precise not in (0, 1, 2), f"{name}: inner_precise={inner_precise}")
    _unsupported(
        softmax_layout not in ("", "TND") or (softmax_layout == "TND" and not tnd),
        f"{name}: softmax_layout={softmax_layout!r} with layout {geo.layout}",
    )
    if pse is not None:
        _check(pse.dtype == dtype, f"{name}: pse dtype {pse.dtype} must equal the query's {dtype}")
        _unsupported(tnd, f"{name}: pse with the TND layout")
        b, n, sq, skv = geo.batch, geo.heads, geo.q_len, geo.kv_len
        _unsupported(
            tuple(pse.shape) not in {(b, n, sq, skv), (b, n, 1, skv), (1, n, sq, skv)},
            f"{name}: pse shape {tuple(pse.shape)}; modelled: [B,N,Sq,Skv], [B,N,1,Skv], [1,N,Sq,Skv]",
        )
    if mask is None:
        return
    _check(
        mask.dtype in (torch.bool, torch.uint8), f"{name}: atten_mask must be bool or uint8, got {mask.dtype}"
    )
    if sparse_mode >= 2:
        _check(
            tuple(mask.shape) == (_FA_COMPRESSED, _FA_COMPRESSED),
            f"{name}: sparse_mode {sparse_mode} takes the 2048x2048 compressed mask, got {tuple(mask.shape)}",
        )
        # The kernel reads tiles of the compressed mask; any other content is not modelled.
        _unsupported(
            not torch.equal(mask.bool(), _fa_compressed_mask()),
            f"{name}: a compressed mask other than triu(ones(2048, 2048), 1)",
        )
        lengths = [(q1 - q0, kv1 - kv0) for q0, q1, kv0, kv1 in geo.segments or ()]
        _check(
            sparse_mode != 3 or all(sq <= skv for sq, skv in lengths or [(geo.q_len, geo.kv_len)]),
            f"{name}: sparse_mode=3 requires Sq <= Skv in every batch",
        )
        return
    _unsupported(tnd, f"{name}: a full atten_mask (sparse_mode {sparse_mode}) in the TND layout")
    b, n, sq, skv = geo.batch, geo.heads, geo.q_len, geo.kv_len
    _check(
        tuple(mask.shape) in {(sq, skv), (b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv)},
        f"{name}: atten_mask shape {tuple(mask.shape)} must be BNSS, B1SS, 11SS or SS for B={b}, N={n}, "
        f"Sq={sq}, Skv={skv}",
    )


def _fa_rule(sq: int, skv: int, mode: int, pre: int, nxt: int) -> Tensor:
    """The kept (i, j) of one batch under sparse mode 0 (the band only) or 2-4 (§6.1 table), Δ = Skv - Sq."""
    i, j, delta = torch.arange(sq).unsqueeze(1), torch.arange(skv), skv - sq
    if mode == 0:
        return (j >= i - pre) & (j <= i + nxt)
    if mode == 2:
        return j <= i
    if mode == 3:
        return j <= i + delta
    return (j >= i + delta - pre) & (j <= i + delta + nxt)


def _fa_keep(geo: _FaGeometry, mask: Tensor | None, mode: int, pre: int, nxt: int) -> Tensor | None:
    """Which scores take part (True = attend), broadcastable to [B, N, Sq, Skv]; None means all of them.

    Without a mask, sparse_mode and pre/next do not take effect (§6.1). Modes 2-4 apply their rule (the
    compressed mask only selects it); mode 0 bands the mask with pre/next, mode 1 takes the mask as is.
    """
    if geo.segments is not None:
        keep = torch.zeros(geo.q_len, geo.kv_len, dtype=torch.bool)
        for q0, q1, kv0, kv1 in geo.segments:
            keep[q0:q1, kv0:kv1] = True if mask is None else _fa_rule(q1 - q0, kv1 - kv0, mode, pre, nxt)
        return keep
    if mask is None:
        return None
    if mode >= 2:
        return _fa_rule(geo.q_len, geo.kv_len, mode, pre, nxt)
    keep = ~mask.bool()
    return keep & _fa_rule(geo.q_len, geo.kv_len, 0, pre, nxt) if mode == 0 else keep


def _fa_prepare(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    head_num: int,
    input_layout: str,
    pse: Tensor | None,
    mask: Tensor | None,
    options: dict[str, Any],
    unmodelled: dict[str, Any],
) -> tuple[_FaGeometry, Tensor | None]:
    """Check a forward or backward call like the device does; return its geometry and keep mask."""
    layout = input_layout.upper()
    _check(
        layout in _FA_RANKS,
        f"{name}: The input_layout should be BSH/SBH/BNSD/BSND/TND(case-insensitive), but got {input_layout}",
    )
    geo = _fa_geometry(
        name, q, k, v, head_num, layout, options["actual_seq_qlen"], options["actual_seq_kvlen"]
    )
    mode = options["sparse_mode"]
    _fa_check_options(
        name,
        geo,
        q.dtype,
        pse,
        mask,
        options["keep_prob"],
        mode,
        options["inner_precise"],
        options["softmax_layout"],
        unmodelled,
    )
    return geo, _fa_keep(geo, mask, mode, options["pre_tockens"], options["next_tockens"])


def _fa_numels(
    geo: _FaGeometry, head_num: int, qlen: Sequence[int] | None, kvlen: Sequence[int] | None
) -> int:
    """The dropout-mask length the C++ adapter returns: B*N*Sq*Skv, or for TND N*sum(Sq_b*Skv_b) over the
    lists as given (the adapter's formula, trailing zeros included)."""
    if geo.segments is None:
        return geo.batch * head_num * geo.q_len * geo.kv_len
    q_ends, kv_ends = [0, *qlen], [0, *kvlen]
    pairs = zip(itertools.pairwise(q_ends), itertools.pairwise(kv_ends), strict=True)
    return geo.heads * sum((q1 - q0) * (kv1 - kv0) for (q0, q1), (kv0, kv1) in pairs)


def _fa_heads(t: Tensor, geo: _FaGeometry, heads: int) -> Tensor:
    """A query/key/value/output tensor in the call's layout as fp32 [B, heads, S, D]."""
    t = t.float()
    if geo.layout == "BSH":
        return t.unflatten(-1, (heads, -1)).transpose(1, 2)
    if geo.layout == "SBH":
        return t.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)
    if geo.layout == "BSND":
        return t.transpose(1, 2)
    if geo.layout == "TND":
        return t.transpose(0, 1).unsqueeze(0)
    return t


def _fa_to_layout(t: Tensor, geo: _FaGeometry, dtype: torch.dtype) -> Tensor:
    """The inverse of _fa_heads, cast to dtype."""
    if geo.layout == "BSH":
        t = t.transpose(1, 2).flatten(2)
    elif geo.layout == "SBH":
        t = t.permute(2, 0, 1, 3).flatten(2)
    elif geo.layout == "BSND":
        t = t.transpose(1, 2)
    elif geo.layout == "TND":
        t = t.squeeze(0).transpose(0, 1)
    return t.to(dtype).contiguous()


def _fa_kv(t: Tensor, geo: _FaGeometry) -> Tensor:
    """Key/value as fp32 [B, N, S, D]: query head h reads KV head h // (N / Nkv) (GQA)."""
    return _fa_heads(t, geo, geo.kv_heads).repeat_interleave(geo.heads // geo.kv_heads, dim=1)


def _fa_kv_grad(t: Tensor, geo: _FaGeometry, dtype: torch.dtype) -> Tensor:
    """The adjoint of _fa_kv: sum each KV head's query-head group, back to the layout."""
    return _fa_to_layout(t.unflatten(1, (geo.kv_heads, -1)).sum(2), geo, dtype)


def _fa_scores(q: Tensor, k: Tensor, pse: Tensor | None, scale: float, keep: Tensor | None) -> Tensor:
    """scale * (q @ k^T + pse) in fp32 (pse_type 1: add pse, then scale), -inf where masked."""
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse.float()
    s = s * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _fa_forward(
    geo: _FaGeometry, keep: Tensor | None, scale: float, q: Tensor, k: Tensor, v: Tensor, pse: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B,N,Sq,Dv], row max, row sum of exp(s - max)), all fp32.

    A fully masked row gives out 0 (flash-attn semantics; the device's result there is UNKNOWN without
    inner_precise=2), max -inf and sum 0.
    """
    s = _fa_scores(_fa_heads(q, geo, geo.heads), _fa_kv(k, geo), pse, scale, keep)
    row_max = s.amax(-1)
    e = torch.exp(s - torch.where(row_max.isneginf(), 0.0, row_max).unsqueeze(-1))
    row_sum = e.sum(-1)
    p = e / torch.where(row_sum > 0, row_sum, 1.0).unsqueeze(-1)
    return p @ _fa_kv(v, geo), row_max, row_sum


def _fa_pack_stats(t: Tensor, geo: _FaGeometry, softmax_layout: str) -> Tensor:
    """[B, N, Sq] row statistics as softmax_max/softmax_sum: [B,N,Sq,8], or [T,N,8] for TND.

    TND keeps the shape [T, N, 8] but by default the memory order is NTD (§6.1); softmax_layout="TND" gives
    the TND order.
    """
    if geo.segments is None:
        return t.unsqueeze(-1).expand(*t.shape, _FA_STATS).contiguous()
    per_head = t[0]  # [N, T]
    if softmax_layout == "TND":
        return per_head.T.unsqueeze(-1).expand(-1, -1, _FA_STATS).contiguous()
    return per_head.unsqueeze(-1).expand(-1, -1, _FA_STATS).contiguous().view(geo.q_len, geo.heads, _FA_STATS)


def _fa_unpack_stats(name: str, label: str, t: Tensor, geo: _FaGeometry, softmax_layout: str) -> Tensor:
    """The inverse of _fa_pack_stats (first of the 8 copies)."""
    expected = (geo.q_len, geo.heads, _FA_STATS)
    if geo.segments is None:
        expected = (geo.batch, geo.heads, geo.q_len, _FA_STATS)
    _check(
        t.dtype == torch.float32 and tuple(t.shape) == expected,
        f"{name}: {label} must be fp32 {list(expected)}, got {t.dtype} {tuple(t.shape)}",
    )
    if geo.segments is None:
        return t[..., 0]
    if softmax_layout == "TND":
        return t[..., 0].T.unsqueeze(0)
    return t.reshape(geo.heads, geo.q_len, _FA_STATS)[..., 0].unsqueeze(0)


def _fa_backward(
    geo: _FaGeometry,
    keep: Tensor | None,
    scale: float,
    tensors: tuple[Tensor, Tensor, Tensor, Tensor | None],
    dy: Tensor,
    out: Tensor,
    row_max: Tensor,
    row_sum: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Flash-attention backward from the saved statistics, as the kernel computes it: P is rebuilt from
    softmax_max/softmax_sum and rowsum(dy * out) comes from attention_in, not from a recomputation."""
    q, k, v, pse = tensors
    qf, kf, vf = _fa_heads(q, geo, geo.heads), _fa_kv(k, geo), _fa_kv(v, geo)
    live = (row_sum > 0).unsqueeze(-1)  # fully masked rows have sum 0 and P = 0
    s = _fa_scores(qf, kf, pse, scale, keep)
    p = torch.where(
        live, torch.exp(s - row_max.unsqueeze(-1)) / torch.where(live, row_sum.unsqueeze(-1), 1.0), 0.0
    )
    dyf, outf = _fa_heads(dy, geo, geo.heads), _fa_heads(out, geo, geo.heads)
    dp = dyf @ vf.transpose(-1, -2)
    ds = p * (dp - (dyf * outf).sum(-1, keepdim=True)) * scale  # gradient w.r.t. q @ k^T + pse
    dq = _fa_to_layout(ds @ kf, geo, q.dtype)
    dk = _fa_kv_grad(ds.transpose(-1, -2) @ qf, geo, k.dtype)
    dv = _fa_kv_grad(p.transpose(-1, -2) @ dyf, geo, v.dtype)
    dpse = None if pse is None else ds.sum_to_size(pse.shape).to(pse.dtype)
    return dq, dk, dv, dpse


def fusion_attention(
    profile: Profile,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    head_num: int,
    input_layout: str,
    pse: Tensor | None = None,
    padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: Tensor | None = None,
    dropout_mask: Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, int, int, int]:
    """softmax(mask(scale * (q @ k^T + pse))) @ v without dropout, fp32 inside.

    Returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels). With keep_prob 1
    no dropout mask is drawn, so seed and offset are 0 (§12) and the seed/offset arguments, like
    gen_mask_parallel and sync, have nothing to act on.
    """
    name = "npu_fusion_attention"
    options = {
        "keep_prob": keep_prob,
        "pre_tockens": pre_tockens,
        "next_tockens": next_tockens,
        "inner_precise": inner_precise,
        "actual_seq_qlen": actual_seq_qlen,
        "actual_seq_kvlen": actual_seq_kvlen,
        "sparse_mode": sparse_mode,
        "softmax_layout": softmax_layout,
    }
    unmodelled = {
        "padding_mask": padding_mask,  # documented as "not supported yet"
        "prefix": prefix,
        "sink": sink,
        "dropout_mask": dropout_mask,
    }
    geo, keep = _fa_prepare(
        name, query, key, value, head_num, input_layout, pse, atten_mask, options, unmodelled
    )
    numels = _fa_numels(geo, head_num, actual_seq_qlen, actual_seq_kvlen)
    out, row_max, row_sum = _fa_forward(geo, keep, float(scale), query, key, value, pse)
    return (
        _fa_to_layout(out, geo, query.dtype),
        _fa_pack_stats(row_max, geo, softmax_layout),
        _fa_pack_stats(row_sum, geo, softmax_layout),
        query.new_empty(0),  # softmax_out is reserved: an empty tensor of the query's dtype
        0,
        0,
        numels,
    )


def fusion_attention_grad(
    profile: Profile,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dy: Tensor,
    head_num: int,
    input_layout: str,
    pse: Tensor | None = None,
    padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None,
    softmax_max: Tensor | None = None,
    softmax_sum: Tensor | None = None,
    softmax_in: Tensor | None = None,
    attention_in: Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Backward of npu_fusion_attention: (dq, dk, dv, dpse[, dsink]), each in its input's dtype and shape.

    dpse is None without pse, as the C++ adapter returns an undefined tensor, and dsink (op-plugin
    >= 26.1.0 returns it) is None: sink is not modelled. The forward's softmax_max, softmax_sum and
    attention_out are required: the gradient is built from them, as on the device. softmax_in is the
    reserved empty tensor and is not read.
    """
    name = "npu_fusion_attention_grad"
    options = {
        "keep_prob": keep_prob,
        "pre_tockens": pre_tockens,
        "next_tockens": next_tockens,
        "inner_precise": inner_precise,
        "actual_seq_qlen": actual_seq_qlen,
        "actual_seq_kvlen": actual_seq_kvlen,
        "sparse_mode": sparse_mode,
        "softmax_layout": softmax_layout,
    }
    unmodelled = {"padding_mask": padding_mask, "prefix": prefix, "sink": sink}
    geo, keep = _fa_prepare(
        name, query, key, value, head_num, input_layout, pse, atten_mask, options, unmodelled
    )
    _unsupported(
        softmax_max is None or softmax_sum is None or attention_in is None,
        f"{name}: without the forward's softmax_max, softmax_sum and attention_in",
    )
    out_dim = geo.heads * geo.v_dim if geo.layout in ("BSH", "SBH") else geo.v_dim
    expected = (*query.shape[:-1], out_dim)
    for label, t in (("dy", dy), ("attention_in", attention_in)):
        _check(
            tuple(t.shape) == expected and t.dtype == query.dtype,
            f"{name}: {label} must be {query.dtype} {list(expected)}, got {t.dtype} {tuple(t.shape)}",
        )
    row_max = _fa_unpack_stats(name, "softmax_max", softmax_max, geo, softmax_layout)
    row_sum = _fa_unpack_stats(name, "softmax_sum", softmax_sum, geo, softmax_layout)
    grads = _fa_backward(geo, keep, scale_value, (query, key, value, pse), dy, attention_in, row_max, row_sum)
    return grads if "sink" not in profile.schemas["npu_fusion_attention_grad"] else (*grads, None)


# ----------------------------------------------------------------------------------------------------
# Grouped matmul (§7): GroupedMatmulKernelNpuOpApi.cpp (op-plugin) and gmm/grouped_matmul (CANN)
# ----------------------------------------------------------------------------------------------------


def transposed_last_two(t: Tensor) -> bool:
    """aclnn_grouped_matmul_util.cpp IsTransposeLastTwoDims: a transposed view of a contiguous tensor."""
    if t.dim() < 2:
        return False
    shape, strides = t.shape, t.stride()
    if not (strides[-2] == 1 and strides[-1] == shape[-2]):
        return False
    span = shape[-1] * shape[-2]
    for dim in range(t.dim() - 3, -1, -1):
        if strides[dim] != span:
            return False
        span *= shape[dim]
    return True


def _special_transposed(tensors: Sequence[Tensor]) -> bool:
    """aclnn_grouped_matmul.cpp CheckSpecialTranspose: transposed, unless the last two dims are (1, 1)."""
    for t in tensors:
        last = math.prod(t.shape[-2:]) if t.dim() > 1 else t.shape[-1]
        if transposed_last_two(t) and last != 1:
            return True
    return False


def _check_gmm_transpose(group_type: int, x: Sequence[Tensor], weight: Sequence[Tensor]) -> None:
    """aclnn_grouped_matmul.cpp CheckTransposeStatus and CheckParamDifferentGroupType."""
    name = "npu_grouped_matmul"
    if group_type == 2:
        transpose_x, transpose_weight = transposed_last_two(x[0]), _special_transposed(weight)
        _check(
            transpose_x,
            f"{name}: When groupType is 2 and x is not separated, tensor in x should be transposed.",
        )
    else:
        transpose_x, transpose_weight = _special_transposed(x), transposed_last_two(weight[0])
        _check(not transpose_x, f"{name}: When groupType is {group_type}, x can not be transposed.")
    _check(
        not (transpose_x and transpose_weight),
        f"{name}: x and weight can not be transposed at the same time.",
    )


def _group_ends(group_list: Tensor, cumulative: bool, total: int, axis: str) -> list[int]:
    """Cumulative end offsets of each group, checked: non-negative, non-decreasing, last <= total."""
    values = group_list.tolist()
    ends = _reference.group_ends(group_list, cumulative)
    _check(
        all(v >= 0 for v in values) and all(b >= a for a, b in itertools.pairwise(ends)),
        f"npu_grouped_matmul: group_list {values} must give non-negative, non-decreasing offsets",
    )
    _check(ends[-1] <= total, f"npu_grouped_matmul: group_list covers {ends[-1]} > {total} along {axis}")
    return ends


def _check_gmm_bias(
    bias: Sequence[Tensor] | None, n_groups: int, single_weight: bool, dtype: torch.dtype
) -> None:
    """Per-group 1-D biases ([E, N] is also accepted as one tensor next to a single [E, K, N] weight)."""
    if bias is None:
        return
    biases = list(bias)
    if single_weight and len(biases) == 1 and biases[0].dim() == 2:
        biases = list(biases[0].unbind(0))
    _check(len(biases) == n_groups, f"npu_grouped_matmul: {len(biases)} biases for {n_groups} groups")
    for b in biases:
        _check(b.dim() == 1, f"npu_grouped_matmul: bias must be 1-D [N] per group, got {tuple(b.shape)}")
        _check(
            b.dtype == _GMM_BIAS_DTYPE[dtype],
            f"npu_grouped_matmul: {dtype} x needs a {_GMM_BIAS_DTYPE[dtype]} bias, got {b.dtype}",
        )


def _check_gmm_shapes(x: Sequence[Tensor], weights: Sequence[Tensor], split_item: int) -> None:
    name = "npu_grouped_matmul"
    for w in weights:
        _check(w.dim() == 2, f"{name}: each weight must be [K, N], got {tuple(w.shape)}")
        _check(max(w.shape) < 65536, f"{name}: inner dims must be < 65536, got weight {tuple(w.shape)}")
    x_max_dim = 6 if split_item == 0 else 2
    for t in x:
        _check(2 <= t.dim() <= x_max_dim, f"{name}: x must be 2-{x_max_dim}-D here, got {tuple(t.shape)}")
        _check(t.shape[-1] < 65536, f"{name}: inner dims must be < 65536, got x {tuple(t.shape)}")


def grouped_matmul(
    profile: Profile,
    x: Sequence[Tensor],
    weight: Sequence[Tensor],
    bias: Sequence[Tensor] | None = None,
    scale: Sequence[Tensor] | None = None,
    offset: Sequence[Tensor] | None = None,
    antiquant_scale: Sequence[Tensor] | None = None,
    antiquant_offset: Sequence[Tensor] | None = None,
    per_token_scale: Sequence[Tensor] | None = None,
    group_list: Tensor | None = None,
    activation_input: Sequence[Tensor] | None = None,
    activation_quant_scale: Sequence[Tensor] | None = None,
    activation_quant_offset: Sequence[Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: Any = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[Tensor]:
    """Grouped x_i @ weight_i (+ bias_i), non-quantised; no autograd on any branch.

    ``tuning_config`` is a performance hint only and is ignored.
    """
    name = "npu_grouped_matmul"
    quant = {
        "scale": scale,
        "offset": offset,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
        "per_token_scale": per_token_scale,
        "activation_input": activation_input,
        "activation_quant_scale": activation_quant_scale,
        "activation_quant_offset": activation_quant_offset,
        "x_dtype": x_dtype,
        "weight_dtype": weight_dtype,
        "scale_dtype": scale_dtype,
        "per_token_scale_dtype": per_token_scale_dtype,
    }
    given = sorted(k for k, v in quant.items() if v is not None)
    _unsupported(bool(given), f"{name}: quantised path ({', '.join(given)}) is not modelled")
    _unsupported(act_type not in (0, None), f"{name}: act_type={act_type} (per-token quant only)")
    _unsupported(group_list_type == 2, f"{name}: group_list_type=2 (int8 quant only)")
    _unsupported(
        output_dtype is not None and not isinstance(output_dtype, torch.dtype),
        f"{name}: integer (ACL) output_dtype codes",
    )
    # GroupedMatmulKernelNpuOpApi.cpp: group_type must be passed; 7.1.0 takes -1 and 0 only, later
    # branches -1, 0 and 2.
    _check(group_type is not None, "Requires manual passing group_type, current is None.")
    _check(
        group_type in profile.gmm_group_types,
        f"{name}: group_type {group_type} is not supported by torch_npu {profile.torch_npu} "
        f"(op-plugin {profile.op_plugin} takes {sorted(profile.gmm_group_types)})",
    )
    split_item = 0 if split_item is None else split_item
    group_list_type = 0 if group_list_type is None else group_list_type
    _check(len(x) > 0 and len(weight) > 0, "Invalid inputs: neither x nor weight could be empty.")
    _check(split_item in (0, 1, 2, 3), f"Invalid value of split_item [{split_item}], should be 0/1/2/3.")
    n_entries = max(len(x), len(weight), len(bias or ()))
    _check(n_entries <= 128, f"{name}: at most 128 list entries, got {n_entries}")
    dtype = x[0].dtype
    _check(dtype in _FLOATS, f"{name}: unsupported x dtype {dtype}")
    _check(
        all(t.dtype == dtype for t in (*x, *weight)),
        f"{name}: non-quantised x and weight must share one dtype",
    )
    out_dtype = dtype if output_dtype is None else output_dtype
    _check(out_dtype in _FLOATS, f"{name}: unsupported output_dtype {output_dtype}")
    if group_list is not None:
        # aclnn_grouped_matmul.cpp CheckGroupListCommonTensor: int64, at most 1024 groups.
        _check(group_list.dtype == torch.int64, f"{name}: group_list must be int64, got {group_list.dtype}")
        _check(
            group_list.dim() == 1 and 1 <= group_list.numel() <= 1024,
            f"{name}: group_list must be 1-D with 1..1024 groups, got {tuple(group_list.shape)}",
        )
        _check(group_list_type in (0, 1), f"{name}: group_list_type {group_list_type} invalid")
        # op-plugin docs, torch_npu-npu_grouped_matmul.md: with group_list_type 1 "长度不能为1".
        _check(
            group_list_type != 1 or group_list.numel() != 1,
            f"{name}: a group_list of counts (group_list_type=1) must not have length 1",
        )
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    weights = list(weight[0].unbind(0)) if single_weight else list(weight)
    _check_gmm_shapes(x, weights, split_item)
    _check_gmm_transpose(group_type, x, weight)
    all_empty = all(t.numel() == 0 for t in x)

    if group_type == -1:
        _check(group_list is None, f"{name}: group_type=-1 takes no group_list")
        _check(len(x) == len(weights), f"{name}: {len(x)} x tensors for {len(weights)} weights")
        _check_gmm_bias(bias, len(weights), single_weight, dtype)
        _check(
            split_item in (0, 1) or len({w.shape[-1] for w in weights}) == 1,
            f"{name}: split_item 2/3 needs one N for every group",
        )
    else:
        _check(group_list is not None, f"{name}: group_type={group_type} needs a group_list")
        _check(len(x) == 1, f"{name}: group_type={group_type} takes a single x, got {len(x)}")
        _check(x[0].dim() == 2, f"{name}: group_type={group_type} needs a 2-D x, got {tuple(x[0].shape)}")
    if group_type == 0:
        n_groups = group_list.numel()
        _check(len(weights) == n_groups, f"{name}: {len(weights)} weights for {n_groups} groups")
        _check_gmm_bias(bias, n_groups, single_weight, dtype)
        # The adapter sizes split_item 0/1 outputs as if group_list were cumulative, whatever its type.
        ends = _group_ends(group_list, group_list_type == 0 or split_item in (0, 1), x[0].shape[0], "M")
    if group_type == 2:
        _check(split_item in (2, 3), f"{name}: group_type=2 needs split_item 2 or 3, got {split_item}")
        _check(
            len(weight) == 1 and weight[0].dim() == 2,
            f"{name}: group_type=2 takes a single 2-D weight, got {[tuple(w.shape) for w in weight]}",
        )
        _check(bias is None, f"{name}: When groupType is 2, bias must be empty.")
        ends = _group_ends(group_list, group_list_type == 0, x[0].shape[1], "K")

    outs = _reference.npu_grouped_matmul(
        list(x),
        list(weight),
        bias=None if bias is None else list(bias),
        group_list=group_list,
        split_item=split_item,
        group_type=group_type,
        group_list_type=group_list_type,
        output_dtype=out_dtype,
    )
    if all_empty:
        # aclnn_grouped_matmul.cpp CheckZeroShape: with every x empty no kernel runs, and the outputs the
        # adapter allocated stay as they were.
        return [uninitialised(o.shape, o.dtype) for o in outs]
    if group_type == 0 and split_item in (2, 3) and ends[-1] < x[0].shape[0]:
        (out,) = outs
        out[ends[-1] :] = float("nan")  # rows past the last offset are never written
    if group_type == 2 and not profile.gmm_zero_fills_empty_groups:
        (out,) = outs
        for group, (start, end) in enumerate(itertools.pairwise([0, *ends])):
            if start == end:
                out[group] = float("nan")  # no EmptyTensorCompute: an empty group's block is not written
    return outs


# ----------------------------------------------------------------------------------------------------
# MoE routing (§8)
# ----------------------------------------------------------------------------------------------------


def _check_gating(x: Tensor, finished: Tensor | None, k: int) -> None:
    name = "npu_moe_gating_top_k_softmax"
    _check(x.dim() in (2, 3), f"{name}: x must be [N, E] or [B, S, E], got {tuple(x.shape)}")
    _check(x.dtype in _FLOATS, f"{name}: unsupported dtype {x.dtype}")
    e = x.shape[-1]
    _check(1 <= k <= min(e, 1024), f"{name}: k={k} must be in [1, min(E={e}, 1024)]")
    if finished is not None:
        _check(
            finished.dtype == torch.bool and finished.shape == x.shape[:-1],
            f"{name}: finished must be bool {tuple(x.shape[:-1])}, got {finished.dtype} {finished.shape}",
        )


def gating_top_k_softmax(
    profile: Profile, x: Tensor, finished: Tensor | None = None, k: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    """(top-k softmax probs [x.dtype], expert_idx int32, row_idx int32)."""
    _check_gating(x, finished, k)
    p = torch.softmax(x.float(), dim=-1)
    top = torch.argsort(-p, dim=-1, stable=True)[..., :k]  # ties go to the lower expert index
    y = p.gather(-1, top).to(x.dtype)
    expert_idx = top.to(torch.int32)
    if finished is not None:
        expert_idx[finished] = x.shape[-1]
    rows = p[..., 0].numel()
    row_idx = torch.arange(rows * k, dtype=torch.int32).reshape(k, rows).T.reshape(*x.shape[:-1], k)
    return y, expert_idx, row_idx


def compute_expert_tokens(profile: Profile, sorted_expert_for_source_row: Tensor, num_expert: int) -> Tensor:
    """Cumulative token counts per expert (int32), usable as group_list type 0."""
    name = "npu_moe_compute_expert_tokens"
    sorted_experts = sorted_expert_for_source_row
    _check(
        sorted_experts.dtype == torch.int32 and sorted_experts.dim() == 1,
        f"{name}: input must be a 1-D int32 tensor, got {sorted_experts.dtype} {tuple(sorted_experts.shape)}",
    )
    _check(0 < num_expert <= 2048, f"{name}: num_expert={num_expert} must be in (0, 2048]")
    # The kernel binary-searches, so unsorted input would give garbage there; here it is refused.
    _check(bool((sorted_experts[1:] >= sorted_experts[:-1]).all()), f"{name}: input must be sorted ascending")
    experts = torch.arange(num_expert, dtype=torch.int32)
    return torch.searchsorted(sorted_experts, experts, right=True).to(torch.int32)


def _check_permute(tokens: Tensor, indices: Tensor, padded_mode: bool) -> int:
    name = "npu_moe_token_permute"
    _unsupported(padded_mode, f"{name}: padded_mode=True is not modelled")
    _check(tokens.dim() == 2 and tokens.dtype in _FLOATS, f"{name}: tokens must be [T, H] fp16/bf16/fp32")
    _check(
        indices.dtype in (torch.int32, torch.int64) and indices.dim() in (1, 2),
        f"{name}: indices must be int32/int64 [T] or [T, topK], got {indices.dtype} {tuple(indices.shape)}",
    )
    _check(indices.shape[0] == tokens.shape[0], f"{name}: indices and tokens disagree on T")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    _check(topk <= 512, f"{name}: topK={topk} must be <= 512")
    return topk


def token_permute(
    profile: Profile,
    tokens: Tensor,
    indices: Tensor,
    num_out_tokens: int | None = None,
    padded_mode: bool = False,
) -> tuple[Tensor, Tensor]:
    """Sort token copies by expert: (permuted_tokens, sorted_indices int32 = the inverse permutation)."""
    _check_permute(tokens, indices, padded_mode)
    return _reference.npu_moe_token_permute(tokens, indices, num_out_tokens)


def _permute_grad(
    grad: Tensor, sorted_indices: Tensor, num_tokens: int, dtype: torch.dtype, topk: int
) -> Tensor:
    # Golden: grad.index_select(0, sorted_indices).reshape(-1, topK, H).sum(1); truncated rows give zero.
    summed = _reference.gather_rows(grad, sorted_indices).reshape(num_tokens, topk, grad.shape[1]).sum(1)
    return summed.to(dtype)


def token_permute_grad_v2(
    profile: Profile,
    grad_permuted_tokens: Tensor,
    sorted_indices: Tensor,
    tokens_size_0: int,
    tokens_dtype: torch.dtype,
    num_top_k: int,
    padded_mode: bool = False,
) -> Tensor:
    """Backward of npu_moe_token_permute (op-plugin >= 26.1.0): the gradient w.r.t. tokens [T, H]."""
    _unsupported(padded_mode, "npu_moe_token_permute_grad_v2: padded_mode=True is not modelled")
    return _permute_grad(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_top_k)


def token_permute_grad(
    profile: Profile,
    tokens: Tensor,
    grad_permuted_tokens: Tensor,
    indices: Tensor,
    sorted_indices: Tensor,
    padded_mode: bool = False,
) -> Tensor:
    """Backward of npu_moe_token_permute (op-plugin 7.2.0 to 26.0.0): the gradient w.r.t. tokens."""
    _unsupported(padded_mode, "npu_moe_token_permute_grad: padded_mode=True is not modelled")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    return _permute_grad(grad_permuted_tokens, sorted_indices, tokens.shape[0], tokens.dtype, topk)


def _check_unpermute(
    permuted: Tensor, sorted_indices: Tensor, probs: Tensor | None, padded_mode: bool
) -> None:
    name = "npu_moe_token_unpermute"
    _unsupported(padded_mode, f"{name}: padded_mode=True is not modelled")
    _check(permuted.dim() == 2 and permuted.dtype in _FLOATS, f"{name}: permuted_tokens must be [P, H] float")
    _check(
        sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1,
        f"{name}: sorted_indices must be 1-D int32, got {sorted_indices.dtype} {tuple(sorted_indices.shape)}",
    )
    if probs is not None:
        # moe_token_unpermute_def.cpp: every (tokens, probs) pair of bf16/fp16/fp32.
        _check(
            probs.dim() == 2 and probs.dtype in _FLOATS and probs.numel() == sorted_indices.numel(),
            f"{name}: probs must be float [T, topK] with T*topK == {sorted_indices.numel()}",
        )


def token_unpermute(
    profile: Profile,
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> Tensor:
    """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*topK + k]].

    ``restore_shape`` only matters in padded mode, which is not modelled.
    """
    _check_unpermute(permuted_tokens, sorted_indices, probs, padded_mode)
    return _reference.npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs)


def _unpermute_grad(
    grad: Tensor,
    sorted_indices: Tensor,
    num_permuted: int,
    dtype: torch.dtype,
    probs: Tensor | None,
    permuted,
) -> tuple[Tensor, Tensor]:
    topk = probs.shape[1] if probs is not None else 1
    hidden = grad.shape[1]
    gf = grad.float().unsqueeze(1)
    weights = probs.float().unsqueeze(-1) if probs is not None else gf.new_ones((grad.shape[0], 1, 1))
    index = sorted_indices.long().clamp(max=num_permuted)  # rows past num_permuted were dropped
    dpermuted = grad.new_zeros((num_permuted + 1, hidden), dtype=torch.float32)
    dpermuted.index_add_(0, index, (gf * weights).reshape(-1, hidden))
    if probs is None:
        # The second output has no documented shape without probs (UNKNOWN); an empty tensor is returned.
        return dpermuted[:num_permuted].to(dtype), grad.new_empty((0,), dtype=dtype)
    _check(permuted is not None, "npu_moe_token_unpermute_grad: the probs gradient needs permuted_tokens")
    rows = _reference.gather_rows(permuted, sorted_indices).reshape(-1, topk, hidden)
    dprobs = (rows * gf).sum(-1).to(probs.dtype)
    return dpermuted[:num_permuted].to(dtype), dprobs


def token_unpermute_grad_v2(
    profile: Profile,
    grad_unpermuted_tokens: Tensor,
    sorted_indices: Tensor,
    permuted_tokens_size_0: int,
    permuted_tokens_dtype: torch.dtype,
    probs: Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
    permuted_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Backward of npu_moe_token_unpermute (op-plugin master): (d permuted_tokens, d probs)."""
    _unsupported(padded_mode, "npu_moe_token_unpermute_grad_v2: padded_mode=True is not modelled")
    return _unpermute_grad(
        grad_unpermuted_tokens,
        sorted_indices,
        permuted_tokens_size_0,
        permuted_tokens_dtype,
        probs,
        permuted_tokens,
    )


def token_unpermute_grad(
    profile: Profile,
    permuted_tokens: Tensor,
    grad_unpermuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Backward of npu_moe_token_unpermute (op-plugin 7.2.0 to 26.1.0): (d permuted_tokens, d probs)."""
    _unsupported(padded_mode, "npu_moe_token_unpermute_grad: padded_mode=True is not modelled")
    return _unpermute_grad(
        grad_unpermuted_tokens,
        sorted_indices,
        permuted_tokens.shape[0],
        permuted_tokens.dtype,
        probs,
        permuted_tokens,
    )


def _init_routing_v2(
    x: Tensor,
    expert_idx: Tensor,
    scale: Tensor | None,
    active_num: int,
    expert_num: int,
    expert_tokens_num_type: int,
    expert_tokens_num_flag: bool,
    active_expert_range: Sequence[int],
    row_idx_type: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dropless, non-quantised routing; output shapes follow the meta registration."""
    name = "npu_moe_init_routing_v2"
    _check(x.dim() == 2 and x.dtype in _FLOATS, f"{name}: x must be [N, H] fp16/bf16/fp32")
    _check(
        expert_idx.dim() == 2 and expert_idx.dtype == torch.int32 and expert_idx.shape[0] == x.shape[0],
        f"{name}: expert_idx must be int32 [N, K] with x's N, got {expert_idx.dtype} {expert_idx.shape}",
    )
    _check(expert_tokens_num_type in (0, 1, 2), f"{name}: expert_tokens_num_type must be 0, 1 or 2")
    _check(row_idx_type in (0, 1), f"{name}: row_idx_type must be 0 or 1")
    if active_expert_range:
        _check(len(active_expert_range) == 2, f"{name}: active_expert_range must be int[2]")
        start, end = active_expert_range
        _check(0 <= start < end <= 10240, f"{name}: active_expert_range must be increasing within [0, 10240]")
        range_length = end - start
    else:
        start, end, range_length = 0, (expert_num if expert_num > 0 else _INT32_MAX), expert_num
    if expert_tokens_num_flag:
        _check(range_length > 0, f"{name}: expert token counts need expert_num or active_expert_range")
        _check(expert_tokens_num_type != 2 or expert_num > 0, f"{name}: key-value counts need expert_num")
    if scale is not None:
        _check(
            scale.dim() == 1 and scale.shape[0] == x.shape[0],
            f"{name}: scale must be 1-D (N,) in non-quant mode, got {tuple(scale.shape)}",
        )

    n, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    in_range = (flat >= start) & (flat < end)
    # Experts below the range are pushed to the end; those above it sort after the in-range ones anyway.
    order = torch.argsort(torch.where(flat < start, _INT32_MAX, flat), stable=True)
    count = int(in_range.sum())
    n_active = count if active_num <= 0 else min(active_num, count)
    n_rows = n * k if active_num <= 0 else min(active_num, n * k)
    source = order[:n_active] // k
    # Rows past n_active (out-of-range experts) are undefined on the device; the stand-in zeroes them.
    expanded_x = x.new_zeros((n_rows, x.shape[1]))
    expanded_x[:n_active] = x[source]
    expanded_scale = x.new_zeros((n_rows,), dtype=torch.float32)
    if scale is not None:
        expanded_scale[:n_active] = scale.float()[source]
    if row_idx_type == 0:
        expanded_row_idx = torch.full((n * k,), -1, dtype=torch.int32)
        expanded_row_idx[order[:count]] = torch.arange(count, dtype=torch.int32)
    else:
        expanded_row_idx = order.to(torch.int32)
    if not expert_tokens_num_flag:
        tokens = torch.zeros((), dtype=torch.int64)  # the meta's shape [] when the counts are not requested
    else:
        counts = torch.bincount(flat[in_range] - start, minlength=range_length)
        if expert_tokens_num_type == 0:
            tokens = counts.cumsum(0)
        elif expert_tokens_num_type == 1:
            tokens = counts
        else:
            present = counts.nonzero().reshape(-1)
            tokens = torch.zeros((expert_num, 2), dtype=torch.int64)
            tokens[: present.numel(), 0] = present + start
            tokens[: present.numel(), 1] = counts[present]
    return expanded_x, expanded_row_idx, tokens, expanded_scale


def _finalize_routing(
    rows: Tensor,
    skip1: Tensor | None,
    skip2: Tensor | None,
    bias: Tensor | None,
    scales: Tensor | None,
    src_to_dst: Tensor,
    expert_for_source_row: Tensor | None,
    drop_pad_mode: int,
    k: int,
) -> Tensor:
    name = "npu_moe_finalize_routing"
    _check(
        rows.dim() == 2 and rows.dtype in _FLOATS, f"{name}: expanded_permuted_rows must be [N*K, H] float"
    )
    _check(
        src_to_dst.dim() == 1 and src_to_dst.dtype == torch.int32,
        f"{name}: expanded_src_to_dst_row must be 1-D int32",
    )
    # K comes from scales; without scales the schema's k gives it (default 1, the reference's K=1).
    topk = scales.shape[1] if scales is not None else k
    _check(topk >= 1 and src_to_dst.numel() % topk == 0, f"{name}: {src_to_dst.numel()} indices for K={topk}")
    n, hidden = src_to_dst.numel() // topk, rows.shape[1]
    index = src_to_dst.long()
    _check(
        bool(((index >= -1) & (index < rows.shape[0])).all()),
        f"{name}: expanded_src_to_dst_row holds indices outside [-1, {rows.shape[0]})",
    )
    for label, t in (("skip1", skip1), ("skip2", skip2)):
        if t is not None:
            _check(
                t.shape == (n, hidden) and t.dtype == rows.dtype,
                f"{name}: {label} must be {rows.dtype} [N, H]",
            )
    _check(skip2 is None or skip1 is not None, f"{name}: skip2 requires skip1")
    if scales is not None:
        _check(
            scales.dim() == 2 and scales.shape[0] == n and scales.dtype in _FLOATS,
            f"{name}: scales must be float [N, K] = [{n}, {topk}], got {tuple(scales.shape)}",
        )
    if bias is not None:
        _check(expert_for_source_row is not None, f"{name}: bias requires export_for_source_row")
        _check(
            bias.dim() == 2 and bias.shape[1] == hidden and bias.dtype == rows.dtype,
            f"{name}: bias must be {rows.dtype} [E, H]",
        )
        _check(
            expert_for_source_row.shape == (n, topk) and expert_for_source_row.dtype == torch.int32,
            f"{name}: export_for_source_row must be int32 [N, K]",
        )

    # drop_pad_mode 0: column arrangement r = idx[k*N + i]; 2: row arrangement r = idx[i*K + k].
    r = index.reshape(topk, n).T if drop_pad_mode == 0 else index.reshape(n, topk)
    valid = (r >= 0).unsqueeze(-1)
    term = _reference.gather_rows(rows, torch.where(r >= 0, r, rows.shape[0]))
    if bias is not None:
        term = term + bias.float()[expert_for_source_row.long()]
    weights = scales.float() if scales is not None else term.new_ones((n, topk))
    # fp32 accumulation with one final cast is a choice: the kernel's precision is UNKNOWN.
    out = (term * weights.unsqueeze(-1) * valid).sum(1)
    for t in (skip1, skip2):
        if t is not None:
            out = out + t.float()
    return out.to(rows.dtype)


# ----------------------------------------------------------------------------------------------------
# The public ops: exact torch_npu 2.14 schemas, each counting its calls
# ----------------------------------------------------------------------------------------------------


def init_routing_v2(
    profile: Profile,
    x: Tensor,
    expert_idx: Tensor,
    scale: Tensor | None = None,
    offset: Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: Sequence[int] = (),
    row_idx_type: int = 0,
    x_dtype: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dropless, non-quantised MoE routing; no autograd (generic fallback).

    ``expert_capacity`` only matters in drop/pad mode, which is not modelled. Up to op-plugin 7.3.0 the
    schema's default quant_mode is 0 (static quant): a call without quant_mode=-1 is refused there.
    """
    name = "npu_moe_init_routing_v2"
    _check(drop_pad_mode in (0, 1), f"{name}: drop_pad_mode {drop_pad_mode} invalid")
    _check(quant_mode in (-1, 0, 1, 2, 3), f"{name}: quant_mode {quant_mode} invalid")
    _unsupported(drop_pad_mode == 1, f"{name}: drop/pad mode (drop_pad_mode=1)")
    _unsupported(quant_mode != -1, f"{name}: quantisation (quant_mode={quant_mode})")
    _unsupported(offset is not None or x_dtype is not None, f"{name}: offset/x_dtype (quant)")
    return _init_routing_v2(
        x,
        expert_idx,
        scale,
        active_num,
        expert_num,
        expert_tokens_num_type,
        expert_tokens_num_flag,
        active_expert_range,
        row_idx_type,
    )


def finalize_routing(
    profile: Profile,
    expanded_permuted_rows: Tensor,
    skip1: Tensor | None,
    skip2: Tensor | None,
    bias: Tensor | None,
    scales: Tensor | None,
    expanded_src_to_dst_row: Tensor,
    export_for_source_row: Tensor | None,
    drop_pad_mode: int | None = 0,
    k: int | None = 1,
) -> Tensor:
    """Weighted sum of the experts' rows back per token (+ skips); no autograd (generic fallback)."""
    drop_pad_mode = 0 if drop_pad_mode is None else drop_pad_mode
    _check(drop_pad_mode in (0, 1, 2, 3), f"npu_moe_finalize_routing: drop_pad_mode {drop_pad_mode} invalid")
    _unsupported(drop_pad_mode in (1, 3), "npu_moe_finalize_routing: drop/pad rows [E, C, H] (modes 1, 3)")
    return _finalize_routing(
        expanded_permuted_rows,
        skip1,
        skip2,
        bias,
        scales,
        expanded_src_to_dst_row,
        export_for_source_row,
        drop_pad_mode,
        1 if k is None else k,
    )


# ----------------------------------------------------------------------------------------------------
# Fake (meta) kernels: output shapes and dtypes only, so that torch.compile and torch.export see the ops
# as opaque, as they see torch_npu's (op_plugin/meta/_meta_registrations.py). Outputs are contiguous, as
# the device allocates them.
# ----------------------------------------------------------------------------------------------------


def _empty(shape: Sequence[int], dtype: torch.dtype, like: Tensor) -> Tensor:
    return like.new_empty(tuple(shape), dtype=dtype)


def _like(t: Tensor) -> Tensor:
    """A contiguous tensor of t's shape and dtype: the device's outputs are fresh, contiguous
    allocations whatever the input's strides (and the CPU kernels return the same; _library.py)."""
    return t.new_empty(t.shape)


def _fake_rms_norm(profile: Profile, input: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple:
    lead = input.shape[: input.dim() - gamma.dim()]
    return _like(input), _empty((*lead, *([1] * gamma.dim())), torch.float32, input)


def _fake_rms_norm_backward(
    profile: Profile, dy: Tensor, input: Tensor, gamma: Tensor, rstd: Tensor
) -> tuple:
    return _like(input), _empty(gamma.shape, torch.float32, gamma)


def _fake_add_rms_norm(
    profile: Profile, x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-06
) -> tuple:
    y, rstd = _fake_rms_norm(profile, x1, gamma)
    return y, rstd, _like(x1)


def _fake_swiglu(profile: Profile, input: Tensor, dim: int = -1) -> Tensor:
    shape = list(input.shape)
    shape[dim] //= 2
    return _empty(shape, input.dtype, input)


def _fake_swiglu_backward(profile: Profile, grad_output: Tensor, input: Tensor, dim: int = -1) -> Tensor:
    return _like(input)


def _fake_rotary_mul(profile: Profile, input: Tensor, r1: Tensor, r2: Tensor, *args: Any) -> Tensor:
    return _like(input)


def _fake_rotary_mul_backward(
    profile: Profile, grad: Tensor, input: Tensor, r1: Tensor, r2: Tensor, *args
) -> tuple:
    return _like(input), _empty(r1.shape, input.dtype, input), _empty(r2.shape, input.dtype, input)


def _fake_apply_rotary_pos_emb(profile: Profile, query: Tensor, key: Tensor, *args: Any) -> tuple:
    return _like(query), _like(key)


def _fake_fusion_attention(
    profile: Profile,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    head_num: int,
    input_layout: str,
    *args: Any,
) -> tuple:
    options = dict(zip(_FA_OPTION_NAMES, args, strict=False))
    layout = input_layout.upper()
    qlen, kvlen = options.get("actual_seq_qlen"), options.get("actual_seq_kvlen")
    geo = _fa_geometry("npu_fusion_attention", query, key, value, head_num, layout, qlen, kvlen)
    out_dim = geo.heads * geo.v_dim if layout in ("BSH", "SBH") else geo.v_dim
    stats = (
        (geo.q_len, geo.heads, _FA_STATS) if layout == "TND" else (geo.batch, geo.heads, geo.q_len, _FA_STATS)
    )
    return (
        _empty((*query.shape[:-1], out_dim), query.dtype, query),
        _empty(stats, torch.float32, query),
        _empty(stats, torch.float32, query),
        _empty((0,), query.dtype, query),
        0,
        0,
        _fa_numels(geo, head_num, qlen, kvlen),
    )


# The positional parameters of npu_fusion_attention after input_layout, in schema order.
_FA_OPTION_NAMES = (
    "pse",
    "padding_mask",
    "atten_mask",
    "scale",
    "keep_prob",
    "pre_tockens",
    "next_tockens",
    "inner_precise",
    "prefix",
    "actual_seq_qlen",
    "actual_seq_kvlen",
    "sparse_mode",
    "gen_mask_parallel",
    "sync",
    "softmax_layout",
    "sink",
    "dropout_mask",
    "seed",
    "offset",
)


def _fake_fusion_attention_grad(
    profile: Profile,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dy: Tensor,
    head_num: int,
    input_layout: str,
    *args,
) -> tuple:
    pse = args[0] if args else None
    grads = (
        _like(query),
        _like(key),
        _like(value),
        None if pse is None else _like(pse),
    )
    return grads if "sink" not in profile.schemas["npu_fusion_attention_grad"] else (*grads, None)


def _fake_grouped_matmul(profile: Profile, x: Sequence[Tensor], weight: Sequence[Tensor], *args: Any) -> list:
    options = dict(zip(_GMM_OPTION_NAMES, args, strict=False))
    split_item = options.get("split_item") or 0
    group_type = options.get("group_type")
    group_list = options.get("group_list")
    dtype = options.get("output_dtype") or x[0].dtype
    n = weight[0].shape[-1]
    if group_type == 2:
        return [_empty((group_list.shape[0], x[0].shape[0], n), dtype, x[0])]
    if split_item in (2, 3):
        return [_empty((sum(t.shape[0] for t in x), n), dtype, x[0])]
    if group_type == -1 or group_list is None:
        weights = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
        return [_empty((*t.shape[:-1], w.shape[-1]), dtype, t) for t, w in zip(x, weights, strict=True)]
    ctx = torch.library.get_ctx()  # split_item 0/1: the rows of each group depend on group_list's values
    return [_empty((ctx.new_dynamic_size(), n), dtype, x[0]) for _ in range(group_list.shape[0])]


# The parameters of npu_grouped_matmul after weight, in schema order.
_GMM_OPTION_NAMES = (
    "bias",
    "scale",
    "offset",
    "antiquant_scale",
    "antiquant_offset",
    "per_token_scale",
    "group_list",
    "activation_input",
    "activation_quant_scale",
    "activation_quant_offset",
    "split_item",
    "group_type",
    "group_list_type",
    "act_type",
    "tuning_config",
    "output_dtype",
)


def _fake_gating(profile: Profile, x: Tensor, finished: Tensor | None = None, k: int = 1) -> tuple:
    shape = (*x.shape[:-1], k)
    return _empty(shape, x.dtype, x), _empty(shape, torch.int32, x), _empty(shape, torch.int32, x)


def _fake_compute_expert_tokens(
    profile: Profile, sorted_expert_for_source_row: Tensor, num_expert: int
) -> Tensor:
    return _empty((num_expert,), torch.int32, sorted_expert_for_source_row)


def _fake_init_routing_v2(profile: Profile, x: Tensor, expert_idx: Tensor, *args: Any) -> tuple:
    options = dict(zip(_INIT_ROUTING_OPTION_NAMES, args, strict=False))
    n, k = expert_idx.shape
    active_num = options.get("active_num", -1)
    rows = n * k if active_num <= 0 else min(active_num, n * k)
    if not options.get("expert_tokens_num_flag", False):
        tokens_shape: tuple[int, ...] = ()
    elif options.get("expert_tokens_num_type", 0) == 2:
        tokens_shape = (options.get("expert_num", -1), 2)
    else:
        span = options.get("active_expert_range") or (0, options.get("expert_num", -1))
        tokens_shape = (span[1] - span[0],)
    return (
        _empty((rows, x.shape[1]), x.dtype, x),
        _empty((n * k,), torch.int32, x),
        _empty(tokens_shape, torch.int64, x),
        _empty((rows,), torch.float32, x),
    )


# The parameters of npu_moe_init_routing_v2 after expert_idx, in schema order.
_INIT_ROUTING_OPTION_NAMES = (
    "scale",
    "offset",
    "active_num",
    "expert_capacity",
    "expert_num",
    "drop_pad_mode",
    "expert_tokens_num_type",
    "expert_tokens_num_flag",
    "quant_mode",
    "active_expert_range",
    "row_idx_type",
    "x_dtype",
)


def _fake_finalize_routing(
    profile: Profile,
    rows: Tensor,
    skip1,
    skip2,
    bias,
    scales,
    src_to_dst: Tensor,
    experts,
    drop_pad_mode=0,
    k=1,
) -> Tensor:
    topk = scales.shape[1] if scales is not None else (1 if k is None else k)
    return _empty((src_to_dst.shape[0] // topk, rows.shape[1]), rows.dtype, rows)


def _fake_permute(
    profile: Profile,
    tokens: Tensor,
    indices: Tensor,
    num_out_tokens: int | None = None,
    padded_mode: bool = False,
) -> tuple:
    total = indices.numel()
    rows = total if not num_out_tokens or num_out_tokens <= 0 else min(num_out_tokens, total)
    return _empty((rows, tokens.shape[1]), tokens.dtype, tokens), _empty((total,), torch.int32, tokens)


def _fake_permute_grad_v2(
    profile: Profile,
    grad: Tensor,
    sorted_indices: Tensor,
    tokens_size_0: int,
    tokens_dtype,
    num_topk: int,
    *args,
) -> Tensor:
    return _empty((tokens_size_0, grad.shape[1]), tokens_dtype, grad)


def _fake_permute_grad(profile: Profile, tokens: Tensor, *args: Any) -> Tensor:
    return _like(tokens)


def _fake_unpermute(
    profile: Profile, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None, *args
) -> Tensor:
    topk = probs.shape[1] if probs is not None else 1
    return _empty(
        (sorted_indices.shape[0] // topk, permuted_tokens.shape[1]), permuted_tokens.dtype, permuted_tokens
    )


def _fake_unpermute_grad_v2(
    profile: Profile,
    grad: Tensor,
    sorted_indices: Tensor,
    size_0: int,
    dtype,
    probs: Tensor | None = None,
    *args,
) -> tuple:
    dprobs = _like(probs) if probs is not None else _empty((0,), dtype, grad)
    return _empty((size_0, grad.shape[1]), dtype, grad), dprobs


def _fake_unpermute_grad(
    profile: Profile,
    permuted_tokens: Tensor,
    grad: Tensor,
    sorted_indices: Tensor,
    probs: Tensor | None = None,
    *args,
) -> tuple:
    dprobs = _like(probs) if probs is not None else _empty((0,), permuted_tokens.dtype, grad)
    return _like(permuted_tokens), dprobs


@dataclass(frozen=True)
class OpDef:
    """How the stand-in computes one op (checks and math) and what its fake kernel returns."""

    impl: Any
    fake: Any


OP_DEFS: dict[str, OpDef] = {
    "npu_rms_norm": OpDef(rms_norm, _fake_rms_norm),
    "npu_rms_norm_backward": OpDef(rms_norm_backward, _fake_rms_norm_backward),
    "npu_gemma_rms_norm": OpDef(gemma_rms_norm, _fake_rms_norm),
    "npu_add_rms_norm": OpDef(add_rms_norm, _fake_add_rms_norm),
    "npu_swiglu": OpDef(swiglu, _fake_swiglu),
    "npu_swiglu_backward": OpDef(swiglu_backward, _fake_swiglu_backward),
    "npu_rotary_mul": OpDef(rotary_mul, _fake_rotary_mul),
    "npu_rotary_mul_backward": OpDef(rotary_mul_backward, _fake_rotary_mul_backward),
    "npu_apply_rotary_pos_emb": OpDef(apply_rotary_pos_emb, _fake_apply_rotary_pos_emb),
    "npu_fusion_attention": OpDef(fusion_attention, _fake_fusion_attention),
    "npu_fusion_attention_grad": OpDef(fusion_attention_grad, _fake_fusion_attention_grad),
    "npu_grouped_matmul": OpDef(grouped_matmul, _fake_grouped_matmul),
    "npu_moe_gating_top_k_softmax": OpDef(gating_top_k_softmax, _fake_gating),
    "npu_moe_compute_expert_tokens": OpDef(compute_expert_tokens, _fake_compute_expert_tokens),
    "npu_moe_init_routing_v2": OpDef(init_routing_v2, _fake_init_routing_v2),
    "npu_moe_finalize_routing": OpDef(finalize_routing, _fake_finalize_routing),
    "npu_moe_token_permute": OpDef(token_permute, _fake_permute),
    "npu_moe_token_permute_grad": OpDef(token_permute_grad, _fake_permute_grad),
    "npu_moe_token_permute_grad_v2": OpDef(token_permute_grad_v2, _fake_permute_grad_v2),
    "npu_moe_token_unpermute": OpDef(token_unpermute, _fake_unpermute),
    "npu_moe_token_unpermute_grad": OpDef(token_unpermute_grad, _fake_unpermute_grad),
    "npu_moe_token_unpermute_grad_v2": OpDef(token_unpermute_grad_v2, _fake_unpermute_grad_v2),
}
