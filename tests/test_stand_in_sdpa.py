"""What the device computes for attention, on the stand-in: the work accounting and torch_npu's own sdpa.

The accounting (``attention_work()``, testing/device/work.py) counts the score elements every forward
``npu_fusion_attention`` call computes: by sparse mode, pre/next tokens and layout. The figures here are
hand-counted on small grids (a 4x4 causal triangle is 4+3+2+1 = 10 elements), not derived from the
stand-in's helpers.
"""

from __future__ import annotations

import threading

import pytest
import torch

from npu_autopatch.testing import make_torch_npu
from npu_autopatch.testing.device import attention_work, computed_elements

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
