"""Rotary embedding on ``npu_rotary_mul``: out = x * cos + rotate(x) * sin, elementwise.

The variants, one per form of the stock code (the probe tells them apart):

- ``half``: the standard form over the full head dim, q * cos + rotate_half(q) * sin: 'half'
  mode with cos/sin unsqueezed to broadcast over heads.
- ``partial`` (Qwen3-Next, Qwen3.5, GLM-4-MoE): only the first ``cos.shape[-1]`` dims rotate,
  the rest passes through; the rotated part is the ``half`` form.
- ``interleave`` (GLM-4): partial, with cos/sin's first half repeated element-wise and an
  even/odd rotate_half: exactly 'interleave' mode. That mode takes cos as [T, 1, D] only (for a
  4-D input, [1, 1, S, D], i.e. batch 1), so batch and sequence are flattened into T.
- ``deinterleave`` (DeepSeek-V3 ``apply_rotary_pos_emb_interleave``, its default path): the
  pairs (x0, x1), (x2, x3) ... rotate together and come out de-interleaved (evens, then odds),
  i.e. the ``half`` form applied to the de-interleaved input. cos is HF's cat(freqs, freqs):
  4.57 multiplies by all of it, 5.x by its first half twice; the same for that cos.
- ``mrope`` (Qwen2.5-VL ``apply_multimodal_rotary_pos_emb``, up to 5.16): cos/sin [3, B, S, D]
  are mixed by ``mrope_section`` first, then it is the ``half`` form.
- ``vision`` (``apply_rotary_pos_emb_vision``): q/k [S, N, D] and cos [S, D], computed in fp32
  and cast back: 'half' mode on a 3-D input with cos [S, 1, D].

A replacement keeps the stock signature: 4.x has a ``position_ids`` parameter (ignored;
Qwen2-MoE passes it positionally), 5.x does not. Where stock promotes q/k to the dtype of
cos/sin, so does the replacement (npu_rotary_mul would cast cos/sin down to q's dtype).
"""

import torch

from .._types import Kernel, Variant
from ._probe import agree_strict, first_disagreement, generator, parameters, randn, signature_reason

# A replacement keeps the stock signature, because callers pass the fifth argument
# positionally (4.x Qwen2-MoE passes position_ids). Each builder therefore writes its body
# once per signature: sharing one body through a helper would add a Python frame to every
# rotary call, which the hot path must not have.
_SIGNATURE_4X = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")
_SIGNATURE_5X = ("q", "k", "cos", "sin", "unsqueeze_dim")


def _build_half(stock, npu, on_error):
    promote = torch.promote_types

    if parameters(stock) == _SIGNATURE_4X:

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


def _build_partial(stock, npu, on_error):
    promote = torch.promote_types
    cat = torch.cat

    if parameters(stock) == _SIGNATURE_4X:

        def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            cos = cos.unsqueeze(unsqueeze_dim)
            sin = sin.unsqueeze(unsqueeze_dim)
            if cos.dtype != q.dtype:
                q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
            rotary_dim = cos.shape[-1]
            q_embed = npu.npu_rotary_mul(q[..., :rotary_dim], cos, sin)
            k_embed = npu.npu_rotary_mul(k[..., :rotary_dim], cos, sin)
            return cat((q_embed, q[..., rotary_dim:]), dim=-1), cat((k_embed, k[..., rotary_dim:]), dim=-1)

        return apply_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        if cos.dtype != q.dtype:
            q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
        rotary_dim = cos.shape[-1]
        q_embed = npu.npu_rotary_mul(q[..., :rotary_dim], cos, sin)
        k_embed = npu.npu_rotary_mul(k[..., :rotary_dim], cos, sin)
        return cat((q_embed, q[..., rotary_dim:]), dim=-1), cat((k_embed, k[..., rotary_dim:]), dim=-1)

    return apply_rotary_pos_emb


