"""What a kernel needs from the installed torch_npu, decided from its version without running an op.

torch_npu's ops come from Ascend/op-plugin, one branch per release line; a torch_npu release
builds on one of them. Ascend/pytorch's COMPATIBILITY.en.md ("TorchNPU version mapping table")
gives the branch of each release; ``_OP_PLUGIN_LINES`` is that table, per PyTorch line (the post
release from which a branch is used; the releases between two listed ones take the older branch,
as their release branches' version.txt histories show). What each branch provides is read from
its sources and cited where it is used. Running an op to find out is not an option: it would open
a device context on device 0 in every rank at import.

When the version cannot be read, the dispatcher is asked what torch_npu registered (an autograd
kernel for an op, an argument in a schema), which is what the version stands for.
"""

import re

# COMPATIBILITY.en.md: PyTorch line -> ((first torch_npu post release, op-plugin branch), ...).
# Branches as (major, minor); the 6.0.rc* and 5.0.* lines count as 6.0 and 5.0.
_OP_PLUGIN_LINES = {
    (2, 0, 1): ((0, (5, 0)),),
    (2, 1, 0): ((0, (5, 0)), (4, (6, 0)), (12, (7, 0)), (13, (7, 1)), (17, (7, 2))),
    (2, 2, 0): ((0, (6, 0)),),
    (2, 3, 1): ((0, (6, 0)), (6, (7, 0))),
    (2, 4, 0): ((0, (6, 0)), (4, (7, 0))),
    (2, 5, 1): ((0, (7, 0)), (1, (7, 1))),
    (2, 6, 0): ((0, (7, 1)), (3, (7, 2)), (5, (7, 3))),
    (2, 7, 1): ((0, (7, 2)), (2, (7, 3)), (4, (26, 0)), (8, (26, 1))),
    (2, 8, 0): ((0, (7, 2)), (2, (7, 3)), (4, (26, 0))),
    (2, 9, 0): ((0, (7, 3)), (2, (26, 0)), (6, (26, 1))),
    (2, 10, 0): ((0, (26, 0)), (4, (26, 1))),
    (2, 11, 0): ((0, (26, 1)),),
    (2, 12, 0): ((0, (26, 1)),),
}
# A PyTorch line newer than the table: the newest branch, or later (Ascend/pytorch master, which
# builds 2.13.0 to 2.15.0, pins op-plugin master).
_NEWEST = (26, 1)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?")


def op_plugin_line(version):
    """The op-plugin branch (major, minor) a torch_npu version builds on, or None if unreadable."""
    found = _VERSION.match(str(version or ""))
    if found is None:
        return None
    major, minor, patch, post = found.groups()
    base, post = (int(major), int(minor), int(patch)), int(post or 0)
    if base > max(_OP_PLUGIN_LINES):
        return _NEWEST
    known = [b for b in _OP_PLUGIN_LINES if b <= base]
    if not known:
        return (5, 0)  # older than every listed release: before op-plugin 6.0
    if max(known) != base:
        return _OP_PLUGIN_LINES[max(known)][-1][1]  # an unlisted line: no newer than its predecessor
    return [line for first, line in _OP_PLUGIN_LINES[base] if first <= post][-1]


def _name(line):
    return f"{line[0]}.{line[1]}.0"


def op_plugin_branch(version):
    """The op-plugin branch of a torch_npu version, for a report: '7.1.0', '26.1.0 or later', or None."""
    line = op_plugin_line(version)
    if line is None:
        return None
    found = _VERSION.match(str(version))
    newer = tuple(int(part) for part in found.groups()[:3]) > max(_OP_PLUGIN_LINES)
    return _name(line) + (" or later" if newer else "")


def _schema(npu, op):
    """The registered schema of ``op`` (torch_npu exposes torch.ops.npu packets), or None."""
    packet = getattr(npu, op, None)
    try:
        return packet.default._schema
    except AttributeError:
        return None


