"""Gated MLPs: SiLU on ``npu_swiglu``, GELU (Gemma's) on ``npu_geglu``.

npu_swiglu(x) = silu(first half of x) * second half, fp32 inside. Two layouts of the same math:

- separate projections: down_proj(act_fn(gate_proj(x)) * up_proj(x)); gate goes first in the
  concatenation. The Linears may carry a bias (the Qwen2.5-VL vision MLP): it is inside them.
- one fused projection (GLM-4 ``Glm4MLP``): gate, up = gate_up_proj(x).chunk(2);
  down_proj(up * activation_fn(gate)). The projection output already is [gate, up], so it goes
  to npu_swiglu as it is, with no concatenation.

The activation is chosen per instance by the config, so an instance whose activation is not
SiLU runs the stock code; so does an empty input, which npu_swiglu refuses (op-plugin docs,
torch_npu-npu_swiglu.md), e.g. a rank whose micro-batch has no tokens.
"""

import torch

from .._types import Kernel, Pattern, Report, Variant
from ._calls import counters
from ._probe import agree_strict, generator, instance, linear, randn, with_stock_names
from ._requirements import geglu_requirement, swiglu_requirement
from .activations import gelu_mode, gelu_modes


def _silu_types():
    types_ = {torch.nn.SiLU}
    try:
        from transformers.activations import SiLUActivation

        types_.add(SiLUActivation)
    except ImportError:  # transformers 4.x maps "silu" to torch.nn.SiLU
        pass
    return frozenset(types_)


def _activation_stock(instance):
    """For report(): why an MLP instance runs the stock code (its activation is not SiLU), else None."""
    act = getattr(instance, "act_fn", None) or getattr(instance, "activation_fn", None)
    if act is None or type(act) in _silu_types():
        return None
    return f"its activation is {type(act).__name__}, not SiLU"


def _stock_rule(activation, silu_types):
    """Why a call ran stock: the instance's activation, else its empty input."""
    return "empty input" if type(activation) in silu_types else f"activation {type(activation).__name__}"


def _build_separate(stock, npu, on_error):
    silu_types = _silu_types()
    cat = torch.cat
    count_fused, count_stock = counters(on_error)

    def forward(self, x):
        if type(self.act_fn) not in silu_types or not x.numel():
            count_stock(lambda: _stock_rule(self.act_fn, silu_types), x)
            return stock(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        try:
            hidden = npu.npu_swiglu(cat((gate, up), dim=-1), dim=-1)
        except Exception as exc:
            on_error(exc, x)
            return stock(self, x)
        count_fused()
        return self.down_proj(hidden)

    return with_stock_names(forward, stock)


def _probe_separate(stock, candidate):
    gen = generator()
    mlp = instance(
        stock,
        gate_proj=linear(gen, 16, 24, bias=True),
        up_proj=linear(gen, 16, 24, bias=True),
        down_proj=linear(gen, 24, 16, bias=True),
        act_fn=torch.nn.SiLU(),
    )
    x = randn(gen, 2, 3, 16)
    return agree_strict(lambda: stock(mlp, x), lambda: candidate(mlp, x))


def _build_fused(stock, npu, on_error):
    silu_types = _silu_types()
    count_fused, count_stock = counters(on_error)

    def forward(self, hidden_states):
        if type(self.activation_fn) not in silu_types or not hidden_states.numel():
            count_stock(lambda: _stock_rule(self.activation_fn, silu_types), hidden_states)
            return stock(self, hidden_states)
        gate_up = self.gate_up_proj(hidden_states)
        try:
            hidden = npu.npu_swiglu(gate_up, dim=-1)
        except Exception as exc:
            on_error(exc, hidden_states)
            return stock(self, hidden_states)
        count_fused()
        return self.down_proj(hidden)

    return with_stock_names(forward, stock)


def _probe_fused(stock, candidate):
    gen = generator()
    mlp = instance(
        stock,
        gate_up_proj=linear(gen, 16, 48),
        down_proj=linear(gen, 24, 16),
        activation_fn=torch.nn.SiLU(),
    )
    x = randn(gen, 2, 3, 16)
    return agree_strict(lambda: stock(mlp, x), lambda: candidate(mlp, x))


SWIGLU = Kernel(
    "swiglu",
    ("npu_swiglu",),
    (
        Variant("gate-up", _build_separate, _probe_separate),
        Variant("fused-gate-up", _build_fused, _probe_fused),
    ),
    requires=swiglu_requirement,
    report=Report(instance_stock=_activation_stock),
    # An experts or MoE block is the moe kernel's candidate, whatever else its name says.
    candidates=(
        Pattern(
            "mlp",
            classes=r"(MLP|Mlp|FeedForward|FFN|Ffn)",
            not_named=r"Experts|(SparseMoeBlock|SparseMoE|MoE|Moe|MoEBlock|MoeBlock)$",
        ),
    ),
)


# npu_geglu's ``approximate``: 1 = tanh, 0 = erf (aclnnGeGluV3, hicann/ops-nn ge_glu_v2 docs and golden).
_GEGLU_APPROXIMATE = {"tanh": 1, "none": 0}


def _gelu_stock(instance):
    """For report(): why a gated MLP instance runs the stock code (its activation is no GELU), else None."""
    act = getattr(instance, "act_fn", None)
    if act is None or gelu_mode(act) is not None:
        return None
    return f"its activation is {type(act).__name__}, not a GELU npu_geglu computes"


def _build_geglu(stock, npu, on_error):
    """down_proj(act_fn(gate_proj(x)) * up_proj(x)) as npu_geglu on [gate, up]: with activate_left=True the
    GELU takes the left half, the gate (default False would take the right one, the up projection)."""
    modes = gelu_modes()
    cat = torch.cat
    count_fused, count_stock = counters(on_error)

    def forward(self, x):
        mode = gelu_mode(self.act_fn, modes)
        if mode is None:
            count_stock(lambda: f"activation {type(self.act_fn).__name__}", x)
            return stock(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        try:
            hidden, _gelu = npu.npu_geglu(
                cat((gate, up), dim=-1), dim=-1, approximate=_GEGLU_APPROXIMATE[mode], activate_left=True
            )
        except Exception as exc:
            on_error(exc, x)
            return stock(self, x)
        count_fused()
        return self.down_proj(hidden)

    return with_stock_names(forward, stock)


def _probe_geglu(stock, candidate):
    gen = generator()
    mlp = instance(
        stock,
        gate_proj=linear(gen, 16, 24),
        up_proj=linear(gen, 16, 24),
        down_proj=linear(gen, 24, 16),
        act_fn=torch.nn.GELU(approximate="tanh"),
    )
    x = randn(gen, 2, 3, 16) * 3
    return agree_strict(lambda: stock(mlp, x), lambda: candidate(mlp, x))


GEGLU = Kernel(
    "geglu",
    ("npu_geglu",),
    (Variant("gelu-gate-up", _build_geglu, _probe_geglu),),
    requires=geglu_requirement,
    report=Report(instance_stock=_gelu_stock),
)
