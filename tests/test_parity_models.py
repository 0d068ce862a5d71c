"""Parity of the norm, gated norm, MLP and rotary kernels on every table model.

Each model present in the running transformers is checked stock vs patched (logits and every
gradient, fp32 and bf16, exact op counts) with the kernels of this file enabled, on the default
stand-in profile (the newest torch_npu); the moe kernel has its own tests (test_parity_moe.py),
so here the routed experts run stock. The vision-language models get an image, so that their
vision towers' kernels run too; the same run checks the tiny model itself (small, finite, the
gradient reaches it). The older release profiles share the forward math and differ in schemas
and backward ops: there, one model per kernel variant. Then the import-hook path in a fresh
interpreter, the target Qwen2.5-VL shares with qwen2 in 4.57, and the traps: a target whose math
differs is left stock with the reason.
"""

import copy
import importlib
import json
import math
from pathlib import Path

import pytest
import torch
import transformers

import npu_autopatch
from npu_autopatch.kernels import KERNELS, Kernel, choose_variant
from npu_autopatch.models import MODEL_TYPES, MODELS
from npu_autopatch.testing import DEFAULT, PROFILES, parity, stand_in, tiny
from npu_autopatch.testing.parity import (
    TOLERANCE,
    check_parity,
    forward_backward,
    model_batch,
    relative_error,
    tiny_config,
    tiny_model,
)

from .conftest import FULL, every_variant, present, run_python, variant_users

V4 = int(transformers.__version__.split(".")[0]) < 5
KERNEL_NAMES = ("rms_norm", "gated_rms_norm", "swiglu", "geglu", "rope")


def calls(rms_norm=0, swiglu=0, rotary_mul=0, geglu=0):
    """Fused-op calls in one forward; the backward calls each op's backward as often."""
    counts = {
        "npu_rms_norm": rms_norm,
        "npu_swiglu": swiglu,
        "npu_rotary_mul": rotary_mul,
        "npu_geglu": geglu,
    }
    return {op: n for op, n in counts.items() if n}


# The backward op of each fused op, where it is not "<op>_backward" (derivatives.yaml).
GRAD_OP = {"npu_geglu": "npu_geglu_grad"}


def grad_op(op):
    return GRAD_OP.get(op, op + "_backward")


