"""A selection that names unknown things, or patches no model, is a configuration error (issue 33).

A typo in a cluster's NPU_AUTOPATCH_MODELS used to switch every model off with one "ignoring" line
among the rest, and NPU_AUTOPATCH_KERNELS=bogus gave one warning per model (49 lines). Now: one
rank-0 WARNING per mistake at start, naming the nearest valid names and saying when no model will be
patched; never an exception at interpreter start; ``check`` fails on them (tests/test_cli.py).
"""

import pytest

import npu_autopatch
from npu_autopatch import _config, _control

from .conftest import STAND_IN_SITE, run_python

# Child interpreters: CI's full matrix (`pytest -m ""`); the interpreter's start is their subject.
pytestmark = [pytest.mark.full, pytest.mark.process]

# Patching on at start, then a job's imports on a device (the stand-in's torch_npu), each model's
# decision taken: every warning it would give is given.
JOB = """
import npu_autopatch
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe
record = npu_autopatch.status()["qwen3"]
print(record.state.value, record.code.value if record.code else "-")
"""


def job(**env):
    child = run_python(JOB, NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE), **env)
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr
    return child.stdout.strip(), [line for line in child.stderr.splitlines() if line.strip()]


def test_an_unknown_kernel_alone_is_one_warning_that_says_nothing_will_be_patched():
    code, lines = job(NPU_AUTOPATCH_KERNELS="bogus")
    assert code == "skipped no-kernel-selected"
    assert len(lines) == 1, lines  # not one more per model
    assert "unknown kernels in NPU_AUTOPATCH_KERNELS: 'bogus'" in lines[0]
    assert "no model will be patched" in lines[0]


def test_an_unknown_model_alone_says_nothing_will_be_patched():
    code, lines = job(NPU_AUTOPATCH_MODELS="nosuchmodel")
    assert code == "skipped not-selected"
    assert len(lines) == 1, lines
    assert "'nosuchmodel'" in lines[0] and "no model will be patched" in lines[0]


def test_a_typo_names_the_nearest_valid_names_and_the_rest_is_patched():
    code, lines = job(NPU_AUTOPATCH_MODELS="qwen33,qwen3", NPU_AUTOPATCH_KERNELS="rms_norm,rop")
    assert code == "applied -"  # qwen3 is selected, with the kernel named right
    assert len(lines) == 2, lines
    assert "'qwen33' (did you mean 'qwen3'" in lines[0] and "no model will be patched" not in lines[0]
    assert "'rop' (did you mean 'rope'?)" in lines[1]


def test_valid_names_that_select_no_model_are_one_warning():
    code, lines = job(NPU_AUTOPATCH_MODELS="qwen3", NPU_AUTOPATCH_KERNELS="gated_delta_rule")
    assert code == "skipped no-kernel-selected"
    assert len(lines) == 1, lines
    assert lines[0].startswith("npu-autopatch: no model will be patched: Config(models=qwen3")


def test_a_kernel_selection_of_the_users_is_no_warning_per_model():
    # rms_norm selects most models; the ones it leaves out (the attention integrations) are the user's
    # choice, as an excluded model is: no line each.
    code, lines = job(NPU_AUTOPATCH_KERNELS="rms_norm")
    assert code == "applied -" and lines == []


def test_enable_names_the_nearest_valid_names_in_its_error():
    with pytest.raises(ValueError, match=r"unknown models \['lama'\] \('lama': did you mean 'llama'"):
        npu_autopatch.enable(models=["lama"])
    assert not npu_autopatch.is_enabled()


def test_the_mistakes_check_reads_are_the_ones_enable_warns(monkeypatch):
    monkeypatch.setenv("NPU_AUTOPATCH_MODELS", "qwen3")
    monkeypatch.setenv("NPU_AUTOPATCH_EXCLUDE", "qwen3")
    assert _control.selection_mistakes() == [
        "no model will be patched: Config(models=qwen3, exclude=qwen3, kernels=all, strict=False, "
        "force=False) selects none of the known models"
    ]
    monkeypatch.setenv("NPU_AUTOPATCH_EXCLUDE", "")
    assert _control.selection_mistakes() == []
    assert not npu_autopatch.is_enabled()  # it looked, applied nothing


def test_a_selection_of_every_model_is_never_empty():
    config = _config.Config(None, frozenset(), None, False, False)
    assert _config.patches_no_model(config) is False
