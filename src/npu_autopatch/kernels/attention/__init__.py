"""Attention: transformers' Ascend flash-attention functions, made to honour what transformers passes.

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
import logging
import math
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

from .._types import Kernel, Report, Variant
from ._calls import counters
from ._probe import agree, first_disagreement, generator, randn, signature_reason
from ._requirements import sink_requirement

_UNBOUNDED = 2147483647  # npu_fusion_attention's default pre_tockens/next_tockens: no limit
_BAND = 4  # sparse_mode: band counted from the bottom-right corner
_DENSE = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "kwargs")
_VARLEN = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    "dropout_p", "softmax_scale", "causal", "kwargs",
)  # fmt: skip
_CHOICE = ("self", "attn_implementation", "is_init_check", "allow_all_kernels")
_HUB_LIST = "_compatible_flash_implementations"
_INTEGRATION = "transformers.integrations.npu_flash_attention"


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


# What npu_fusion_attention states it takes (op doc ``torch_npu-npu_fusion_attention.md``, op-plugin
# master and 7.x: fp16/bf16/fp32; head dim D in 1..768 with the value's no larger; 1..256 query heads;
# no empty sequence): a call outside it runs unfused for that call, without asking the op.
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM, _MAX_HEADS = 768, 256


def _device_refusal(q, v, heads) -> str | None:
    """The rule of the op's documented limits this call breaks, or None (a few integer comparisons)."""
    d, dv = q.shape[-1], v.shape[-1]
    if q.dtype not in _FUSED_DTYPES:
        return f"dtype {q.dtype} (the op takes fp16, bf16, fp32)"
    if not 1 <= dv <= d <= _MAX_HEAD_DIM:
        return f"head dim outside 1..{_MAX_HEAD_DIM}"
    if not 1 <= heads <= _MAX_HEADS:
        return f"more than {_MAX_HEADS} heads"
    if q.numel() == 0 or v.numel() == 0:
        return "empty input"
    return None


def _shape_class(q, k, v, heads_dim, causal, window_size, s_aux) -> tuple:
    """What a fused-op failure is remembered by: everything of a call but its token counts (device,
    heads, head dims, dtype, mask mode, sink). A shape the op raised on runs unfused from then on;
    another model's calls (another head dim, a model on the NPU beside one on the CPU) keep the fused
    op. Token counts are left out: a new batch length would otherwise ask a refusing op again."""
    return (
        q.device.type, q.dtype, tuple(q.shape[heads_dim:]), tuple(k.shape[heads_dim:]), v.shape[-1],
        causal, window_size is not None, s_aux is not None,
    )  # fmt: skip


def _fused_or_why(q, v, heads, softcap, s_aux, fused_sink, refused, key) -> str | None:
    """None when this call goes to the fused op, else the rule that sends it to the unfused math (its
    count in status())."""
    if softcap is not None:
        return "softcap"
    if s_aux is not None and not fused_sink:
        return "sinks unfused"
    rule = _device_refusal(q, v, heads)
    if rule is not None:
        return f"device rule: {rule}"
    if key in refused:
        return "op-failed"  # this shape class raised before: it is not asked again
    return None


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


def _sinks_reach_the_op():
    """Whether transformers' Ascend functions take ``s_aux`` now (this kernel's replacements do, the
    stock ones do not): transformers passes the sinks only to a function whose signature has it."""
    module = sys.modules.get(_INTEGRATION)
    functions = [
        getattr(module, name, None) for name in ("npu_flash_attn_func", "npu_flash_attn_varlen_func")
    ]
    return all(f is not None and "s_aux" in inspect.signature(f).parameters for f in functions)


