"""The last line of defence, the kernels' side (contract C1): a raising fused op costs one call, not a crash.

Each built-in replacement is built on a stand-in whose op raises (a device rule nobody knew): the call
returns exactly what the stock code returns, and ``on_error`` was called once with the exception and the
call's input tensors. What the patcher then does (stock for the rest of the process, status(), one
warning) is tested with the mechanism.
"""

import importlib

import pytest
import torch
import transformers

from npu_autopatch.kernels import KERNELS, choose_variant
from npu_autopatch.models import MODELS
from npu_autopatch.testing import make_torch_npu
from npu_autopatch.testing.parity import tiny_config, tiny_model

V4 = int(transformers.__version__.split(".")[0]) < 5


class DeviceRule(RuntimeError):
    """What a torch_npu op raises for a shape no known rule refuses."""


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, exc, *tensors):
        self.calls.append((exc, tensors))


def raising_npu(op):
    npu = make_torch_npu()
    error = DeviceRule(f"{op}: refused by a rule nobody knew")

    def refuse(*args, **kwargs):
        raise error

    setattr(npu, op, refuse)
    return npu, error


def module_of(model_type):
    try:
        return importlib.import_module(MODELS[model_type].module)
    except ModuleNotFoundError:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


def built(kernel, stock, npu, on_error, variant):
    chosen, reason = choose_variant(KERNELS[kernel], stock)
    assert chosen is not None and chosen.name == variant, reason
    return chosen.build(stock, npu, on_error)


def rope_args(gen, rotary_dim=16, head_dim=16, batch=2):
    q, k = (
        torch.randn(batch, 4, 5, head_dim, generator=gen),
        torch.randn(batch, 2, 5, head_dim, generator=gen),
    )
    angles = torch.randn(batch, 5, rotary_dim // 2, generator=gen)
    emb = torch.cat((angles, angles), -1)
    return q, k, emb.cos(), emb.sin()


def norm_case(model_type, cls):
    def make(gen):
        norm = getattr(module_of(model_type), cls)(16)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16, generator=gen))
        return type(norm).forward, (norm, torch.randn(2, 3, 16, generator=gen))

    return make


def gated_case(gen):
    norm = module_of("qwen3_next").Qwen3NextRMSNormGated(16)
    x, gate = torch.randn(2, 3, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    return type(norm).forward, (norm, x, gate)


def mlp_case(model_type, cls):
    def make(gen):
        torch.manual_seed(0)
        mlp = getattr(module_of(model_type), cls)(tiny_config(model_type))
        return type(mlp).forward, (mlp, torch.randn(2, 3, mlp.down_proj.out_features, generator=gen))

    return make


def rope_case(model_type, function, rotary_dim=16):
    def make(gen):
        return getattr(module_of(model_type), function), rope_args(gen, rotary_dim)

    return make


def mrope_case(gen):
    module = module_of("qwen2_5_vl")
    if not hasattr(module, "apply_multimodal_rotary_pos_emb"):
        pytest.skip("apply_multimodal_rotary_pos_emb is gone from this transformers (5.17+)")
    q, k, _, _ = rope_args(gen)
    angles = torch.randn(3, 2, 5, 8, generator=gen)
    emb = torch.cat((angles, angles), -1)
    return module.apply_multimodal_rotary_pos_emb, (q, k, emb.cos(), emb.sin(), [2, 3, 3])


def vision_case(gen):
    q, k = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    angles = torch.randn(6, 8, generator=gen)
    emb = torch.cat((angles, angles), -1)
    return module_of("qwen2_5_vl").apply_rotary_pos_emb_vision, (q, k, emb.cos(), emb.sin())


def moe_case(gen):
    """qwen3_moe's routed experts: 5.x's fused *Experts.forward, 4.x's sparse block forward."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe")
    block = model.model.layers[1].mlp
    x = torch.randn(2, 3, block.gate.weight.shape[1], generator=gen)
    if V4:
        return type(block).forward, (block, x)
    experts = block.experts
    router_logits = torch.randn(6, experts.num_experts, generator=gen)
    weights, index = torch.topk(router_logits.softmax(-1), 2, dim=-1)
    return type(experts).forward, (experts, x.view(6, -1), index, weights)


CASES = [
    ("rms_norm", "llama", "npu_rms_norm", norm_case("qwen3", "Qwen3RMSNorm")),
    ("rms_norm", "zero-centred", "npu_rms_norm", norm_case("gemma3", "Gemma3RMSNorm")),
    ("gated_rms_norm", "silu", "npu_rms_norm", gated_case),
    ("swiglu", "gate-up", "npu_swiglu", mlp_case("qwen3", "Qwen3MLP")),
    ("swiglu", "fused-gate-up", "npu_swiglu", mlp_case("glm4", "Glm4MLP")),
    ("rope", "half", "npu_rotary_mul", rope_case("qwen3", "apply_rotary_pos_emb")),
    ("rope", "partial", "npu_rotary_mul", rope_case("qwen3_next", "apply_rotary_pos_emb", rotary_dim=8)),
    ("rope", "interleave", "npu_rotary_mul", rope_case("glm4", "apply_rotary_pos_emb", rotary_dim=8)),
    ("rope", "deinterleave", "npu_rotary_mul", rope_case("deepseek_v3", "apply_rotary_pos_emb_interleave")),
    ("rope", "mrope", "npu_rotary_mul", mrope_case),
    ("rope", "vision", "npu_rotary_mul", vision_case),
    ("moe", "sparse-block" if V4 else "experts", "npu_grouped_matmul", moe_case),
]


def flat(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize(("kernel", "variant", "op", "case"), CASES, ids=[f"{k}-{v}" for k, v, _, _ in CASES])
def test_a_raising_op_gives_the_stock_result_and_one_report(kernel, variant, op, case):
    gen = torch.Generator().manual_seed(0)
    stock, args = case(gen)
    npu, error = raising_npu(op)
    on_error = Recorder()
    replacement = built(kernel, stock, npu, on_error, variant)
    with torch.no_grad():
        expected = flat(stock(*args))
        got = flat(replacement(*args))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert len(on_error.calls) == 1
    exc, tensors = on_error.calls[0]
    assert exc is error
    # The call's own tensors, first of all its input (a norm adds its weight).
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    assert tensors[0] is inputs[0]
    assert all(isinstance(t, torch.Tensor) for t in tensors)


def test_an_op_that_works_is_never_reported():
    gen = torch.Generator().manual_seed(0)
    stock, args = rope_case("qwen3", "apply_rotary_pos_emb")(gen)
    npu, on_error = make_torch_npu(), Recorder()
    replacement = built("rope", stock, npu, on_error, "half")
    for g, e in zip(replacement(*args), stock(*args), strict=True):
        torch.testing.assert_close(g, e)
    assert on_error.calls == [] and npu.calls["npu_rotary_mul"] == 2


def test_a_user_error_in_stock_code_is_not_blamed_on_the_kernel():
    """Inputs stock itself refuses take the stock path: stock raises, on_error hears nothing."""
    gen = torch.Generator().manual_seed(0)
    stock, (q, k, cos, sin) = rope_case("qwen3", "apply_rotary_pos_emb")(gen)
    npu, on_error = make_torch_npu(), Recorder()
    replacement = built("rope", stock, npu, on_error, "half")
    with pytest.raises(RuntimeError):
        stock(q, k, cos[:, :3], sin[:, :3])  # cos for 3 positions, q has 5
    with pytest.raises(RuntimeError):
        replacement(q, k, cos[:, :3], sin[:, :3])
    assert on_error.calls == [] and npu.calls["npu_rotary_mul"] == 0