# Per tiny model (testing.tiny: two text layers, one of each kind; a one-block vision tower fed one
# image where the model has one), with the breakdown. Sparse layers: the routed experts run stock
# here (test_parity_moe.py); in 4.57 the routed experts of several MoE models are *MLP modules, so
# swiglu also runs once per expert the batch reaches ("+ N experts").
EXPECTED = {
    # --- the llama family -------------------------------------------------------------------
    # 2 norms per layer + final (qwen3: + q/k norms); q and k per layer; one MLP per layer.
    "llama": calls(rms_norm=5, swiglu=2, rotary_mul=4),
    "mistral": calls(rms_norm=5, swiglu=2, rotary_mul=4),
    "qwen2": calls(rms_norm=5, swiglu=2, rotary_mul=4),
    "qwen3": calls(rms_norm=9, swiglu=2, rotary_mul=4),
    # --- the first table --------------------------------------------------------------------
    # 2 norms per layer + final (+ q/k norms: 4 per layer); one MLP per dense layer or shared expert;
    # q and k per attention layer; vision towers: 2 norms per block + merger, its MLP, its q and k.
    "qwen2_moe": calls(rms_norm=5, swiglu=2 + (4 if V4 else 0), rotary_mul=4),  # dense + shared
    "qwen3_moe": calls(rms_norm=9, swiglu=1 + (4 if V4 else 0), rotary_mul=4),  # dense layer only
    "deepseek_v3": calls(rms_norm=9, swiglu=2 + (8 if V4 else 0), rotary_mul=4),  # + q_a/kv_a norms
    "glm4": calls(rms_norm=9, swiglu=2, rotary_mul=4),  # 4 norms per layer; interleaved rotary
    "glm4_moe": calls(rms_norm=5, swiglu=2 + (4 if V4 else 0), rotary_mul=4),
    "qwen2_5_vl": calls(rms_norm=5 + 3, swiglu=2 + 1, rotary_mul=4 + 2),
    "qwen3_vl": calls(rms_norm=9, swiglu=2, rotary_mul=4 + 2),  # the tower: LayerNorm, GELU MLP
    "qwen3_vl_moe": calls(rms_norm=9, swiglu=1, rotary_mul=4 + 2),  # experts fused in 4.57 too
    # one Gated DeltaNet layer (+ its gated norm) and one full-attention layer (+ q/k norm, rope)
    "qwen3_next": calls(rms_norm=8, swiglu=2 + (4 if V4 else 0), rotary_mul=2),
    "qwen3_5": calls(rms_norm=8, swiglu=2, rotary_mul=2 + 2),
    "qwen3_5_moe": calls(rms_norm=8, swiglu=2, rotary_mul=2 + 2),
    # text 4 per layer + q/k + final, the projector's norm; a gated GELU MLP per layer (npu_geglu)
    "gemma3": calls(rms_norm=14, rotary_mul=4, geglu=2),
    # --- issue 34: the Gemma family ---------------------------------------------------------
    "gemma": calls(rms_norm=5, rotary_mul=4, geglu=2),
    "gemma2": calls(rms_norm=9, rotary_mul=4, geglu=2),  # 4 norms per layer (pre and post) + final
    # --- issue 11 ---------------------------------------------------------------------------
    "qwen2_vl": calls(rms_norm=5, swiglu=2, rotary_mul=4 + 2),  # the tower: LayerNorm, GELU MLP
    # the thinker; 4.57's vision rotary (tensor, freqs) is left out
    "qwen2_5_omni": calls(rms_norm=5 + 3, swiglu=2 + 1, rotary_mul=4 + (2 if not V4 else 0)),
    "qwen3_omni_moe": calls(rms_norm=9, swiglu=1 + (4 if V4 else 0), rotary_mul=4 + 2),
    "glm": calls(rms_norm=5, swiglu=2, rotary_mul=4),
    "glm4v": calls(rms_norm=9 + 4, swiglu=2 + 1, rotary_mul=2),  # vision rotary only
    "glm4v_moe": calls(rms_norm=5 + 4, swiglu=2 + 1 + (4 if V4 else 0), rotary_mul=2),
    "glm4_moe_lite": calls(rms_norm=9, swiglu=2, rotary_mul=4),  # MLA: + q_a/kv_a norms
    "glm_moe_dsa": calls(rms_norm=9, swiglu=2, rotary_mul=8),  # + the indexer's q and k
    "deepseek_v2": calls(rms_norm=9, swiglu=2 + (8 if V4 else 0)),  # complex rotary: stock
    "deepseek_v32": calls(rms_norm=9, swiglu=2, rotary_mul=8),  # + the indexer's q and k
    "ernie4_5": calls(rms_norm=5, swiglu=2),
    "ernie4_5_moe": calls(rms_norm=5, swiglu=2 + (4 if V4 else 0)),
    "hunyuan_v1_dense": calls(rms_norm=9, swiglu=2, rotary_mul=4),
    "hunyuan_v1_moe": calls(rms_norm=9, swiglu=2 + (7 if V4 else 0), rotary_mul=4),
    "seed_oss": calls(rms_norm=5, rotary_mul=4),
    "minimax_m2": calls(rms_norm=9, rotary_mul=4),  # every layer sparse: no dense MLP
    # two attention blocks per layer: 8 norms per layer + final, 2 MLPs per layer
    "longcat_flash": calls(rms_norm=17, swiglu=4 + (8 if V4 else 0), rotary_mul=8),
    "dots1": calls(rms_norm=9, swiglu=2 + (8 if V4 else 0), rotary_mul=4),
    "kimi_linear": calls(rms_norm=8, swiglu=3),  # MLA without rotary; the sigmoid-gated norm is stock
    "mixtral": calls(rms_norm=5, rotary_mul=4),
    "ministral": calls(rms_norm=5, swiglu=2, rotary_mul=4),
    "mistral3": calls(rms_norm=1),  # the projector's norm (the text model is its own type)
    "phi3": calls(rms_norm=5, swiglu=2, rotary_mul=4),
    "olmo2": calls(rms_norm=9, swiglu=2),
    "olmo3": calls(rms_norm=9, swiglu=2),
    "smollm3": calls(rms_norm=5, swiglu=2, rotary_mul=2),  # a NoPE layer
    "granite": calls(rms_norm=5, swiglu=2, rotary_mul=4),
    "granitemoe": calls(rms_norm=5, rotary_mul=4),
    "gpt_oss": calls(rms_norm=5),
}
# Fused ops whose backward runs fewer times than their forward: the sparse-attention indexer's
# q and k rotary feed a top-k selection, which passes no gradient (as in stock).
BACKWARD = {"glm_moe_dsa": {"npu_rotary_mul": 4}, "deepseek_v32": {"npu_rotary_mul": 4}}