def _has_autograd(npu, op):
    """Whether the dispatcher has an autograd kernel (not the fallback) for ``op``: how torch_npu
    registers a backward (Ascend/pytorch codegen/autograd/templates/VariableType.cpp:
    TORCH_LIBRARY_IMPL(npu, AutogradPrivateUse1, m))."""
    import torch

    schema = _schema(npu, op)
    name = schema.name if schema is not None else f"npu::{op}"
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        return has_kernel(name, "AutogradPrivateUse1") or has_kernel(name, "Autograd")
    except RuntimeError:  # no such operator
        return False


def moe_requirement(npu):
    """None if the MoE kernel can train on this torch_npu, else why not and what is needed.

    op-plugin 7.2.0 brought both halves of its backward: derivatives.yaml entries for
    npu_moe_token_permute/unpermute (7.1.0 has the ops with no autograd: torch_npu's fallback
    warns and gives no gradient) and group_type=2 in npu_grouped_matmul (7.1.0's
    GroupedMatmulKernelNpuOpApi.cpp: "group_type currently only support -1 and 0").
    """
    version = getattr(npu, "__version__", None)
    line = op_plugin_line(version)
    if line is None:
        if _has_autograd(npu, "npu_moe_token_permute"):
            return None
        have = f"torch_npu {version!r} (version unreadable; its npu_moe_token_permute has no autograd kernel)"
    elif line >= (7, 2):
        return None
    else:
        have = f"torch_npu {version} has op-plugin {_name(line)}"
    return (
        "npu_moe_token_permute/unpermute have no backward and npu_grouped_matmul refuses group_type=2 "
        f"before op-plugin 7.2.0 ({have}): the experts, the router and the MoE input would get no "
        "gradient; needs torch_npu >= 2.7.1 (on older PyTorch lines: 2.6.0.post3, 2.1.0.post17)"
    )


def rotary_mode_requirement(npu):
    """None if npu_rotary_mul takes ``rotary_mode`` (the interleave variant needs it), else why not.

    The argument arrived in op-plugin 7.0.0 (op_plugin_functions.yaml: 6.0.0 has
    ``npu_rotary_mul(Tensor self, Tensor r1, Tensor r2)``).
    """
    version = getattr(npu, "__version__", None)
    line = op_plugin_line(version)
    if line is None:
        schema = _schema(npu, "npu_rotary_mul")
        if schema is not None and any(argument.name == "rotary_mode" for argument in schema.arguments):
            return None
        have = f"torch_npu {version!r} (version unreadable; no rotary_mode in its schema)"
    elif line >= (7, 0):
        return None
    else:
        have = f"torch_npu {version} has op-plugin {_name(line)}"
    return (
        f"npu_rotary_mul has no rotary_mode before op-plugin 7.0.0 ({have}): the interleaved rotary "
        "(GLM-4) needs its 'interleave' mode; needs torch_npu >= 2.5.1 (on older PyTorch lines: "
        "2.4.0.post4, 2.3.1.post6, 2.1.0.post12)"
    )


def swiglu_requirement(npu):
    """None if torch_npu has npu_swiglu with its backward (op-plugin 6.0.rc1's op_plugin_functions.yaml and
    derivatives.yaml; 5.0.0 has npu_rms_norm and npu_rotary_mul, not npu_swiglu), else why not."""
    version = getattr(npu, "__version__", None)
    line = op_plugin_line(version)
    if line is None or line >= (6, 0):
        return None  # unreadable: the patcher's check that the op exists decides
    return (
        f"npu_swiglu arrived in op-plugin 6.0 (torch_npu {version} has op-plugin {_name(line)}); "
        "needs torch_npu >= 2.2.0 (on the 2.1 line: 2.1.0.post4)"
    )


