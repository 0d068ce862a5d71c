"""Faults met through the lazy path (NPU_AUTOPATCH=1, post-import hooks) in fresh interpreters.

tests/test_mechanism.py covers the same faults in-process on modules imported before
enable(); here each fault strikes while a modeling module is being imported. In every case
the user's import succeeds (unless another library's own hook fails it), the other models
are patched, the failed model is stock, and status() says why. Several faults share one
interpreter, each on a modeling module not imported before.
"""

import json

import pytest

from npu_autopatch.models import INTEGRATIONS

from .conftest import STAND_IN_SITE, run_python

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = pytest.mark.full


PRELUDE = """
import importlib, json, sys
import npu_autopatch
from npu_autopatch.testing import stand_in

def import_(name):
    try:
        importlib.import_module("transformers.models." + name + ".modeling_" + name)
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

def ours(obj):
    return getattr(obj, "__module__", "").startswith("npu_autopatch.kernels")

def modeling(name):
    return sys.modules["transformers.models." + name + ".modeling_" + name]

def state(name):
    record = npu_autopatch.status()[name]
    return [record.state, record.reason]

def foreign_forward(self, hidden_states):
    return hidden_states  # stands for Liger-Kernel's or a framework's own replacement

class ForeignFinder:
    # Another library's own import hook (not wrapt) that replaces a class's forward after the
    # body ran; installed before enable(), so it stands after our watcher in sys.meta_path.

    def __init__(self, name, class_name):
        self.module_name = "transformers.models." + name + ".modeling_" + name
        self.class_name = class_name

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module_name:
            return None
        after = sys.meta_path[[f is self for f in sys.meta_path].index(True) + 1:]
        spec = next(s for s in (f.find_spec(fullname, path, target) for f in after) if s is not None)
        real, class_name = spec.loader, self.class_name

        class Loader:
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                setattr(getattr(module, class_name), "forward", foreign_forward)

        spec.loader = Loader()
        return spec

    @classmethod
    def install(cls, name, class_name):
        watcher = [type(f).__name__ for f in sys.meta_path].index("TransformersWatcher")
        sys.meta_path.insert(watcher + 1, cls(name, class_name))

out = {}
"""


def run_child(code, **env):
    child = run_python(PRELUDE + code + "\nprint(json.dumps(out))", PYTHONPATH=str(STAND_IN_SITE), **env)
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    return json.loads(child.stdout.splitlines()[-1]), child.stderr


DEVICE_FAULTS = """
with stand_in(available=False):
    out["unavailable"] = import_("llama"), state("llama"), ours(modeling("llama").LlamaRMSNorm.forward)

with stand_in(missing=("npu_swiglu",)):  # an older torch_npu release
    npu_autopatch.disable()
    npu_autopatch.enable()  # a new decision; patches llama, imported above, at once
    out["missing_op"] = {
        "llama": state("llama"),
        "mistral": [import_("mistral"), state("mistral")],
        "gemma3": [import_("gemma3"), state("gemma3")],
        "mistral_norm_is_ours": ours(modeling("mistral").MistralRMSNorm.forward),
        "mistral_rope_is_ours": ours(modeling("mistral").apply_rotary_pos_emb),
    }

from npu_autopatch import kernels

with stand_in():
    def boom(*args, **kwargs):
        raise RuntimeError("golden swiglu broke")

    kernels.golden_ops().npu_swiglu = boom  # the op raises while the patcher validates
    npu_autopatch.disable()
    npu_autopatch.enable()
    out["raising_op"] = {
        "qwen2": [import_("qwen2"), state("qwen2")],
        "gemma3": state("gemma3"),
        "qwen2_norm_is_ours": ours(modeling("qwen2").Qwen2RMSNorm.forward),
    }
"""


