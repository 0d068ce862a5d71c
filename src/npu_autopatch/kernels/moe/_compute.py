"""The routed experts' computation on the torch_npu ops, shared by every moe variant.

Routing (``_route``: softmax routing on the chosen logits), the rows of each expert (``_counts``), the
chain permute -> grouped matmul -> npu_swiglu -> grouped matmul -> unpermute (``_routed_experts``), the
grouped matmul's autograd Function with dW in the weight's own layout (``_grouped_matmul``), what the
device does with an expert without rows (``_k_split_zeroes_empty_groups``, ``_EmptyExperts``), and
4.x's stacked ModuleList weights (``_hit``, ``_stacked``). The variants, their probes and the kernel's
declaration are in ``__init__``; why each step is so, in its docstring.
"""

import re

import torch

from .._requirements import device_family

# ops-transformer gmm/grouped_matmul/op_kernel/grouped_matmul.cpp: on the A2/A3 path (``__CCE_AICORE__ ==
# 220``) the K-split's kernel (tiling key 1, "x transposed") runs ``EmptyTensorCompute``
# (grouped_matmul_vector.h), which writes zeros into the output block of a group with no rows. The
# repository starts with the CANN 8.5 line (2025-09); whether older CANN does the same is not known,
# nor whether the Ascend 950's path (op_kernel/arch35) does. The SoC names torch_npu reports for A2/A3.
_ZEROING_CANN = (8, 5)
_ZEROING_FAMILIES = ("Ascend910B", "Ascend910_93")
_CANN_VERSION = re.compile(r"(\d+)\.(\d+)")


def _k_split_zeroes_empty_groups(npu):
    """Whether this device's K-split writes zeros for an expert without rows (then dW needs no fill).

    Read from the SoC name and ``torch_npu.npu.utils.get_cann_version("CANN")`` (op-plugin docs,
    torch_npu-npu-utils-get_cann_version.md: "" before CANN 8.1.RC1); anything unreadable counts as
    no, and the kernel zeroes those blocks itself.
    """
    family = device_family(npu) or ""
    try:
        found = _CANN_VERSION.match(npu.npu.utils.get_cann_version(module="CANN") or "")
    except Exception:  # an older torch_npu without the query, or no CANN to ask
        found = None
    cann = tuple(int(part) for part in found.groups()) if found else (0, 0)
    return family.startswith(_ZEROING_FAMILIES) and cann >= _ZEROING_CANN


class _EmptyExperts:
    """The experts without rows of one call, for a backward that must zero their dW blocks itself.

    The counts are copied to pinned host memory without blocking, right after the forward computes
    them, and an event marks the copy; the backward waits on that event, long passed by then (the
    forward's rest, the later layers and the loss run in between), and reads the host copy: no
    stream drain inside the step. Each empty expert's block is then zeroed alone (one small fill of
    [K, N] per empty expert), not the whole dW.
    """

    def __init__(self, npu, counts):
        self._host, self._event, self._experts = counts, None, None
        if counts.device.type == "cpu":  # nothing to copy (the CPU stand-in)
            return
        try:
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            event = npu.npu.Event()
            event.record()
        except Exception:  # no pinned memory or event here: copied in the backward (it waits for the device)
            return
        self._host, self._event = host, event

    def experts(self):
        if self._experts is None:
            if self._event is not None:
                self._event.synchronize()
            self._experts = [expert for expert, rows in enumerate(self._host.tolist()) if not rows]
        return self._experts


def _grouped_matmul(npu):
    """fn(x, weight [E, K, N], counts int64 [E], empty): rows of expert e of x @ weight[e], with a backward.

    The backward writes each weight's gradient in the weight's own layout, so that AccumulateGrad
    takes it as it is (no copy into the parameter's strides): for a weight that is a transposed
    view of a contiguous [E, N, K] parameter (transformers 5.x's [E, 2I, H] and [E, H, I]; 4.x's
    stacked experts), dW^T[e] = dy[rows of e]^T @ x[rows of e] is one K-split with the gradient
    transposed (x transposed, weight not: aclnn_grouped_matmul.cpp CheckCaseSplitK; MindSpeed's gmm
    backward does the same for a transposed weight), handed back as a transposed view; for a
    contiguous [E, K, N] weight (4.57 Qwen3-VL-MoE), dW[e] = x[rows of e]^T @ dy[rows of e].
    ``empty``: None where the device's K-split writes zeros for an expert without rows
    (``_k_split_zeroes_empty_groups``) or every expert has rows; else an ``_EmptyExperts``, whose
    blocks the backward zeroes one by one.

    One autograd Function per torch_npu module, closing over it, so that torch.compile traces it
    with nothing but tensors (and None) in its arguments on the devices that zero empty blocks.
    """

    def k_split(x, dy, counts):
        return npu.npu_grouped_matmul(
            [x], [dy], group_list=counts, group_type=2, split_item=3, group_list_type=1
        )[0]

    class GroupedMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, counts, empty):
            ctx.save_for_backward(x, weight, counts)
            ctx.empty = empty
            return npu.npu_grouped_matmul(
                [x], [weight], group_list=counts, group_type=0, split_item=3, group_list_type=1
            )[0]

        @staticmethod
        def backward(ctx, dy):
            x, weight, counts = ctx.saved_tensors
            dy = dy.contiguous()  # a transposed dy would count as a transposed x or weight
            dx = dweight = None
            if ctx.needs_input_grad[0]:
                dx = npu.npu_grouped_matmul(
                    [dy],
                    [weight.transpose(1, 2)],
                    group_list=counts,
                    group_type=0,
                    split_item=3,
                    group_list_type=1,
                )[0]
            if ctx.needs_input_grad[1]:
                if weight.transpose(1, 2).is_contiguous():  # the parameter is [E, N, K]
                    dweight = k_split(dy.t(), x, counts).transpose(1, 2)
                else:
                    dweight = k_split(x.t(), dy, counts)
                for expert in ctx.empty.experts() if ctx.empty is not None else ():
                    dweight[expert].zero_()
            return dx, dweight, None, None

    return GroupedMatmul.apply


