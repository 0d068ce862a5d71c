"""The stand-in refuses what the device refuses, per torch_npu release: the source's rules, tested directly.

The rotary kernel's layout tables (hicann/ops-transformer rope_rotate_half_tiling.cpp ChooseTilingMode and
CheckBnsdBlockSkip, rope_half_grad_tiling.cpp RopeHalfGradSelectLayout, the interleave tilings), the grouped
matmul's transpose, group-type and empty-input behaviour, and what each release line has a backward for.
Then the two layouts the rope kernel uses are checked against those tables over a grid of shapes.
"""

import itertools
import warnings

import pytest
import torch

from npu_autopatch.testing import DEFAULT, PROFILES, make_torch_npu
from npu_autopatch.testing.device import ops as rules


@pytest.fixture(params=list(PROFILES))
def npu(request):
    return make_torch_npu(profile=request.param)


def rotary(npu, x_shape, r_shape, mode="half", dtype=torch.float32, backward=False):
    x = torch.randn(*x_shape, dtype=dtype, requires_grad=backward)
    r = torch.randn(*r_shape, dtype=dtype)
    out = npu.npu_rotary_mul(x, r, r, mode)
    if backward:
        out.sum().backward()
    return out


# --- npu_rotary_mul: what the A2 device refuses, on every profile --------------------------------------


def test_hf_layout_with_many_short_sequences_is_refused(npu):
    """The issue's case: q [B, N, S, D] with HF's batch-1 cos [1, 1, S, D], B*N > 8*S (D/2 aligned)."""
    with pytest.raises(RuntimeError, match="please do not use RotaryPositionEmbedding fusion operator"):
        rotary(npu, (32, 8, 8, 128), (1, 1, 8, 128), dtype=torch.bfloat16)
    rotary(npu, (4, 8, 8, 128), (1, 1, 8, 128), dtype=torch.bfloat16)  # B*N = 32 <= 64: taken


def test_hf_layout_with_a_small_rotary_dim_is_refused_at_any_batch(npu):
    """D/2 not 32-byte aligned and D < 80: BNSD is refused once 2*B*N > ceil(S / 48)."""
    with pytest.raises(RuntimeError, match="please do not use"):
        rotary(npu, (2, 4, 64, 16), (1, 1, 64, 16), dtype=torch.bfloat16)  # D/2 = 8 bf16: unaligned
    rotary(npu, (2, 64, 4, 16), (1, 64, 1, 16), dtype=torch.bfloat16)  # the same as BSND: taken


def test_backward_has_no_layout_for_per_batch_cos_with_b_not_below_s(npu):
    """q [B, N, S, D] with cos [B, 1, S, D]: forward fine, backward only for B < S."""
    rotary(npu, (2, 4, 8, 16), (2, 1, 8, 16), backward=True)
    rotary(npu, (8, 4, 8, 16), (8, 1, 8, 16))  # the forward takes B = S ...
    with pytest.raises(RuntimeError, match="invalid shape!"):
        rotary(npu, (8, 4, 8, 16), (8, 1, 8, 16), backward=True)  # ... the backward does not


def test_three_dimensional_input_is_refused(npu):
    """Vision q [S, N, D] and the old flattened interleave [T, N, R] (V1 kernel: 4-D only)."""
    for mode in ("half", "interleave"):
        with pytest.raises(RuntimeError, match="4-dimensional"):
            rotary(npu, (16, 2, 8), (16, 1, 8), mode)


def test_interleave_takes_batch_one_cos_only(npu):
    rotary(npu, (2, 5, 3, 8), (1, 5, 1, 8), "interleave", backward=True)
    with pytest.raises(RuntimeError, match="not supported"):
        rotary(npu, (2, 5, 3, 8), (2, 5, 1, 8), "interleave")


# --- the two layouts of the rope kernel, against the tables ---------------------------------------------

BATCH = (1, 2, 7, 32, 999, 1000, 4096)
SEQ = (1, 2, 8, 63, 4096)
HEADS = (1, 2, 8, 64, 999)
HEAD_DIM = (2, 8, 16, 64, 80, 128, 256, 894)


