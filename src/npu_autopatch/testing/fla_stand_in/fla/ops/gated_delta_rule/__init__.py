"""``fla.ops.gated_delta_rule``: the two entry points, reference math (see the package docstring)."""

import torch

from ... import CALLS


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _check(q, k, v, cu_seqlens, head_first):
    if head_first:
        raise ValueError("head_first=True is not supported.")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.shape[2] % k.shape[2]:
        raise ValueError("num_v_heads must be a multiple of num_qk_heads.")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
        )


def _recurrence(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
):
    """[B, T, H, *] inputs; state reset at each ``cu_seqlens`` boundary."""
    dtype = q.dtype
    repeat = v.shape[2] // k.shape[2]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q, k = q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    batch, tokens, heads, key_dim = k.shape
    bounds = [0, tokens] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    rows = batch if cu_seqlens is None else len(bounds) - 1
    if initial_state is None:
        states = torch.zeros(rows, heads, key_dim, v.shape[-1])
    else:
        states = initial_state.float()
    out = torch.empty_like(v)
    finals = []
    for row in range(rows):
        b = row if cu_seqlens is None else 0
        start, end = (0, tokens) if cu_seqlens is None else (bounds[row], bounds[row + 1])
        state = states[row]
        for t in range(start, end):
            state = state * g[b, t].exp()[:, None, None]
            correction = (v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], state)) * beta[b, t][:, None]
            state = state + torch.einsum("hk,hv->hkv", k[b, t], correction)
            out[b, t] = torch.einsum("hk,hkv->hv", q[b, t], state)
        finals.append(state)
    return out.to(dtype), torch.stack(finals) if output_final_state else None


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    head_first=False,
):
    CALLS["chunk_gated_delta_rule"] += 1
    _check(q, k, v, cu_seqlens, head_first)
    return _recurrence(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )


def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    CALLS["fused_recurrent_gated_delta_rule"] += 1
    _check(q, k, v, cu_seqlens, False)
    return _recurrence(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )
