"""Ray workers: NPU_AUTOPATCH in a task's or actor's runtime_env patches that worker only.

One real local Ray cluster for the whole module, started by a driver in a fresh interpreter
(so that Ray's threads, signal handlers and logging never enter the pytest process), with a
bounded run time; the driver shuts the cluster down, and its process group is killed if it
overruns.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from .conftest import ROOT, STAND_IN_SITE, child_env

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = [pytest.mark.full, pytest.mark.process]


pytest.importorskip("ray", reason="ray is not installed")

DRIVER = """
import json, sys
import ray

SITE = sys.argv[1]
ON = {"env_vars": {"NPU_AUTOPATCH": "1", "PYTHONPATH": SITE}}
OFF = {"env_vars": {"PYTHONPATH": SITE}}

def probe():
    # No code of ours runs in the worker before this import but the .pth line at its start.
    import os, sys
    booted = "npu_autopatch" in sys.modules
    from transformers.models.qwen3 import modeling_qwen3
    import npu_autopatch
    return {
        "booted_at_start": booted,
        "state": npu_autopatch.status()["qwen3"].state,
        "norm_module": modeling_qwen3.Qwen3RMSNorm.forward.__module__,
        "pid": os.getpid(),
    }

@ray.remote
class Probe:
    def run(self):
        return probe()

ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 * 1024)
try:
    task = ray.remote(probe)
    actor = Probe.options(runtime_env=ON).remote()
    on, off, in_actor = ray.get(
        [task.options(runtime_env=ON).remote(), task.options(runtime_env=OFF).remote(), actor.run.remote()],
        timeout=150,
    )
    print("RESULT " + json.dumps({"task": on, "task_without": off, "actor": in_actor}), flush=True)
finally:
    ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_results(tmp_path_factory):
    script = tmp_path_factory.mktemp("ray") / "driver.py"
    script.write_text(DRIVER)
    env = child_env(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    driver = subprocess.Popen(
        [sys.executable, str(script), str(STAND_IN_SITE)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # the cluster's processes share its group: one kill ends all
    )
    try:
        stdout, stderr = driver.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()
        pytest.fail("the Ray driver overran its time; cluster killed")
    assert driver.returncode == 0, stderr[-4000:]
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


PATCHED = {"booted_at_start": True, "state": "applied", "norm_module": "npu_autopatch.kernels.norm"}


def without_pid(result):
    return {k: v for k, v in result.items() if k != "pid"}


def test_a_task_with_the_variable_in_its_runtime_env_is_patched(ray_results):
    assert without_pid(ray_results["task"]) == PATCHED


def test_an_actor_with_the_variable_in_its_runtime_env_is_patched(ray_results):
    assert without_pid(ray_results["actor"]) == PATCHED


def test_a_worker_without_it_is_not(ray_results):
    assert without_pid(ray_results["task_without"]) == {
        "booted_at_start": False,
        "state": "off",
        "norm_module": "transformers.models.qwen3.modeling_qwen3",
    }
    assert ray_results["task_without"]["pid"] not in (ray_results["task"]["pid"], ray_results["actor"]["pid"])
