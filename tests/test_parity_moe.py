"""Parity of the moe kernel: every MoE model against stock transformers, logits and all gradients.

Each model present in the running transformers is checked with the moe kernel alone (so
that the errors and the op calls are its own) in fp32 and bf16 on the default stand-in profile,
one model per moe variant on the older release profiles (the op-plugin 7.1.0 one gates the
kernel), and with every kernel through the import hook. Then the routing edge cases: a single
token, and an expert without rows between others, down to the gradient an empty expert gets.
Then the fallbacks and the probes: a non-SiLU activation runs stock, a missing op fails the
model by name, and each variant refuses a lookalike whose math differs.
"""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import npu_autopatch
from npu_autopatch.kernels import KERNELS, choose_variant
from npu_autopatch.models import MODELS
from npu_autopatch.testing import DEFAULT, PROFILES, stand_in
from npu_autopatch.testing.parity import (
    check_parity,
    forward_backward,
    relative_error,
    tiny_model,
)

from .conftest import FULL, every_variant, kernel_ops, run_python, variant_users
from .conftest import present as importable

# Sparse (MoE) layers of each tiny model (testing.tiny keeps one layer of each kind: a dense first
# layer where the model has one, then a sparse one).
MOE_LAYERS = {
    "qwen2_moe": 1,
    "qwen3_moe": 1,
    "deepseek_v3": 1,
    "glm4_moe": 1,
    "qwen3_next": 1,
    "qwen3_vl_moe": 1,
    "qwen3_5_moe": 2,  # a linear-attention and a full-attention layer, both sparse
    "qwen3_omni_moe": 1,
    "glm4v_moe": 1,
    "glm4_moe_lite": 1,
    "glm_moe_dsa": 1,
    "deepseek_v2": 2,
    "deepseek_v32": 1,
    "ernie4_5_moe": 1,
    "hunyuan_v1_moe": 2,
    "minimax_m2": 2,
    "dots1": 2,
    "kimi_linear": 2,
    "mixtral": 2,
    "granitemoe": 2,
}
assert set(MOE_LAYERS) == {m for m in MODELS if "moe" in MODELS[m].kernels}, "a MoE model without parity"

# The moe kernel's op calls per sparse layer in one training step: permute, gate_up and down
# grouped matmuls around swiglu, unpermute; the backward runs two grouped matmuls (dx, dW)
# for each forward one, and the backward ops of the rest.
PER_LAYER = {
    "npu_moe_token_permute": 1,
    "npu_grouped_matmul": 6,
    "npu_swiglu": 1,
    "npu_moe_token_unpermute": 1,
    "npu_moe_token_unpermute_grad_v2": 1,
    "npu_swiglu_backward": 1,
    "npu_moe_token_permute_grad_v2": 1,
}
# The ops no other kernel calls (swiglu is shared with the dense MLPs).
MOE_OWN = tuple(op for op in PER_LAYER if "swiglu" not in op)

# fp32 holds the kernels to rounding order; bf16 (the same math, rounded) is the full matrix's.
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=FULL)], ids=["fp32", "bf16"]
)


def expected_calls(model_type, profile="a2-newest"):
    """The moe kernel's op calls in one step, named as the profile's release names its backward ops."""
    backward = PROFILES[profile].autograd  # 26.1.0+: *_grad_v2; 7.2.0 to 26.0.0: *_grad
    names = {
        "npu_moe_token_permute_grad_v2": backward["npu_moe_token_permute"],
        "npu_moe_token_unpermute_grad_v2": backward["npu_moe_token_unpermute"],
    }
    return {names.get(op, op): count * MOE_LAYERS[model_type] for op, count in PER_LAYER.items()}


def present(model_type):
    """Whether the running transformers has this model and its moe target (without importing the
    modeling module): on 4.x some models' sparse blocks are another computation, left out."""
    experts = next(t for t in MODELS[model_type].targets if t.kernel_name == "moe")  # the router: after it
    since = experts.since is None or release(transformers.__version__) >= release(experts.since)
    return importable(model_type) and since


