"""Routed experts on ``npu_grouped_matmul``.

Every variant runs one computation, ``_routed_experts``: sort the (token, expert) pairs by
expert with ``npu_moe_token_permute``, count the rows of each expert (``histc``, as
transformers' grouped_mm path does: no device-to-host sync), run gate_up and down as two
grouped matmuls with ``npu_swiglu`` between them (the FIRST half is gated, as in
``gate, up = chunk(2)``), then unsort and sum the top-k rows weighted by the routing
weights with ``npu_moe_token_unpermute``. Permute and unpermute have a real backward on the
device; ``npu_moe_init_routing_v2``/``npu_moe_finalize_routing`` have none and are not used.
The activation comes from the config, so every variant runs the stock code for an instance
whose experts' ``act_fn`` is not SiLU.

``npu_grouped_matmul`` has no autograd at all (its gradients silently vanish), so it runs
inside an autograd Function (``_grouped_matmul``) whose backward is grouped matmuls too:
dx = dy @ W[e]^T (group type 0) and dW (group type 2, which splits the contraction axis and
gives one block per expert), written in the parameter's own layout so that AccumulateGrad
takes it without a copy: for the HF [E, N, K] parameters, passed to the forward as transposed
views (M-split: x must not be transposed; aclnn_grouped_matmul.cpp), dW^T = dy^T x is one
K-split with the gradient transposed (x transposed, weight not: CheckCaseSplitK), handed back
as a transposed view. An expert with no rows gets a zero block: the A2/A3 kernel writes it on
CANN 8.5 and later (ops-transformer grouped_matmul.cpp, EmptyTensorCompute); elsewhere (older
CANN, the Ascend 950: unread) the backward zeroes those blocks itself, one small fill per empty
expert, found from the counts copied to pinned host memory in the forward (``_EmptyExperts``).
An all-empty x skips the kernel and leaves its output uninitialised
(aclnn_grouped_matmul.cpp CheckZeroShape): such a call runs stock (below).

npu_moe_token_unpermute takes every (tokens, probs) dtype pair and returns the tokens' dtype
(moe_token_unpermute_def.cpp), so the expert output goes in as it is, in the input dtype, and
the routing weights in theirs (fp32 for DeepSeek-V3/GLM-4-MoE): no upcast copy of the
[T*K, H] rows; the weighted sum is the kernel's.

A call with no tokens at all (a rank whose micro-batch is empty) runs the stock code: the
ops would get empty inputs, which npu_swiglu refuses and the grouped matmul skips. So does a
call of a layer with one expert, and a 4.x call that reaches a single expert: a group list of
counts must not have length 1 (op-plugin docs, torch_npu-npu_grouped_matmul.md). That check
is per call, so the kernel stays in place for the model's other layers and calls. When an op
still raises in the forward, the replacement reports it through ``on_error`` and returns the
stock result.

The kernel needs what op-plugin 7.2.0 brought: a backward for npu_moe_token_permute/unpermute
(derivatives.yaml) and group_type=2 in npu_grouped_matmul (GroupedMatmulKernelNpuOpApi.cpp);
``MOE.requires`` says so for older torch_npu (_requirements.py).

Variants (the probe picks the one whose stock math it reproduces):

- ``experts``: the 5.x fused ``*Experts.forward(hidden_states, top_k_index,
  top_k_weights)``, ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.
- ``experts-kn``: Qwen3-VL-MoE 4.57 ``Qwen3VLMoeTextExperts.forward(hidden_states,
  routing_weights [T, E] dense, router_indices)``, ``gate_up_proj [E, H, 2I]``,
  ``down_proj [E, I, H]`` (already gmm's layout); its training loop and its eval-mode dense
  bmm are the same math.
- ``sparse-block`` / ``sparse-block-shared``: the 4.x ``*SparseMoeBlock.forward`` with a
  ModuleList of experts (Qwen3-MoE; Qwen2-MoE and Qwen3-Next add a shared expert under a
  sigmoid gate). The router (softmax in fp32, top-k, optional renormalisation, cast to the
  input dtype) and the shared expert run as in stock, and the ``(hidden, router_logits)``
  return is kept.
- ``moe-method``: the 4.x ``DeepseekV3MoE.moe`` / ``Glm4MoeMoE.moe(hidden_states,
  topk_indices, topk_weights)`` over a ModuleList.

4.x ModuleList weights are stacked into one [E', 2I, H] and one [E', H, I] tensor per
forward, of the E' experts that have rows: a copy of their weights per call, from which
autograd hands each expert its slice of the gradient (in the weight's own strides: no copy),
while an expert without rows gets no gradient (None), as in the stock loop, so an optimizer
skips it there too. Finding them costs one host sync per layer, which the stock loop pays as
well. The op's list form would avoid the copy but takes at most 128 weights (DeepSeek-V3 has
256 routed experts, Qwen3-Next 512), and a cached stack would go stale after an optimizer step.

The experts-implementation registry of 5.x: the class attribute ``forward`` of a fused
experts class is ``use_experts_implementation``'s wrapper, which looks up
``config._experts_implementation`` at every call. We leave it in place: the kernel's install
serves transformers' default experts implementation ("grouped_mm" in ``ALL_EXPERTS_FUNCTIONS``,
see _experts_registry.py) with ``_build_experts``'s function for the patched classes, so
``set_experts_implementation`` keeps working, an explicit choice wins, and the config keeps
transformers' own value. ``stock`` is then what "grouped_mm" ran before us, never the
dispatcher (no recursion). Where this
kernel does not apply (per instance: a non-SiLU ``act_fn``, or decorator flags other than
gated, concatenated, untransposed, bias-free, no post-expert norm, no expert parallelism),
``stock`` runs. The probe runs the wrapper with the "eager" implementation, i.e. the
class's own expert loop; the parity tests run the kernel.
"""

