"""report(model): what a live model runs, per module class and rotary function, with the flags.

Every claim is checked against what really runs: the stand-in counts the fused ops of one
forward, so "ours" means the op ran and "runs stock" means it did not. Real transformers
tiny models on both majors; real accelerate hooks (cpu_offload, dispatch_model) on CPU.
"""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from accelerate import cpu_offload, dispatch_model
from accelerate.hooks import remove_hook_from_module
from accelerate.utils import imports as accelerate_imports

import npu_autopatch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.tiny import model_inputs, tiny_model

from .conftest import ROOT, child_env

V4 = int(transformers.__version__.split(".")[0]) < 5


def _entry(report, name):
    return next(e for e in report.modules if e.name == name)


def _flags(report, kind=None, subject=None):
    return [f for f in report.flags if kind in (None, f.kind) and subject in (None, f.subject)]


def _forward_ops(model, npu):
    """The fused-op calls of one forward of ``model``."""
    inputs, _labels = model_inputs(model)
    npu.calls.clear()
    with torch.no_grad():
        model(**inputs)
    return dict(npu.calls)


@pytest.fixture
def accelerate_sees_no_npu():
    """accelerate caches is_npu_available(); under the stand-in it says True and then calls NPU APIs
    (``torch.npu.empty_cache``, ``Module.npu``) that only real torch_npu has. Hook on plain CPU."""
    accelerate_imports.is_npu_available.cache_clear()
    yield
    accelerate_imports.is_npu_available.cache_clear()


def test_a_patched_dense_model_is_all_ours_without_flags():
    with stand_in() as npu:
        npu_autopatch.enable()
        model = tiny_model("qwen3")
        report = npu_autopatch.report(model)
        ops = _forward_ops(model, npu)
    norm, mlp = _entry(report, "Qwen3RMSNorm"), _entry(report, "Qwen3MLP")
    assert (norm.origin, norm.kernel, norm.defined_by) == ("ours", "rms_norm", "npu_autopatch.kernels.norm")
    assert (mlp.origin, mlp.kernel) == ("ours", "swiglu")
    assert [f.origin for f in report.functions] == ["ours"]
    assert report.flags == []
    assert ops["npu_rms_norm"] == norm.count == 9  # every instance really ran the fused op
    assert ops["npu_swiglu"] == mlp.count == 2
    assert report.counts["modules_ours"] == 11 and report.counts["modules_foreign"] == 0
    assert report.as_dict()["records"]["qwen3"]["state"] == "applied"
    assert "0 flags" in str(report) and "| `Qwen3RMSNorm` | 9 | ours |" in report.markdown()


def test_a_vision_language_model_reports_its_vision_tower():
    with stand_in():
        npu_autopatch.enable()
        model = tiny_model("qwen3_vl")
        report = npu_autopatch.report(model)
    names = {e.name for e in report.modules}
    assert {"Qwen3VLVisionBlock", "Qwen3VLVisionMLP", "Qwen3VLTextRMSNorm"} <= names
    assert _entry(report, "Qwen3VLTextRMSNorm").origin == "ours"
    vision_rotary = [f for f in report.functions if f.name.endswith(":apply_rotary_pos_emb_vision")]
    assert [f.origin for f in vision_rotary] == ["ours"]
    # The vision MLP is GELU: no kernel target, so it is flagged with what the probes say.
    (flag,) = _flags(report, "stock", "Qwen3VLVisionMLP")
    assert "not one of its targets" in flag.message and "no kernel reproduces it" in flag.message


def test_an_unpatched_model_has_its_norms_mlps_and_rotary_flagged_stock():
    model = tiny_model("qwen3")
    report = npu_autopatch.report(model)
    assert {_entry(report, "Qwen3RMSNorm").origin, _entry(report, "Qwen3MLP").origin} == {"stock"}
    flagged = {f.subject: f for f in _flags(report, "stock")}
    rotary = "transformers.models.qwen3.modeling_qwen3:apply_rotary_pos_emb"
    assert set(flagged) == {"Qwen3RMSNorm", "Qwen3MLP", rotary}
    # Off in this process: "not-enabled", or "disabled" once an earlier test patched qwen3.
    code = npu_autopatch.status()["qwen3"].code.value
    assert code in ("not-enabled", "disabled")
    assert {f.code for f in flagged.values()} == {code}
    assert report.counts["modules_ours"] == 0


