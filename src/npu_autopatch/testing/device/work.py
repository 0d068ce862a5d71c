"""Work accounting: the attention score elements the device computes, so that tests and benchmarks can state
the work of a path against the minimum its mask needs.

What is counted, per forward call (the backward is not counted: the grad op computes the same blocks again,
so a ratio of forwards is the ratio of a training step):

- ``npu_fusion_attention`` (every caller: a kernel, HF's flash-attention integration, torch_npu's sdpa):
  the score elements its tiling computes, per batch and query head, from the sparse mode, pre/next tokens
  and layout (``computed_elements``). An explicit mask in sparse mode 0 with unbounded pre/next is computed
  whole: in hicann/ops-transformer ``attention/flash_attention_score/op_host/``
  ``flash_attention_score_tiling_general.cpp``, ``GetSparseInfo`` (lines 795-819 at c29bc10) returns with no
  sparsity for ``preTokens >= S1 && nextTokens >= S2``: every Sq x Skv block is computed whatever the mask
  holds. Without a mask no sparse mode applies
  (same function, ``attenMaskExistFlag != 1``): dense. Counted at element granularity: the device works in
  tiles whose sizes depend on the tiling template and are not sourced here (docs/device-rules.md), so the
  device's own figure is this one rounded up to whole tiles.
- torch_npu's sdpa (``sdpa.py``): its calls (path ``"sdpa"``), its math path (path ``"math"``, every
  score dense), and the masks it materialises: ``mask_copy_bytes`` for copies of the caller's mask
  (``logical_not`` before the fused op, the bool-to-float conversion before the math path),
  ``mask_built_bytes`` for the 2048x2048 causal mask it builds on every ``is_causal`` call.

Nothing is recorded while no tally is open: the op checks one list and goes on. A tally counts the calls of
every thread of the process. Under ``torch.compile`` the fused op is counted (its kernel runs at run time);
the sdpa-level figures are counted only where sdpa runs eagerly.

This module imports no torch (``testing.device`` is imported by every pytest run).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["AttentionCall", "AttentionWork", "attention_work", "computed_elements"]

UNBOUNDED = 2147483647  # pre_tockens/next_tockens default: INT32_MAX, no band
FUSED = "npu_fusion_attention"
MATH = "math"
SDPA = "sdpa"


@dataclass(frozen=True)
class AttentionCall:
    """One forward attention call as the device runs it."""

    path: str  # "npu_fusion_attention" or "math" (torch_npu's sdpa decomposed)
    layout: str  # the fused op's input_layout; "BNSD" on the math path
    sparse_mode: int | None  # None on the math path
    inner_precise: int | None  # None on the math path
    masked: bool  # an atten_mask was given (the fused op) or an attn_mask (the math path)
    computed: int  # score elements computed, all batches and query heads


@dataclass
class AttentionWork:
    """The figures of one ``attention_work()`` tally. Read them after (or during) the ``with`` block."""

    computed: int = 0  # forward score elements, every path
    computed_by_path: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)  # "npu_fusion_attention", "math", "sdpa"
    mask_copy_bytes: int = 0  # copies of a caller's mask made by torch_npu's sdpa
    mask_built_bytes: int = 0  # causal masks built by torch_npu's sdpa
    records: list[AttentionCall] = field(default_factory=list)

    @property
    def sparse_modes(self) -> Counter[int]:
        """How many fused calls ran in each sparse mode."""
        return Counter(r.sparse_mode for r in self.records if r.path == FUSED)


_lock = threading.Lock()
_tallies: list[AttentionWork] = []


def tallying() -> bool:
    """Whether any tally is open: the one check a call makes when none is."""
    return bool(_tallies)


def record_call(call: AttentionCall) -> None:
    """Add one attention call to every open tally."""
    with _lock:
        for work in _tallies:
            work.computed += call.computed
            work.computed_by_path[call.path] += call.computed
            work.calls[call.path] += 1
            work.records.append(call)


def record_sdpa(mask_copy_bytes: int, mask_built_bytes: int) -> None:
    """Add one call of torch_npu's sdpa and the mask memory it allocated to every open tally."""
    with _lock:
        for work in _tallies:
            work.calls[SDPA] += 1
            work.mask_copy_bytes += mask_copy_bytes
            work.mask_built_bytes += mask_built_bytes


@contextlib.contextmanager
def attention_work() -> Iterator[AttentionWork]:
    """Tally the attention work of the block: ``with attention_work() as work: ...; work.computed``.

    Tallies may nest or overlap; each counts what ran while it was open.
    """
    work = AttentionWork()
    with _lock:
        _tallies.append(work)
    try:
        yield work
    finally:
        with _lock:
            _tallies.remove(work)


def _band(q_len: int, kv_len: int, low: int, high: int) -> int:
    """The (i, j) with 0 <= i < q_len, 0 <= j < kv_len and low <= j - i <= high."""
    low, high = max(low, -q_len), min(high, kv_len)  # keeps the sums small with unbounded pre/next
    return sum(max(0, min(kv_len - 1, i + high) - max(0, i + low) + 1) for i in range(q_len))


def computed_elements(
    q_len: int,
    kv_len: int,
    *,
    masked: bool,
    sparse_mode: int = 0,
    pre_tokens: int = UNBOUNDED,
    next_tokens: int = UNBOUNDED,
) -> int:
    """Score elements ``npu_fusion_attention`` computes for one batch (one TND sequence) and one query head.

    Without a mask: all of them, whatever the mode. With one: mode 0 computes the band
    ``-pre <= j - i <= next`` (all of Sq x Skv when unbounded; a causal template when ``next == 0``),
    mode 1 all, mode 2 (leftUpCausal) ``j <= i``, mode 3 (rightDownCausal) ``j <= i + Skv - Sq``, mode 4
    (band) ``-pre <= j - i - (Skv - Sq) <= next``. The op doc's table for modes 2-4 (torch_npu_ops.md §6.1);
    mode 0 as flash_attention_score_tiling_general.cpp ``GetSparseInfo`` decides it.
    """
    if not masked or sparse_mode == 1:
        return q_len * kv_len
    delta = kv_len - q_len
    if sparse_mode == 0:
        return _band(q_len, kv_len, -pre_tokens, next_tokens)
    if sparse_mode == 2:
        return _band(q_len, kv_len, -q_len, 0)
    if sparse_mode == 3:
        return _band(q_len, kv_len, -q_len, delta)
    if sparse_mode == 4:
        return _band(q_len, kv_len, delta - pre_tokens, delta + next_tokens)
    raise NotImplementedError(f"torch_npu stand-in: work of sparse_mode {sparse_mode} is not modelled")
