"""The device's limits for npu_fusion_attention, and what a call is remembered by when the op raised.

A call outside the op's documented limits runs unfused without asking the op; a shape class the op
raised on runs unfused from then on (``_fused_or_why``, read by the fused functions for every call).
"""

import torch

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
