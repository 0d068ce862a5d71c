"""Gated MLPs: SiLU on ``npu_swiglu``, GELU (Gemma's) on ``npu_geglu``.

npu_swiglu(x) = silu(first half of x) * second half, fp32 inside. Two layouts of the same math:

- separate projections: down_proj(act_fn(gate_proj(x)) * up_proj(x)). When gate_proj and up_proj are
  plain ``nn.Linear`` (no hook, no LoRA or quantised layer; under autocast, in its dtype as F.linear
  would be), their two matmuls write the
  halves of one [2, T, I] buffer (``_GateUp``: gate first) and npu_swiglu takes it along dim 0, so
  nothing is concatenated; otherwise the modules are called and their outputs concatenated, gate
  first, into [T, 2I] (a copy). npu_swiglu takes any dim in [-x.dim(), x.dim() - 1] (op-plugin docs,
  torch_npu-npu_swiglu.md; aclnnSwiGlu's dimOptional), npu_geglu any dim in range
  (GeGluKernelNpuOpApi.cpp; aclnnGeGluV3). The Linears may carry a bias (the Qwen2.5-VL vision MLP).
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


class _GateUp(torch.autograd.Function):
    """[2, T, I]: x @ gate^T (+ its bias) and x @ up^T (+ its bias), each matmul writing its own half of one
    buffer, which the fused activation reads along dim 0: no [T, 2I] concatenation (a copy of both
    projections' outputs). The backward: dx with one matmul and one addmm, each weight's gradient in the
    weight's own [I, H] layout, each bias's as a row sum."""

    @staticmethod
    def forward(ctx, x, gate_weight, gate_bias, up_weight, up_bias):
        tokens = x.reshape(-1, x.shape[-1])
        out = tokens.new_empty((2, tokens.shape[0], gate_weight.shape[0]))
        for half, (weight, bias) in enumerate(((gate_weight, gate_bias), (up_weight, up_bias))):
            if bias is None:
                torch.mm(tokens, weight.t(), out=out[half])
            else:
                torch.addmm(bias, tokens, weight.t(), out=out[half])
        ctx.save_for_backward(tokens, gate_weight, up_weight)
        ctx.input_shape = x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        tokens, gate_weight, up_weight = ctx.saved_tensors
        dgate, dup = grad.contiguous()
        needs = ctx.needs_input_grad
        dx = torch.addmm(dgate @ gate_weight, dup, up_weight).view(ctx.input_shape) if needs[0] else None
        return (
            dx,
            dgate.t() @ tokens if needs[1] else None,
            dgate.sum(0) if needs[2] else None,
            dup.t() @ tokens if needs[3] else None,
            dup.sum(0) if needs[4] else None,
        )


# The dtypes autocast casts to its own for F.linear (float64 it leaves as it is).
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _plain_projections(x, projections, plain_types):
    """The dtype F.linear would compute gate and up in, if they are plain ``nn.Linear`` on plain tensors
    with no hook of their own and no forward of their own (accelerate's offload wraps the instance's
    ``forward``): then ``_GateUp`` computes exactly what calling them would. Under autocast that is its
    dtype (F.linear is on its lower-precision list: inputs, weights and biases cast to it); otherwise the
    tensors must share x's dtype. None for anything else (a LoRA or quantised layer, a hooked module,
    DTensor weights, mixed dtypes): the modules are called. (Global module hooks, a tracker's, see the
    MLP's call and not its gate and up Linears'.)

    The check runs on every call, so it reads the modules' own dictionaries (no ``nn.Module.__getattr__``)
    and ``plain_types`` comes from the builder (``_plain_types``): 2.7 us for two projections where a
    generator-and-getattr form took 9 us (benchmarks/call_overhead.py).
    """
    device = x.device.type
    try:
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    casts = _AUTOCAST_CASTS if autocast else ()
    if type(x) not in plain_types or (x.dtype != dtype and x.dtype not in casts):
        return None
    for module in projections:
        state = module.__dict__
        if type(module) is not torch.nn.Linear or "forward" in state:
            return None
        for hooks in _MODULE_HOOKS:
            if state.get(hooks):
                return None
        parameters = state["_parameters"]
        for tensor in (parameters["weight"], parameters.get("bias")):
            if tensor is not None and (
                type(tensor) not in plain_types or (tensor.dtype != dtype and tensor.dtype not in casts)
            ):
                return None
    return dtype


def _plain_types():
    """Tensor types whose matmuls are F.linear's: plain tensors and parameters, and the fake and functional
    tensors torch.compile traces with; not a subclass computing otherwise (DTensor, a quantised weight)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (torch.Tensor, torch.nn.Parameter, FakeTensor, FunctionalTensor)


def _gate_up(self, x, plain_types):
    """gate and up of a separate-projections MLP as one [2, T, I] buffer (dim 0 the halves), when they are
    plain Linears; else None (the caller concatenates the modules' outputs)."""
    gate, up = self.gate_proj, self.up_proj
    dtype = _plain_projections(x, (gate, up), plain_types)
    if dtype is None:
        return None
    gate, up = gate.__dict__["_parameters"], up.__dict__["_parameters"]  # checked plain Linears
    if gate["weight"].shape != up["weight"].shape:
        return None
    tensors = [x, gate["weight"], gate.get("bias"), up["weight"], up.get("bias")]
    for index, tensor in enumerate(tensors):
        if tensor is not None and tensor.dtype != dtype:
            tensors[index] = tensor.to(dtype)
    return _GateUp.apply(*tensors)


def _build_separate(stock, npu, on_error):
    silu_types = _silu_types()
    plain_types = _plain_types()
    cat = torch.cat
    count_fused, count_stock = counters(on_error)

    def forward(self, x):
        if type(self.act_fn) not in silu_types or not x.numel():
            count_stock(lambda: _stock_rule(self.act_fn, silu_types), x)
            return stock(self, x)
        halves = _gate_up(self, x, plain_types)
        try:
            if halves is None:
                hidden = npu.npu_swiglu(cat((self.gate_proj(x), self.up_proj(x)), dim=-1), dim=-1)
            else:
                hidden = npu.npu_swiglu(halves, dim=0).view(*x.shape[:-1], halves.shape[-1])
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
    plain_types = _plain_types()
    count_fused, count_stock = counters(on_error)

    def forward(self, x):
        mode = gelu_mode(self.act_fn, modes)
        if mode is None:
            count_stock(lambda: f"activation {type(self.act_fn).__name__}", x)
            return stock(self, x)
        halves = _gate_up(self, x, plain_types)
        approximate = _GEGLU_APPROXIMATE[mode]
        try:
            if halves is None:
                joined = cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
                hidden, _gelu = npu.npu_geglu(joined, dim=-1, approximate=approximate, activate_left=True)
            else:
                hidden, _gelu = npu.npu_geglu(halves, dim=0, approximate=approximate, activate_left=True)
                hidden = hidden.view(*x.shape[:-1], halves.shape[-1])
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
