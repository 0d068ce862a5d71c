"""The LM head's loss and log-probs without the ``[tokens, vocab]`` logits (issue 19).

For Qwen3's vocabulary (151,936) the logits of 8k tokens, their fp32 upcast and the saved
log-softmax take 12-16 GiB, more than the decoder. Both functions here compute ``hidden @ W.T``
one chunk of rows at a time, so at most one chunk of logits is alive; they are plain torch ops,
so they run on any device.

- ``linear_cross_entropy`` computes the gradients w.r.t. ``hidden`` and ``weight`` during the
  forward, chunk by chunk (the loss is a scalar, so its backward only scales them): no logits are
  saved for the backward; a bf16 weight's gradient takes a second pass that recomputes the logits
  by blocks of the vocabulary (issue 35: see ``_LinearCrossEntropy``).
- ``linear_logprobs`` returns per-token values whose upstream gradients are known only in the
  backward, so it saves the inputs and recomputes each chunk's logits there.

Importing this module imports torch and nothing else; it patches nothing.
"""

import itertools

import torch

__all__ = ["linear_cross_entropy", "linear_logprobs"]

# The bytes of one chunk's logits and of their gradient alive at once (the fp32 logits, and in a
# bf16 or fp16 step the matmul's output and the gradient in that dtype beside them): the default
# budget every call divides into chunks, read at each call, so setting it here overrides it for
# the loss kernel too; ``chunk_bytes=`` overrides it for one call. Chosen at the knee of time vs
# chunk size measured in docs/loss.md (benchmarks/loss_memory.py --sweep).
CHUNK_BYTES = 256 * 2**20


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype ``lm_head`` would multiply in, as ``F.linear`` does: the autocast dtype under
    autocast (both operands cast to it), else the operands' own; None when they differ outside it."""
    device = weight.device.type
    eligible = (torch.float32, torch.float16, torch.bfloat16)
    if torch.is_autocast_enabled(device) and hidden.dtype in eligible and weight.dtype in eligible:
        return torch.get_autocast_dtype(device)
    return weight.dtype if hidden.dtype == weight.dtype else None


