"""transformers' side of FA2 on the NPU, beyond the two fused functions: a model listing hub kernels
keeps FA2 (``keep_fa2``), a padded batch is unpadded once per mask (``unpad_once``), transformers' cache
of the functions it loaded follows each swap, and report()'s rows say what computes each attention.
"""

import inspect
import sys
from dataclasses import dataclass

import torch

from .._probe import agree, first_disagreement, signature_reason
from . import _fused
from ._choices import _chosen
from ._fused import _PerTensor

_CHOICE = ("self", "attn_implementation", "is_init_check", "allow_all_kernels")
_HUB_LIST = "_compatible_flash_implementations"
_INTEGRATION = "transformers.integrations.npu_flash_attention"


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
    if home == _fused.__name__:
        record = records.get("npu_flash_attention")
        variants = ", ".join(sorted(set(record.variants.values()))) if record is not None else "?"
        failed = record is not None and record.code == "op-failed"  # status()'s ReasonCode.OP_FAILED
        how = "fused op given up for some shapes: unfused there" if failed else variants
        return f"FA2 on the NPU, patched (attention kernel: {how})"
    if home == integration.__name__:
        return "FA2 on the NPU, stock (drops sliding windows and sinks)"
    return f"FA2 on the NPU, foreign ({home}.{getattr(function, '__qualname__', '?')})"
