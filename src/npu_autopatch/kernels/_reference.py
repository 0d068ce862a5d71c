"""CPU reference math of the torch_npu ops the kernels call: what each op computes, nothing more.

The probes build every candidate on these functions (``golden_ops()`` is this module), and the
testing stand-in (``npu_autopatch.testing``) computes its ops with them, adding the device's
checks, profiles, autograd behaviour and registration on top: one definition of each op's math.
The functions have torch_npu's signatures (``torch_npu_ops.md``) and its output dtypes and
rounding (fp32 inside, one cast at the end, where the op-plugin golden tests say so); they check
nothing the math does not need, so a probe compares the math, not the device's shape rules.
"""

import torch

_float32 = torch.float32


def npu_rms_norm(input, gamma, epsilon=1e-06):
    """(y in input's dtype, rstd fp32): y = x * rsqrt(mean(x^2) + eps) * gamma over gamma's dims,
    in fp32, rounded once at the end (op-plugin test_npu_rms_norm.py golden)."""
    xf = input.float()
    dims = tuple(range(-gamma.dim(), 0))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return ((xf * rstd) * gamma.float()).to(input.dtype), rstd


def npu_swiglu(input, dim=-1):
    """silu(first half) * second half along ``dim``, in fp32, cast to input's dtype."""
    a, b = input.float().chunk(2, dim)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


# torch's own GELU, not ``torch.nn.functional.gelu``: the stand-in may model the device's aten gelu
# there (testing/device/gelu.py), and the reference is the math the op computes, not the device's aten.
_gelu = torch._C._nn.gelu


def npu_gelu(input, approximate="none"):
    """GELU with ``approximate`` honoured ('none': erf, 'tanh'), in fp32, cast to input's dtype
    (aclnnGeluV2; op-plugin test_npu_gelu.py's golden is torch's gelu with the same argument)."""
    return _gelu(input.float(), approximate=approximate).to(input.dtype)


def npu_fast_gelu(input):
    """x / (1 + exp(-1.702 x)) in fp32, cast to input's dtype: the Atlas A2/A3 formula of
    torch_npu-npu_fast_gelu.md (the Atlas training and inference series compute another)."""
    x = input.float()
    return (x * torch.sigmoid(1.702 * x)).to(input.dtype)


def geglu_halves(input, dim, activate_left):
    """(gate, x) of a GeGLU input in fp32: the GELU takes the left half with ``activate_left``, else
    the right one."""
    left, right = input.float().chunk(2, dim)
    return (left, right) if activate_left else (right, left)


def npu_geglu(input, dim=-1, approximate=1, activate_left=False):
    """(x * gelu(gate), gelu(gate)), both in input's dtype; approximate 1 = tanh, 0 = erf. fp32 inside,
    one cast at the end (hicann/ops-nn activation/ge_glu_v2 tests/assets/golden.py, whose fp16 with
    tanh stays in fp16: not modelled, no kernel calls it in fp16)."""
    gate, x = geglu_halves(input, dim, activate_left)
    gelu = _gelu(gate, approximate="tanh" if approximate == 1 else "none")
    return (x * gelu).to(input.dtype), gelu.to(input.dtype)


def rotate_by_mode(x, rotary_mode):
    """'half': cat(-x2, x1) over the two halves; 'interleave': (x0, x1) -> (-x1, x0) per pair."""
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).reshape(x.shape)


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """input * r1 + rotate(input) * r2, r1/r2 broadcast and cast to input's dtype (the adapter
    casts them, RotaryMulKernelNpuOpApi.cpp), computed in that dtype as the op-plugin golden."""
    rotated = input @ rotate.to(input.dtype) if rotate is not None else rotate_by_mode(input, rotary_mode)
    return input * r1.to(input.dtype) + rotated * r2.to(input.dtype)


def group_ends(group_list, cumulative):
    """The cumulative end offset of each group, as Python ints (group_list_type 0: given; 1: counts)."""
    values = group_list.tolist()
    if cumulative:
        return values
    ends, total = [], 0
    for count in values:
        total += count
        ends.append(total)
    return ends


