"""status() tells the truth, cheaply, in a vocabulary a program can read (issue 10 items 2, 6, 8)."""

import dataclasses
import json
import logging
import typing
from pathlib import Path

import pytest
import transformers
from transformers.models.gemma3 import modeling_gemma3  # noqa: F401 - imported, so enable() patches it
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

import npu_autopatch
from npu_autopatch import PatchRecord, ReasonCode, State, Target, TargetReason, models
from npu_autopatch.testing import stand_in

from .conftest import STAND_IN_SITE, run_python

V4 = int(transformers.__version__.split(".")[0]) < 5
QWEN3 = modeling_qwen3.__name__


@pytest.fixture
def registry():
    """Models registered by a test are dropped after it."""
    added = []

    def add(model):
        added.append(model.model_type)
        npu_autopatch.register(model)

    yield add
    npu_autopatch.disable()
    for model_type in added:
        npu_autopatch.unregister(model_type)


def mismatching_model():
    # rotate_half is not a rotary embedding: the probe refuses it; the norm is patched.
    return models.Model(
        "qwen3_mismatch",
        Target("rms_norm", "Qwen3RMSNorm.forward"),
        Target("rope", "rotate_half"),
        module=QWEN3,
    )


def test_a_selected_target_left_stock_makes_the_model_partial_with_a_warning(npu_stand_in, registry, caplog):
    registry(mismatching_model())
    with caplog.at_level(logging.INFO, logger="npu_autopatch"):
        npu_autopatch.enable(models=["qwen3_mismatch"])
    record = npu_autopatch.status()["qwen3_mismatch"]
    assert record.state == State.PARTIAL == "partial"
    assert record.code == ReasonCode.MATH_DIFFERS == "math-differs"
    assert record.kernels == ("rms_norm",)
    assert record.stock == {f"{QWEN3}:rotate_half": "math-differs"}
    assert record.reason.startswith(f"rope not applied to {QWEN3}:rotate_half: ")
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "qwen3_mismatch" in r.getMessage()
    ]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "partial" in warnings[0].getMessage() and f"{QWEN3}:rotate_half" in warnings[0].getMessage()


def test_each_target_left_stock_has_its_own_code_and_text_from_patcher_to_cli(npu_stand_in, registry):
    registry(mismatching_model())
    npu_autopatch.enable(models=["qwen3_mismatch"], kernels=["rms_norm", "rope"])
    record = npu_autopatch.status()["qwen3_mismatch"]
    target = f"{QWEN3}:rotate_half"
    (reason,) = record.stock_reasons.values()
    assert isinstance(reason, TargetReason) and list(record.stock_reasons) == [target]
    assert reason.code == ReasonCode.MATH_DIFFERS
    assert reason.text.startswith(f"rope not applied to {target}: ")
    assert record.reason == reason.text  # the readable string is made of the structured parts
    plain = json.loads(json.dumps(record.as_dict()))
    assert plain["stock_reasons"] == {target: {"code": "math-differs", "text": reason.text}}

    later = dataclasses.replace(record, notes=("a note status() adds",))
    assert later.reason == f"{reason.text}; a note status() adds" and later.stock == record.stock

    from npu_autopatch.__main__ import format_table

    model_row, target_row = format_table({"qwen3_mismatch": record}).splitlines()[1:]
    assert model_row.split()[:4] == ["qwen3_mismatch", "partial", "math-differs", "rms_norm"]
    assert target_row.split(maxsplit=1) == ["math-differs", reason.text]


def test_strict_mode_rejects_a_partial_model_and_rolls_it_back(npu_stand_in, registry):
    registry(mismatching_model())
    norm = modeling_qwen3.Qwen3RMSNorm.__dict__["forward"]
    with pytest.raises(npu_autopatch.PatchError, match="qwen3_mismatch partial: rope not applied"):
        npu_autopatch.enable(models=["qwen3_mismatch"], strict=True)
    assert modeling_qwen3.Qwen3RMSNorm.__dict__["forward"] is norm


def test_the_chosen_variant_of_every_target_is_recorded(npu_stand_in):
    npu_autopatch.enable(models=["qwen3", "gemma3"])
    report = npu_autopatch.status()
    assert report["qwen3"].variants == {
        f"{QWEN3}:Qwen3RMSNorm.forward": "llama",
        f"{QWEN3}:Qwen3MLP.forward": "gate-up",
        f"{QWEN3}:apply_rotary_pos_emb": "half",
    }
    gemma3 = report["gemma3"].variants
    assert gemma3["transformers.models.gemma3.modeling_gemma3:Gemma3RMSNorm.forward"] == "zero-centred"
    assert report["qwen3"].code is None and report["qwen3"].stock == {}


