"""Transactions, isolation, selection, strict mode and undo, on the real modeling modules.

These run in-process on modules imported before enable(): the already-imported path.
The lazy (post-import hook) path is covered in fresh interpreters in test_startup.py.
"""

import pytest
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

import npu_autopatch
from npu_autopatch import _ledger, models
from npu_autopatch._state import STATE
from npu_autopatch.kernels import KERNELS, Kernel, Variant
from npu_autopatch.testing import stand_in

from .conftest import run_python

QWEN3_TARGETS = (
    (modeling_qwen3.Qwen3RMSNorm, "forward"),
    (modeling_qwen3.Qwen3MLP, "forward"),
    (modeling_qwen3, "apply_rotary_pos_emb"),
)


def snapshot(targets=QWEN3_TARGETS):
    return [
        owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr) for owner, attr in targets
    ]


QWEN3_STOCK = snapshot()


def assert_stock(before, targets=QWEN3_TARGETS):
    after = snapshot(targets)
    assert all(a is b for a, b in zip(after, before, strict=True)), "a target was left replaced"


def foreign_forward(self, hidden_states):
    """Another library's RMSNorm (as Liger-Kernel or a framework's own patch would install)."""
    variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states.float() * (variance + self.variance_epsilon).rsqrt()).to(
        hidden_states.dtype
    )


def test_enable_patches_imported_modules_and_disable_restores_identical_objects(npu_stand_in):
    before = snapshot()
    npu_autopatch.enable()
    after = snapshot()
    assert all(a is not b for a, b in zip(after, before, strict=True))
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "applied"
    assert record.kernels == ("rms_norm", "swiglu", "rope")
    assert record.targets == (
        "transformers.models.qwen3.modeling_qwen3:Qwen3RMSNorm.forward",
        "transformers.models.qwen3.modeling_qwen3:Qwen3MLP.forward",
        "transformers.models.qwen3.modeling_qwen3:apply_rotary_pos_emb",
    )
    npu_autopatch.disable()
    assert_stock(before)
    assert npu_autopatch.status()["qwen3"].state == "reverted"
    assert not npu_autopatch.is_enabled()


def test_enable_is_idempotent_and_reapplies_after_disable(npu_stand_in):
    npu_autopatch.enable()
    first = snapshot()
    npu_autopatch.enable()
    assert all(a is b for a, b in zip(snapshot(), first, strict=True)), "a second enable() re-patched"
    npu_autopatch.disable()
    npu_autopatch.enable()
    assert npu_autopatch.status()["qwen3"].state == "applied"
    assert all(a is not b for a, b in zip(snapshot(), QWEN3_STOCK, strict=True))


def test_enable_with_another_selection_reverts_what_is_no_longer_selected(npu_stand_in):
    before = snapshot()
    npu_autopatch.enable(models=["qwen3", "llama"])
    npu_autopatch.enable(models=["llama"])
    assert_stock(before)
    report = npu_autopatch.status()
    assert report["qwen3"].state == "skipped" and "not in the selected models" in report["qwen3"].reason
    assert report["llama"].state == "applied"


def test_exclude_and_kernel_selection(npu_stand_in):
    npu_autopatch.enable(exclude=["qwen3"], kernels=["rms_norm"])
    report = npu_autopatch.status()
    assert report["qwen3"].state == "skipped" and report["qwen3"].reason == "excluded by configuration"
    assert report["llama"].kernels == ("rms_norm",)
    assert report["llama"].targets == ("transformers.models.llama.modeling_llama:LlamaRMSNorm.forward",)
    assert "forward" in modeling_llama.LlamaMLP.__dict__
    assert (
        modeling_llama.LlamaMLP.__dict__["forward"].__module__ == "transformers.models.llama.modeling_llama"
    )


def test_unknown_names_in_arguments_raise_and_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown models \['qwen9'\].*qwen3"):
        npu_autopatch.enable(models=["qwen9"])
    with pytest.raises(ValueError, match=r"unknown kernels \['flash'\].*rms_norm"):
        npu_autopatch.enable(kernels="flash")
    assert not npu_autopatch.is_enabled()


def test_without_torch_npu_every_model_is_skipped_with_the_reason():
    before = snapshot()
    npu_autopatch.enable()
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "skipped"
    assert record.reason.startswith("torch_npu not importable: ModuleNotFoundError")
    assert_stock(before)


def test_npu_not_visible_is_a_skip():
    with stand_in(available=False):
        npu_autopatch.enable()
        record = npu_autopatch.status()["llama"]
    assert record.state == "skipped"
    assert "torch.npu.is_available() is False" in record.reason


def test_missing_op_fails_that_model_entirely():
    before = snapshot()
    with stand_in(missing=("npu_swiglu",)):
        npu_autopatch.enable()
        report = npu_autopatch.status()
    assert report["qwen3"].state == "failed"
    assert "torch_npu has no npu_swiglu" in report["qwen3"].reason
    assert_stock(before)  # the norm and rope were not swapped in either: all or nothing