def test_a_model_outside_the_table_is_flagged_with_what_the_probes_say():
    assert "exaone4" not in npu_autopatch.status(), "pick another model type outside the table"
    with stand_in():
        npu_autopatch.enable()
        report = npu_autopatch.report(tiny_model("exaone4"))
    flagged = {f.subject: f.message for f in _flags(report, "stock")}
    assert "not in the model table" in flagged["Exaone4RMSNorm"]
    assert "the probes say rms_norm reproduces it" in flagged["Exaone4RMSNorm"]
    assert "the probes say swiglu reproduces it" in flagged["Exaone4MLP"]
    assert report.counts["modules_ours"] == 0


def test_a_patched_mlp_instance_with_another_activation_is_reported_running_stock():
    with stand_in() as npu:
        npu_autopatch.enable()
        model = tiny_model("qwen3")
        model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # our swiglu leaves it to the stock code
        report = npu_autopatch.report(model)
        ops = _forward_ops(model, npu)
    mlp = _entry(report, "Qwen3MLP")
    assert (mlp.origin, mlp.runs) == ("ours", {"stock": 1, "ours": 1})
    (flag,) = report.flags
    assert (flag.kind, flag.instances) == ("stock", ["model.layers.0.mlp"])
    assert "activation is GELU, not SiLU" in flag.message
    assert ops["npu_swiglu"] == 1


def test_gemmas_gelu_mlp_and_its_towers_activations_are_ours_and_a_silu_instance_is_flagged():
    """Gemma3's gated GELU MLP runs geglu, its SigLIP tower's GELUTanh runs gelu (the activations entry);
    an MLP instance given SiLU runs stock, flagged with its activation."""
    with stand_in() as npu:
        npu_autopatch.enable()
        model = tiny_model("gemma3")
        model.model.language_model.layers[1].mlp.act_fn = torch.nn.SiLU()
        report = npu_autopatch.report(model)
        ops = _forward_ops(model, npu)
    assert _entry(report, "Gemma3MLP").origin == "ours" and _entry(report, "GELUTanh").origin == "ours"
    (flag,) = _flags(report, "stock", "Gemma3MLP")
    assert flag.instances == ["model.language_model.layers.1.mlp"]
    assert "its activation is SiLU, not a GELU npu_geglu computes" in flag.message
    assert ops["npu_geglu"] == 1 and ops["npu_gelu"] > 0  # the tower ran ours
    assert _entry(report, "Gemma3RMSNorm").origin == "ours"


def test_quick_gelu_the_release_cannot_train_is_flagged_gated_with_its_requirement():
    """qwen2_vl's vision MLP calls transformers' QuickGELUActivation, a target of the activations entry:
    on torch_npu 2.7.1 (op-plugin 7.2.0, no npu_fast_gelu backward) it runs stock, and report(model) says
    why, from that entry's status()."""
    with stand_in(profile="a2-2.7.1"):
        npu_autopatch.enable()
        report = npu_autopatch.report(tiny_model("qwen2_vl"))
        npu_autopatch.disable()
    assert _entry(report, "QuickGELUActivation").origin == "stock"
    (flag,) = _flags(report, "gated", "QuickGELUActivation")
    assert (
        flag.code == "kernel-unsupported"
        and "npu_fast_gelu has no backward before op-plugin 7.3.0" in flag.message
    )
    with stand_in():
        npu_autopatch.enable()
        report = npu_autopatch.report(tiny_model("qwen2_vl"))
    assert _entry(report, "QuickGELUActivation").origin == "ours"
    assert not _flags(report, None, "QuickGELUActivation")


def test_a_kernel_left_out_by_enable_leaves_the_mlps_stock_with_the_reason():
    with stand_in() as npu:
        npu_autopatch.enable(kernels=["rms_norm", "rope"])
        model = tiny_model("qwen3")
        report = npu_autopatch.report(model)
        ops = _forward_ops(model, npu)
    assert _entry(report, "Qwen3MLP").origin == "stock" and _entry(report, "Qwen3RMSNorm").origin == "ours"
    (flag,) = report.flags
    assert (flag.kind, flag.subject, flag.code) == ("stock", "Qwen3MLP", "no-kernel-selected")
    assert "swiglu kernel is not selected" in flag.message
    assert "npu_swiglu" not in ops and ops["npu_rms_norm"] == 9