def _build_choice(stock, npu, on_error):
    """Keep ``flash_attention_2`` for a model whose class lists hub flash kernels.

    transformers 5.x swaps FA2 for the first kernel a model's ``_compatible_flash_implementations``
    names (gpt-oss: ``kernels-community/vllm-flash-attn3``, built for CUDA only); on an NPU that name is
    not registered and the first forward raises KeyError. FA2 on the NPU is transformers' Ascend
    functions: with this kernel's replacements in that module they take the sinks, so the model keeps
    FA2. Without them the sinks would be dropped: the load is refused with the reason.
    """

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        listed = getattr(self, _HUB_LIST, None)
        if attn_implementation != "flash_attention_2" or not listed:
            return stock(self, attn_implementation, *args, **kwargs)
        if not _sinks_reach_the_op():
            raise ValueError(
                f"{type(self).__name__}: attn_implementation='flash_attention_2' on the NPU runs "
                f"transformers' Ascend functions ({_INTEGRATION}), which drop this model's attention sinks "
                "unless npu-autopatch's attention kernel is applied there (it is not: see "
                f"npu_autopatch.status()['npu_flash_attention']), and the hub kernels this model lists "
                f"({', '.join(listed)}) have no NPU build. Use attn_implementation='eager', or enable the "
                "attention kernel."
            )
        own = vars(self)
        own[_HUB_LIST] = None  # this instance keeps FA2: transformers reads the list through getattr
        try:
            return stock(self, attn_implementation, *args, **kwargs)
        finally:
            own.pop(_HUB_LIST, None)

    return _check_and_adjust_attn_implementation


def _probe_choice(stock, candidate):
    """The replacement differs from stock only in FA2 with a hub list: the stock method must be the
    one that reads that list per instance (``getattr(self, ...)``), with the parameters it passes on."""
    wrong = signature_reason(stock, _CHOICE)
    if wrong:
        return wrong
    code = getattr(stock, "__code__", None)
    if code is None or _HUB_LIST not in code.co_consts:
        return f"the stock method does not read {_HUB_LIST} from the instance"
    return None


def _build_unpad_once(stock, npu, on_error):
    """transformers' ``_get_unpad_data(attention_mask)``, once per mask rather than once per layer.

    For a padded batch, every flash-attention layer unpads anew from the same 2-D mask: a
    ``nonzero`` and an ``.item()`` (two device-to-host syncs) and a fresh ``cu_seqlens``, which the
    varlen replacement must copy to the host again. The mask is one tensor for the whole forward, so
    its unpadding data are computed for its first layer and handed to the others (the same tensors:
    integer indices, no gradient); a modified or new mask is unpadded again. Under ``torch.compile``
    the stock function runs: a graph cannot hold the cache.
    """
    cached = _PerTensor(stock)

    def _get_unpad_data(attention_mask):
        if torch.compiler.is_compiling():
            return stock(attention_mask)
        return cached(attention_mask)

    return _get_unpad_data


def _probe_unpad_once(stock, candidate):
    """The same data as stock for padded masks, from the cache the second time, and again after the
    mask changed in place."""
    wrong = signature_reason(stock, ("attention_mask",))
    if wrong:
        return wrong
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 1:] = 0

    def as_tensors(unpad_data):  # (indices, cu_seqlens, max_seqlen: an int)
        indices, cu_seqlens, longest = unpad_data
        return indices, cu_seqlens, torch.tensor(longest)

    def compare():
        return agree(lambda: as_tensors(stock(mask.clone())), lambda: as_tensors(candidate(mask)))

    first, again = compare(), compare()
    mask[0, 5] = 0  # the next batch's mask, written into the same tensor
    return first_disagreement(first, again, compare())


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


# transformers' cache of the functions it loaded (modeling_flash_attention_utils), per function.
_CACHED = (("_flash_fn", "npu_flash_attn_func"), ("_flash_varlen_fn", "npu_flash_attn_varlen_func"))


def _refresh_transformers_cache():
    """Point transformers' cache of the NPU flash functions at what the integration module holds now.

    transformers loads them, and builds its keyword filter from the varlen function's signature, on
    the first flash-attention forward or model, and 5.x keeps them for the process: without this, an
    enable() after that (a stock run first, in a notebook or a comparison script) would report the
    kernel applied while the cached stock functions still dropped the windows, and a disable() would
    leave the replacements running. Only a cache holding the integration's own functions (stock or
    ours) is touched; one holding another implementation is left alone.
    """
    utils = sys.modules.get("transformers.modeling_flash_attention_utils")
    integration = sys.modules.get("transformers.integrations.npu_flash_attention")
    if utils is None or integration is None:
        return
    varlen_moved = False
    for cached, name in _CACHED:
        held, now = getattr(utils, cached, None), getattr(integration, name, None)
        if held is None or now is None or held is now:
            continue
        if held is getattr(now, "__wrapped__", None) or getattr(held, "__wrapped__", None) is now:
            setattr(utils, cached, now)
            varlen_moved |= cached == "_flash_varlen_fn"
    if varlen_moved and getattr(utils, "_process_flash_kwargs_fn", None) is not None:
        utils._process_flash_kwargs_fn = utils._lazy_define_process_function(utils._flash_varlen_fn)