def test_missing_target_fails_only_that_model(npu_stand_in, monkeypatch):
    before = snapshot()
    monkeypatch.delattr(modeling_qwen3, "Qwen3MLP")  # as if transformers renamed the class
    npu_autopatch.enable()
    report = npu_autopatch.status()
    assert report["qwen3"].state == "failed"
    assert report["qwen3"].reason.startswith("target Qwen3MLP.forward not found in transformers.models.qwen3")
    assert report["llama"].state == "applied"
    assert report["qwen2"].state == "applied"
    assert_stock(before[::2], QWEN3_TARGETS[::2])


def test_foreign_patch_is_left_alone_unless_forced(npu_stand_in, monkeypatch):
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", foreign_forward)
    npu_autopatch.enable()
    record = npu_autopatch.status()["qwen2"]
    assert record.state == "skipped"
    assert "Qwen2RMSNorm.forward is already replaced by tests.test_mechanism.foreign_forward" in record.reason
    assert modeling_qwen2.Qwen2RMSNorm.forward is foreign_forward

    npu_autopatch.enable(force=True)
    assert npu_autopatch.status()["qwen2"].state == "applied"
    assert modeling_qwen2.Qwen2RMSNorm.forward is not foreign_forward
    npu_autopatch.disable()
    assert modeling_qwen2.Qwen2RMSNorm.forward is foreign_forward


def test_a_target_replaced_after_us_is_reported_and_kept_by_disable(npu_stand_in):
    original = modeling_qwen2.Qwen2RMSNorm.__dict__["forward"]
    npu_autopatch.enable()
    modeling_qwen2.Qwen2RMSNorm.forward = foreign_forward  # a framework's later patch pass
    try:
        record = npu_autopatch.status()["qwen2"]
        assert record.state == "overridden"
        assert "replaced after us by tests.test_mechanism.foreign_forward" in record.reason
        npu_autopatch.disable()
        assert modeling_qwen2.Qwen2RMSNorm.forward is foreign_forward
    finally:
        modeling_qwen2.Qwen2RMSNorm.forward = original


def _raising_kernel(name):
    def build(stock, npu, on_error):
        raise RuntimeError("boom at patch time")

    return Kernel(name, KERNELS[name].ops, (Variant("broken", build, KERNELS[name].variants[0].probe),))


def test_kernel_raising_at_patch_time_fails_the_model_and_swaps_nothing(npu_stand_in, monkeypatch):
    before = snapshot()
    monkeypatch.setitem(KERNELS, "rope", _raising_kernel("rope"))
    npu_autopatch.enable()
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "failed"
    assert "kernel rope raised while checking" in record.reason and "boom at patch time" in record.reason
    assert_stock(before)


def test_a_swap_failing_midway_rolls_back_the_swaps_already_made(npu_stand_in, monkeypatch):
    before = snapshot()
    real_setattr = setattr
    swaps = []

    def failing_setattr(owner, attr, value):
        swaps.append(attr)
        if owner is modeling_qwen3:
            raise TypeError("module refuses the assignment")
        real_setattr(owner, attr, value)

    monkeypatch.setattr(_ledger, "setattr", failing_setattr, raising=False)
    npu_autopatch.enable(models=["qwen3"], default_attention=False)  # its swap in modeling_utils comes first
    record = npu_autopatch.status()["qwen3"]
    assert swaps[:3] == ["forward", "forward", "apply_rotary_pos_emb"]
    assert record.state == "failed" and "module refuses the assignment" in record.reason
    assert_stock(before)


def test_strict_mode_raises_naming_model_and_cause_after_rollback():
    before = snapshot()
    with stand_in(missing=("npu_rotary_mul",)), pytest.raises(npu_autopatch.PatchError) as raised:
        npu_autopatch.enable(models=["qwen3"], strict=True)
    assert "qwen3 failed" in str(raised.value) and "npu_rotary_mul" in str(raised.value)
    assert_stock(before)


def test_math_mismatch_leaves_the_target_stock_and_the_model_partial(npu_stand_in, monkeypatch):
    # rotate_half is not a rotary embedding: the probe refuses it, the norm is still patched.
    entry = models.Model(
        "qwen3_mismatch",
        models.Target("rms_norm", "Qwen3RMSNorm.forward"),
        models.Target("rope", "rotate_half"),
        module=modeling_qwen3.__name__,
    )
    monkeypatch.setitem(STATE.models, "qwen3_mismatch", entry)
    rotate_half = modeling_qwen3.rotate_half
    npu_autopatch.enable(models=["qwen3_mismatch"])
    record = npu_autopatch.status()["qwen3_mismatch"]
    assert record.state == "partial" and record.code == "math-differs"
    assert record.kernels == ("rms_norm",)
    assert record.reason.startswith(f"rope not applied to {modeling_qwen3.__name__}:rotate_half: ")
    assert "signature" in record.reason
    assert modeling_qwen3.rotate_half is rotate_half