import types

import torch

from ..._types import Kernel, Pattern, Report, Variant
from .._calls import counters
from .._probe import (
    agree_strict,
    first_disagreement,
    generator,
    instance,
    linear,
    randn,
    signature_reason,
)
from .._requirements import moe_requirement
from ..mlp import _silu_types
from . import _experts_registry
from ._compute import _counts, _hit, _route, _routed_experts, _stacked

# --- builds ---------------------------------------------------------------------------

# The decorator flags of a 5.x experts class under which this kernel's math is not the class's.
_EXPERTS_FLAGS = (
    ("has_gate", True, "no gate"),
    ("is_concatenated", True, "gate and up not concatenated"),
    ("is_transposed", False, "transposed weights"),
    ("has_bias", False, "biases"),
    ("has_post_expert_norm", False, "post-expert norm"),
    ("_is_expert_parallel", False, "expert-parallel"),
)


def _why_stock_experts(experts, tokens, silu_types):
    """The rule that sent a fused-experts call to the stock code (for its count in status())."""
    if type(experts.act_fn) not in silu_types:
        return f"activation {type(experts.act_fn).__name__}"
    for flag, kernel_takes, why in _EXPERTS_FLAGS:
        if bool(getattr(experts, flag, kernel_takes)) != kernel_takes:
            return why
    return "no tokens" if not tokens else "one expert"


def _why_stock_experts_list(activation, tokens, silu_types, hit=()):
    """The same for a ModuleList of experts: its activation, no tokens, fewer than two experts hit,
    or a hit expert that is not a gated MLP."""
    if type(activation) not in silu_types:
        return f"activation {type(activation).__name__}"
    if not tokens:
        return "no tokens"
    return "one expert hit" if len(hit) < 2 else "an expert not a gated MLP"


def _build_experts(stock, npu, on_error):
    silu_types = _silu_types()
    routed_experts = _routed_experts(npu)
    count_fused, count_stock = counters(on_error)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if (
            type(self.act_fn) not in silu_types
            or not getattr(self, "has_gate", True)
            or not getattr(self, "is_concatenated", True)
            or getattr(self, "is_transposed", False)
            or getattr(self, "has_bias", False)
            or getattr(self, "has_post_expert_norm", False)
            or getattr(self, "_is_expert_parallel", False)
            or not hidden_states.shape[0]
            or self.gate_up_proj.shape[0] < 2  # a group list of counts must not have length 1
        ):
            count_stock(lambda: _why_stock_experts(self, hidden_states.shape[0], silu_types), hidden_states)
            return stock(self, hidden_states, top_k_index, top_k_weights)
        gate_up, down = self.gate_up_proj, self.down_proj
        try:
            out = routed_experts(
                hidden_states,
                top_k_index,
                top_k_weights,
                gate_up.transpose(1, 2),
                down.transpose(1, 2),
                _counts(top_k_index, gate_up.shape[0]),
            )
        except Exception as exc:
            on_error(exc, hidden_states, top_k_index, top_k_weights)
            return stock(self, hidden_states, top_k_index, top_k_weights)
        count_fused()
        return out

    return forward