def release(version):
    return tuple(int(part) for part in version.split(".")[:2])


@pytest.fixture
def model_type(request):
    if not present(request.param):
        pytest.skip(f"transformers {transformers.__version__} has no {request.param} experts target")
    return request.param


MODEL_TYPES = pytest.mark.parametrize("model_type", sorted(MOE_LAYERS), indirect=True)


def assert_within_tolerance(report):
    """Logits and every gradient within the harness's bounds: TOLERANCE, BF16_TOLERANCE for the Gated
    DeltaNet decay parameters, and in bf16 a tensor no further from fp32 than stock (``rounding``)."""
    assert not report.over_tolerance, (report.over_tolerance, report.logits_error, report.grad_error)


def assert_moe_parity(report, model_type, profile):
    assert report.state == "applied", report.reason
    assert report.kernels == ("moe",)
    # and nothing else ran, but the model's default attention (torch_npu's sdpa)
    assert kernel_ops(report.ops_called) == expected_calls(model_type, profile)
    assert not report.missing_grads, f"no gradient reached {report.missing_grads}"
    assert_within_tolerance(report)


@DTYPES
@MODEL_TYPES
def test_moe_kernel_matches_stock(model_type, dtype, npu_stand_in):
    """Every MoE model on the default profile (the newest torch_npu)."""
    report = check_parity(model_type, dtype, npu=npu_stand_in, kernels=["moe"])
    assert_moe_parity(report, model_type, DEFAULT.name)


VARIANTS = every_variant("moe")
# The release lines that have what the kernel needs (op-plugin 7.2.0 on), and the ones gated.
GATED = "a2-2.6.0"
OLDER = [name for name, profile in PROFILES.items() if profile is not DEFAULT and name != GATED]


def representative(pair):
    """The first MoE model (in table order) whose experts take this moe variant; skips when none does."""
    users = [model for model in variant_users().get(pair, ()) if model in MOE_LAYERS and present(model)]
    if not users:
        pytest.skip(f"no MoE model of transformers {transformers.__version__} takes {'/'.join(pair)}")
    return users[0]


@pytest.mark.parametrize("profile", OLDER)
@DTYPES
@pytest.mark.parametrize("pair", VARIANTS, ids=["/".join(p) for p in VARIANTS])
def test_every_moe_variant_matches_stock_on_the_older_releases(pair, dtype, profile):
    """The release lines before the default that run the kernel: one model per moe variant."""
    model_type = representative(pair)
    with stand_in(profile=profile) as npu:
        report = check_parity(model_type, dtype, npu=npu, kernels=["moe"])
    assert_moe_parity(report, model_type, profile)
    assert pair[1] in npu_autopatch.status()[model_type].variants.values()


@DTYPES
@pytest.mark.parametrize("pair", VARIANTS, ids=["/".join(p) for p in VARIANTS])
def test_below_op_plugin_7_2_the_experts_run_stock_and_the_model_still_matches(pair, dtype):
    """torch_npu 2.6.0 (op-plugin 7.1.0): the patcher gates the moe kernel (no backward for the token
    ops, no group_type 2), status() says why, and the model's other kernels hold parity with the
    experts stock. One model per moe variant: the gate is the kernel's requirement, not the model's."""
    model_type = representative(pair)
    with stand_in(profile=GATED) as npu:
        report = check_parity(model_type, dtype, npu=npu)
    assert report.state == "partial" and report.code == "kernel-unsupported", report.reason
    assert set(report.stock.values()) == {"kernel-unsupported"}
    assert "before op-plugin 7.2.0 (torch_npu 2.6.0 has op-plugin 7.1.0)" in report.reason
    assert report.passed, report  # gated, told, and the rest matches stock
    assert "moe" not in report.kernels and report.ops_called.get("npu_rms_norm")
    assert not any(op.startswith(("npu_moe", "npu_grouped_matmul")) for op in report.ops_called)
    assert not report.missing_grads, f"no gradient reached {report.missing_grads}"
    assert_within_tolerance(report)


