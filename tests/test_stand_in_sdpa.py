"""What the device computes for attention, on the stand-in: the work accounting and torch_npu's own sdpa.

The accounting (``attention_work()``, testing/device/work.py) counts the score elements every forward
``npu_fusion_attention`` call computes: by sparse mode, pre/next tokens and layout. The figures here are
hand-counted on small grids (a 4x4 causal triangle is 4+3+2+1 = 10 elements), not derived from the
stand-in's helpers.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
import torch.nn.functional as F
import transformers

from npu_autopatch.testing import PROFILES, make_torch_npu, stand_in
from npu_autopatch.testing.device import attention_work, computed_elements
from npu_autopatch.testing.device.profiles import SDPA_RULES

from .conftest import run_python

UNBOUNDED = 2147483647


@pytest.fixture
def npu():
    torch.manual_seed(0)
    return make_torch_npu()


def compressed() -> torch.Tensor:
    return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def fa(npu, q_shape, layout="BNSD", head_num=1, **kwargs):
    q = torch.randn(q_shape)
    return npu.npu_fusion_attention(q, q, q, head_num, layout, **kwargs)


# (kwargs of the call, elements per batch and head) on Sq = Skv = 4.
SQUARE_CASES = {
    "no mask": ({}, 16),
    "no mask, sparse_mode 3 (no mask: no mode applies)": ({"sparse_mode": 3}, 16),
    "explicit mask, sparse_mode 0, unbounded": ({"atten_mask": torch.zeros(4, 4, dtype=torch.bool)}, 16),
    "explicit mask, sparse_mode 1": (
        {"atten_mask": torch.zeros(4, 4, dtype=torch.bool), "sparse_mode": 1},
        16,
    ),
    "explicit mask, sparse_mode 0, next 0 (causal)": (
        {"atten_mask": torch.zeros(4, 4, dtype=torch.bool), "next_tockens": 0},
        10,
    ),
    "explicit mask, sparse_mode 0, pre 1 next 0": (
        {"atten_mask": torch.zeros(4, 4, dtype=torch.bool), "pre_tockens": 1, "next_tockens": 0},
        7,
    ),
    "sparse_mode 2": ({"atten_mask": compressed(), "sparse_mode": 2}, 10),
    "sparse_mode 3": ({"atten_mask": compressed(), "sparse_mode": 3}, 10),
    "sparse_mode 4, pre 1 next 0": (
        {"atten_mask": compressed(), "sparse_mode": 4, "pre_tockens": 1, "next_tockens": 0},
        7,
    ),
}


@pytest.mark.parametrize("case", list(SQUARE_CASES))
def test_one_batch_and_head_computes_the_elements_of_its_mode(npu, case):
    kwargs, expected = SQUARE_CASES[case]
    with attention_work() as work:
        fa(npu, (1, 1, 4, 8), **kwargs)
    assert work.computed == expected
    assert work.calls == {"npu_fusion_attention": 1}
    assert work.computed_by_path == {"npu_fusion_attention": expected}
    (record,) = work.records
    mode = kwargs.get("sparse_mode", 0)
    assert (record.layout, record.sparse_mode, record.computed) == ("BNSD", mode, expected)


def test_batches_and_query_heads_multiply_in_every_dense_layout(npu):
    """B=2, N=3 query heads (GQA over one KV head for BNSD), Sq=Skv=4, causal: 2*3*10."""
    mask = {"atten_mask": compressed(), "sparse_mode": 3}
    with attention_work() as work:
        q, kv = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 8)
        npu.npu_fusion_attention(q, kv, kv, 3, "BNSD", **mask)
        fa(npu, (2, 4, 3, 8), "BSND", 3, **mask)
        fa(npu, (2, 4, 24), "BSH", 3, **mask)
        fa(npu, (4, 2, 24), "SBH", 3, **mask)
    assert work.computed == 4 * 60
    assert [r.computed for r in work.records] == [60] * 4


def test_tnd_counts_each_sequence_from_actual_seq_lengths(npu):
    """Two sequences of 3 and 5 tokens, causal: (3+2+1) + (5+4+3+2+1) per head; without a mask 9 + 25."""
    lengths = {"actual_seq_qlen": [3, 8], "actual_seq_kvlen": [3, 8]}
    with attention_work() as causal:
        fa(npu, (8, 2, 8), "TND", 2, atten_mask=compressed(), sparse_mode=3, **lengths)
    with attention_work() as unmasked:
        fa(npu, (8, 2, 8), "TND", 2, **lengths)
    assert causal.computed == 2 * (6 + 15)
    assert unmasked.computed == 2 * (9 + 25)


def test_a_short_query_counts_top_left_and_bottom_right_causal_apart(npu):
    """Sq=2, Skv=4: leftUpCausal keeps j <= i (1+2), rightDownCausal j <= i+2 (3+4)."""
    q, kv = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 4, 8)
    with attention_work() as work:
        for mode in (2, 3):
            npu.npu_fusion_attention(q, kv, kv, 1, "BNSD", atten_mask=compressed(), sparse_mode=mode)
    assert [r.computed for r in work.records] == [3, 7]
    assert work.sparse_modes == {2: 1, 3: 1}


def test_the_backward_is_not_counted(npu):
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with attention_work() as work:
        out = npu.npu_fusion_attention(q, q, q, 1, "BNSD")[0]
        out.sum().backward()
    assert npu.calls == {"npu_fusion_attention": 1, "npu_fusion_attention_grad": 1}
    assert work.calls == {"npu_fusion_attention": 1}
    assert work.computed == 16


def test_tallies_count_only_while_open_nest_and_see_every_thread(npu):
    fa(npu, (1, 1, 4, 8))  # no tally open: recorded nowhere
    with attention_work() as outer:
        fa(npu, (1, 1, 4, 8))
        with attention_work() as inner:
            worker = threading.Thread(target=fa, args=(npu, (1, 1, 2, 8)))
            worker.start()
            worker.join()
        fa(npu, (1, 1, 4, 8))
    fa(npu, (1, 1, 4, 8))
    assert inner.computed == 4 and inner.calls == {"npu_fusion_attention": 1}
    assert outer.computed == 16 + 4 + 16 and outer.calls == {"npu_fusion_attention": 3}


def test_computed_elements_is_the_per_head_figure_for_shapes_too_large_to_run():
    """A window of 1,024 over 32k tokens in band mode: 1,025 per row once the window is full."""
    s, window = 32768, 1024
    band = computed_elements(s, s, masked=True, sparse_mode=4, pre_tokens=window, next_tokens=0)
    assert band == sum(min(i, window) + 1 for i in range(s))
    assert computed_elements(s, s, masked=True) == s * s
    assert computed_elements(s, s, masked=True, sparse_mode=2) == s * (s + 1) // 2


# ------------------------------------------------------------------------------------------------------
# torch_npu's sdpa (testing/device/sdpa.py): per profile, what F.scaled_dot_product_attention runs.
# ------------------------------------------------------------------------------------------------------

TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, bound before any stand-in is installed
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
# The profiles whose op-plugin branch (profiles.py SdpaRules) is master; the others are 7.1.0 and 7.2.0.
MASTER_LEVEL = {name for name, profile in PROFILES.items() if profile.sdpa.branch == "master"}


@pytest.fixture(params=list(PROFILES))
def device(request):
    torch.manual_seed(0)
    with stand_in(profile=request.param) as module, attention_work() as work:
        yield module, work


def leaves(*shapes):
    return [torch.randn(shape, requires_grad=True) for shape in shapes]


def same_as_torch(args, kwargs, reference_args=None):
    """The stand-in's sdpa equals torch's own (fp32 within 1e-5), output and gradients of q, k, v."""
    out = F.scaled_dot_product_attention(*args, **kwargs)
    grads = torch.autograd.grad(out.square().sum(), args[:3])
    copies = [t.detach().clone().requires_grad_() for t in args[:3]]
    reference_args = reference_args or {}
    expected = TORCH_SDPA(*copies, *args[3:], **{**kwargs, **reference_args})
    expected_grads = torch.autograd.grad(expected.square().sum(), copies)
    torch.testing.assert_close(out, expected, **FP32_TOL)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32_TOL)


def padding_mask(batch, q_len, kv_len):
    """A boolean [B, 1, Sq, Skv] keep-mask where every row keeps its first key (no fully masked row)."""
    mask = torch.rand(batch, 1, q_len, kv_len) > 0.4
    mask[..., 0] = True
    return mask


def test_causal_without_a_mask_is_the_fused_op_in_left_up_causal_mode(device):
    npu, work = device
    q, k, v = leaves((2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8))
    same_as_torch((q, k, v), {"is_causal": True, "enable_gqa": True})
    assert npu.calls == {"npu_fusion_attention": 1, "npu_fusion_attention_grad": 1}
    assert work.calls == {"sdpa": 1, "npu_fusion_attention": 1}
    assert work.sparse_modes == {2: 1}
    assert work.computed == 2 * 4 * 15  # the 5x5 triangle per batch and query head
    assert (work.mask_copy_bytes, work.mask_built_bytes) == (0, 2 * 2048 * 2048)  # ones, then triu


def test_a_boolean_mask_is_the_fused_op_computing_every_score_after_an_inverted_copy(device):
    npu, work = device
    q, k, v = leaves((2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 8))
    mask = padding_mask(2, 5, 6)
    same_as_torch((q, k, v, mask), {})
    assert npu.calls == {"npu_fusion_attention": 1, "npu_fusion_attention_grad": 1}
    assert work.sparse_modes == {0: 1}
    assert work.computed == 2 * 4 * 5 * 6
    assert work.mask_copy_bytes == mask.numel()  # logical_not(mask), bool
    (record,) = work.records
    # op-plugin 26.1.0 on: inner_precise 2 (invalid-row mode) for a masked, non-causal Sq > 1 call.
    assert record.inner_precise == (2 if npu.PROFILE.name in MASTER_LEVEL else 0)


def test_a_float_mask_is_the_math_path_with_every_score(device):
    npu, work = device
    q, k, v = leaves((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8))
    mask = torch.randn(2, 1, 5, 5)
    same_as_torch((q, k, v, mask), {})
    assert npu.calls == {}
    assert work.calls == {"sdpa": 1, "math": 1}
    assert work.computed_by_path == {"math": 2 * 4 * 5 * 5}
    assert work.mask_copy_bytes == 0  # an additive mask is used as it is


def test_fp32_with_a_head_dim_not_a_multiple_of_4_is_math_from_master(device):
    npu, work = device
    q, k, v = leaves((1, 2, 4, 6), (1, 2, 4, 6), (1, 2, 4, 6))
    mask = padding_mask(1, 4, 4)
    same_as_torch((q, k, v, mask), {})
    if npu.PROFILE.name in MASTER_LEVEL:
        assert npu.calls == {} and work.calls == {"sdpa": 1, "math": 1}
        # convert_boolean_attn_mask_math: logical_not (bool), then the float mask of the query's dtype.
        assert work.mask_copy_bytes == mask.numel() * (1 + 4)
    else:
        assert npu.calls == {"npu_fusion_attention": 1, "npu_fusion_attention_grad": 1}
        assert work.mask_copy_bytes == mask.numel()


def test_gqa_reaches_the_fused_op_whatever_enable_gqa_says(device):
    """The fused branch needs only Nq % Nkv == 0: torch's own sdpa would refuse enable_gqa=False here."""
    _, work = device
    q, k, v = leaves((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8))
    same_as_torch((q, k, v), {"enable_gqa": False}, reference_args={"enable_gqa": True})
    assert work.calls == {"sdpa": 1, "npu_fusion_attention": 1}
    assert work.computed == 4 * 9