def matmul(x, weight, bias, out_dtype):
    """x @ weight (+ bias) in fp32, cast once."""
    y = x.float() @ weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    group_list=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    output_dtype=None,
):
    """Grouped x_i @ weight_i (+ bias_i), non-quantised, as a list of outputs.

    group_type -1: x and weight are lists of equal length; 0 (M-split): the rows of the single x
    are split by group_list, one [K, N] weight per group (a single [E, K, N] weight is E groups);
    2 (K-split): the columns of the single x [M, K] and the rows of the single weight [K, N] are
    split, one [M, N] block per group, [E, M, N]. split_item 0/1 return one output per group,
    2/3 one concatenated output. Rows past the last offset are not computed by the device; here
    they are zero.
    """
    out_dtype = x[0].dtype if output_dtype is None else output_dtype
    weights = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
    biases = list(bias[0].unbind(0)) if bias is not None and len(bias) == 1 and bias[0].dim() == 2 else bias
    biases = biases if biases is not None else [None] * len(weights)
    if group_type == 2:
        (x0,), (w0,) = x, weight
        ends = group_ends(group_list, group_list_type == 0)
        starts = [0, *ends[:-1]]
        return [
            torch.stack(
                [matmul(x0[:, s:e], w0[s:e], None, out_dtype) for s, e in zip(starts, ends, strict=True)]
            )
        ]
    if group_type == -1 or group_list is None:
        outs = [matmul(xi, wi, bi, out_dtype) for xi, wi, bi in zip(x, weights, biases, strict=True)]
        return outs if split_item in (0, 1) else [torch.cat(outs, 0)]
    (x0,) = x
    # split_item 0/1 size their outputs as if group_list were cumulative, whatever its type (the
    # op-plugin adapter, GroupedMatmulKernelNpuOpApi.cpp).
    ends = group_ends(group_list, group_list_type == 0 or split_item in (0, 1))
    starts = [0, *ends[:-1]]
    outs = [
        matmul(x0[s:e], w, b, out_dtype) for s, e, w, b in zip(starts, ends, weights, biases, strict=True)
    ]
    if split_item in (0, 1):
        return outs
    tail = x0.new_zeros((x0.shape[0] - ends[-1], weights[0].shape[-1]), dtype=out_dtype)
    return [torch.cat([*outs, tail], 0)]


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """(tokens copied per (token, slot) and sorted by expert, stably; sorted_indices int32).

    sorted_indices is the INVERSE permutation: permuted[sorted_indices[f]] = tokens[f // topK]
    (op-plugin test_npu_moe_token_permute.py golden)."""
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    n = order.numel() if not num_out_tokens or num_out_tokens <= 0 else min(num_out_tokens, order.numel())
    return tokens[order[:n] // topk], torch.argsort(order).to(torch.int32)


def gather_rows(rows, index):
    """rows[index] in fp32; an index past the end (a dropped token) reads a zero row."""
    padded = torch.cat((rows.float(), rows.new_zeros((1, rows.shape[1]), dtype=_float32)))
    return padded[index.long().clamp(max=rows.shape[0])]


def npu_moe_token_unpermute(
    permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None
):
    """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * topK + k]], in
    permuted_tokens' dtype. Every (tokens, probs) dtype pair is taken (moe_token_unpermute_def.cpp);
    the sum is accumulated in fp32 and cast once (the kernel's own precision is not published)."""
    topk = probs.shape[1] if probs is not None else 1
    rows = gather_rows(permuted_tokens, sorted_indices).reshape(-1, topk, permuted_tokens.shape[1])
    weights = probs.float() if probs is not None else rows.new_ones(rows.shape[:2])
    return (rows * weights.unsqueeze(-1)).sum(1).to(permuted_tokens.dtype)


def _kept(sq, skv, sparse_mode, pre, nxt, device):
    """The (i, j) that take part under sparse mode 2, 3 or 4 (§6.1 table; Δ = Skv - Sq, i.e. mode 3
    and 4 count from the bottom-right corner, mode 4 keeps ``i+Δ-pre <= j <= i+Δ+next``)."""
    i, j = torch.arange(sq, device=device).unsqueeze(1), torch.arange(skv, device=device)
    if sparse_mode == 2:
        return j <= i
    delta = skv - sq
    if sparse_mode == 3:
        return j <= i + delta
    return (j >= i + delta - pre) & (j <= i + delta + nxt)


def _attend(q, k, v, scale, keep, sink):
    """softmax(scale * q @ k^T masked, with the sink's extra logit per head) @ v; [B, S, N, D] in, fp32."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # GQA: head h reads h // group
    scores = (q @ k.transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sink is not None:  # the doc's reference: append the sink logit, softmax, drop its column
        column = sink.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2)


def npu_fusion_attention(
    query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
    keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    softmax_layout="", sink=None,
):  # fmt: skip
    """The attention output (first of the 7 outputs; the rest are None) for what the attention kernel
    passes: BSND or TND (cumulative ``actual_seq_*`` ends, each segment on its own), no mask or the
    compressed mask with sparse mode 2-4, GQA, ``sink`` (torch_npu_ops.md §6.1). The stand-in
    (testing/device/attention.py) adds the other layouts, the statistics, the backward and the
    device's checks."""
    rules = (sparse_mode, pre_tockens, next_tockens) if atten_mask is not None else None

    def one(q, k, v):  # [B, S, N, D]
        keep = None if rules is None else _kept(q.shape[1], k.shape[1], *rules, q.device)
        return _attend(q, k, v, scale, keep, sink)

    if input_layout == "BSND":
        out = one(query, key, value)
    else:
        pieces, q0, kv0 = [], 0, 0
        for q1, kv1 in zip(actual_seq_qlen, actual_seq_kvlen, strict=True):
            pieces.append(
                one(
                    *(
                        t[a:b].unsqueeze(0)
                        for t, a, b in ((query, q0, q1), (key, kv0, kv1), (value, kv0, kv1))
                    )
                )[0]
            )
            q0, kv0 = q1, kv1
        out = torch.cat(pieces)
    return (out.to(query.dtype), None, None, None, 0, 0, 0)
