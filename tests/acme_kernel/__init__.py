"""A kernel written as a plugin writes one, from files of its own: tests/test_new_kernel.py adds it.

``rotary_table``: the cos/sin table of a rotary embedding module (``LlamaRotaryEmbedding.forward``
and its copies) through one op, ``npu_acme_cos_sin`` (a new op: the test puts it on the stand-in).
It declares all of itself in ``ROTARY_TABLE``: its op and that op's CPU reference (for the probe), a
variant and its probe, its candidate pattern for discovery, what report(model) shows of it (a table
of its own and a flag), an opt-in switch (``enable(rotary_table=True)``,
``NPU_AUTOPATCH_ROTARY_TABLE=1``) and an install of its own (the swap, and an entry in ``TABLES``).
"""

from .kernel import OP, ROTARY_TABLE, TABLES

__all__ = ["OP", "ROTARY_TABLE", "TABLES"]