def accepted(x, r, mode, itemsize):
    """Whether the device tables take (x, r) forward and backward, r not needing a gradient."""
    d = x[3]
    if mode == "half":
        layout, b, n, lines = rules.half_forward_layout(x, r)
        forward = layout != "UNKNOWN" and lines > 0 and b < 1000 and n < 1000
        forward = forward and not (layout == "BNSD" and rules.bnsd_block_skip(b, n, lines, d, itemsize))
        return forward and rules.half_backward_layout(x, r) is not None
    found = rules.interleave_forward_layout(x, r)
    return (
        found is not None
        and found[1] * found[2] < 1000
        and rules.interleave_backward_layout(x, r) is not None
    )


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_the_rope_kernels_layouts_are_in_both_tables_for_every_shape(mode):
    """Layout A, x [B, S, N, D] with cos [1, S, 1, D] when B*N < 1000, else layout B, x [1, B*S, N, D]
    with cos [1, B*S, 1, D] (N < 1000): the forward and the backward tables take every shape."""
    refused = []
    for b, s, n, d, itemsize in itertools.product(BATCH, SEQ, HEADS, HEAD_DIM, (2, 4)):
        if b * n < 1000:
            x, r = (b, s, n, d), (1, s, 1, d)
        else:
            x, r = (1, b * s, n, d), (1, b * s, 1, d)
        if not accepted(x, r, mode, itemsize):
            refused.append((x, r, itemsize))
    assert refused == []


def test_hf_own_layouts_are_refused_for_some_shapes():
    """The grid is not trivially accepted: HF's [B, N, S, D] with cos [1, 1, S, D] or [B, 1, S, D] fails."""
    batch_one = [(b, s, n, d) for b, s, n, d in itertools.product(BATCH[:5], SEQ, HEADS[:4], HEAD_DIM)]
    refused_11sd = [
        x for x in batch_one if not accepted((x[0], x[2], x[1], x[3]), (1, 1, x[1], x[3]), "half", 2)
    ]
    refused_b1sd = [
        x for x in batch_one if not accepted((x[0], x[2], x[1], x[3]), (x[0], 1, x[1], x[3]), "half", 2)
    ]
    assert (32, 8, 8, 128) in refused_11sd  # many short sequences
    assert (7, 2, 2, 64) in refused_b1sd and (7, 2, 2, 64) not in refused_11sd  # per-batch cos, B >= S


# --- npu_grouped_matmul -----------------------------------------------------------------------------------


def gmm(npu, x, w, counts, group_type=0, **kwargs):
    return npu.npu_grouped_matmul(
        [x],
        [w],
        group_list=torch.tensor(counts),
        group_type=group_type,
        split_item=3,
        group_list_type=1,
        **kwargs,
    )[0]


def test_k_split_is_refused_before_op_plugin_7_2(npu):
    x, dy = torch.randn(9, 4), torch.randn(9, 5)
    if npu.PROFILE.name == "a2-2.6.0":
        with pytest.raises(RuntimeError, match=r"group_type 2 is not supported by torch_npu 2\.6\.0"):
            gmm(npu, x.t(), dy, [2, 4, 3], group_type=2)
    else:
        assert gmm(npu, x.t(), dy, [2, 4, 3], group_type=2).shape == (3, 4, 5)


def test_k_split_leaves_empty_groups_unwritten_before_the_cann_8_5_line(npu):
    """An expert without rows: zeros from EmptyTensorCompute (current CANN), unwritten memory before."""
    if npu.PROFILE.name == "a2-2.6.0":
        pytest.skip("no K-split on op-plugin 7.1.0")
    x, dy = torch.randn(9, 4), torch.randn(9, 5)
    dw = gmm(npu, x.t(), dy, [2, 0, 7], group_type=2)
    torch.testing.assert_close(dw[0], x[:2].t() @ dy[:2])
    if npu.PROFILE.gmm_zero_fills_empty_groups:
        assert torch.equal(dw[1], torch.zeros(4, 5))
    else:
        assert dw[1].isnan().all()


def test_an_all_empty_x_skips_the_kernel_and_leaves_the_output_unwritten(npu):
    """aclnn_grouped_matmul.cpp CheckZeroShape: no kernel runs, the allocated output stays as it was."""
    out = gmm(npu, torch.randn(0, 4), torch.randn(2, 4, 5), [0, 0])
    assert out.shape == (0, 5)
    if npu.PROFILE.name != "a2-2.6.0":
        dw = gmm(npu, torch.randn(0, 4).t(), torch.randn(0, 5), [0, 0], group_type=2)
        assert dw.shape == (2, 4, 5) and dw.isnan().all()


