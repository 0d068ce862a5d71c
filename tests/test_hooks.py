"""One hook mechanism, transactional arming, strict errors that reach the user, a full undo
(issue 10 items 3, 4, 5, 7, 10, 12). Import-time behaviour runs in fresh interpreters."""

import json
import os

import pytest
import transformers
from transformers.models.qwen3 import modeling_qwen3

import npu_autopatch
from npu_autopatch.models import INTEGRATIONS

from .conftest import STAND_IN_SITE, run_python

V4 = int(transformers.__version__.split(".")[0]) < 5


def child_json(code, **env):
    env.setdefault("PYTHONPATH", str(STAND_IN_SITE))
    child = run_python(code, **env)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.splitlines()[-1]), child.stderr


# --- item 3: strict failures through transformers' lazy imports -------------------------

STRICT_LAZY = """
import json, npu_autopatch
out = {}
def attempt(name, load):
    try:
        load()
    except npu_autopatch.PatchError as exc:
        out[name] = ["PatchError", str(exc), isinstance(exc, ImportError)]
    except BaseException as exc:
        out[name] = [type(exc).__name__, str(exc), None]
    else:
        out[name] = ["imported", None, None]
def top_level():
    from transformers import Qwen3ForCausalLM
def auto():
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=16,
        intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
attempt("top_level", top_level)
attempt("auto", auto)
print(json.dumps(out))
"""


def test_strict_errors_reach_the_user_as_patch_error_through_lazy_imports():
    # The integrations excluded: transformers imports their modules first (they would be named).
    out, _ = child_json(
        STRICT_LAZY,
        NPU_AUTOPATCH="1",
        NPU_AUTOPATCH_STRICT="1",
        NPU_AUTOPATCH_EXCLUDE=",".join(sorted(INTEGRATIONS)),
        PYTHONPATH="",
    )
    for name, model in (("top_level", "qwen3"), ("auto", "llama")):
        kind, text, is_import_error = out[name]
        assert kind == "PatchError", (name, out[name])
        assert text.startswith(f"npu_autopatch strict mode: {model} skipped: torch_npu not importable"), text
        assert is_import_error is False  # an `except ImportError:` fallback does not swallow it


# --- item 4: transactional arming ---------------------------------------------------------

STRICT_ENABLE = """
import json, sys
from transformers.models.llama import modeling_llama
del modeling_llama.LlamaMLP  # as if renamed: llama fails, in strict mode enable() raises
import npu_autopatch
try:
    npu_autopatch.enable(strict=True)
    raised = None
except npu_autopatch.PatchError as exc:
    raised = str(exc)
from transformers.models.gemma3 import modeling_gemma3  # imported after: its hook must be armed
report = npu_autopatch.status()
print(json.dumps([raised, npu_autopatch.is_enabled(), report["llama"].state, report["gemma3"].state]))
"""


def test_a_strict_error_from_enable_comes_after_every_hook_is_armed():
    (raised, enabled, llama, gemma3), _ = child_json(STRICT_ENABLE)
    assert raised and "llama failed: target LlamaMLP.forward not found" in raised
    assert enabled is True and llama == "failed"
    assert gemma3 == "applied"  # the table's later models are hooked, not left pending for ever


MID_IMPORT = """
import json, pathlib, sys, threading, time
import transformers
import npu_autopatch
from npu_autopatch import Target, register

site = pathlib.Path(sys.argv[0]).parent if False else pathlib.Path(TMP)
source = pathlib.Path(transformers.models.llama.modeling_llama.__file__).read_text()
# The body of this module waits until the main thread has called enable().
absolute = source.replace("from ...", "from transformers.").replace("from ..", "from transformers.models.")
absolute = absolute.replace("from .", "from transformers.models.llama.")
(site / "slow_modeling.py").write_text(absolute + "\\nSTARTED.set()\\nRELEASE.wait(30)\\n")
import builtins
builtins.STARTED, builtins.RELEASE = threading.Event(), threading.Event()
sys.path.insert(0, str(site))
register("slow", module="slow_modeling", targets=[Target("rms_norm", "LlamaRMSNorm.forward")])
importer = threading.Thread(target=__import__, args=("slow_modeling",))
importer.start()
assert builtins.STARTED.wait(60)
npu_autopatch.enable()  # while the other thread is executing the module's body
builtins.RELEASE.set()
importer.join(60)
record = npu_autopatch.status()["slow"]
print(json.dumps([record.state, record.reason, sys.modules["slow_modeling"].LlamaRMSNorm.forward.__module__]))
"""


