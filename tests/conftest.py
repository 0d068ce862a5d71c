"""Shared helpers: fresh interpreters for import-time behaviour, and a clean slate per test."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import npu_autopatch
from npu_autopatch import _plugins

# Installed plugins (the example plugin is part of the test environment) are in MODELS
# from the start here, as they are in every child process that reads the configuration.
_plugins.discover()

ROOT = Path(__file__).resolve().parents[1]
# On PYTHONPATH, this directory makes `import torch_npu` give the CPU stand-in in a child
# process. It exists only in the test tree, so it can never load outside the tests.
STAND_IN_SITE = Path(__file__).resolve().parent / "stand_in_site"
_SCRUBBED = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PYTHONPATH")


def child_env(**overrides):
    """The test's environment without any NPU_AUTOPATCH* or rank variable, plus overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_AUTOPATCH") and k not in _SCRUBBED}
    env.update(overrides)
    return env


def run_python(code, timeout=180, **env):
    """Run ``code`` in a fresh interpreter of this venv: site, .pth files and all."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture(autouse=True)
def patching_off():
    """Every test starts and ends with patching disabled and nothing replaced."""
    npu_autopatch.disable()
    yield
    npu_autopatch.disable()
