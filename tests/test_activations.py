"""The GELU family (issue 34): npu_gelu, npu_fast_gelu and npu_geglu on the stand-in, per release, and the
activations kernels on transformers' activation classes: exact GELU equal to the CPU's (which aten's gelu on
the NPU is not), the tanh forms and quick GELU equal to stock, fp32 and bf16, gradients too, fused ops
counted, against an fp64 reference; quick GELU stock where its backward is missing, with the reason."""

import warnings

import pytest
import torch
import transformers
from transformers.activations import ACT2CLS, ACT2FN

import npu_autopatch
from npu_autopatch.kernels import KERNELS
from npu_autopatch.kernels.activations import gelu_mode
from npu_autopatch.testing import PROFILES, stand_in
from npu_autopatch.testing.device.gelu import aten_gelu
from npu_autopatch.testing.parity import (
    TOLERANCE,
    check_parity,
    forward_backward,
    model_batch,
    relative_error,
    tiny_model,
)

from .conftest import FULL, present

GELU = torch.nn.functional.gelu


def grid(dtype=torch.float32):
    """Inputs across GELU's curve, the tails included (where the tanh form and erf part most)."""
    return torch.linspace(-6, 6, 4 * 256).reshape(4, 256).to(dtype).requires_grad_()


def value_and_grad(fn, x):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=torch.float32)).reshape(y.shape).to(y.dtype))
    return y.detach().double(), x.grad.double()


# --- the stand-in's ops --------------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
def test_npu_gelu_honours_approximate_forward_and_backward(profile):
    with stand_in(profile=profile) as npu:
        for approximate in ("none", "tanh"):
            got = value_and_grad(lambda x, a=approximate: npu.npu_gelu(x, approximate=a), grid())
            want = value_and_grad(lambda x, a=approximate: GELU(x, approximate=a), grid())
            assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], atol=1e-6), approximate
        # the two forms do differ: the test would see an ignored argument
        assert (GELU(grid(), approximate="tanh") - GELU(grid())).abs().max() > 1e-4
        with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh'"):
            npu.npu_gelu(grid(), approximate="erf")
        assert npu.calls["npu_gelu"] == 3 and npu.calls["npu_gelu_backward"] == 2


@pytest.mark.parametrize("profile", PROFILES)
def test_npu_fast_gelu_is_quick_gelu_with_a_backward_from_7_3(profile):
    quick = ACT2FN["quick_gelu"]
    with stand_in(profile=profile) as npu:
        assert torch.allclose(npu.npu_fast_gelu(grid()), quick(grid()), atol=1e-6)
        x = grid()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            npu.npu_fast_gelu(x).sum().backward()
        has_backward = "npu_fast_gelu" in PROFILES[profile].autograd
        assert has_backward == (PROFILES[profile].op_plugin.startswith("master"))
        if has_backward:
            got, want = value_and_grad(npu.npu_fast_gelu, grid()), value_and_grad(quick, grid())
            assert torch.allclose(got[1], want[1], atol=1e-6)
            assert npu.calls["npu_fast_gelu_backward"] == 2
        else:  # torch_npu's autograd fallback: a warning, no gradient
            assert x.grad is None and "npu_fast_gelu_backward" not in npu.calls
            assert any("autograd kernel was not registered" in str(w.message) for w in caught)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("approximate", [0, 1])
@pytest.mark.parametrize("activate_left", [True, False])
def test_npu_geglu_gelus_the_half_activate_left_names(profile, approximate, activate_left):
    """activate_left=True: gelu(left) * right (HF's act(gate) * up on cat([gate, up])); False: left *
    gelu(right). The second output is the GELU, not differentiable (derivatives.yaml)."""
    mode = "tanh" if approximate == 1 else "none"

    def expected(x):
        left, right = x.chunk(2, -1)
        gate, other = (left, right) if activate_left else (right, left)
        return GELU(gate, approximate=mode) * other

    with stand_in(profile=profile) as npu:

        def fused(x):
            out, gelu = npu.npu_geglu(x, dim=-1, approximate=approximate, activate_left=activate_left)
            assert not gelu.requires_grad
            return out

        got, want = value_and_grad(fused, grid()), value_and_grad(expected, grid())
        assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-5)
        assert npu.calls["npu_geglu"] == 1 and npu.calls["npu_geglu_grad"] == 1
        with pytest.raises(RuntimeError, match="must be even"):
            npu.npu_geglu(torch.randn(2, 7))