def gelu_requirement(npu):
    """None if torch_npu has npu_gelu with ``approximate`` and its backward, else why not.

    Both arrived in op-plugin 6.0.0 (op_plugin_functions.yaml ``npu_gelu(Tensor self, *, str
    approximate='none')`` and derivatives.yaml ``npu_gelu_backward``, ``version: [v2.1, newest]``); the
    5.0.0 and 6.0.rc* branches have neither (the patcher's check that the op exists refuses those).
    """
    version = getattr(npu, "__version__", None)
    line = op_plugin_line(version)
    if line is None:
        if _has_autograd(npu, "npu_gelu"):
            return None
        have = f"torch_npu {version!r} (version unreadable; its npu_gelu has no autograd kernel)"
    elif line >= (6, 0):
        return None
    else:
        have = f"torch_npu {version} has op-plugin {_name(line)}"
    return (
        f"npu_gelu and its backward arrived in op-plugin 6.0.0 ({have}); needs a torch_npu built on it "
        "or later"
    )


def geglu_requirement(npu):
    """None if torch_npu's npu_geglu takes ``activate_left`` (HF's act(gate) * up puts the GELU on the left
    half), else why not. op-plugin 6.0.rc1 added it to npu_geglu and npu_geglu_grad
    (op_plugin_functions.yaml; 5.0.0's schema is ``npu_geglu(Tensor self, int dim=-1, int approximate=1)``);
    derivatives.yaml joins npu_geglu to npu_geglu_grad in every branch."""
    version = getattr(npu, "__version__", None)
    line = op_plugin_line(version)
    if line is None:
        schema = _schema(npu, "npu_geglu")
        if schema is None or any(argument.name == "activate_left" for argument in schema.arguments):
            return None  # a plain function (the probes' reference ops), or the argument is there
        have = f"torch_npu {version!r} (version unreadable; no activate_left in its npu_geglu)"
    elif line >= (6, 0):
        return None
    else:
        have = f"torch_npu {version} has op-plugin {_name(line)}"
    return (
        f"npu_geglu has no activate_left before op-plugin 6.0 ({have}); needs torch_npu >= 2.2.0 "
        "(on the 2.1 line: 2.1.0.post4)"
    )


# The device families whose npu_fast_gelu computes x / (1 + exp(-1.702 x)), quick GELU, as the SoC name
# starts: Atlas A2 (Ascend910B*) and A3 (Ascend910_93*) (torch_npu-npu_fast_gelu.md, every branch from
# 7.1.0 to master: the Atlas training and inference series compute another formula; the Ascend 950 is
# not among the products the doc lists).
FAST_GELU_FAMILIES = ("Ascend910B", "Ascend910_93")


def fast_gelu_requirement(npu):
    """None if npu_fast_gelu has its backward on this torch_npu and computes quick GELU on this device.

    derivatives.yaml joins npu_fast_gelu to npu_fast_gelu_backward from op-plugin 7.3.0 (before, only
    the beta ``fast_gelu``, fp16/fp32 only, has an entry, and npu_fast_gelu would give no gradient).
    """
    version = getattr(npu, "__version__", None)
    line = op_plugin_line(version)
    if line is None:
        if not _has_autograd(npu, "npu_fast_gelu"):
            have = f"torch_npu {version!r} (version unreadable; its npu_fast_gelu has no autograd kernel)"
            return _fast_gelu_release_reason(have)
    elif line < (7, 3):
        return _fast_gelu_release_reason(f"torch_npu {version} has op-plugin {_name(line)}")
    soc = device_family(npu)
    if soc is not None and soc.startswith(FAST_GELU_FAMILIES):
        return None
    return (
        "npu_fast_gelu computes x / (1 + exp(-1.702 x)) on Atlas A2 and A3 only "
        f"(torch_npu-npu_fast_gelu.md); this device is {soc or 'of a family whose SoC name is unreadable'}"
    )


