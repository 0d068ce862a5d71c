"""How the device differentiates its ops: per op, the formula of ``derivatives.yaml`` through its backward op.

Each entry takes the registered backward op of the profile and its name (``npu_rms_norm_backward``,
or for the token ops the release's ``*_grad`` or ``*_grad_v2``) and gives the (setup_context, backward) pair
that ``torch.library.register_autograd`` takes. Which op has which backward op, per release line,
is the profile's ``autograd`` mapping (profiles.py); an op without one gets torch's autograd
fallback, which does what torch_npu's VariableFallbackKernel.cpp does: warn, and give no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .attention import FA_OPTION_NAMES

Formula = tuple[Callable[..., None], Callable[..., tuple]]  # (setup_context, backward)


def _rms_norm(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    def setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(inputs[0], inputs[1], output[1])
        ctx.mark_non_differentiable(output[1])  # derivatives.yaml: output_differentiability [true, false]

    def backward(ctx: Any, dy: torch.Tensor, _drstd: Any) -> tuple:
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = grad_op(dy, x, gamma, rstd)
        return dx, dgamma.to(gamma.dtype), None  # the kernel's dgamma is fp32; gamma gets its own dtype

    return setup, backward


def _swiglu(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.dim = inputs[1]

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        return grad_op(grad, x, ctx.dim), None

    return setup, backward


def _gelu(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    def setup(ctx: Any, inputs: tuple, output: torch.Tensor, keyword_only_inputs: dict) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.approximate = keyword_only_inputs["approximate"]  # keyword-only in the schema

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        return (grad_op(grad, x, approximate=ctx.approximate),)

    return setup, backward


def _fast_gelu(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        return (grad_op(grad, x),)

    return setup, backward


def _geglu(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    def setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(inputs[0], output[1])  # derivatives.yaml passes result1, the gelu
        ctx.mark_non_differentiable(output[1])  # output_differentiability [true, false]
        ctx.options = inputs[1:]

    def backward(ctx: Any, grad: torch.Tensor, _dgelu: Any) -> tuple:
        x, gelu = ctx.saved_tensors
        return grad_op(grad, x, gelu, *ctx.options), None, None, None

    return setup, backward


def _rotary_mul(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, r1, r2, mode = inputs[:4]
        ctx.save_for_backward(x, r1, r2)
        ctx.mode, ctx.n_inputs = mode, len(inputs)
        # derivatives.yaml marks rotate non_differentiable while npu_rotary_mul_backward cannot take it:
        # the gradient through a rotate matrix would be wrong, and the docs say it is not supported.
        ctx.rotated = len(inputs) > 4 and inputs[4] is not None

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.rotated:
            raise RuntimeError("npu_rotary_mul: backward is not supported when a rotate matrix is given")
        x, r1, r2 = ctx.saved_tensors
        dx, dr1, dr2 = grad_op(grad, x, r1, r2, ctx.mode)
        return (dx, dr1.to(r1.dtype), dr2.to(r2.dtype), *([None] * (ctx.n_inputs - 3)))

    return setup, backward


# npu_fusion_attention's arguments in schema order, and those its grad op takes as keywords.
_FA_INPUTS = ("query", "key", "value", "head_num", "input_layout", *FA_OPTION_NAMES)
_FA_TO_GRAD = {"scale": "scale_value"}
_FA_SINK = _FA_INPUTS.index("sink")


def _fusion_attention(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    grad_arguments = {argument.name for argument in grad_op.default._schema.arguments}

    def setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        given = dict(zip(_FA_INPUTS, inputs, strict=False))
        out, softmax_max, softmax_sum, softmax_out, seed, offset, numels = output
        ctx.save_for_backward(
            given["query"], given["key"], given["value"], given["pse"], given["atten_mask"],
            out, softmax_max, softmax_sum, softmax_out,
        )  # fmt: skip
        options = {_FA_TO_GRAD.get(k, k): v for k, v in given.items() if k not in ("query", "key", "value")}
        options.update(seed=seed, offset=offset, numels=numels)
        ctx.options = {
            k: v for k, v in options.items() if k in grad_arguments and k not in ("pse", "atten_mask")
        }
        ctx.n_inputs = len(inputs)

    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> tuple:
        q, k, v, pse, mask, out, softmax_max, softmax_sum, softmax_out = ctx.saved_tensors
        options = dict(ctx.options)
        head_num, layout = options.pop("head_num"), options.pop("input_layout")
        grads = grad_op(
            q, k, v, grad, head_num, layout,
            pse=pse, atten_mask=mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
            softmax_in=softmax_out, attention_in=out, **options,
        )  # fmt: skip
        dq, dk, dv, dpse = grads[:4]
        result = [None] * ctx.n_inputs
        result[0], result[1], result[2], result[5] = dq, dk, dv, dpse
        if len(grads) > 4 and ctx.n_inputs > _FA_SINK:  # derivatives.yaml (7.3.0 on): sink gets grads[4]
            result[_FA_SINK] = grads[4]
        return tuple(result)

    return setup, backward


def _permute(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    v2 = backward_name.endswith("_v2")

    def setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        tokens, indices, _num_out_tokens, padded_mode = inputs
        ctx.save_for_backward(tokens, indices, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.padded_mode = padded_mode

    def backward(ctx: Any, grad: torch.Tensor, _dsorted: Any) -> tuple:
        tokens, indices, sorted_indices = ctx.saved_tensors
        if v2:  # derivatives.yaml (26.1.0, master)
            topk = 1 if indices.dim() == 1 else indices.shape[-1]
            dtokens = grad_op(grad, sorted_indices, tokens.shape[0], tokens.dtype, topk, ctx.padded_mode)
        else:  # derivatives.yaml (7.2.0 to 26.0.0)
            dtokens = grad_op(tokens, grad, indices, sorted_indices, ctx.padded_mode)
        return dtokens, None, None, None

    return setup, backward


def _unpermute(grad_op: Callable[..., Any], backward_name: str) -> Formula:
    v2 = backward_name.endswith("_v2")

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        permuted, sorted_indices, probs, padded_mode, restore_shape = inputs
        ctx.save_for_backward(permuted, sorted_indices, probs)
        ctx.padded_mode, ctx.restore_shape = padded_mode, restore_shape

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        permuted, sorted_indices, probs = ctx.saved_tensors
        if v2:  # derivatives.yaml (master), through _npu_moe_token_unpermute
            dpermuted, dprobs = grad_op(
                grad, sorted_indices, permuted.shape[0], permuted.dtype, probs,
                ctx.padded_mode, ctx.restore_shape, permuted,
            )  # fmt: skip
        else:  # derivatives.yaml (7.2.0 to 26.1.0)
            dpermuted, dprobs = grad_op(
                permuted, grad, sorted_indices, probs, ctx.padded_mode, ctx.restore_shape
            )
        return dpermuted, None, dprobs if probs is not None else None, None, None

    return setup, backward


FORMULAS: dict[str, Callable[[Callable[..., Any], str], Formula]] = {
    "npu_rms_norm": _rms_norm,
    "npu_swiglu": _swiglu,
    "npu_rotary_mul": _rotary_mul,
    "npu_gelu": _gelu,
    "npu_fast_gelu": _fast_gelu,
    "npu_geglu": _geglu,
    "npu_fusion_attention": _fusion_attention,
    "npu_moe_token_permute": _permute,
    "npu_moe_token_unpermute": _unpermute,
}
