"""A CPU stand-in for ``fla`` (flash-linear-attention) >= 0.5.2, the release line with a ``triton_ascend``
backend for the gated delta rule (``fla/ops/gated_delta_rule/backends/triton_ascend/``).

Only what transformers and the ``gated_delta_rule`` kernel call: ``fla.ops.gated_delta_rule``'s
``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule``, token by token in fp32 (the
reference math, not fla's kernels). Limits modelled from fla's public API (``fla/ops/gated_delta_rule/
chunk.py``): q, k, v of one dtype; value heads a multiple of key heads (GVA); ``cu_seqlens`` only with a
batch of one, then ``initial_state`` and the final state are one per sequence; ``head_first`` refused.
Not modelled (unknown here): dtype or head-dim limits of the Ascend kernels themselves.

``CALLS`` counts the calls per entry point, so that a test sees which path ran.
"""

from collections import Counter

__version__ = "0.5.2"

CALLS: Counter = Counter()