def backward_count(model_type, op):
    return BACKWARD.get(model_type, {}).get(op, EXPECTED[model_type][op])


# Every table model has parity here (the attention entry has its own: test_attention.py).
assert set(EXPECTED) == set(MODEL_TYPES)

# Config variants that take another target: DeepSeek-V3 and GLM-4.7-Flash without interleaved
# rope use the standard apply_rotary_pos_emb.
CASES = [(model, {}) for model in EXPECTED] + [
    ("deepseek_v3", {"rope_interleave": False}),
    ("glm4_moe_lite", {"rope_interleave": False}),
]


def expected_kernels(model_type):
    return tuple(k for k in MODELS[model_type].kernels if k in KERNEL_NAMES)


def assert_parity(report, model_type, ops=None):
    """Applied with every kernel and every target of this file, exact op counts, within tolerance."""
    ops = report.ops_called if ops is None else ops
    assert report.state == "applied", report.reason
    assert report.kernels == expected_kernels(model_type)
    assert report.reason is None, report.reason  # a target refused by its probe would be named here
    for op, count in EXPECTED[model_type].items():
        assert ops.get(op) == count, (op, ops)
        assert ops.get(grad_op(op)) == backward_count(model_type, op), (grad_op(op), ops)
    assert not report.missing_grads, f"no gradient reached {report.missing_grads}"
    assert not report.over_tolerance, (report.over_tolerance, report.logits_error, report.grad_error)
    assert report.passed


def case_id(case):
    model, overrides = case
    return model + "".join(f"-{k}={v}" for k, v in overrides.items())


# fp32 holds the kernels to rounding order; bf16 (the same math, rounded) is the full matrix's.
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=FULL)], ids=["fp32", "bf16"]
)
OLDER = [name for name, profile in PROFILES.items() if profile is not DEFAULT]


@pytest.fixture
def built(monkeypatch):
    """The tiny model check_parity builds (testing.parity's own builder, recorded)."""
    seen = {}

    def recorded(*args, **kwargs):
        seen["model"] = tiny_model(*args, **kwargs)
        return seen["model"]

    monkeypatch.setattr(parity, "tiny_model", recorded)
    return seen


def assert_a_sound_tiny_model(model_type, model):
    """The tiny model is small and trains: its gradient (the patched run's, equal to stock's) reaches the
    input embeddings and most parameters, finite. gemma3's SigLIP pooling head is unused and
    DeepSeek-V3.2's sparse-attention indexer (a top-k selection) gets none, as in stock. A model with a
    vision tower was fed an image: its placeholder tokens match the tower's output."""
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.get_input_embeddings().weight.grad is not None
    grads = {name: p.grad for name, p in model.named_parameters()}
    reached = [name for name, grad in grads.items() if grad is not None]
    assert len(reached) >= 0.5 * len(grads)
    assert all(torch.isfinite(grads[name]).all() for name in reached)
    input_ids, _, inputs = model_batch(model)
    if "pixel_values" in inputs:
        assert input_ids.shape[1] > tiny.TEXT_TOKENS
    if model_type.endswith("omni_moe") or model_type == "qwen2_5_omni":  # the thinker, with its towers
        assert type(model).__name__.endswith("ThinkerForConditionalGeneration")
        assert {"pixel_values", "input_features"} <= set(inputs)