LAZY_SCRIPT = """
import json, torch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import check_parity
reports = {{}}
with stand_in() as npu:
    for model in {models!r}:
        report = check_parity(model, torch.float32, npu=npu, lazy=True)
        reports[model] = {{**vars(report), "passed": report.passed}}
print(json.dumps(reports))
"""


@FULL
def test_moe_models_patched_by_the_import_hook_with_every_kernel_match_stock():
    """The path of NPU_AUTOPATCH=1, with all kernels: moe composes with the others. (The default selection
    has the import-hook path of every model, in test_parity_models.py.)"""
    models = [m for m in sorted(MOE_LAYERS) if present(m)]
    child = run_python(LAZY_SCRIPT.format(models=models))
    assert child.returncode == 0, child.stderr
    reports = json.loads(child.stdout.splitlines()[-1])
    assert sorted(reports) == models
    for model, report in reports.items():
        assert report["state"] == "applied", (model, report["reason"])
        assert "moe" in report["kernels"], model
        assert "moe not applied" not in (report["reason"] or ""), report["reason"]
        calls = expected_calls(model)
        assert {op: report["ops_called"].get(op) for op in MOE_OWN} == {op: calls[op] for op in MOE_OWN}
        assert report["passed"], report


@MODEL_TYPES
def test_a_single_token_matches_stock(model_type, npu_stand_in):
    """A 1x1 batch: top-2 of four (or eight) experts leaves most of them without rows, so
    every grouped matmul, forward and backward, has empty groups."""
    model = tiny_model(model_type)
    input_ids, labels = torch.tensor([[17]]), torch.tensor([[42]])
    stock_logits, stock = forward_backward(model, input_ids, labels)
    npu_autopatch.enable(models=[model_type], kernels=["moe"])
    try:
        assert npu_autopatch.status()[model_type].state == "applied"
        calls = npu_stand_in.calls["npu_grouped_matmul"]
        patched_logits, patched = forward_backward(model, input_ids, labels)
        calls = npu_stand_in.calls["npu_grouped_matmul"] - calls
    finally:
        npu_autopatch.disable()
    assert calls == 6 * MOE_LAYERS[model_type]
    assert relative_error(patched_logits, stock_logits) <= 1e-4
    # No gradient where stock has none (a 4.x expert without a token): None, not zeros.
    assert [n for n, g in patched.items() if g is None] == [n for n, g in stock.items() if g is None]
    # With one key, the query path's gradients are zero in exact arithmetic (the softmax is
    # constant); rounding noise around zero is no relative error, hence the floor. The default
    # attention is torch_npu's fused op on the device, whose backward rebuilds the softmax from its
    # saved statistics: its noise there is ~1e-7 of the largest gradient, so the floor is 1e-2 of it.
    floor = 1e-2 * max(g.abs().max() for g in stock.values() if g is not None)
    for name, expected in stock.items():
        if expected is not None:
            scale = max(expected.abs().max(), floor)
            assert (patched[name] - expected).abs().max() <= 1e-4 * scale, name


def stock_route(logits, top_k, renormalise, dtype=torch.float):
    """transformers' softmax routing (Qwen's TopKRouter, 4.x's sparse blocks): fp32 softmax over every
    expert, top-k, optionally renormalised (in ``dtype``: fp64 for the reference)."""
    probs = torch.softmax(logits, dim=-1, dtype=dtype)
    top, experts = torch.topk(probs, top_k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True) if renormalise else top), experts