def test_every_state_and_reason_carries_a_code(npu_stand_in, monkeypatch):
    npu_autopatch.enable(models=["qwen3", "qwen2"], exclude=["qwen2"])
    report = npu_autopatch.status()
    assert (report["qwen3"].state, report["qwen3"].code) == ("applied", None)
    assert (report["qwen2"].state, report["qwen2"].code) == ("skipped", "excluded")
    assert (report["llama"].state, report["llama"].code) == ("skipped", "not-selected")
    npu_autopatch.disable()
    assert (npu_autopatch.status()["qwen3"].state, npu_autopatch.status()["qwen3"].code) == (
        "reverted",
        "disabled",
    )

    monkeypatch.delattr(modeling_qwen3, "Qwen3MLP")
    npu_autopatch.enable(models=["qwen3"])
    assert (npu_autopatch.status()["qwen3"].state, npu_autopatch.status()["qwen3"].code) == (
        "failed",
        "target-missing",
    )


def test_no_npu_and_a_missing_op_have_their_codes():
    with stand_in(available=False):
        npu_autopatch.enable(models=["qwen3"])
        assert npu_autopatch.status()["qwen3"].code == "no-npu"
    npu_autopatch.disable()
    with stand_in(missing=("npu_swiglu",)):
        npu_autopatch.enable(models=["qwen3"])
        record = npu_autopatch.status()["qwen3"]
    assert (record.state, record.code) == ("failed", "op-missing")


def test_a_foreign_patch_and_a_later_replacement_have_their_codes(npu_stand_in, monkeypatch):
    def foreign_forward(self, hidden_states):
        return hidden_states

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", foreign_forward)
    original = modeling_qwen3.Qwen3RMSNorm.__dict__["forward"]
    npu_autopatch.enable(models=["llama", "qwen3"])
    assert npu_autopatch.status()["llama"].code == "foreign-patch"
    modeling_qwen3.Qwen3RMSNorm.forward = foreign_forward  # another library, after us
    try:
        record = npu_autopatch.status()["qwen3"]
        assert (record.state, record.code) == ("overridden", "replaced-after-us")
    finally:
        npu_autopatch.disable()
        modeling_qwen3.Qwen3RMSNorm.forward = original


class LigerLikeRMSNorm(modeling_qwen3.torch.nn.Module):
    """Liger-Kernel rebinds the module's class name to its own class (apply_liger_kernel_to_qwen3)."""

    def forward(self, hidden_states):
        return hidden_states


def test_a_class_rebound_by_another_library_is_named_not_called_stock(npu_stand_in, monkeypatch):
    npu_autopatch.enable(models=["qwen3"])
    monkeypatch.setattr(modeling_qwen3, "Qwen3RMSNorm", LigerLikeRMSNorm)
    record = npu_autopatch.status()["qwen3"]
    assert (record.state, record.code) == ("overridden", "replaced-after-us")
    assert "LigerLikeRMSNorm" in record.reason and "run stock" not in record.reason, record.reason


def users_norm_forward(self, hidden_states):
    """A user's own forward, set on instances (as LLaMA-Factory's kernels do): not transformers' code."""
    return hidden_states * self.weight