def test_a_moe_kernel_the_device_profile_gates_off_is_flagged_with_its_requirement():
    with stand_in(profile="a2-2.6.0") as npu:
        npu_autopatch.enable()
        model = tiny_model("qwen3_moe")
        report = npu_autopatch.report(model)
        ops = _forward_ops(model, npu)
    (flag,) = _flags(report, "gated")
    experts = "Qwen3MoeSparseMoeBlock" if V4 else "Qwen3MoeExperts"
    assert (flag.subject, flag.code) == (experts, "kernel-unsupported")
    assert "op-plugin 7.2.0" in flag.message and "torch_npu >= 2.7.1" in flag.message
    assert _entry(report, experts).origin == "stock"
    assert "npu_grouped_matmul" not in ops and ops["npu_rms_norm"] > 0
    assert not _flags(report, "stock")  # the 5.x block only routes: its experts module is the one flagged


def test_deepseek_v3s_routed_experts_are_ours_on_both_majors():
    with stand_in() as npu:
        npu_autopatch.enable()
        model = tiny_model("deepseek_v3")
        report = npu_autopatch.report(model)
        ops = _forward_ops(model, npu)
    # 4.x: the block's ``moe`` method is replaced; 5.x: the fused experts run through the interface.
    experts = _entry(report, "DeepseekV3MoE" if V4 else "DeepseekV3Experts")
    assert (experts.origin, experts.kernel) == ("ours", "moe")
    assert experts.via == ("moe" if V4 else "experts interface 'grouped_mm'")
    assert report.flags == []
    assert ops["npu_grouped_matmul"] > 0


@pytest.mark.skipif(V4, reason="transformers 5.x experts interface")
def test_5x_experts_are_ours_through_the_experts_interface_unless_the_config_picks_another():
    with stand_in() as npu:
        npu_autopatch.enable()
        model = tiny_model("qwen3_moe")
        experts = _entry(npu_autopatch.report(model), "Qwen3MoeExperts")
        ours_ops = _forward_ops(model, npu)
        model.set_experts_implementation("eager")
        eager_report = npu_autopatch.report(model)
        eager = _entry(eager_report, "Qwen3MoeExperts")
        eager_ops = _forward_ops(model, npu)
    assert (experts.origin, experts.kernel, experts.via) == (
        "ours",
        "moe",
        "experts interface 'grouped_mm'",
    )
    assert ours_ops["npu_grouped_matmul"] > 0
    assert (eager.origin, eager.via) == ("stock", "experts interface 'eager'")
    (flag,) = eager_report.flags
    assert (flag.kind, flag.subject) == ("stock", "Qwen3MoeExperts")
    assert "its config selects 'eager'" in flag.message
    assert "set_experts_implementation('grouped_mm') switches it" in flag.message
    assert "npu_grouped_matmul" not in eager_ops


def test_cpu_offload_before_enable_is_flagged_captured_and_really_runs_stock(accelerate_sees_no_npu):
    model = tiny_model("qwen3")
    cpu_offload(model, execution_device="cpu")  # hooks every module with its own weights
    with stand_in() as npu:
        npu_autopatch.enable()
        report = npu_autopatch.report(model)
        ops = _forward_ops(model, npu)
    (flag,) = report.flags
    assert (flag.kind, flag.subject, len(flag.instances)) == ("captured-before-patching", "Qwen3RMSNorm", 9)
    assert "accelerate.hooks" in flag.message and "runs stock" in flag.message
    norm = _entry(report, "Qwen3RMSNorm")
    assert norm.origin == "ours" and norm.runs == {"stock": 9}
    assert "npu_rms_norm" not in ops  # the class is patched, yet no hooked instance calls the kernel
    assert ops["npu_swiglu"] == 2  # the MLPs hold no weights of their own: not hooked, so ours

    # remove_hook_from_module puts the captured bound method back on the instance: still stock.
    remove_hook_from_module(model, recurse=True)
    (flag,) = npu_autopatch.report(model).flags
    assert (flag.kind, flag.subject) == ("captured-before-patching", "Qwen3RMSNorm")
    assert "npu_rms_norm" not in _forward_ops(model, npu)
    # Deleting the instance attribute lets the class's (patched) forward through.
    for module in model.modules():
        vars(module).pop("forward", None)
    assert npu_autopatch.report(model).flags == []
    assert _forward_ops(model, npu)["npu_rms_norm"] == 9


