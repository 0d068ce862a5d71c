"""Rotary embedding on ``npu_rotary_mul``.

The standard "rotate half" form over the full head dim, q * cos + rotate_half(q) * sin, is
npu_rotary_mul in 'half' mode with cos/sin unsqueezed to broadcast over heads. The
replacement keeps the stock signature: 4.x has a position_ids parameter (ignored; Qwen2-MoE
passes it positionally), 5.x does not.
"""

import torch

from ._probe import agree, first_disagreement, generator, parameters, randn
from .base import Kernel, Variant

_SIGNATURES = (
    ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"),
    ("q", "k", "cos", "sin", "unsqueeze_dim"),
)


def _build_half(stock, npu):
    promote = torch.promote_types

    if "position_ids" in (parameters(stock) or ()):

        def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            cos = cos.unsqueeze(unsqueeze_dim)
            sin = sin.unsqueeze(unsqueeze_dim)
            if cos.dtype != q.dtype:  # stock promotes; npu_rotary_mul would cast cos down
                q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
            return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)

        return apply_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # the 5.x signature
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        if cos.dtype != q.dtype:
            q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
        return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)

    return apply_rotary_pos_emb


def rope_inputs(gen, rotary_dim, head_dim=8):
    """q [B, N, S, D], k with fewer heads, and HF-style cos/sin [B, S, rotary_dim]."""
    q = randn(gen, 1, 2, 3, head_dim)
    k = randn(gen, 1, 1, 3, head_dim)
    angles = randn(gen, 1, 3, rotary_dim // 2)
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos(), emb.sin()


def _probe_half(stock, candidate):
    params = parameters(stock)
    if params not in _SIGNATURES:
        return f"the signature {params} is not the standard apply_rotary_pos_emb signature"
    gen = generator()
    full = rope_inputs(gen, rotary_dim=8)
    partial = rope_inputs(gen, rotary_dim=4)  # stock variants that rotate only part of D
    return first_disagreement(
        agree(lambda: stock(*full), lambda: candidate(*full)),
        agree(lambda: stock(*partial), lambda: candidate(*partial)),
    )


ROPE = Kernel("rope", ("npu_rotary_mul",), (Variant("half", _build_half, _probe_half),))