def test_a_module_mid_import_in_another_thread_is_patched_when_its_body_ends(tmp_path):
    (state, reason, module), _ = child_json(MID_IMPORT.replace("TMP", repr(str(tmp_path))))
    assert state == "applied", reason
    assert module == "npu_autopatch.kernels.norm"


# --- item 5: one mechanism; find_spec; reload and retried import in every order ---------

FIND_SPEC = """
import importlib.util, json, sys
importlib.util.find_spec("transformers")  # what accelerate, peft and trl do to test availability
armed_by_find_spec = "wrapt" in sys.modules
import transformers
from transformers.models.qwen3 import modeling_qwen3
import npu_autopatch
print(json.dumps([armed_by_find_spec, npu_autopatch.status()["qwen3"].state]))
"""


def test_find_spec_of_transformers_arms_nothing_and_its_import_does():
    (armed_by_find_spec, state), _ = child_json(FIND_SPEC, NPU_AUTOPATCH="1")
    assert armed_by_find_spec is False
    assert state == "applied"


ORDERS = {
    "enable-first": "import npu_autopatch; npu_autopatch.enable()\nimport transformers\n",
    "transformers-first": "import transformers\nimport npu_autopatch; npu_autopatch.enable()\n",
    "module-first": "import transformers.models.qwen3.modeling_qwen3\n"
    "import npu_autopatch; npu_autopatch.enable()\n",
}

RELOAD = """
import importlib, json, sys, wrapt
import torch
from npu_autopatch.testing.parity import tiny_model
def ours(obj):
    return getattr(obj, "__module__", "").startswith("npu_autopatch.kernels")
def raising_hook(module):
    raise RuntimeError("another library's hook failed")
wrapt.register_post_import_hook(raising_hook, "transformers.models.llama.modeling_llama")
ORDER
import npu_autopatch
from transformers.models.qwen3 import modeling_qwen3 as first
built_before = tiny_model("qwen3")
old_norm, old_mlp = first.Qwen3RMSNorm, first.Qwen3MLP
importlib.reload(first)
qwen3 = sys.modules["transformers.models.qwen3.modeling_qwen3"]
try:
    import transformers.models.llama.modeling_llama
except RuntimeError:
    pass
import transformers.models.llama.modeling_llama as llama  # retried: the raising hook has fired
report = npu_autopatch.status()
import torch_npu
before = sum(torch_npu.calls.values())
built_before(torch.tensor([[1, 2, 3]]))
print(json.dumps({
    "qwen3": report["qwen3"].state,
    "new_objects": [ours(qwen3.Qwen3RMSNorm.forward), ours(qwen3.Qwen3MLP.forward),
                    ours(qwen3.apply_rotary_pos_emb)],
    "old_objects": [ours(old_norm.forward), ours(old_mlp.forward)],
    "built_before_ran_npu_ops": sum(torch_npu.calls.values()) > before,
    "llama": report["llama"].state,
    "llama_objects": ours(llama.LlamaRMSNorm.forward),
}))
"""


@pytest.mark.parametrize("order", list(ORDERS))
def test_reload_and_retried_import_are_patched_in_every_order(order):
    result, _ = child_json(RELOAD.replace("ORDER", ORDERS[order]))
    assert result == {
        "qwen3": "applied",
        "new_objects": [True, True, True],
        "old_objects": [True, True],  # a model built before the reload stays fully patched
        "built_before_ran_npu_ops": True,
        "llama": "applied",
        "llama_objects": True,
    }, order


# --- item 7: disable() is a full undo; replacements carry __wrapped__ ---------------------