def _build_experts_kn(stock, npu, on_error):
    silu_types = _silu_types()
    routed_experts = _routed_experts(npu)
    count_fused, count_stock = counters(on_error)

    def forward(self, hidden_states, routing_weights, router_indices):
        if (
            type(self.act_fn) not in silu_types
            or not hidden_states.numel()
            or self.gate_up_proj.shape[0] < 2  # a group list of counts must not have length 1
        ):
            count_stock(lambda: _why_stock_experts(self, hidden_states.numel(), silu_types), hidden_states)
            return stock(self, hidden_states, routing_weights, router_indices)
        batch_size, hidden_size = hidden_states.shape[0], self.hidden_size
        tokens = hidden_states.reshape(-1, hidden_size)
        top_k_weights = routing_weights.gather(1, router_indices)
        gate_up, down = self.gate_up_proj, self.down_proj
        try:
            counts = _counts(router_indices, gate_up.shape[0])
            out = routed_experts(tokens, router_indices, top_k_weights, gate_up, down, counts)
        except Exception as exc:
            on_error(exc, hidden_states, routing_weights, router_indices)
            return stock(self, hidden_states, routing_weights, router_indices)
        count_fused()
        return out.view(batch_size, -1, hidden_size)

    return forward


def _build_sparse_block(shared):
    def build(stock, npu, on_error):
        silu_types = _silu_types()
        routed_experts = _routed_experts(npu, every_expert_has_rows=True)
        sigmoid = torch.sigmoid
        count_fused, count_stock = counters(on_error)

        def forward(self, hidden_states):
            experts = self.experts
            if type(getattr(experts[0], "act_fn", None)) not in silu_types or not hidden_states.numel():
                activation, tokens = getattr(experts[0], "act_fn", None), hidden_states.numel()
                count_stock(lambda: _why_stock_experts_list(activation, tokens, silu_types), hidden_states)
                return stock(self, hidden_states)
            batch_size, sequence_length, hidden_dim = hidden_states.shape
            tokens = hidden_states.view(-1, hidden_dim)
            router_logits = self.gate(tokens)
            routing_weights, selected_experts = _route(router_logits, self.top_k, self.norm_topk_prob)
            routing_weights = routing_weights.to(tokens.dtype)
            hit, counts = _hit(experts, selected_experts)
            stacked = _stacked(experts, hit, counts) if len(hit) > 1 else None
            if stacked is None:  # a group list of counts must not have length 1; a non-MLP expert
                activation = getattr(experts[0], "act_fn", None)
                count_stock(lambda: _why_stock_experts_list(activation, 1, silu_types, hit), hidden_states)
                return stock(self, hidden_states)
            try:
                out = routed_experts(tokens, selected_experts, routing_weights, *stacked)
            except Exception as exc:
                on_error(exc, hidden_states)
                return stock(self, hidden_states)
            count_fused()
            if shared:
                gate = sigmoid(self.shared_expert_gate(tokens))
                out = out + gate * self.shared_expert(tokens)
            return out.view(batch_size, sequence_length, hidden_dim), router_logits

        return forward

    return build


def _build_moe_method(stock, npu, on_error):
    silu_types = _silu_types()
    routed_experts = _routed_experts(npu, every_expert_has_rows=True)
    count_fused, count_stock = counters(on_error)

    def moe(self, hidden_states, topk_indices, topk_weights):
        experts = self.experts
        if type(getattr(experts[0], "act_fn", None)) not in silu_types or not hidden_states.shape[0]:
            activation, tokens = getattr(experts[0], "act_fn", None), hidden_states.shape[0]
            count_stock(lambda: _why_stock_experts_list(activation, tokens, silu_types), hidden_states)
            return stock(self, hidden_states, topk_indices, topk_weights)
        hit, counts = _hit(experts, topk_indices)
        stacked = _stacked(experts, hit, counts) if len(hit) > 1 else None
        if stacked is None:  # a group list of counts must not have length 1; a non-MLP expert
            activation = getattr(experts[0], "act_fn", None)
            count_stock(lambda: _why_stock_experts_list(activation, 1, silu_types, hit), hidden_states)
            return stock(self, hidden_states, topk_indices, topk_weights)
        try:
            out = routed_experts(hidden_states, topk_indices, topk_weights, *stacked)
        except Exception as exc:
            on_error(exc, hidden_states, topk_indices, topk_weights)
            return stock(self, hidden_states, topk_indices, topk_weights)
        count_fused()
        return out

    return moe


