"""torch_npu's ``scaled_dot_product_attention``: what ``F.scaled_dot_product_attention`` runs on an NPU.

torch_npu registers op-plugin's own kernel for aten's ``scaled_dot_product_attention`` on both PrivateUse1
and AutogradPrivateUse1, so upstream's composite (its backend choice, the sdp_kernel flags) never runs on
NPU tensors: op-plugin's ``op_plugin/ops/opapi/ScaledDotProductAttentionKernelNpuOpApi.cpp`` decides
between the fused FlashAttentionScore op and a decomposed math path. transformers' ``sdpa`` attention
(its default on every device) calls ``torch.nn.functional.scaled_dot_product_attention``, so while a
stand-in is installed that function is this model of op-plugin's kernel (``install``), for the stand-in's
profile's op-plugin branch (``Profile.sdpa``, profiles.py ``SdpaRules``). What every branch shares, with
7.2.0's lines (master's in brackets):

- checks (``validate_sdpa_input`` :36-64): q/k/v one dtype, at least 2-D; a mask is bool or the query's dtype;
- the fused branch (:223-228 [:285-291]): fp16/bf16/fp32, a bool mask or none, q/k/v 4-D (BNSD),
  Nq <= 2048, Nkv <= 2048, Nq % Nkv == 0 (GQA whatever ``enable_gqa`` says), head dim <= 512, and a SoC
  at least Ascend910B1 (every profile's is). It calls the fused op in layout BNSD with pre_tockens
  INT32_MAX and: ``is_causal`` -> a freshly built ``triu(ones(2048, 2048), 1)`` and sparse_mode 2
  (leftUpCausal), next_tockens 0; an explicit mask -> ``logical_not(mask)``, a new tensor, sparse_mode 0,
  next_tockens INT32_MAX, i.e. every block computed (:81-100, :247-257 [:75-90, :301-321]). The stand-in
  calls its own ``npu_fusion_attention`` (its checks, its backward through the grad op, its call counts and
  the work accounting apply); from 26.0.0 the device calls ``npu_fusion_attention_v3`` below Ascend950,
  with the same arguments;
- the fused-infer branch (:258-302): its conditions are a subset of the fused branch's, so it never runs;
- otherwise the math path (:303-306 [:369-372]): a bool mask becomes an additive float mask of the query's
  dtype (``convert_boolean_attn_mask_math``: zeros_like, masked_fill -inf), then aten's
  ``_scaled_dot_product_attention_math``.

Not modelled: op-plugin's compatible mode (``TORCH_NPU_USE_COMPATIBLE_IMPL``, off by default: master
forces math for ``sdpa_kernel(MATH)`` or head dims > 256), nested tensors, dropout on the fused branch (the
stand-in's fused op refuses keep_prob < 1).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import work
from .common import check

_TOKEN_MAX = 2147483647
_COMPRESSED = 2048  # ATTENMASK_LIMIT: the side of the causal mask built for is_causal
_N_LIMIT = 2048
_D_LIMIT = 512
_LEFT_UP_CAUSAL = 2
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _validate(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None) -> None:
    """validate_sdpa_input (7.2.0 :36-64)."""
    check(
        query.dtype == key.dtype == value.dtype,
        "Expected query, key, and value to have the same dtype, but got query.dtype: "
        f"{query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.",
    )
    check(
        query.dim() >= 2 and key.dim() >= 2 and value.dim() >= 2,
        "Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
        f"{query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.",
    )
    if attn_mask is not None:
        check(
            attn_mask.dtype in (torch.bool, query.dtype),
            "Expected attn_mask dtype to be bool or to match query dtype, but got attn_mask.dtype: "
            f"{attn_mask.dtype} and  query.dtype: {query.dtype} instead.",
        )


def _fused_branch(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None) -> bool:
    """The fused branch's condition (7.2.0 :223-228, master :285-291)."""
    return (
        query.dtype in _FUSED_DTYPES
        and (attn_mask is None or attn_mask.dtype == torch.bool)
        and query.dim() == key.dim() == value.dim() == 4
        and query.shape[1] <= _N_LIMIT
        and query.shape[3] <= _D_LIMIT
        and 0 < key.shape[1] <= _N_LIMIT
        and query.shape[1] % key.shape[1] == 0
    )