def test_dispatch_model_while_patched_still_runs_our_kernel_after_disable(accelerate_sees_no_npu, tmp_path):
    with stand_in() as npu:
        npu_autopatch.enable()
        model = tiny_model("qwen3")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map.update({"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    npu_autopatch.disable()
    report = npu_autopatch.report(model)
    ops = _forward_ops(model, npu)
    captured = {f.subject: f for f in _flags(report, "captured-while-patched")}
    assert set(captured) == {"Qwen3RMSNorm", "Qwen3MLP"}
    assert len(captured["Qwen3RMSNorm"].instances) == 9
    assert "still runs our kernel after disable()" in captured["Qwen3RMSNorm"].message
    assert _entry(report, "Qwen3RMSNorm").runs == {"ours": 9}
    assert ops["npu_rms_norm"] == 9 and ops["npu_swiglu"] == 2  # after disable(): really ours
    assert "npu_rotary_mul" not in ops  # the rotary function is module-level: disable() did reach it
    assert [f.origin for f in report.functions] == ["stock"]


def _user_norm(self, hidden_states):
    return hidden_states * self.weight


def test_a_foreign_forward_is_reported_foreign_with_its_module(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    monkeypatch.setattr(qwen3.Qwen3RMSNorm, "forward", _user_norm)
    report = npu_autopatch.report(tiny_model("qwen3"))
    norm = _entry(report, "Qwen3RMSNorm")
    assert (norm.origin, norm.defined_by) == ("foreign", __name__)
    assert report.counts["modules_foreign"] == 9
    assert not _flags(report, subject="Qwen3RMSNorm")  # not stock: someone else's code runs there


def test_report_command_builds_the_tiny_model_on_the_lazy_path():
    child = subprocess.run(
        [sys.executable, "-m", "npu_autopatch", "report", "--model-type", "qwen3", "--json"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    assert out["environment"]["enabled_before_transformers_import"] is True
    assert out["model_type"] == "qwen3" and out["counts"]["flags"] == 0
    norm = next(m for m in out["modules"] if m["name"] == "Qwen3RMSNorm")
    assert (norm["origin"], norm["kernel"], norm["count"]) == ("ours", "rms_norm", 9)
    assert out["records"]["qwen3"]["state"] == "applied"


class UserRMSNorm(torch.nn.Module):
    """A user's own norm in their own script: llama's code, copied."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class UserMLP(torch.nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class UserModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 16)
        self.mlp = UserMLP(16, 32)
        self.norm = UserRMSNorm(16)

    def forward(self, ids):
        return self.norm(self.mlp(self.embed(ids)))


def test_a_users_own_norm_and_mlp_that_kernels_reproduce_are_flagged_with_how_to_patch_them():
    model = UserModel()
    report = npu_autopatch.report(model)
    assert {_entry(report, "UserRMSNorm").origin, _entry(report, "UserMLP").origin} == {"foreign"}
    flags = {f.subject: f.message for f in _flags(report, "unpatched")}
    assert set(flags) == {"UserRMSNorm", "UserMLP"}
    assert "the probes say rms_norm reproduces it (llama)" in flags["UserRMSNorm"]
    assert "the probes say swiglu reproduces it (gate-up)" in flags["UserMLP"]
    call = flags["UserRMSNorm"].partition("nothing patches it: ")[2]
    assert call.startswith("npu_autopatch.register(") and call in flags["UserMLP"]  # one call per module

    # The advice, run as printed, patches both.
    with stand_in() as npu:
        npu_autopatch.enable()
        eval(call, {"npu_autopatch": npu_autopatch})
        try:
            patched = npu_autopatch.report(model)
            with torch.no_grad():
                model(torch.tensor([[1, 2, 3]]))
        finally:
            npu_autopatch.unregister("test_report")
    assert {_entry(patched, "UserRMSNorm").origin, _entry(patched, "UserMLP").origin} == {"ours"}
    assert patched.flags == []
    assert npu.calls["npu_rms_norm"] == 1 and npu.calls["npu_swiglu"] == 1


def test_another_librarys_norm_code_in_transformers_place_is_flagged_with_the_force_switch(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    monkeypatch.setattr(qwen3.Qwen3RMSNorm, "forward", UserRMSNorm.forward)  # llama's code, not ours
    with stand_in():
        npu_autopatch.enable(models=["qwen3"])
        report = npu_autopatch.report(tiny_model("qwen3"))
    assert _entry(report, "Qwen3RMSNorm").origin == "foreign"
    (flag,) = _flags(report, "unpatched", "Qwen3RMSNorm")
    assert flag.code == "foreign-patch"
    assert "the probes say rms_norm reproduces it (llama)" in flag.message
    assert "pass force=True" in flag.message, flag.message
