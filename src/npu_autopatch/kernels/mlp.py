"""Gated SiLU MLP on ``npu_swiglu``.

down_proj(act_fn(gate_proj(x)) * up_proj(x)) with a SiLU act_fn. npu_swiglu gates the
FIRST half of its input, so gate goes first in the concatenation. The activation is chosen
per instance by the config, so an instance whose act_fn is not SiLU runs the stock code.
"""

import torch

from ._probe import agree, fake_module, generator, linear, randn
from .base import Kernel, Variant


def _silu_types():
    types_ = {torch.nn.SiLU}
    try:
        from transformers.activations import SiLUActivation

        types_.add(SiLUActivation)
    except ImportError:  # transformers 4.x maps "silu" to torch.nn.SiLU
        pass
    return frozenset(types_)


def _build_separate(stock, npu):
    silu_types = _silu_types()
    cat = torch.cat

    def forward(self, x):
        if type(self.act_fn) not in silu_types:
            return stock(self, x)
        return self.down_proj(npu.npu_swiglu(cat((self.gate_proj(x), self.up_proj(x)), dim=-1), dim=-1))

    return forward


def _probe_separate(stock, candidate):
    gen = generator()
    mlp = fake_module(
        gate_proj=linear(gen, 16, 24),
        up_proj=linear(gen, 16, 24),
        down_proj=linear(gen, 24, 16),
        act_fn=torch.nn.SiLU(),
    )
    x = randn(gen, 2, 3, 16)
    return agree(lambda: stock(mlp, x), lambda: candidate(mlp, x))


SWIGLU = Kernel("swiglu", ("npu_swiglu",), (Variant("gate-up", _build_separate, _probe_separate),))
