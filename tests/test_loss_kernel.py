"""The opt-in loss kernel (kernels/loss.py) against stock transformers (issue 19 item 1-2).

Loss and every parameter's gradient of the table's causal LMs with the kernel on match stock, fp32
tight and bf16 within rounding: with -100 padding, num_items_in_batch, tied embeddings,
logits_to_keep (with shift_labels), the MoE auxiliary loss. The default selection runs the llama
family and qwen3_moe in every case; the full matrix every table model's trained head (a VLM's
text head, with its image) in fp32 and bf16, where a head the probe refuses must stay stock with
the reason. HF Trainer gives the same losses step by step. Only the loss kernel is selected
(kernels=[]), so stock is the only other party.
"""

import importlib
import inspect

import pytest
import torch
import transformers

import npu_autopatch
from npu_autopatch import _config, _control
from npu_autopatch.kernels import KERNELS, choose_variant
from npu_autopatch.kernels import loss as loss_kernel
from npu_autopatch.models import MODEL_TYPES, MODELS
from npu_autopatch.testing import PROFILES, stand_in, tiny
from npu_autopatch.testing.parity import tiny_model

from .conftest import FULL, present
from .test_trainers import trainer_losses

LOSS_MODELS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]  # the default selection's
# (rtol, atol as a fraction of the tensor's largest value)
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2**-6)}
V4 = int(transformers.__version__.split(".")[0]) < 5

# Trained heads the probe refuses, with the words of the reason: they stay stock.
REFUSED = {
    "Gemma3ForCausalLM": "math differs",  # final logit softcapping
    "GraniteForCausalLM": "math differs",  # logits / logits_scaling
    "GraniteMoeForCausalLM": "math differs",
}
if V4:
    # 4.57's VLM heads leave num_items_in_batch out of their loss (stock divides by the batch's own
    # count under gradient accumulation: "math differs", or Qwen3-VL's forward fails on the probe's
    # config first); its Omni thinkers merge the towers' embeddings themselves.
    REFUSED.update(
        dict.fromkeys(
            [
                "Qwen3VLForConditionalGeneration",
                "Qwen3VLMoeForConditionalGeneration",
                "Gemma3ForConditionalGeneration",
                "Glm4vForConditionalGeneration",
                "Glm4vMoeForConditionalGeneration",
            ],
            "loss not applied",
        ),
        Qwen2_5OmniThinkerForConditionalGeneration="does not provide",
        Qwen3OmniMoeThinkerForConditionalGeneration="does not provide",
    )


# Table models whose LM head the chunked loss cannot compute, so the table gives them no loss target:
# gemma2 caps its final logits (tanh softcap before the loss), which the loss probe refuses.
NO_LOSS_TARGET = {"gemma2": "final_logit_softcapping"}


def test_every_table_model_has_a_loss_target():
    assert [t for t in MODEL_TYPES if "loss" not in MODELS[t].kernels] == list(NO_LOSS_TARGET)


def _batch(model, seed=1, batch=2, length=9):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a padded prompt
    return ids, labels


