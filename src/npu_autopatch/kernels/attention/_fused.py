"""The fused op's calls: transformers' Ascend flash-attention functions, made to honour what it passes.

On an NPU, ``attn_implementation="flash_attention_2"`` runs ``npu_flash_attn_func`` (equal-length
batches, layout BSND) and ``npu_flash_attn_varlen_func`` (padded or packed batches, layout TND) of
``transformers.integrations.npu_flash_attention``. transformers looks them up in that module when
its first flash-attention forward runs (``modeling_flash_attention_utils._lazy_imports``) and keeps
them; it builds the keyword arguments it passes from the varlen function's signature
(``_lazy_define_process_function``). The stock functions have no ``window_size``, ``s_aux`` or
``softcap`` parameter, so transformers drops the sliding window and the attention sinks without a
word (and, on 4.57, the softcap). The replacements take them and honour them:

- the sliding window: transformers passes ``window_size = (W - 1, W - 1)`` for a window of W tokens
  (the current one included: eager keeps ``q - W < kv <= q``), only when the key is longer than W.
  npu_fusion_attention's band mode (``sparse_mode=4`` with the 2048x2048 compressed mask) keeps
  ``i+Δ-pre <= j <= i+Δ+next`` counted from the bottom-right corner (Δ = Skv - Sq; the op's doc
  builds its band as ``triu(k=next+1) | tril(k=-pre-1)``), so ``pre = W - 1`` and ``next = 0`` when
  causal, ``W - 1`` when not. In TND each sequence gets its own band.
- attention sinks (gpt-oss's ``s_aux``): the op's ``sink``, an unscaled extra logit per head, from
  op-plugin 7.3.0 (``_requirements.sink_requirement``). Before that, the calls with sinks run unfused:
  the ``*_unfused_sinks`` variants, which status() names for the target.
- softcap: the op has none; the call runs unfused (5.x stock raises, 4.57 stock drops it).

Unfused is eager attention on the device in torch ops, as transformers' eager computes it: correct,
with an S x S score matrix per head. A call outside the op's documented limits (head dim, heads,
dtype) runs unfused without asking it; a fused call that raises is reported through ``on_error``
and calls of that shape class run unfused from then on, the function's other calls stay fused (a
model beside it with another head dim keeps the fused op). Never stock: stock would be wrong for a
sliding-window model.

The varlen function copies ``cu_seqlens[1:]`` to the host (the op takes lists): stock does it twice
per layer. Here it is once per tensor: a tensor seen before (the same object, not modified since)
is not copied again, so verl-style ``cu_seq_lens_q/k`` passed to the model cost one copy per forward.
"""

import inspect
import math
import threading
import weakref

import torch

from .._calls import counters
from .._probe import agree, first_disagreement, generator, randn, signature_reason
from ._limits import _fused_or_why, _shape_class

_UNBOUNDED = 2147483647  # npu_fusion_attention's default pre_tockens/next_tockens: no limit
_BAND = 4  # sparse_mode: band counted from the bottom-right corner
_DENSE = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "kwargs")
_VARLEN = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    "dropout_p", "softmax_scale", "causal", "kwargs",
)  # fmt: skip


class _PerTensor:
    """``compute(tensor)`` once per tensor: keyed by identity and version (a dead or modified tensor is
    computed again), the last few kept (a forward has one or two).

    An inference tensor (made under ``torch.inference_mode()``) has no version counter, so a change in
    place could not be seen: it is computed every time, as stock does (one host copy per layer).
    """

    def __init__(self, compute, size: int = 8) -> None:
        self._compute = compute
        self._size = size
        self._entries: dict[int, tuple] = {}
        self._lock = threading.Lock()  # threads (e.g. pipeline stages) share it

    def __call__(self, tensor: torch.Tensor):
        if torch.compiler.is_compiling() or tensor.is_inference():
            # compiling: a guard on the tensor's identity and version would compile the graph again
            # for every new batch; the compiled call computes it as stock does
            return self._compute(tensor)
        key = id(tensor)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
            return entry[2]
        value = self._compute(tensor)
        with self._lock:
            if len(self._entries) >= self._size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = (weakref.ref(tensor), tensor._version, value)
        return value


# ``cu_seqlens[1:]`` as a host tuple: the one device-to-host copy per tensor.
HOST_ENDS = _PerTensor(lambda cu_seqlens: tuple(cu_seqlens[1:].tolist()))


