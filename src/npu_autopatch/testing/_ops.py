"""Pure-PyTorch CPU implementations of the torch_npu fused ops, strict about every documented limit.

Each rule cites the section of ``torch_npu_ops.md`` it comes from (§N). Where that reference marks
something UNKNOWN, the documented golden (the op-plugin tests' CPU reference) is followed and the choice is
stated.

Two kinds of error are raised on purpose:

* ``RuntimeError``: the real op rejects the call (a documented limit), as ``TORCH_CHECK`` does on the device.
* ``NotImplementedError``: the call is valid on the device but this stand-in does not model it (quantisation,
  drop/pad routing, ...), so a test must not pass by accident. It subclasses ``RuntimeError``.

Autograd is reproduced per op (§9): a real backward that goes through the public backward op, the error
fallback whose backward raises, or the generic fallback that warns once and gives no gradient at all.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# §2: the (x, gamma) dtype pairs of Atlas A2/A3.
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

# §5.1: r1/r2 layouts the kernel accepts, as the set of leading dims where r1 spans x (D excluded). The
# layout is implicit, so 4-D x may be BNSD (11SD, B1SD, BNSD), BSND (1S1D, BS1D, BSND) or SBND (S11D, SB1D,
# SBND).
_ROTARY_LAYOUTS = {
    "half": {4: ({2}, {0, 2}, {0, 1, 2}, {1}, {0, 1}, {0}), 3: ({0}, {0, 1})},
    "interleave": {4: ({2}, {1}, {0}), 3: ({0},)},
}

_INT32_MAX = 2**31 - 1


def _check(condition: bool, message: str) -> None:
    """Raise like the device's TORCH_CHECK does."""
    if not condition:
        raise RuntimeError(message)


def _unsupported(condition: bool, message: str) -> None:
    """Refuse a path the device supports but the stand-in does not model."""
    if condition:
        raise NotImplementedError(f"torch_npu stand-in: {message}")


class _State:
    """Per-module bookkeeping shared by the ops and by the backward nodes they create."""

    def __init__(self, calls: Counter[str]) -> None:
        self.calls = calls
        self.ops: dict[str, Callable[..., Any]] = {}
        self.warned: set[str] = set()

    def warn_no_autograd(self, name: str) -> None:
        """The generic fallback's warning (torch's warnAutogradNotImplemented), once per op and module."""
        if name in self.warned:
            return
        self.warned.add(name)
        warnings.warn(
            f"npu::{name}: an autograd kernel was not registered to the Autograd key(s) but we are trying to "
            "backprop through it. This may lead to silently incorrect behavior. This behavior is deprecated "
            "and will be removed in a future version of PyTorch.",
            UserWarning,
            stacklevel=2,
        )


# ----------------------------------------------------------------------------------------------------
# Autograd fallbacks (§9)
# ----------------------------------------------------------------------------------------------------


class _WarnNotImplemented(torch.autograd.Function):
    """Generic fallback: the outputs get a node that warns once and returns no gradient for any input."""

    @staticmethod
    def forward(ctx: Any, state: _State, name: str, compute: Callable[[], tuple], *tensors: Any) -> tuple:
        ctx.state, ctx.name, ctx.n_inputs = state, name, len(tensors)
        return tuple(compute())

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        ctx.state.warn_no_autograd(ctx.name)
        return (None,) * (3 + ctx.n_inputs)


class _RaiseInBackward(torch.autograd.Function):
    """Error fallback (autogradNotImplementedFallback): backward raises ``message``."""

    @staticmethod
    def forward(ctx: Any, message: str, compute: Callable[[], tuple], *tensors: Any) -> tuple:
        ctx.message = message
        return tuple(compute())

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise RuntimeError(ctx.message)


def _not_implemented_message(name: str) -> str:
    # torch's NotImplemented node names the op by its schema name, namespace included.
    return f"derivative for npu::{name} is not implemented"


# ----------------------------------------------------------------------------------------------------
# RMSNorm family (§2, §3)
# ----------------------------------------------------------------------------------------------------


def _check_norm_args(name: str, x: Tensor, gamma: Tensor) -> None:
    _check(
        1 <= gamma.dim() <= x.dim() and tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]),
        f"{name}: gamma shape {tuple(gamma.shape)} must equal the trailing dims of input {tuple(x.shape)}",
    )


def _rstd(xf: Tensor, norm_dims: int, epsilon: float) -> Tensor:
    """fp32 rstd with the kept (size 1) normalised dims: shape x.shape[:-g.dim()] + (1,)*g.dim()."""
    dims = tuple(range(-norm_dims, 0))
    return torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)


def _sum_leading(t: Tensor, n: int) -> Tensor:
    # sum(dim=()) would reduce every dim, so an empty leading set must stay unreduced.
    return t.sum(dim=tuple(range(n))) if n else t


