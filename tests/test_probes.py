"""The probes refuse what a kernel cannot reproduce, and the replacements never raise on what they take.

Each case is code the scan of every modeling module found accepted and then wrong or crashing (issue 11,
coverage notes "probe gaps"). The real transformers class or function where the installed version has
it; otherwise a copy of the code as the other major has it, so both majors test every case.
"""

import importlib
import inspect

import pytest
import torch

from npu_autopatch.kernels import KERNELS, choose_variant
from npu_autopatch.kernels._probe import instance
from npu_autopatch.testing import make_torch_npu
from npu_autopatch.testing.tiny import tiny_config


def real(model, name):
    """``name`` from transformers' modeling_<model>, or None where this transformers has none."""
    try:
        module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    except ImportError:
        return None
    return getattr(module, name, None)


class Recorder:
    """An on_error that records what reached it (it must stay empty: nothing here is a device fault)."""

    def __init__(self):
        self.calls = []

    def __call__(self, exc, *tensors):
        self.calls.append(exc)


def build(kernel, stock):
    """(variant name, replacement on a fresh stand-in, the stand-in, on_error recorder)."""
    variant, reason = choose_variant(KERNELS[kernel], stock)
    assert variant is not None, reason
    npu, errors = make_torch_npu(), Recorder()
    return variant.name, variant.build(stock, npu, errors), npu, errors


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def assert_same(got, expected, rtol=1e-5, atol=1e-6):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)


# --- 1. gated norms with forward(hidden_states, gate=None) are not plain RMSNorms -----------------


@pytest.mark.parametrize(
    ("model", "cls"),
    [
        ("bamba", "BambaRMSNormGated"),
        ("granitemoehybrid", "GraniteMoeHybridRMSNormGated"),
        ("mamba2", "MambaRMSNormGated"),
    ],
)
def test_rms_norm_refuses_a_norm_with_a_gate_parameter(model, cls):
    norm = real(model, cls)
    variant, reason = choose_variant(KERNELS["rms_norm"], norm.forward)
    assert variant is None
    assert "gate" in reason, reason


def test_rms_norm_keeps_the_stock_parameter_name():
    """A norm whose input is called ``x`` (gemma3) still takes ``norm(x=...)`` once replaced."""
    stock = real("gemma3", "Gemma3RMSNorm").forward
    name, forward, npu, errors = build("rms_norm", stock)
    assert name == "zero-centred"
    norm = real("gemma3", "Gemma3RMSNorm")(16)
    x = torch.randn(2, 3, 16)
    assert_same((forward(norm, x=x),), (stock(norm, x=x),))
    assert npu.calls["npu_rms_norm"] == 1 and not errors.calls


# --- 2. partial mRoPE (4.57 Glm4vMoe) -------------------------------------------------------------