def _band(causal, window_size):
    """(pre, next) in tokens from flash-attention's ``window_size`` (-1: unbounded)."""
    left, right = window_size if window_size is not None else (-1, -1)
    pre = left if left >= 0 else _UNBOUNDED
    return pre, 0 if causal else (right if right >= 0 else _UNBOUNDED)


def _stock_mask(stock):
    """The compressed-mask getter and causal sparse mode of the stock module (its cache, its env);
    (None, None) for code elsewhere, which the probes then refuse."""
    names = getattr(stock, "__globals__", {})
    return names.get("get_attn_mask_npu"), names.get("SPARSE_MODE")


def _fused_options(device, causal, pre, nxt, s_aux, get_mask, causal_mode):
    """npu_fusion_attention's mask keywords for this band, and the sink when there is one."""
    if pre == _UNBOUNDED and nxt == _UNBOUNDED:
        options = {}  # full attention: no mask
    elif causal and pre == _UNBOUNDED:
        options = {"atten_mask": get_mask(device), "sparse_mode": causal_mode}  # what stock passes
    else:
        options = {
            "atten_mask": get_mask(device),
            "sparse_mode": _BAND,
            "pre_tockens": pre,
            "next_tockens": nxt,
        }
    if s_aux is not None:
        options["sink"] = s_aux.float()
    return options


