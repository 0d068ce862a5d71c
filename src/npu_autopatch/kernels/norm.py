"""RMSNorm kernels on ``npu_rms_norm``.

Two formula families, told apart by probing, never by class name:

- llama style: y = weight * (x * rsqrt(mean(x^2) + eps)).to(input dtype), eps in
  ``variance_epsilon``. npu_rms_norm computes in fp32 and rounds once at the end, so in bf16
  the result may differ from stock in the last bit (the parity tests allow for that).
- zero-centred (Gemma3, Qwen3-Next, Qwen3.5): y = (x * rsqrt(mean(x^2) + eps) * (1 + weight)),
  all in fp32, cast to the input dtype at the end; eps in ``eps``, forward parameter ``x``.
  That is npu_rms_norm with gamma = 1 + weight in fp32, in the same order, so it matches stock
  to fp32 rounding in every dtype. (npu_gemma_rms_norm computes the same forward but has no
  autograd kernel: the weights would silently get no gradient.)
- cast once (DeepSeek-V4, OLMo 2/3): y = (weight * (x * rsqrt(mean(x^2) + eps)) in fp32).to(input
  dtype), eps in ``variance_epsilon``: the weight stays fp32 (``_keep_in_fp32_modules``) and the
  product is rounded once, so a bf16 model keeps bf16 activations. That is npu_rms_norm with an
  fp32 gamma; the llama form instead promotes to fp32 there, as its stock does.

The probes compare fp32, then bf16 activations with an fp32 weight (what from_pretrained leaves
for kept-in-fp32 norms), for the output dtype. A forward with any parameter besides its input
(the 4.57 gated norms' ``gate=None``) is refused: the replacement would drop it.

The gated norm of the linear-attention layers (``*RMSNormGated.forward(hidden_states, gate)``)
is the llama-style norm times silu(gate) in fp32, cast to the input dtype.
"""

import torch

from .._types import Kernel, Pattern, Variant
from ._calls import counters
from ._probe import (
    BFLOAT16,
    MIXED_TOLERANCE,
    agree_strict,
    first_disagreement,
    generator,
    instance,
    one_input,
    parameters,
    randn,
    with_stock_names,
)


def _build_llama(stock, npu, on_error):
    float32 = torch.float32
    count_fused, _ = counters(on_error)

    def forward(self, hidden_states):
        weight, eps = self.weight, self.variance_epsilon
        try:
            if weight.dtype == hidden_states.dtype:
                out = npu.npu_rms_norm(hidden_states, weight, epsilon=eps)[0]
            elif weight.dtype == float32:
                # Mixed precision (bf16/fp16 activations, fp32 weight) is a supported pair; stock
                # promotes the product to fp32, so we return fp32 too.
                out = npu.npu_rms_norm(hidden_states, weight, epsilon=eps)[0].to(float32)
            else:
                dtype = torch.promote_types(hidden_states.dtype, weight.dtype)
                out = npu.npu_rms_norm(hidden_states.to(dtype), weight.to(dtype), epsilon=eps)[0]
        except Exception as exc:
            on_error(exc, hidden_states, weight)
            return stock(self, hidden_states)
        count_fused()
        return out

    return with_stock_names(forward, stock)


def _probe_norm(stock, candidate, **eps):
    """fp32 against stock, then bf16 input with the fp32 weight: same math, same output dtype."""
    wrong = one_input(stock)
    if wrong:
        return wrong
    gen = generator()
    # The real class, so that the stock forward finds its own methods (Gemma3's ``_norm``); a
    # random weight, as (1 + weight) and weight only agree where weight is zero.
    norm = instance(stock, weight=torch.nn.Parameter(randn(gen, 16)), **eps)
    x = randn(gen, 2, 3, 16)
    mixed = x.to(BFLOAT16)
    return first_disagreement(
        agree_strict(lambda: stock(norm, x), lambda: candidate(norm, x)),
        agree_strict(lambda: stock(norm, mixed), lambda: candidate(norm, mixed), **MIXED_TOLERANCE),
    )


