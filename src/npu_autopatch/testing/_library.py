"""The stand-in's ops as torch.library custom ops, one namespace per profile, as torch_npu registers its own.

Registered ops are opaque to torch.compile and torch.export: dynamo calls them as they are and traces
their fake (meta) kernels, as it does torch_npu's ``torch.ops.npu.*``, so a compiled patched model
neither recompiles per call nor traces into the stand-in's Python. Each profile gets its own
namespace (``torch.ops.npu_standin_<profile>``) because the profiles differ in schemas and in which
ops have a backward; the device's own namespace, ``npu``, is never used, so that the stand-in cannot
collide with a real torch_npu.

Calls are counted inside the CPU kernels, at run time, into the ``calls`` Counter of every live
stand-in module of the profile: the count is what ran, compiled or not.

Autograd per profile: an op with a backward op gets a registered autograd formula that calls that
backward op (counted too); an op listed as raising gets a backward that raises, as op-plugin's
AutogradErrorFallback.cpp; an op without either gets nothing, and torch's own autograd fallback does
what torch_npu's VariableFallbackKernel.cpp does: warn, and give no gradient.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import _ops
from ._profiles import RAISES, Profile

_REQUIRED = object()
_lock = threading.Lock()
_registrations: dict[str, Registration] = {}


class Registration:
    """The ops of one profile, registered once per process."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.namespace = profile.namespace
        self.modules: weakref.WeakSet[types.ModuleType] = weakref.WeakSet()  # live stand-ins
        self.library = torch.library.Library(self.namespace, "DEF")
        for name, schema in profile.schemas.items():
            self.library.define(schema)
            definition = _ops.OP_DEFS[name]
            arguments = self.op(name).default._schema.arguments
            self.library.impl(name, self._kernel(name, definition.impl, arguments), "CPU")
            torch.library.register_fake(
                f"{self.namespace}::{name}", self._fake(definition.fake, arguments), lib=self.library
            )
        for name, backward in profile.autograd.items():
            setup, formula = (_raises if backward == RAISES else _FORMULAS[name])(self, name, backward)
            torch.library.register_autograd(
                f"{self.namespace}::{name}", formula, setup_context=setup, lib=self.library
            )

    def op(self, name: str) -> Any:
        """The registered op (an OpOverloadPacket), as torch_npu exposes ``torch.ops.npu.<name>``."""
        return getattr(getattr(torch.ops, self.namespace), name)

    def _kernel(self, name: str, impl: Callable[..., Any], arguments: list) -> Callable[..., Any]:
        profile, modules, values_of = self.profile, self.modules, _binder(arguments)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            for module in list(modules):
                module.calls[name] += 1
            # The device computes below autograd: whatever happens here records no graph. Its outputs
            # are fresh contiguous allocations, as the fake kernels say (the in-place
            # npu_apply_rotary_pos_emb returns its inputs themselves).
            with torch.no_grad():
                result = impl(profile, *values_of(args, kwargs))
            return result if name == "npu_apply_rotary_pos_emb" else _contiguous(result)

        return kernel

    def _fake(self, fake: Callable[..., Any], arguments: list) -> Callable[..., Any]:
        profile, values_of = self.profile, _binder(arguments)

        def fake_kernel(*args: Any, **kwargs: Any) -> Any:
            return fake(profile, *values_of(args, kwargs))

        return fake_kernel


def _binder(arguments: list) -> Callable[[tuple, dict], list]:
    """A function giving every schema argument's value in schema order, defaults filled in.

    torch calls a Python kernel with only the arguments the caller passed, and the defaults of a
    profile's schema (e.g. init_routing_v2's quant_mode) are the profile's, not the kernel's.
    """
    names = [argument.name for argument in arguments]
    defaults = [
        argument.default_value if argument.has_default_value() else _REQUIRED for argument in arguments
    ]

    def values_of(args: tuple, kwargs: dict) -> list:
        values = list(args)
        for name, default in zip(names[len(args) :], defaults[len(args) :], strict=True):
            value = kwargs.get(name, default)
            if value is _REQUIRED:
                raise TypeError(f"missing required argument {name!r}")
            values.append(value)
        return values

    return values_of


def _contiguous(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return result.contiguous()
    if isinstance(result, (tuple, list)):
        return type(result)(_contiguous(r) for r in result)
    return result


def registration(profile: Profile) -> Registration:
    """The registered ops of ``profile`` (registered at the first call, once per process)."""
    with _lock:
        found = _registrations.get(profile.name)
        if found is None:
            found = _registrations[profile.name] = Registration(profile)
        return found


# --- autograd formulas: (setup_context, backward) per op ------------------------------------------


def _raises(reg: Registration, name: str, backward_op: str) -> tuple:
    message = _ops.not_implemented_message(name)

    def backward(ctx: Any, *grads: Any) -> tuple:
        raise RuntimeError(message)

    return None, backward


def _rms_norm(reg: Registration, name: str, backward_op: str) -> tuple:
    grad_op = reg.op(backward_op)

    def setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(inputs[0], inputs[1], output[1])
        ctx.mark_non_differentiable(output[1])  # derivatives.yaml: output_differentiability [true, false]

    def backward(ctx: Any, dy: torch.Tensor, _drstd: Any) -> tuple:
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = grad_op(dy, x, gamma, rstd)
        return dx, dgamma.to(gamma.dtype), None  # the kernel's dgamma is fp32; gamma gets its own dtype

    return setup, backward


def _swiglu(reg: Registration, name: str, backward_op: str) -> tuple:
    grad_op = reg.op(backward_op)

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.dim = inputs[1]

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        return grad_op(grad, x, ctx.dim), None

    return setup, backward


def _rotary_mul(reg: Registration, name: str, backward_op: str) -> tuple:
    grad_op = reg.op(backward_op)

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
_FA_INPUTS = ("query", "key", "value", "head_num", "input_layout", *_ops._FA_OPTION_NAMES)
_FA_TO_GRAD = {"scale": "scale_value"}


def _fusion_attention(reg: Registration, name: str, backward_op: str) -> tuple:
    grad_op = reg.op(backward_op)
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
        return tuple(result)

    return setup, backward


def _permute(reg: Registration, name: str, backward_op: str) -> tuple:
    grad_op = reg.op(backward_op)
    v2 = backward_op.endswith("_v2")

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


def _unpermute(reg: Registration, name: str, backward_op: str) -> tuple:
    grad_op = reg.op(backward_op)
    v2 = backward_op.endswith("_v2")

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


_FORMULAS = {
    "npu_rms_norm": _rms_norm,
    "npu_swiglu": _swiglu,
    "npu_rotary_mul": _rotary_mul,
    "npu_fusion_attention": _fusion_attention,
    "npu_moe_token_permute": _permute,
    "npu_moe_token_unpermute": _unpermute,
}
