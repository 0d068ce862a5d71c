"""aten's ``gelu`` on the NPU: the tanh approximation, whatever ``approximate`` says.

op-plugin registers its own kernel for aten's ``gelu`` (``gelu.out`` from 26.0.0) and ``gelu_backward``.
On every branch the stand-in's profiles model it calls ``aclnnGelu(self, out)`` / ``aclnnGeluBackward(
grad_output, self, grad_input)``, which take no ``approximate``: 7.1.0 and 7.2.0 generate them from
op_plugin_functions.yaml (``exec: aclnnGelu, self, out``); 7.3.0 (``op_plugin/ops/opapi/
GeluKernelNpuOpApi.cpp``), 26.0.0, 26.1.0 and master (``GeluOutKernelNpuOpApi.cpp``,
``GeluBackwardKernelNpuOpApi.cpp``) do so unless ``at_npu::native::env::CheckCompatibleImpl()`` holds
(26.1.0 and master: or ``c10_npu::IsAclnnOnly()``), and then call aclnnGeluV2/aclnnGeluBackwardV2 with
it; the acl_op fallback (``aclops/GeluKernelNpu.cpp``) drops it too. torch_npu-npu_gelu.md (7.1.0 on):
with torch's own gelu on the NPU "approximate has no effect and defaults to tanh". So a model trained
with exact GELU (``hidden_act="gelu"``) computes the tanh form on the device unless patched.

Not modelled: the compatible mode (off by default) and ``IsAclnnOnly()``, whose definition (in
Ascend/pytorch) was not read: whether the Ascend 950 honours ``approximate`` is unknown, and the 950
profile computes tanh as the A2 does.

Unlike torch_npu's sdpa (sdpa.py), ``stand_in()`` does not install this by default: the parity harness
compares a patched model with stock on the CPU, the math the model was trained with, and a stock tower
computing the tanh form would differ from it by the approximation itself (its error is what this module
exists to show). ``aten_gelu()`` installs it for one block; enter it after enable(), so that the probes
(which compare with the CPU's math) have run. Code that bound ``torch.nn.functional.gelu`` earlier keeps
torch's; transformers' ``GELUActivation`` binds it when built, so build the model inside.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch.nn.functional as F
from torch import Tensor


def _device_gelu(torch_gelu):
    @functools.wraps(torch_gelu)  # __wrapped__: torch's gelu, which a GELU module on the device calls
    def gelu(input: Tensor, approximate: str = "none") -> Tensor:
        return torch_gelu(input, approximate="tanh")

    return gelu


@contextlib.contextmanager
def aten_gelu() -> Iterator[None]:
    """``torch.nn.functional.gelu`` is the device's meanwhile: the tanh form whatever ``approximate`` says."""
    previous = F.gelu
    F.gelu = _device_gelu(previous)
    try:
        yield
    finally:
        F.gelu = previous
