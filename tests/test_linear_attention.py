"""The Gated DeltaNet layers keep packed sequences apart (issue 20), and change nothing else.

Packed: two or three documents in one row, their boundaries given by ``position_ids`` restarting
at 0 or by ``cu_seq_lens_q/k``, against each document run alone through the stock model: the
logits and every gradient agree (fp32 tight, bf16 within rounding). Stock leaks the recurrent
state and the conv window from one document into the next, or raises ``ValueError`` (5.x with
``cu_seq_lens``): these tests fail without the kernel. Unpacked (with or without padding) and
decode with a cache run the stock layer: bit for bit the stock result.
"""

import importlib.util

import pytest
import torch

import npu_autopatch
from npu_autopatch.kernels import KERNELS, choose_variant
from npu_autopatch.kernels.linear_attention import document_starts
from npu_autopatch.testing.parity import (
    BF16_TOLERANCE,
    NOISE_FLOOR,
    TOLERANCE,
    check_parity,
    relative_error,
    tiny_model,
)

from .conftest import present

MODELS = [m for m in ("qwen3_5", "qwen3_5_moe", "qwen3_next") if present(m)]
# Not in the table: their linear-attention decoder layers are found by discovery.
DISCOVERED = [m for m in ("olmo_hybrid", "lara_mini") if importlib.util.find_spec(f"transformers.models.{m}")]
LENGTHS = (7, 9, 5)
LINEAR_ONLY = {"layer_types": ["linear_attention", "linear_attention"]}


def documents(model, seed=0):
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, n), generator=gen) for n in LENGTHS]


def step(model, input_ids_list, weights, **kwargs):
    """(logits in fp32, {name: gradient in fp32}) of a fixed projection of the logits, summed over
    the calls (one per document, or one packed call)."""
    model.zero_grad(set_to_none=True)
    logits = torch.cat(
        [model(input_ids=ids, use_cache=False, **kwargs).logits for ids in input_ids_list], dim=1
    )
    (logits.float() * weights).sum().backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def assert_close(got, expected, dtype):
    (got_logits, got_grads), (logits, grads) = got, expected
    tolerance = TOLERANCE[dtype]
    assert relative_error(got_logits, logits) <= tolerance
    assert got_grads.keys() == grads.keys()
    largest = max(g.abs().max().item() for g in grads.values())
    for name, grad in grads.items():
        if max(grad.abs().max().item(), got_grads[name].abs().max().item()) < NOISE_FLOOR * largest:
            continue  # rounding noise in both runs
        bound = tolerance
        if dtype == torch.bfloat16:
            bound = next((b for suffix, b in BF16_TOLERANCE.items() if name.endswith(suffix)), tolerance)
        assert relative_error(got_grads[name], grad) <= bound, name


def packed_inputs(docs, boundaries):
    packed = torch.cat(docs, dim=1)
    if boundaries == "position_ids":
        return packed, {"position_ids": torch.cat([torch.arange(d.shape[1]) for d in docs])[None]}
    lengths = torch.tensor([d.shape[1] for d in docs])
    cu = torch.cat((torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)))
    longest = int(lengths.max())
    return packed, {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("model_type", MODELS)
def test_packed_documents_match_each_run_alone(npu_stand_in, model_type, boundaries, dtype):
    # With cu_seq_lens and no position_ids, the full-attention layers (SDPA) would see one long
    # document: only linear-attention layers, so that the boundaries come from the kwargs alone.
    overrides = LINEAR_ONLY if boundaries == "cu_seq_lens" else {}
    model = tiny_model(model_type, dtype, **overrides)
    docs = documents(model)
    packed, kwargs = packed_inputs(docs, boundaries)
    vocab = model.config.get_text_config().vocab_size
    weights = torch.randn(1, packed.shape[1], vocab, generator=torch.Generator().manual_seed(1))
    alone = step(model, docs, weights)
    # In bf16 the fused norms and SwiGLU round differently from stock (test_parity_models.py holds
    # them to that): here only this kernel, so that what is compared is the packing.
    kernels = None if dtype == torch.float32 else ["gated_delta_rule"]
    npu_autopatch.enable(models=[model_type], kernels=kernels)
    try:
        assert npu_autopatch.status()[model_type].state == "applied", npu_autopatch.status()[model_type]
        together = step(model, [packed], weights, **kwargs)
    finally:
        npu_autopatch.disable()
    assert_close(together, alone, dtype)


@pytest.mark.parametrize("model_type", DISCOVERED)
def test_discovery_keeps_packed_documents_apart_in_other_models(npu_stand_in, model_type):
    model = tiny_model(model_type)
    docs = documents(model)
    packed, kwargs = packed_inputs(docs, "position_ids")
    weights = torch.randn(1, packed.shape[1], model.config.get_text_config().vocab_size)
    alone = step(model, docs, weights)
    npu_autopatch.enable(discover=True)
    try:
        assert "gated_delta_rule" in npu_autopatch.status()[model_type].kernels
        together = step(model, [packed], weights, **kwargs)
    finally:
        npu_autopatch.disable()
    assert_close(together, alone, torch.float32)


def test_stock_leaks_across_packed_documents(npu_stand_in):
    """The reason for the kernel, measured: stock's packed logits are not the documents' own."""
    model_type = MODELS[0]
    model = tiny_model(model_type)
    docs = documents(model)
    packed, kwargs = packed_inputs(docs, "position_ids")
    weights = torch.ones(1, packed.shape[1], model.config.get_text_config().vocab_size)
    (stock_logits, _), (alone_logits, _) = (
        step(model, [packed], weights, **kwargs),
        step(model, docs, weights),
    )
    assert relative_error(stock_logits, alone_logits) > 1e-2


@pytest.mark.parametrize("model_type", MODELS)
def test_unpacked_parity_with_stock(npu_stand_in, model_type):
    report = check_parity(model_type, npu=npu_stand_in)
    assert "gated_delta_rule" in report.kernels
    assert report.passed, report


def exactly_stock(model_type, run):
    """``run(model)`` stock, then with only this kernel patched in: equal to the last bit."""
    model = tiny_model(model_type)
    with torch.no_grad():
        stock = run(model)
        npu_autopatch.enable(models=[model_type], kernels=["gated_delta_rule"])
        try:
            assert npu_autopatch.status()[model_type].state == "applied"
            patched = run(model)
        finally:
            npu_autopatch.disable()
    return stock, patched


@pytest.mark.parametrize("model_type", MODELS)
def test_padded_batch_is_exactly_stock(npu_stand_in, model_type):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding in the first row
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)

    def run(model):
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits

    stock, patched = exactly_stock(model_type, run)
    assert torch.equal(stock, patched)


