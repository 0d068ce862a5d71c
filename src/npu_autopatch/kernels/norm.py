"""RMSNorm kernels on ``npu_rms_norm``.

Llama style: y = weight * (x * rsqrt(mean(x^2) + eps)).to(input dtype), eps in
``variance_epsilon``. npu_rms_norm computes in fp32 and rounds once at the end, so in bf16
the result may differ from stock in the last bit (the parity tests allow for that).
"""

import torch

from ._probe import agree, fake_module, generator, randn
from .base import Kernel, Variant


def _build_llama(stock, npu):
    float32 = torch.float32

    def forward(self, hidden_states):
        weight = self.weight
        if weight.dtype == hidden_states.dtype:
            return npu.npu_rms_norm(hidden_states, weight, epsilon=self.variance_epsilon)[0]
        if weight.dtype == float32:
            # Mixed precision (bf16/fp16 activations, fp32 weight) is a supported pair; stock
            # promotes the product to fp32, so we return fp32 too.
            return npu.npu_rms_norm(hidden_states, weight, epsilon=self.variance_epsilon)[0].to(float32)
        dtype = torch.promote_types(hidden_states.dtype, weight.dtype)
        return npu.npu_rms_norm(hidden_states.to(dtype), weight.to(dtype), epsilon=self.variance_epsilon)[0]

    return forward


def _probe_llama(stock, candidate):
    gen = generator()
    norm = fake_module(weight=torch.nn.Parameter(randn(gen, 16)), variance_epsilon=1e-6)
    x = randn(gen, 2, 3, 16)
    return agree(lambda: stock(norm, x), lambda: candidate(norm, x))


RMS_NORM = Kernel("rms_norm", ("npu_rms_norm",), (Variant("llama", _build_llama, _probe_llama),))
