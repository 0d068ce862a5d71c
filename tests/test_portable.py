"""A model built while patched runs anywhere, and one built elsewhere gets the kernels here (issue 16).

Nothing of ours may outlive the process in the user's objects: a 5.x MoE model's config used
to keep our experts-implementation name, which exists only in a patched process, so the model
raised ``KeyError`` wherever else it went. Each side runs in a fresh interpreter: the builder
patched (with the stand-in), the receiver with no npu-autopatch and no torch_npu at all.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, SDPA_OPS, STAND_IN_SITE, child_env, run_python, selected_values
from .test_parity_models import present

MODELS = ["qwen3", "qwen3_moe"]

# Builds each model with patching on, keeps its stock output (patching off, same weights and
# input), and hands the model on in the way ``how`` names.
BUILDER = """
import json, os, pickle, sys
import torch


def run(model):  # in the receiving process: no npu-autopatch, no torch_npu
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits
    return logits, [name for name in ("torch_npu", "npu_autopatch") if name in sys.modules]


def close(got, expected):  # a Ray worker runs one thread: another summation order
    return torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def without_stand_in():  # workers inherit the environment and (spawn) sys.path
    os.environ.pop("PYTHONPATH", None)
    sys.path[:] = [entry for entry in sys.path if "stand_in_site" not in entry]


def main(how, folder):
    import npu_autopatch
    from npu_autopatch.testing.parity import tiny_model

    npu_autopatch.enable()
    models = {{}}
    for model_type in {models!r}:
        model = tiny_model(model_type).eval()
        assert npu_autopatch.status()[model_type].state == "applied", npu_autopatch.status()[model_type]
        models[model_type] = model
    npu_autopatch.disable()
    expected = {{t: run(m)[0] for t, m in models.items()}}
    npu_autopatch.enable()  # the model leaves a patched process
    got = {{}}
    forms = how.split("+")  # "save+pickle": both files, for one receiver
    if "save" in forms:
        for model_type, model in models.items():
            torch.save(model, os.path.join(folder, model_type + ".pt"))
            torch.save(expected[model_type], os.path.join(folder, model_type + ".expected.pt"))
    if "pickle" in forms:
        for model_type, model in models.items():
            with open(os.path.join(folder, model_type + ".pkl"), "wb") as f:
                pickle.dump((model, expected[model_type]), f)
    if how == "spawn":
        import multiprocessing
        without_stand_in()
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            got = {{t: pool.apply(run, (m,)) for t, m in models.items()}}
    elif how == "ray":
        import ray
        without_stand_in()
        ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024 * 1024)
        try:
            remote = ray.remote(run)
            got = {{t: ray.get(remote.remote(m), timeout=150) for t, m in models.items()}}
        finally:
            ray.shutdown()
    result = {{t: {{"stock": close(out, expected[t]), "loaded": on}} for t, (out, on) in got.items()}}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # a spawned worker imports this file again
    main(sys.argv[1], sys.argv[2])
"""

# Loads what the builder left, in a process with no npu-autopatch and no torch_npu.
RECEIVER = """
import json, os, pickle, sys
import torch

how, folder = sys.argv[1], sys.argv[2]
ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
close = lambda got, expected: torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
result = {{}}
for form in how.split("+"):
    for model_type in {models!r}:
        if form == "save":
            model = torch.load(os.path.join(folder, model_type + ".pt"), weights_only=False)
            expected = torch.load(os.path.join(folder, model_type + ".expected.pt"))
        else:
            with open(os.path.join(folder, model_type + ".pkl"), "rb") as f:
                model, expected = pickle.load(f)
        with torch.no_grad():
            logits = model(ids).logits
        ours = [name for name in ("torch_npu", "npu_autopatch") if name in sys.modules]
        result.setdefault(form, {{}})[model_type] = {{"stock": close(logits, expected), "loaded": ours}}
