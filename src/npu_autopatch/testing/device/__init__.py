"""The device model: what one torch_npu release on one Atlas A2 chip computes and refuses, op by op.

Read from the sources (op-plugin, torch_npu, the CANN kernels' tiling), each rule citing its file:

- ``profiles.py``: the release lines (which ops, with which schema, and which backward op each has);
- ``ops.py``: the ops the kernels call (checks on top of ``kernels._reference``'s math, backward math,
  fake kernels);
- ``attention.py``: ``npu_fusion_attention`` and its grad, modelled for the attention kernel (issue 18);
- ``autograd.py``: the ``derivatives.yaml`` formulas that join an op to its backward op;
- ``work.py``: the attention work accounting (``attention_work()``: score elements computed, per path);
- ``common.py``: how every op refuses a call and allocates.

The harness that installs it as ``torch_npu`` and counts the calls is the package above
(``testing.stand_in``, ``testing._library``). Only ``profiles`` and ``work`` are imported with this package:
they must stay torch-free, as ``testing`` is loaded by every pytest run through the plugin entry point.
"""

from .profiles import DEFAULT, PROFILES, Profile
from .work import AttentionCall, AttentionWork, attention_work, computed_elements

__all__ = [
    "DEFAULT",
    "PROFILES",
    "AttentionCall",
    "AttentionWork",
    "Profile",
    "attention_work",
    "computed_elements",
]