def _unfused(q, k, v, scale, pre, nxt, sink, softcap, dropout_p):
    """Eager attention on [B, S, N, D], in transformers' eager order: scores in the input dtype,
    softcap, mask, sinks, softmax in fp32, cast back, dropout, @ v."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    sq, skv = scores.shape[-2:]
    i, j = torch.arange(sq, device=q.device).unsqueeze(1) + (skv - sq), torch.arange(skv, device=q.device)
    scores = scores.masked_fill((j < i - pre) | (j > i + nxt), torch.finfo(scores.dtype).min)
    if sink is not None:
        column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = torch.nn.functional.dropout(probs.to(q.dtype), p=dropout_p, training=dropout_p > 0)
    return (probs @ v).transpose(1, 2)


def _exposed(replacement):
    """Pin the replacement's own signature: the patcher sets ``__wrapped__`` to the stock function and
    ``inspect.signature`` (which transformers reads) would otherwise report the stock parameters."""
    replacement.__signature__ = inspect.signature(replacement)
    return replacement


def _build_dense(stock, npu, on_error, fused_sink=True):
    get_mask, causal_mode = _stock_mask(stock)
    refused: dict[tuple, str] = {}  # shape class -> the fused op's error on it
    count_fused, count_stock = counters(on_error)

    def npu_flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=None, s_aux=None,
        **kwargs,
    ):  # fmt: skip
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        pre, nxt = _band(causal, window_size)
        key = _shape_class(q, k, v, 2, causal, window_size, s_aux)
        why = _fused_or_why(q, v, q.shape[2], softcap, s_aux, fused_sink, refused, key)
        if why is None:
            options = _fused_options(q.device, causal, pre, nxt, s_aux, get_mask, causal_mode)
            try:
                out = npu.npu_fusion_attention(
                    q, k, v, q.shape[2], "BSND", keep_prob=1.0 - dropout_p, scale=scale, **options
                )[0]
            except Exception as exc:
                on_error(exc, q, k, v)
                refused[key] = f"{type(exc).__name__}: {exc}"
            else:
                count_fused()
                return out
        else:
            count_stock(why, q)
        return _unfused(q, k, v, scale, pre, nxt, s_aux, softcap, dropout_p)

    return _exposed(npu_flash_attn_func)


def _build_varlen(stock, npu, on_error, fused_sink=True):
    get_mask, causal_mode = _stock_mask(stock)
    refused: dict[tuple, str] = {}  # shape class -> the fused op's error on it
    count_fused, count_stock = counters(on_error)

    def npu_flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=None, softcap=None, s_aux=None, **kwargs,
    ):  # fmt: skip
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        pre, nxt = _band(causal, window_size)
        ends_q = HOST_ENDS(cu_seqlens_q)
        ends_k = ends_q if cu_seqlens_k is cu_seqlens_q else HOST_ENDS(cu_seqlens_k)
        key = _shape_class(q, k, v, 1, causal, window_size, s_aux)
        why = _fused_or_why(q, v, q.shape[1], softcap, s_aux, fused_sink, refused, key)
        if why is None:
            options = _fused_options(q.device, causal, pre, nxt, s_aux, get_mask, causal_mode)
            try:
                out = npu.npu_fusion_attention(
                    q, k, v, q.shape[1], "TND", keep_prob=1.0 - dropout_p, scale=scale,
                    actual_seq_qlen=ends_q, actual_seq_kvlen=ends_k, **options,
                )[0]  # fmt: skip
            except Exception as exc:
                on_error(exc, q, k, v)
                refused[key] = f"{type(exc).__name__}: {exc}"
            else:
                count_fused()
                return out
        else:
            count_stock(why, q)
        pieces, q0, k0 = [], 0, 0
        for q1, k1 in zip(ends_q, ends_k, strict=True):
            one = (q[q0:q1], k[k0:k1], v[k0:k1])
            pieces.append(
                _unfused(*(t.unsqueeze(0) for t in one), scale, pre, nxt, s_aux, softcap, dropout_p)[0]
            )
            q0, k0 = q1, k1
        return torch.cat(pieces)

    return _exposed(npu_flash_attn_varlen_func)


def _unfused_sinks(build):
    """``build`` for a torch_npu whose npu_fusion_attention has no ``sink`` (before op-plugin 7.3.0)."""

    def build_unfused_sinks(stock, npu, on_error):
        return build(stock, npu, on_error, fused_sink=False)

    return build_unfused_sinks


def _eager(q, k, v, scale, causal, window, sink):
    """The probes' reference, written as transformers' eager masks it: key kv is seen by query q
    (absolute position q + Skv - Sq) when kv <= q if causal, and q - W < kv (< q + W) with a window."""
    sq, skv = q.shape[1], k.shape[1]
    q_pos = torch.arange(sq).unsqueeze(1) + (skv - sq)
    kv_pos = torch.arange(skv)
    seen = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        seen &= kv_pos <= q_pos
    if window is not None:
        seen &= (kv_pos > q_pos - window) & (kv_pos < q_pos + window)
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    logits = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink.view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :skv]
    return (probs @ vh).transpose(1, 2)


# (causal, window W or None, with a sink): the cases transformers passes; W = 3 is shorter than S = 7.
_CASES = ((True, None, False), (True, 3, False), (False, 3, False), (False, None, False), (True, 3, True))


def _probe_inputs():
    gen = generator()
    q, k, v = randn(gen, 2, 7, 4, 8), randn(gen, 2, 7, 2, 8), randn(gen, 2, 7, 2, 8)  # GQA 4:2
    return q, k, v, randn(gen, 4)


def _window_size(window):
    return None if window is None else (window - 1, window - 1)


def _mask_reason(stock):
    if None in _stock_mask(stock):
        return "its module has no get_attn_mask_npu and SPARSE_MODE (the compressed mask the op takes)"
    return None


def _probe_dense(stock, candidate):
    wrong = signature_reason(stock, _DENSE) or _mask_reason(stock)
    if wrong:
        return wrong
    q, k, v, sink = _probe_inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    return first_disagreement(
        *(
            agree(
                lambda c=causal, w=window, s=sink if sunk else None: _eager(q, k, v, scale, c, w, s),
                lambda c=causal, w=window, s=sink if sunk else None: candidate(
                    q, k, v, softmax_scale=scale, causal=c, window_size=_window_size(w), s_aux=s
                ),
            )
            for causal, window, sunk in _CASES
        )
    )


def _probe_varlen(stock, candidate):
    wrong = signature_reason(stock, _VARLEN) or _mask_reason(stock)
    if wrong:
        return wrong
    q, k, v, sink = _probe_inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)  # two sequences of 7, each on its own
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    return first_disagreement(
        *(
            agree(
                lambda c=causal, w=window, s=sink if sunk else None: _eager(q, k, v, scale, c, w, s).flatten(
                    0, 1
                ),
                lambda c=causal, w=window, s=sink if sunk else None: candidate(
                    *flat, cu, cu, 7, 7, softmax_scale=scale, causal=c, window_size=_window_size(w), s_aux=s
                ),
            )
            for causal, window, sunk in _CASES
        )
    )
