"""The plugin's proof: patched Granite matches stock Granite, on the CPU stand-in."""

import pytest
import torch

import npu_autopatch
from npu_autopatch.testing.parity import check_parity


def test_the_plugin_is_discovered_from_its_entry_point():
    assert npu_autopatch.status()["granite"].module == "transformers.models.granite.modeling_granite"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_patched_granite_matches_stock(dtype, npu_stand_in):
    report = check_parity("granite", dtype, npu=npu_stand_in)
    assert report.state == "applied", report.reason
    assert report.kernels == ("rms_norm", "swiglu", "rope")
    assert report.ops_called["npu_rms_norm"] == 5  # two per layer and the final norm
    assert report.ops_called["npu_swiglu_backward"] == 2
    assert report.passed, report