def test_a_forward_set_on_instances_over_ours_is_overridden_when_the_model_first_runs(npu_stand_in, caplog):
    """Any library's or user's ``module.forward = ...`` over a target we patched: found when the model
    first runs (status() not asked before), named with its holder among every overridden target, told
    once; the instances running our kernel through an accelerate-style wrapper are not an override."""
    import functools
    import types

    from npu_autopatch.testing import parity, tiny

    npu_autopatch.enable(models=["qwen3"])
    model = tiny.tiny_model("qwen3")
    mlp = model.model.layers[0].mlp
    ours = mlp.forward  # our kernel, bound: a wrapper around it (accelerate's hooks) still runs ours
    mlp.forward = functools.wraps(ours)(lambda *args, **kwargs: ours(*args, **kwargs))
    norms = [m for m in model.modules() if isinstance(m, modeling_qwen3.Qwen3RMSNorm)]
    for norm in norms:
        norm.forward = types.MethodType(users_norm_forward, norm)
    caplog.set_level(logging.WARNING, logger="npu_autopatch")
    ids, labels, inputs = parity.model_batch(model, 1)
    parity.forward_backward(model, ids, labels, **inputs)
    told = [r.getMessage() for r in caplog.records if "replaced-after-us" in r.getMessage()]
    assert len(told) == 1, told  # logged as the model ran, before anyone asked
    record = npu_autopatch.status()["qwen3"]
    assert (record.state, record.code) == ("overridden", "replaced-after-us")
    norm_forward = "transformers.models.qwen3.modeling_qwen3:Qwen3RMSNorm.forward"
    holder = f"{__name__}.users_norm_forward"
    assert f"{norm_forward} is bypassed by a forward set on its instances by {holder}" in record.reason
    assert "(our kernel there: 0 calls so far)" in record.reason  # every norm ran the user's code
    assert "Qwen3MLP" not in record.reason, record.reason
    for _look in range(2):
        npu_autopatch.report(model)
        npu_autopatch.status()
    assert len([r for r in caplog.records if "replaced-after-us" in r.getMessage()]) == 1
    flags = [f for f in npu_autopatch.report(model).flags if f.kind == "instance-forward"]
    assert [(f.subject, len(f.instances)) for f in flags] == [("Qwen3RMSNorm", len(norms))], flags


def test_accelerates_mixed_precision_wrapper_around_ours_is_not_an_override(npu_stand_in):
    """accelerate's ``prepare`` under mixed precision sets, on the instance, a bound method around the
    class's forward (ours): ``convert_outputs_to_fp32(autocast(forward.__func__))``, accelerator.py's own
    lines. Our kernel still runs under it, so the model stays applied and report(model) flags nothing
    (HF Trainer with bf16=True read ``overridden`` when the wrapped forward was the loss kernel's)."""
    import types

    import torch
    from accelerate.utils.operations import convert_outputs_to_fp32

    from npu_autopatch.testing import parity, tiny

    npu_autopatch.enable(models=["qwen3"])
    model = tiny.tiny_model("qwen3")
    mlp = model.model.layers[0].mlp
    mlp.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(mlp.forward.__func__), mlp)
    mlp.forward = types.MethodType(convert_outputs_to_fp32(mlp.forward.__func__), mlp)
    ids, labels, inputs = parity.model_batch(model, 1)
    parity.forward_backward(model, ids, labels, **inputs)
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "applied", record.reason
    mlp_calls = record.calls["transformers.models.qwen3.modeling_qwen3:Qwen3MLP.forward"]
    assert mlp_calls["fused"] > 0, record.calls
    assert not npu_autopatch.report(model).flags  # report(model) reads it as ours too


def test_every_target_replaced_after_us_is_named_not_only_the_first(npu_stand_in, monkeypatch):
    npu_autopatch.enable(models=["qwen3"])
    monkeypatch.setattr(modeling_qwen3, "Qwen3RMSNorm", LigerLikeRMSNorm)
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", users_norm_forward)
    monkeypatch.setattr(modeling_qwen3.Qwen3MLP, "forward", users_norm_forward)
    reason = npu_autopatch.status()["qwen3"].reason
    for target in ("Qwen3RMSNorm.forward", "apply_rotary_pos_emb", "Qwen3MLP.forward"):
        assert f"modeling_qwen3:{target} was replaced after us by tests." in reason, (target, reason)


def test_a_class_rebound_before_us_is_named_with_the_target_we_wanted(npu_stand_in, monkeypatch):
    """Liger-Kernel rebinds Qwen3RMSNorm to its LigerRMSNorm before we patch: the reason names both."""
    monkeypatch.setattr(modeling_qwen3, "Qwen3RMSNorm", LigerLikeRMSNorm)
    npu_autopatch.enable(models=["qwen3"])
    record = npu_autopatch.status()["qwen3"]
    assert (record.state, record.code) == ("skipped", "foreign-patch")
    holder = f"{__name__}.LigerLikeRMSNorm"
    assert f"{QWEN3}:Qwen3RMSNorm.forward is already replaced by {holder}" in record.reason, record.reason