def _build_interleave(stock, npu, on_error):
    promote = torch.promote_types
    cat = torch.cat

    if parameters(stock) == _SIGNATURE_4X:

        def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            # [..., S, 1, R] after moving the heads axis last but one; then flattened to T.
            cos = cos.unsqueeze(unsqueeze_dim).movedim(unsqueeze_dim, -2)
            sin = sin.unsqueeze(unsqueeze_dim).movedim(unsqueeze_dim, -2)
            cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
            if cos.dtype != q.dtype:
                q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
            rotary_dim = cos.shape[-1]
            q_rot = q[..., :rotary_dim].movedim(unsqueeze_dim, -2)
            k_rot = k[..., :rotary_dim].movedim(unsqueeze_dim, -2)
            lead = q_rot.shape[:-2]
            cos = cos.expand(*lead, 1, rotary_dim).reshape(-1, 1, rotary_dim)
            sin = sin.expand(*lead, 1, rotary_dim).reshape(-1, 1, rotary_dim)
            q_embed = npu.npu_rotary_mul(q_rot.reshape(-1, *q_rot.shape[-2:]), cos, sin, "interleave")
            k_embed = npu.npu_rotary_mul(k_rot.reshape(-1, *k_rot.shape[-2:]), cos, sin, "interleave")
            q_embed = q_embed.view(q_rot.shape).movedim(-2, unsqueeze_dim)
            k_embed = k_embed.view(k_rot.shape).movedim(-2, unsqueeze_dim)
            return cat((q_embed, q[..., rotary_dim:]), dim=-1), cat((k_embed, k[..., rotary_dim:]), dim=-1)

        return apply_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim).movedim(unsqueeze_dim, -2)
        sin = sin.unsqueeze(unsqueeze_dim).movedim(unsqueeze_dim, -2)
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        if cos.dtype != q.dtype:
            q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
        rotary_dim = cos.shape[-1]
        q_rot = q[..., :rotary_dim].movedim(unsqueeze_dim, -2)
        k_rot = k[..., :rotary_dim].movedim(unsqueeze_dim, -2)
        lead = q_rot.shape[:-2]
        cos = cos.expand(*lead, 1, rotary_dim).reshape(-1, 1, rotary_dim)
        sin = sin.expand(*lead, 1, rotary_dim).reshape(-1, 1, rotary_dim)
        q_embed = npu.npu_rotary_mul(q_rot.reshape(-1, *q_rot.shape[-2:]), cos, sin, "interleave")
        k_embed = npu.npu_rotary_mul(k_rot.reshape(-1, *k_rot.shape[-2:]), cos, sin, "interleave")
        q_embed = q_embed.view(q_rot.shape).movedim(-2, unsqueeze_dim)
        k_embed = k_embed.view(k_rot.shape).movedim(-2, unsqueeze_dim)
        return cat((q_embed, q[..., rotary_dim:]), dim=-1), cat((k_embed, k[..., rotary_dim:]), dim=-1)

    return apply_rotary_pos_emb


def _build_deinterleave(stock, npu, on_error):
    promote = torch.promote_types

    def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        if cos.dtype != q.dtype:
            q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
        q = q.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # evens, then odds
        k = k.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)

    return apply_rotary_pos_emb_interleave


def _build_mrope(stock, npu, on_error):
    promote = torch.promote_types
    cat = torch.cat

    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        # Section i of the head dim takes its angles from axis i % 3 (temporal, height, width).
        mrope_section = mrope_section * 2
        cos = cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1)
        sin = cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1)
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        if cos.dtype != q.dtype:
            q, k = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
        return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)

    return apply_multimodal_rotary_pos_emb


def _build_vision(stock, npu, on_error):
    float32 = torch.float32

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        cos = cos.unsqueeze(-2).to(float32)  # [S, 1, D] for q/k [S, N, D]
        sin = sin.unsqueeze(-2).to(float32)
        q_embed = npu.npu_rotary_mul(q.to(float32), cos, sin).to(q.dtype)
        k_embed = npu.npu_rotary_mul(k.to(float32), cos, sin).to(k.dtype)
        return q_embed, k_embed

    return apply_rotary_pos_emb_vision


