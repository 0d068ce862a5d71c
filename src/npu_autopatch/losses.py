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
  backward, so it saves the inputs and recomputes each chunk's logits there (and a bf16 weight's
  gradient by blocks of the vocabulary, as the loss).

Each call allocates its chunk memory once (``_Scratch``, sized by ``CHUNK_BYTES``) and works in
it in place.

Importing this module imports torch and nothing else; it patches nothing.
"""

import itertools

import torch

__all__ = ["linear_cross_entropy", "linear_logprobs"]

# The bytes of one call's chunk memory (``_Scratch``: the matmul's output, in a bf16 or fp16 step
# the fp32 copy beside it, and for linear_logprobs a spare fp32 buffer): the default budget every
# call divides into chunks and vocabulary blocks, read at each call, so setting it here overrides it for
# the loss kernel too; ``chunk_bytes=`` overrides it for one call. Chosen at the knee of time vs
# chunk size measured in docs/loss.md (benchmarks/loss_memory.py --sweep).
CHUNK_BYTES = 512 * 2**20


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


def _even_step(total: int, most: int) -> int:
    """The step that cuts ``total`` rows into the fewest parts of at most ``most`` rows, all of
    about one size: 1,843 rows at most 883 a part are 3 parts of 615, not 883, 883 and 77 (a thin
    last matmul runs far below the others' rate)."""
    parts = max(1, -(-total // max(1, most)))
    return max(1, -(-total // parts))


def _tiles(tokens: int, vocab: int, elements: int) -> tuple[int, int, int]:
    """(token rows per chunk, vocabulary rows per block, the scratch's elements) for ``elements``
    logits at once: a chunk is rows x the whole vocabulary, a block all tokens x its rows."""
    rows = _even_step(tokens, elements // vocab)
    columns = _even_step(vocab, elements // max(1, tokens))
    return rows, columns, max(min(rows, tokens) * vocab, tokens * columns)


class _Scratch:
    """One call's chunk memory, allocated once and reused by every chunk and block: the matmul's
    output in its dtype, an fp32 copy beside it when that dtype is 2-byte, and on request a spare
    fp32 buffer. Reusing it keeps the peak at the budget and spares each chunk fresh pages (on CPU
    a new large tensor is a new mapping). Every elementwise step runs in place on one dtype: a
    mixed-dtype ``out=`` (e.g. bf16 minus fp32 into fp32) takes a slow casting path, several times
    the cost of the in-place ops plus one ``copy_`` (measured in docs/loss.md)."""

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device, spare: bool = False):
        def fp32():
            return torch.empty(elements, dtype=torch.float32, device=device)

        self._matmul = torch.empty(elements, dtype=dtype, device=device)
        self._fp32 = fp32() if dtype != torch.float32 else None
        self._spare = fp32() if spare else None

    @staticmethod
    def bytes_per_logit(dtype: torch.dtype, spare: bool = False) -> int:
        """What a scratch for ``dtype`` keeps per logit: the budget divided by this is its size."""
        return dtype.itemsize + (4 if dtype != torch.float32 else 0) + (4 if spare else 0)

    def logits(self, rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """``rows @ matrix.T`` (a chunk of tokens against the vocabulary, or all tokens against a
        block of it), written into the matmul's buffer: no new memory per chunk or block."""
        out = self._matmul[: rows.shape[0] * matrix.shape[0]].view(rows.shape[0], matrix.shape[0])
        return torch.mm(rows, matrix.T, out=out)

    def upcast(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` in fp32: themselves when fp32, else copied into the fp32 view of their shape."""
        if self._fp32 is None:
            return logits
        return self._fp32[: logits.numel()].view(logits.shape).copy_(logits)

    def spare(self, like: torch.Tensor) -> torch.Tensor:
        """The spare fp32 buffer, viewed in the shape of ``like``."""
        return self._spare[: like.numel()].view(like.shape)

    @staticmethod
    def weight_grad(weight: torch.Tensor, wanted: bool, by_blocks: bool) -> torch.Tensor | None:
        """The weight's gradient to fill, or None when not ``wanted``: uninitialised when the
        vocabulary pass writes every row of it (``by_blocks``), zeros for the in-place sum over chunks."""
        if not wanted:
            return None
        return torch.empty_like(weight) if by_blocks else torch.zeros_like(weight)


def _downcast(grad: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The fp32 ``grad`` in the matmul's dtype, written over the matmul's output ``logits`` (where
    stock's backward rounds the logits' gradient)."""
    return grad if grad is logits else logits.copy_(grad)


def _rounds_per_chunk(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether a weight gradient summed chunk by chunk would be rounded at every chunk: the matmul
    returns 2-byte partial sums (a bf16 weight, or autocast), or sums in a dtype not the weight's."""
    return dtype != weight.dtype or dtype.itemsize < 4


def _weight_by_vocab_blocks(rows, matrix, targets, grad_weight, scratch, columns, block_grad):
    """The weight's gradient block by block of vocabulary rows, each over every token in one
    matmul, rounded once as stock's single matmul (cut-cross-entropy's order): the block's logits
    are recomputed, and ``block_grad(logits, one_hot)`` turns them into their gradient in place,
    ``one_hot`` being the (token, column) of the targets inside the block."""
    for block, one_hot in enumerate(_one_hot_blocks(targets, matrix.shape[0], columns)):
        part = slice(block * columns, (block + 1) * columns)
        logits = scratch.logits(rows, matrix[part])
        grad = block_grad(logits, one_hot)
        if grad.dtype == grad_weight.dtype:
            torch.mm(grad.T, rows, out=grad_weight[part])
        else:  # under autocast: the bf16 product cast to the fp32 weight's dtype, as stock's
            grad_weight[part] = grad.T @ rows


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


def _token_chunk(chunk, matrix, target, scale, scratch, grad_weight):
    """One chunk of token rows over the whole vocabulary: (sum of their losses, their log-sum-exp,
    their hidden states' gradient or None); adds their part of the weight's gradient to
    ``grad_weight`` when given.

    The exponentials of the log-sum-exp are the softmax's too: one ``exp`` pass over the fp32
    logits, then the gradient ``(softmax - one_hot) * scale`` in the matmul's dtype."""
    logits = scratch.logits(chunk, matrix)
    rows = torch.arange(target.numel(), device=target.device)
    picked = logits[rows, target].float()
    top = logits.amax(dim=-1).float()
    exp = scratch.upcast(logits).sub_(top[:, None]).exp_()
    total = exp.sum(dim=-1)
    lse = top + total.log()
    loss = (lse - picked).sum()
    if scale is None:
        return loss, lse, None
    factor = scale / total
    at_target = exp[rows, target] * factor - scale
    grad = _downcast(exp.mul_(factor[:, None]), logits)
    grad[rows, target] = at_target.to(grad.dtype)
    if grad_weight is not None:
        grad_weight.addmm_(grad.T, chunk)
    return loss, lse, grad @ matrix


def _loss_block_grad(scratch, shift, scale):
    """``block_grad`` of the loss: ``shift`` is each token's log-sum-exp minus ``log(scale)``, so
    one ``exp`` makes softmax * scale; ``scale`` is taken off at the targets."""

    def block_grad(logits, one_hot):
        exp = scratch.upcast(logits).sub_(shift[:, None]).exp_()
        at_target = exp[one_hot] - scale
        grad = _downcast(exp, logits)
        grad[one_hot] = at_target.to(grad.dtype)
        return grad

    return block_grad


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropy over the valid rows, times ``scale``; gradients made in the forward.

    The logits are ``hidden @ weight.T`` in ``dtype`` (the weight's, or autocast's), then fp32, as
    lm_head and ForCausalLMLoss (or cross_entropy under autocast) compute them. One pass over
    chunks of token rows makes the loss and the hidden states' gradient, each row's over the whole
    vocabulary in one matmul, as stock's backward makes it. The weight's gradient sums over every
    token: where it and the matmul are fp32 it is accumulated in place chunk by chunk. Where the
    matmul rounds to 2 bytes (a bf16 weight, or autocast), each partial sum would be rounded, an
    error growing with the number of chunks; then a second pass goes over blocks of vocabulary
    rows (``_weight_by_vocab_blocks``, from the first pass's log-sum-exp): one matmul more per
    logit, and no accumulator.
    """

    @staticmethod
    def forward(ctx, hidden, weight, valid, scale, plan):
        index, targets = valid  # the rows that count and their labels (see linear_cross_entropy)
        dtype, elements = plan
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        by_blocks = want_weight and _rounds_per_chunk(dtype, weight)
        grad_scale = scale if want_hidden or (want_weight and not by_blocks) else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = _Scratch.weight_grad(weight, want_weight, by_blocks)
        in_place = None if by_blocks else grad_weight
        with torch.autocast(weight.device.type, enabled=False):
            rows = hidden.index_select(0, index).to(dtype)  # lm_head's input, valid rows only
            matrix = weight.to(dtype)  # under autocast its cast, as autocast's cache keeps one
            lse = torch.empty(index.numel(), dtype=torch.float32, device=hidden.device)
            step, columns, size = _tiles(index.numel(), weight.shape[0], elements)
            scratch = _Scratch(size, dtype, hidden.device)
            for start in range(0, index.numel(), step):
                part = slice(start, start + step)
                chunk = (rows[part], matrix, targets[part], grad_scale, scratch, in_place)
                loss, lse[part], grad = _token_chunk(*chunk)
                total += loss
                if want_hidden:
                    grad_hidden.index_copy_(0, index[part], grad.to(hidden.dtype))
            if by_blocks:
                block_grad = _loss_block_grad(scratch, lse - scale.log(), scale)
                _weight_by_vocab_blocks(rows, matrix, targets, grad_weight, scratch, columns, block_grad)
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
    ``chunk_bytes``: the memory the call's chunks work in (its scratch: the logits of a chunk of
    token rows or of a block of the vocabulary, and their gradient; default ``CHUNK_BYTES``);
    ``chunk_size``, at most that many rows of logits per chunk, overrides it.
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
    plan = (dtype, _elements(chunk_size, chunk_bytes, weight.shape[0], _Scratch.bytes_per_logit(dtype)))
    return _LinearCrossEntropy.apply(flat, weight, (index, labels[index]), scale, plan)


def _logprob_stats(chunk, matrix, target, temperature, scratch):
    """(log-prob of ``target``, entropy, log-sum-exp) per row of a chunk, of its fp32 logits / T:
    with ``y`` the logits minus their row maximum and ``e = exp(y)``, ``lse = max + log sum e``
    and the entropy ``log sum e - sum(e * y) / sum e``.

    ``e * y`` is written in place over ``y`` and summed by torch's cascade reduction, as ``e`` is.
    A dot product (``einsum``) accumulating the 151,936 terms in fp32 had 1.9-7x stock's entropy error
    against fp64; this has a tenth of stock's (issue 42, ``tests/test_losses.py``). Its cost: the
    product is written once over the chunk's fp32 logits, where the dot product only read them."""
    logits = scratch.logits(chunk, matrix)
    scaled = scratch.upcast(logits).div_(temperature)
    rows = torch.arange(target.numel(), device=target.device)
    picked = scaled[rows, target]
    top = scaled.amax(dim=-1)
    shifted = scaled.sub_(top[:, None])
    exp = torch.exp(shifted, out=scratch.spare(shifted))
    total = exp.sum(dim=-1)
    log_total = total.log()
    lse = top + log_total
    entropy = log_total - shifted.mul_(exp).sum(dim=-1) / total
    return picked - lse, entropy, lse


def _logprob_grad(scratch, temperature, lse, slope, offset, at_target):
    """``block_grad`` of the log-probs and entropy, for a tile of rows (tokens) and columns: with
    ``logp`` the tile's log-softmax and ``p`` its softmax, the logits' gradient is
    ``p * (slope * logp + offset)`` per row, plus ``at_target`` at the targets, over ``T``:
    d logp[t] / dz = onehot(t) - p, d entropy / dz = -p * (log p + entropy)."""

    def block_grad(logits, one_hot):
        logp = scratch.upcast(logits).div_(temperature).sub_(lse[:, None])
        probs = torch.exp(logp, out=scratch.spare(logp))
        grad = logp.mul_(slope[:, None]).add_(offset[:, None]).mul_(probs)
        grad[one_hot] += at_target[one_hot[0]]
        return _downcast(grad, logits)

    return block_grad


def _logprob_tiles(hidden, weight, plan):
    """``linear_logprobs``' rows per chunk, columns per block and scratch (with the spare buffer for
    the softmax beside the log-probs)."""
    dtype, elements = plan
    rows, columns, size = _tiles(hidden.shape[0], weight.shape[0], elements)
    return rows, columns, _Scratch(size, dtype, hidden.device, spare=True)


class _LinearLogprobs(torch.autograd.Function):
    """Per-row log-prob of ``tokens`` and entropy; the backward recomputes each chunk's logits.

    The hidden states' gradient comes from chunks of token rows over the whole vocabulary; the
    weight's, as in ``_LinearCrossEntropy``: in place chunk by chunk in fp32, by blocks of the
    vocabulary over all tokens where the matmul rounds to 2 bytes."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, plan):
        ctx.temperature, ctx.plan = temperature, plan
        dtype = plan[0]
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
        with torch.autocast(weight.device.type, enabled=False):
            matrix = weight.to(dtype)  # under autocast its cast, as autocast's cache keeps one
            step, _, scratch = _logprob_tiles(hidden, weight, plan)
            for start in range(0, hidden.shape[0], step):
                part = slice(start, start + step)
                chunk = (hidden[part].to(dtype), matrix, tokens[part], temperature, scratch)
                logprobs[part], entropy[part], lse[part] = _logprob_stats(*chunk)
        ctx.save_for_backward(hidden, weight, tokens, entropy, lse)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, tokens, entropy, lse = ctx.saved_tensors
        dtype, temperature = ctx.plan[0], ctx.temperature
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        by_blocks = want_weight and _rounds_per_chunk(dtype, weight)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = _Scratch.weight_grad(weight, want_weight, by_blocks)
        # An output the loss does not use gets zeros here (autograd materialises them).
        slope = -grad_entropy.float() / temperature
        at_target = grad_logprobs.float() / temperature
        offset = slope * entropy - at_target
        with torch.autocast(weight.device.type, enabled=False):
            matrix = weight.to(dtype)
            rows = hidden.to(dtype)
            step, columns, scratch = _logprob_tiles(hidden, weight, ctx.plan)
            for start in range(0, hidden.shape[0], step):
                part = slice(start, start + step)
                chunk = rows[part]
                logits = scratch.logits(chunk, matrix)
                one_hot = (torch.arange(chunk.shape[0], device=chunk.device), tokens[part])
                args = (lse[part], slope[part], offset[part], at_target[part])
                grad = _logprob_grad(scratch, temperature, *args)(logits, one_hot)
                if want_hidden:
                    grad_hidden[part] = grad @ matrix
                if want_weight and not by_blocks:
                    grad_weight.addmm_(grad.T, chunk)
            if by_blocks:
                block_grad = _logprob_grad(scratch, temperature, lse, slope, offset, at_target)
                _weight_by_vocab_blocks(rows, matrix, tokens, grad_weight, scratch, columns, block_grad)
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
    per_logit = _Scratch.bytes_per_logit(dtype, spare=True)
    plan = (dtype, _elements(chunk_size, chunk_bytes, weight.shape[0], per_logit))
    tokens_flat = tokens.reshape(-1).to(flat.device)
    logprobs, entropy = _LinearLogprobs.apply(flat, weight, tokens_flat, temperature, plan)
    return logprobs.view(tokens.shape), entropy.view(tokens.shape)