@pytest.mark.parametrize("renormalise", [True, False], ids=["norm_topk_prob", "no-renormalisation"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_routing_on_the_chosen_logits_picks_stocks_experts_with_weights_as_close_to_fp64(renormalise, dtype):
    """The moe kernel's routing (``_route``: top-k on the logits, then a softmax over the k, or
    without renormalisation, stock's probabilities gathered) against stock's, 4,096 tokens over 128
    experts, top-8: the same experts (no ties among distinct random logits), weights no further from the
    fp64 reference than stock's own, and the same gradient of the logits."""
    from npu_autopatch.kernels.moe._compute import _route

    torch.manual_seed(0)
    logits = (torch.randn(4096, 128) * 2).to(dtype).requires_grad_()
    weights, experts = _route(logits, 8, renormalise)
    stock_weights, stock_experts = stock_route(logits, 8, renormalise)
    assert torch.equal(experts, stock_experts)
    exact, _ = stock_route(logits.double(), 8, renormalise, torch.double)
    error, stock_error = ((w.double() - exact).norm() / exact.norm() for w in (weights, stock_weights))
    assert error <= stock_error * 1.05, (error, stock_error)  # relative Frobenius: within rounding of stock's
    upstream = torch.randn_like(weights)
    (grad,) = torch.autograd.grad((weights * upstream).sum(), logits)
    (stock_grad,) = torch.autograd.grad((stock_weights * upstream).sum(), logits)
    tolerance = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else {}  # bf16: its own rounding
    torch.testing.assert_close(grad, stock_grad, **tolerance)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "mixtral"], indirect=True)
def test_the_patched_router_returns_stocks_logits_experts_and_weights(model_type, npu_stand_in):
    """5.x's ``*TopKRouter`` under the moe kernel (its router variants): the same logits, the same experts,
    the same weights in the same dtype (Qwen's cast to the logits' dtype, Mixtral's fp32)."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("4.57's sparse blocks route inside the moe kernel's block forward")
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(model_type, dtype)
        router = model.model.layers[-1].mlp.gate  # a sparse layer (the last)
        x = torch.randn(64, model.config.hidden_size, dtype=dtype)
        with torch.no_grad():
            stock = router(x)
            npu_autopatch.enable(models=[model_type], kernels=["moe"])
            try:
                assert type(router).forward.__module__ == "npu_autopatch.kernels.moe"
                patched = router(x)
            finally:
                npu_autopatch.disable()
        assert torch.equal(patched[0], stock[0]) and torch.equal(patched[2], stock[2])
        assert patched[1].dtype == stock[1].dtype
        torch.testing.assert_close(patched[1], stock[1])


class GatedMLP(torch.nn.Module):
    """A 4.x expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def fused_module(experts, hidden, intermediate):
    module = torch.nn.Module()
    module.num_experts = experts
    module.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * intermediate, hidden) / hidden**0.5)
    module.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, intermediate) / intermediate**0.5)
    module.act_fn = torch.nn.SiLU()
    return module


def list_module(experts, hidden, intermediate):
    module = torch.nn.Module()
    module.experts = torch.nn.ModuleList([GatedMLP(hidden, intermediate) for _ in range(experts)])
    return module


@pytest.mark.parametrize(
    ("variant", "make_module", "empty_expert"),
    [
        ("experts", fused_module, lambda module: module.gate_up_proj.grad[1]),
        ("moe-method", list_module, lambda module: module.experts[1].gate_proj.weight.grad),
    ],
    ids=["fused-weights", "module-list"],
)
@pytest.mark.parametrize("profile", ["a2-newest", "a2-2.7.1", "950-newest"])
def test_an_expert_without_rows_between_others(variant, make_module, empty_expert, profile):
    """Twelve tokens routed around expert 1: an empty group between full ones, in the forward
    grouped matmuls, dx (group type 0) and dW (group type 2), against the stock loop.

    On 2.7.1 (CANN 8.3) and on the Ascend 950 (whose path was not read) the K-split leaves an empty
    group's block unwritten (NaN in the stand-in): the kernel must zero it itself."""
    with stand_in(profile=profile) as npu_stand_in:
        check_an_expert_without_rows(variant, make_module, empty_expert, npu_stand_in)


