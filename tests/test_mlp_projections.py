"""The gated MLP kernels' two paths to the fused activation (kernels/mlp.py).

Plain ``nn.Linear`` gate and up projections write the halves of one [2, T, I] buffer that
npu_swiglu / npu_geglu read along dim 0: no [T, 2I] concatenation in the forward, x's gradient
from one matmul and one addmm, each weight's gradient in its own layout. Anything else (LoRA,
a hooked projection) calls the modules and concatenates their outputs, as before: equal
to stock, and the LoRA adapters and hooks see their calls. Under autocast the buffer is in autocast's
dtype, as F.linear's outputs would be.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import npu_autopatch
from npu_autopatch.testing.parity import forward_backward, relative_error, tiny_model

# (model type, kernel, fused op): a SiLU MLP (swiglu) and Gemma's gated GELU (geglu).
MODELS = pytest.mark.parametrize(
    ("model_type", "kernel", "op"),
    [("qwen3", "swiglu", "npu_swiglu"), ("gemma", "geglu", "npu_geglu")],
    ids=["swiglu", "geglu"],
)


class Ops(TorchDispatchMode):
    """The aten ops dispatched, by name, with their outputs' shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = [tuple(t.shape) for t in outs if isinstance(t, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, shapes))
        return out


def step(model, kernel=None):
    """(logits, gradients, the ops of the step) of one training step, patched with ``kernel`` alone."""
    torch.manual_seed(1)
    input_ids = torch.randint(0, 100, (2, 7))
    if kernel is not None:
        npu_autopatch.enable(kernels=[kernel])
    try:
        with Ops() as ops:
            logits, grads = forward_backward(model, input_ids, input_ids)
    finally:
        if kernel is not None:
            npu_autopatch.disable()
    return logits, grads, ops.ops


def assert_equal_to_stock(stock, patched):
    (stock_logits, stock_grads, _), (logits, grads, _) = stock, patched
    assert relative_error(logits, stock_logits) <= 1e-4
    assert [n for n, g in grads.items() if g is None] == [n for n, g in stock_grads.items() if g is None]
    for name, expected in stock_grads.items():
        if expected is not None:
            assert relative_error(grads[name], expected) <= 1e-4, name


def intermediate(model):
    return model.config.intermediate_size


def concatenations(ops, size):
    """The [..., 2I] concatenations of a step: the copy the plain path avoids."""
    return [shapes for name, shapes in ops if name == "cat" and any(s[-1:] == (2 * size,) for s in shapes)]


@MODELS
def test_plain_projections_write_one_buffer_with_no_concatenation(model_type, kernel, op, npu_stand_in):
    model = tiny_model(model_type)
    stock = step(model)
    calls = npu_stand_in.calls[op]
    patched = step(model, kernel)
    assert npu_stand_in.calls[op] - calls == model.config.num_hidden_layers
    assert_equal_to_stock(stock, patched)
    assert not concatenations(patched[2], intermediate(model))
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            assert parameter.grad.stride() == parameter.stride(), name


@MODELS
def test_lora_on_gate_up_and_down_takes_the_modules_path_and_equals_stock(
    model_type, kernel, op, npu_stand_in
):
    peft = pytest.importorskip("peft")
    model = tiny_model(model_type)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(model, config)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # non-zero, so that the adapters change the output
            torch.nn.init.normal_(parameter, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    stock = step(model)
    calls = npu_stand_in.calls[op]
    patched = step(model, kernel)
    assert npu_stand_in.calls[op] - calls == model.config.num_hidden_layers
    assert_equal_to_stock(stock, patched)
    lora = [g for n, g in patched[1].items() if "lora_" in n]
    assert lora and all(g is not None and g.abs().sum() > 0 for g in lora)
    assert concatenations(patched[2], intermediate(model))  # the modules' outputs, joined


@MODELS
def test_a_hooked_projection_is_called_and_equals_stock(model_type, kernel, op, npu_stand_in):
    model = tiny_model(model_type)
    seen = []
    for layer in model.model.layers:
        layer.mlp.up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    stock = step(model)
    seen.clear()
    patched = step(model, kernel)
    assert len(seen) == model.config.num_hidden_layers
    assert_equal_to_stock(stock, patched)
    assert concatenations(patched[2], intermediate(model))


@MODELS
def test_under_autocast_the_one_buffer_is_in_autocasts_dtype_and_equals_stock(
    model_type, kernel, op, npu_stand_in
):
    """Autocast casts F.linear's inputs, weights and biases to its dtype: the one-buffer path does the same
    (fp32 weights, bf16 matmuls), with no concatenation, and each fp32 weight's gradient in its layout."""
    model = tiny_model(model_type)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 100, (2, 7))
    results = []
    for patch in (None, kernel):
        if patch:
            npu_autopatch.enable(kernels=[patch])
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16), Ops() as ops:
                logits, grads = forward_backward(model, input_ids, input_ids)
        finally:
            if patch:
                npu_autopatch.disable()
        results.append((logits, grads, ops.ops))
    (stock_logits, stock_grads, _), (logits, grads, ops) = results
    assert relative_error(logits, stock_logits) <= 4e-2
    for name, expected in stock_grads.items():
        if expected is not None:
            assert relative_error(grads[name], expected) <= 4e-2, name
    assert not concatenations(ops, intermediate(model))
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            assert parameter.grad.dtype == torch.float32 and parameter.grad.stride() == parameter.stride(), (
                name
            )