def test_enable_gqa_reaches_the_math_path_from_op_plugin_7_3(device):
    """A float mask with GQA: 7.1.0/7.2.0 drop enable_gqa on the way to the math path, which then refuses
    the head counts; later branches pass it on."""
    npu, work = device
    q, k, v = leaves((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8))
    mask = torch.randn(1, 1, 3, 3)
    if npu.PROFILE.sdpa.math_takes_enable_gqa:
        same_as_torch((q, k, v, mask), {"enable_gqa": True})
        assert work.calls == {"sdpa": 1, "math": 1}
    else:
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)


def test_a_three_dimensional_mask_is_math_before_26_1_and_expanded_from_it(device):
    npu, work = device
    q, k, v = leaves((2, 2, 4, 8), (2, 2, 4, 8), (2, 2, 4, 8))
    mask = padding_mask(1, 4, 4)[0]  # [1, Sq, Skv]
    same_as_torch((q, k, v, mask), {})
    if npu.PROFILE.sdpa.expands_masks:
        assert work.calls == {"sdpa": 1, "npu_fusion_attention": 1}
        assert work.mask_copy_bytes == 2 * 2 * 4 * 4  # the inverted copy of the expanded [B, N, Sq, Skv]
    else:
        assert work.calls == {"sdpa": 1, "math": 1}