def _fast_gelu_release_reason(have):
    return (
        f"npu_fast_gelu has no backward before op-plugin 7.3.0 ({have}): quick GELU would get no gradient; "
        "needs torch_npu >= 2.9.0 (on older PyTorch lines: 2.8.0.post2, 2.7.1.post2, 2.6.0.post5)"
    )


# The device families whose npu_fusion_attention forward hands ``sink`` to the kernel, as the SoC
# name torch.npu.get_device_name(0) starts: the ones the sources were read for and the stand-in
# models (Atlas A2). Not the Ascend 950 (sink_requirement); any other family is unverified.
SINK_FAMILIES = ("Ascend910B",)


def device_family(npu):
    """The SoC name torch_npu reports for device 0 (e.g. "Ascend910B1", "Ascend950..."), or None.

    ``torch.npu.get_device_name(0)`` returns ``aclrtGetSocName()`` (Ascend/pytorch
    torch_npu/csrc/npu/Module.cpp ``GetDeviceName``) after checking the index against the device
    count: no device context is opened (without the index it would ask ``current_device()``, which
    initialises the device; ``torch_npu.npu.utils.get_soc_version()`` does too).
    """
    try:
        return npu.npu.get_device_name(0) or None
    except Exception:  # no torch_npu.npu, no device, or a CANN that cannot say
        return None


def _sink_family_reason(npu):
    """None if this device's fused forward takes the sink, else why the sinks must run unfused."""
    soc = device_family(npu)
    if soc is not None and soc.startswith(SINK_FAMILIES):
        return None
    if soc is not None and soc.startswith("Ascend950"):
        return (
            f"on {soc} (Ascend 950) npu_fusion_attention's forward passes no sink to the kernel while its "
            "backward passes it (op-plugin 26.0.0, 26.1.0 and master, FlashAttentionKernelNpuOpApi.cpp; CANN "
            "documents the sink as not supported on the 950 yet): fused, the sinks would be silently dropped"
        )
    return (
        f"the device ({soc or 'its SoC name unreadable'}) is not a family whose fused sink was checked "
        f"against op-plugin's source ({', '.join(f'{family}*' for family in SINK_FAMILIES)})"
    )


def sink_requirement(npu):
    """None if npu_fusion_attention takes ``sink`` (attention sinks) on this device, else why not.

    ``sink`` arrived in op-plugin 7.3.0, in the forward and in npu_fusion_attention_grad, which
    returns its gradient from then on (op_plugin_functions.yaml and derivatives.yaml of the 7.3.0
    branch; 7.2.0 has neither); the op's doc adds that the device needs CANN 8.5.0, which the
    version does not tell: an older CANN raises at the call ("The param sink is not supported in
    this CANN version", FlashAttentionKernelNpuOpApi.cpp). The device family must be one whose
    forward hands the sink to the kernel (``SINK_FAMILIES``; not the Ascend 950).
    """
    return _sink_release_reason(npu) or _sink_family_reason(npu)


def _sink_release_reason(npu):
    """None if this torch_npu's npu_fusion_attention has ``sink``, else why not."""
    version = getattr(npu, "__version__", None)
    line = op_plugin_line(version)
    if line is None:
        schema = _schema(npu, "npu_fusion_attention")
        if schema is not None:
            names = [argument.name for argument in schema.arguments]
        else:  # a plain function (the probes' reference ops)
            import inspect

            names = list(inspect.signature(npu.npu_fusion_attention).parameters)
        if "sink" in names:
            return None
        have = f"torch_npu {version!r} (version unreadable; no sink in its npu_fusion_attention)"
    elif line >= (7, 3):
        return None
    else:
        have = f"torch_npu {version} has op-plugin {_name(line)}"
    return (
        f"npu_fusion_attention has no sink before op-plugin 7.3.0 ({have}); needs torch_npu >= 2.9.0 "
        "(on older PyTorch lines: 2.8.0.post2, 2.7.1.post2, 2.6.0.post5) and CANN >= 8.5.0"
    )