@DTYPES
@pytest.mark.parametrize("case", CASES, ids=map(case_id, CASES))
def test_patched_model_matches_stock(case, dtype, built, npu_stand_in):
    """Every model, built tiny from its own config, on the default profile (the newest torch_npu)."""
    model_type, overrides = case
    if not present(model_type):
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")
    report = check_parity(model_type, dtype, npu=npu_stand_in, kernels=KERNEL_NAMES, **overrides)
    assert_parity(report, model_type)
    assert math.isfinite(report.logits_error)
    if dtype == torch.float32:
        assert_a_sound_tiny_model(model_type, built["model"])


VARIANTS = every_variant(*KERNEL_NAMES)


def representative(pair):
    """The first table model (in table order) whose targets take this kernel variant; skips when none does,
    or when an earlier variant of VARIANTS has the same model (its run covers this variant too)."""
    users = variant_users()
    if pair not in users:
        pytest.skip(f"no table model of transformers {transformers.__version__} takes {'/'.join(pair)}")
    model = users[pair][0]
    earlier = next(p for p in VARIANTS if users.get(p, (None,))[0] == model)
    if earlier != pair:
        pytest.skip(f"{model} is {'/'.join(earlier)}'s model too: that run covers {'/'.join(pair)}")
    return model


@pytest.mark.parametrize("profile", OLDER)
@DTYPES
@pytest.mark.parametrize("pair", VARIANTS, ids=["/".join(p) for p in VARIANTS])
def test_every_kernel_variant_matches_stock_on_the_older_releases(pair, dtype, profile):
    """Every torch_npu release line the kernels support, one model per kernel variant."""
    model_type = representative(pair)
    with stand_in(profile=profile) as npu:
        report = check_parity(model_type, dtype, npu=npu, kernels=KERNEL_NAMES)
    assert_parity(report, model_type)
    assert pair[1] in npu_autopatch.status()[model_type].variants.values()


LAZY_SCRIPT = """
import json, torch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import check_parity
reports = {{}}
with stand_in() as npu:
    for model in {models!r}:
        report = check_parity(model, torch.float32, npu=npu, lazy=True, kernels={kernels!r})
        reports[model] = {{**vars(report), "passed": report.passed}}
print(json.dumps(reports))
"""


def test_patched_by_the_import_hook_matches_stock():
    models = [model for model in EXPECTED if present(model)]
    # The child imports this very npu_autopatch, installed or not.
    source = str(Path(npu_autopatch.__file__).resolve().parents[1])
    child = run_python(
        LAZY_SCRIPT.format(models=models, kernels=KERNEL_NAMES), timeout=300, PYTHONPATH=source
    )
    assert child.returncode == 0, child.stderr[-3000:]
    reports = json.loads(child.stdout.splitlines()[-1])
    assert sorted(reports) == sorted(models)
    for model, report in reports.items():
        assert report["state"] == "applied", (model, report["reason"])
        assert tuple(report["kernels"]) == expected_kernels(model)
        assert report["reason"] is None, report["reason"]
        for op, count in EXPECTED[model].items():
            assert report["ops_called"].get(op) == count, (model, op, report["ops_called"])
            assert report["ops_called"].get(grad_op(op)) == backward_count(model, op), (model, op)
        assert not report["missing_grads"], (model, report["missing_grads"])
        assert report["passed"], (model, report)


def stock_targets(*targets):
    return [
        owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr) for owner, attr in targets
    ]