def _counts(top_k_index, num_experts):
    """int64 [E]: the rows of each expert. histc, as transformers' grouped_mm path: no host sync."""
    return torch.histc(top_k_index.float(), bins=num_experts, min=0, max=num_experts).to(torch.int64)


def _routed_experts(npu, every_expert_has_rows=False):
    """fn(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up [E, H, 2I],
    down [E, I, H], counts [E]) -> [T, H] in the input dtype: each token's weighted experts.

    ``every_expert_has_rows``: the caller passes only experts with rows (4.x's stacked hit experts),
    so no weight-gradient block is ever left for the backward to zero."""
    grouped_matmul = _grouped_matmul(npu)
    zero_empty_blocks = not every_expert_has_rows and not _k_split_zeroes_empty_groups(npu)

    def routed_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, counts):
        empty = _EmptyExperts(npu, counts) if zero_empty_blocks else None
        permuted, sorted_indices = npu.npu_moe_token_permute(hidden_states, top_k_index)
        up = npu.npu_swiglu(grouped_matmul(permuted, gate_up, counts, empty), dim=-1)
        out = grouped_matmul(up, down, counts, empty)
        return npu.npu_moe_token_unpermute(out, sorted_indices, top_k_weights)

    return routed_experts


def _hit(experts, top_k_index):
    """(the experts of a ModuleList that have rows, the rows of every expert): one host sync, as
    the stock loop pays to find them."""
    counts = _counts(top_k_index, len(experts))
    return counts.nonzero().flatten().tolist(), counts


def _stacked(experts, hit, counts):
    """The ``hit`` experts of a ModuleList as gmm weights [E', H, 2I], [E', I, H], and their counts.

    Only those: as in the stock loop, an expert without rows gets no gradient (None, which
    optimizers skip, not zeros). None when a hit expert is not a gated MLP (4.57 LongCat-Flash's
    ``nn.Identity`` zero experts): that call runs the stock loop.
    """
    try:
        gate_up = torch.stack(
            [w for i in hit for w in (experts[i].gate_proj.weight, experts[i].up_proj.weight)]
        )
        down = torch.stack([experts[i].down_proj.weight for i in hit])
    except AttributeError:
        return None
    pairs, intermediate, hidden = gate_up.shape
    gate_up = gate_up.view(pairs // 2, 2 * intermediate, hidden).transpose(1, 2)
    return gate_up, down.transpose(1, 2), counts[hit]


def _route(router_logits, top_k, renormalise):
    """(fp32 weights [T, k], experts [T, k]) of softmax routing, with top-k taken on the logits.

    The softmax is monotonic, so the top-k of the probabilities are those of the logits: the same
    experts, except on exact ties. Renormalised over the k (Qwen's ``norm_topk_prob``, Mixtral), the
    weights are a softmax over the k chosen logits: no [T, E] probabilities are written, normalised, or
    read back by the backward. Without renormalising, a chosen expert's weight is its probability among
    all E: stock's fp32 softmax over E, gathered at the chosen experts (the same values as stock's; the
    exp(v - logsumexp) shortcut was up to 3 ulp from fp64 where stock is within 1). Plain torch ops: no
    fused router op of torch_npu has a backward for softmax routing (npu_moe_gating_top_k_softmax has
    none, and from op-plugin 26.1.0 its backward raises).
    """
    top, experts = torch.topk(router_logits, top_k, dim=-1)
    if renormalise:
        return torch.softmax(top.float(), dim=-1), experts
    return torch.softmax(router_logits, dim=-1, dtype=torch.float).gather(-1, experts), experts