def _probe_llama(stock, candidate):
    return _probe_norm(stock, candidate, variance_epsilon=1e-6)


def _build_cast_once(stock, npu, on_error):
    count_fused, _ = counters(on_error)

    def forward(self, hidden_states):
        weight = self.weight
        try:
            out = npu.npu_rms_norm(hidden_states, weight.float(), epsilon=self.variance_epsilon)[0]
        except Exception as exc:
            on_error(exc, hidden_states, weight)
            return stock(self, hidden_states)
        count_fused()
        return out

    return with_stock_names(forward, stock)


def _build_zero_centred(stock, npu, on_error):
    count_fused, _ = counters(on_error)

    def forward(self, x):
        # gamma is fp32 whatever the weight dtype: (x dtype, fp32) is a supported pair for every
        # float x, and the product is rounded once, after the multiply, as stock does.
        weight, eps = self.weight, self.eps
        try:
            out = npu.npu_rms_norm(x, 1.0 + weight.float(), epsilon=eps)[0]
        except Exception as exc:
            on_error(exc, x, weight)
            return stock(self, x)
        count_fused()
        return out

    return with_stock_names(forward, stock)


def _probe_zero_centred(stock, candidate):
    return _probe_norm(stock, candidate, eps=1e-6)


# Every RMSNorm-looking class is a candidate of both norm kernels: the plain one is tried first.
NORMS = Pattern("norm", classes=r"RMSNorm")

RMS_NORM = Kernel(
    "rms_norm",
    ("npu_rms_norm",),
    (
        Variant("llama", _build_llama, _probe_llama),
        Variant("zero-centred", _build_zero_centred, _probe_zero_centred),
        Variant("cast-once", _build_cast_once, _probe_llama),
    ),
    candidates=(NORMS,),
)


def _build_gated(stock, npu, on_error):
    float32 = torch.float32
    promote = torch.promote_types
    silu = torch.nn.functional.silu
    count_fused, count_stock = counters(on_error)

    def forward(self, hidden_states, gate):
        # 5.x reads the activation from the instance; 4.57 has no attribute and always uses silu.
        activation = getattr(self, "activation", "silu")
        if activation != "silu":
            count_stock(f"activation {activation}", hidden_states)
            return stock(self, hidden_states, gate)
        input_dtype = hidden_states.dtype
        weight, eps = self.weight, self.variance_epsilon
        try:
            x, gamma = hidden_states, weight
            if gamma.dtype != input_dtype and gamma.dtype != float32:  # not a supported dtype pair
                dtype = promote(input_dtype, gamma.dtype)
                x, gamma = x.to(dtype), gamma.to(dtype)
            normed = npu.npu_rms_norm(x, gamma, epsilon=eps)[0]
        except Exception as exc:
            on_error(exc, hidden_states, weight)
            return stock(self, hidden_states, gate)
        count_fused()
        return (normed * silu(gate.to(float32))).to(input_dtype)

    forward.__defaults__ = getattr(stock, "__defaults__", None)  # 4.57 has gate=None, 5.x requires it
    return forward


def _probe_gated(stock, candidate):
    params = parameters(stock)
    if params != ("self", "hidden_states", "gate"):
        return f"the signature {params} is not (self, hidden_states, gate)"
    gen = generator()
    weight = torch.nn.Parameter(randn(gen, 16))
    norm = instance(stock, weight=weight, variance_epsilon=1e-6, activation="silu")
    x, gate = randn(gen, 2, 3, 16), randn(gen, 2, 3, 16)
    return agree_strict(lambda: stock(norm, x, gate), lambda: candidate(norm, x, gate))


GATED_RMS_NORM = Kernel(
    "gated_rms_norm", ("npu_rms_norm",), (Variant("silu", _build_gated, _probe_gated),), candidates=(NORMS,)
)