def test_the_model_table_is_read_only_and_register_changes_the_registry():
    """models.MODELS is the shipped table, data; register() changes the registry in the state, and
    unregister() brings a built-in entry back from the table."""
    built_in = models.MODELS["llama"]
    with pytest.raises(TypeError):
        models.MODELS["llama"] = models.Model("llama", models.Target("rms_norm", "LlamaRMSNorm.forward"))
    assert STATE.models["llama"] is built_in
    mine = models.Model("llama", models.Target("rms_norm", "LlamaRMSNorm.forward"))
    npu_autopatch.register(mine, replace=True)
    try:
        assert STATE.models["llama"] is mine and models.MODELS["llama"] is built_in
    finally:
        npu_autopatch.unregister("llama")
    assert STATE.models["llama"] is built_in


def test_a_kernel_narrowed_to_the_variants_the_device_runs_keeps_its_own_reference_ops(
    npu_stand_in, monkeypatch
):
    """A plugin's kernel whose first variant the torch_npu refuses is probed without it, on the
    kernel's own reference op still (Kernel.reference), and says why it runs the second."""
    built_on = []  # the op each build was given: the reference op's in a probe, the device's else

    def reference_identity(function):
        return function

    def build(stock, npu, on_error):
        identity = npu.npu_acme_identity
        built_on.append(identity)
        return lambda self, hidden_states: identity(stock)(self, hidden_states)

    def probe(stock, candidate):
        return None

    kernel = Kernel(
        "acme_norm",
        ("npu_acme_identity",),
        (
            Variant("newer", build, probe, requires=lambda npu: "needs a newer torch_npu"),
            Variant("plain", build, probe),
        ),
        reference={"npu_acme_identity": reference_identity},
    )
    entry = models.Model(
        "qwen3_narrowed", models.Target(kernel, "Qwen3RMSNorm.forward"), module=modeling_qwen3.__name__
    )
    monkeypatch.setitem(STATE.models, "qwen3_narrowed", entry)
    monkeypatch.setattr(npu_stand_in, "npu_acme_identity", lambda function: function, raising=False)
    npu_autopatch.enable(models=["qwen3_narrowed"])
    record = npu_autopatch.status()["qwen3_narrowed"]
    assert record.state == "applied", record.reason
    assert list(record.variants.values()) == ["plain"]
    assert "runs its plain variant, not newer: needs a newer torch_npu" in record.reason
    # Probed on the kernel's reference op: the variants it runs, then the ones it refuses.
    assert built_on[:2] == [reference_identity, reference_identity], built_on


def test_shared_target_stays_patched_while_another_model_holds_it(npu_stand_in, monkeypatch):
    # In transformers 4.57 Qwen2.5-VL uses qwen2's Qwen2RMSNorm: two models, one target.
    alias = models.Model(
        "qwen2_alias", models.Target("rms_norm", "Qwen2RMSNorm.forward"), module=modeling_qwen2.__name__
    )
    monkeypatch.setitem(STATE.models, "qwen2_alias", alias)
    original = modeling_qwen2.Qwen2RMSNorm.__dict__["forward"]
    npu_autopatch.enable(models=["qwen2", "qwen2_alias"])
    patched = modeling_qwen2.Qwen2RMSNorm.__dict__["forward"]
    assert patched is not original
    assert npu_autopatch.status()["qwen2_alias"].state == "applied"

    _ledger.release_all("qwen2")  # qwen2 lets go (as with a failure or exclude); the alias still holds it
    assert modeling_qwen2.Qwen2RMSNorm.__dict__["forward"] is patched
    assert modeling_qwen2.Qwen2MLP.__dict__["forward"].__module__ == modeling_qwen2.__name__
    _ledger.release_all("qwen2_alias")
    assert modeling_qwen2.Qwen2RMSNorm.__dict__["forward"] is original


def test_status_before_enable_says_patching_is_off():
    child = run_python("import npu_autopatch; r = npu_autopatch.status()['llama']; print(r.state, r.module)")
    assert child.stdout.strip() == "off transformers.models.llama.modeling_llama"
    child = run_python("import npu_autopatch; print(npu_autopatch.status()['llama'].reason)")
    assert child.stdout.strip() == "patching is not enabled"


def test_a_rotary_function_turned_into_a_module_by_kernels_is_still_stock(npu_stand_in, monkeypatch):
    # With the `kernels` package, transformers 5.x makes the decorated function an nn.Module
    # instance whose forward calls it (kernels' _create_func_module); it is still stock code.
    import torch

    stock = modeling_llama.apply_rotary_pos_emb

    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return stock(*args, **kwargs)

    hub_module = Func()
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", hub_module)
    npu_autopatch.enable(models=["llama"])
    record = npu_autopatch.status()["llama"]
    assert record.state == "applied" and "rope" in record.kernels, record
    assert modeling_llama.apply_rotary_pos_emb is not hub_module
    npu_autopatch.disable()
    assert modeling_llama.apply_rotary_pos_emb is hub_module