def partial_multimodal_rotary(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """4.57 Glm4vMoe's apply_multimodal_rotary_pos_emb: mRoPE over the first cos.shape[-1] dims."""
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def test_rope_refuses_a_partial_multimodal_rotary():
    stock = real("glm4v_moe", "apply_multimodal_rotary_pos_emb") or partial_multimodal_rotary
    variant, reason = choose_variant(KERNELS["rope"], stock)
    assert variant is None
    assert "mrope: stock rotates only the first" in reason, reason


def test_rope_still_takes_the_full_head_multimodal_rotary():
    stock = real("qwen2_5_omni", "apply_multimodal_rotary_pos_emb") or real(
        "qwen2_vl", "apply_multimodal_rotary_pos_emb"
    )
    if stock is None:
        pytest.skip("no apply_multimodal_rotary_pos_emb in this transformers")
    assert choose_variant(KERNELS["rope"], stock)[0].name == "mrope"


# --- 3. zero-computation experts (4.57 LongCat-Flash) ----------------------------------------------


class ZeroExpertsMoE(torch.nn.Module):
    """4.57 LongcatFlashMoE.moe: a ModuleList of gated MLPs followed by nn.Identity zero experts."""

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = torch.nn.functional.one_hot(topk_indices, num_classes=len(self.experts))
        expert_mask = expert_mask.permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states.index_add_(0, token_indices, weighted_output)
        return final_hidden_states.type(hidden_states.dtype)


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_moe_runs_stock_for_a_call_that_reaches_a_zero_expert():
    owner = real("longcat_flash", "LongcatFlashMoE")
    stock = owner.moe if owner is not None and hasattr(owner, "moe") else ZeroExpertsMoE.moe
    name, moe, npu, errors = build("moe", stock)
    assert name == "moe-method"
    torch.manual_seed(0)
    experts = torch.nn.ModuleList([*(GatedMLP(16, 8) for _ in range(4)), torch.nn.Identity()])
    module = instance(stock, experts=experts)
    x = torch.randn(6, 16)
    weights = torch.softmax(torch.randn(6, 2), -1)
    to_routed = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    to_zero = to_routed.clone()
    to_zero[2, 1] = 4  # one token also goes to the identity expert

    assert_same((moe(module, x, to_zero, weights),), (stock(module, x, to_zero, weights),))
    assert npu.calls["npu_grouped_matmul"] == 0 and not errors.calls  # stock, and no fault reported
    assert_same((moe(module, x, to_routed, weights),), (stock(module, x, to_routed, weights),), 1e-4, 1e-5)
    assert npu.calls["npu_grouped_matmul"] == 2 and not errors.calls  # the fused path where it can


@pytest.mark.parametrize("training", [True, False])
def test_moe_runs_stock_for_a_layer_with_one_expert(training):
    """The device refuses a group list of one count: 4.57 Qwen3-VL-MoE's experts with one expert run
    the stock code for the call, with no fault reported (5.x's fused experts: test_experts_interface)."""
    experts_class = real("qwen3_vl_moe", "Qwen3VLMoeTextExperts")
    if experts_class is None or "routing_weights" not in inspect.signature(experts_class.forward).parameters:
        pytest.skip("transformers 5.x: the fused experts go through the experts interface")
    name, forward, npu, errors = build("moe", experts_class.forward)
    assert name == "experts-kn"
    config = tiny_config("qwen3_vl_moe").get_text_config()
    config.num_experts = 1
    experts = experts_class(config).train(training)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape) / weight.shape[-1] ** 0.5)
    x = torch.randn(2, 3, config.hidden_size)
    index, dense = torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1)
    assert_same((forward(experts, x, dense, index),), (experts_class.forward(experts, x, dense, index),))
    assert npu.calls["npu_grouped_matmul"] == 0 and not errors.calls


# --- 4. vision rotary: partial head (minimax_m3_vl), 4-D q/k (muse_glimmer) ------------------------


def partial_vision_rotary(q, k, cos, sin):
    """5.24 minimax_m3_vl's apply_rotary_pos_emb_vision: the first cos.shape[-1] dims rotate."""
    rot_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    q_rot, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k_rot, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


def test_rope_refuses_a_partial_vision_rotary():
    stock = real("minimax_m3_vl", "apply_rotary_pos_emb_vision") or partial_vision_rotary
    variant, reason = choose_variant(KERNELS["rope"], stock)
    assert variant is None
    assert "vision: stock rotates only the first" in reason, reason


