"""tests/_warm.py: a warm child behaves as a cold interpreter would, as far as the tests can tell."""

import subprocess
import sys

import pytest

from . import _warm
from .conftest import ROOT, STAND_IN_SITE, child_env

PROBE = r"""
import atexit, importlib.util, json, os, sys, threading, time
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
print(json.dumps({
    "argv": sys.argv,
    "path": sys.path[:2],
    "cwd": os.getcwd(),
    "probe": os.environ.get("PROBE"),
    "main": __name__,
    "imported": [m for m in ("npu_autopatch", "transformers", "tests") if m in sys.modules],
    "torch_npu": importlib.util.find_spec("torch_npu") is not None,
}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.parametrize("pythonpath", [None, str(STAND_IN_SITE)])
def test_a_warm_child_runs_as_a_cold_one(tmp_path, pythonpath):
    env = child_env(PROBE="seen", **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    args = [sys.executable, "-c", PROBE, "one", "two"]
    cold = _warm.run(args, env, cwd=tmp_path, timeout=60, warm=False)
    warm = _warm.run(args, env, cwd=tmp_path, timeout=60)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.returncode == 3 and "thread joined\natexit ran" in cold.stdout, cold


def test_a_module_run_warm_gets_its_file_as_argv_0_as_python_m_does():
    args = [sys.executable, "-m", "npu_autopatch", "models"]
    cold = _warm.run(args, child_env(), cwd=ROOT, timeout=120, warm=False)
    warm = _warm.run(args, child_env(), cwd=ROOT, timeout=120)
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout) and "| qwen3 |" in warm.stdout


def test_what_torchs_import_reads_sends_a_child_cold():
    code = "import sys; print('torch' in sys.modules)"
    assert _warm.run([sys.executable, "-c", code], child_env(), timeout=60).stdout == "True\n"
    for env in ({"OMP_NUM_THREADS": "7"}, {"TORCH_LOGS": "dynamo"}, {"PYTHONHASHSEED": "5"}):
        assert _warm.run([sys.executable, "-c", code], child_env(**env), timeout=60).stdout == "False\n", env


BOOTED = r"""
import sys
booted = "npu_autopatch._bootstrap" in sys.modules
import npu_autopatch
from transformers.models.qwen3 import modeling_qwen3
print(booted, npu_autopatch.status()["qwen3"].state.value, modeling_qwen3.Qwen3RMSNorm.forward.__module__)
"""


def test_with_npu_autopatch_set_a_warm_child_boots_as_the_pth_line_does():
    env = child_env(NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE))
    cold = _warm.run([sys.executable, "-c", BOOTED], env, cwd=ROOT, timeout=120, warm=False)
    warm = _warm.run([sys.executable, "-c", BOOTED], env, cwd=ROOT, timeout=120)
    assert warm.stdout == cold.stdout and cold.stdout.startswith("True applied npu_autopatch"), cold


def test_a_child_past_its_timeout_is_killed_and_the_next_one_runs():
    with pytest.raises(subprocess.TimeoutExpired):
        _warm.run([sys.executable, "-c", "import time; time.sleep(60)"], child_env(), timeout=1)
    after = _warm.run([sys.executable, "-c", "print('next')"], child_env(), timeout=60)
    assert after.stdout == "next\n"