def test_aten_gelu_on_the_device_is_the_tanh_form_whatever_approximate_says():
    x = grid().detach()
    with aten_gelu():
        assert torch.equal(torch.nn.functional.gelu(x), GELU(x, approximate="tanh"))
        assert torch.equal(ACT2FN["gelu"](x), GELU(x, approximate="tanh"))  # built inside: binds the device's
    assert torch.nn.functional.gelu is GELU


# --- the kernels on transformers' activation classes ---------------------------------------------

# ACT2FN name -> (the op it runs, the GELU it computes)
ACTIVATIONS = {
    "gelu": ("npu_gelu", "none"),
    "gelu_python": ("npu_gelu", "none"),
    "gelu_new": ("npu_gelu", "tanh"),
    "gelu_fast": ("npu_gelu", "tanh"),
    "gelu_pytorch_tanh": ("npu_gelu", "tanh"),
    "gelu_python_tanh": ("npu_gelu", "tanh"),
    "quick_gelu": ("npu_fast_gelu", None),
}


def reference(name, x):
    """The activation in fp64: what both stock and the kernel approximate."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return GELU(x, approximate=ACTIVATIONS[name][1])


@pytest.mark.parametrize(
    "profile", [pytest.param(p, marks=FULL) if p != "a2-newest" else p for p in PROFILES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_each_activation_runs_its_op_and_matches_stock_and_fp64(name, dtype, profile):
    op, mode = ACTIVATIONS[name]
    with stand_in(profile=profile) as npu:
        module = ACT2FN[name]
        if op == "npu_gelu":
            assert gelu_mode(module) == mode
        stock = value_and_grad(module, grid(dtype))
        npu_autopatch.enable(models=["activations"], kernels=["gelu", "quick_gelu"])
        try:
            record = npu_autopatch.status()["activations"]
            patched = value_and_grad(module, grid(dtype))
        finally:
            npu_autopatch.disable()
        exact = value_and_grad(lambda x: reference(name, x), grid(torch.float64))
    fused = op == "npu_gelu" or profile == "a2-newest"  # npu_fast_gelu: a backward from 7.3.0, A2 only
    assert npu.calls[op] == (1 if fused else 0)
    if not fused:
        assert record.stock["transformers.activations:QuickGELUActivation.forward"] == "kernel-unsupported"
        assert "npu_fast_gelu" in record.reason
    tolerance = TOLERANCE[dtype]
    for got, want, truth in zip(patched, stock, exact, strict=True):
        assert relative_error(got, want) <= tolerance
        # fp64: the kernel's error is no larger than stock's own
        assert relative_error(got, truth) <= relative_error(want, truth) + tolerance / 10


def test_an_instance_whose_function_is_no_known_gelu_runs_stock_counted_with_the_reason(npu_stand_in):
    module = ACT2CLS["gelu"]()
    module.act = torch.relu  # someone's own choice on a GELUActivation
    x = grid().detach()
    npu_autopatch.enable(models=["activations"], kernels=["gelu"])
    try:
        assert torch.equal(module(x), torch.relu(x))
        calls = npu_autopatch.status()["activations"].calls["transformers.activations:GELUActivation.forward"]
        why = KERNELS["gelu"].report.instance_stock(module)
    finally:
        npu_autopatch.disable()
    assert npu_stand_in.calls["npu_gelu"] == 0
    assert calls["fused"] == 0 and list(calls["stock"].values()) == [1]
    assert why == "GELUActivation calls relu, no GELU npu_gelu computes" == next(iter(calls["stock"]))


def test_the_kernels_switch_like_the_others(npu_stand_in):
    """kernels= (NPU_AUTOPATCH_KERNELS) selects them one by one: quick_gelu alone leaves GELU stock."""
    npu_autopatch.enable(models=["activations"], kernels=["quick_gelu"])
    try:
        assert ACT2FN["gelu"].forward.__func__ is ACT2CLS["gelu"].__dict__["forward"]  # stock
        ACT2FN["gelu"](grid().detach())
        ACT2FN["quick_gelu"](grid().detach())
        record = npu_autopatch.status()["activations"]
    finally:
        npu_autopatch.disable()
    assert record.kernels == ("quick_gelu",)
    assert npu_stand_in.calls["npu_fast_gelu"] == 1 and "npu_gelu" not in npu_stand_in.calls


# --- whole models ----------------------------------------------------------------------------------


def test_exact_gelu_equals_the_cpus_where_aten_gelu_on_the_device_does_not(npu_stand_in):
    """mistral3's vision tower (Pixtral) is hidden_act="gelu": on the device stock computes the tanh form
    (the stand-in's aten gelu, testing/device/gelu.py); patched it runs npu_gelu(approximate="none") and
    equals the CPU's exact GELU, logits and every gradient."""
    if not present("mistral3"):
        pytest.skip("no mistral3 in this transformers")
    model = tiny_model("mistral3")
    input_ids, labels, inputs = model_batch(model)
    cpu = forward_backward(model, input_ids, labels, **inputs)

    def on_device():
        with aten_gelu():  # a GELUActivation binds F.gelu when built: build it inside
            device_model = tiny_model("mistral3")
            device_model.load_state_dict(model.state_dict())
            return forward_backward(device_model, input_ids, labels, **inputs)

    stock = on_device()
    grads = [(stock[1][n], g) for n, g in cpu[1].items() if g is not None]
    assert max(relative_error(got, want) for got, want in grads) > 1e-6  # the tanh form, not exact
    npu_autopatch.enable(models=["mistral3", "activations"], kernels=["gelu"])
    try:
        patched = on_device()
        calls = npu_autopatch.status()["activations"].calls["transformers.activations:GELUActivation.forward"]
    finally:
        npu_autopatch.disable()
    assert relative_error(patched[0], cpu[0]) == 0.0
    assert all(torch.equal(patched[1][n], g) for n, g in cpu[1].items() if g is not None)
    assert calls["fused"] == npu_stand_in.calls["npu_gelu"] == npu_stand_in.calls["npu_gelu_backward"] > 0


# Per tiny model with the activations entry patched beside it: (npu_gelu, npu_fast_gelu) per forward, and
# the backward calls where fewer (gemma3's SigLIP pooling head is unused: no gradient through its MLP).
TOWERS = {
    "qwen3_vl": {"npu_gelu": 1},  # the vision MLP: gelu_pytorch_tanh
    "qwen3_vl_moe": {"npu_gelu": 1},
    "qwen3_5": {"npu_gelu": 1},
    "qwen3_5_moe": {"npu_gelu": 1},
    "gemma3": {"npu_gelu": 4},  # SigLIP: gelu_pytorch_tanh (encoder and pooling head)
    "gemma": {"npu_gelu": 2},  # the MLPs' gelu_pytorch_tanh, with geglu not selected
    "gemma2": {"npu_gelu": 2},
    "qwen2_vl": {"npu_fast_gelu": 1},  # the vision MLP: quick_gelu
    "qwen2_5_omni": {"npu_gelu": 1},  # the audio tower: gelu
    "qwen3_omni_moe": {"npu_gelu": 3},  # the audio tower and the vision tower's
    "mistral3": {"npu_gelu": 2},  # Pixtral's MLP (gelu) and the projector's gelu
}
BACKWARD = {"gemma3": {"npu_gelu": 3}}
GRAD_OP = {"npu_gelu": "npu_gelu_backward", "npu_fast_gelu": "npu_fast_gelu_backward"}


@pytest.mark.parametrize(
    "profile", [pytest.param(p, marks=FULL) if p != "a2-newest" else p for p in PROFILES]
)
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=FULL)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("model_type", TOWERS)
def test_towers_match_stock_with_the_activations_patched(model_type, dtype, profile):
    if not present(model_type):
        pytest.skip(f"no {model_type} in transformers {transformers.__version__}")
    with stand_in(profile=profile) as npu:
        report = check_parity(
            model_type, dtype, npu=npu, kernels=["gelu", "quick_gelu"], integrations=["activations"]
        )
        npu_autopatch.enable(models=["activations"], kernels=["gelu", "quick_gelu"])  # its status meanwhile
        try:
            record = npu_autopatch.status()["activations"]
        finally:
            npu_autopatch.disable()
    quick = PROFILES[profile].name == "a2-newest"  # npu_fast_gelu's backward (7.3.0 on), on an A2
    for op, count in TOWERS[model_type].items():
        expected = count if op == "npu_gelu" or quick else 0
        assert report.ops_called.get(op, 0) == expected, (op, report.ops_called)
        backward = BACKWARD.get(model_type, {}).get(op, count) if expected else 0
        assert report.ops_called.get(GRAD_OP[op], 0) == backward, (op, report.ops_called)
    assert (record.state == "applied") == quick, record.reason
    if not quick:
        assert record.stock == {"transformers.activations:QuickGELUActivation.forward": "kernel-unsupported"}
        assert "npu_fast_gelu" in record.reason and "quick_gelu not applied" in record.reason
    assert not report.missing_grads and not report.over_tolerance, (report.logits_error, report.grad_error)