@dataclass
class AttentionEntry:
    """One attention module class of a model, for report(): the implementation its config picks, who
    chose it, and the code that computes it (FA2 on the NPU: transformers' Ascend functions, ours or
    stock)."""

    name: str  # the class's qualified name
    count: int  # instances in the model
    implementation: str  # config._attn_implementation: flash_attention_2, sdpa, eager, ...
    chosen: str  # who chose it: the user, transformers' default, routed by the default_attention kernel
    path: str  # what runs, in words


def _report_rows(classes, records) -> list[AttentionEntry]:
    """For report(): each ``*Attention`` module class with a config, the implementation it asks for,
    who chose it and what runs it. FA2 on an NPU is transformers' Ascend functions; transformers calls
    the ones it loaded at its first FA2 forward (``modeling_flash_attention_utils._flash_varlen_fn``),
    else the integration module's now."""
    entries = []
    for cls, instances in classes.items():
        config = getattr(instances[0][1], "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if not cls.__name__.endswith("Attention") or implementation is None:
            continue
        path = _flash_path(records) if implementation == "flash_attention_2" else implementation
        chosen = _chosen(config, implementation)
        entries.append(AttentionEntry(cls.__qualname__, len(instances), implementation, chosen, path))
    return entries


def _flash_path(records) -> str:
    utils = sys.modules.get("transformers.modeling_flash_attention_utils")
    integration = sys.modules.get(_INTEGRATION)
    npu = sys.modules.get("transformers.utils")
    if integration is None or npu is None or not npu.is_torch_npu_available():
        return "flash_attention_2 (not the NPU path)"
    function = getattr(utils, "_flash_varlen_fn", None) or integration.npu_flash_attn_varlen_func
    home = getattr(function, "__module__", None) or "?"
    if home == __name__:
        record = records.get("npu_flash_attention")
        variants = ", ".join(sorted(set(record.variants.values()))) if record is not None else "?"
        failed = record is not None and record.code == "op-failed"  # status()'s ReasonCode.OP_FAILED
        how = "fused op given up for some shapes: unfused there" if failed else variants
        return f"FA2 on the NPU, patched (attention kernel: {how})"
    if home == integration.__name__:
        return "FA2 on the NPU, stock (drops sliding windows and sinks)"
    return f"FA2 on the NPU, foreign ({home}.{getattr(function, '__qualname__', '?')})"


ATTENTION = Kernel(
    "attention",
    ("npu_fusion_attention",),
    fallback=(
        "unfused attention for calls of that shape (eager math on the device: stock would drop the window "
        "and the sinks; other shapes keep the fused op)"
    ),
    variants=(
        Variant("dense", _build_dense, _probe_dense, requires=sink_requirement),
        Variant("varlen", _build_varlen, _probe_varlen, requires=sink_requirement),
        # A torch_npu without ``sink``: the same, the calls with sinks unfused; the variant's name in
        # status() says so.
        Variant("dense_unfused_sinks", _unfused_sinks(_build_dense), _probe_dense),
        Variant("varlen_unfused_sinks", _unfused_sinks(_build_varlen), _probe_varlen),
        Variant("keep_fa2", _build_choice, _probe_choice),
        Variant("unpad_once", _build_unpad_once, _probe_unpad_once),
    ),
    refresh=_refresh_transformers_cache,
    report=Report(rows=_report_rows, columns=("n", "implementation", "chosen by", "runs")),
)

# --- transformers' default attention on the NPU: the flash-attention path (issue 27) ----------------

_ROUTED = "flash_attention_2"
_GET_CORRECT = ("self", "requested_attention", "is_init_check")
# Why a model keeps transformers' default (the reasons status() counts; all but the last are the
# caller's or transformers' own and never warned about).
CHOSEN = "an explicit choice"
NOT_NPU = "no NPU"
NO_FA2 = "no flash attention in transformers"
NOT_TRANSFORMERS = "not transformers' own code"
NOT_SELECTED = "model not selected"
KNOWN_FAILURE = "transformers' FA2 path fails for it"
DROPS_BIDIRECTIONAL = "FA2 drops its bidirectional mask"
INSIDE_NO_FA2 = "inside a model without flash attention"
LEFT_STOCK = "model left stock"
KERNEL_OFF = "attention kernel not applied"
# Why a call of a routed model runs stock sdpa rather than the flash path (decided per call).
MASK_4D = "attention call with a 4-D mask"
_ROUTINE = (
    CHOSEN, NOT_NPU, NO_FA2, DROPS_BIDIRECTIONAL, NOT_TRANSFORMERS, NOT_SELECTED, KNOWN_FAILURE,
    INSIDE_NO_FA2, MASK_4D,
)  # fmt: skip
# Model types (modeling module's package) whose transformers FA2 code raises or computes wrong where
# its sdpa does not, on a transformers major ("4" or "5"; "*" both): they keep the default, with why.
# Found by the whole-table parity test (tests/test_default_attention.py), not by the kernel.
_FA2_FAILS = {
    "glm4v_moe": (
        "*",
        "transformers' FA2 path reads its 3-row mRoPE position_ids as packed sequences at batch size 1 "
        "(sequence lengths for 3x the tokens): the device refuses them",
    ),
    "qwen2_moe": ("4", "4.57 refuses right padding with flash_attention_2 (a ValueError)"),
    "deepseek_v2": ("4", "4.57's FA2 path mixes packed sequences"),
    "granitemoe": ("4", "4.57's FA2 path mixes packed sequences"),
}


class _Choices:
    """The default-attention decision per model config, while the config lives: for report() (who
    chose the implementation) and for disable()/enable() (``_refresh_routed``: a routed config goes
    back to stock's default when the route is taken out, and to FA2 when it is put back).

    Held here, beside the only code that writes and reads it, not in the package state: like
    ``HOST_ENDS`` it is a cache of facts about the user's objects, keyed weakly (a config is
    unhashable: keyed by id, the entry dropped when the config dies).
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.reduced: set[type] = set()  # the config classes ``_portable`` registered a reducer for

    def note(self, config, routed: bool, why: str | None, stock_choice: str, model) -> None:
        key = id(config)

        def forget(ref, key=key):
            with self._lock:
                if self._by_id.get(key, (None,))[0] is ref:
                    del self._by_id[key]

        with self._lock:
            self._by_id[key] = (weakref.ref(config, forget), routed, why, stock_choice, weakref.ref(model))

    def of(self, config):
        """(routed, why not, stock's choice) for this config, or None if no decision was seen."""
        entry = self._by_id.get(id(config))
        return entry[1:4] if entry is not None and entry[0]() is config else None

    def decided_by(self, config):
        """The model whose build took this config's decision (None once it is gone, or if none)."""
        entry = self._by_id.get(id(config))
        return entry[4]() if entry is not None and entry[0]() is config else None

    def routed(self):
        """[(config, stock's choice)] of the live routed configs."""
        with self._lock:
            entries = list(self._by_id.values())
        return [
            (ref(), stock_choice)
            for ref, routed, _why, stock_choice, _model in entries
            if routed and ref() is not None
        ]


CHOICES = _Choices()


def _portable_reduce(config):
    """How a routed config's class pickles while the route is in place (``copyreg``: pickle,
    ``torch.save``, Ray, spawn and ``copy.deepcopy`` read it): as stock would, with stock's choice in
    place of ours. Nothing of ours may outlive the process in the user's objects: a routed model
    saved whole or sent to a worker must run where there is no NPU (or no npu-autopatch), and
    ``"flash_attention_2"`` there means the flash-attn package. A deep copy in this process is not
    routed again either (it runs stock's choice: correct, not the lean path)."""
    reduced = list(object.__reduce_ex__(config, 2))
    decision, state = CHOICES.of(config), reduced[2]
    routed = decision is not None and decision[0] and isinstance(state, dict)
    if routed and state.get("_attn_implementation_internal") == _ROUTED:
        reduced[2] = {**state, "_attn_implementation_internal": decision[2]}
    return tuple(reduced)


def _portable(classes, on: bool) -> None:
    """Register ``_portable_reduce`` for these config classes (``on``), or take every one of ours out;
    a class someone else registered a reducer for is left to them."""
    import copyreg

    for cls in classes if on else list(CHOICES.reduced):
        held = copyreg.dispatch_table.get(cls)
        if on and held is None:
            copyreg.pickle(cls, _portable_reduce)
            CHOICES.reduced.add(cls)
        elif not on:
            CHOICES.reduced.discard(cls)
            if held is _portable_reduce:
                del copyreg.dispatch_table[cls]


def _chosen(config, implementation) -> str:
    """Who chose a config's attention implementation, in words, for report()."""
    decision = CHOICES.of(config)
    if decision is None:
        return "the user, or before npu-autopatch"
    routed, why, stock_choice = decision
    if routed and implementation == _ROUTED:
        return f"default, routed from {stock_choice} by npu-autopatch (packed documents kept apart)"
    if routed or why == CHOSEN:
        return "the user"  # routed once, then set_attn_implementation() or a config shared with another model
    return f"transformers' default ({why})"


def _model_type(cls) -> str | None:
    """The model type of a class of transformers' own modeling modules (``transformers.models.<type>.``)."""
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def _fa2_fails(model_type) -> str | None:
    on, why = _FA2_FAILS.get(model_type, (None, None))
    return why if on in ("*", _major()) else None


def _flash_functions_ours() -> str | None:
    """None when transformers' Ascend flash-attention functions are this kernel's, else why not.

    Imported here if transformers has not yet (an FA2 model would import it at once): our import
    hook patches it as it loads, under the package lock, which this code does not hold.
    """
    import importlib

    try:
        module = importlib.import_module(_INTEGRATION)
    except Exception as exc:  # a model's __init__ must not fail because of us: it keeps stock's choice
        return f"{KERNEL_OFF} ({_INTEGRATION} did not import: {type(exc).__name__}: {exc})"
    functions = (module.npu_flash_attn_func, module.npu_flash_attn_varlen_func)
    if all(getattr(f, "__module__", None) == __name__ for f in functions):
        return None
    record = sys.modules["npu_autopatch"].status().get("npu_flash_attention")
    state = f"{record.state.value}: {record.reason}" if record is not None else "not in the registry"
    return f"{KERNEL_OFF} ({state})"


# Classes 4.57 lets run FA2 although FA2 drops the bidirectional part of their mask (the image tokens,
# PaliGemma's prompt prefix): transformers 5 marks the same classes ``_supports_flash_attn = False``
# ("Flash Attention drops the bidirectional mask over image tokens"); the route reads 4.57 as 5 does.
_DROPS_BIDIRECTIONAL_4 = frozenset(
    {
        "Gemma3Model", "Gemma3ForConditionalGeneration", "Gemma3ForSequenceClassification",
        "PaliGemmaModel", "PaliGemmaForConditionalGeneration",
    }
)  # fmt: skip


def _fa2_refusal(cls) -> str | None:
    """Why a class is not to run FA2 (transformers' own test: 5.x ``_supports_flash_attn``, 4.57
    ``_supports_flash_attn_2``; and 4.57's classes whose mask FA2 cannot hold), or None."""
    if not (getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False)):
        return NO_FA2
    if _major() == "4" and cls.__name__ in _DROPS_BIDIRECTIONAL_4:
        return DROPS_BIDIRECTIONAL
    return None


def _major() -> str:
    return sys.modules["transformers"].__version__.split(".", 1)[0]


def _containers(model) -> list:
    """The models whose ``__init__`` is building ``model``, innermost first: an inner base model is built
    by its task model, a vision-language model's towers by the wrapper (from the Python stack: asked
    only while a model is built). Empty for a model built on its own."""
    base = sys.modules["transformers.modeling_utils"].PreTrainedModel
    found, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, base) and all(owner is not f for f in found):
                found.append(owner)
        frame = frame.f_back
    return found


