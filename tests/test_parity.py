"""Parity is the proof: every patched model against stock transformers, logits and all gradients.

Both paths: enabled after the modeling module was imported (in this process), and enabled
before it (in a fresh interpreter, where the post-import hook does the patching).
"""

import json

import pytest
import torch

from npu_autopatch.testing import PROFILES, stand_in
from npu_autopatch.testing.parity import check_parity

from .conftest import run_python

# Fused-op calls per forward of a tiny two-layer model: RMSNorm runs twice per layer plus
# the final norm (qwen3 adds q_norm and k_norm per layer), rotary twice per layer (q, k),
# the MLP once per layer. The backward runs each op's backward kernel as often.
EXPECTED_CALLS = {
    "llama": {"npu_rms_norm": 5, "npu_swiglu": 2, "npu_rotary_mul": 4},
    "mistral": {"npu_rms_norm": 5, "npu_swiglu": 2, "npu_rotary_mul": 4},
    "qwen2": {"npu_rms_norm": 5, "npu_swiglu": 2, "npu_rotary_mul": 4},
    "qwen3": {"npu_rms_norm": 9, "npu_swiglu": 2, "npu_rotary_mul": 4},
}


def assert_parity(report, expected_calls):
    assert report.state == "applied", report.reason
    assert report.kernels == ("rms_norm", "swiglu", "rope")
    for op, count in expected_calls.items():
        assert report.ops_called.get(op) == count, (op, report.ops_called)
        assert report.ops_called.get(op + "_backward") == count, (op + "_backward", report.ops_called)
    assert not report.missing_grads, f"no gradient reached {report.missing_grads}"
    assert report.logits_error <= report.tolerance, report.logits_error
    assert report.grad_error <= report.tolerance, (report.worst_tensor, report.grad_error)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", sorted(EXPECTED_CALLS))
def test_patched_model_matches_stock(model_type, dtype, profile):
    """On every stand-in profile: every torch_npu release line the kernels support."""
    with stand_in(profile=profile) as npu:
        assert_parity(check_parity(model_type, dtype, npu=npu), EXPECTED_CALLS[model_type])


LAZY_SCRIPT = """
import json, sys, torch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import check_parity
with stand_in() as npu:
    report = check_parity({model!r}, getattr(torch, {dtype!r}), npu=npu, lazy=True)
print(json.dumps({{**vars(report), "passed": report.passed}}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", sorted(EXPECTED_CALLS))
def test_patched_by_the_import_hook_matches_stock(model_type, dtype):
    child = run_python(LAZY_SCRIPT.format(model=model_type, dtype=dtype))
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["state"] == "applied", report["reason"]
    for op, count in EXPECTED_CALLS[model_type].items():
        assert report["ops_called"].get(op) == count, (op, report["ops_called"])
        assert report["ops_called"].get(op + "_backward") == count
    assert not report["missing_grads"]
    assert report["passed"], report