def _build_router(renormalise_always, cast):
    """A 5.x ``*TopKRouter.forward`` (softmax routing): ``_route`` on its logits. Qwen's renormalises when
    ``norm_topk_prob`` and casts the weights to the logits' dtype; Mixtral's always renormalises and keeps
    them in fp32."""

    def build(stock, npu, on_error):
        count_fused, _count_stock = counters(on_error)
        linear_ = torch.nn.functional.linear

        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            router_logits = linear_(hidden_states, self.weight)
            renormalise = renormalise_always or self.norm_topk_prob
            router_scores, router_indices = _route(router_logits, self.top_k, renormalise)
            if cast:
                router_scores = router_scores.to(router_logits.dtype)
            count_fused()
            return router_logits, router_scores, router_indices

        return forward

    return build


# --- probes: the stock code on tiny fake modules, E=4 experts, top-2, H=16, I=8 --------

_E, _K, _H, _I, _T = 4, 2, 16, 8, 6


class _GatedMLP(torch.nn.Module):
    """A 4.x per-expert (or shared-expert) module: down(act(gate(x)) * up(x))."""

    def __init__(self, gen, hidden, intermediate):
        super().__init__()
        self.gate_proj = linear(gen, hidden, intermediate)
        self.up_proj = linear(gen, hidden, intermediate)
        self.down_proj = linear(gen, intermediate, hidden)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _routing(gen):
    """Distinct top-K experts per token, never the last one (an expert with no rows), and weights."""
    index = torch.argsort(randn(gen, _T, _E - 1), dim=-1)[:, :_K]
    return index, torch.softmax(randn(gen, _T, _K), dim=-1)


def _param(gen, *shape):
    return torch.nn.Parameter(randn(gen, *shape) / shape[-1] ** 0.5)


def _module(stock, **attributes):
    """An instance of the stock method's class (5.x: the class of the function the experts
    decorator wraps), carrying exactly ``attributes``; see ``_probe.instance``."""
    return instance(getattr(stock, "__wrapped__", stock), **attributes)


def _probe_experts(stock, candidate):
    wrong = signature_reason(stock, ("self", "hidden_states", "top_k_index", "top_k_weights"))
    if wrong:
        return wrong
    gen = generator()
    experts = _module(
        stock,
        num_experts=_E,
        hidden_dim=_H,
        intermediate_dim=_I,
        gate_up_proj=_param(gen, _E, 2 * _I, _H),
        down_proj=_param(gen, _E, _H, _I),
        act_fn=torch.nn.SiLU(),
        # What use_experts_implementation sets; "eager" dispatches to the class's own loop.
        config=types.SimpleNamespace(_experts_implementation="eager"),
        has_gate=True,
        has_bias=False,
        is_transposed=False,
        is_concatenated=True,
        has_post_expert_norm=False,
        _is_expert_parallel=False,
    )
    x = randn(gen, _T, _H)
    index, weights = _routing(gen)
    return agree_strict(
        lambda: stock(experts, x, index, weights), lambda: candidate(experts, x, index, weights)
    )