def _why_not_routed(model, requested, npu_available, containers) -> str | None:
    """None when ``model``'s default attention goes to the flash-attention path, else the reason."""
    if requested is not None:
        return CHOSEN
    if not npu_available():
        return NOT_NPU
    cls = type(model)
    refusal = _fa2_refusal(cls)
    if refusal is not None:
        return refusal
    if any(_fa2_refusal(type(container)) for container in containers):
        # a wrapper that refuses FA2 (Gemma 3's and PaliGemma's vision-language classes: their mask is
        # bidirectional over the image tokens or the prefix, which FA2 drops) keeps its towers on it too
        return INSIDE_NO_FA2
    model_type = _model_type(cls)
    if model_type is None:
        return NOT_TRANSFORMERS  # remote code may call the flash-attn package itself
    record = sys.modules["npu_autopatch"].status().get(model_type)
    code = record.code.value if record is not None and record.code is not None else None
    if code in ("excluded", "not-selected"):
        return NOT_SELECTED  # NPU_AUTOPATCH_EXCLUDE, or models= without it: stock, the attention too
    if record is not None and record.state.value == "failed":
        return LEFT_STOCK  # all or nothing: a model whose patch failed runs stock, its attention too
    if _fa2_fails(model_type):
        return KNOWN_FAILURE
    return _flash_functions_ours()


