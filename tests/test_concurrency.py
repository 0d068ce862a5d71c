"""Threads: concurrent imports of modeling modules, and enable()/disable() racing each other."""

import json
import threading

from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

import npu_autopatch

from .conftest import STAND_IN_SITE, run_python

JOIN_TIMEOUT = 60

EIGHT_IMPORTS = """
import importlib, importlib.util, json, logging, os, sys, threading
import torch
import transformers  # arms the hooks
# transformers 4.57's lazy modules are not safe to initialise from several threads at once
# (ImportError: cannot import name 'GenerationMixin', without npu_autopatch too): what all
# modeling modules share is imported first; every modeling module is still imported at once.
from transformers.generation import GenerationMixin
from transformers.modeling_utils import PreTrainedModel
import npu_autopatch
from npu_autopatch.models import MODELS

messages = []

class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())

logger = logging.getLogger("npu_autopatch")
logger.addHandler(Collect())
logger.setLevel(logging.INFO)

def exists(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its model package is not in this transformers
        return False

present = [m for m in MODELS.values() if exists(m.module)]
chosen = present[:8]
assert len(chosen) == 8, [m.model_type for m in present]
threads_before = torch.get_num_threads()
barrier = threading.Barrier(len(chosen))
errors = []

def load(name):
    barrier.wait()
    try:
        importlib.import_module(name)
    except BaseException as exc:
        errors.append(f"{name}: {exc!r}")

threads = [threading.Thread(target=load, args=(m.module,), daemon=True) for m in chosen]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(JOIN_TIMEOUT)
hung = [m.module for m, t in zip(chosen, threads) if t.is_alive()]
if hung:
    print(json.dumps({"hung": hung}), flush=True)
    os._exit(3)

def holds_kernel(module, where):
    owner_path = where.split(":", 1)[1].split(".")
    owner = module
    for name in owner_path[:-1]:
        owner = getattr(owner, name)
    # 5.x experts keep transformers' dispatching forward; the kernel is the registered implementation.
    target = getattr(owner, "_npu_autopatch_experts", None) or getattr(owner, owner_path[-1])
    return target.__module__.startswith("npu_autopatch.kernels")

report = npu_autopatch.status()
result = {}
for model in chosen:
    record = report[model.model_type]
    result[model.model_type] = {
        "state": record.state,
        "reason": record.reason,
        "applied_messages": sum(m.startswith(f"npu-autopatch: {model.model_type}: applied ")
                                for m in messages),
        "targets_hold_kernels": all(
            holds_kernel(sys.modules[t.split(":")[0]], t) for t in record.targets
        ),
    }
print(json.dumps({"errors": errors, "models": result, "messages": messages,
                  "threads_kept": torch.get_num_threads() == threads_before}))
""".replace("JOIN_TIMEOUT", str(JOIN_TIMEOUT))


def test_eight_threads_importing_eight_models_at_once_patch_each_exactly_once():
    # Two intra-op threads whatever the test run has (CI: OMP_NUM_THREADS=1): the probes run on one
    # and must give the user's count back.
    child = run_python(EIGHT_IMPORTS, NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE), OMP_NUM_THREADS="2")
    assert child.returncode == 0, child.stdout + child.stderr  # 3: a thread never came back
    result = json.loads(child.stdout.splitlines()[-1])
    assert result["errors"] == []
    assert result["threads_kept"], "the probes did not give the user's intra-op thread count back"
    assert not [m for m in result["messages"] if "internal error" in m]
    for model_type, outcome in result["models"].items():
        assert outcome["state"] == "applied", (model_type, outcome["reason"])
        assert outcome["applied_messages"] == 1, (model_type, result["messages"])
        assert outcome["targets_hold_kernels"], model_type


def _target_objects():
    return (
        modeling_llama.LlamaRMSNorm.__dict__["forward"],
        modeling_qwen3.Qwen3RMSNorm.__dict__["forward"],
        modeling_qwen3.apply_rotary_pos_emb,
    )


STOCK = _target_objects()


def _consistent():
    """Enabled: both models applied and every target ours. Disabled: all stock, none applied."""
    report = npu_autopatch.status()
    states = (report["llama"].state, report["qwen3"].state)
    replaced = [now is not stock for now, stock in zip(_target_objects(), STOCK, strict=True)]
    if npu_autopatch.is_enabled():
        return states == ("applied", "applied") and all(replaced)
    return "applied" not in states and not any(replaced)


def _race(first, second):
    barrier = threading.Barrier(2)

    def run(call):
        barrier.wait()
        call()

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "enable()/disable() deadlocked"


def test_enable_and_disable_racing_end_in_a_consistent_state(npu_stand_in):
    for _ in range(40):
        npu_autopatch.disable()
        _race(npu_autopatch.enable, npu_autopatch.disable)
        assert _consistent(), npu_autopatch.status()
        npu_autopatch.enable()
        _race(npu_autopatch.disable, npu_autopatch.enable)
        assert _consistent(), npu_autopatch.status()


def test_two_selections_racing_end_with_exactly_one_of_them(npu_stand_in):
    for _ in range(20):
        _race(lambda: npu_autopatch.enable(models=["llama"]), lambda: npu_autopatch.enable(models=["qwen3"]))
        report = npu_autopatch.status()
        states = (report["llama"].state, report["qwen3"].state)
        assert states in (("applied", "skipped"), ("skipped", "applied")), states
        ours = [now is not stock for now, stock in zip(_target_objects(), STOCK, strict=True)]
        assert ours == [states[0] == "applied", states[1] == "applied", states[1] == "applied"]
        npu_autopatch.disable()
