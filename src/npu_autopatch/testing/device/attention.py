"""npu_fusion_attention and its grad: the op the attention kernel (kernels/attention/) calls.

transformers' NPU flash-attention integration (``integrations/npu_flash_attention.py``) calls
``torch_npu.npu_fusion_attention`` when a model runs ``attn_implementation="flash_attention_2"`` on an
NPU, so the stand-in has it today (tests/test_stand_in_attention.py runs HF's FA2 path through it).
The rules are those of op-plugin's ``FlashAttentionKernelNpuOpApi.cpp`` and its docs (§6.1 of
``torch_npu_ops.md``), and hicann/ops-transformer's flash-attention tiling; each names its source.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import work
from .common import FLOATS, check, fake_empty, fake_like, unsupported
from .ops import OpDef
from .profiles import Profile

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
    check(
        bool(qlen) and bool(kvlen) and len(qlen) == len(kvlen),
        f"{name}: the size of actual_seq_qlen and actual_seq_kvlen must be the same and cannot be empty.",
    )
    ends = [(int(q), int(kv)) for q, kv in zip(qlen, kvlen, strict=True)]
    while ends and ends[-1] == (0, 0):
        ends.pop()
    segments, q0, kv0 = [], 0, 0
    for q1, kv1 in ends:
        check(
            q1 >= q0 and kv1 >= kv0,
            f"{name}: actual_seq_qlen {list(qlen)} and actual_seq_kvlen {list(kvlen)} must be cumulative "
            "(non-decreasing) end offsets",
        )
        segments.append((q0, q1, kv0, kv1))
        q0, kv0 = q1, kv1
    check(q0 <= tq and kv0 <= tkv, f"{name}: actual_seq lists end at {q0}/{kv0}, past T = {tq}/{tkv}")
    unsupported(q0 < tq or kv0 < tkv, f"{name}: tokens past the last actual_seq offset (undefined)")
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
        check(t.dim() == rank, f"{name}: layout {layout} needs a {rank}-D {label}, got {tuple(t.shape)}")
    check(q.dtype in FLOATS, f"{name}: unsupported dtype {q.dtype}")
    check(
        k.dtype == q.dtype and v.dtype == q.dtype,
        f"{name}: query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}",
    )
    check(
        k.shape[:-1] == v.shape[:-1],
        f"{name}: key {tuple(k.shape)} and value {tuple(v.shape)} must match outside the last dim",
    )
    check(1 <= head_num <= 256, f"{name}: head_num={head_num} must be in 1..256")
    if layout in ("BSH", "SBH"):
        hq, hk, hv = q.shape[-1], k.shape[-1], v.shape[-1]
        check(
            hq > 0 and hq % head_num == 0, f"{name}: query hidden size {hq} is not head_num={head_num} heads"
        )
        d = hq // head_num
        kv_heads = hk // d
        check(
            kv_heads > 0 and hk == kv_heads * d and hv % kv_heads == 0,
            f"{name}: key/value hidden sizes {hk}/{hv} are not whole heads of D={d}",
        )
        heads, dv = head_num, hv // kv_heads
        batch_dim, seq_dim = (0, 1) if layout == "BSH" else (1, 0)
    else:
        heads_dim, seq_dim, batch_dim = {"BSND": (2, 1, 0), "BNSD": (1, 2, 0), "TND": (1, 0, 0)}[layout]
        heads, kv_heads, d, dv = q.shape[heads_dim], k.shape[heads_dim], q.shape[-1], v.shape[-1]
        check(heads == head_num, f"{name}: query has {heads} heads but head_num={head_num}")
        check(k.shape[-1] == d, f"{name}: query and key head dims differ ({d} vs {k.shape[-1]})")
    check(1 <= d <= 768, f"{name}: head dim D={d} must be in 1..768")
    check(1 <= dv <= d, f"{name}: value head dim {dv} must be in 1..D={d}")
    check(
        kv_heads > 0 and heads % kv_heads == 0,
        f"{name}: {heads} query heads are not a multiple of {kv_heads} key/value heads",
    )
    q_len, kv_len = q.shape[seq_dim], k.shape[seq_dim]
    check(q_len > 0 and kv_len > 0, f"{name}: empty sequences are not supported")
    if layout == "TND":
        segments = _fa_segments(name, qlen, kvlen, q_len, kv_len)
        return _FaGeometry(layout, 1, heads, kv_heads, q_len, kv_len, dv, segments)
    unsupported(
        qlen is not None or kvlen is not None,
        f"{name}: actual_seq_qlen/actual_seq_kvlen with layout {layout}",
    )
    batch = q.shape[batch_dim]
    check(
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
    check(0 < keep_prob <= 1, f"{name}: The keep_prob value must be in range of (0, 1], but got {keep_prob}")
    unsupported(
        keep_prob != 1, f"{name}: dropout (keep_prob={keep_prob}) needs the device's Philox generator"
    )
    check(
        sparse_mode in ((0, 1, 2, 3, 4, 6, 7, 8) if tnd else range(7)),
        f"{name}: The sparse_mode value must be in range of {'[0,5) or (5,8]' if tnd else '[0,6]'}, but got "
        f"{sparse_mode}",
    )
    unsupported(sparse_mode >= 5, f"{name}: sparse_mode {sparse_mode} (prefix and outer-split modes)")
    given = sorted(k for k, value in unmodelled.items() if value is not None)
    unsupported(bool(given), f"{name}: {', '.join(given)}")
    # inner_precise only changes how fully masked rows are computed; they give 0 here whatever its value.
    unsupported(inner_precise not in (0, 1, 2), f"{name}: inner_precise={inner_precise}")
    unsupported(
        softmax_layout not in ("", "TND") or (softmax_layout == "TND" and not tnd),
        f"{name}: softmax_layout={softmax_layout!r} with layout {geo.layout}",
    )
    if pse is not None:
        check(pse.dtype == dtype, f"{name}: pse dtype {pse.dtype} must equal the query's {dtype}")
        unsupported(tnd, f"{name}: pse with the TND layout")
        b, n, sq, skv = geo.batch, geo.heads, geo.q_len, geo.kv_len
        unsupported(
            tuple(pse.shape) not in {(b, n, sq, skv), (b, n, 1, skv), (1, n, sq, skv)},
            f"{name}: pse shape {tuple(pse.shape)}; modelled: [B,N,Sq,Skv], [B,N,1,Skv], [1,N,Sq,Skv]",
        )
    if mask is None:
        return
    check(
        mask.dtype in (torch.bool, torch.uint8), f"{name}: atten_mask must be bool or uint8, got {mask.dtype}"
    )
    if sparse_mode >= 2:
        check(
            tuple(mask.shape) == (_FA_COMPRESSED, _FA_COMPRESSED),
            f"{name}: sparse_mode {sparse_mode} takes the 2048x2048 compressed mask, got {tuple(mask.shape)}",
        )
        # The kernel reads tiles of the compressed mask; any other content is not modelled.
        unsupported(
            not torch.equal(mask.bool(), _fa_compressed_mask()),
            f"{name}: a compressed mask other than triu(ones(2048, 2048), 1)",
        )
        lengths = [(q1 - q0, kv1 - kv0) for q0, q1, kv0, kv1 in geo.segments or ()]
        check(
            sparse_mode != 3 or all(sq <= skv for sq, skv in lengths or [(geo.q_len, geo.kv_len)]),
            f"{name}: sparse_mode=3 requires Sq <= Skv in every batch",
        )
        return
    unsupported(tnd, f"{name}: a full atten_mask (sparse_mode {sparse_mode}) in the TND layout")
    b, n, sq, skv = geo.batch, geo.heads, geo.q_len, geo.kv_len
    # The CANN tiling accepts these four and nothing else, no broadcasting (hicann/ops-transformer
    # attention/flash_attention_score/op_host/flash_attention_score_tiling_general.cpp, lines 1508-1560 at
    # c29bc10: "get unsupported atten_mask shape"); op-plugin's adapter passes the mask on unchecked.
    check(
        tuple(mask.shape) in {(sq, skv), (b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv)},
        f"{name}: get unsupported atten_mask shape {tuple(mask.shape)}: it must be BNSS, B1SS, 11SS or SS "
        f"for B={b}, N={n}, Sq={sq}, Skv={skv}",
    )


def _fa_check_sink(name: str, sink: Tensor | None, heads: int) -> None:
    """``sink``: float32 of shape [head_num] (op doc, torch_npu-npu_fusion_attention.md). Only profiles whose
    schema has it get here with one (op-plugin 7.3.0 onwards); older ones refuse the keyword."""
    if sink is not None:
        check(
            sink.dtype == torch.float32 and tuple(sink.shape) == (heads,),
            f"{name}: sink must be float32 [head_num={heads}], got {sink.dtype} {tuple(sink.shape)}",
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
    check(
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


def _fa_sink(sink: Tensor) -> Tensor:
    """The sink logit per head, broadcastable to the [B, N, Sq] row statistics."""
    return sink.float().view(1, -1, 1)


def _fa_forward(
    geo: _FaGeometry,
    keep: Tensor | None,
    scale: float,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pse: Tensor | None,
    sink: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B,N,Sq,Dv], row max, row sum of exp(s - max)), all fp32.

    A fully masked row gives out 0 (flash-attn semantics; the device's result there is UNKNOWN without
    inner_precise=2), max -inf and sum 0. With ``sink`` each row has one more, unscaled logit whose column is
    dropped (the op doc's reference: ``softmax(cat([scale*QK^T, sink]))[..., :-1] @ V``); the statistics then
    take it in, as CANN's aclnnFlashAttentionScoreV3/V4 docs define them (hicann/ops-transformer,
    attention/flash_attention_score/docs): max = max(sink, max(S)), sum = sum(exp(S - max)) + exp(sink - max).
    """
    s = _fa_scores(_fa_heads(q, geo, geo.heads), _fa_kv(k, geo), pse, scale, keep)
    row_max = s.amax(-1) if sink is None else torch.maximum(s.amax(-1), _fa_sink(sink))
    e = torch.exp(s - torch.where(row_max.isneginf(), 0.0, row_max).unsqueeze(-1))
    row_sum = e.sum(-1) if sink is None else e.sum(-1) + torch.exp(_fa_sink(sink) - row_max)
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
    check(
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
    sink: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Flash-attention backward from the saved statistics, as the kernel computes it: P is rebuilt from
    softmax_max/softmax_sum and rowsum(dy * out) comes from attention_in, not from a recomputation.

    The sink's gradient: its probability p_sink = exp(sink - max) / sum takes part in every row's
    normalisation, so d loss / d sink[h] = -sum over batches and rows of p_sink * rowsum(dy * out), fp32 [N]
    (the grad op returns dsink shaped and typed as sink: FlashAttentionKernelNpuOpApi.cpp)."""
    q, k, v, pse = tensors
    qf, kf, vf = _fa_heads(q, geo, geo.heads), _fa_kv(k, geo), _fa_kv(v, geo)
    live = (row_sum > 0).unsqueeze(-1)  # fully masked rows have sum 0 and P = 0
    s = _fa_scores(qf, kf, pse, scale, keep)
    p = torch.where(
        live, torch.exp(s - row_max.unsqueeze(-1)) / torch.where(live, row_sum.unsqueeze(-1), 1.0), 0.0
    )
    dyf, outf = _fa_heads(dy, geo, geo.heads), _fa_heads(out, geo, geo.heads)
    dp = dyf @ vf.transpose(-1, -2)
    row_dot = (dyf * outf).sum(-1)
    ds = p * (dp - row_dot.unsqueeze(-1)) * scale  # gradient w.r.t. q @ k^T + pse
    dq = _fa_to_layout(ds @ kf, geo, q.dtype)
    dk = _fa_kv_grad(ds.transpose(-1, -2) @ qf, geo, k.dtype)
    dv = _fa_kv_grad(p.transpose(-1, -2) @ dyf, geo, v.dtype)
    dpse = None if pse is None else ds.sum_to_size(pse.shape).to(pse.dtype)
    if sink is None:
        return dq, dk, dv, dpse, None
    p_sink = torch.where(live.squeeze(-1), torch.exp(_fa_sink(sink) - row_max) / row_sum, 0.0)
    return dq, dk, dv, dpse, -(p_sink * row_dot).sum((0, 2))


def _fa_work(geo: _FaGeometry, masked: bool, options: dict[str, Any]) -> work.AttentionCall:
    """The score elements one forward call computes (work.py): per batch and head, or per TND sequence."""
    mode, pre, nxt = options["sparse_mode"], options["pre_tockens"], options["next_tockens"]

    def elements(q_len: int, kv_len: int) -> int:
        return work.computed_elements(
            q_len, kv_len, masked=masked, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt
        )

    if geo.segments is None:
        per_head = geo.batch * elements(geo.q_len, geo.kv_len)
    else:
        per_head = sum(elements(q1 - q0, kv1 - kv0) for q0, q1, kv0, kv1 in geo.segments)
    return work.AttentionCall(
        work.FUSED, geo.layout, mode, options["inner_precise"], masked, per_head * geo.heads
    )


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

    Returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels). The score elements
    the call computes are added to every open ``attention_work()`` tally (work.py; the grad op is not
    counted). With keep_prob 1
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
        "dropout_mask": dropout_mask,
    }
    geo, keep = _fa_prepare(
        name, query, key, value, head_num, input_layout, pse, atten_mask, options, unmodelled
    )
    _fa_check_sink(name, sink, geo.heads)
    numels = _fa_numels(geo, head_num, actual_seq_qlen, actual_seq_kvlen)
    if work.tallying():
        work.record_call(_fa_work(geo, atten_mask is not None, options))
    # The 950's forward never hands the sink to the kernel (profiles.Profile.forward_sink).
    kept_sink = sink if profile.forward_sink else None
    out, row_max, row_sum = _fa_forward(geo, keep, float(scale), query, key, value, pse, kept_sink)
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

    dpse is None without pse, as the C++ adapter returns an undefined tensor; dsink (op-plugin >= 7.3.0
    returns it: its schema has five outputs) is the sink's gradient, None without a sink. The forward's
    softmax_max, softmax_sum and attention_out are required: the gradient is built from them, as on the
    device. softmax_in is the reserved empty tensor and is not read.
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
    unmodelled = {"padding_mask": padding_mask, "prefix": prefix}
    geo, keep = _fa_prepare(
        name, query, key, value, head_num, input_layout, pse, atten_mask, options, unmodelled
    )
    unsupported(
        softmax_max is None or softmax_sum is None or attention_in is None,
        f"{name}: without the forward's softmax_max, softmax_sum and attention_in",
    )
    out_dim = geo.heads * geo.v_dim if geo.layout in ("BSH", "SBH") else geo.v_dim
    expected = (*query.shape[:-1], out_dim)
    for label, t in (("dy", dy), ("attention_in", attention_in)):
        check(
            tuple(t.shape) == expected and t.dtype == query.dtype,
            f"{name}: {label} must be {query.dtype} {list(expected)}, got {t.dtype} {tuple(t.shape)}",
        )
    _fa_check_sink(name, sink, geo.heads)
    row_max = _fa_unpack_stats(name, "softmax_max", softmax_max, geo, softmax_layout)
    row_sum = _fa_unpack_stats(name, "softmax_sum", softmax_sum, geo, softmax_layout)
    grads = _fa_backward(
        geo, keep, scale_value, (query, key, value, pse), dy, attention_in, row_max, row_sum, sink
    )
    return grads if "sink" in profile.schemas["npu_fusion_attention_grad"] else grads[:4]


def _fake_fusion_attention(
    profile: Profile,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    head_num: int,
    input_layout: str,
    *args: Any,
) -> tuple:
    options = dict(zip(FA_OPTION_NAMES, args, strict=False))
    layout = input_layout.upper()
    qlen, kvlen = options.get("actual_seq_qlen"), options.get("actual_seq_kvlen")
    geo = _fa_geometry("npu_fusion_attention", query, key, value, head_num, layout, qlen, kvlen)
    out_dim = geo.heads * geo.v_dim if layout in ("BSH", "SBH") else geo.v_dim
    stats = (
        (geo.q_len, geo.heads, _FA_STATS) if layout == "TND" else (geo.batch, geo.heads, geo.q_len, _FA_STATS)
    )
    return (
        fake_empty((*query.shape[:-1], out_dim), query.dtype, query),
        fake_empty(stats, torch.float32, query),
        fake_empty(stats, torch.float32, query),
        fake_empty((0,), query.dtype, query),
        0,
        0,
        _fa_numels(geo, head_num, qlen, kvlen),
    )


# The positional parameters of npu_fusion_attention after input_layout, in schema order.
FA_OPTION_NAMES = (
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
        fake_like(query),
        fake_like(key),
        fake_like(value),
        None if pse is None else fake_like(pse),
    )
    if "sink" not in profile.schemas["npu_fusion_attention_grad"]:
        return grads
    sink = args[-1] if args else None  # the last argument of the grad's schema
    return (*grads, None if sink is None else fake_like(sink))


OP_DEFS: dict[str, OpDef] = {
    "npu_fusion_attention": OpDef(fusion_attention, _fake_fusion_attention),
    "npu_fusion_attention_grad": OpDef(fusion_attention_grad, _fake_fusion_attention_grad),
}