def _build_route(stock, npu, on_error):
    """transformers' default attention (``attn_implementation`` not given): the flash-attention path.

    ``get_correct_attn_implementation(requested)`` turns ``None`` into ``"sdpa"`` (else ``"eager"``)
    for every model, on every device; on the NPU, sdpa with a mask computes every score of a padded,
    packed or windowed batch (docs/attention.md). Here ``None`` becomes ``"flash_attention_2"`` for a
    model of transformers whose class supports it while this kernel's flash functions are in place:
    padded batches unpadded, packed documents apart, windows in band mode. Anything the user named
    (sdpa, eager, a hub kernel) goes to stock untouched. transformers' own checks for FA2 are not
    run for the route: on the NPU they only warn about dtypes the op takes (fp32) and devices the
    model is not on yet, which a user who chose nothing should not read.

    One decision per model built, counted once: the models its ``__init__`` builds (an inner base model
    on the same config, a vision-language model's towers on its sub-configs) follow it, uncounted, and
    a model inside one that refuses FA2 keeps stock's choice. What the flash path cannot take is
    decided per call, by the replacement's ``per_call`` functions (``_install_route``).
    """
    from transformers.utils import is_torch_npu_available

    count_routed, count_stock = counters(on_error, routine=_ROUTINE)

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False, *args, **kwargs):
        config = getattr(self, "config", None)
        decision = CHOICES.of(config)
        if requested_attention == _ROUTED and decision is not None and decision[0]:
            return _ROUTED  # transformers checking again what the route chose: not a new decision
        stock_choice = stock(self, requested_attention, is_init_check, *args, **kwargs)
        containers = _containers(self)
        if decision is not None and requested_attention == decision[2]:
            decider = CHOICES.decided_by(config)
            if decider is self or any(decider is container for container in containers):
                return stock_choice  # the choice written by this build's decision, read back
        why = _why_not_routed(self, requested_attention, is_torch_npu_available, containers)
        if config is not None:
            CHOICES.note(config, why is None, why, stock_choice, self)
        if why is None:
            _portable((type(config),), on=True)
        if not containers:  # the model being built, not one its __init__ builds: counted once
            if why is None:
                count_routed()
            else:
                count_stock(why.split(" (", 1)[0])
        return _ROUTED if why is None else stock_choice

    def attention(flash):
        """The registry's ``flash_attention_2`` function (``flash``), deciding per call for the models
        the route chose it for: what the flash path cannot take runs stock's sdpa, as transformers'
        default would have; an explicit FA2 model's calls go to ``flash`` untouched."""

        def flash_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
            if not _routed_config(getattr(module, "config", None)):
                return flash(module, query, key, value, attention_mask, *args, **kwargs)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
                # a custom mask (packed documents, a tree, a prefix) or transformers' compiled sdpa
                # mask: only sdpa reads it, FA2 would index it as a padding mask
                if not torch.compiler.is_compiling():
                    count_stock(MASK_4D, query)
                return _registry_function("sdpa")(module, query, key, value, attention_mask, *args, **kwargs)
            if torch.compiler.is_compiling():
                if attention_mask is None and key.shape[2] != query.shape[2]:
                    # keys of a cache beside the query: the masks were stock's (``mask``), which
                    # leaves this one to sdpa's own causal flag
                    return _registry_function("sdpa")(module, query, key, value, None, *args, **kwargs)
                return flash(module, query, key, value, attention_mask, *args, **kwargs)
            _CALL.routed = True
            try:
                return flash(module, query, key, value, attention_mask, *args, **kwargs)
            finally:
                _CALL.routed = False

        return flash_attention_forward

    def mask(flash_mask):
        """The mask registry's ``flash_attention_2`` function (``flash_mask``): for a routed model, stock's
        sdpa mask where the compiled forward is then stock's (a call under ``torch.compile`` that
        carries a padding mask or a cache beside its query: no host copies, no data-dependent
        unpadding) and for a compileable cache's masks; otherwise ``flash_mask``. A compiled call with
        neither (a packed batch, its documents told apart by position_ids alone, or an unpadded one)
        takes the flash path as it does uncompiled: stock's mask would drop the documents' bounds
        wherever a cache is in use, and skip what replaces ``_flash_attention_forward`` (verl's Ulysses)."""

        def flash_attention_mask(*args, config=None, **kwargs):
            compiled = torch.compiler.is_compiling() and not _unmasked_prefill(args, kwargs)
            if (compiled or _CALL.compileable_cache) and config is not None and _routed_config(config):
                return _mask_function("sdpa")(*args, config=config, **kwargs)
            return flash_mask(*args, config=config, **kwargs)

        return flash_attention_mask

    def generation_inputs(prepare):
        """``GenerationMixin.prepare_inputs_for_generation`` (``prepare``): for a routed model with a
        compileable cache, the masks it builds are stock's sdpa masks (``_Call.compileable_cache``)."""
        names = list(inspect.signature(prepare).parameters)
        index = next((names.index(name) for name in ("cache", "past_key_values") if name in names), None)

        def prepare_inputs_for_generation(self, *args, **kwargs):
            cache = None
            if index is not None:
                cache = kwargs.get(names[index]) if len(args) < index else args[index - 1]
            routed = _routed_config(getattr(self, "config", None))
            if not routed or not getattr(cache, "is_compileable", False):
                return prepare(self, *args, **kwargs)
            _CALL.compileable_cache = True
            try:
                return prepare(self, *args, **kwargs)
            finally:
                _CALL.compileable_cache = False

        return prepare_inputs_for_generation

    get_correct_attn_implementation.per_call = {
        "attention": attention,
        "mask": mask,
        "generation": generation_inputs,
    }
    return get_correct_attn_implementation