@pytest.mark.skipif(not V4, reason="from 5.2 Qwen2.5-VL has its own Qwen2_5_VLRMSNorm: nothing is shared")
def test_qwen2_5_vl_and_qwen2_share_one_norm_target_and_stay_correct(npu_stand_in):
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as vl

    assert vl.Qwen2RMSNorm is qwen2.Qwen2RMSNorm  # 4.57 imports it from modeling_qwen2
    shared = [(qwen2.Qwen2RMSNorm, "forward")]
    own = [(vl.Qwen2_5_VLMLP, "forward"), (vl, "apply_multimodal_rotary_pos_emb")]
    originals = stock_targets(*shared, *own)
    model = tiny_model("qwen2_5_vl")
    input_ids, labels, inputs = model_batch(model)
    stock = forward_backward(model, input_ids, labels, **inputs)

    def check(state):
        before = npu_stand_in.calls["npu_rms_norm"]
        logits, grads = forward_backward(model, input_ids, labels, **inputs)
        assert npu_stand_in.calls["npu_rms_norm"] - before == EXPECTED["qwen2_5_vl"]["npu_rms_norm"], state
        assert relative_error(logits, stock[0]) <= TOLERANCE[torch.float32], state
        for name, grad in stock[1].items():
            if grad is not None:
                assert relative_error(grads[name], grad) <= TOLERANCE[torch.float32], (state, name)

    # Both: the second model to be patched joins the first on the shared norm.
    npu_autopatch.enable(models=["qwen2", "qwen2_5_vl"])
    status = npu_autopatch.status()
    assert status["qwen2"].state == status["qwen2_5_vl"].state == "applied"
    assert stock_targets(*shared)[0] is not originals[0]
    check("both")

    # qwen2 excluded: Qwen2.5-VL still needs the norm, and has it.
    npu_autopatch.enable(models=["qwen2", "qwen2_5_vl"], exclude=["qwen2"])
    assert npu_autopatch.status()["qwen2"].state == "skipped"
    assert npu_autopatch.status()["qwen2_5_vl"].state == "applied"
    assert stock_targets(*shared)[0] is not originals[0]
    check("qwen2 excluded")

    # qwen2_5_vl excluded: its own targets are stock again; the norm is qwen2's, so it stays.
    npu_autopatch.enable(models=["qwen2", "qwen2_5_vl"], exclude=["qwen2_5_vl"])
    assert stock_targets(*shared)[0] is not originals[0]
    assert all(a is b for a, b in zip(stock_targets(*own), originals[1:], strict=True))
    check("qwen2_5_vl excluded")

    npu_autopatch.disable()
    assert all(a is b for a, b in zip(stock_targets(*shared, *own), originals, strict=True))
    assert torch.equal(forward_backward(model, input_ids, labels, **inputs)[0], stock[0])


def test_a_gelu_mlp_runs_npu_geglu_not_the_swiglu_kernel(npu_stand_in):
    """Gemma3's MLP is gated GELU (gelu_pytorch_tanh): the table gives it geglu, never swiglu; a GELU
    instance under the swiglu kernel (which its gate-up probe would accept: the layout is the same)
    runs the stock code, and under geglu runs npu_geglu with the GELU on the gate (activate_left)."""
    from transformers.models.gemma3 import modeling_gemma3

    assert "swiglu" not in MODELS["gemma3"].kernels and "geglu" in MODELS["gemma3"].kernels
    config = tiny_config("gemma3").get_text_config()
    assert config.hidden_activation == "gelu_pytorch_tanh"
    torch.manual_seed(0)
    mlp = modeling_gemma3.Gemma3MLP(config)
    stock = modeling_gemma3.Gemma3MLP.forward
    x = torch.randn(2, 3, config.hidden_size)
    swiglu, _ = choose_variant(KERNELS["swiglu"], stock)
    assert torch.equal(swiglu.build(stock, npu_stand_in, None)(mlp, x), stock(mlp, x))
    assert npu_stand_in.calls["npu_swiglu"] == 0
    geglu, _ = choose_variant(KERNELS["geglu"], stock)
    got = geglu.build(stock, npu_stand_in, None)(mlp, x)
    assert relative_error(got, stock(mlp, x)) < 1e-6
    assert npu_stand_in.calls["npu_geglu"] == 1
    # A SiLU instance of the same class is no GELU: stock, under geglu.
    mlp.act_fn = torch.nn.SiLU()
    assert torch.equal(geglu.build(stock, npu_stand_in, None)(mlp, x), stock(mlp, x))
    assert npu_stand_in.calls["npu_geglu"] == 1