def check_an_expert_without_rows(variant, make_module, empty_expert, npu_stand_in):
    torch.manual_seed(0)
    module = make_module(4, 16, 8)
    stock = {"experts": fused_experts(F.silu), "moe-method": moe_method(weighted=True)}[variant]
    kernel = next(v for v in KERNELS["moe"].variants if v.name == variant).build(stock, npu_stand_in, None)
    x = torch.randn(12, 16)
    index = torch.tensor([0, 2, 3])[torch.argsort(torch.randn(12, 3), dim=-1)[:, :2]]
    weights = torch.softmax(torch.randn(12, 2), dim=-1)
    dy = torch.randn(12, 16)

    def step(forward):
        module.zero_grad(set_to_none=True)
        inputs = (x.clone().requires_grad_(), weights.clone().requires_grad_())
        calls = npu_stand_in.calls["npu_grouped_matmul"]
        out = forward(module, inputs[0], index, inputs[1])
        forward_calls = npu_stand_in.calls["npu_grouped_matmul"] - calls
        (out * dy).sum().backward()
        backward_calls = npu_stand_in.calls["npu_grouped_matmul"] - calls - forward_calls
        grads = [t.grad for t in inputs] + [p.grad for p in module.parameters()]
        return out.detach(), grads, empty_expert(module), (forward_calls, backward_calls)

    stock_out, stock_grads, stock_empty, _ = step(stock)
    out, grads, empty, calls = step(kernel)
    assert calls == (2, 4)
    torch.testing.assert_close(out, stock_out)
    assert [g is None for g in grads] == [g is None for g in stock_grads]
    for got, expected in zip(grads, stock_grads, strict=True):
        if expected is not None:
            torch.testing.assert_close(got, expected)
    # Stock's gradient of the empty expert, exactly: zero rows of the fused weight, or None
    # for the expert's own modules (which an optimizer then skips).
    if stock_empty is None:
        assert empty is None
    else:
        assert (stock_empty == 0).all() and (empty == 0).all()


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_the_kernel_knows_which_devices_zero_an_empty_experts_block(profile):
    """The kernel's rule (SoC family and CANN version) agrees with each stand-in profile's, read from
    the CANN kernel's sources: it zeroes dW itself exactly where the device leaves the block unwritten."""
    from npu_autopatch.kernels.moe._compute import _k_split_zeroes_empty_groups

    with stand_in(profile=profile) as npu:
        assert _k_split_zeroes_empty_groups(npu) == npu.PROFILE.gmm_zero_fills_empty_groups
        del npu.npu.utils  # a torch_npu without the query: the kernel zeroes the blocks itself
        assert not _k_split_zeroes_empty_groups(npu)


def kn_module(experts, hidden, intermediate):
    """4.57 Qwen3-VL-MoE's experts: the weights already in the grouped matmul's [E, K, N] layout."""
    module = torch.nn.Module()
    module.num_experts, module.hidden_size = experts, hidden
    module.gate_up_proj = torch.nn.Parameter(torch.randn(experts, hidden, 2 * intermediate) / hidden**0.5)
    module.down_proj = torch.nn.Parameter(torch.randn(experts, intermediate, hidden) / intermediate**0.5)
    module.act_fn = torch.nn.SiLU()
    return module


def kn_experts(self, hidden_states, routing_weights, router_indices):
    """4.57 Qwen3VLMoeTextExperts.forward's training loop (dense [T, E] routing weights)."""
    x = hidden_states.reshape(-1, self.hidden_size)
    out = torch.zeros_like(x)
    for expert in range(self.num_experts):
        token = torch.where((router_indices == expert).any(-1))[0]
        gate, up = (x[token] @ self.gate_up_proj[expert]).chunk(2, dim=-1)
        rows = (F.silu(gate) * up) @ self.down_proj[expert]
        out.index_add_(0, token, rows * routing_weights[token, expert, None])
    return out.view(hidden_states.shape[0], -1, self.hidden_size)


