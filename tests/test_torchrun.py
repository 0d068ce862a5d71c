"""torchrun with two CPU ranks (gloo): both ranks patched, only rank 0 logs, status() agrees."""

import json
import socket
import subprocess
import sys

import pytest

from .conftest import ROOT, STAND_IN_SITE, child_env

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = [pytest.mark.full, pytest.mark.process]


WORKER = """
import datetime, json, logging, os, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s|%(message)s")
from transformers.models.qwen3 import modeling_qwen3  # before the process group: rank from RANK
import torch.distributed as dist
import npu_autopatch

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
from transformers.models.llama import modeling_llama  # after it: rank from torch.distributed
report = {m: r.as_dict() for m, r in npu_autopatch.status().items()}
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, report)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"world": dist.get_world_size(), "reports": gathered}), flush=True)
dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_ranks(worker, directory, env, timeout):
    """``worker`` (a script's text) run by torchrun as 2 local ranks on a free port, from ROOT."""
    script = directory / "worker.py"
    script.write_text(worker)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_two_ranks_are_patched_and_only_rank_zero_logs(tmp_path):
    env = child_env(
        NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"
    )
    run = two_ranks(WORKER, tmp_path, env, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["world"] == 2
    rank0, rank1 = result["reports"]
    assert rank0 == rank1  # status() agrees on both ranks
    assert rank0["qwen3"]["state"] == "applied" and rank0["llama"]["state"] == "applied"

    ours = [line for line in run.stderr.splitlines() if line.startswith("npu_autopatch|")]
    assert ours == [  # the integrations are imported with transformers, before any model
        "npu_autopatch|npu-autopatch: flash_attention_utils: applied attention to 1 target",
        "npu_autopatch|npu-autopatch: npu_flash_attention: applied attention to 2 targets",
        "npu_autopatch|npu-autopatch: activations: applied gelu, quick_gelu to 5 targets",
        "npu_autopatch|npu-autopatch: default_attention: applied default_attention to 1 target",
        "npu_autopatch|npu-autopatch: qwen3: applied rms_norm, swiglu, rope to 3 targets",
        "npu_autopatch|npu-autopatch: llama: applied rms_norm, swiglu, rope to 3 targets",
    ]