def test_device_and_op_faults_leave_the_model_stock_and_say_why():
    # NPU_AUTOPATCH_PROBE=always: the golden op fault is seen by a probe, not a shipped verdict.
    out, stderr = run_child(DEVICE_FAULTS, NPU_AUTOPATCH="1", NPU_AUTOPATCH_PROBE="always")
    imported, (state, reason), norm_is_ours = out["unavailable"]
    assert imported == "ok" and state == "skipped" and not norm_is_ours
    assert "torch.npu.is_available() is False" in reason

    faults = out["missing_op"]
    assert faults["llama"][0] == "failed" and "torch_npu has no npu_swiglu" in faults["llama"][1]
    assert faults["mistral"][0] == "ok" and faults["mistral"][1][0] == "failed"
    assert "torch_npu has no npu_swiglu" in faults["mistral"][1][1]
    assert not faults["mistral_norm_is_ours"] and not faults["mistral_rope_is_ours"]  # all or nothing
    assert faults["gemma3"] == ["ok", ["applied", None]]

    faults = out["raising_op"]
    assert faults["qwen2"][0] == "ok" and faults["qwen2"][1][0] == "failed"
    assert "kernel swiglu raised while checking" in faults["qwen2"][1][1]
    assert "RuntimeError: golden swiglu broke" in faults["qwen2"][1][1]
    assert not faults["qwen2_norm_is_ours"]
    assert faults["gemma3"] == ["applied", None]
    assert "golden swiglu broke" in stderr  # one warning per failed model, never a traceback


MODEL_FAULTS = """
import wrapt
from npu_autopatch import models
from npu_autopatch._state import STATE

def foreign_patch(module):
    module.MistralRMSNorm.forward = foreign_forward

def raising_hook(module):
    raise RuntimeError("another library's hook failed")

# As if transformers renamed LlamaMLP: the table names a class the module does not have.
STATE.models["llama"] = models.Model(
    "llama",
    models.Target("rms_norm", "LlamaRMSNorm.forward"),
    models.Target("swiglu", "LlamaMLPRenamed.forward"),
    models.Target("rope", "apply_rotary_pos_emb"),
)
ForeignFinder.install("qwen2", "Qwen2RMSNorm")
# wrapt hooks registered before `import transformers` arms ours: wrapt would run them first.
wrapt.register_post_import_hook(foreign_patch, "transformers.models.mistral.modeling_mistral")
wrapt.register_post_import_hook(raising_hook, "transformers.models.qwen3.modeling_qwen3")

with stand_in():
    out["renamed"] = [import_("llama"), state("llama"), ours(modeling("llama").LlamaRMSNorm.forward),
                      ours(modeling("llama").apply_rotary_pos_emb)]
    out["replaced_before_us"] = [import_("qwen2"), state("qwen2"),
                                 modeling("qwen2").Qwen2RMSNorm.forward is foreign_forward]
    out["replaced_after_us"] = [import_("mistral"), state("mistral"),
                                modeling("mistral").MistralRMSNorm.forward is foreign_forward]
    out["raising_hook"] = [import_("qwen3"), state("qwen3")]
    out["raising_hook_retried"] = [import_("qwen3"), state("qwen3"),
                                   ours(modeling("qwen3").Qwen3RMSNorm.forward)]
    out["gemma3"] = [import_("gemma3"), state("gemma3")]

    # importlib.reload runs the body again: new, stock classes and functions.
    old_norm = modeling("qwen3").Qwen3RMSNorm
    importlib.reload(modeling("qwen3"))
    new_norm = modeling("qwen3").Qwen3RMSNorm
    out["reloaded"] = [state("qwen3"), new_norm is not old_norm, ours(new_norm.forward),
                       ours(modeling("qwen3").apply_rotary_pos_emb), ours(old_norm.forward)]
    loaders = [(modeling(n).__loader__, modeling(n).__spec__.loader) for n in ("llama", "mistral", "qwen3")]
    out["loaders"] = sorted({type(a).__name__ + "/" + type(b).__name__ for a, b in loaders})

    npu_autopatch.disable()
    out["after_disable"] = [
        modeling("mistral").MistralRMSNorm.forward is foreign_forward,
        modeling("qwen2").Qwen2RMSNorm.forward is foreign_forward,
        ours(modeling("qwen3").Qwen3RMSNorm.forward),
        ours(modeling("gemma3").apply_rotary_pos_emb),
    ]
"""