def _angles(gen, *shape):
    """HF-style cos/sin: the angles of each frequency repeated in both halves of the last dim."""
    angles = randn(gen, *shape[:-1], shape[-1] // 2)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rope_inputs(gen, rotary_dim, head_dim=8):
    """q [B, N, S, D], k with fewer heads, and HF-style cos/sin [B, S, rotary_dim]."""
    q = randn(gen, 2, 2, 3, head_dim)
    k = randn(gen, 2, 1, 3, head_dim)
    return (q, k, *_angles(gen, 2, 3, rotary_dim))


def _bsnd(q, k, cos, sin):
    """The same inputs laid out [B, S, N, D], for ``unsqueeze_dim=2``."""
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def _compare(stock, candidate, inputs, **kwargs):
    return agree_strict(lambda: stock(*inputs, **kwargs), lambda: candidate(*inputs, **kwargs))


def _rotates_part(stock, inputs):
    """Whether stock takes cos/sin narrower than the head dim, i.e. it is a partial rotary."""
    try:
        with torch.no_grad():
            stock(*inputs)
    except Exception:
        return False
    return True


def _probe_half(stock, candidate):
    mismatch = signature_reason(stock, _SIGNATURE_4X, _SIGNATURE_5X)
    if mismatch:
        return mismatch
    gen = generator()
    full, partial = rope_inputs(gen, rotary_dim=8), rope_inputs(gen, rotary_dim=4)
    if _rotates_part(stock, partial):
        return "stock rotates only the first cos.shape[-1] dims of the head (partial rotary)"
    return first_disagreement(
        _compare(stock, candidate, full), _compare(stock, candidate, _bsnd(*full), unsqueeze_dim=2)
    )


def _probe_partial(stock, candidate):
    mismatch = signature_reason(stock, _SIGNATURE_4X, _SIGNATURE_5X)
    if mismatch:
        return mismatch
    gen = generator()
    full, partial = rope_inputs(gen, rotary_dim=8), rope_inputs(gen, rotary_dim=4)
    return first_disagreement(
        _compare(stock, candidate, partial),
        _compare(stock, candidate, _bsnd(*partial), unsqueeze_dim=2),
        _compare(stock, candidate, full),
    )


def _probe_deinterleave(stock, candidate):
    mismatch = signature_reason(stock, _SIGNATURE_4X)
    if mismatch:
        return mismatch
    gen = generator()
    return _compare(stock, candidate, rope_inputs(gen, rotary_dim=8))


def _probe_mrope(stock, candidate):
    mismatch = signature_reason(stock, ("q", "k", "cos", "sin", "mrope_section", "unsqueeze_dim"))
    if mismatch:
        return mismatch
    gen = generator()
    q, k, _, _ = rope_inputs(gen, rotary_dim=8)
    cos, sin = _angles(gen, 3, 2, 3, 8)  # one set of angles per axis: temporal, height, width
    return _compare(stock, candidate, (q, k, cos, sin, [1, 1, 2]))


def _probe_vision(stock, candidate):
    mismatch = signature_reason(stock, ("q", "k", "cos", "sin"))
    if mismatch:
        return mismatch
    gen = generator()
    q, k = randn(gen, 3, 2, 8), randn(gen, 3, 2, 8)  # [S, N, D]
    return _compare(stock, candidate, (q, k, *_angles(gen, 3, 8)))


ROPE = Kernel(
    "rope",
    ("npu_rotary_mul",),
    (
        Variant("half", _build_half, _probe_half),
        Variant("partial", _build_partial, _probe_partial),
        Variant("interleave", _build_interleave, _probe_partial),
        Variant("deinterleave", _build_deinterleave, _probe_deinterleave),
        Variant("mrope", _build_mrope, _probe_mrope),
        Variant("vision", _build_vision, _probe_vision),
    ),
)