class _Call(threading.local):
    """What the route's per-call functions need to know of the call in progress, per thread.

    ``routed``: a routed call is running transformers' FA2 code, which prints "Casting fp32 inputs back
    to torch.float32 for flash-attn compatibility" once for an fp32 model (a cast to the dtype it has):
    a user who chose nothing never chose FA2, and stock sdpa prints nothing, so the filter on that
    logger drops the line meanwhile (it is inert otherwise; transformers' ``warning_once`` then
    remembers the line as printed, and an explicit FA2 model in the same process does not print it
    either). ``compileable_cache``: ``generate`` is building the masks of a static (compileable) cache,
    transformers' path to a compiled decode (5.x compiles it on its own): for a routed model they are
    stock's sdpa masks, so its forward runs as stock's, compiled or not.
    """

    routed = False
    compileable_cache = False

    def filter(self, record) -> bool:
        return not (self.routed and record.getMessage().startswith("Casting fp32 inputs back"))


_CALL = _Call()


def _routed_config(config) -> bool:
    """Whether the route chose FA2 for this config (a dict lookup: dynamo traces it as a constant)."""
    decision = CHOICES.of(config)
    return decision is not None and decision[0]


def _unmasked_prefill(args, kwargs) -> bool:
    """Whether a mask function's call (keywords, as transformers passes them) is for a batch with no
    padding mask whose keys are its own tokens, no cache beside them (4.57 gives the query's length
    as ``cache_position``, 5.x as ``q_length``). False when that cannot be read: stock's masks then."""
    if args or kwargs.get("attention_mask") is not None or "kv_length" not in kwargs:
        return False
    if "q_length" in kwargs:
        return kwargs["q_length"] == kwargs["kv_length"]
    positions = kwargs.get("cache_position")
    return isinstance(positions, torch.Tensor) and positions.shape[0] == kwargs["kv_length"]