def _rms_norm_forward(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = _rstd(xf, gamma.dim(), epsilon)
    # Golden: y = (x*rstd)*gamma in fp32, cast to x.dtype once at the end. Whether the kernel rounds x*rstd
    # before the gamma multiply for bf16 is UNKNOWN; the golden's single cast is used.
    return ((xf * rstd) * gamma.float()).to(x.dtype), rstd


def _rms_norm_backward(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
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


class _RmsNorm(torch.autograd.Function):
    """derivatives.yaml: input, gamma via npu_rms_norm_backward(grad, input, gamma, rstd); rstd is not
    differentiable."""

    @staticmethod
    def forward(ctx: Any, state: _State, x: Tensor, gamma: Tensor, epsilon: float) -> tuple:
        y, rstd = _rms_norm_forward(x, gamma, epsilon)
        ctx.state = state
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx: Any, dy: Tensor, _drstd: Tensor) -> tuple:
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = ctx.state.ops["npu_rms_norm_backward"](dy, x, gamma, rstd)
        # The kernel's dgamma is fp32; autograd hands gamma its own dtype.
        return None, dx, dgamma.to(gamma.dtype), None


def _check_rms_norm(name: str, x: Tensor, gamma: Tensor) -> None:
    _check_norm_args(name, x, gamma)
    _check(
        (x.dtype, gamma.dtype) in _RMS_NORM_DTYPE_PAIRS,
        f"{name}: unsupported (input, gamma) dtypes ({x.dtype}, {gamma.dtype})",
    )


def _gemma_rms_norm(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = _rstd(xf, gamma.dim(), epsilon)
    return (xf * rstd * (1.0 + gamma.float())).to(x.dtype), rstd


def _check_add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor) -> None:
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


def _add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    x = x1 + x2  # golden: the sum is rounded to the input dtype before the fp32 normalisation
    y, rstd = _rms_norm_forward(x, gamma, epsilon)
    return y, rstd, x


# ----------------------------------------------------------------------------------------------------
# SwiGLU (§4)
# ----------------------------------------------------------------------------------------------------


def _check_swiglu(name: str, x: Tensor, dim: int) -> None:
    _check(x.dtype in _FLOATS, f"{name}: unsupported dtype {x.dtype}")
    _check(1 <= x.dim() <= 8, f"{name}: input must be 1-8-D, got {x.dim()}-D")
    _check(-x.dim() <= dim < x.dim(), f"{name}: dim {dim} out of range for a {x.dim()}-D input")
    _check(x.numel() > 0, f"{name}: empty input is not supported")
    _check(x.is_contiguous(), f"{name}: input must be contiguous")
    _check(x.shape[dim] % 2 == 0, f"{name}: size {x.shape[dim]} along dim {dim} must be even")


def _swiglu_forward(x: Tensor, dim: int) -> Tensor:
    a, b = x.float().chunk(2, dim)  # the FIRST half is gated
    return (F.silu(a) * b).to(x.dtype)


def _swiglu_backward(grad: Tensor, x: Tensor, dim: int) -> Tensor:
    a, b = x.float().chunk(2, dim)
    _check(grad.shape == a.shape, f"npu_swiglu_backward: grad shape {tuple(grad.shape)} != {tuple(a.shape)}")
    g = grad.float()
    s = torch.sigmoid(a)
    da = g * b * (s + a * s * (1 - s))
    db = g * a * s
    return torch.cat((da, db), dim).to(x.dtype)


class _Swiglu(torch.autograd.Function):
    """derivatives.yaml: input via npu_swiglu_backward(grad, input, dim)."""

    @staticmethod
    def forward(ctx: Any, state: _State, x: Tensor, dim: int) -> Tensor:
        ctx.state, ctx.dim = state, dim
        ctx.save_for_backward(x)
        return _swiglu_forward(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        return None, ctx.state.ops["npu_swiglu_backward"](grad, x, ctx.dim), None


# ----------------------------------------------------------------------------------------------------
# RoPE (§5)
# ----------------------------------------------------------------------------------------------------


def _rotate(x: Tensor, mode: str) -> Tensor:
    if mode == "half":
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).reshape(x.shape)


def _rotate_adjoint(y: Tensor, mode: str) -> Tensor:
    """The transpose of ``_rotate``: <rotate(x), y> == <x, rotate_adjoint(y)>."""
    if mode == "half":
        y1, y2 = y.chunk(2, -1)
        return torch.cat((y2, -y1), -1)
    return torch.stack((y[..., 1::2], -y[..., ::2]), -1).reshape(y.shape)


def _rotary_batch_heads(x: Tensor, r1: Tensor) -> tuple[int, int]:
    """(B, N) for the half/interleave limits. The layout is implicit: dim 0 is taken as B and N is the first
    of dims 1-2 that r1 broadcasts over, else dim 1 (for 3-D TND x: B = 1, N = dim 1)."""
    if x.dim() == 3:
        return 1, x.shape[1]
    heads = [i for i in (1, 2) if r1.shape[i] == 1 and x.shape[i] > 1]
    return x.shape[0], x.shape[heads[0] if heads else 1]


def _check_rotary_mode(name: str, mode: str) -> None:
    # 'quarter' and 'interleave-half' exist only on Ascend 950 (§5.1), not on A2/A3.
    _check(
        mode in _ROTARY_LAYOUTS, f"{name}: rotary_mode {mode!r} is not supported; use 'half' or 'interleave'"
    )


def _check_rotary(x: Tensor, r1: Tensor, r2: Tensor, mode: str, rotate: Tensor | None) -> None:
    name = "npu_rotary_mul"
    _check_rotary_mode(name, mode)
    _check(x.dim() in (3, 4), f"{name}: input must be 3-D or 4-D, got {x.dim()}-D")
    for t in (x, r1, r2):
        _check(t.dtype in _FLOATS, f"{name}: unsupported dtype {t.dtype}")
    d = x.shape[-1]
    _check(d % 2 == 0 and d < 896, f"{name}: head dim D={d} must be even and < 896")
    _check(r1.shape == r2.shape, f"{name}: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have one shape")
    _check(
        r1.dim() == x.dim() and r1.shape[-1] == d,
        f"{name}: r1/r2 {tuple(r1.shape)} must have the rank of input {tuple(x.shape)} and the full head dim",
    )
    lead = range(x.dim() - 1)
    _check(
        all(r1.shape[i] in (1, x.shape[i]) for i in lead),
        f"{name}: r1/r2 {tuple(r1.shape)} do not broadcast to input {tuple(x.shape)}",
    )
    spanned = {i for i in lead if x.shape[i] > 1}
    full = {i for i in spanned if r1.shape[i] == x.shape[i]}
    _check(
        any(set(layout) & spanned == full for layout in _ROTARY_LAYOUTS[mode][x.dim()]),
        f"{name}: r1/r2 layout {tuple(r1.shape)} for input {tuple(x.shape)} is not supported in {mode} mode",
    )
    b, n = _rotary_batch_heads(x, r1)
    if mode == "half":
        _check(b < 1000 and n < 1000, f"{name}: half mode needs B < 1000 and N < 1000, got B={b}, N={n}")
        needs_grad = torch.is_grad_enabled() and (r1.requires_grad or r2.requires_grad)
        _check(not needs_grad or b * n <= 1024, f"{name}: B*N={b * n} must be <= 1024 when r1/r2 need grad")
    else:
        _check(b * n < 1000, f"{name}: interleave mode needs B*N < 1000, got {b * n}")
    if rotate is not None:
        _check(rotate.shape == (d, d), f"{name}: rotate must be [{d}, {d}], got {tuple(rotate.shape)}")


def _rotary_forward(x: Tensor, r1: Tensor, r2: Tensor, mode: str, rotate: Tensor | None) -> Tensor:
    # The adapter casts r1/r2 to x.dtype; the golden computes in the input dtype.
    rotated = x @ rotate.to(x.dtype) if rotate is not None else _rotate(x, mode)
    return x * r1.to(x.dtype) + rotated * r2.to(x.dtype)


def _rotary_backward(
    grad: Tensor, x: Tensor, r1: Tensor, r2: Tensor, mode: str
) -> tuple[Tensor, Tensor, Tensor]:
    _check_rotary_mode("npu_rotary_mul_backward", mode)
    _check(
        grad.shape == x.shape, f"npu_rotary_mul_backward: grad {tuple(grad.shape)} != input {tuple(x.shape)}"
    )
    g = grad.to(x.dtype)
    dx = g * r1.to(x.dtype) + _rotate_adjoint(g * r2.to(x.dtype), mode)
    dr1 = (g * x).sum_to_size(r1.shape)
    dr2 = (g * _rotate(x, mode)).sum_to_size(r2.shape)
    return dx, dr1, dr2  # all in x.dtype (meta)


class _RotaryMul(torch.autograd.Function):
    """derivatives.yaml: input, r1, r2 via npu_rotary_mul_backward(grad, input, r1, r2, rotary_mode)."""

    @staticmethod
    def forward(ctx: Any, state: _State, x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> Tensor:
        ctx.state, ctx.mode = state, mode
        ctx.save_for_backward(x, r1, r2)
        return _rotary_forward(x, r1, r2, mode, None)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        x, r1, r2 = ctx.saved_tensors
        dx, dr1, dr2 = ctx.state.ops["npu_rotary_mul_backward"](grad, x, r1, r2, ctx.mode)
        return None, dx, dr1.to(r1.dtype), dr2.to(r2.dtype), None


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


class _FusionAttention(torch.autograd.Function):
    """derivatives.yaml: query, key, value, pse via npu_fusion_attention_grad(query, key, value, grad, ...,
    result1, result2, result3, result0, ...). Only attention_out's gradient reaches the backward op."""

    @staticmethod
    def forward(
        ctx: Any,
        state: _State,
        geo: _FaGeometry,
        keep: Tensor | None,
        grad_args: dict[str, Any],
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pse: Tensor | None,
    ) -> tuple:
        out, row_max, row_sum = _fa_forward(geo, keep, grad_args["scale_value"], q, k, v, pse)
        layout = grad_args["softmax_layout"]
        result = (
            _fa_to_layout(out, geo, q.dtype),
            _fa_pack_stats(row_max, geo, layout),
            _fa_pack_stats(row_sum, geo, layout),
            q.new_empty(0),  # softmax_out is reserved: an empty tensor of the query's dtype
        )
        ctx.state, ctx.grad_args = state, grad_args
        ctx.save_for_backward(q, k, v, pse, *result)
        return result

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_unused: Tensor) -> tuple:
        q, k, v, pse, out, softmax_max, softmax_sum, softmax_out = ctx.saved_tensors
        dq, dk, dv, dpse, _ = ctx.state.ops["npu_fusion_attention_grad"](
            q,
            k,
            v,
            grad,
            pse=pse,
            softmax_max=softmax_max,
            softmax_sum=softmax_sum,
            softmax_in=softmax_out,
            attention_in=out,
            **ctx.grad_args,
        )
        return None, None, None, None, dq, dk, dv, dpse


# ----------------------------------------------------------------------------------------------------
# Grouped matmul (§7)
# ----------------------------------------------------------------------------------------------------


def _group_ends(group_list: Tensor, cumulative: bool, total: int, axis: str) -> list[int]:
    """Cumulative end offsets of each group, checked: non-negative, non-decreasing, last <= total."""
    values = group_list.tolist()
    ends = values if cumulative else torch.tensor(values, dtype=torch.int64).cumsum(0).tolist()
    _check(
        all(v >= 0 for v in values) and all(b >= a for a, b in itertools.pairwise(ends)),
        f"npu_grouped_matmul: group_list {values} must give non-negative, non-decreasing offsets",
    )
    _check(ends[-1] <= total, f"npu_grouped_matmul: group_list covers {ends[-1]} > {total} along {axis}")
    return ends


def _gmm_bias(
    bias: Sequence[Tensor] | None, n_groups: int, single_weight: bool, dtype: torch.dtype
) -> list[Tensor | None]:
    """Per-group 1-D biases ([E, N] is also accepted as one tensor next to a single [E, K, N] weight)."""
    if bias is None:
        return [None] * n_groups
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
    return biases


def _mm(x: Tensor, w: Tensor, b: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    _check(
        x.shape[-1] == w.shape[0],
        f"npu_grouped_matmul: x {tuple(x.shape)} and weight {tuple(w.shape)} do not multiply",
    )
    y = x.float() @ w.float()
    if b is not None:
        _check(b.shape[0] == w.shape[1], f"npu_grouped_matmul: bias {tuple(b.shape)} != N={w.shape[1]}")
        y = y + b.float()
    return y.to(out_dtype)


def _concat_rows(outs: list[Tensor]) -> Tensor:
    _check(
        len({o.shape[-1] for o in outs}) == 1,
        "npu_grouped_matmul: split_item 2/3 needs one N for every group",
    )
    return torch.cat(outs, 0)


def _grouped_matmul(
    x: Sequence[Tensor],
    weight: Sequence[Tensor],
    bias: Sequence[Tensor] | None,
    group_list: Tensor | None,
    split_item: int,
    group_type: int,
    group_list_type: int,
    output_dtype: torch.dtype | None,
) -> list[Tensor]:
    name = "npu_grouped_matmul"
    dtype = x[0].dtype
    _check(dtype in _FLOATS, f"{name}: unsupported x dtype {dtype}")
    _check(
        all(t.dtype == dtype for t in (*x, *weight)),
        f"{name}: non-quantised x and weight must share one dtype",
    )
    out_dtype = dtype if output_dtype is None else output_dtype
    _check(out_dtype in _FLOATS, f"{name}: unsupported output_dtype {output_dtype}")
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    weights = list(weight[0].unbind(0)) if single_weight else list(weight)
    for w in weights:
        _check(w.dim() == 2, f"{name}: each weight must be [K, N], got {tuple(w.shape)}")
        _check(max(w.shape) < 65536, f"{name}: inner dims must be < 65536, got weight {tuple(w.shape)}")
    x_max_dim = 6 if split_item == 0 else 2
    for t in x:
        _check(2 <= t.dim() <= x_max_dim, f"{name}: x must be 2-{x_max_dim}-D here, got {tuple(t.shape)}")
        _check(t.shape[-1] < 65536, f"{name}: inner dims must be < 65536, got x {tuple(t.shape)}")

    if group_type == -1:
        _check(group_list is None, f"{name}: group_type=-1 takes no group_list")
        _check(len(x) == len(weights), f"{name}: {len(x)} x tensors for {len(weights)} weights")
        biases = _gmm_bias(bias, len(weights), single_weight, dtype)
        outs = [_mm(xi, wi, bi, out_dtype) for xi, wi, bi in zip(x, weights, biases, strict=True)]
        return outs if split_item in (0, 1) else [_concat_rows(outs)]

    _check(group_list is not None, f"{name}: group_type={group_type} needs a group_list")
    _check(len(x) == 1, f"{name}: group_type={group_type} takes a single x, got {len(x)}")
    (x0,) = x
    _check(x0.dim() == 2, f"{name}: group_type={group_type} needs a 2-D x, got {tuple(x0.shape)}")
    if group_type == 0:
        n_groups = group_list.numel()
        _check(len(weights) == n_groups, f"{name}: {len(weights)} weights for {n_groups} groups")
        biases = _gmm_bias(bias, n_groups, single_weight, dtype)
        # C++ pitfall: split_item 0/1 sizes the outputs as if group_list were cumulative, whatever its type.
        ends = _group_ends(group_list, group_list_type == 0 or split_item in (0, 1), x0.shape[0], "M")
        starts = [0, *ends[:-1]]
        outs = [
            _mm(x0[s:e], w, b, out_dtype) for s, e, w, b in zip(starts, ends, weights, biases, strict=True)
        ]
        if split_item in (0, 1):
            return outs
        # Rows past the last offset are undefined on the device (§7); the stand-in zeroes them.
        tail = x0.new_zeros((x0.shape[0] - ends[-1], weights[0].shape[1]), dtype=out_dtype)
        return [_concat_rows([*outs, tail])]

    # group_type 2: the contraction axis (x's dim 1 = weight's dim 0) is split; one [M, N] result per group.
    _check(split_item in (2, 3), f"{name}: group_type=2 needs split_item 2 or 3, got {split_item}")
    _check(
        len(weight) == 1 and weight[0].dim() == 2,
        f"{name}: group_type=2 takes a single 2-D weight, got {[tuple(w.shape) for w in weight]}",
    )
    _check(bias is None, f"{name}: group_type=2 takes no bias")
    (w0,) = weight
    ends = _group_ends(group_list, group_list_type == 0, x0.shape[1], "K")
    starts = [0, *ends[:-1]]
    return [
        torch.stack([_mm(x0[:, s:e], w0[s:e], None, out_dtype) for s, e in zip(starts, ends, strict=True)])
    ]


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


def _gating_top_k_softmax(x: Tensor, finished: Tensor | None, k: int) -> tuple[Tensor, Tensor, Tensor]:
    p = torch.softmax(x.float(), dim=-1)
    top = torch.argsort(-p, dim=-1, stable=True)[..., :k]  # ties go to the lower expert index
    y = p.gather(-1, top).to(x.dtype)
    expert_idx = top.to(torch.int32)
    if finished is not None:
        expert_idx[finished] = x.shape[-1]
    rows = p[..., 0].numel()
    row_idx = torch.arange(rows * k, dtype=torch.int32).reshape(k, rows).T.reshape(*x.shape[:-1], k)
    return y, expert_idx, row_idx


def _compute_expert_tokens(sorted_experts: Tensor, num_expert: int) -> Tensor:
    name = "npu_moe_compute_expert_tokens"
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


def _permute(tokens: Tensor, indices: Tensor, topk: int, num_out_tokens: int | None) -> tuple[Tensor, Tensor]:
    order = torch.argsort(indices.reshape(-1), stable=True)
    n = order.numel() if not num_out_tokens or num_out_tokens <= 0 else min(num_out_tokens, order.numel())
    # sorted_indices is the INVERSE of Megatron's: permuted[sorted_indices[f]] = tokens[f // topK].
    return tokens[order[:n] // topk], torch.argsort(order).to(torch.int32)


def _padded_rows(rows: Tensor, index: Tensor) -> Tensor:
    """rows[index] in fp32, with any index past the end (a dropped token) reading a zero row."""
    padded = torch.cat((rows.float(), rows.new_zeros((1, rows.shape[1]), dtype=torch.float32)))
    return padded[index.long().clamp(max=rows.shape[0])]


def _permute_grad(
    grad: Tensor, sorted_indices: Tensor, num_tokens: int, dtype: torch.dtype, topk: int
) -> Tensor:
    # Golden: grad.index_select(0, sorted_indices).reshape(-1, topK, H).sum(1); truncated rows give zero.
    summed = _padded_rows(grad, sorted_indices).reshape(num_tokens, topk, grad.shape[1]).sum(1)
    return summed.to(dtype)


class _Permute(torch.autograd.Function):
    """derivatives.yaml: tokens via npu_moe_token_permute_grad_v2(grad, result1, T, dtype, topK, padded)."""

    @staticmethod
    def forward(
        ctx: Any,
        state: _State,
        tokens: Tensor,
        indices: Tensor,
        topk: int,
        num_out_tokens: int | None,
        padded_mode: bool,
    ) -> tuple:
        permuted, sorted_indices = _permute(tokens, indices, topk, num_out_tokens)
        ctx.state, ctx.topk, ctx.padded_mode = state, topk, padded_mode
        ctx.num_tokens, ctx.dtype = tokens.shape[0], tokens.dtype
        ctx.save_for_backward(sorted_indices)
        ctx.mark_non_differentiable(sorted_indices)
        return permuted, sorted_indices

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _dsorted: Any) -> tuple:
        (sorted_indices,) = ctx.saved_tensors
        grad_op = ctx.state.ops["npu_moe_token_permute_grad_v2"]
        dtokens = grad_op(grad, sorted_indices, ctx.num_tokens, ctx.dtype, ctx.topk, ctx.padded_mode)
        return None, dtokens, None, None, None, None


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
        _check(
            probs.dim() == 2 and probs.dtype in _FLOATS and probs.numel() == sorted_indices.numel(),
            f"{name}: probs must be float [T, topK] with T*topK == {sorted_indices.numel()}",
        )


def _unpermute(permuted: Tensor, sorted_indices: Tensor, probs: Tensor | None) -> Tensor:
    topk = probs.shape[1] if probs is not None else 1
    rows = _padded_rows(permuted, sorted_indices).reshape(-1, topk, permuted.shape[1])
    # Accumulating in fp32 and casting once is a choice: the kernel's precision is UNKNOWN.
    weights = probs.float() if probs is not None else rows.new_ones(rows.shape[:2])
    return (rows * weights.unsqueeze(-1)).sum(1).to(permuted.dtype)


def _unpermute_grad(
    grad: Tensor,
    sorted_indices: Tensor,
    num_permuted: int,
    dtype: torch.dtype,
    probs: Tensor | None,
    permuted: Tensor | None,
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
    _check(permuted is not None, "npu_moe_token_unpermute_grad_v2: probs gradient needs permuted_tokens")
    rows = _padded_rows(permuted, sorted_indices).reshape(-1, topk, hidden)
    dprobs = (rows * gf).sum(-1).to(probs.dtype)
    return dpermuted[:num_permuted].to(dtype), dprobs


class _Unpermute(torch.autograd.Function):
    """derivatives.yaml: permuted_tokens, probs via npu_moe_token_unpermute_grad_v2."""

    @staticmethod
    def forward(
        ctx: Any,
        state: _State,
        permuted: Tensor,
        sorted_indices: Tensor,
        probs: Tensor | None,
        padded_mode: bool,
        restore_shape: list[int] | None,
    ) -> Tensor:
        ctx.state, ctx.padded_mode, ctx.restore_shape = state, padded_mode, restore_shape
        ctx.has_probs = probs is not None
        ctx.save_for_backward(permuted, sorted_indices, probs)
        return _unpermute(permuted, sorted_indices, probs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        permuted, sorted_indices, probs = ctx.saved_tensors
        dpermuted, dprobs = ctx.state.ops["npu_moe_token_unpermute_grad_v2"](
            grad,
            sorted_indices,
            permuted.shape[0],
            permuted.dtype,
            probs if ctx.has_probs else None,
            ctx.padded_mode,
            ctx.restore_shape,
            permuted,
        )
        return None, dpermuted, None, dprobs if ctx.has_probs else None, None, None


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
    term = _padded_rows(rows, torch.where(r >= 0, r, rows.shape[0]))
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


def build_ops(calls: Counter[str]) -> dict[str, Callable[..., Any]]:
    """Create one module's op functions; they count into ``calls`` and share one warn-once state."""
    state = _State(calls)

    def npu_rms_norm(input: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple[Tensor, Tensor]:
        """RMSNorm over the last gamma.dim() dims; returns (y [x.dtype], rstd [fp32])."""
        calls["npu_rms_norm"] += 1
        _check_rms_norm("npu_rms_norm", input, gamma)
        return _RmsNorm.apply(state, input, gamma, epsilon)

    def npu_rms_norm_backward(
        dy: Tensor, input: Tensor, gamma: Tensor, rstd: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Backward of npu_rms_norm: (dx [x.dtype], dgamma [fp32, gamma.shape])."""
        calls["npu_rms_norm_backward"] += 1
        return _rms_norm_backward(dy, input, gamma, rstd)

    def npu_gemma_rms_norm(input: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple[Tensor, Tensor]:
        """Gemma RMSNorm, y = x*rstd*(1+gamma); no autograd kernel (generic fallback)."""
        calls["npu_gemma_rms_norm"] += 1
        # The dtype table is documented for npu_rms_norm only (UNKNOWN here); the same pairs are enforced.
        _check_rms_norm("npu_gemma_rms_norm", input, gamma)
        return _WarnNotImplemented.apply(
            state, "npu_gemma_rms_norm", lambda: _gemma_rms_norm(input, gamma, epsilon), input, gamma
        )

    def npu_add_rms_norm(
        x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-06
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Residual add then RMSNorm: returns (y, rstd, x1 + x2); backward raises."""
        calls["npu_add_rms_norm"] += 1
        _check_add_rms_norm(x1, x2, gamma)
        return _RaiseInBackward.apply(
            _not_implemented_message("npu_add_rms_norm"),
            lambda: _add_rms_norm(x1, x2, gamma, epsilon),
            x1,
            x2,
            gamma,
        )

    def npu_swiglu(input: Tensor, dim: int = -1) -> Tensor:
        """silu(first half) * second half along dim, fp32 inside."""
        calls["npu_swiglu"] += 1
        _check_swiglu("npu_swiglu", input, dim)
        return _Swiglu.apply(state, input, dim)

    def npu_swiglu_backward(grad_output: Tensor, input: Tensor, dim: int = -1) -> Tensor:
        """Backward of npu_swiglu: the gradient w.r.t. input, in input's dtype."""
        calls["npu_swiglu_backward"] += 1
        _check_swiglu("npu_swiglu_backward", input, dim)
        return _swiglu_backward(grad_output, input, dim)

    def npu_rotary_mul(
        input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half", rotate: Tensor | None = None
    ) -> Tensor:
        """x*r1 + rotate(x)*r2 with full-head-dim r1 (cos) and r2 (sin)."""
        calls["npu_rotary_mul"] += 1
        _check_rotary(input, r1, r2, rotary_mode, rotate)
        if rotate is None:
            return _RotaryMul.apply(state, input, r1, r2, rotary_mode)
        # derivatives.yaml marks rotate non-differentiable and the backward op cannot take it (§11.6).
        (out,) = _RaiseInBackward.apply(
            "npu_rotary_mul: backward is not supported when a rotate matrix is given",
            lambda: (_rotary_forward(input, r1, r2, rotary_mode, rotate),),
            input,
            r1,
            r2,
            rotate,
        )
        return out

    def npu_rotary_mul_backward(
        grad: Tensor, input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half"
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Backward of npu_rotary_mul: (dx, dr1, dr2) in x's dtype, dr1/dr2 summed to r1/r2 shapes."""
        calls["npu_rotary_mul_backward"] += 1
        return _rotary_backward(grad, input, r1, r2, rotary_mode)

    def npu_apply_rotary_pos_emb(
        query: Tensor, key: Tensor, cos: Tensor, sin: Tensor, layout: str = "BSND", rotary_mode: str = "half"
    ) -> tuple[Tensor, Tensor]:
        """RoPE on query and key IN PLACE; returns the same (mutated) tensor objects."""
        calls["npu_apply_rotary_pos_emb"] += 1
        _check_apply_rope(query, key, cos, sin, layout, rotary_mode)
        new_query, new_key = _RaiseInBackward.apply(
            _not_implemented_message("npu_apply_rotary_pos_emb"),
            lambda: (
                _rotary_forward(query, cos, sin, "half", None),
                _rotary_forward(key, cos, sin, "half", None),
            ),
            query,
            key,
            cos,
            sin,
        )
        # The copy records the mutation for autograd, so backward reaches the raising node.
        query.copy_(new_query)
        key.copy_(new_key)
        return query, key

    def npu_fusion_attention(
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
        """softmax(mask(scale * (q @ k^T + pse))) @ v without dropout, fp32 inside; real backward.

        Returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels). With keep_prob 1
        no dropout mask is drawn, so seed and offset are 0 (§12) and the seed/offset arguments, like
        gen_mask_parallel and sync, have nothing to act on.
        """
        name = "npu_fusion_attention"
        calls[name] += 1
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
        grad_args = {
            **options,
            "head_num": head_num,
            "input_layout": input_layout,
            "atten_mask": atten_mask,
            "scale_value": float(scale),
            "seed": 0,
            "offset": 0,
            "numels": numels,
            "gen_mask_parallel": gen_mask_parallel,
            "sync": sync,
        }
        result = _FusionAttention.apply(state, geo, keep, grad_args, query, key, value, pse)
        return (*result, 0, 0, numels)

    def npu_fusion_attention_grad(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        dy: Tensor,
        head_num: int,
        input_layout: str,
        *,
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
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """Backward of npu_fusion_attention: (dq, dk, dv, dpse, dsink), each in its input's dtype and shape.

        The schema is op-plugin's (the reference quotes only the forward's); dpse is None without pse, as the
        C++ adapter returns an undefined tensor, and dsink is None (sink is not modelled). The forward's
        softmax_max, softmax_sum and attention_out are required: the gradient is built from them, as on the
        device. softmax_in is the reserved empty tensor and is not read.
        """
        name = "npu_fusion_attention_grad"
        calls[name] += 1
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
        grads = _fa_backward(
            geo, keep, scale_value, (query, key, value, pse), dy, attention_in, row_max, row_sum
        )
        return (*grads, None)

    def npu_grouped_matmul(
        x: Sequence[Tensor],
        weight: Sequence[Tensor],
        *,
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
        output_dtype: torch.dtype | None = None,
        x_dtype: int | None = None,
        weight_dtype: int | None = None,
        scale_dtype: int | None = None,
        per_token_scale_dtype: int | None = None,
    ) -> list[Tensor]:
        """Grouped x_i @ weight_i (+ bias_i), non-quantised, as a list; no autograd (generic fallback).

        ``tuning_config`` is a performance hint only and is ignored.
        """
        calls["npu_grouped_matmul"] += 1
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
        _unsupported(bool(given), f"npu_grouped_matmul: quantised path ({', '.join(given)}) is not modelled")
        _unsupported(act_type != 0, f"npu_grouped_matmul: act_type={act_type} (per-token quant only)")
        _unsupported(group_list_type == 2, "npu_grouped_matmul: group_list_type=2 (int8 quant only)")
        _unsupported(
            group_list is not None and not isinstance(group_list, Tensor),
            "npu_grouped_matmul: the legacy .List overload (group_list as a Python list)",
        )
        _unsupported(
            output_dtype is not None and not isinstance(output_dtype, torch.dtype),
            "npu_grouped_matmul: integer (ACL) output_dtype codes",
        )
        for label, arg in (("x", x), ("weight", weight), ("bias", bias)):
            if arg is not None and not isinstance(arg, list | tuple):
                raise TypeError(
                    f"npu_grouped_matmul: {label} must be a list of tensors, got {type(arg).__name__}"
                )
        _check(group_type is not None, "Requires manual passing group_type, current is None.")
        _check(group_type in (-1, 0, 2), f"The group_type must be -1, 0 or 2, but now is [{group_type}]")
        _check(len(x) > 0 and len(weight) > 0, "Invalid inputs: neither x nor weight could be empty.")
        _check(split_item in (0, 1, 2, 3), f"Invalid value of split_item [{split_item}], should be 0/1/2/3.")
        n_entries = max(len(x), len(weight), len(bias or ()))
        _check(n_entries <= 128, f"npu_grouped_matmul: at most 128 list entries, got {n_entries}")
        if group_list is not None:
            _check(
                group_list.dtype == torch.int64,
                f"npu_grouped_matmul: group_list must be int64, got {group_list.dtype}",
            )
            _check(
                group_list.dim() == 1 and 1 <= group_list.numel() <= 1024,
                f"npu_grouped_matmul: group_list must be 1-D with 1..1024 groups, got {group_list.shape}",
            )
            _check(
                group_list_type in (0, 1), f"npu_grouped_matmul: group_list_type {group_list_type} invalid"
            )
        outs = _WarnNotImplemented.apply(
            state,
            "npu_grouped_matmul",
            lambda: _grouped_matmul(
                x, weight, bias, group_list, split_item, group_type, group_list_type, output_dtype
            ),
            *x,
            *weight,
            *(bias or ()),
        )
        return list(outs)

    def npu_moe_gating_top_k_softmax(
        x: Tensor, finished: Tensor | None = None, k: int = 1
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(top-k softmax probs [x.dtype], expert_idx int32, row_idx int32); backward raises."""
        calls["npu_moe_gating_top_k_softmax"] += 1
        _check_gating(x, finished, k)
        return _RaiseInBackward.apply(
            _not_implemented_message("npu_moe_gating_top_k_softmax"),
            lambda: _gating_top_k_softmax(x, finished, k),
            x,
        )

    def npu_moe_compute_expert_tokens(sorted_expert_for_source_row: Tensor, num_expert: int) -> Tensor:
        """Cumulative token counts per expert (int32), usable as group_list type 0."""
        calls["npu_moe_compute_expert_tokens"] += 1
        return _compute_expert_tokens(sorted_expert_for_source_row, num_expert)

    def npu_moe_init_routing_v2(
        x: Tensor,
        expert_idx: Tensor,
        *,
        scale: Tensor | None = None,
        offset: Tensor | None = None,
        active_num: int = -1,
        expert_capacity: int = -1,
        expert_num: int = -1,
        drop_pad_mode: int = 0,
        expert_tokens_num_type: int = 0,
        expert_tokens_num_flag: bool = False,
        quant_mode: int = -1,
        active_expert_range: Sequence[int] = [],  # the schema's default; never mutated
        row_idx_type: int = 0,
        x_dtype: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Dropless, non-quantised MoE routing; no autograd (generic fallback).

        ``expert_capacity`` only matters in drop/pad mode, which is not modelled.
        """
        calls["npu_moe_init_routing_v2"] += 1
        _check(drop_pad_mode in (0, 1), f"npu_moe_init_routing_v2: drop_pad_mode {drop_pad_mode} invalid")
        _check(quant_mode in (-1, 0, 1, 2, 3), f"npu_moe_init_routing_v2: quant_mode {quant_mode} invalid")
        _unsupported(drop_pad_mode == 1, "npu_moe_init_routing_v2: drop/pad mode (drop_pad_mode=1)")
        _unsupported(quant_mode != -1, f"npu_moe_init_routing_v2: quantisation (quant_mode={quant_mode})")
        _unsupported(
            offset is not None or x_dtype is not None, "npu_moe_init_routing_v2: offset/x_dtype (quant)"
        )
        return _WarnNotImplemented.apply(
            state,
            "npu_moe_init_routing_v2",
            lambda: _init_routing_v2(
                x,
                expert_idx,
                scale,
                active_num,
                expert_num,
                expert_tokens_num_type,
                expert_tokens_num_flag,
                active_expert_range,
                row_idx_type,
            ),
            x,
            *(() if scale is None else (scale,)),
        )

    def npu_moe_finalize_routing(
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
        calls["npu_moe_finalize_routing"] += 1
        _check(
            drop_pad_mode in (0, 1, 2, 3), f"npu_moe_finalize_routing: drop_pad_mode {drop_pad_mode} invalid"
        )
        _unsupported(
            drop_pad_mode in (1, 3), "npu_moe_finalize_routing: drop/pad rows [E, C, H] (modes 1, 3)"
        )
        tensors = [t for t in (expanded_permuted_rows, skip1, skip2, bias, scales) if t is not None]
        (out,) = _WarnNotImplemented.apply(
            state,
            "npu_moe_finalize_routing",
            lambda: (
                _finalize_routing(
                    expanded_permuted_rows,
                    skip1,
                    skip2,
                    bias,
                    scales,
                    expanded_src_to_dst_row,
                    export_for_source_row,
                    drop_pad_mode,
                    k,
                ),
            ),
            *tensors,
        )
        return out

    def npu_moe_token_permute(
        tokens: Tensor, indices: Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Sort token copies by expert: (permuted_tokens, sorted_indices int32 = the inverse permutation)."""
        calls["npu_moe_token_permute"] += 1
        topk = _check_permute(tokens, indices, padded_mode)
        return _Permute.apply(state, tokens, indices, topk, num_out_tokens, padded_mode)

    def npu_moe_token_permute_grad_v2(
        grad_permuted_tokens: Tensor,
        sorted_indices: Tensor,
        tokens_size_0: int,
        tokens_dtype: torch.dtype,
        num_topK: int,
        padded_mode: bool = False,
    ) -> Tensor:
        """Backward of npu_moe_token_permute: the gradient w.r.t. tokens [T, H]."""
        calls["npu_moe_token_permute_grad_v2"] += 1
        _unsupported(padded_mode, "npu_moe_token_permute_grad_v2: padded_mode=True is not modelled")
        return _permute_grad(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_topK)

    def npu_moe_token_unpermute(
        permuted_tokens: Tensor,
        sorted_indices: Tensor,
        probs: Tensor | None = None,
        padded_mode: bool = False,
        restore_shape: Sequence[int] | None = None,
    ) -> Tensor:
        """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*topK + k]].

        ``restore_shape`` only matters in padded mode, which is not modelled.
        """
        calls["npu_moe_token_unpermute"] += 1
        _check_unpermute(permuted_tokens, sorted_indices, probs, padded_mode)
        return _Unpermute.apply(state, permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)

    def npu_moe_token_unpermute_grad_v2(
        grad_unpermuted_tokens: Tensor,
        sorted_indices: Tensor,
        permuted_tokens_size_0: int,
        permuted_tokens_dtype: torch.dtype,
        probs: Tensor | None = None,
        padded_mode: bool = False,
        restore_shape: Sequence[int] | None = None,
        permuted_tokens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Backward of npu_moe_token_unpermute: (d permuted_tokens, d probs)."""
        calls["npu_moe_token_unpermute_grad_v2"] += 1
        _unsupported(padded_mode, "npu_moe_token_unpermute_grad_v2: padded_mode=True is not modelled")
        return _unpermute_grad(
            grad_unpermuted_tokens,
            sorted_indices,
            permuted_tokens_size_0,
            permuted_tokens_dtype,
            probs,
            permuted_tokens,
        )

    ops = [
        npu_rms_norm,
        npu_rms_norm_backward,
        npu_gemma_rms_norm,
        npu_add_rms_norm,
        npu_swiglu,
        npu_swiglu_backward,
        npu_rotary_mul,
        npu_rotary_mul_backward,
        npu_apply_rotary_pos_emb,
        npu_fusion_attention,
        npu_fusion_attention_grad,
        npu_grouped_matmul,
        npu_moe_gating_top_k_softmax,
        npu_moe_compute_expert_tokens,
        npu_moe_init_routing_v2,
        npu_moe_finalize_routing,
        npu_moe_token_permute,
        npu_moe_token_permute_grad_v2,
        npu_moe_token_unpermute,
        npu_moe_token_unpermute_grad_v2,
    ]
    for op in ops:  # read as torch_npu's own functions in reprs and tracebacks
        op.__module__, op.__qualname__ = "torch_npu", op.__name__
    state.ops.update({op.__name__: op for op in ops})
    return dict(state.ops)
