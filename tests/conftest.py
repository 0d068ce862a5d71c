"""Shared helpers: fresh interpreters for import-time behaviour, and a clean slate per test."""

import functools
import importlib
import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

import npu_autopatch
from npu_autopatch import _plugins

from ._warm import run as warm_run

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


def run_python(code, timeout=180, warm=True, **env):
    """Run ``code`` in a fresh interpreter of this venv: site, .pth files and all (``warm``: forked with
    torch imported where the environment allows, tests/_warm.py; ``False`` where the subject is the
    interpreter's start)."""
    return warm_run([sys.executable, "-c", textwrap.dedent(code)], child_env(**env), ROOT, timeout, warm)


def child_result(code, *argv, timeout=600, pythonpath=ROOT / "src", cwd=None, **env):
    """Run a child script (one intra-op thread, ``pythonpath`` on the path; warm, as ``run_python``) and
    return the JSON it printed after ``RESULT``; a failing child fails the test with its output."""
    result = warm_run(
        [sys.executable, "-c", code, *argv],
        child_env(PYTHONPATH=str(pythonpath), OMP_NUM_THREADS="1", **env),
        cwd,
        timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.split("RESULT", 1)[1])


@pytest.fixture(autouse=True)
def patching_off():
    """Every test starts and ends with patching disabled and nothing replaced."""
    npu_autopatch.disable()
    yield
    npu_autopatch.disable()


@pytest.fixture(autouse=True)
def environment_kept():
    """Each test leaves os.environ as it found it. transformers 4.57's TrainingArguments writes
    ACCELERATE_MIXED_PRECISION there: after one bf16 trainer test, every later Trainer of the worker
    (and every child it starts) trained under bf16 autocast, whatever its own ``bf16=False`` said."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# The fused attention ops torch_npu's own sdpa runs on the device for a model on its default attention
# (the stand-in models it: testing/device/sdpa.py), in stock and patched runs alike.
SDPA_OPS = frozenset({"npu_fusion_attention", "npu_fusion_attention_grad"})


def kernel_ops(ops):
    """``ops`` (op name -> calls) without those of torch_npu's sdpa: what the kernels themselves ran."""
    return {op: n for op, n in ops.items() if op not in SDPA_OPS}


# The full matrix only (CI: ``pytest -m ""``): what the default selection covers another way (a second
# dtype, the per-model runs of an edge case whose code is per kernel variant, a second child process).
FULL = pytest.mark.full


def selected_values(request, name):
    """Every value of the parameter ``name`` (a list parameter: each of its items) of the tests of the
    requesting module this session runs (after ``-m`` and ``-k``), in order. A module-scoped fixture runs
    one child interpreter for all of them, where one child per parameter would repeat its imports of
    torch and transformers (CI's time); each test still checks its own values, one by one."""
    values = {}
    for item in request.session.items:
        if item.module is request.module and name in getattr(getattr(item, "callspec", None), "params", {}):
            value = item.callspec.params[name]
            values.update(dict.fromkeys(value if isinstance(value, list | tuple) else [value]))
    return list(values)


def present(model_type):
    """Whether the running transformers has this table model (without importing its modeling module)."""
    from npu_autopatch.models import MODELS

    try:
        return importlib.util.find_spec(MODELS[model_type].module) is not None
    except ModuleNotFoundError:
        return False


@functools.cache
def variant_users():
    """{(kernel, variant): the table models present whose targets take it, in table order}.

    Read from status() after patching every table model present (all kernels) on the stand-in, as the
    patcher chooses: the release profiles share the forward math, so the parity tests run every model
    on the default profile and one model per (kernel, variant) on the others.
    """
    from npu_autopatch.kernels import KERNELS
    from npu_autopatch.models import BUILTIN, MODELS
    from npu_autopatch.testing import stand_in

    kernel_of = {variant.name: name for name, kernel in KERNELS.items() for variant in kernel.variants}
    assert len(kernel_of) == sum(len(kernel.variants) for kernel in KERNELS.values()), "variant names clash"
    models = [model for model in BUILTIN if present(model)]
    users = {}
    with stand_in():
        for model in models:
            importlib.import_module(MODELS[model].module)
        npu_autopatch.enable(models=models)
        try:
            records = npu_autopatch.status()
        finally:
            npu_autopatch.disable()
    for model in models:
        for variant in dict.fromkeys(records[model].variants.values()):
            users.setdefault((kernel_of[variant], variant), []).append(model)
    return {pair: tuple(found) for pair, found in users.items()}


def every_variant(*kernels):
    """Every (kernel, variant) the kernels define, whether or not this transformers has a user of it."""
    from npu_autopatch.kernels import KERNELS

    return [(name, variant.name) for name in kernels for variant in KERNELS[name].variants]