@pytest.mark.parametrize("model_type", MODELS)
def test_decode_with_a_cache_is_exactly_stock(npu_stand_in, model_type):
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))

    def run(model):
        out = model.generate(
            prompt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        return out.sequences, torch.stack(out.logits)

    (stock_tokens, stock_logits), (tokens, logits) = exactly_stock(model_type, run)
    assert tokens.shape[1] == prompt.shape[1] + 4
    assert torch.equal(tokens, stock_tokens)
    assert torch.equal(logits, stock_logits)


@pytest.mark.parametrize("model_type", MODELS[:1])
def test_gradient_checkpointing_still_recomputes_the_layer(npu_stand_in, model_type):
    """5.x checkpoints in a wrapper around each layer class's forward: the replacement keeps it."""
    model = tiny_model(model_type)
    model.train()
    model.gradient_checkpointing_enable()
    docs = documents(model)
    packed, kwargs = packed_inputs(docs, "position_ids")
    weights = torch.randn(1, packed.shape[1], model.config.get_text_config().vocab_size)
    mixers = [m for name, m in model.named_modules() if name.endswith("linear_attn")]
    calls = []
    handles = [m.register_forward_hook(lambda *_: calls.append(1)) for m in mixers]
    try:
        alone = step(model, docs, weights)
        npu_autopatch.enable(models=[model_type])
        try:
            calls.clear()
            together = step(model, [packed], weights, **kwargs)
        finally:
            npu_autopatch.disable()
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == 2 * len(mixers)  # once in the forward, once recomputed in the backward
    assert_close(together, alone, torch.float32)


def test_a_layer_being_compiled_runs_stock_in_one_graph(npu_stand_in):
    """Finding documents reads tensor values: under torch.compile the stock layer runs, fullgraph."""
    model = tiny_model("qwen3_next")
    layer = next(module for module in model.modules() if hasattr(module, "linear_attn"))
    hidden = torch.randn(1, 16, model.config.hidden_size)

    def run():
        return layer(hidden, position_embeddings=None, position_ids=torch.arange(16)[None])

    stock = torch.compile(run, fullgraph=True, backend="eager")()
    torch._dynamo.reset()
    npu_autopatch.enable(models=["qwen3_next"], kernels=["gated_delta_rule"])
    try:
        patched = torch.compile(run, fullgraph=True, backend="eager")()
    finally:
        npu_autopatch.disable()
        torch._dynamo.reset()
    assert torch.equal(patched, stock)


def test_document_starts():
    restarting = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert document_starts(6, restarting, None).tolist() == [0, 3, 5]
    # cu_seq_lens win over position_ids; a tail after the last end is a document of its own.
    assert document_starts(6, restarting, torch.tensor([0, 4], dtype=torch.int32)).tolist() == [0, 4]
    assert document_starts(6, torch.arange(6)[None], None) is None  # one document
    assert document_starts(6, restarting.expand(2, 6), None) is None  # a batch: one document per row
    assert document_starts(1, torch.zeros(1, 1, dtype=torch.long), None) is None  # decode


def scaled_residual_layer(scale):
    """The forward of a pre-norm decoder layer whose residual branch is scaled by ``scale``."""

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None, position_ids=None, cache=None, **kw
    ):
        residual = hidden_states
        mixed = self.linear_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask
        )
        hidden_states = residual + scale * mixed
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    return forward


def test_probe_refuses_a_layer_it_does_not_reproduce():
    kernel = KERNELS["gated_delta_rule"]
    variant, reason = choose_variant(kernel, scaled_residual_layer(0.5), live=True)
    assert variant is None
    assert "differs" in reason
    assert choose_variant(kernel, scaled_residual_layer(1.0), live=True)[0] is not None
