"""The plugin's proof: patched Helium matches stock Helium, on the CPU stand-in."""

import pytest
import torch

import npu_autopatch
from npu_autopatch.testing.parity import check_parity


def test_the_plugin_is_discovered_from_its_entry_point():
    npu_autopatch.enable()  # as NPU_AUTOPATCH=1 does: status() then lists the installed plugins
    try:
        assert npu_autopatch.status()["helium"].module == "transformers.models.helium.modeling_helium"
    finally:
        npu_autopatch.disable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_patched_helium_matches_stock(dtype, npu_stand_in):
    report = check_parity("helium", dtype, npu=npu_stand_in)
    assert report.state == "applied", report.reason
    assert report.kernels == ("rms_norm", "swiglu")
    assert report.ops_called["npu_rms_norm"] == 5  # two per layer and the final norm
    assert report.ops_called["npu_swiglu_backward"] == 2
    assert report.passed, report