def test_excluded_model_sharing_a_target_is_told_truthfully(npu_stand_in, registry):
    # 4.57's Qwen2.5-VL uses qwen2's Qwen2RMSNorm; the alias stands for it on every version.
    registry(
        models.Model(
            "qwen2_alias", Target("rms_norm", "Qwen2RMSNorm.forward"), module=modeling_qwen2.__name__
        )
    )
    npu_autopatch.enable(models=["qwen2", "qwen2_alias"], exclude=["qwen2_alias"])
    record = npu_autopatch.status()["qwen2_alias"]
    target = f"{modeling_qwen2.__name__}:Qwen2RMSNorm.forward"
    assert (record.state, record.code) == ("skipped", "excluded")
    assert record.shared == {target: ("qwen2",)}
    assert "still runs" in record.reason and target in record.reason and "qwen2" in record.reason


@pytest.mark.skipif(not V4, reason="from 5.2 Qwen2.5-VL has its own RMSNorm: nothing is shared")
def test_excluded_qwen2_5_vl_reports_the_norm_it_shares_with_qwen2(npu_stand_in):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: F401

    # Selected with qwen2 only: 4.57's Qwen2-VL and Qwen2.5-Omni (table models) hold the norm too.
    npu_autopatch.enable(models=["qwen2", "qwen2_5_vl"], exclude=["qwen2_5_vl"])
    record = npu_autopatch.status()["qwen2_5_vl"]
    assert record.state == "skipped" and record.code == "excluded"
    assert record.shared == {f"{modeling_qwen2.__name__}:Qwen2RMSNorm.forward": ("qwen2",)}


def test_the_record_and_vocabulary_are_public_and_typed():
    hints = typing.get_type_hints(PatchRecord)
    assert hints["state"] is State and hints["kernels"] == tuple[str, ...]
    assert {s.value for s in State} == {
        "off",
        "pending",
        "absent",
        "applied",
        "partial",
        "skipped",
        "failed",
        "reverted",
        "overridden",
    }
    assert all(
        (isinstance(code.value, str) and "-" in code.value) or code.value.isalpha() for code in ReasonCode
    )
    assert (Path(npu_autopatch.__file__).parent / "py.typed").is_file()
    record = npu_autopatch.status()["qwen3"]
    plain = json.loads(json.dumps(record.as_dict()))
    assert plain["state"] == record.state.value and plain["code"] == record.code.value


CHEAP = """
import json, sys
import npu_autopatch
report = npu_autopatch.status()
print(json.dumps({"heavy": sorted(m for m in ("torch", "wrapt", "transformers", "importlib.metadata")
                                  if m in sys.modules),
                  "llama": [report["llama"].state, report["llama"].code]}))
"""


@pytest.mark.parametrize("switch", ["0", "1"])
def test_status_imports_nothing_heavy_when_nothing_was_patched(switch):
    child = run_python(CHEAP, warm=False, NPU_AUTOPATCH=switch)  # what is imported: a cold start's
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    # Patching on, status() reads the installed plugins' entry points (issue 33): package metadata,
    # once per process, never torch, wrapt or transformers.
    assert result["heavy"] == (["importlib.metadata"] if switch == "1" else [])
    assert result["llama"] == (["pending", "waiting-for-import"] if switch == "1" else ["off", "not-enabled"])


PENDING = """
import json, sys, wrapt
import npu_autopatch
from npu_autopatch import Target, register
register("nowhere", module="transformers.models.nowhere.modeling_nowhere",
         targets=[Target("rms_norm", "NowhereRMSNorm.forward")])
def raising_hook(module):
    raise RuntimeError("another library's hook failed")
wrapt.register_post_import_hook(raising_hook, "transformers.models.mistral.modeling_mistral")
import transformers
try:
    import transformers.models.mistral.modeling_mistral
except RuntimeError:
    pass
report = npu_autopatch.status()
print(json.dumps({m: [report[m].state, report[m].code] for m in ("llama", "nowhere", "mistral")}))
"""


def test_pending_absent_and_import_failed_are_told_apart():
    child = run_python(PENDING, NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE))
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == {
        "llama": ["pending", "waiting-for-import"],
        "nowhere": ["absent", "module-absent"],
        "mistral": ["pending", "import-failed"],
    }


NO_HOOKS = """
import json, sys
sys.modules["wrapt"] = None  # as if wrapt were broken: the hooks cannot be armed
import transformers
import npu_autopatch
record = npu_autopatch.status()["llama"]
print(json.dumps([record.state, record.code, npu_autopatch.is_enabled()]))
"""


def test_hooks_that_cannot_be_armed_are_a_failure_not_pending():
    child = run_python(NO_HOOKS, NPU_AUTOPATCH="1")
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == ["failed", "hooks-failed", True]
    assert "could not arm the import hooks" in child.stderr
