"""Version gating (contract C2): what each kernel needs from the installed torch_npu, read without an op."""

import pytest

from npu_autopatch.kernels import KERNELS
from npu_autopatch.kernels._requirements import (
    fast_gelu_requirement,
    geglu_requirement,
    gelu_requirement,
    moe_requirement,
    op_plugin_line,
    rotary_mode_requirement,
    swiglu_requirement,
)
from npu_autopatch.testing import PROFILES, make_torch_npu

# Ascend/pytorch COMPATIBILITY.en.md, row by row (torch_npu release -> op-plugin branch), and the
# releases between two rows, which take the older branch.
COMPATIBILITY = {
    "2.12.0": (26, 1),
    "2.11.0": (26, 1),
    "2.10.0.post4": (26, 1),
    "2.10.0": (26, 0),
    "2.9.0.post6": (26, 1),
    "2.9.0.post2": (26, 0),
    "2.9.0": (7, 3),
    "2.8.0.post4": (26, 0),
    "2.8.0.post2": (7, 3),
    "2.8.0": (7, 2),
    "2.7.1.post8": (26, 1),
    "2.7.1.post4": (26, 0),
    "2.7.1.post2": (7, 3),
    "2.7.1.post1": (7, 2),
    "2.7.1": (7, 2),
    "2.6.0.post5": (7, 3),
    "2.6.0.post4": (7, 2),
    "2.6.0.post3": (7, 2),
    "2.6.0.post2": (7, 1),
    "2.6.0": (7, 1),
    "2.5.1.post1": (7, 1),
    "2.5.1": (7, 0),
    "2.4.0.post4": (7, 0),
    "2.4.0.post2": (6, 0),
    "2.3.1.post6": (7, 0),
    "2.1.0.post17": (7, 2),
    "2.1.0.post13": (7, 1),
    "2.1.0.post12": (7, 0),
    "2.1.0.post10": (6, 0),
    "2.1.0": (5, 0),
    "1.11.0.post14": (5, 0),
    # Newer than the table: Ascend/pytorch master (2.13.0 to 2.15.0) pins op-plugin master.
    "2.13.0": (26, 1),
    "2.14.0": (26, 1),
    # Local versions and release candidates are read by their release.
    "2.6.0+gitabc1234": (7, 1),
    "2.7.1rc1": (7, 2),
}


@pytest.mark.parametrize(("version", "line"), COMPATIBILITY.items())
def test_a_torch_npu_version_maps_to_its_op_plugin_branch(version, line):
    assert op_plugin_line(version) == line


@pytest.mark.parametrize("version", [None, "", "unknown", "v2"])
def test_an_unreadable_version_maps_to_nothing(version):
    assert op_plugin_line(version) is None


def module_with_version(version, profile="a2-newest"):
    npu = make_torch_npu(profile=profile)
    npu.__version__ = version
    return npu


@pytest.mark.parametrize("version", ["2.7.1", "2.8.0", "2.6.0.post3", "2.1.0.post17", "2.9.0", "2.14.0"])
def test_the_moe_kernel_runs_from_op_plugin_7_2(version):
    assert moe_requirement(module_with_version(version)) is None


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0.post2", "2.5.1.post1", "2.1.0.post13", "2.4.0"])
def test_the_moe_kernel_is_gated_below_op_plugin_7_2_with_the_reason(version):
    reason = moe_requirement(module_with_version(version))
    line = op_plugin_line(version)
    assert reason.startswith(
        "npu_moe_token_permute/unpermute have no backward and npu_grouped_matmul refuses group_type=2 "
        f"before op-plugin 7.2.0 (torch_npu {version} has op-plugin {line[0]}.{line[1]}.0)"
    )
    assert "would get no gradient" in reason and "needs torch_npu >= 2.7.1" in reason


def test_the_interleaved_rotary_needs_rotary_mode():
    assert rotary_mode_requirement(module_with_version("2.5.1")) is None
    reason = rotary_mode_requirement(module_with_version("2.4.0.post2"))
    assert "no rotary_mode before op-plugin 7.0.0 (torch_npu 2.4.0.post2 has op-plugin 6.0.0)" in reason
    assert "needs torch_npu >= 2.5.1" in reason
    (interleave,) = [v for v in KERNELS["rope"].variants if v.name == "interleave"]
    assert interleave.requires is rotary_mode_requirement
    assert all(v.requires is None for v in KERNELS["rope"].variants if v is not interleave)


