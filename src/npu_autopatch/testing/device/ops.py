"""The ops the kernels call: the device's checks on top of the reference math, per op, and their backward.

What each op computes comes from ``npu_autopatch.kernels._reference`` (the one definition the probes
use too). What the device REFUSES is added on top, each rule with its source: the CANN kernels'
host-side tiling checks (hicann/ops-transformer), the op-plugin adapters (Ascend/op-plugin, per
release branch), and where no source check exists, the op documentation (``torch_npu_ops.md`` §N,
op-plugin's docs). What changed between release lines is a field of the profile (profiles.py).
The testing harness (``testing._library``) registers these functions as torch.library ops, one
namespace per profile. Ops no kernel calls are not modelled; the attention kernel's op is in
attention.py.

Two kinds of error are raised on purpose (common.py):

* ``RuntimeError``: the real op rejects the call, as ``TORCH_CHECK`` or a failed tiling does on the device.
* ``NotImplementedError``: the call is valid on the device but this stand-in does not model it (quantisation,
  padded mode, ...), so a test must not pass by accident.

Where the device leaves memory uninitialised (an output it allocates with ``empty`` and never writes), the
stand-in fills it with NaN, the worst case, so that a caller trusting it fails the parity tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...kernels import _reference
from .common import FLOATS, check, fake_empty, fake_like, uninitialised, unsupported
from .profiles import Profile

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


# ----------------------------------------------------------------------------------------------------
# RMSNorm family (§2, §3)
# ----------------------------------------------------------------------------------------------------


def _check_norm_args(name: str, x: Tensor, gamma: Tensor) -> None:
    check(
        1 <= gamma.dim() <= x.dim() and tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]),
        f"{name}: gamma shape {tuple(gamma.shape)} must equal the trailing dims of input {tuple(x.shape)}",
    )


def _check_rms_norm(name: str, x: Tensor, gamma: Tensor) -> None:
    # op-plugin docs, (beta)torch_npu-npu_rms_norm.md: input 2-8-D; empty and non-contiguous tensors are fine.
    check(2 <= x.dim() <= 8, f"{name}: input must be 2-8-D, got {x.dim()}-D")
    _check_norm_args(name, x, gamma)
    check(
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
    check(dy.shape == x.shape, f"npu_rms_norm_backward: dy shape {tuple(dy.shape)} != input {tuple(x.shape)}")
    _check_norm_args("npu_rms_norm_backward", x, gamma)
    xf, dyf, gf = x.float(), dy.float(), gamma.float()
    norm_dims = tuple(range(-gamma.dim(), 0))
    dgamma = _sum_leading(dyf * xf * rstd, x.dim() - gamma.dim())
    inner = (rstd.pow(3) * dyf * gf * xf).sum(dim=norm_dims, keepdim=True)
    dx = dyf * gf * rstd - xf * inner / gamma.numel()
    return dx.to(x.dtype), dgamma


# ----------------------------------------------------------------------------------------------------
# SwiGLU (§4)
# ----------------------------------------------------------------------------------------------------


def _check_swiglu(name: str, x: Tensor, dim: int) -> None:
    # op-plugin docs, (beta)torch_npu-npu_swiglu.md: 1-8-D, even along dim, contiguous, not empty.
    check(x.dtype in FLOATS, f"{name}: unsupported dtype {x.dtype}")
    check(1 <= x.dim() <= 8, f"{name}: input must be 1-8-D, got {x.dim()}-D")
    check(-x.dim() <= dim < x.dim(), f"{name}: dim {dim} out of range for a {x.dim()}-D input")
    check(x.numel() > 0, f"{name}: empty input is not supported")
    check(x.is_contiguous(), f"{name}: input must be contiguous")
    check(x.shape[dim] % 2 == 0, f"{name}: size {x.shape[dim]} along dim {dim} must be even")


def swiglu(profile: Profile, input: Tensor, dim: int = -1) -> Tensor:
    _check_swiglu("npu_swiglu", input, dim)
    return _reference.npu_swiglu(input, dim)


def swiglu_backward(profile: Profile, grad_output: Tensor, input: Tensor, dim: int = -1) -> Tensor:
    """The golden of test_npu_swiglu_backward.py, fp32 inside."""
    _check_swiglu("npu_swiglu_backward", input, dim)
    a, b = input.float().chunk(2, dim)
    check(
        grad_output.shape == a.shape,
        f"npu_swiglu_backward: grad shape {tuple(grad_output.shape)} != {tuple(a.shape)}",
    )
    g = grad_output.float()
    s = torch.sigmoid(a)
    da = g * b * (s + a * s * (1 - s))
    db = g * a * s
    return torch.cat((da, db), dim).to(input.dtype)


# ----------------------------------------------------------------------------------------------------
# The GELU family (issue 34): npu_gelu, npu_fast_gelu, npu_geglu and their backward ops
# ----------------------------------------------------------------------------------------------------

_GELU_MODES = ("none", "tanh")


def _check_elementwise(name: str, x: Tensor) -> None:
    # torch_npu-npu_gelu.md / torch_npu-npu_fast_gelu.md: Atlas A2 takes fp16, bf16 and fp32, up to 8-D.
    check(x.dtype in FLOATS, f"{name}: unsupported dtype {x.dtype}")
    check(x.dim() <= 8, f"{name}: input must be at most 8-D, got {x.dim()}-D")


def gelu(profile: Profile, input: Tensor, approximate: str = "none") -> Tensor:
    _check_elementwise("npu_gelu", input)
    check(approximate in _GELU_MODES, f"npu_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _reference.npu_gelu(input, approximate)


def gelu_backward(profile: Profile, grad_output: Tensor, input: Tensor, approximate: str = "none") -> Tensor:
    """aten's gelu_backward with the same ``approximate`` (op-plugin test_npu_gelu_backward.py golden), in
    fp32."""
    _check_elementwise("npu_gelu_backward", input)
    check(approximate in _GELU_MODES, f"npu_gelu_backward: approximate {approximate!r}")
    dtype = torch.result_type(grad_output, input)
    return torch.ops.aten.gelu_backward(grad_output.float(), input.float(), approximate=approximate).to(dtype)


def fast_gelu(profile: Profile, input: Tensor) -> Tensor:
    _check_elementwise("npu_fast_gelu", input)
    return _reference.npu_fast_gelu(input)


def fast_gelu_backward(profile: Profile, grad: Tensor, input: Tensor) -> Tensor:
    """d/dx of x * sigmoid(1.702 x), fp32 inside (the A2/A3 formula's derivative)."""
    _check_elementwise("npu_fast_gelu_backward", input)
    x = input.float()
    s = torch.sigmoid(1.702 * x)
    return (grad.float() * (s + 1.702 * x * s * (1 - s))).to(torch.result_type(grad, input))


def _check_geglu(name: str, x: Tensor, dim: int, approximate: int) -> None:
    # GeGluKernelNpuOpApi.cpp: dim in range; aclnnGeGluV3 (hicann/ops-nn ge_glu_v2 docs): fp16/bf16/fp32,
    # 0-8-D, the dim's size even; approximate 0 (none) or 1 (tanh).
    check(x.dtype in FLOATS, f"{name}: unsupported dtype {x.dtype}")
    check(x.dim() <= 8, f"{name}: input must be at most 8-D, got {x.dim()}-D")
    rank = max(x.dim(), 1)
    check(-rank <= dim < rank, f"{name}: dim {dim} out of range for a {x.dim()}-D input")
    check(x.shape[dim] % 2 == 0, f"{name}: size {x.shape[dim]} along dim {dim} must be even")
    check(approximate in (0, 1), f"{name}: approximate must be 0 (none) or 1 (tanh), got {approximate}")


def geglu(
    profile: Profile, input: Tensor, dim: int = -1, approximate: int = 1, activate_left: bool = False
) -> tuple[Tensor, Tensor]:
    _check_geglu("npu_geglu", input, dim, approximate)
    return _reference.npu_geglu(input, dim, approximate, activate_left)


def geglu_grad(
    profile: Profile,
    grad_output: Tensor,
    input: Tensor,
    gelu: Tensor,
    dim: int = -1,
    approximate: int = 1,
    activate_left: bool = False,
) -> Tensor:
    """d(x * gelu(gate)) in input's dtype, the halves in input's order; the x half from the saved ``gelu``
    (derivatives.yaml passes result1), the gate half through aten's gelu_backward. fp32 inside."""
    _check_geglu("npu_geglu_grad", input, dim, approximate)
    gate, x = _reference.geglu_halves(input, dim, activate_left)
    check(
        grad_output.shape == gate.shape,
        f"npu_geglu_grad: grad shape {tuple(grad_output.shape)} != {tuple(gate.shape)}",
    )
    g = grad_output.float()
    mode = "tanh" if approximate == 1 else "none"
    dgate = torch.ops.aten.gelu_backward(g * x, gate, approximate=mode)
    dx = g * gelu.float()
    halves = (dgate, dx) if activate_left else (dx, dgate)
    return torch.cat(halves, dim).to(input.dtype)


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
    check(
        mode in ("half", "interleave"),
        f"{name}: The rotary_mode of npu_rotary_mul should be half or interleave, but got {mode}",
    )
    # rope_rotate_half_tiling.cpp CheckShapeSupport "the input shape must be 4-dimensional";
    # rope_interleaved_tiling.cpp CheckInputShape; rope_half_grad_tiling.cpp "only support 4-d input".
    # (op-plugin >= 26.0.0 calls aclnnRotaryPositionEmbeddingV2 where CANN has it; its 3-D support is
    # documented but untested upstream and its rules are not published: UNKNOWN, modelled as V1.)
    check(
        x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4,
        f"{name}: the input shape must be 4-dimensional, got x {tuple(x.shape)}, cos {tuple(r1.shape)}",
    )
    for t in (x, r1, r2):
        check(
            t.dtype in FLOATS, f"{name}: only supports float, float16 and bfloat16 data type, got {t.dtype}"
        )
    check(r1.shape == r2.shape, f"{name}: cos shape {tuple(r1.shape)} and sin shape {tuple(r2.shape)} differ")
    d = x.shape[-1]
    check(r1.shape[-1] == d, f"{name}: input last dim (head_dim) should be equal, x {d}, cos {r1.shape[-1]}")
    check(d % 2 == 0, f"{name}: input last dim (head_dim) {d} must be an even number")
    check(d <= ROTARY_D_LIMIT, f"{name}: input last dim (head_dim) {d} should be at most {ROTARY_D_LIMIT}")
    # The kernels read r at the broadcast positions; torch's broadcasting rule is the least they need.
    check(
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
        check(layout != "UNKNOWN", f"{name}: unknow input layout, unable to calculate: x {xs}, cos {rs}")
        check(lines > 0, f"{name}: cos {rs} broadcasts over every dim of x {xs}: no layout (S lines unset)")
        check(
            not (layout == "BNSD" and bnsd_block_skip(b, n, lines, d, x.element_size())),
            f"{name}: when input is BNSD layout and B * N is large or D is not aligned, please do not use "
            f"RotaryPositionEmbedding fusion operator (x {xs}, cos {rs}, B*N={b * n}, S={lines}, D={d})",
        )
        # Documented only (torch_npu-npu_rotary_mul.md, aclnnRotaryPositionEmbedding.md), read as the
        # tiling's broadcast dims: B, N < 1000; B*N <= 1024 when cos/sin need gradients.
        check(b < 1000 and n < 1000, f"{name}: half mode needs B < 1000 and N < 1000, got B={b}, N={n}")
        check(not needs_grad or b * n <= 1024, f"{name}: B*N={b * n} must be <= 1024 when r1/r2 need grad")
    else:
        found = interleave_forward_layout(xs, rs)
        check(found is not None, f"{name}: The shape of the input x {xs}, cos and sin {rs} is not supported.")
        _, batch, heads = found
        check(d < ROTARY_D_LIMIT, f"{name}: interleave mode needs D < {ROTARY_D_LIMIT}, got {d}")  # doc
        check(batch * heads < 1000, f"{name}: interleave mode needs B*N < 1000, got {batch * heads}")  # doc


def check_rotary_backward(grad: Tensor, x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> None:
    name = "npu_rotary_mul_backward"
    _check_rotary_common(name, x, r1, r2, mode)
    check(grad.shape == x.shape, f"{name}: grad {tuple(grad.shape)} != input {tuple(x.shape)}")
    xs, rs = tuple(x.shape), tuple(r1.shape)
    layout = half_backward_layout(xs, rs) if mode == "half" else interleave_backward_layout(xs, rs)
    check(layout is not None, f"{name}: invalid shape! x shape: {xs} and cos shape: {rs}")


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
        check(
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
        check(
            transpose_x,
            f"{name}: When groupType is 2 and x is not separated, tensor in x should be transposed.",
        )
    else:
        transpose_x, transpose_weight = _special_transposed(x), transposed_last_two(weight[0])
        check(not transpose_x, f"{name}: When groupType is {group_type}, x can not be transposed.")
    check(
        not (transpose_x and transpose_weight),
        f"{name}: x and weight can not be transposed at the same time.",
    )


def _group_ends(group_list: Tensor, cumulative: bool, total: int, axis: str) -> list[int]:
    """Cumulative end offsets of each group, checked: non-negative, non-decreasing, last <= total."""
    values = group_list.tolist()
    ends = _reference.group_ends(group_list, cumulative)
    check(
        all(v >= 0 for v in values) and all(b >= a for a, b in itertools.pairwise(ends)),
        f"npu_grouped_matmul: group_list {values} must give non-negative, non-decreasing offsets",
    )
    check(ends[-1] <= total, f"npu_grouped_matmul: group_list covers {ends[-1]} > {total} along {axis}")
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
    check(len(biases) == n_groups, f"npu_grouped_matmul: {len(biases)} biases for {n_groups} groups")
    for b in biases:
        check(b.dim() == 1, f"npu_grouped_matmul: bias must be 1-D [N] per group, got {tuple(b.shape)}")
        check(
            b.dtype == _GMM_BIAS_DTYPE[dtype],
            f"npu_grouped_matmul: {dtype} x needs a {_GMM_BIAS_DTYPE[dtype]} bias, got {b.dtype}",
        )


def _check_gmm_shapes(x: Sequence[Tensor], weights: Sequence[Tensor], split_item: int) -> None:
    name = "npu_grouped_matmul"
    for w in weights:
        check(w.dim() == 2, f"{name}: each weight must be [K, N], got {tuple(w.shape)}")
        check(max(w.shape) < 65536, f"{name}: inner dims must be < 65536, got weight {tuple(w.shape)}")
    x_max_dim = 6 if split_item == 0 else 2
    for t in x:
        check(2 <= t.dim() <= x_max_dim, f"{name}: x must be 2-{x_max_dim}-D here, got {tuple(t.shape)}")
        check(t.shape[-1] < 65536, f"{name}: inner dims must be < 65536, got x {tuple(t.shape)}")


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
    unsupported(bool(given), f"{name}: quantised path ({', '.join(given)}) is not modelled")
    unsupported(act_type not in (0, None), f"{name}: act_type={act_type} (per-token quant only)")
    unsupported(group_list_type == 2, f"{name}: group_list_type=2 (int8 quant only)")
    unsupported(
        output_dtype is not None and not isinstance(output_dtype, torch.dtype),
        f"{name}: integer (ACL) output_dtype codes",
    )
    # GroupedMatmulKernelNpuOpApi.cpp: group_type must be passed; 7.1.0 takes -1 and 0 only, later
    # branches -1, 0 and 2.
    check(group_type is not None, "Requires manual passing group_type, current is None.")
    check(
        group_type in profile.gmm_group_types,
        f"{name}: group_type {group_type} is not supported by torch_npu {profile.torch_npu} "
        f"(op-plugin {profile.op_plugin} takes {sorted(profile.gmm_group_types)})",
    )
    split_item = 0 if split_item is None else split_item
    group_list_type = 0 if group_list_type is None else group_list_type
    check(len(x) > 0 and len(weight) > 0, "Invalid inputs: neither x nor weight could be empty.")
    check(split_item in (0, 1, 2, 3), f"Invalid value of split_item [{split_item}], should be 0/1/2/3.")
    n_entries = max(len(x), len(weight), len(bias or ()))
    check(n_entries <= 128, f"{name}: at most 128 list entries, got {n_entries}")
    dtype = x[0].dtype
    check(dtype in FLOATS, f"{name}: unsupported x dtype {dtype}")
    check(
        all(t.dtype == dtype for t in (*x, *weight)),
        f"{name}: non-quantised x and weight must share one dtype",
    )
    out_dtype = dtype if output_dtype is None else output_dtype
    check(out_dtype in FLOATS, f"{name}: unsupported output_dtype {output_dtype}")
    if group_list is not None:
        # aclnn_grouped_matmul.cpp CheckGroupListCommonTensor: int64, at most 1024 groups.
        check(group_list.dtype == torch.int64, f"{name}: group_list must be int64, got {group_list.dtype}")
        check(
            group_list.dim() == 1 and 1 <= group_list.numel() <= 1024,
            f"{name}: group_list must be 1-D with 1..1024 groups, got {tuple(group_list.shape)}",
        )
        check(group_list_type in (0, 1), f"{name}: group_list_type {group_list_type} invalid")
        # op-plugin docs, torch_npu-npu_grouped_matmul.md: with group_list_type 1 "长度不能为1".
        check(
            group_list_type != 1 or group_list.numel() != 1,
            f"{name}: a group_list of counts (group_list_type=1) must not have length 1",
        )
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    weights = list(weight[0].unbind(0)) if single_weight else list(weight)
    _check_gmm_shapes(x, weights, split_item)
    _check_gmm_transpose(group_type, x, weight)
    all_empty = all(t.numel() == 0 for t in x)

    if group_type == -1:
        check(group_list is None, f"{name}: group_type=-1 takes no group_list")
        check(len(x) == len(weights), f"{name}: {len(x)} x tensors for {len(weights)} weights")
        _check_gmm_bias(bias, len(weights), single_weight, dtype)
        check(
            split_item in (0, 1) or len({w.shape[-1] for w in weights}) == 1,
            f"{name}: split_item 2/3 needs one N for every group",
        )
    else:
        check(group_list is not None, f"{name}: group_type={group_type} needs a group_list")
        check(len(x) == 1, f"{name}: group_type={group_type} takes a single x, got {len(x)}")
        check(x[0].dim() == 2, f"{name}: group_type={group_type} needs a 2-D x, got {tuple(x[0].shape)}")
    if group_type == 0:
        n_groups = group_list.numel()
        check(len(weights) == n_groups, f"{name}: {len(weights)} weights for {n_groups} groups")
        _check_gmm_bias(bias, n_groups, single_weight, dtype)
        # The adapter sizes split_item 0/1 outputs as if group_list were cumulative, whatever its type.
        ends = _group_ends(group_list, group_list_type == 0 or split_item in (0, 1), x[0].shape[0], "M")
    if group_type == 2:
        check(split_item in (2, 3), f"{name}: group_type=2 needs split_item 2 or 3, got {split_item}")
        check(
            len(weight) == 1 and weight[0].dim() == 2,
            f"{name}: group_type=2 takes a single 2-D weight, got {[tuple(w.shape) for w in weight]}",
        )
        check(bias is None, f"{name}: When groupType is 2, bias must be empty.")
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


def _check_permute(tokens: Tensor, indices: Tensor, padded_mode: bool) -> int:
    name = "npu_moe_token_permute"
    unsupported(padded_mode, f"{name}: padded_mode=True is not modelled")
    check(tokens.dim() == 2 and tokens.dtype in FLOATS, f"{name}: tokens must be [T, H] fp16/bf16/fp32")
    check(
        indices.dtype in (torch.int32, torch.int64) and indices.dim() in (1, 2),
        f"{name}: indices must be int32/int64 [T] or [T, topK], got {indices.dtype} {tuple(indices.shape)}",
    )
    check(indices.shape[0] == tokens.shape[0], f"{name}: indices and tokens disagree on T")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    check(topk <= 512, f"{name}: topK={topk} must be <= 512")
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
    unsupported(padded_mode, "npu_moe_token_permute_grad_v2: padded_mode=True is not modelled")
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
    unsupported(padded_mode, "npu_moe_token_permute_grad: padded_mode=True is not modelled")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    return _permute_grad(grad_permuted_tokens, sorted_indices, tokens.shape[0], tokens.dtype, topk)


def _check_unpermute(
    permuted: Tensor, sorted_indices: Tensor, probs: Tensor | None, padded_mode: bool
) -> None:
    name = "npu_moe_token_unpermute"
    unsupported(padded_mode, f"{name}: padded_mode=True is not modelled")
    check(permuted.dim() == 2 and permuted.dtype in FLOATS, f"{name}: permuted_tokens must be [P, H] float")
    check(
        sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1,
        f"{name}: sorted_indices must be 1-D int32, got {sorted_indices.dtype} {tuple(sorted_indices.shape)}",
    )
    if probs is not None:
        # moe_token_unpermute_def.cpp: every (tokens, probs) pair of bf16/fp16/fp32.
        check(
            probs.dim() == 2 and probs.dtype in FLOATS and probs.numel() == sorted_indices.numel(),
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
    check(permuted is not None, "npu_moe_token_unpermute_grad: the probs gradient needs permuted_tokens")
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
    unsupported(padded_mode, "npu_moe_token_unpermute_grad_v2: padded_mode=True is not modelled")
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
    unsupported(padded_mode, "npu_moe_token_unpermute_grad: padded_mode=True is not modelled")
    return _unpermute_grad(
        grad_unpermuted_tokens,
        sorted_indices,
        permuted_tokens.shape[0],
        permuted_tokens.dtype,
        probs,
        permuted_tokens,
    )


# ----------------------------------------------------------------------------------------------------
# Fake (meta) kernels: output shapes and dtypes only, so that torch.compile and torch.export see the ops
# as opaque, as they see torch_npu's (op_plugin/meta/_meta_registrations.py). Outputs are contiguous, as
# the device allocates them.
# ----------------------------------------------------------------------------------------------------


def _fake_rms_norm(profile: Profile, input: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple:
    lead = input.shape[: input.dim() - gamma.dim()]
    return fake_like(input), fake_empty((*lead, *([1] * gamma.dim())), torch.float32, input)


def _fake_rms_norm_backward(
    profile: Profile, dy: Tensor, input: Tensor, gamma: Tensor, rstd: Tensor
) -> tuple:
    return fake_like(input), fake_empty(gamma.shape, torch.float32, gamma)


def _fake_swiglu(profile: Profile, input: Tensor, dim: int = -1) -> Tensor:
    shape = list(input.shape)
    shape[dim] //= 2
    return fake_empty(shape, input.dtype, input)


def _fake_swiglu_backward(profile: Profile, grad_output: Tensor, input: Tensor, dim: int = -1) -> Tensor:
    return fake_like(input)


def _fake_rotary_mul(profile: Profile, input: Tensor, r1: Tensor, r2: Tensor, *args: Any) -> Tensor:
    return fake_like(input)


def _fake_rotary_mul_backward(
    profile: Profile, grad: Tensor, input: Tensor, r1: Tensor, r2: Tensor, *args
) -> tuple:
    return (
        fake_like(input),
        fake_empty(r1.shape, input.dtype, input),
        fake_empty(r2.shape, input.dtype, input),
    )


def _fake_grouped_matmul(profile: Profile, x: Sequence[Tensor], weight: Sequence[Tensor], *args: Any) -> list:
    options = dict(zip(_GMM_OPTION_NAMES, args, strict=False))
    split_item = options.get("split_item") or 0
    group_type = options.get("group_type")
    group_list = options.get("group_list")
    dtype = options.get("output_dtype") or x[0].dtype
    n = weight[0].shape[-1]
    if group_type == 2:
        return [fake_empty((group_list.shape[0], x[0].shape[0], n), dtype, x[0])]
    if split_item in (2, 3):
        return [fake_empty((sum(t.shape[0] for t in x), n), dtype, x[0])]
    if group_type == -1 or group_list is None:
        weights = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
        return [fake_empty((*t.shape[:-1], w.shape[-1]), dtype, t) for t, w in zip(x, weights, strict=True)]
    ctx = torch.library.get_ctx()  # split_item 0/1: the rows of each group depend on group_list's values
    return [fake_empty((ctx.new_dynamic_size(), n), dtype, x[0]) for _ in range(group_list.shape[0])]


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


def _fake_permute(
    profile: Profile,
    tokens: Tensor,
    indices: Tensor,
    num_out_tokens: int | None = None,
    padded_mode: bool = False,
) -> tuple:
    total = indices.numel()
    rows = total if not num_out_tokens or num_out_tokens <= 0 else min(num_out_tokens, total)
    return fake_empty((rows, tokens.shape[1]), tokens.dtype, tokens), fake_empty(
        (total,), torch.int32, tokens
    )


def _fake_permute_grad_v2(
    profile: Profile,
    grad: Tensor,
    sorted_indices: Tensor,
    tokens_size_0: int,
    tokens_dtype,
    num_topk: int,
    *args,
) -> Tensor:
    return fake_empty((tokens_size_0, grad.shape[1]), tokens_dtype, grad)


def _fake_permute_grad(profile: Profile, tokens: Tensor, *args: Any) -> Tensor:
    return fake_like(tokens)


def _fake_unpermute(
    profile: Profile, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None, *args
) -> Tensor:
    topk = probs.shape[1] if probs is not None else 1
    return fake_empty(
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
    dprobs = fake_like(probs) if probs is not None else fake_empty((0,), dtype, grad)
    return fake_empty((size_0, grad.shape[1]), dtype, grad), dprobs


def _fake_unpermute_grad(
    profile: Profile,
    permuted_tokens: Tensor,
    grad: Tensor,
    sorted_indices: Tensor,
    probs: Tensor | None = None,
    *args,
) -> tuple:
    dprobs = fake_like(probs) if probs is not None else fake_empty((0,), permuted_tokens.dtype, grad)
    return fake_like(permuted_tokens), dprobs


def _fake_geglu(profile: Profile, input: Tensor, dim: int = -1, *args: Any) -> tuple[Tensor, Tensor]:
    shape = list(input.shape)
    shape[dim] //= 2
    return fake_empty(shape, input.dtype, input), fake_empty(shape, input.dtype, input)


def _fake_geglu_grad(profile: Profile, grad_output: Tensor, input: Tensor, *args: Any) -> Tensor:
    return fake_like(input)


def _fake_elementwise(profile: Profile, input: Tensor, *args: Any) -> Tensor:
    return fake_like(input)


def _fake_elementwise_backward(profile: Profile, grad: Tensor, input: Tensor, *args: Any) -> Tensor:
    return fake_empty(input.shape, torch.result_type(grad, input), input)


@dataclass(frozen=True)
class OpDef:
    """How the stand-in computes one op (checks and math) and what its fake kernel returns."""

    impl: Callable[..., Any]
    fake: Callable[..., Any]


OP_DEFS: dict[str, OpDef] = {
    "npu_rms_norm": OpDef(rms_norm, _fake_rms_norm),
    "npu_rms_norm_backward": OpDef(rms_norm_backward, _fake_rms_norm_backward),
    "npu_swiglu": OpDef(swiglu, _fake_swiglu),
    "npu_swiglu_backward": OpDef(swiglu_backward, _fake_swiglu_backward),
    "npu_gelu": OpDef(gelu, _fake_elementwise),
    "npu_gelu_backward": OpDef(gelu_backward, _fake_elementwise_backward),
    "npu_fast_gelu": OpDef(fast_gelu, _fake_elementwise),
    "npu_fast_gelu_backward": OpDef(fast_gelu_backward, _fake_elementwise_backward),
    "npu_geglu": OpDef(geglu, _fake_geglu),
    "npu_geglu_grad": OpDef(geglu_grad, _fake_geglu_grad),
    "npu_rotary_mul": OpDef(rotary_mul, _fake_rotary_mul),
    "npu_rotary_mul_backward": OpDef(rotary_mul_backward, _fake_rotary_mul_backward),
    "npu_grouped_matmul": OpDef(grouped_matmul, _fake_grouped_matmul),
    "npu_moe_token_permute": OpDef(token_permute, _fake_permute),
    "npu_moe_token_permute_grad": OpDef(token_permute_grad, _fake_permute_grad),
    "npu_moe_token_permute_grad_v2": OpDef(token_permute_grad_v2, _fake_permute_grad_v2),
    "npu_moe_token_unpermute": OpDef(token_unpermute, _fake_unpermute),
    "npu_moe_token_unpermute_grad": OpDef(token_unpermute_grad, _fake_unpermute_grad),
    "npu_moe_token_unpermute_grad_v2": OpDef(token_unpermute_grad_v2, _fake_unpermute_grad_v2),
}
