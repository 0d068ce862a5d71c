"""The chunked gated delta rule, vectorised across chunks: no Python loop over the sequence.

transformers' ``torch_chunk_gated_delta_rule`` walks the chunks of 64 tokens one by one in
Python (128 steps at 8k tokens, each a handful of kernel launches forward and backward; 4.57
also loops 63 times per call for the in-chunk triangular solve). Here the in-chunk part is the
same math batched over all chunks (one ``solve_triangular`` for the UT transform), and the
state carried from chunk to chunk, a linear recurrence

    S_{c+1} = A_c S_c + B_c,   A_c = exp(g_c) I - Kd_c^T W_c,   B_c = Kd_c^T U_c

(``U``/``W``: the solved values and decayed keys, ``Kd``: the keys decayed to the chunk's end),
is found by an associative scan: pairs of chunks are composed, (A2, B2) after (A1, B1) being
(A2 A1, A2 B1 + B2), recursively, so log2(chunks) levels of batched matmuls, O(chunks) work in
all. Each chunk then reads the state entering it, as stock does, all chunks at once.

A_c is the product of the chunk's per-token transitions exp(g_t)(I - beta_t k_t k_t^T), whose
norm is at most 1 for l2-normalised keys and beta in (0, 1) (how the models call it): the
composed products stay bounded and the error stays that of stock's sequential order
(tests/test_linear_attention.py measures both against an fp64 run).
"""

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm of the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``torch_chunk_gated_delta_rule``'s arguments and results: (output, final state or None).

    query, key: [batch, tokens, key heads, key dim]; value: [batch, tokens, value heads, value dim];
    g, beta: [batch, tokens, value heads]; initial_state: [batch, value heads, key dim, value dim].
    """
    out_dtype = query.dtype
    tokens, key_heads, key_dim = key.shape[1:]
    value_heads = value.shape[2]
    if key_heads != value_heads:  # each key head serves consecutive value heads
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query = query * key_dim**-0.5

    pad = -tokens % chunk_size
    query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    # [batch, heads, chunks, chunk, dim]; padding has beta = 0 and g = 0: no update, no decay.
    query, key, value = (x.unflatten(2, (-1, chunk_size)) for x in (query, key, value))
    beta, g = (x.unflatten(2, (-1, chunk_size)) for x in (beta, g))
    k_beta = key * beta.unsqueeze(-1)
    v_beta = value * beta.unsqueeze(-1)

    decay = g.cumsum(dim=-1)  # log decay from the chunk's start to each token
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise  # unit lower triangular once solved
    solved = torch.linalg.solve_triangular(
        ut_system,
        torch.cat((v_beta, k_beta * decay.exp().unsqueeze(-1)), dim=-1),
        upper=False,
        unitriangular=True,
    )
    new_values, decayed_keys = solved.split((value.shape[-1], key_dim), dim=-1)  # U, W
    intra = (query @ key.transpose(-1, -2)) * pairwise
    query = query * decay.exp().unsqueeze(-1)
    key = key * (decay[..., -1:] - decay).exp().unsqueeze(-1)  # Kd: decayed to the chunk's end

    key_t = key.transpose(-1, -2)
    eye = torch.eye(key_dim, dtype=key.dtype, device=key.device)
    transition = decay[..., -1, None, None].exp() * eye - key_t @ decayed_keys  # A
    update = key_t @ new_values  # B
    if initial_state is not None:
        first = transition[:, :, 0] @ initial_state.to(update) + update[:, :, 0]
        update = torch.cat((first.unsqueeze(2), update[:, :, 1:]), dim=2)
    after = _scan(transition, update)  # state after each chunk
    entering = torch.cat(
        (
            after.new_zeros(after[:, :, :1].shape)
            if initial_state is None
            else initial_state.to(after)[:, :, None],
            after[:, :, :-1],
        ),
        dim=2,
    )
    output = query @ entering + intra @ (new_values - decayed_keys @ entering)
    output = output.flatten(2, 3)[:, :, :tokens].transpose(1, 2)
    final = after[:, :, -1] if output_final_state else None
    return output.to(out_dtype, memory_format=torch.contiguous_format), final


def _scan(transition: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """The states x_c = A_c x_{c-1} + B_c from x_{-1} = 0, along dim 2, in log2(chunks) levels."""
    chunks = transition.shape[2]
    if chunks == 1:
        return update
    if chunks % 2:
        head = _scan(transition[:, :, :-1], update[:, :, :-1])
        last = transition[:, :, -1] @ head[:, :, -1] + update[:, :, -1]
        return torch.cat((head, last.unsqueeze(2)), dim=2)
    even_a, odd_a = transition[:, :, 0::2], transition[:, :, 1::2]
    even_b, odd_b = update[:, :, 0::2], update[:, :, 1::2]
    pair_b = odd_a @ even_b + odd_b
    # The pairs' transitions are needed only if another level follows.
    pair_a = odd_a @ even_a if chunks > 2 else odd_a
    after_odd = _scan(pair_a, pair_b)  # the state after chunk 2j + 1
    before_even = torch.cat((after_odd.new_zeros(after_odd[:, :, :1].shape), after_odd[:, :, :-1]), dim=2)
    after_even = even_a @ before_even + even_b
    return torch.stack((after_even, after_odd), dim=3).flatten(2, 3)
