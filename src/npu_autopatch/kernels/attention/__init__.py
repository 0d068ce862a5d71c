"""Attention on the NPU: transformers' flash-attention path on npu_fusion_attention, and transformers'
default attention sent there. Two kernels, declared here; each room holds one idea:

- ``_fused``: the fused op's calls, transformers' Ascend ``npu_flash_attn_func`` (BSND) and
  ``npu_flash_attn_varlen_func`` (TND) made to honour sliding windows, sinks and softcap, their
  unfused math, the one host copy of the sequence ends per tensor, and the probes against eager;
- ``_limits``: what the device's op takes (dtype, head dim, heads) and the shape classes it refused;
- ``_integration``: transformers' side of FA2 on the NPU (a model listing hub kernels keeps FA2, a
  padded batch unpadded once per mask, transformers' cache of the functions, report()'s rows);
- ``_route``: the default route (``default_attention``): the decision per model and per call (registry
  slots, generate's masks, ``torch.compile``);
- ``_choices``: the record of that decision per model config, and its reasons.
"""

from ..._types import Kernel, Report, Variant
from .._requirements import sink_requirement
from ._fused import _build_dense, _build_varlen, _probe_dense, _probe_varlen, _unfused_sinks
from ._integration import (
    _build_choice,
    _build_unpad_once,
    _probe_choice,
    _probe_unpad_once,
    _refresh_transformers_cache,
    _report_rows,
)
from ._route import _build_route, _install_route, _probe_route, _refresh_routed

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


DEFAULT_ATTENTION = Kernel(
    "default_attention",
    (),
    variants=(Variant("flash_attention_2", _build_route, _probe_route),),
    install=_install_route,
    refresh=_refresh_routed,
    switch="default_attention",
    switched_on=True,
)