def _registry_function(name):
    """transformers' attention function of that name now (a user's registration included)."""
    return sys.modules["transformers.modeling_utils"].AttentionInterface._global_mapping[name]


def _mask_function(name):
    """transformers' mask function of that name now."""
    return sys.modules["transformers.masking_utils"].AttentionMaskInterface._global_mapping[name]


def _install_route(target, build, slot):
    """The route's ledger entries: the method that decides per model, and the two registry entries of
    ``flash_attention_2`` (attention and mask functions) that decide per call for the routed models
    (``_build_route``). All or none; ``disable()`` puts back what each held."""
    import importlib

    route = build(target.stock)
    logging.getLogger("transformers.modeling_flash_attention_utils").addFilter(_CALL)  # once: a set
    entries = [
        slot(target.owner, target.attr, target.current, route, target.had_own, target.where, path=target.path)
    ]
    registries = (
        ("transformers.modeling_utils", "AttentionInterface", "ALL_ATTENTION_FUNCTIONS", "attention"),
        ("transformers.masking_utils", "AttentionMaskInterface", "ALL_MASK_ATTENTION_FUNCTIONS", "mask"),
    )
    for module, interface, shown, kind in registries:
        registry = getattr(importlib.import_module(module), interface)._global_mapping
        current = registry.get(_ROUTED)
        if current is None:
            continue
        where = f"{shown}[{_ROUTED!r}]"
        entries.append(
            slot(registry, _ROUTED, current, route.per_call[kind](current), True, where, plumbing=True)
        )
    mixin = importlib.import_module("transformers.generation.utils").GenerationMixin
    prepare = mixin.__dict__.get("prepare_inputs_for_generation")
    if prepare is not None:
        where = "transformers.generation.utils:GenerationMixin.prepare_inputs_for_generation"
        wrapped = route.per_call["generation"](prepare)
        name = "prepare_inputs_for_generation"
        entries.append(slot(mixin, name, prepare, wrapped, True, where, plumbing=True))
    return entries


