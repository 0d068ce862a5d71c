"""transformers 5.x's own experts switch keeps working: the MoE kernel is an experts implementation
(issue 10 item 11, contract C4). 4.57 has no such interface: the class method is replaced."""

import pytest
import torch
import transformers

import npu_autopatch
from npu_autopatch.testing.parity import tiny_model

V4 = int(transformers.__version__.split(".")[0]) < 5
KEY = "npu_grouped_mm"

pytestmark = pytest.mark.skipif(V4, reason="transformers 4.x has no experts interface")


def moe_calls(npu):
    return npu.calls["npu_grouped_matmul"]


def run(model):
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))


def test_the_kernel_is_the_default_of_patched_models_and_the_switch_still_works(npu_stand_in):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    experts_forward = qwen3_moe.Qwen3MoeExperts.__dict__["forward"]
    built_before = tiny_model("qwen3_moe")
    npu_autopatch.enable(models=["qwen3_moe"], kernels=["moe"])
    assert qwen3_moe.Qwen3MoeExperts.__dict__["forward"] is experts_forward  # transformers' dispatcher stays
    assert KEY in ALL_EXPERTS_FUNCTIONS
    record = npu_autopatch.status()["qwen3_moe"]
    assert record.state == "applied" and record.kernels == ("moe",)

    model = tiny_model("qwen3_moe")
    assert model.config._experts_implementation == "grouped_mm"  # nothing requested: transformers' name
    for built in (model, built_before):  # the kernel is reached at dispatch time, by that name
        before = moe_calls(npu_stand_in)
        run(built)
        assert moe_calls(npu_stand_in) > before
    model.set_experts_implementation(KEY)  # our name still works
    before = moe_calls(npu_stand_in)
    run(model)
    assert moe_calls(npu_stand_in) > before

    for other in ("eager", "batched_mm", "grouped_mm"):
        model.set_experts_implementation(other)
        before = moe_calls(npu_stand_in)
        run(model)
        assert moe_calls(npu_stand_in) == before, other

    seen = []

    def mine(self, hidden_states, top_k_index, top_k_weights):
        seen.append(type(self).__name__)
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](self, hidden_states, top_k_index, top_k_weights)

    ALL_EXPERTS_FUNCTIONS.register("mine_for_test", mine)
    try:
        model.set_experts_implementation("mine_for_test")
        run(model)
        assert seen and seen[0] == "Qwen3MoeExperts"
    finally:
        type(ALL_EXPERTS_FUNCTIONS)._global_mapping.pop("mine_for_test", None)


def test_an_explicit_choice_wins_and_status_says_so(npu_stand_in):
    from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

    npu_autopatch.enable(models=["qwen3_moe"], kernels=["moe"])
    model = tiny_model("qwen3_moe", experts_implementation="eager")
    assert model.config._experts_implementation == "eager"
    before = moe_calls(npu_stand_in)
    run(model)
    assert moe_calls(npu_stand_in) == before
    record = npu_autopatch.status()["qwen3_moe"]
    assert record.state == "applied"
    assert "experts_implementation='eager'" in record.reason, record.reason
    note = (
        "models given experts_implementation='eager' run that, not the moe kernel (an explicit choice wins)"
    )
    assert note in record.notes, record.notes
    npu_autopatch.disable()
    npu_autopatch.enable(models=["qwen3_moe"], kernels=["moe"])  # a new enable(): told of new choices only
    assert note not in npu_autopatch.status()["qwen3_moe"].notes


def test_disable_unregisters_and_a_model_built_while_patched_keeps_running(npu_stand_in):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    base = qwen3_moe.Qwen3MoePreTrainedModel
    npu_autopatch.enable(models=["qwen3_moe"], kernels=["moe"])
    assert "get_correct_experts_implementation" in base.__dict__
    model = tiny_model("qwen3_moe")
    npu_autopatch.disable()
    assert "get_correct_experts_implementation" not in base.__dict__
    assert ALL_EXPERTS_FUNCTIONS.get(KEY) is not None and ALL_EXPERTS_FUNCTIONS[KEY].__module__.startswith(
        "transformers"
    )  # our function is gone; the name stays an alias of transformers' own, for models built meanwhile
    before = moe_calls(npu_stand_in)
    run(model)
    assert moe_calls(npu_stand_in) == before
    assert tiny_model("qwen3_moe").config._experts_implementation == "grouped_mm"


def test_a_one_expert_layer_runs_stock_per_call_and_keeps_the_kernel(npu_stand_in):
    """The device refuses a group list of one count: a layer with one expert runs the stock code for
    that call, and the kernel stays in place for every other layer and call (no demotion)."""
    from transformers.models.hunyuan_v1_moe import modeling_hunyuan_v1_moe  # noqa: F401

    model = tiny_model("hunyuan_v1_moe", num_experts=1)
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        stock = model(tokens).logits
    npu_autopatch.enable(models=["hunyuan_v1_moe"], kernels=["moe"])
    model.set_experts_implementation(KEY)
    with torch.no_grad():
        first, second = model(tokens).logits, model(tokens).logits
    record = npu_autopatch.status()["hunyuan_v1_moe"]
    assert (record.state, record.code, record.stock) == ("applied", None, {}), record.reason
    assert moe_calls(npu_stand_in) == 0
    torch.testing.assert_close(first, stock)
    torch.testing.assert_close(second, stock)


def test_a_demoted_kernel_falls_back_even_under_a_wrapper_without_wrapped(npu_stand_in, monkeypatch):
    """A fused op raising (a device rule nobody knew) takes the kernel out on the first call
    (on_error). The model still selects our key; its fallback must not rely on ``__wrapped__``,
    which another library's wrapper of the class forward may not keep."""
    from transformers.models.hunyuan_v1_moe import modeling_hunyuan_v1_moe as hunyuan

    experts = hunyuan.HunYuanMoEV1Experts
    model = tiny_model("hunyuan_v1_moe")
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        stock = model(tokens).logits
    npu_autopatch.enable(models=["hunyuan_v1_moe"], kernels=["moe"])
    model.set_experts_implementation(KEY)

    def refuse(*args, **kwargs):
        raise RuntimeError("npu_grouped_matmul: refused by a rule nobody knew")

    monkeypatch.setattr(npu_stand_in, "npu_grouped_matmul", refuse)
    original = experts.forward

    def profiled(self, *args, **kwargs):  # e.g. a profiler's wrapper: no functools.wraps
        return original(self, *args, **kwargs)

    experts.forward = profiled
    try:
        with torch.no_grad():
            first, second = model(tokens).logits, model(tokens).logits
    finally:
        experts.forward = original
    record = npu_autopatch.status()["hunyuan_v1_moe"]
    assert record.state == "partial" and record.code == "op-failed", record.reason
    assert "refused by a rule nobody knew" in record.reason
    torch.testing.assert_close(first, stock)
    torch.testing.assert_close(second, stock)