class BackwardOps(TorchDispatchMode):
    """The aten ops a backward dispatches, with the largest tensor each one writes or reads."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and not func.is_view:
            tensors = (*args, *torch.utils._pytree.tree_leaves(out))
            touched = [t for t in tensors if isinstance(t, torch.Tensor)]
            self.ops.append((func.overloadpacket.__name__, max((t.numel() for t in touched), default=0)))
        return out


# A whole-tensor pass that moves a weight's gradient without computing it: a fill, or a copy into
# another layout (AccumulateGrad's, a clone, a contiguous copy).
COPIES_AND_FILLS = {"copy_", "clone", "_to_copy", "fill_", "zero_", "masked_fill_", "masked_fill"}


@pytest.mark.parametrize(
    ("variant", "make_module", "every_expert_has_rows"),
    [("experts", fused_module, False), ("experts-kn", kn_module, False), ("moe-method", list_module, True)],
    ids=["5.x-fused", "4.57-qwen3-vl-moe", "4.x-module-list"],
)
@pytest.mark.parametrize("profile", ["a2-newest", "a2-2.7.1"])
def test_each_weight_gradient_arrives_in_its_parameters_strides_with_no_weight_sized_copy(
    variant, make_module, every_expert_has_rows, profile
):
    """The backward's ops, counted on the stand-in: two grouped matmuls per weight (dx, dW), each dW
    written in the parameter's own layout (so AccumulateGrad takes it as it is) and never copied.
    Only where the device's K-split leaves an empty expert's block unwritten (2.7.1: CANN 8.3) does the
    kernel zero that expert's block, one small fill per weight (expert 1 has no rows); the stacked 4.x
    experts have no empty expert."""
    torch.manual_seed(0)
    module = make_module(4, 16, 8)
    with stand_in(profile=profile) as npu:
        kernel = next(v for v in KERNELS["moe"].variants if v.name == variant).build(None, npu, None)
        x = torch.randn(12, 16, requires_grad=True)
        index = torch.tensor([0, 2, 3])[torch.argsort(torch.randn(12, 3), dim=-1)[:, :2]]
        weights = torch.softmax(torch.randn(12, 2), dim=-1).requires_grad_()
        if variant == "experts-kn":
            dense = torch.zeros(12, 4).scatter(1, index, weights)
            out = kernel(module, x.view(1, 12, 16), dense, index)
        else:
            out = kernel(module, x, index, weights)
        calls = npu.calls["npu_grouped_matmul"]
        with BackwardOps() as recorded:
            out.square().sum().backward()
        assert npu.calls["npu_grouped_matmul"] - calls == 4
    parameters = dict(module.named_parameters())
    smallest = min(p.numel() for p in parameters.values() if p.grad is not None)
    moved = [(op, n) for op, n in recorded.ops if op in COPIES_AND_FILLS and n >= smallest // 4]
    fills = 0 if every_expert_has_rows or PROFILES[profile].gmm_zero_fills_empty_groups else 2
    # a fill of one expert's block: a quarter of the weight (four experts)
    sizes = sorted(p.numel() // 4 for p in parameters.values())[:fills]
    assert sorted(moved) == [("zero_", n) for n in sizes], moved
    for name, parameter in parameters.items():
        if parameter.grad is not None:
            assert parameter.grad.stride() == parameter.stride(), name
            assert parameter.grad.isfinite().all(), name
    assert sum(p.grad is not None for p in parameters.values()) == len(parameters) - (
        3 if every_expert_has_rows else 0
    )  # 4.x: expert 1, without rows, gets no gradient (None) as in the stock loop


@pytest.mark.parametrize(
    ("variant", "make_module"),
    [("experts", fused_module), ("moe-method", list_module)],
    ids=["fused-weights", "module-list"],
)
def test_a_rank_without_tokens_runs_stock_forward_and_backward(variant, make_module, npu_stand_in):
    """A micro-batch with no tokens at all: the ops would get empty inputs (npu_swiglu refuses them, the
    grouped matmul skips its kernel and leaves its output unwritten), so the call runs stock."""
    torch.manual_seed(0)
    module = make_module(4, 16, 8)
    stock = {"experts": fused_experts(F.silu), "moe-method": moe_method(weighted=True)}[variant]
    kernel = next(v for v in KERNELS["moe"].variants if v.name == variant).build(stock, npu_stand_in, None)
    x, index = torch.randn(0, 16, requires_grad=True), torch.zeros(0, 2, dtype=torch.int64)
    weights = torch.rand(0, 2, requires_grad=True)
    results = []
    for forward in (stock, kernel):
        module.zero_grad(set_to_none=True)
        out = forward(module, x, index, weights)
        (out.sum() + sum(p.sum() for p in module.parameters()) * 0).backward()
        results.append(
            (out.detach(), [None if p.grad is None else p.grad.clone() for p in module.parameters()])
        )
    (stock_out, stock_grads), (out, grads) = results
    assert out.shape == stock_out.shape == (0, 16)
    for got, expected in zip(grads, stock_grads, strict=True):
        torch.testing.assert_close(got, expected)
    assert not any(op.startswith(("npu_moe", "npu_grouped")) for op in npu_stand_in.calls)


# One model per variant in use: all of 5.x's are fused experts; 4.57 has four layouts.
@pytest.mark.parametrize(
    "model_type",
    ["qwen3_moe"]
    if int(transformers.__version__.split(".")[0]) >= 5
    else ["qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_vl_moe"],
    indirect=True,
)
def test_an_activation_other_than_silu_runs_stock(model_type, npu_stand_in):
    report = check_parity(model_type, npu=npu_stand_in, kernels=["moe"], hidden_act="gelu")
    assert report.state == "applied", report.reason
    assert report.kernels == ("moe",)
    assert kernel_ops(report.ops_called) == {}  # (the default attention is torch_npu's sdpa)
    assert (report.logits_error, report.grad_error, report.missing_grads) == (0.0, 0.0, ())


def test_a_torch_npu_without_a_routing_op_fails_the_model_with_the_op_named(npu_stand_in):
    model_type = next(m for m in sorted(MOE_LAYERS) if present(m))
    tiny_model(model_type)  # imports the modeling module
    del npu_stand_in.npu_moe_token_permute
    npu_autopatch.enable(models=[model_type], kernels=["moe"])
    record = npu_autopatch.status()[model_type]
    assert record.state == "failed"
    assert "npu_moe_token_permute" in record.reason and "moe" in record.reason, record.reason


# --- the probes refuse lookalikes whose math differs ----------------------------------------


def fused_experts(act):
    """A 5.x-style fused experts forward with the activation ``act``."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            rows = F.linear(act(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, rows * top_k_weights[token, slot, None])
        return out

    return forward