def test_replacements_carry_wrapped_and_disable_restores_them(npu_stand_in):
    norm = modeling_qwen3.Qwen3RMSNorm.__dict__["forward"]
    rope = modeling_qwen3.apply_rotary_pos_emb
    npu_autopatch.enable(models=["qwen3"])
    assert modeling_qwen3.Qwen3RMSNorm.__dict__["forward"].__wrapped__ is norm
    assert modeling_qwen3.apply_rotary_pos_emb.__wrapped__ is rope
    npu_autopatch.disable()
    assert modeling_qwen3.Qwen3RMSNorm.__dict__["forward"] is norm
    assert modeling_qwen3.apply_rotary_pos_emb is rope


REMOTE_WRAPPER = """
import json
import transformers.dynamic_module_utils as dmu
original = dmu.get_class_in_module
import npu_autopatch
from npu_autopatch import Target, register
npu_autopatch.enable()
untouched_without_remote_models = dmu.get_class_in_module is original
register("acme", module="transformers_modules.*.modeling_acme",
         targets=[Target("rms_norm", "AcmeRMSNorm.forward")])
wrapped_with_one = dmu.get_class_in_module is not original
npu_autopatch.disable()
print(json.dumps([untouched_without_remote_models, wrapped_with_one, dmu.get_class_in_module is original]))
"""


def test_get_class_in_module_is_wrapped_only_for_remote_models_and_restored_by_disable():
    result, _ = child_json(REMOTE_WRAPPER)
    assert result == [True, True, True]


# --- item 10: only the commit runs under the package lock -------------------------------

FORK_DURING_PROBES = """
import json, os, select, threading, time
import npu_autopatch
from npu_autopatch.kernels import KERNELS

inside = threading.Event()
variant = KERNELS["rms_norm"].variants[0]
real_probe = variant.probe

def slow_probe(stock, candidate):
    inside.set()
    time.sleep(2.0)
    return real_probe(stock, candidate)

variant.probe = slow_probe
import transformers
importer = threading.Thread(target=__import__, args=("transformers.models.mistral.modeling_mistral",))
importer.start()
assert inside.wait(60)
begin = time.perf_counter()
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write_end, npu_autopatch.status()["mistral"].state.encode())
    os._exit(0)
fork_seconds = time.perf_counter() - begin
ready, _, _ = select.select([read_end], [], [], 30)
state = os.read(read_end, 100).decode() if ready else None
if state is None:
    os.kill(pid, 9)
os.waitpid(pid, 0)
importer.join(60)
print(json.dumps({"fork_seconds": fork_seconds, "child_state": state,
                  "parent_state": npu_autopatch.status()["mistral"].state}))
"""


def test_a_fork_does_not_wait_for_the_probes_and_the_child_does_not_hang():
    result, _ = child_json(FORK_DURING_PROBES, NPU_AUTOPATCH="1", NPU_AUTOPATCH_PROBE="always")
    assert result["fork_seconds"] < 1.0, result  # the probes take 2 s: the fork did not wait
    assert result["child_state"] == "pending"  # its importing thread does not exist in the child
    assert result["parent_state"] == "applied"


# --- item 12: ownership by what the object is, not by a path string ----------------------

SYMLINKED = """
import json, os, sys
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.glm4_moe import modeling_glm4_moe
# The path string transformers reports is another spelling of the one its code was loaded from
# (a symlinked site-packages, a relative sys.path entry, direct_transformers_import).
sys.modules["transformers"].__file__ = os.path.join(os.environ["OTHER_SPELLING"], "__init__.py")
import npu_autopatch
npu_autopatch.enable()
report = npu_autopatch.status()
print(json.dumps([sys.modules["transformers"].__file__, {m: [report[m].state, report[m].reason] for m in
                                          ("deepseek_v3", "glm4_moe")}]))
"""


def test_a_transformers_reached_through_another_spelling_of_its_path_is_still_its_own(tmp_path):
    # transformers' own test suite imports it with direct_transformers_import("src/transformers"):
    # a relative spelling; a symlinked site-packages gives another.
    real = os.path.dirname(transformers.__file__)
    os.symlink(real, tmp_path / "transformers")
    (path, report), _ = child_json(SYMLINKED, OTHER_SPELLING=str(tmp_path / "transformers"))
    assert not path.startswith(real), path
    for model_type, (state, reason) in report.items():
        assert state == "applied", (model_type, reason)