def _check(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not multiply")
    dtype = _matmul_dtype(hidden, weight)
    if dtype is None:
        raise ValueError(f"hidden is {hidden.dtype} and weight {weight.dtype}: cast one, as lm_head would")
    return dtype


def _elements(chunk_size: int | None, chunk_bytes: int | None, vocab: int, per_logit: int) -> int:
    """Logits per chunk: ``chunk_size`` rows of the vocabulary, else as many as fit ``chunk_bytes``
    (by default CHUNK_BYTES) at ``per_logit`` bytes each (what the function keeps per logit at once)."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return chunk_size * vocab
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if budget < 1:
        raise ValueError(f"chunk_bytes must be positive, got {budget}")
    return max(vocab, budget // per_logit)


def _shifted(logits, shift):
    """``logits - shift`` per row in fp32: in place for fp32 logits, else read from the 2-byte
    ones into a new fp32 tensor (the upcast and the subtraction in one pass)."""
    if logits.dtype == torch.float32:
        return logits.sub_(shift[:, None])
    return torch.sub(logits, shift[:, None], out=torch.empty(logits.shape, device=logits.device))


def _token_chunk(chunk, matrix, target, scale, grad_weight):
    """One chunk of token rows over the whole vocabulary: (sum of their losses, their log-sum-exp,
    their hidden states' gradient or None); adds their part of the weight's gradient to
    ``grad_weight`` when given. Its temporaries die with the call, not with the next chunk.

    The exponentials of the log-sum-exp are the softmax's too: one ``exp`` pass over the fp32
    logits, then the gradient ``(softmax - one_hot) * scale`` written in the matmul's dtype into the
    matmul's output (rounded as stock's backward rounds it)."""
    logits = chunk @ matrix.T
    rows = torch.arange(target.numel(), device=target.device)
    picked = logits[rows, target].float()
    top = logits.amax(dim=-1).float()
    exp = _shifted(logits, top).exp_()
    total = exp.sum(dim=-1)
    lse = top + total.log()
    loss = (lse - picked).sum()
    if scale is None:
        return loss, lse, None
    factor = scale / total
    at_target = exp[rows, target] * factor - scale
    grad = torch.mul(exp, factor[:, None], out=logits)
    grad[rows, target] = at_target.to(grad.dtype)
    if grad_weight is not None:
        grad_weight.addmm_(grad.T, chunk)
    return loss, lse, grad @ matrix


def _vocab_block(rows, block, shift, one_hot, scale):
    """The weight's gradient for one block of vocabulary rows, over every token in one matmul;
    ``shift`` is each row's log-sum-exp minus ``log(scale)``, so one ``exp`` makes softmax * scale,
    written in the matmul's dtype into the matmul's output."""
    logits = rows @ block.T
    shifted = _shifted(logits, shift)
    at_target = shifted[one_hot].exp() - scale
    grad = torch.exp(shifted, out=logits)
    grad[one_hot] = at_target.to(grad.dtype)
    return grad.T @ rows


def _one_hot_blocks(targets, vocab, columns):
    """For each block of ``columns`` vocabulary rows, the (row, column) of the targets inside it:
    one host sync for all the blocks, not one per block."""
    order = torch.argsort(targets)
    starts = torch.arange(columns, vocab + columns, columns, device=targets.device)
    bounds = [0, *torch.searchsorted(targets[order], starts).tolist()]
    return [
        (order[lo:hi], targets[order[lo:hi]] - block * columns)
        for block, (lo, hi) in enumerate(itertools.pairwise(bounds))
    ]


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropy over the valid rows, times ``scale``; gradients made in the forward.

    The logits are ``hidden @ weight.T`` in ``dtype`` (the weight's, or autocast's), then fp32, as
    lm_head and ForCausalLMLoss (or cross_entropy under autocast) compute them. One pass over
    chunks of token rows makes the loss and the hidden states' gradient, each row's over the whole
    vocabulary in one matmul, as stock's backward makes it. The weight's gradient sums over every
    token: where it and the matmul are fp32 it is accumulated in place chunk by chunk. Where the
    matmul rounds to 2 bytes (a bf16 weight, or autocast), each partial sum would be rounded, an
    error growing with the number of chunks; then a second pass goes over blocks of vocabulary
    rows, recomputes each block's logits for all tokens (from the first pass's log-sum-exp) and
    makes its rows of the gradient in one matmul over all tokens, rounded once as stock's
    (cut-cross-entropy's order): one matmul more per logit, and no accumulator.
    """

    @staticmethod
    def forward(ctx, hidden, weight, valid, scale, plan):
        index, targets = valid  # the rows that count and their labels (see linear_cross_entropy)
        dtype, elements = plan
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        by_blocks = want_weight and (dtype != weight.dtype or dtype.itemsize < 4)
        grad_scale = scale if want_hidden or (want_weight and not by_blocks) else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        in_place = None if by_blocks else grad_weight
        with torch.autocast(weight.device.type, enabled=False):
            rows = hidden.index_select(0, index).to(dtype)  # lm_head's input, valid rows only
            matrix = weight.to(dtype)  # under autocast its cast, as autocast's cache keeps one
            lse = torch.empty(index.numel(), dtype=torch.float32, device=hidden.device)
            step = max(1, elements // weight.shape[0])
            for start in range(0, index.numel(), step):
                part = slice(start, start + step)
                loss, lse[part], grad = _token_chunk(rows[part], matrix, targets[part], grad_scale, in_place)
                total += loss
                if want_hidden:
                    grad_hidden.index_copy_(0, index[part], grad.to(hidden.dtype))
            if by_blocks:
                columns = max(1, elements // max(1, index.numel()))
                blocks = _one_hot_blocks(targets, weight.shape[0], columns)
                shift = lse - scale.log()
                for block, one_hot in enumerate(blocks):
                    part = slice(block * columns, (block + 1) * columns)
                    grad_weight[part] = _vocab_block(rows, matrix[part], shift, one_hot, scale)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        # A loss is usually the root of the graph (grad_output == 1): then no copy of the gradients.
        if grad_output.numel() == 1 and bool(grad_output == 1):
            return grad_hidden, grad_weight, None, None, None
        scale = grad_output.to(torch.float32)
        return (
            None if grad_hidden is None else (grad_hidden * scale).to(grad_hidden.dtype),
            None if grad_weight is None else (grad_weight * scale).to(grad_weight.dtype),
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding all the logits.

    Same result as transformers' ``ForCausalLMLoss`` on ``lm_head(hidden)`` with labels already
    shifted (the caller shifts): logits upcast to fp32, ``ignore_index`` rows left out, the sum
    divided by ``num_items_in_batch`` when given (gradient accumulation), else the mean over the
    valid rows (NaN when there is none, as stock), or the plain sum with ``reduction="sum"``.
    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]`` (same dtype, or any under autocast: then
    the matmul runs in autocast's dtype and the rest in fp32, as lm_head and the loss do there,
    and each input's gradient comes back in its own dtype), ``labels`` ``hidden.shape[:-1]``.
    ``chunk_bytes``: the memory one chunk's logits and their gradient may take (default
    ``CHUNK_BYTES``); ``chunk_size``, rows of logits per chunk, overrides it.
    Gradients flow to ``hidden`` and ``weight`` (computed during this call, applied in backward).
    """
    dtype = _check(hidden, weight)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(flat.device)
    keep = labels != ignore_index
    # Ignored rows add nothing to the loss and get a zero gradient: only the valid ones are
    # gathered (one host sync), so no chunk is empty and padding costs no matmul.
    index = keep.nonzero().squeeze(1)
    if num_items_in_batch is not None:
        divisor = torch.as_tensor(num_items_in_batch, device=flat.device)
    elif reduction == "mean":
        divisor = keep.sum()
    else:
        divisor = torch.ones((), device=flat.device)
    scale = 1.0 / divisor.to(torch.float32)
    # The fp32 logits, and beside them the matmul's output or the gradient when it is 2-byte.
    per_logit = 4 + (dtype.itemsize if dtype.itemsize < 4 else 0)
    plan = (dtype, _elements(chunk_size, chunk_bytes, weight.shape[0], per_logit))
    return _LinearCrossEntropy.apply(flat, weight, (index, labels[index]), scale, plan)


def _chunk_stats(chunk, weight, target, temperature):
    """fp32 logits / T of a chunk, with their log-probs of ``target``, softmax and entropy."""
    logits = (chunk @ weight.T).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    return logp, probs, logp.gather(1, target[:, None]).squeeze(1), entropy


class _LinearLogprobs(torch.autograd.Function):
    """Per-row log-prob of ``tokens`` and entropy; the backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, plan):
        dtype, elements = plan
        rows = max(1, elements // weight.shape[0])
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        with torch.autocast(weight.device.type, enabled=False):
            matrix = weight.to(dtype)  # under autocast its cast, as autocast's cache keeps one
            for start in range(0, hidden.shape[0], rows):
                part = slice(start, start + rows)
                stats = _chunk_stats(hidden[part].to(dtype), matrix, tokens[part], temperature)
                logprobs[part], entropy[part] = stats[2], stats[3]
        ctx.save_for_backward(hidden, weight, tokens, entropy)
        ctx.temperature, ctx.rows, ctx.dtype = temperature, rows, dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, tokens, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        with torch.autocast(weight.device.type, enabled=False):
            matrix = weight.to(ctx.dtype)
            for start in range(0, hidden.shape[0], ctx.rows):
                part = slice(start, start + ctx.rows)
                chunk, target = hidden[part].to(ctx.dtype), tokens[part]
                logp, probs, _, _ = _chunk_stats(chunk, matrix, target, ctx.temperature)
                # d logp[t] / dz = onehot(t) - p;  d entropy / dz = -p * (log p + entropy)
                grad = probs * (logp + entropy[part, None]) * -grad_entropy[part, None].float()
                grad -= probs * grad_logprobs[part, None].float()
                grad[torch.arange(target.numel(), device=grad.device), target] += grad_logprobs[part].float()
                grad = (grad / ctx.temperature).to(ctx.dtype)
                if want_hidden:
                    grad_hidden[part] = grad @ matrix
                if want_weight:
                    # Under autocast an fp32 weight's gradient sums the bf16 products in fp32.
                    grad_weight.addmm_(grad.T.to(weight.dtype), chunk.to(weight.dtype))
        return grad_hidden, grad_weight, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of ``tokens``, entropy of the whole distribution) per token, in fp32.

    The values of ``log_softmax(hidden @ weight.T / temperature).gather(-1, tokens)`` and of the
    entropy of those logits, for RL (PPO/GRPO ratios and the entropy bonus), without the
    ``[tokens, vocab]`` logits: chunk by chunk, with gradients to ``hidden`` and ``weight``
    through both outputs. ``hidden`` is ``[..., H]``, ``tokens`` ``hidden.shape[:-1]``; the
    outputs have the shape of ``tokens``. The logits are computed in the input dtype and
    upcast to fp32 before the division, as verl and TRL do with the model's logits; under
    autocast the matmul runs in its dtype, as lm_head does there. ``chunk_bytes`` and
    ``chunk_size`` as in ``linear_cross_entropy``.
    """
    dtype = _check(hidden, weight)
    if tokens.shape != hidden.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match hidden {tuple(hidden.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    # The fp32 logits, log-probs, probabilities and two products of them at once (the backward).
    plan = (dtype, _elements(chunk_size, chunk_bytes, weight.shape[0], 20))
    tokens_flat = tokens.reshape(-1).to(flat.device)
    logprobs, entropy = _LinearLogprobs.apply(flat, weight, tokens_flat, temperature, plan)
    return logprobs.view(tokens.shape), entropy.view(tokens.shape)