def test_swiglu_needs_op_plugin_6():
    assert swiglu_requirement(module_with_version("2.1.0.post4")) is None
    assert swiglu_requirement(module_with_version("custom-build")) is None  # the op check decides
    reason = swiglu_requirement(module_with_version("2.1.0"))
    assert reason.startswith("npu_swiglu arrived in op-plugin 6.0 (torch_npu 2.1.0 has op-plugin 5.0.0)")


def test_the_gelu_family_needs_its_op_plugin_lines():
    """npu_gelu and npu_geglu's activate_left from 6.0; npu_fast_gelu's backward from 7.3.0, on A2/A3."""
    assert gelu_requirement(module_with_version("2.1.0.post10")) is None
    assert "npu_gelu and its backward arrived in op-plugin 6.0.0 (torch_npu 2.1.0 has op-plugin 5.0.0)" in (
        gelu_requirement(module_with_version("2.1.0"))
    )
    assert geglu_requirement(module_with_version("2.2.0")) is None
    assert geglu_requirement(module_with_version("custom-build")) is None  # its schema has activate_left
    assert "npu_geglu has no activate_left before op-plugin 6.0" in geglu_requirement(
        module_with_version("2.1.0")
    )
    for version in ("2.9.0", "2.8.0.post2", "2.7.1.post2", "2.6.0.post5", "2.14.0"):
        assert fast_gelu_requirement(module_with_version(version)) is None, version
    for version in ("2.8.0", "2.7.1", "2.6.0.post4", "2.1.0.post17"):
        reason = fast_gelu_requirement(module_with_version(version))
        assert reason.startswith("npu_fast_gelu has no backward before op-plugin 7.3.0"), reason
        assert "quick GELU would get no gradient; needs torch_npu >= 2.9.0" in reason
    # The release has it, the device computes another formula or is not documented: stock.
    reason = fast_gelu_requirement(make_torch_npu(profile="950-newest"))
    assert reason.endswith("on Atlas A2 and A3 only (torch_npu-npu_fast_gelu.md); this device is Ascend950")


def test_the_built_in_kernels_declare_their_requirements():
    assert KERNELS["moe"].requires is moe_requirement
    assert KERNELS["swiglu"].requires is swiglu_requirement
    assert KERNELS["geglu"].requires is geglu_requirement
    assert KERNELS["gelu"].requires is gelu_requirement
    assert KERNELS["quick_gelu"].requires is fast_gelu_requirement
    assert all(KERNELS[name].requires is None for name in ("rms_norm", "gated_rms_norm", "rope"))


@pytest.mark.parametrize("profile", PROFILES)
def test_each_stand_in_profile_is_gated_as_its_release(profile):
    npu = make_torch_npu(profile=profile)
    assert npu.__version__ == PROFILES[profile].torch_npu
    assert rotary_mode_requirement(npu) is None
    assert (moe_requirement(npu) is None) == (profile != "a2-2.6.0")
    assert gelu_requirement(npu) is None and geglu_requirement(npu) is None
    assert (fast_gelu_requirement(npu) is None) == (profile == "a2-newest")


@pytest.mark.parametrize(
    ("profile", "gated"), [("a2-newest", False), ("a2-2.7.1", False), ("a2-2.6.0", True)]
)
def test_an_unreadable_version_asks_the_dispatcher(profile, gated):
    """No version to read: whether torch_npu registered a backward for the token permute op decides."""
    npu = module_with_version("custom-build", profile)
    reason = moe_requirement(npu)
    assert (reason is not None) == gated
    if gated:
        assert "version unreadable; its npu_moe_token_permute has no autograd kernel" in reason
    assert rotary_mode_requirement(npu) is None  # every profile's schema has rotary_mode
    assert gelu_requirement(npu) is None  # every profile registers npu_gelu's backward
    # npu_fast_gelu's backward: registered on the newest profile only (derivatives.yaml 7.3.0 on)
    assert (fast_gelu_requirement(npu) is None) == (profile == "a2-newest")
