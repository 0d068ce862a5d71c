"""multiprocessing children: spawn and forkserver patch themselves, fork inherits.

Each test runs a parent script in a fresh interpreter; the parent starts its children as a
training job's data loader or worker pool would.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from .conftest import ROOT, STAND_IN_SITE, child_env

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = [pytest.mark.full, pytest.mark.process]


TIMEOUT = 120


def run_script(tmp_path, code, **env):
    """Run ``code`` as a script file (spawn and forkserver children re-import it by path)."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(code))
    child = subprocess.run(
        [sys.executable, str(script)],
        env=child_env(PYTHONPATH=str(STAND_IN_SITE), **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    return json.loads(child.stdout.splitlines()[-1])


FRESH_CHILD = """
import json, multiprocessing, os, sys

def probe():
    # No code of ours runs here before the import: only the .pth line, at interpreter start.
    booted = "npu_autopatch" in sys.modules
    from transformers.models.qwen3 import modeling_qwen3
    import npu_autopatch
    record = npu_autopatch.status()["qwen3"]
    return {
        "booted_at_start": booted,
        "state": record.state,
        "norm_module": modeling_qwen3.Qwen3RMSNorm.forward.__module__,
    }

if __name__ == "__main__":
    # The parent itself is not patched: NPU_AUTOPATCH reaches only the children's start-up.
    assert "npu_autopatch" not in sys.modules
    os.environ["NPU_AUTOPATCH"] = "1"
    context = multiprocessing.get_context(METHOD)
    with context.Pool(1) as pool:
        result = pool.apply_async(probe).get(timeout=100)
    print(json.dumps({**result, "parent_imported_us": "npu_autopatch" in sys.modules}))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_fresh_child_with_the_variable_patches_itself(tmp_path, method):
    result = run_script(tmp_path, FRESH_CHILD.replace("METHOD", repr(method)))
    assert result == {
        "booted_at_start": True,
        "state": "applied",
        "norm_module": "npu_autopatch.kernels.norm",
        "parent_imported_us": False,
    }


FORKED_CHILD = """
import json, logging, multiprocessing
from transformers.models.qwen3 import modeling_qwen3
import npu_autopatch

class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

def probe(parent_forward_id):
    collect = Collect()
    logger = logging.getLogger("npu_autopatch")
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    from transformers.models.llama import modeling_llama  # patched by the inherited hook
    npu_autopatch.enable()  # the same selection: nothing to do
    report = npu_autopatch.status()
    return {
        "same_qwen3_forward": id(modeling_qwen3.Qwen3RMSNorm.forward) == parent_forward_id,
        "qwen3": report["qwen3"].state,
        "llama": report["llama"].state,
        "llama_norm_module": modeling_llama.LlamaRMSNorm.forward.__module__,
        "logged": collect.messages,
    }

if __name__ == "__main__":
    assert npu_autopatch.status()["qwen3"].state == "applied"
    forward_id = id(modeling_qwen3.Qwen3RMSNorm.forward)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        result = pool.apply_async(probe, (forward_id,)).get(timeout=100)
    print(json.dumps(result))
"""


def test_a_forked_child_inherits_the_patched_state_and_does_not_patch_twice(tmp_path):
    result = run_script(tmp_path, FORKED_CHILD, NPU_AUTOPATCH="1")
    assert result["same_qwen3_forward"] is True
    assert result["qwen3"] == "applied" and result["llama"] == "applied"
    assert result["llama_norm_module"] == "npu_autopatch.kernels.norm"
    # The only patching in the child is llama's: qwen3's is inherited, enable() is a no-op.
    assert [m for m in result["logged"] if "applied" in m] == [
        "npu-autopatch: llama: applied rms_norm, swiglu, rope to 3 targets"
    ]


FORK_DURING_A_PATCH = """
import json, os, select, threading, time
import npu_autopatch
from npu_autopatch.kernels import KERNELS

# Make mistral's RMSNorm probe slow, so that the fork below lands inside its transaction.
inside = threading.Event()
variant = KERNELS["rms_norm"].variants[0]
real_probe = variant.probe

def slow_probe(stock, candidate):
    inside.set()
    time.sleep(1.0)
    return real_probe(stock, candidate)

variant.probe = slow_probe
import transformers  # arms the hooks
importer = threading.Thread(target=__import__, args=("transformers.models.mistral.modeling_mistral",))
importer.start()
assert inside.wait(60)
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:  # the child: one thread; the importer thread does not exist here
    os.write(write_end, npu_autopatch.status()["mistral"].state.encode())
    os._exit(0)
ready, _, _ = select.select([read_end], [], [], 30)
state = os.read(read_end, 100).decode() if ready else None
if state is None:
    os.kill(pid, 9)
os.waitpid(pid, 0)
importer.join(60)
print(json.dumps({"child_state": state, "parent_state": npu_autopatch.status()["mistral"].state}))
"""


def test_a_fork_during_a_patch_does_not_hang_the_child(tmp_path):
    # Without the fork handlers in _state the child could inherit a lock held by a thread that
    # does not exist there, and its first status() would hang for ever (child_state None). The
    # probes run outside the lock (tests/test_hooks.py: the fork does not wait for them), so
    # the child sees mistral's import unfinished: pending, as its importing thread is gone.
    result = run_script(tmp_path, FORK_DURING_A_PATCH, NPU_AUTOPATCH="1", NPU_AUTOPATCH_PROBE="always")
    assert result == {"child_state": "pending", "parent_state": "applied"}