@pytest.mark.parametrize("model", ["muse_glimmer", "qwen2_5_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_rotary_takes_batched_q_and_k(model, dtype):
    """muse_glimmer passes q/k [1, S, N, D] to Qwen2.5-VL's vision rotary: the fused op runs on it."""
    stock = real(model, "apply_rotary_pos_emb_vision")
    if stock is None:
        pytest.skip(f"no {model} in this transformers")
    name, rotary, npu, errors = build("rope", stock)
    assert name == "vision"
    gen = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, 5, 3, 16, generator=gen).to(dtype),
        torch.randn(2, 5, 1, 16, generator=gen).to(dtype),
    )
    angles = torch.randn(5, 8, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    assert_same(
        rotary(q, k, cos, sin), stock(q, k, cos, sin), *((1e-5, 1e-6) if dtype == torch.float32 else (0, 0))
    )
    assert npu.calls["npu_rotary_mul"] == 2 and not errors.calls


# --- 5. rotary output dtype with bf16 q/k and fp32 cos/sin (the OLMo family casts back) ----------


def test_rope_refuses_a_rotary_that_casts_back_to_the_query_dtype():
    stock = real("olmo2", "apply_rotary_pos_emb")
    variant, reason = choose_variant(KERNELS["rope"], stock)
    assert variant is None
    assert "half: stock returns" in reason and "torch.bfloat16, the kernel" in reason, reason


@pytest.mark.parametrize("model", ["llama", "qwen3_next", "glm4", "deepseek_v3"])
def test_rope_returns_the_stock_dtype_with_fp32_cos(model):
    """The table's rotaries promote q/k to cos's dtype; so do their replacements."""
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    stock = getattr(module, "apply_rotary_pos_emb_interleave", None) or module.apply_rotary_pos_emb
    name, rotary, npu, errors = build("rope", stock)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    angles = torch.randn(1, 5, 8, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    if name in ("partial", "interleave"):
        cos, sin = cos[..., :8], sin[..., :8]
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    expected = stock(q, k, cos, sin)
    assert expected[0].dtype == torch.float32  # the case: stock promotes
    assert_same(rotary(q, k, cos, sin), expected, 1e-5, 1e-5)
    assert npu.calls["npu_rotary_mul"] == 2 and not errors.calls


# --- 6. an fp32 norm weight with bf16 activations (DeepSeek-V4, OLMo 2) ---------------------------


class CastOnceRMSNorm(torch.nn.Module):
    """5.24 DeepseekV4RMSNorm: the weight stays fp32, the product is cast to the input dtype once."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


@pytest.mark.parametrize(
    ("model", "cls", "variant", "out_dtype"),
    [
        ("deepseek_v4", "DeepseekV4RMSNorm", "cast-once", torch.bfloat16),
        ("olmo2", "Olmo2RMSNorm", "cast-once", torch.bfloat16),
        ("llama", "LlamaRMSNorm", "llama", torch.float32),
    ],
)
def test_rms_norm_returns_the_stock_dtype_for_an_fp32_weight(model, cls, variant, out_dtype):
    norm_class = real(model, cls) or (CastOnceRMSNorm if model == "deepseek_v4" else None)
    name, forward, npu, errors = build("rms_norm", norm_class.forward)
    assert name == variant
    norm = norm_class(16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    expected = norm_class.forward(norm, x)
    assert expected.dtype == out_dtype
    assert_same((forward(norm, x),), (expected,), 1e-2, 1e-2)
    assert npu.calls["npu_rms_norm"] == 1 and not errors.calls


# --- 7. an MLP called with no tokens (higgs_audio_v2) ---------------------------------------------


@pytest.mark.parametrize(("model", "cls"), [("higgs_audio_v2", "HiggsAudioV2MLP"), ("llama", "LlamaMLP")])
def test_swiglu_runs_stock_on_an_empty_input_without_reporting_a_fault(model, cls):
    mlp_class = real(model, cls)
    if mlp_class is None:
        pytest.skip(f"no {model} in this transformers")
    mlp = mlp_class(tiny_config(model).get_text_config())
    name, forward, npu, errors = build("swiglu", mlp_class.forward)
    assert name == "gate-up"
    width = mlp.gate_proj.in_features
    empty = torch.randn(0, width)
    out = forward(mlp, empty)
    assert out.shape == (0, width) and npu.calls["npu_swiglu"] == 0 and not errors.calls
    forward(mlp, torch.randn(3, width))
    assert npu.calls["npu_swiglu"] == 1 and not errors.calls


# --- 8. an interleaved rotary at full head width (no pass-through) ---------------------------------


def rotate_half_interleaved(x):
    """GLM-4's rotate_half_llm: the pairs (x0, x1), (x2, x3) ... rotate together."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def interleaved_full_width_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """GLM-4's rotary without its pass-through part: every dim of the head rotates, so the stock code
    takes cos/sin as wide as the head only (a narrower one fails on the shape)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    q_embed = q * cos + rotate_half_interleaved(q) * sin
    k_embed = k * cos + rotate_half_interleaved(k) * sin
    return q_embed, k_embed


def test_rope_takes_an_interleaved_rotary_at_full_head_width():
    """The probes follow the target's own cos width: a partial width only for code that takes it."""
    name, forward, npu, errors = build("rope", interleaved_full_width_rotary)
    assert name == "interleave"
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 64, generator=gen), torch.randn(2, 2, 5, 64, generator=gen)
    angles = torch.randn(1, 5, 32, generator=gen)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    assert_same(forward(q, k, cos, sin), interleaved_full_width_rotary(q, k, cos, sin))
    assert npu.calls["npu_rotary_mul"] == 2 and not errors.calls
