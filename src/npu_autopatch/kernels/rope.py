"""Rotary embedding on ``npu_rotary_mul``: out = x * cos + rotate(x) * sin, elementwise.

The variants, one per form of the stock code (the probe tells them apart):

- ``half``: the standard form over the full head dim, q * cos + rotate_half(q) * sin: 'half' mode.
- ``partial`` (Qwen3-Next, Qwen3.5, GLM-4-MoE): only the first ``cos.shape[-1]`` dims rotate,
  the rest passes through; the rotated part is the ``half`` form.
- ``interleave`` (GLM-4): partial, with cos/sin's first half repeated element-wise and an
  even/odd rotate_half: exactly 'interleave' mode.
- ``deinterleave`` (DeepSeek-V3 ``apply_rotary_pos_emb_interleave``, its default path): the
  pairs (x0, x1), (x2, x3) ... rotate together and come out de-interleaved (evens, then odds),
  i.e. the ``half`` form applied to the de-interleaved input. cos is HF's cat(freqs, freqs):
  4.57 multiplies by all of it, 5.x by its first half twice; the same for that cos.
- ``mrope`` (Qwen2.5-VL ``apply_multimodal_rotary_pos_emb``, up to 5.16): cos/sin [3, B, S, D]
  are mixed by ``mrope_section`` first, then it is the ``half`` form.
- ``vision`` (``apply_rotary_pos_emb_vision``): q/k [S, N, D] or [B, S, N, D] (muse_glimmer) and
  cos [S, D], computed in fp32 and cast back.

A form whose real calls this module would hand back to stock every time is refused, not accepted
as a no-op: an mRoPE or vision rotary that rotates only part of the head (4.57 Glm4vMoe,
minimax_m3_vl). Every probe also runs bf16 q/k with fp32 cos/sin, as a bf16 model passes them,
and compares the output dtype: the OLMo family casts back to q's dtype, which ``half`` does not.

The layouts. The device's kernel infers its layout from which dims of cos broadcast against x
(hicann/ops-transformer, rope_rotate_half_tiling.cpp ChooseTilingMode) and takes 4-D input only.
HF's own layout, q [B, N, S, D] with cos [B or 1, 1, S, D], is refused in two ways: the forward
refuses "BNSD" with a batch-1 cos when B*N is large against S (CheckBnsdBlockSkip: many short
sequences, small rotary dims), and the backward has no layout for a per-batch cos when B >= S
(rope_half_grad_tiling.cpp RopeHalfGradSelectLayout). So every variant hands the kernel one of
two layouts that both tables accept for every B, S, N and D:

- A: x [B, S, N, D] (q transposed, a view) with a batch-1 cos [1, S, 1, D] ("BSND" / "1S1D" in
  both tables; B = 1 and S = 1 fall into their no-broadcast and "SB1D" rows), used when cos has
  batch 1 and B*N < 1000 (the documented limits: B, N < 1000; B*N < 1000 in interleave mode;
  B*N <= 1024 when cos needs a gradient);
- B: batch and sequence flattened into one axis, x [1, B*S, N, D] with cos [1, B*S, 1, D]
  (forward: "r BS1D"; backward: "BSND/BS1D" with 1 < B*S, or "SBND/SB1D" when B*S = 1), for a
  per-batch cos (position_ids given: packed sequences, verl), for B*N >= 1000, for interleave
  mode with a per-batch cos (that mode takes batch-1 cos only), and for the vision tower.

A call the kernel cannot take even so (a head dim >= 896 or odd, not 4-D, empty, cos that does
not match q's sequence or head dim) runs the stock code for that call: a few integer
comparisons, measured in benchmarks/call_overhead.py. If the op still raises (a rule nobody
knew), the replacement reports it through ``on_error`` and returns the stock result.

A replacement keeps the stock signature: 4.x has a ``position_ids`` parameter (ignored; Qwen2-MoE
passes it positionally), 5.x does not; see ``_stock_signature``. Where stock promotes q/k to the
dtype of cos/sin, so does the replacement (npu_rotary_mul would cast cos/sin down to q's dtype).
"""

import functools

import torch

from .._types import Kernel, Pattern, Variant
from ._calls import counters
from ._probe import (
    BFLOAT16,
    MIXED_TOLERANCE,
    agree_strict,
    first_disagreement,
    generator,
    parameters,
    randn,
    signature_reason,
)
from ._requirements import rotary_mode_requirement