def test_a_zero_centred_norm_is_never_given_the_llama_kernel(npu_stand_in, monkeypatch):
    # With only the llama variant, Gemma3's (1 + weight) norm is refused and stays stock.
    monkeypatch.setattr(KERNELS["rms_norm"], "variants", KERNELS["rms_norm"].variants[:1])
    report = check_parity("gemma3", npu=npu_stand_in)
    assert report.state == "partial" and report.kernels == ("geglu", "rope")  # a selected target left stock
    assert report.reason == (
        "rms_norm not applied to transformers.models.gemma3.modeling_gemma3:Gemma3RMSNorm.forward: "
        "the stock code reads state this kernel does not provide "
        "('Gemma3RMSNorm' object has no attribute 'eps')"
    )
    assert "npu_rms_norm" not in report.ops_called
    assert not report.missing_grads and not report.over_tolerance  # what it patched is right


ZERO_CENTRED = [
    ("gemma3", "Gemma3RMSNorm"),
    ("gemma", "GemmaRMSNorm"),
    ("gemma2", "Gemma2RMSNorm"),
    ("qwen3_next", "Qwen3NextRMSNorm"),
    ("qwen3_5", "Qwen3_5RMSNorm"),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNorm"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type, name", ZERO_CENTRED, ids=[m for m, _ in ZERO_CENTRED])
def test_the_zero_centred_kernel_rounds_where_stock_does(model_type, name, dtype, npu_stand_in):
    # (1 + weight) in fp32 and one rounding at the end, as stock: equal to the last bit, with a
    # weight far from its zero init. (The weight may be in the activations' dtype or fp32.)
    if not present(model_type):
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")
    module = importlib.import_module(MODELS[model_type].module)
    cls = getattr(module, name)
    stock = cls.forward
    variant, _ = choose_variant(KERNELS["rms_norm"], stock)
    assert variant.name == "zero-centred"
    forward = variant.build(stock, npu_stand_in, None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=gen).to(dtype)
    for weight_dtype in (dtype, torch.float32):
        norm = cls(64, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=gen))
        norm.to(weight_dtype)
        assert torch.equal(forward(norm, x), stock(norm, x)), weight_dtype
    assert npu_stand_in.calls["npu_rms_norm"] == 2


# A variant whose math differs from the target is refused by its probe, with the reason.
REFUSED = [
    ("gemma3", "Gemma3RMSNorm.forward", "rms_norm", "llama", "has no attribute 'eps'"),
    ("qwen3", "Qwen3RMSNorm.forward", "rms_norm", "zero-centred", "has no attribute 'variance_epsilon'"),
    ("qwen3", "Qwen3RMSNorm.forward", "gated_rms_norm", "silu", "is not (self, hidden_states, gate)"),
    ("glm4", "Glm4MLP.forward", "swiglu", "gate-up", "has no attribute 'gate_up_proj'"),
    ("qwen3", "Qwen3MLP.forward", "swiglu", "fused-gate-up", "has no attribute 'act_fn'"),
    ("glm4", "apply_rotary_pos_emb", "rope", "half", "partial rotary"),
    ("glm4", "apply_rotary_pos_emb", "rope", "partial", "the math differs from stock"),
    ("qwen3_next", "apply_rotary_pos_emb", "rope", "half", "partial rotary"),
    ("qwen3_next", "apply_rotary_pos_emb", "rope", "interleave", "the math differs from stock"),
    ("deepseek_v3", "apply_rotary_pos_emb_interleave", "rope", "half", "the math differs from stock"),
    # 4.x: the signature of the interleaved function, so the probe compares the math
    ("qwen3", "apply_rotary_pos_emb", "rope", "deinterleave", "the math differs" if V4 else "the signature"),
    # (qwen3's rotary under the partial variant is no longer here: its probe follows the target's own
    # cos width, and partial at full width is qwen3's math. The patcher takes `half` first.)
    ("qwen3_vl", "apply_rotary_pos_emb_vision", "rope", "half", "the signature"),
]