def _probe_route(stock, candidate):
    """The stock method must be transformers' default-picking one: ``(requested_attention,
    is_init_check)``, turning ``None`` into ``"sdpa"`` (read in its constants)."""
    wrong = signature_reason(stock, _GET_CORRECT)
    if wrong:
        return wrong
    code = getattr(stock, "__code__", None)
    if code is None or "sdpa" not in code.co_consts:
        return "the stock method does not pick sdpa for a model that asks for nothing"
    return None


def _refresh_routed():
    """After the route is swapped in or out: the configs it routed follow (FA2 while it is in place,
    stock's default after disable() or with the switch off), unless their implementation was changed
    since (``set_attn_implementation``: the user's choice, left alone)."""
    utils = sys.modules.get("transformers.modeling_utils")
    method = getattr(getattr(utils, "PreTrainedModel", None), "get_correct_attn_implementation", None)
    routing = getattr(method, "__module__", None) == __name__
    routed = CHOICES.routed()
    for config, stock_choice in routed:
        now, then = (stock_choice, _ROUTED) if routing else (_ROUTED, stock_choice)
        if config._attn_implementation_internal == now:
            config._attn_implementation_internal = then
    _portable({type(config) for config, _choice in routed}, on=routing)


DEFAULT_ATTENTION = Kernel(
    "default_attention",
    (),
    variants=(Variant("flash_attention_2", _build_route, _probe_route),),
    install=_install_route,
    refresh=_refresh_routed,
    switch="default_attention",
    switched_on=True,
)