# The layouts, as ``verify`` reports them.
LAYOUTS = {
    "A": "q/k [B, S, N, D] (a transposed view), cos/sin [1, S, 1, D]: batch-1 cos and B*N < 1000",
    "B": "q/k [1, B*S, N, D], cos/sin [1, B*S, 1, D]: per-sample cos, B*N >= 1000, the vision tower",
    "stock": "head dim odd or >= 896, empty, not 4-D (vision: 3-D or 4-D), or cos not matching q: stock code",
}

_SIGNATURE_4X = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")
_SIGNATURE_5X = ("q", "k", "cos", "sin", "unsqueeze_dim")

# The head dim the kernels take: even and at most 896 (rope_rotate_half_tiling.cpp
# D_LENGTH_LIMIT, rope_half_grad_tiling.cpp D_THRESHOLD); interleave mode is documented as < 896.
_HEAD_DIM_LIMIT = 896
# Layout A's bound on B*N (the documented B, N < 1000 of half mode and B*N < 1000 of interleave
# mode); layout B has B = 1 and needs N < 1000.
_BATCH_HEADS_LIMIT = 1000


@functools.lru_cache(maxsize=256)  # a model calls with few shapes: formatting the reason costs more
def _why_stock(qs, cs, unsqueeze_dim, partial=False):
    """The rule that sent a call (q of shape ``qs``, cos/sin of shape ``cs``) to the stock code, for its
    count in status(): the checks of the builds below, in their order, named."""
    if len(qs) != 4 or len(cs) != 3:
        return f"q {len(qs)}-D, cos {len(cs)}-D (not 4-D / 3-D)"
    if not 0 < unsqueeze_dim < 3:
        return f"unsqueeze_dim {unsqueeze_dim}"
    if cs[1] != qs[3 - unsqueeze_dim]:
        return f"cos sequence {cs[1]} != q sequence {qs[3 - unsqueeze_dim]}"
    dim, name = cs[2], "rotary-dim" if partial else "head-dim"
    if dim > qs[3] or (not partial and dim != qs[3]):
        return f"cos dim {dim} != head dim {qs[3]}"
    if dim >= _HEAD_DIM_LIMIT:
        return f"{name} {dim} > {_HEAD_DIM_LIMIT - 1}"
    if dim & 1:
        return f"{name} {dim} odd"
    if cs[0] != 1 and cs[0] != qs[0]:
        return f"cos batch {cs[0]} != q batch {qs[0]}"
    return "empty input"


@functools.lru_cache(maxsize=256)
def _why_stock_vision(qs, cs):
    """``_why_stock`` of the vision form: q/k [S, N, D] or [B, S, N, D], cos/sin [S, D]."""
    if len(qs) not in (3, 4) or len(cs) != 2:
        return f"q {len(qs)}-D, cos {len(cs)}-D (not 3-D or 4-D / 2-D)"
    if cs[0] != qs[-3]:
        return f"cos sequence {cs[0]} != q sequence {qs[-3]}"
    if cs[1] != qs[-1]:
        return f"cos dim {cs[1]} != head dim {qs[-1]}"
    if qs[-1] >= _HEAD_DIM_LIMIT:
        return f"head-dim {qs[-1]} > {_HEAD_DIM_LIMIT - 1}"
    if qs[-1] & 1:
        return f"head-dim {qs[-1]} odd"
    if not qs[-3]:
        return "empty input"
    return f"batch x heads {(qs[0] if len(qs) == 4 else 1) * qs[-2]} >= {_BATCH_HEADS_LIMIT}"


def _stock_signature(replacement, takes_position_ids):
    """``replacement`` with the stock parameters: one definition serves 4.x and 5.x, with no wrapper.

    Each replacement is written once as ``(q, k, cos, sin, fifth=1, sixth=1)`` and reads its
    unsqueeze dim as ``sixth if takes_position_ids else fifth``. For 4.x its code gets the names
    ``(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)``; for 5.x five parameters
    ``(q, k, cos, sin, unsqueeze_dim=1)``, ``sixth`` becoming a local it never reads. Only names
    and the argument count change, not the bytecode, so keyword and positional calls bind as
    they do for the stock function.
    """
    code = replacement.__code__
    local_names = code.co_varnames[6:]
    if takes_position_ids:
        replacement.__code__ = code.replace(co_varnames=(*_SIGNATURE_4X, *local_names))
        replacement.__defaults__ = (None, 1)
    else:
        replacement.__code__ = code.replace(co_argcount=5, co_varnames=(*_SIGNATURE_5X, "_", *local_names))
        replacement.__defaults__ = (1,)
    return replacement