def _run(model, autocast=False, **inputs):
    """(loss, {parameter: gradient}, outputs) of one forward (under bf16 autocast if asked) + backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out


def _close(got, expected, dtype):
    rtol, atol = TOLERANCE[dtype]
    # Absolute error relative to the tensor's largest value: a summed gradient rounds at its scale.
    scale = expected.abs().max().item() if expected.numel() > 1 else 1.0
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=atol * max(scale, 1e-3))


CASES = {
    "padding": lambda ids, labels: {},
    "num_items_in_batch": lambda ids, labels: {"num_items_in_batch": torch.tensor(11)},
    "logits_to_keep": lambda ids, labels: {"logits_to_keep": 4, "shift_labels": labels[:, -4:].contiguous()},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# The slicing by logits_to_keep is the same code in every model: one is enough.
@pytest.mark.parametrize(
    "model_type, case",
    [(m, c) for m in LOSS_MODELS for c in ("padding", "num_items_in_batch")] + [("qwen3", "logits_to_keep")],
)
def test_loss_and_every_gradient_match_stock(model_type, case, dtype, npu_stand_in):
    overrides = {"output_router_logits": True} if "moe" in model_type else {}
    if case == "padding" and model_type in ("llama", "qwen3"):
        overrides["tie_word_embeddings"] = True
    model = tiny_model(model_type, dtype, **overrides)
    ids, labels = _batch(model)
    inputs = {"input_ids": ids, "labels": labels, **CASES[case](ids, labels)}
    stock_loss, stock_grads, stock_out = _run(model, **inputs)
    assert stock_out.logits is not None
    npu_autopatch.enable(models=[model_type], kernels=[], loss=True)
    record = npu_autopatch.status()[model_type]
    assert record.state == "applied" and record.kernels == ("loss",), record.reason
    loss, grads, out = _run(model, **inputs)
    assert out.logits is None  # the chunked loss ran
    if "moe" in model_type:
        assert out.aux_loss is not None and out.aux_loss.item() != 0
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.get_input_embeddings().weight
    _close(loss, stock_loss, dtype)
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        _close(grad, stock_grads[name], dtype)


def test_eval_no_labels_and_no_grad_take_the_stock_forward(npu_stand_in):
    model = tiny_model("qwen3")
    ids, labels = _batch(model)
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    assert model(input_ids=ids, labels=labels).logits is None
    assert model(input_ids=ids).logits is not None
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels).logits is not None
    model.eval()
    assert model(input_ids=ids, labels=labels).logits is not None
    model.train()
    assert isinstance(model(input_ids=ids, labels=labels, return_dict=False), tuple)


def test_off_by_default_and_reported_when_on(npu_stand_in):
    model = tiny_model("qwen3")
    npu_autopatch.enable(models=["qwen3"])
    assert "loss" not in npu_autopatch.status()["qwen3"].kernels
    ids, labels = _batch(model)
    assert model(input_ids=ids, labels=labels).logits is not None
    npu_autopatch.enable(models=["qwen3"], loss=True)
    record = npu_autopatch.status()["qwen3"]
    assert "loss" in record.kernels
    assert any(where.endswith("Qwen3ForCausalLM.forward") for where in record.targets), record.targets
    assert "loss=True" in repr(_control.selection())
    assert "forward (loss)" in str(npu_autopatch.report(model))


def test_the_switch_follows_the_conventions_of_the_others():
    def resolve(environ, warn=print, kernels=None, **arguments):
        return _config.resolve(None, None, kernels, None, False, warn, ["qwen3"], environ, **arguments)

    assert not resolve({}).selects("loss")
    assert resolve({"NPU_AUTOPATCH_LOSS": "1"}).selects("loss")
    assert not resolve({"NPU_AUTOPATCH_LOSS": "1"}, loss=False).selects("loss")
    assert resolve({}, loss=True).selects("loss")
    with pytest.raises(TypeError, match="unexpected keyword argument 'lose'"):  # a typo is not ignored
        resolve({}, lose=True)
    warnings = []
    assert not resolve({"NPU_AUTOPATCH_LOSS": "maybe"}, warnings.append).selects("loss")
    assert warnings and "NPU_AUTOPATCH_LOSS" in warnings[0]
    with pytest.raises(ValueError, match="unknown kernels"):  # its own switch, not kernels=
        resolve({}, kernels=["loss"])


@pytest.mark.parametrize(
    "model_type, cls, why",
    [
        ("gemma2", "Gemma2ForCausalLM", "math differs"),  # final logit softcapping
        ("granite", "GraniteForCausalLM", "math differs"),  # logits / logits_scaling
        ("cohere", "CohereForCausalLM", "logit_scale"),
    ],
)
def test_a_head_that_does_more_is_refused_with_the_reason(model_type, cls, why):
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    variant, reason = choose_variant(KERNELS["loss"], getattr(module, cls).forward, live=True)
    assert variant is None and why in reason


def test_a_user_loss_function_takes_the_stock_forward(npu_stand_in):
    model = tiny_model("qwen3")
    ids, labels = _batch(model)
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, out.logits.float().mean())


def test_a_head_with_hooks_of_its_own_takes_the_stock_forward_once(npu_stand_in):
    """FSDP2 sharding the head alone, DeepSpeed, accelerate offload: their hooks see the real call."""
    model = tiny_model("qwen3")
    ids, labels = _batch(model)
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].shape))
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and seen == [(*ids.shape, model.config.hidden_size)]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_a_training_step_under_autocast_is_chunked_and_equals_stock_under_autocast(model_type, npu_stand_in):
    """Issue 35: HF Trainer(bf16=True), accelerate and TRL wrap the forward in autocast. The chunked
    loss runs there with autocast's semantics (the head's matmul in bf16, the loss in fp32): counted
    fused, no logits, stock's loss and every gradient within bf16 rounding, fp32 master weights
    getting fp32 gradients."""
    overrides = {"output_router_logits": True} if "moe" in model_type else {}
    model = tiny_model(model_type, **overrides)
    ids, labels = _batch(model)
    stock_loss, stock_grads, stock_out = _run(model, autocast=True, input_ids=ids, labels=labels)
    assert stock_out.logits is not None
    npu_autopatch.enable(models=[model_type], kernels=[], loss=True)
    loss, grads, out = _run(model, autocast=True, input_ids=ids, labels=labels)
    calls = npu_autopatch.status()[model_type].calls
    assert {"fused": 1, "stock": {}} in calls.values(), calls
    assert out.logits is None
    assert grads["lm_head.weight"].dtype == torch.float32
    _close(loss, stock_loss, torch.bfloat16)
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        _close(grad, stock_grads[name], torch.bfloat16)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_trainer_gives_the_same_losses_step_by_step(model_type, bf16, tmp_path, npu_stand_in, monkeypatch):
    """fp32, and bf16=True (the forward under autocast): every micro-batch takes the chunked loss."""
    stock = trainer_losses(tiny_model(model_type), tmp_path / "stock", prompts=True, bf16=bf16)
    npu_autopatch.enable(models=[model_type], kernels=[], loss=True)
    calls = []
    chunked = loss_kernel.linear_cross_entropy
    counted = lambda *a, **k: calls.append(k) or chunked(*a, **k)  # noqa: E731
    monkeypatch.setattr(loss_kernel, "linear_cross_entropy", counted)
    model = tiny_model(model_type)
    logits = []
    model.register_forward_hook(lambda module, args, out: logits.append(out.logits))
    patched = trainer_losses(model, tmp_path / "patched", prompts=True, bf16=bf16)
    record = npu_autopatch.status()[model_type]
    assert record.kernels == ("loss",)
    assert len(stock) == len(patched) == 4
    # Every micro-batch took the chunked loss, divided by the accumulation's token count.
    assert len(calls) == 8 and all(k["num_items_in_batch"] is not None for k in calls)
    assert {"fused": 8, "stock": {}} in record.calls.values() and logits == [None] * 8, record.calls
    torch.testing.assert_close(patched, stock, rtol=2e-2 if bf16 else 1e-4, atol=0)


def _router_logits(model, on):
    """The MoE auxiliary loss in the output (and so in the loss), wherever the config keeps the switch."""
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if hasattr(config, "output_router_logits"):
            config.output_router_logits = on


def _stock_runs(model, runs):
    """The stock results of the cases stock runs, the MoE auxiliary loss on if stock can add it.

    4.57's stock fails some: its VLMs do not pass shift_labels on (logits_to_keep), and its
    Qwen3-Omni thinker has no ``router_aux_loss_coef`` to add the auxiliary loss with.
    """
    for aux in (True, False):
        _router_logits(model, aux)
        stock = {}
        for case, run in runs.items():
            try:
                stock[case] = _run(model, **run)
            except (ValueError, AttributeError):
                assert V4, case
        if stock:
            return stock
    raise AssertionError("stock runs none of the cases")


@FULL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if present(t) and t not in NO_LOSS_TARGET])
def test_every_table_model_matches_stock_or_stays_stock_with_the_reason(model_type, dtype, npu_stand_in):
    """Each table model's trained head (testing.tiny's, a VLM with its image): padding, gradient
    accumulation and (where the forward takes it) logits_to_keep, every parameter's gradient."""
    model = tiny_model(model_type, dtype)
    inputs, _ = tiny.model_inputs(model)
    ids = inputs["input_ids"]
    labels = torch.where(ids < tiny.vocab_size(model.config), ids, -100)
    labels[0, :4] = -100
    cases = ["padding", "num_items_in_batch"]
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        cases.append("logits_to_keep")
    runs = {case: {**inputs, "labels": labels, **CASES[case](ids, labels)} for case in cases}
    stock = _stock_runs(model, runs)
    assert "padding" in stock
    npu_autopatch.enable(models=[model_type], kernels=[], loss=True)
    record = npu_autopatch.status()[model_type]
    head = type(model).__name__
    refused = REFUSED.get(head)
    if refused:
        assert any(head in where and refused in why.text for where, why in record.stock_reasons.items()), (
            record
        )
    for case, (stock_loss, stock_grads, _) in stock.items():
        loss, grads, out = _run(model, **runs[case])
        assert (out.logits is None) != bool(refused), (case, record.reason)
        _close(loss, stock_loss, dtype)
        assert grads.keys() == stock_grads.keys()
        for name, grad in grads.items():
            _close(grad, stock_grads[name], dtype)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_the_loss_kernel_matches_stock_on_every_release_profile(profile):
    """It calls no torch_npu op: every modelled release takes it, with the same result."""
    with stand_in(profile=profile):
        model = tiny_model("qwen3")
        ids, labels = _batch(model)
        stock_loss, stock_grads, _ = _run(model, input_ids=ids, labels=labels)
        npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
        assert npu_autopatch.status()["qwen3"].state == "applied"
        loss, grads, out = _run(model, input_ids=ids, labels=labels)
    assert out.logits is None
    _close(loss, stock_loss, torch.float32)
    for name, grad in grads.items():
        _close(grad, stock_grads[name], torch.float32)


@pytest.mark.parametrize("fullgraph", [True, pytest.param(False, marks=FULL)])
def test_under_torch_compile_the_stock_head_and_loss_run_in_the_graph(fullgraph, npu_stand_in):
    model = tiny_model("qwen3")
    ids, labels = _batch(model)
    stock_loss, stock_grads, _ = _run(model, input_ids=ids, labels=labels)
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
        loss, grads, out = _run(compiled, input_ids=ids, labels=labels)
    finally:
        torch._dynamo.reset()
    assert out.logits is not None
    _close(loss, stock_loss, torch.float32)
    for name, grad in grads.items():
        _close(grad, stock_grads[name.removeprefix("_orig_mod.")], torch.float32)