@pytest.mark.parametrize(
    "model_type, path, kernel, variant, reason", REFUSED, ids=[f"{r[0]}-{r[1]}-{r[3]}" for r in REFUSED]
)
def test_a_variant_whose_math_differs_is_refused_with_the_reason(model_type, path, kernel, variant, reason):
    module = importlib.import_module(MODELS[model_type].module)
    stock = module
    for name in path.split("."):
        stock = getattr(stock, name)
    (only,) = [v for v in KERNELS[kernel].variants if v.name == variant]
    chosen, why = choose_variant(Kernel(kernel, KERNELS[kernel].ops, (only,)), stock)
    assert chosen is None
    assert reason in why, why


def test_every_rotary_target_is_in_the_shape_sweep():
    """Whole-model parity runs one batch shape; the shapes the device refuses are the sweep's
    (test_rope_sweep.py), which takes its rotary functions from the table: every table model with a
    rope target in this transformers has its functions there."""
    from npu_autopatch.testing.rope_sweep import _rotary_functions

    swept = {model for _where, owners, _function in _rotary_functions() for model in owners}
    with_rope = {m for m in MODEL_TYPES if "rope" in MODELS[m].kernels and present(m)}
    assert with_rope - swept == set()


GEMMA_TEXT = [("gemma", "gemma"), ("gemma2", "gemma2"), ("gemma3_text", "gemma3")]


@pytest.mark.parametrize(
    "profile", [pytest.param(p, marks=FULL) if p != DEFAULT.name else p for p in PROFILES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type, entry", GEMMA_TEXT, ids=[m for m, _ in GEMMA_TEXT])
def test_gemma_text_mlps_run_npu_geglu_within_1e_5_and_no_further_from_fp64(
    model_type, entry, dtype, profile
):
    """The issue's bound: a tiny Gemma text model with only its MLPs on npu_geglu equals stock within 1e-5
    (fp32) or 4e-2 (bf16), logits and every gradient, npu_geglu and its grad counted once per layer; and
    against the same model in fp64, patched is no further than stock."""
    if not present(entry):
        pytest.skip(f"no {entry} in transformers {transformers.__version__}")
    bound = {torch.float32: 1e-5, torch.bfloat16: 4e-2}[dtype]
    with stand_in(profile=profile) as npu:
        # eager attention: the MLP is compared here (on 7.1.0/7.2.0 torch_npu's sdpa sends gemma3_text's
        # masked GQA call to its math path, which drops enable_gqa and fails, stock or patched: sdpa.py)
        model = tiny_model(model_type, dtype, attn_implementation="eager")
        input_ids, labels, inputs = model_batch(model)
        stock = forward_backward(model, input_ids, labels, **inputs)
        exact = forward_backward(copy.deepcopy(model).double(), input_ids, labels, **inputs)
        npu_autopatch.enable(models=[entry], kernels=["geglu"])
        try:
            assert npu_autopatch.status()[entry].kernels == ("geglu",)
            patched = forward_backward(model, input_ids, labels, **inputs)
        finally:
            npu_autopatch.disable()
    layers = model.config.num_hidden_layers
    assert npu.calls["npu_geglu"] == npu.calls["npu_geglu_grad"] == layers
    pairs = [(patched[0], stock[0], exact[0])] + [
        (patched[1][name], grad, exact[1][name]) for name, grad in stock[1].items() if grad is not None
    ]
    for got, want, truth in pairs:
        assert relative_error(got, want) <= bound
        assert relative_error(got, truth) <= relative_error(want, truth) + bound