print("RESULT " + json.dumps(result), flush=True)
"""


def _run(code, *args, timeout=300, **env):
    """Run ``code`` as a script file (a spawned worker re-imports it) in a fresh interpreter."""
    script = Path(args[-1]) / "script.py"
    script.write_text(code)
    child = subprocess.run(
        [sys.executable, str(script), *args],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        start_new_session=True,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    line = next(line for line in child.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _models():
    models = [m for m in MODELS if present(m)]
    assert models == MODELS
    return models


@pytest.fixture(scope="module")
def received(request, tmp_path_factory):
    """{form: what the receiver found}: one builder and one receiver for every form this session runs."""
    forms = "+".join(selected_values(request, "how"))
    models = _models()
    folder = str(tmp_path_factory.mktemp("portable"))
    _run(BUILDER.format(models=models), forms, folder, PYTHONPATH=str(STAND_IN_SITE))
    return _run(RECEIVER.format(models=models), forms, folder)


@pytest.mark.parametrize("how", ["save", "pickle"])
def test_a_model_saved_while_patched_runs_in_a_process_without_us(how, received):
    assert received[how] == {m: {"stock": True, "loaded": []} for m in _models()}


@pytest.mark.full  # a worker interpreter more: CI's full matrix
@pytest.mark.process
def test_a_model_sent_to_a_spawned_worker_runs_there_unpatched(tmp_path):
    models = _models()
    got = _run(BUILDER.format(models=models), "spawn", str(tmp_path), PYTHONPATH=str(STAND_IN_SITE))
    assert got == {m: {"stock": True, "loaded": []} for m in models}


@pytest.mark.full  # a Ray cluster: CI's full matrix
@pytest.mark.process
def test_a_model_sent_to_a_ray_task_runs_there_unpatched(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed")
    models = _models()
    try:
        got = _run(
            BUILDER.format(models=models), "ray", str(tmp_path), timeout=240, PYTHONPATH=str(STAND_IN_SITE)
        )
    except subprocess.TimeoutExpired as exc:  # a hung cluster: kill the driver's process group
        with_pid = getattr(exc, "pid", None)
        if with_pid:
            os.killpg(with_pid, signal.SIGKILL)
        raise
    assert got == {m: {"stock": True, "loaded": []} for m in models}


# The reverse: built and saved with no npu-autopatch, loaded where it is on: the kernels apply.
UNPATCHED_BUILDER = """
import os, sys
import torch
from npu_autopatch.testing.parity import tiny_model
for model_type in {models!r}:
    torch.save(tiny_model(model_type).eval(), os.path.join(sys.argv[1], model_type + ".pt"))
"""

PATCHED_RECEIVER = """
import collections, json, os, sys
import torch
import torch_npu
import npu_autopatch

ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
result = {{}}
for model_type in {models!r}:
    model = torch.load(os.path.join(sys.argv[1], model_type + ".pt"), weights_only=False)
    before = collections.Counter(torch_npu.calls)
    with torch.no_grad():
        patched = model(ids).logits
    ran = dict(collections.Counter(torch_npu.calls) - before)
    npu_autopatch.disable()
    with torch.no_grad():
        stock = model(ids).logits
    npu_autopatch.enable()
    result[model_type] = {{"ops": sorted(ran), "close": torch.allclose(patched, stock, rtol=1e-4, atol=1e-5)}}
print("RESULT " + json.dumps(result), flush=True)
"""


def test_a_model_built_without_us_gets_the_kernels_where_patching_is_on(tmp_path):
    models = _models()
    result = run_python(UNPATCHED_BUILDER.format(models=models).replace("sys.argv[1]", repr(str(tmp_path))))
    assert result.returncode == 0, result.stderr[-3000:]
    got = _run(
        PATCHED_RECEIVER.format(models=models),
        str(tmp_path),
        NPU_AUTOPATCH="1",
        PYTHONPATH=str(STAND_IN_SITE),
    )
    assert got["qwen3"]["close"], got
    kernels_ran = [op for op in got["qwen3"]["ops"] if op not in SDPA_OPS]  # and torch_npu's sdpa
    assert kernels_ran == ["npu_rms_norm", "npu_rotary_mul", "npu_swiglu"], got
    assert got["qwen3_moe"]["close"] and "npu_grouped_matmul" in got["qwen3_moe"]["ops"], got