def test_a_head_dim_above_512_is_math(device):
    npu, work = device
    q, k, v = leaves((1, 1, 2, 520), (1, 1, 2, 520), (1, 1, 2, 520))
    same_as_torch((q, k, v), {"is_causal": True})
    assert work.calls == {"sdpa": 1, "math": 1} and npu.calls == {}


def test_checks_refuse_what_op_plugin_refuses(device):
    q = torch.randn(1, 1, 2, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(RuntimeError, match="attn_mask dtype to be bool or to match"):
        F.scaled_dot_product_attention(q, q, q, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="attn_mask should be none when is_causal"):
        F.scaled_dot_product_attention(q, q, q, torch.ones(2, 2, dtype=torch.bool), is_causal=True)


def test_leaving_the_stand_in_restores_torch_sdpa_exactly():
    with stand_in(profile="a2-2.7.1"):
        outer = F.scaled_dot_product_attention
        with stand_in():
            assert F.scaled_dot_product_attention not in (outer, TORCH_SDPA)
        assert F.scaled_dot_product_attention is outer
        with stand_in(available=False):  # no device: nothing routes sdpa
            assert F.scaled_dot_product_attention is outer
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_autocast_casts_the_inputs_as_torch_npu_lists_the_op(device):
    """AutoCastOps.cpp lists sdpa as lower_precision_fp: fp32 q/k with a bf16 v run in bf16."""
    _, work = device
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = TORCH_SDPA(q.bfloat16(), k.bfloat16(), v, is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
    assert work.calls == {"sdpa": 1, "npu_fusion_attention": 1}


def test_a_padded_batch_on_transformers_default_attention_computes_every_score():
    """A tiny qwen3 with transformers' default attention (sdpa), right-padded batch (lengths 6 and 3): the
    fused op in sparse mode 0 on every layer, computing all of B x N x S x S where the minimum is each
    sequence's causal triangle. A fresh interpreter: transformers decides at import whether it runs on an NPU.
    """
    child = run_python(
        """
        import json
        import torch
        from npu_autopatch.testing import stand_in
        from npu_autopatch.testing.device import attention_work

        with stand_in() as npu:
            from npu_autopatch.testing.tiny import tiny_model

            model = tiny_model("qwen3")
            config = model.config
            ids = torch.randint(1, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
            mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
            with attention_work() as work:
                model(input_ids=ids, attention_mask=mask).logits.sum().backward()
            print("RESULT" + json.dumps({
                "implementation": config._attn_implementation,
                "layers": config.num_hidden_layers,
                "heads": config.num_attention_heads,
                "computed": work.computed,
                "calls": dict(work.calls),
                "sparse_modes": {str(k): v for k, v in work.sparse_modes.items()},
                "fused": dict(npu.calls),
            }))
        """
    )
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.split("RESULT", 1)[1])
    layers, heads = result["layers"], result["heads"]
    assert result["implementation"] == "sdpa"
    assert result["calls"] == {"sdpa": layers, "npu_fusion_attention": layers}
    assert result["sparse_modes"] == {"0": layers}
    assert result["fused"] == {"npu_fusion_attention": layers, "npu_fusion_attention_grad": layers}
    minimum = layers * heads * ((6 * 7) // 2 + (3 * 4) // 2)  # each sequence's causal triangle
    assert result["computed"] == layers * 2 * heads * 6 * 6 > minimum


# ------------------------------------------------------------------------------------------------------
# transformers 5.x's pack_gqa: a 1-token query with a mask is packed to q [B, Nkv, n_rep, D] and passed the
# mask [B, 1, 1, Skv] (integrations/sdpa_attention.py pack_gqa). The CANN tiling refuses that mask shape for
# Sq = n_rep > 1; op-plugin expands it from 26.1.0 (docs/device-rules.md).
# ------------------------------------------------------------------------------------------------------


def packed_decode():
    """B=2, Nkv=2, n_rep=3, Skv=5: the shapes pack_gqa hands sdpa, and the batch's padding mask."""
    q, k, v = leaves((2, 2, 3, 8), (2, 2, 5, 8), (2, 2, 5, 8))
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., :2] = False  # the second sequence is left-padded by two
    return q, k, v, mask


def test_the_packed_decode_mask_is_refused_before_26_1_and_expanded_from_it(device):
    npu, work = device
    q, k, v, mask = packed_decode()
    if npu.PROFILE.sdpa.expands_masks:
        same_as_torch((q, k, v, mask), {})
        assert work.sparse_modes == {0: 1}
        assert work.mask_copy_bytes == 2 * 2 * 3 * 5  # the expanded [B, Nkv, n_rep, Skv], inverted
        assert [r.inner_precise for r in work.records] == [2]  # Sq = n_rep > 1, masked
    else:
        with pytest.raises(RuntimeError, match="get unsupported atten_mask shape"):
            F.scaled_dot_product_attention(q, k, v, mask)


@pytest.mark.parametrize(("branch", "accepted"), [("26.0.0", False), ("26.1.0", True)])
def test_the_release_lines_no_profile_models_follow_their_branch(branch, accepted):
    profile = dataclasses.replace(PROFILES["a2-newest"], sdpa=SDPA_RULES[branch])
    q, k, v, mask = packed_decode()
    with stand_in(profile=profile):
        if accepted:
            same_as_torch((q, k, v, mask), {})
        else:
            with pytest.raises(RuntimeError, match="get unsupported atten_mask shape"):
                F.scaled_dot_product_attention(q, k, v, mask)


GENERATE = """
import json
import torch
from npu_autopatch.testing import stand_in

with stand_in(profile={profile!r}) as npu:
    from npu_autopatch.testing.tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3", num_key_value_heads=2).eval()  # GQA: 4 query heads over 2
    eager = tiny_model("qwen3", num_key_value_heads=2, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(1, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])  # left-padded, as generate() wants
    settings = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    expected = eager.generate(ids, **settings).tolist()
    try:
        result = {{"tokens": model.generate(ids, **settings).tolist(), "expected": expected}}
    except RuntimeError as error:
        result = {{"error": str(error)}}
    result["implementation"] = model.config._attn_implementation
    print("RESULT" + json.dumps(result))
"""


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="4.x repeats k/v (no pack_gqa)")
@pytest.mark.parametrize("profile", ["a2-newest", "a2-2.7.1"])
def test_transformers_5_generate_with_padding_on_default_attention(profile):
    """The first decode step packs GQA with the padding mask: refused on the 2.7.1 line (op-plugin 7.2.0
    passes the mask on, the CANN tiling refuses it), the same tokens as eager from op-plugin 26.1.0."""
    child = run_python(GENERATE.format(profile=profile))
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.split("RESULT", 1)[1])
    assert result["implementation"] == "sdpa"
    if profile == "a2-2.7.1":
        assert "get unsupported atten_mask shape" in result["error"], result
        assert "(2, 1, 1, 6)" in result["error"], result  # [B, 1, 1, Skv] at the first decode step
    else:
        assert result["tokens"] == result["expected"]
