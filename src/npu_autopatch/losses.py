"""The LM head's loss and log-probs without the ``[tokens, vocab]`` logits (issue 19).

For Qwen3's vocabulary (151,936) the logits of 8k tokens, their fp32 upcast and the saved
log-softmax take 12-16 GiB, more than the decoder. Both functions here compute ``hidden @ W.T``
one chunk of rows at a time, so at most one chunk of logits is alive; they are plain torch ops,
so they run on any device.

- ``linear_cross_entropy`` computes the gradients w.r.t. ``hidden`` and ``weight`` during the
  forward, chunk by chunk (the loss is a scalar, so its backward only scales them): nothing is
  recomputed and no logits are saved for the backward.
- ``linear_logprobs`` returns per-token values whose upstream gradients are known only in the
  backward, so it saves the inputs and recomputes each chunk's logits there.

Importing this module imports torch and nothing else; it patches nothing.
"""

import torch

__all__ = ["linear_cross_entropy", "linear_logprobs"]

# Elements of one chunk of logits: 2**24 fp32 values are 64 MiB (110 rows of a 151,936 vocab),
# small next to the weight's gradient (a few such temporaries are alive at once) and still
# large enough to keep the matmuls efficient.
_CHUNK_ELEMENTS = 2**24


def _rows(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // max(1, vocab))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return chunk_size


def _check(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not multiply")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} and weight {weight.dtype}: cast one, as lm_head would")


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropy over the valid rows, times ``scale``; gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, valid, scale, rows):
        index, targets = valid  # the rows that count and their labels (see linear_cross_entropy)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        # Accumulated in the weight's dtype (as the stock backward's single matmul rounds once):
        # an fp32 accumulator would add twice a bf16 weight's size to the peak.
        grad_weight = torch.zeros_like(weight) if want_weight else None
        for start in range(0, index.numel(), rows):
            at = index[start : start + rows]
            target = targets[start : start + rows]
            chunk = hidden.index_select(0, at)
            logits = (chunk @ weight.T).float()  # as ForCausalLMLoss: lm_head in the input dtype, then fp32
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, target[:, None]).squeeze(1)).sum()
            if not (want_hidden or want_weight):
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(target.numel(), device=grad.device), target] -= 1
            grad = grad.mul_(scale).to(hidden.dtype)
            if want_hidden:
                grad_hidden.index_copy_(0, at, grad @ weight)
            if want_weight:
                grad_weight.addmm_(grad.T, chunk)
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
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding all the logits.

    Same result as transformers' ``ForCausalLMLoss`` on ``lm_head(hidden)`` with labels already
    shifted (the caller shifts): logits upcast to fp32, ``ignore_index`` rows left out, the sum
    divided by ``num_items_in_batch`` when given (gradient accumulation), else the mean over the
    valid rows (NaN when there is none, as stock), or the plain sum with ``reduction="sum"``.
    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]`` (same dtype), ``labels`` ``hidden.shape[:-1]``.
    ``chunk_size``: rows of logits per chunk; by default as many as make 2**24 logits.
    Gradients flow to ``hidden`` and ``weight`` (computed during this call, applied in backward).
    """
    _check(hidden, weight)
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
    rows = _rows(chunk_size, weight.shape[0])
    return _LinearCrossEntropy.apply(flat, weight, (index, labels[index]), scale, rows)


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
    def forward(ctx, hidden, weight, tokens, temperature, rows):
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], rows):
            part = slice(start, start + rows)
            stats = _chunk_stats(hidden[part], weight, tokens[part], temperature)
            logprobs[part], entropy[part] = stats[2], stats[3]
        ctx.save_for_backward(hidden, weight, tokens, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, tokens, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            chunk, target = hidden[part], tokens[part]
            logp, probs, _, _ = _chunk_stats(chunk, weight, target, ctx.temperature)
            # d logp[t] / dz = onehot(t) - p;  d entropy / dz = -p * (log p + entropy)
            grad = probs * (logp + entropy[part, None]) * -grad_entropy[part, None].float()
            grad -= probs * grad_logprobs[part, None].float()
            grad[torch.arange(target.numel(), device=grad.device), target] += grad_logprobs[part].float()
            grad = (grad / ctx.temperature).to(hidden.dtype)
            if want_hidden:
                grad_hidden[part] = grad @ weight
            if want_weight:
                grad_weight.addmm_(grad.T, chunk)
        return grad_hidden, grad_weight, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of ``tokens``, entropy of the whole distribution) per token, in fp32.

    The values of ``log_softmax(hidden @ weight.T / temperature).gather(-1, tokens)`` and of the
    entropy of those logits, for RL (PPO/GRPO ratios and the entropy bonus), without the
    ``[tokens, vocab]`` logits: chunk by chunk, with gradients to ``hidden`` and ``weight``
    through both outputs. ``hidden`` is ``[..., H]``, ``tokens`` ``hidden.shape[:-1]``; the
    outputs have the shape of ``tokens``. The logits are computed in the input dtype and
    upcast to fp32 before the division, as verl and TRL do with the model's logits.
    """
    _check(hidden, weight)
    if tokens.shape != hidden.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match hidden {tuple(hidden.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = _rows(chunk_size, weight.shape[0])
    tokens_flat = tokens.reshape(-1).to(flat.device)
    logprobs, entropy = _LinearLogprobs.apply(flat, weight, tokens_flat, temperature, rows)
    return logprobs.view(tokens.shape), entropy.view(tokens.shape)