def _build_half(stock, npu, on_error):
    takes_position_ids = parameters(stock) == _SIGNATURE_4X
    promote = torch.promote_types
    count_fused, count_stock = counters(on_error)

    def apply_rotary_pos_emb(q, k, cos, sin, fifth=1, sixth=1):
        unsqueeze_dim = sixth if takes_position_ids else fifth
        qs, cs = q.shape, cos.shape
        if not (
            len(qs) == 4
            and len(cs) == 3
            and 0 < unsqueeze_dim < 3
            and cs[1] == qs[3 - unsqueeze_dim]
            and cs[2] == qs[3] < _HEAD_DIM_LIMIT
            and not qs[3] & 1
            and (cs[0] == 1 or cs[0] == qs[0])
            and qs[0] * cs[1]
        ):
            count_stock(lambda qs=qs, cs=cs, dim=unsqueeze_dim: _why_stock(qs, cs, dim), q)
            return stock(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        try:
            xq, xk = q, k
            if cos.dtype != q.dtype:  # stock promotes; npu_rotary_mul would cast cos down
                xq, xk = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
            if unsqueeze_dim == 1:
                xq, xk = xq.transpose(1, 2), xk.transpose(1, 2)  # [B, S, N, D]
            batch, seq, dim = qs[0], cs[1], cs[2]
            if cs[0] == 1 and batch * qs[unsqueeze_dim] < _BATCH_HEADS_LIMIT:  # layout A
                c, s = cos.unsqueeze(2), sin.unsqueeze(2)
                oq, ok = npu.npu_rotary_mul(xq, c, s), npu.npu_rotary_mul(xk, c, s)
            else:  # layout B
                tokens = batch * seq
                c = cos.expand(batch, seq, dim).reshape(1, tokens, 1, dim)
                s = sin.expand(batch, seq, dim).reshape(1, tokens, 1, dim)
                oq = npu.npu_rotary_mul(xq.reshape(1, tokens, -1, dim), c, s).view(batch, seq, -1, dim)
                ok = npu.npu_rotary_mul(xk.reshape(1, tokens, -1, dim), c, s).view(batch, seq, -1, dim)
            if unsqueeze_dim == 1:
                oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
        except Exception as exc:
            on_error(exc, q, k, cos, sin)
            return stock(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        count_fused()
        return oq, ok

    return _stock_signature(apply_rotary_pos_emb, takes_position_ids)


def _build_partial(stock, npu, on_error, mode="half"):
    takes_position_ids = parameters(stock) == _SIGNATURE_4X
    promote = torch.promote_types
    count_fused, count_stock = counters(on_error)
    cat = torch.cat
    interleave = mode == "interleave"

    def apply_rotary_pos_emb(q, k, cos, sin, fifth=1, sixth=1):
        unsqueeze_dim = sixth if takes_position_ids else fifth
        qs, cs = q.shape, cos.shape
        if not (
            len(qs) == 4
            and len(cs) == 3
            and 0 < unsqueeze_dim < 3
            and cs[1] == qs[3 - unsqueeze_dim]
            and cs[2] <= qs[3]
            and cs[2] < _HEAD_DIM_LIMIT
            and not cs[2] & 1
            and (cs[0] == 1 or cs[0] == qs[0])
            and qs[0] * cs[1] * cs[2]
        ):
            count_stock(lambda qs=qs, cs=cs, dim=unsqueeze_dim: _why_stock(qs, cs, dim, partial=True), q)
            return stock(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        try:
            c, s = cos, sin
            if interleave:  # GLM-4: the first half of cos, each angle repeated for its pair
                c = c[..., : cs[2] // 2].repeat_interleave(2, dim=-1)
                s = s[..., : cs[2] // 2].repeat_interleave(2, dim=-1)
            xq, xk = q, k
            if cos.dtype != q.dtype:
                xq, xk = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
            batch, seq, rot = qs[0], cs[1], cs[2]
            xq, xk = xq[..., :rot], xk[..., :rot]
            if unsqueeze_dim == 1:
                xq, xk = xq.transpose(1, 2), xk.transpose(1, 2)  # [B, S, N, R]
            if cs[0] == 1 and batch * qs[unsqueeze_dim] < _BATCH_HEADS_LIMIT:  # layout A
                c, s = c.unsqueeze(2), s.unsqueeze(2)
                oq, ok = npu.npu_rotary_mul(xq, c, s, mode), npu.npu_rotary_mul(xk, c, s, mode)
            else:  # layout B
                tokens = batch * seq
                c = c.expand(batch, seq, rot).reshape(1, tokens, 1, rot)
                s = s.expand(batch, seq, rot).reshape(1, tokens, 1, rot)
                oq = npu.npu_rotary_mul(xq.reshape(1, tokens, -1, rot), c, s, mode).view(batch, seq, -1, rot)
                ok = npu.npu_rotary_mul(xk.reshape(1, tokens, -1, rot), c, s, mode).view(batch, seq, -1, rot)
            if unsqueeze_dim == 1:
                oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
            oq = cat((oq, q[..., rot:].to(oq.dtype)), dim=-1)
            ok = cat((ok, k[..., rot:].to(ok.dtype)), dim=-1)
        except Exception as exc:
            on_error(exc, q, k, cos, sin)
            return stock(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        count_fused()
        return oq, ok

    return _stock_signature(apply_rotary_pos_emb, takes_position_ids)


def _build_interleave(stock, npu, on_error):
    return _build_partial(stock, npu, on_error, mode="interleave")


def _build_deinterleave(stock, npu, on_error):
    promote = torch.promote_types
    count_fused, count_stock = counters(on_error)

    def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        qs, cs = q.shape, cos.shape
        if not (
            len(qs) == 4
            and len(cs) == 3
            and 0 < unsqueeze_dim < 3
            and cs[1] == qs[3 - unsqueeze_dim]
            and cs[2] == qs[3] < _HEAD_DIM_LIMIT
            and not qs[3] & 1
            and (cs[0] == 1 or cs[0] == qs[0])
            and qs[0] * cs[1]
        ):
            count_stock(lambda: _why_stock(qs, cs, unsqueeze_dim), q)
            return stock(q, k, cos, sin, position_ids, unsqueeze_dim)
        try:
            xq, xk = q, k
            if cos.dtype != q.dtype:
                xq, xk = q.to(promote(q.dtype, cos.dtype)), k.to(promote(k.dtype, cos.dtype))
            if unsqueeze_dim == 1:
                xq, xk = xq.transpose(1, 2), xk.transpose(1, 2)  # [B, S, N, D]
            # The pairs (x0, x1), (x2, x3) ... de-interleaved: evens, then odds.
            xq = xq.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            xk = xk.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            batch, seq, dim = qs[0], cs[1], cs[2]
            if cs[0] == 1 and batch * qs[unsqueeze_dim] < _BATCH_HEADS_LIMIT:  # layout A
                c, s = cos.unsqueeze(2), sin.unsqueeze(2)
                oq, ok = npu.npu_rotary_mul(xq, c, s), npu.npu_rotary_mul(xk, c, s)
            else:  # layout B
                tokens = batch * seq
                c = cos.expand(batch, seq, dim).reshape(1, tokens, 1, dim)
                s = sin.expand(batch, seq, dim).reshape(1, tokens, 1, dim)
                oq = npu.npu_rotary_mul(xq.reshape(1, tokens, -1, dim), c, s).view(batch, seq, -1, dim)
                ok = npu.npu_rotary_mul(xk.reshape(1, tokens, -1, dim), c, s).view(batch, seq, -1, dim)
            if unsqueeze_dim == 1:
                oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
        except Exception as exc:
            on_error(exc, q, k, cos, sin)
            return stock(q, k, cos, sin, position_ids, unsqueeze_dim)
        count_fused()
        return oq, ok

    return apply_rotary_pos_emb_interleave


def _build_mrope(stock, npu, on_error):
    promote = torch.promote_types
    count_fused, count_stock = counters(on_error)
    cat = torch.cat

    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        # Section i of the head dim takes its angles from axis i % 3 (temporal, height, width).
        sections = mrope_section * 2
        c = cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
        s = cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
        qs, cs = q.shape, c.shape
        if not (
            len(qs) == 4
            and len(cs) == 3
            and 0 < unsqueeze_dim < 3
            and cs[1] == qs[3 - unsqueeze_dim]
            and cs[2] == qs[3] < _HEAD_DIM_LIMIT
            and not qs[3] & 1
            and (cs[0] == 1 or cs[0] == qs[0])
            and qs[0] * cs[1]
        ):
            count_stock(lambda: _why_stock(qs, cs, unsqueeze_dim), q)
            return stock(q, k, cos, sin, mrope_section, unsqueeze_dim)
        try:
            xq, xk = q, k
            if c.dtype != q.dtype:
                xq, xk = q.to(promote(q.dtype, c.dtype)), k.to(promote(k.dtype, c.dtype))
            if unsqueeze_dim == 1:
                xq, xk = xq.transpose(1, 2), xk.transpose(1, 2)  # [B, S, N, D]
            batch, seq, dim = qs[0], cs[1], cs[2]
            if cs[0] == 1 and batch * qs[unsqueeze_dim] < _BATCH_HEADS_LIMIT:  # layout A
                c, s = c.unsqueeze(2), s.unsqueeze(2)
                oq, ok = npu.npu_rotary_mul(xq, c, s), npu.npu_rotary_mul(xk, c, s)
            else:  # layout B: 3-D positions give every sample its own angles
                tokens = batch * seq
                c = c.expand(batch, seq, dim).reshape(1, tokens, 1, dim)
                s = s.expand(batch, seq, dim).reshape(1, tokens, 1, dim)
                oq = npu.npu_rotary_mul(xq.reshape(1, tokens, -1, dim), c, s).view(batch, seq, -1, dim)
                ok = npu.npu_rotary_mul(xk.reshape(1, tokens, -1, dim), c, s).view(batch, seq, -1, dim)
            if unsqueeze_dim == 1:
                oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
        except Exception as exc:
            on_error(exc, q, k, cos, sin)
            return stock(q, k, cos, sin, mrope_section, unsqueeze_dim)
        count_fused()
        return oq, ok

    return apply_multimodal_rotary_pos_emb


def _build_vision(stock, npu, on_error):
    float32 = torch.float32
    count_fused, count_stock = counters(on_error)

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        qs, cs = q.shape, cos.shape
        # q/k [S, N, D] (one image sequence) or [B, S, N, D] (muse_glimmer), cos/sin [S, D].
        batched = len(qs) == 4
        if not (
            (batched or len(qs) == 3)
            and len(cs) == 2
            and cs[0] == qs[-3]
            and cs[1] == qs[-1] < _HEAD_DIM_LIMIT
            and not qs[-1] & 1
            and qs[-3]
            and (qs[0] if batched else 1) * qs[-2] < _BATCH_HEADS_LIMIT
        ):
            count_stock(lambda: _why_stock_vision(qs, cs), q)
            return stock(q, k, cos, sin)
        try:
            # Layout A: q/k [B, S, N, D] (B = 1 for 3-D q), cos [1, S, 1, D]; in fp32, as stock computes.
            c, s = cos[None, :, None, :].to(float32), sin[None, :, None, :].to(float32)
            xq, xk = (q, k) if batched else (q.unsqueeze(0), k.unsqueeze(0))
            oq = npu.npu_rotary_mul(xq.to(float32), c, s).to(q.dtype)
            ok = npu.npu_rotary_mul(xk.to(float32), c, s).to(k.dtype)
        except Exception as exc:
            on_error(exc, q, k, cos, sin)
            return stock(q, k, cos, sin)
        count_fused()
        return (oq, ok) if batched else (oq[0], ok[0])

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


def _batch_one(q, k, cos, sin):
    """The same inputs with HF's default batch-1 cos/sin (position_ids not given)."""
    return q, k, cos[:1], sin[:1]


def _bsnd(q, k, cos, sin):
    """The same inputs laid out [B, S, N, D], for ``unsqueeze_dim=2``."""
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def _mixed(q, k, cos, sin, *rest):
    """The same inputs as transformers passes them in a bf16 model: bf16 q/k, fp32 cos/sin."""
    return (q.to(BFLOAT16), k.to(BFLOAT16), cos, sin, *rest)


def _compare(stock, candidate, inputs, **kwargs):
    return agree_strict(lambda: stock(*inputs, **kwargs), lambda: candidate(*inputs, **kwargs))


def _compare_mixed(stock, candidate, inputs, **kwargs):
    """bf16 q/k with fp32 cos/sin: the kernel must return stock's dtype (OLMo casts back to q's)."""
    mixed = _mixed(*inputs)
    return agree_strict(
        lambda: stock(*mixed, **kwargs), lambda: candidate(*mixed, **kwargs), **MIXED_TOLERANCE
    )


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
        _compare(stock, candidate, full),
        _compare(stock, candidate, _batch_one(*full)),
        _compare(stock, candidate, _bsnd(*full), unsqueeze_dim=2),
        _compare_mixed(stock, candidate, full),
    )


def _probe_partial(stock, candidate):
    """Partial rotary (GLM-4-MoE, Qwen3-Next) on partial cos/sin, then at full width; a stock that
    takes full-width cos/sin only (an interleaved rotary without pass-through) at full width."""
    mismatch = signature_reason(stock, _SIGNATURE_4X, _SIGNATURE_5X)
    if mismatch:
        return mismatch
    gen = generator()
    full, partial = rope_inputs(gen, rotary_dim=8), rope_inputs(gen, rotary_dim=4)
    inputs = partial if _rotates_part(stock, partial) else full
    return first_disagreement(
        _compare(stock, candidate, inputs),
        _compare(stock, candidate, _batch_one(*inputs)),
        _compare(stock, candidate, _bsnd(*inputs), unsqueeze_dim=2),
        _compare(stock, candidate, full),
        _compare_mixed(stock, candidate, inputs),
    )


def _probe_deinterleave(stock, candidate):
    mismatch = signature_reason(stock, _SIGNATURE_4X)
    if mismatch:
        return mismatch
    gen = generator()
    inputs = rope_inputs(gen, rotary_dim=8)
    return first_disagreement(
        _compare(stock, candidate, inputs),
        _compare(stock, candidate, _batch_one(*inputs)),
        _compare_mixed(stock, candidate, inputs),
    )


def _probe_mrope(stock, candidate):
    mismatch = signature_reason(stock, ("q", "k", "cos", "sin", "mrope_section", "unsqueeze_dim"))
    if mismatch:
        return mismatch
    gen = generator()
    q, k, _, _ = rope_inputs(gen, rotary_dim=8)
    cos, sin = _angles(gen, 3, 2, 3, 8)  # one set of angles per axis: temporal, height, width
    wide_q, wide_k, _, _ = rope_inputs(gen, rotary_dim=8, head_dim=16)
    if _rotates_part(stock, (wide_q, wide_k, cos, sin, [1, 1, 2])):
        # 4.57 Glm4vMoe: the real calls rotate part of the head, which this variant leaves to stock.
        return "stock rotates only the first cos.shape[-1] dims of the head (partial mRoPE)"
    inputs = (q, k, cos, sin, [1, 1, 2])
    return first_disagreement(_compare(stock, candidate, inputs), _compare_mixed(stock, candidate, inputs))


def _probe_vision(stock, candidate):
    mismatch = signature_reason(stock, ("q", "k", "cos", "sin"))
    if mismatch:
        return mismatch
    gen = generator()
    q, k = randn(gen, 3, 2, 8), randn(gen, 3, 2, 8)  # [S, N, D]
    cos, sin = _angles(gen, 3, 8)
    if _rotates_part(stock, (q, k, cos[:, :4], sin[:, :4])):
        # minimax_m3_vl: the real calls rotate part of the head, which this variant leaves to stock.
        return "stock rotates only the first cos.shape[-1] dims of the head (partial rotary)"
    batched = (randn(gen, 2, 3, 2, 8), randn(gen, 2, 3, 2, 8), cos, sin)
    return first_disagreement(
        _compare(stock, candidate, (q, k, cos, sin)),
        _compare(stock, candidate, batched),  # muse_glimmer: q/k [B, S, N, D]
        _compare_mixed(stock, candidate, (q, k, cos, sin)),
    )


ROPE = Kernel(
    "rope",
    ("npu_rotary_mul",),
    (
        Variant("half", _build_half, _probe_half),
        Variant("partial", _build_partial, _probe_partial),
        Variant("interleave", _build_interleave, _probe_partial, requires=rotary_mode_requirement),
        Variant("deinterleave", _build_deinterleave, _probe_deinterleave),
        Variant("mrope", _build_mrope, _probe_mrope),
        Variant("vision", _build_vision, _probe_vision),
    ),
    candidates=(Pattern("rope", functions=r"^apply_\w*rotary"),),
)
