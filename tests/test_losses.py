"""npu_autopatch.losses against full-logit references: values and gradients (issue 19, items 1 and 4).

fp32 tight; bf16 within rounding (the chunked weight gradient is rounded once per chunk, stock's
once). Labels with -100 padding, chunk sizes that do and do not divide the rows, chunks whose
tokens are all ignored, num_items_in_batch, and the sum reduction.
"""

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from npu_autopatch.losses import linear_cross_entropy, linear_logprobs

VOCAB, HIDDEN = 97, 24
# bf16: a couple of units in the last place of the tensor's largest element (bf16's eps is 2**-7).
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2**-6)}


def _inputs(dtype, batch=3, length=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (batch, length), generator=gen)
    labels[0, :7] = -100  # padding, and with chunks of 4 or 5 rows whole chunks of it
    labels[2, 3] = -100
    return hidden, weight, labels


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def _close(got, expected, dtype):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        rtol, atol = TOLERANCE[dtype]
        scale = e.abs().max().item() if dtype != torch.float32 and e.numel() > 1 else 1.0
        torch.testing.assert_close(g.float(), e.float(), rtol=rtol, atol=atol * scale)


def _stock_loss(hidden, weight, shifted, **kwargs):
    """ForCausalLMLoss on the full logits, given labels already shifted (its shift_labels)."""
    logits = hidden @ weight.T
    return ForCausalLMLoss(logits, None, VOCAB, shift_labels=shifted, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 4, 5, 33, 1000])
@pytest.mark.parametrize("num_items", [None, 13])
def test_linear_cross_entropy_matches_for_causal_lm_loss(dtype, chunk_size, num_items):
    hidden, weight, labels = _inputs(dtype)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    expected = _stock_loss(hidden, weight, labels, **extra)
    got = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, **extra)
    _close([got], [expected], dtype)
    _close(_grads(got, hidden, weight), _grads(expected, hidden, weight), dtype)


def test_ignored_rows_get_zero_gradient_and_a_scaled_backward_scales():
    hidden, weight, labels = _inputs(torch.float32)
    got = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    expected = _stock_loss(hidden, weight, labels)
    grads = _grads(3.0 * got, hidden, weight)  # grad_output 3: the backward's other branch
    _close(grads, _grads(3.0 * expected, hidden, weight), torch.float32)
    assert torch.count_nonzero(grads[0][0, :7]) == 0


def test_sum_reduction_ignore_index_and_no_grad():
    hidden, weight, labels = _inputs(torch.float32)
    labels[labels == -100] = 5
    labels[1, :4] = 5
    expected = torch.nn.functional.cross_entropy(
        (hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=5, reduction="sum"
    )
    got = linear_cross_entropy(hidden, weight, labels, ignore_index=5, reduction="sum", chunk_size=7)
    _close([got], [expected], torch.float32)
    with torch.no_grad():
        unchunked = linear_cross_entropy(hidden, weight, labels, ignore_index=5, reduction="sum")
    _close([unchunked], [expected], torch.float32)


def test_only_the_weight_may_want_a_gradient():
    hidden, weight, labels = _inputs(torch.float32)
    hidden = hidden.detach()
    (grad,) = _grads(linear_cross_entropy(hidden, weight, labels, chunk_size=4), weight)
    _close([grad], _grads(_stock_loss(hidden, weight, labels), weight), torch.float32)


def test_all_ignored_is_nan_as_stock():
    hidden, weight, labels = _inputs(torch.float32)
    labels.fill_(-100)
    assert torch.isnan(_stock_loss(hidden, weight, labels))
    assert torch.isnan(linear_cross_entropy(hidden, weight, labels))


def test_bad_arguments_raise():
    hidden, weight, labels = _inputs(torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:, 1:])
    with pytest.raises(ValueError, match="cast one"):
        linear_cross_entropy(hidden, weight.bfloat16(), labels)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)


def _reference_logprobs(hidden, weight, tokens, temperature):
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 4, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_logprobs_match_full_logits_with_gradients(dtype, chunk_size, temperature):
    hidden, weight, tokens = _inputs(dtype)
    tokens = tokens.clamp(min=0)
    got = linear_logprobs(hidden, weight, tokens, temperature, chunk_size=chunk_size)
    expected = _reference_logprobs(hidden, weight, tokens, temperature)
    _close(got, expected, dtype)
    # A loss that weighs both outputs per token, as PPO's ratio and entropy bonus do.
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(tokens.shape, generator=gen), torch.randn(tokens.shape, generator=gen)

    def objective(out):
        return (a * out[0]).sum() + (b * out[1]).sum()

    _close(_grads(objective(got), hidden, weight), _grads(objective(expected), hidden, weight), dtype)


def test_linear_logprobs_one_output_only():
    hidden, weight, tokens = _inputs(torch.float32)
    tokens = tokens.clamp(min=0)
    got, _ = linear_logprobs(hidden, weight, tokens, chunk_size=4)
    expected, _ = _reference_logprobs(hidden, weight, tokens, 1.0)
    _close(_grads(got.sum(), hidden, weight), _grads(expected.sum(), hidden, weight), torch.float32)
