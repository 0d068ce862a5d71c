"""Every patched rotary function on the shapes training feeds it, forward and backward, on every profile.

No call raises, outputs and the gradients of q and k equal stock's, and the fused op runs wherever the
kernel can take the shape (stock runs where it cannot). See npu_autopatch.testing.rope_sweep for the cases;
``verify`` runs the same sweep on a real NPU. Every rotary function runs on the default profile; the older
release lines share the rotary kernel's shape rules and differ in the op's schema, so there the functions of
one model per rope variant run.
"""

import importlib

import pytest

from npu_autopatch.testing import DEFAULT, PROFILES, make_torch_npu
from npu_autopatch.testing.rope_sweep import sweep

from .conftest import every_variant, variant_users


def has_mrope():
    """Whether Qwen2.5-VL still has its own multimodal rotary function (up to transformers 5.16)."""
    try:
        module = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    except ImportError:
        return False
    return hasattr(module, "apply_multimodal_rotary_pos_emb")


def failures(cases):
    return [
        f"{c.function} [{c.variant}] {c.shape} {c.dtype}: fused calls {c.fused_calls}, {c.error}"
        for c in cases
        if not c.passed
    ]


def test_every_rotary_function_takes_every_shape_on_the_default_profile():
    cases = sweep(make_torch_npu(profile=DEFAULT))
    assert failures(cases) == []
    variants = {c.variant for c in cases}
    assert {"half", "partial", "interleave", "deinterleave", "vision"} <= variants
    assert ("mrope" in variants) == has_mrope()
    assert {c.dtype for c in cases} == {"float32", "bfloat16"}
    assert any(c.shape.startswith("B >= S") for c in cases) and any("stock" in c.shape for c in cases)
    assert sum(c.fused_calls for c in cases) > 0


@pytest.mark.parametrize("profile", [name for name, profile in PROFILES.items() if profile is not DEFAULT])
def test_every_rope_variant_takes_every_shape_on_the_older_releases(profile):
    users = variant_users()
    in_use = {variant for kernel, variant in every_variant("rope") if (kernel, variant) in users}
    models = {users["rope", variant][0] for variant in in_use}
    cases = sweep(make_torch_npu(profile=profile), models=models)
    assert failures(cases) == []
    assert {c.variant for c in cases} == in_use
    assert sum(c.fused_calls for c in cases) > 0