def test_transpose_rules(npu):
    x, w = torch.randn(6, 4), torch.randn(2, 4, 5)
    gmm(npu, x, w.transpose(1, 2).contiguous().transpose(1, 2), [3, 3])  # M-split: transposed weight is fine
    with pytest.raises(RuntimeError, match="x can not be transposed"):
        gmm(npu, x.t().contiguous().t(), w, [3, 3])  # M-split: transposed x is not
    if npu.PROFILE.name != "a2-2.6.0":
        dy = torch.randn(6, 5)
        with pytest.raises(RuntimeError, match="tensor in x should be transposed"):
            gmm(npu, x.t().contiguous(), dy, [3, 3], group_type=2)  # K-split: x must be transposed
        with pytest.raises(RuntimeError, match="can not be transposed at the same time"):
            gmm(npu, x.t(), dy.t().contiguous().t(), [3, 3], group_type=2)


def test_a_counts_group_list_of_length_one_is_refused(npu):
    with pytest.raises(RuntimeError, match="must not have length 1"):
        gmm(npu, torch.randn(3, 4), torch.randn(1, 4, 5), [3])


# --- autograd and schemas per release -----------------------------------------------------------------


def token_round_trip(npu):
    tokens, probs = torch.randn(6, 4, requires_grad=True), torch.rand(6, 2, requires_grad=True)
    indices = torch.tensor([[1, 0], [2, 1], [0, 2], [1, 2], [0, 1], [2, 0]])
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    npu.npu_moe_token_unpermute(permuted, sorted_indices, probs).sum().backward()
    return tokens, probs


def test_token_permute_backward_ops_follow_the_release(npu):
    name = npu.PROFILE.name
    if name == "a2-2.6.0":  # op-plugin 7.1.0: the ops exist without any backward
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens, probs = token_round_trip(npu)
        assert tokens.grad is None and probs.grad is None
        assert any("an autograd kernel was not registered" in str(w.message) for w in caught)
        assert not any("grad" in op for op in npu.calls)
        return
    tokens, probs = token_round_trip(npu)
    assert tokens.grad is not None and probs.grad is not None
    newest = (
        npu.PROFILE.schemas is PROFILES["a2-newest"].schemas
    )  # a2-newest, and 950-newest: the same release
    suffix = "_grad_v2" if newest else "_grad"  # 26.1.0+: v2 ops; 7.2.0 to 26.0.0: v1
    assert npu.calls["npu_moe_token_permute" + suffix] == npu.calls["npu_moe_token_unpermute" + suffix] == 1


def test_schemas_follow_the_release():
    newest, v271, v260 = PROFILES["a2-newest"], PROFILES["a2-2.7.1"], PROFILES["a2-2.6.0"]
    assert DEFAULT is newest and newest.torch_npu == "2.14.0"
    assert "rotate" in newest.schemas["npu_rotary_mul"] and "rotate" not in v271.schemas["npu_rotary_mul"]
    assert "ScalarType? output_dtype" in v271.schemas["npu_grouped_matmul"]
    assert {op for op in newest.schemas if "token" in op and "grad" in op} == {
        "npu_moe_token_permute_grad_v2",
        "npu_moe_token_unpermute_grad_v2",
    }
    assert {op for op in v271.schemas if "token" in op and "grad" in op} == {
        "npu_moe_token_permute_grad",
        "npu_moe_token_unpermute_grad",
    }
    assert not [op for op in v260.schemas if "token" in op and "grad" in op]


def test_calls_are_counted_per_live_stand_in_of_a_profile():
    first, second, other = make_torch_npu(), make_torch_npu(), make_torch_npu(profile="a2-2.6.0")
    first.npu_swiglu(torch.randn(2, 8))
    assert first.calls == second.calls == {"npu_swiglu": 1} and other.calls == {}
    other.npu_swiglu(torch.randn(2, 8))
    assert first.calls["npu_swiglu"] == 1 and other.calls["npu_swiglu"] == 1


def test_unknown_profiles_are_refused():
    with pytest.raises(ValueError, match=r"unknown stand-in profile 'a2-9\.9'"):
        make_torch_npu(profile="a2-9.9")
    with pytest.raises(ValueError, match="npu_moe_token_permute_grad_v2"):
        make_torch_npu(profile="a2-2.6.0", missing=["npu_moe_token_permute_grad_v2"])