def test_faults_of_one_model_leave_the_others_patched():
    out, stderr = run_child(MODEL_FAULTS, NPU_AUTOPATCH="1")
    imported, (state, reason), norm_is_ours, rope_is_ours = out["renamed"]
    assert imported == "ok" and state == "failed"
    assert reason.startswith("target LlamaMLPRenamed.forward not found in transformers.models.llama")
    assert not norm_is_ours and not rope_is_ours  # the targets that exist were not swapped either
    assert stderr.count("llama: failed") == 1  # one warning, once

    imported, (state, reason), foreign_kept = out["replaced_before_us"]
    assert imported == "ok" and state == "skipped" and foreign_kept
    assert "Qwen2RMSNorm.forward is already replaced by __main__.foreign_forward" in reason

    # Our patch runs right after the body, before any wrapt hook, whoever registered first:
    # the other library's hook replaces our kernel, and status() names it.
    imported, (state, reason), foreign_kept = out["replaced_after_us"]
    assert imported == "ok" and state == "overridden" and foreign_kept
    assert "MistralRMSNorm.forward was replaced after us by __main__.foreign_forward" in reason

    # Another library's raising hook fails the import (wrapt's rule) after we patched: status()
    # must not claim the dropped module, and the retry (a new module object) is patched.
    imported, (state, reason) = out["raising_hook"]
    assert imported == "RuntimeError: another library's hook failed"
    assert state == "pending" and "failed after it was patched" in reason
    assert out["raising_hook_retried"] == ["ok", ["applied", None], True]
    assert out["gemma3"] == ["ok", ["applied", None]]

    (state, reason), new_class, new_is_ours, rope_is_ours, old_is_ours = out["reloaded"]
    assert state == "applied" and new_class and new_is_ours and rope_is_ours
    assert old_is_ours  # models built before the reload use the old classes: they stay fully patched
    assert out["loaders"] == ["SourceFileLoader/SourceFileLoader"]  # no wrapper of ours left behind

    assert out["after_disable"] == [True, True, False, False]


STRICT_FAULTS = """
from npu_autopatch import kernels, models
from npu_autopatch._state import STATE

ForeignFinder.install("gemma3", "Gemma3RMSNorm")
STATE.models["qwen3"] = models.Model("qwen3", models.Target("swiglu", "Qwen3MLPRenamed.forward"))

def strict_import(name):
    try:
        importlib.import_module("transformers.models." + name + ".modeling_" + name)
    except npu_autopatch.PatchError as exc:
        return [type(exc).__name__, str(exc), exc.__cause__ is None,
                "transformers.models." + name + ".modeling_" + name in sys.modules]
    return "imported"

with stand_in(available=False):
    out["unavailable"] = strict_import("llama")
with stand_in(missing=("npu_swiglu",)):
    npu_autopatch.disable()
    npu_autopatch.enable()
    out["missing_op"] = strict_import("mistral")
with stand_in():
    kernels.golden_ops().npu_swiglu = None  # not callable: the probe raises TypeError
    npu_autopatch.disable()
    npu_autopatch.enable()
    out["raising_op"] = strict_import("qwen2")
    out["renamed"] = strict_import("qwen3")
    out["foreign"] = strict_import("gemma3")
"""


def test_strict_mode_turns_each_fault_into_one_clear_exception():
    # The integrations excluded: transformers imports their modules before the models named below.
    out, _stderr = run_child(
        STRICT_FAULTS,
        NPU_AUTOPATCH="1",
        NPU_AUTOPATCH_STRICT="1",
        NPU_AUTOPATCH_PROBE="always",
        NPU_AUTOPATCH_EXCLUDE=",".join(sorted(INTEGRATIONS)),
    )
    expected = {
        "unavailable": "llama skipped: torch_npu imported but torch.npu.is_available() is False",
        "missing_op": "mistral failed: torch_npu has no npu_swiglu",
        "raising_op": "qwen2 failed: kernel swiglu raised while checking",
        "renamed": "qwen3 failed: target Qwen3MLPRenamed.forward not found",
        "foreign": "gemma3 skipped: transformers.models.gemma3.modeling_gemma3:Gemma3RMSNorm.forward "
        "is already replaced by __main__.foreign_forward",
    }
    for fault, message in expected.items():
        kind, text, no_cause, module_kept = out[fault]
        assert kind == "PatchError", (fault, out[fault])
        assert text.startswith("npu_autopatch strict mode: " + message), (fault, text)
        assert no_cause, fault  # one exception, not a chain to dig through
        assert not module_kept, fault  # the import failed, as strict mode asks