def sparse_block(renormalise):
    """A 4.x-style sparse block forward; ``renormalise(self)`` says whether top-k is renormalised."""

    def forward(self, hidden_states):
        batch, length, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        router_logits = self.gate(x)
        weights, index = torch.topk(router_logits.softmax(-1, dtype=torch.float), self.top_k, dim=-1)
        if renormalise(self):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for expert, module in enumerate(self.experts):
            token, slot = torch.where(index == expert)
            out.index_add_(0, token, module(x[token]) * weights[token, slot, None])
        return out.view(batch, length, hidden), router_logits

    return forward


def moe_method(weighted):
    """A 4.x DeepSeek-V3-style ``moe`` method; ``weighted``: whether it applies the routing weights."""

    def moe(self, hidden_states, topk_indices, topk_weights):
        out = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        for expert, module in enumerate(self.experts):
            token, slot = torch.where(topk_indices == expert)
            if token.numel() == 0:  # as stock: an expert without tokens does not run
                continue
            rows = module(hidden_states[token])
            out.index_add_(0, token, rows * topk_weights[token, slot, None] if weighted else rows)
        return out.type(hidden_states.dtype)

    return moe


@pytest.mark.parametrize(
    ("same", "different", "variant"),
    [
        (fused_experts(F.silu), fused_experts(F.gelu), "experts"),
        (sparse_block(lambda self: self.norm_topk_prob), sparse_block(lambda self: True), "sparse-block"),
        (moe_method(weighted=True), moe_method(weighted=False), "moe-method"),
    ],
    ids=["experts-activation", "sparse-block-renormalisation", "moe-method-weights"],
)
def test_the_probe_accepts_the_same_math_and_refuses_a_lookalike(same, different, variant):
    chosen, reason = choose_variant(KERNELS["moe"], same)
    assert chosen is not None and chosen.name == variant, reason
    chosen, reason = choose_variant(KERNELS["moe"], different)
    assert chosen is None
    assert f"{variant}: the math differs from stock" in reason, reason