def _fp32_unaligned(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """master :267-273: fp32 with a last dim that is not a multiple of 4."""
    return query.dtype == torch.float32 and any(t.shape[-1] % 4 for t in (query, key, value))


def _expand_mask(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """preprocess_attn_mask_for_npu (26.1.0 on; master :98-143)."""
    b, n, sq, skv = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    target = (b, n, sq, skv)
    if not 2 <= mask.dim() <= 4 or any(
        m not in (1, t) for m, t in zip(mask.shape, target[-mask.dim() :], strict=True)
    ):
        return mask  # passed as is: the fused op's own checks decide
    if mask.dim() == 2:
        supported = tuple(mask.shape) == (sq, skv)
    elif mask.dim() == 4:
        supported = tuple(mask.shape[2:]) == (sq, skv) and (
            (mask.shape[0] == b and mask.shape[1] in (n, 1)) or (mask.shape[0] == 1 and mask.shape[1] == 1)
        )
    else:
        supported = False
    return mask if supported else mask.expand(target)


def _math(
    module: types.ModuleType,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """convert_boolean_attn_mask_math, then aten's math (7.2.0 :66-79, :303-306; master :369-372)."""
    mask, copied = attn_mask, 0
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        inverted = attn_mask.logical_not()
        mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(inverted, float("-inf"))
        copied = inverted.numel() * inverted.element_size() + mask.numel() * mask.element_size()
    gqa = enable_gqa and module.PROFILE.sdpa.math_takes_enable_gqa
    out = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=gqa
    )[0]
    if work.tallying() and not torch.compiler.is_compiling():
        work.record_sdpa(copied, 0)
        computed = out.numel() // max(out.shape[-1], 1) * key.shape[-2]
        work.record_call(work.AttentionCall(work.MATH, "BNSD", None, None, attn_mask is not None, computed))
    return out


def _fused(
    module: types.ModuleType,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> Tensor:
    """convert_boolean_attn_mask, then the fused op in BNSD (7.2.0 :81-100, :243-257; master :292-321)."""
    rules = module.PROFILE.sdpa
    copied = built = 0
    if is_causal:
        check(attn_mask is None, "The attn_mask should be none when is_causal is true, but got 1-value")
        atten_mask = torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool).triu(1)
        built = 2 * atten_mask.numel()  # at::ones, then the triu result
    elif attn_mask is not None:
        given = _expand_mask(attn_mask, query, key) if rules.expands_masks else attn_mask
        atten_mask = torch.logical_not(given)
        copied = atten_mask.numel()
    else:
        atten_mask = None
    inner_precise = 0
    if rules.masked_inner_precise and not is_causal and query.shape[2] > 1 and attn_mask is not None:
        inner_precise = 2
    if work.tallying() and not torch.compiler.is_compiling():
        work.record_sdpa(copied, built)
    out = module.npu_fusion_attention(
        query,
        key,
        value,
        query.shape[1],
        "BNSD",
        atten_mask=atten_mask,
        scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else scale,
        keep_prob=1.0 - dropout_p,
        pre_tockens=_TOKEN_MAX,
        next_tockens=0 if is_causal else _TOKEN_MAX,
        inner_precise=inner_precise,
        sparse_mode=_LEFT_UP_CAUSAL if is_causal else 0,
    )
    return out[0]


def scaled_dot_product_attention(
    module: types.ModuleType,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """op-plugin's scaled_dot_product_attention for ``module``'s profile (the module docstring).

    Under autocast (CPU autocast stands for the device's here, as everywhere in the stand-in) the inputs are
    cast first: torch_npu lists the op as ``lower_precision_fp`` (Ascend/pytorch
    ``torch_npu/csrc/aten/AutoCastOps.cpp``), so every floating input but float64 takes the autocast dtype,
    and the op runs below autocast.
    """
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value, attn_mask = (
            t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (query, key, value, attn_mask)
        )
        with torch.autocast("cpu", enabled=False):
            return _dispatch(module, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _dispatch(module, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _dispatch(
    module: types.ModuleType,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """The branches of op-plugin's kernel, in its order."""
    rules = module.PROFILE.sdpa
    _validate(query, key, value, attn_mask)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale)
    if rules.fp32_unaligned_to_math and _fp32_unaligned(query, key, value):
        return _math(module, *args, enable_gqa)
    if not _fused_branch(query, key, value, attn_mask):
        return _math(module, *args, enable_gqa)
    if rules.odd_rank_mask_to_math and attn_mask is not None and attn_mask.dim() not in (2, 4):
        return _math(module, *args, enable_gqa)
    return _fused(module, *args)


def install(module: types.ModuleType) -> Callable[[], None]:
    """Make ``torch.nn.functional.scaled_dot_product_attention`` torch_npu's, for ``module``'s profile.

    Returns the function that puts back exactly what was there. Code that bound the function before
    (``from torch.nn.functional import scaled_dot_product_attention``) keeps torch's; transformers looks
    it up at every call.
    """
    previous = F.scaled_dot_product_attention

    def npu_scaled_dot_product_attention(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        return scaled_dot_product_attention(
            module, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )

    F.scaled_dot_product_attention = npu_scaled_dot_product_attention

    def restore() -> None:
        F.scaled_dot_product_attention = previous

    return restore