def _probe_experts_kn(stock, candidate):
    wrong = signature_reason(stock, ("self", "hidden_states", "routing_weights", "router_indices"))
    if wrong:
        return wrong
    gen = generator()
    experts = _module(
        stock,
        num_experts=_E,
        hidden_size=_H,
        intermediate_size=_I,
        expert_dim=_I,
        gate_up_proj=_param(gen, _E, _H, 2 * _I),
        down_proj=_param(gen, _E, _I, _H),
        act_fn=torch.nn.SiLU(),
    )
    x = randn(gen, 2, _T // 2, _H)
    index, weights = _routing(gen)
    dense = torch.zeros(_T, _E).scatter(1, index, weights)
    reasons = []
    for training in (True, False):  # the training loop and the eval-mode dense bmm
        experts.train(training)
        reasons.append(
            agree_strict(lambda: stock(experts, x, dense, index), lambda: candidate(experts, x, dense, index))
        )
    return first_disagreement(*reasons)


def _probe_sparse_block(shared):
    def probe(stock, candidate):
        wrong = signature_reason(stock, ("self", "hidden_states"))
        if wrong:
            return wrong
        gen = generator()
        block = _module(
            stock,
            num_experts=_E,
            top_k=_K,
            gate=linear(gen, _H, _E),
            experts=torch.nn.ModuleList([_GatedMLP(gen, _H, _I) for _ in range(_E)]),
        )
        if shared:
            block.shared_expert = _GatedMLP(gen, _H, 2 * _I)
            block.shared_expert_gate = linear(gen, _H, 1)
        x = randn(gen, 2, _T // 2, _H)
        reasons = []
        for norm_topk_prob in (True, False):
            block.norm_topk_prob = norm_topk_prob
            reasons.append(agree_strict(lambda: stock(block, x), lambda: candidate(block, x)))
        return first_disagreement(*reasons)

    return probe


def _probe_moe_method(stock, candidate):
    wrong = signature_reason(stock, ("self", "hidden_states", "topk_indices", "topk_weights"))
    if wrong:
        return wrong
    gen = generator()
    moe = _module(stock, experts=torch.nn.ModuleList([_GatedMLP(gen, _H, _I) for _ in range(_E)]))
    x = randn(gen, _T, _H)
    index, weights = _routing(gen)
    # A zero-computation expert (4.57 LongCat-Flash: nn.Identity after the routed ones) that
    # tokens reach: that call must come back from the stock loop, not raise.
    zero = _module(stock, experts=torch.nn.ModuleList([*moe.experts, torch.nn.Identity()]))
    to_zero = index.clone()
    to_zero[0, 0] = _E
    return first_disagreement(
        agree_strict(lambda: stock(moe, x, index, weights), lambda: candidate(moe, x, index, weights)),
        agree_strict(lambda: stock(zero, x, to_zero, weights), lambda: candidate(zero, x, to_zero, weights)),
    )


def _probe_router(stock, candidate):
    wrong = signature_reason(stock, ("self", "hidden_states"))
    if wrong:
        return wrong
    gen = generator()
    router = _module(stock, top_k=_K, num_experts=_E, hidden_dim=_H, weight=_param(gen, _E, _H))
    x = randn(gen, _T, _H) * 4  # logits spread enough that no two are within rounding of each other
    reasons = []
    for norm_topk_prob in (True, False):
        router.norm_topk_prob = norm_topk_prob
        for dtype in (torch.float32, torch.bfloat16):  # the weights' dtype after the router: cast or fp32
            router.to(dtype)
            inputs = x.to(dtype)
            reasons.append(
                agree_strict(lambda x=inputs: stock(router, x), lambda x=inputs: candidate(router, x))
            )
    return first_disagreement(*reasons)


MOE = Kernel(
    _experts_registry.KERNEL,
    ("npu_grouped_matmul", "npu_swiglu", "npu_moe_token_permute", "npu_moe_token_unpermute"),
    (
        Variant("experts", _build_experts, _probe_experts),
        Variant("experts-kn", _build_experts_kn, _probe_experts_kn),
        Variant("sparse-block", _build_sparse_block(shared=False), _probe_sparse_block(shared=False)),
        Variant("sparse-block-shared", _build_sparse_block(shared=True), _probe_sparse_block(shared=True)),
        Variant("moe-method", _build_moe_method, _probe_moe_method),
        Variant("router", _build_router(renormalise_always=False, cast=True), _probe_router),
        Variant("router-fp32", _build_router(renormalise_always=True, cast=False), _probe_router),
    ),
    requires=moe_requirement,
    # 5.x's fused experts: an experts implementation in transformers' registry, not a replaced forward
    install=_experts_registry.install,
    report=Report(
        origin=_experts_registry.origin,
        stock_reason=_experts_registry.stock_reason,
        delegates=_experts_registry.delegates,
    ),
    # An MoE block's forward, and 4.x DeepSeek-V3's ``moe`` method where it has one.
    candidates=(
        Pattern(
            "moe",
            classes=r"(Experts|SparseMoeBlock|SparseMoE|MoE|Moe|MoEBlock|MoeBlock)$",
            methods=("forward", "moe"),
        ),
    ),
)
