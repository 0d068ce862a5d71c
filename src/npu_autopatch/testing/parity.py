"""Parity of patched vs stock transformers on tiny random models: the proof of every patch.

One implementation for the project's tests and for users (and plugin authors) checking a
patch: build a tiny random model (no download), run forward and backward stock, patch it
with the public API, run again on the same weights and inputs, undo the patch, and compare
the logits and the gradient of every parameter. Also reports which torch_npu ops ran.

Needs torch and transformers; the caller provides torch_npu (the real one on an NPU, or the
CPU stand-in from ``npu_autopatch.testing.stand_in()``).
"""

from __future__ import annotations

import collections
import inspect
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import npu_autopatch

from ..models import MODELS

# Shared tiny dimensions: hidden 64, two layers, GQA, small vocabulary.
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# MoE models without shared experts: a dense first layer, so that the dense MLP runs too; three
# layers keep two sparse ones.
_DENSE_FIRST = {"num_hidden_layers": 3, "mlp_only_layers": [0]}
# The Gated DeltaNet layers of Qwen3-Next and Qwen3.5; the default layer types put full attention
# on every 4th layer.
_LINEAR_ATTENTION = {
    "num_hidden_layers": 4,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}

# Per-model additions to TINY, keyed by model type (checked to build on 4.57 and 5.x).
EXTRA = {
    "qwen3": {"head_dim": 16},
    "glm4": {"head_dim": 16},
    "gemma3": {"head_dim": 16, "sliding_window": 16},
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 64},
    "qwen3_moe": {**_MOE, **_DENSE_FIRST, "head_dim": 16, "decoder_sparse_step": 1, "norm_topk_prob": True},
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
    "glm4_moe": {
        "head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5,
    },
    "qwen3_next": {**_MOE, **_LINEAR_ATTENTION, "head_dim": 16, "shared_expert_intermediate_size": 32},
    # Vision-language models: these are the fields of the text model (see VISION below).
    "qwen2_5_vl": {"head_dim": 16},
    "qwen3_vl": {"head_dim": 16},
    "qwen3_vl_moe": {**_MOE, **_DENSE_FIRST, "head_dim": 16, "decoder_sparse_step": 1},
    "qwen3_5": {**_LINEAR_ATTENTION, "head_dim": 32},
    "qwen3_5_moe": {**_MOE, **_LINEAR_ATTENTION, "head_dim": 32, "shared_expert_intermediate_size": 32},
}

# Where our model type and the config's model type differ.
CONFIG_TYPE = {"gemma3": "gemma3_text"}

# Vision-language models are built whole (text model + a one-block vision tower) and fed one
# image per sample, so that the vision tower's norms, MLPs and rotary embedding run too.
VISION = {
    "qwen2_5_vl": {"fullatt_block_indexes": [0]},
    "qwen3_vl": {"deepstack_visual_indexes": [0], "num_position_embeddings": 16},
    "qwen3_vl_moe": {"deepstack_visual_indexes": [0], "num_position_embeddings": 16},
    "qwen3_5": {"num_position_embeddings": 16},
    "qwen3_5_moe": {"num_position_embeddings": 16},
}
_TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}

# Multimodal rotary sections (T, H, W) of the text model: they sum to half the rotary dims.
MROPE = {
    "qwen2_5_vl": {"mrope_section": [2, 3, 3]},
    "qwen3_vl": {"mrope_section": [4, 2, 2], "mrope_interleaved": True},
    "qwen3_vl_moe": {"mrope_section": [4, 2, 2], "mrope_interleaved": True},
    "qwen3_5": {"mrope_section": [2, 1, 1], "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    "qwen3_5_moe": {"mrope_section": [2, 1, 1], "mrope_interleaved": True, "partial_rotary_factor": 0.25},
}

# Special tokens of the tiny vocabulary; the text of a batch is drawn below them.
IMAGE_TOKENS = {
    "image_token_id": 120,
    "video_token_id": 121,
    "vision_start_token_id": 122,
    "vision_end_token_id": 123,
}
_IMAGE_GRID = (1, 4, 4)  # temporal, height, width patches of each image

# max |patched - stock| / max |stock|, per tensor. fp32: only rounding order differs between
# a fused kernel and the eager code. bf16: a fused kernel rounds once where the eager code
# rounds after every op, and the differences add up over two layers and the backward pass.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}

# Gradients compared more loosely in bf16 (by the end of the parameter name): the decay of the
# Gated DeltaNet layers (Qwen3-Next, Qwen3.5), four values per layer, each a sum with heavy
# cancellation. One bf16 rounding upstream (the fused SwiGLU rounds once where the eager MLP
# rounds twice) moves them by several percent: over a few batches of the tiny models, stock
# bf16 is up to 1.4e-1 away from stock fp32 there, and patched from stock up to 8e-2. The
# fp32 runs hold them to TOLERANCE.
BF16_TOLERANCE = {"linear_attn.A_log": 1e-1, "linear_attn.dt_bias": 1e-1}


@dataclass
class ParityReport:
    """How one patched model compares with stock.

    ``passed``: every selected target runs its kernel (``applied``), or the ones left stock
    are gated because the installed torch_npu cannot run their kernel (``partial``, every code
    in ``stock`` ``kernel-unsupported``: the right decision, told in ``reason``); every
    gradient reached; and no tensor beyond its bound: ``tolerance``, or in bf16
    BF16_TOLERANCE for the parameters listed there. ``logits_error``, ``grad_error`` and
    ``worst_tensor`` are the maxima over all tensors.
    """

    model: str
    dtype: str
    state: str  # the model's status() state while patched
    reason: str | None
    kernels: tuple[str, ...]
    code: str | None = None  # the status() reason code
    stock: dict[str, str] = field(default_factory=dict)  # selected targets left stock -> their code
    ops_called: dict[str, int] = field(default_factory=dict)
    logits_error: float = float("nan")
    grad_error: float = float("nan")
    worst_tensor: str = ""
    missing_grads: tuple[str, ...] = ()  # parameters with a stock gradient but none patched
    tolerance: float = 0.0
    over_tolerance: tuple[str, ...] = ()  # "logits" or "grad of ..." beyond their bound
    stock_seconds: float = float("nan")  # one forward and backward, stock
    patched_seconds: float = float("nan")  # the same, patched

    @property
    def passed(self) -> bool:
        gated = self.state == "partial" and all(code == "kernel-unsupported" for code in self.stock.values())
        return (self.state == "applied" or gated) and not self.missing_grads and not self.over_tolerance


def tiny_config(model_type: str, **overrides):
    """The tiny config of this model type; ``overrides`` replace fields of the (text) model."""
    import transformers

    fields = {**TINY, **EXTRA.get(model_type, {}), **overrides}
    if model_type not in VISION:
        return transformers.AutoConfig.for_model(CONFIG_TYPE.get(model_type, model_type), **fields)
    del fields["tie_word_embeddings"]  # a field of the whole model
    if int(transformers.__version__.split(".")[0]) >= 5:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, **MROPE[model_type]}
    else:
        fields["rope_scaling"] = {"rope_type": "default", **MROPE[model_type]}
    return transformers.AutoConfig.for_model(
        model_type,
        text_config=fields,
        vision_config={**_TINY_VISION, **VISION[model_type]},
        tie_word_embeddings=False,
        **IMAGE_TOKENS,
    )


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random model of this type, in ``dtype``, initialised from ``seed``.

    A causal LM; for the vision-language models the whole image-text model.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if model_type in VISION else AutoModelForCausalLM
    model = auto.from_config(config)
    return model.to(dtype).train()


def tiny_batch(vocab_size: int = TINY["vocab_size"], seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (2, 8), generator=gen)
    labels = torch.randint(1, vocab_size, (2, 8), generator=gen)
    return input_ids, labels


def tiny_image_batch(config, seed: int = 1):
    """(input_ids, labels, image inputs) of two samples with one image each, for a VL ``config``.

    Each sample is two text tokens, <vision_start>, the image's tokens (one per 2x2 merged
    patches), <vision_end> and four text tokens. The image inputs are ``pixel_values`` and
    ``image_grid_thw``, plus ``mm_token_type_ids`` (1 at image tokens), which 5.x requires.
    """
    vision = config.vision_config
    t, h, w = _IMAGE_GRID
    patches = t * h * w
    image_tokens = patches // vision.spatial_merge_size**2
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1, min(IMAGE_TOKENS.values()), (2, 6), generator=gen)
    image = torch.full((2, image_tokens), IMAGE_TOKENS["image_token_id"])
    start = torch.full((2, 1), IMAGE_TOKENS["vision_start_token_id"])
    end = torch.full((2, 1), IMAGE_TOKENS["vision_end_token_id"])
    input_ids = torch.cat((text[:, :2], start, image, end, text[:, 2:]), dim=1)
    labels = torch.randint(1, config.get_text_config().vocab_size, input_ids.shape, generator=gen)
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    inputs = {
        "pixel_values": torch.randn(2 * patches, patch_dim, generator=gen),
        "image_grid_thw": torch.tensor([_IMAGE_GRID, _IMAGE_GRID]),
        "mm_token_type_ids": (input_ids == IMAGE_TOKENS["image_token_id"]).long(),
    }
    return input_ids, labels, inputs


def model_batch(model, seed: int = 1):
    """(input_ids, labels, other inputs) for this tiny model: text, or text and images."""
    config = model.config
    if not hasattr(config, "vision_config"):
        return (*tiny_batch(config.vocab_size, seed), {})
    input_ids, labels, inputs = tiny_image_batch(config, seed)
    accepted = inspect.signature(model.forward).parameters
    inputs = {name: value for name, value in inputs.items() if name in accepted}  # 4.57: no mm_token_type_ids
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    return input_ids, labels, inputs


def forward_backward(model, input_ids, labels, **inputs):
    """(logits in fp32, {parameter name: gradient in fp32 or None}) of one training step.

    ``inputs`` are further model inputs (images).
    """
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, **inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {
        name: None if p.grad is None else p.grad.detach().float().clone()
        for name, p in model.named_parameters()
    }
    return logits.detach().float(), grads


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-12)
    return ((got - expected).abs().max() / scale).item()


def compare(report: ParityReport, stock, patched) -> ParityReport:
    """Fill in the errors: logits, the worst gradient, gradients that vanished, and the tensors
    beyond their bound."""
    (stock_logits, stock_grads), (patched_logits, patched_grads) = stock, patched
    errors = {"logits": relative_error(patched_logits, stock_logits)}
    missing = []
    for name, expected in stock_grads.items():
        got = patched_grads.get(name)
        if expected is not None and got is None:
            missing.append(name)
        elif expected is not None:
            errors[f"grad of {name}"] = relative_error(got, expected)
    loose = BF16_TOLERANCE if report.dtype == "bfloat16" else {}
    report.over_tolerance = tuple(
        name
        for name, error in errors.items()
        if error > next((t for end, t in loose.items() if name.endswith(end)), report.tolerance)
    )
    report.logits_error = errors.pop("logits")
    report.grad_error = max(errors.values(), default=0.0)
    report.worst_tensor = max(errors, key=errors.get, default="logits")
    report.missing_grads = tuple(missing)
    return report


def check_parity(
    model_type: str,
    dtype: torch.dtype = torch.float32,
    npu=None,
    lazy: bool = False,
    kernels: Sequence[str] | None = None,
    device: str = "cpu",
    **overrides,
) -> ParityReport:
    """Stock vs patched for one model, in one process; patching is left disabled.

    ``lazy=False`` builds the model stock, then patches the imported module (the
    already-imported path). ``lazy=True`` enables patching before the modeling module is
    imported, so the post-import hook patches it (the path of NPU_AUTOPATCH=1); it needs a
    process that has not imported that module yet. ``npu`` is the torch_npu module whose
    ``calls`` counter (the stand-in has one) tells which ops ran. ``kernels`` selects kernels
    as ``enable()`` does (default: all); ``overrides`` replace fields of the tiny (text) config.
    """
    if npu_autopatch.is_enabled():
        npu_autopatch.disable()
    calls = getattr(npu, "calls", None)
    before = collections.Counter(calls) if calls is not None else collections.Counter()
    if lazy:
        module = MODELS[model_type].module
        if module in sys.modules:
            raise RuntimeError(f"lazy parity needs a process that has not imported {module}")
        npu_autopatch.enable(models=[model_type], kernels=kernels)  # the hook patches the module on import
    model = tiny_model(model_type, dtype, **overrides).to(device)
    input_ids, labels, inputs = (_to(t, device) for t in model_batch(model))
    if not lazy:
        stock, stock_seconds = _timed(device, forward_backward, model, input_ids, labels, **inputs)
        npu_autopatch.enable(models=[model_type], kernels=kernels)  # patches the imported module at once
        use_patched_experts(model, model_type)
    try:
        record = npu_autopatch.status()[model_type]
        patched, patched_seconds = _timed(device, forward_backward, model, input_ids, labels, **inputs)
    finally:
        npu_autopatch.disable()
    if lazy:
        stock, stock_seconds = _timed(device, forward_backward, model, input_ids, labels, **inputs)
    ops = dict(collections.Counter(calls) - before) if calls is not None else {}
    report = ParityReport(
        model=model_type,
        dtype=str(dtype).replace("torch.", ""),
        state=str(record.state),
        reason=record.reason,
        kernels=record.kernels,
        code=None if record.code is None else str(record.code),
        stock={target: str(code) for target, code in record.stock.items()},
        ops_called=ops,
        tolerance=TOLERANCE[dtype],
        stock_seconds=stock_seconds,
        patched_seconds=patched_seconds,
    )
    return compare(report, stock, patched)


def use_patched_experts(model, model_type):
    """transformers 5.x: a model built before patching keeps the experts implementation it
    resolved then; switch it to the patched one, as a user would."""
    from .._experts import KEY

    if "moe" in npu_autopatch.status()[model_type].kernels and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(KEY)


def _to(batch, device):
    if isinstance(batch, dict):
        return {name: value.to(device) for name, value in batch.items()}
    return batch.to(device)


def _timed(device, fn, *args, **kwargs):
    """(result, wall seconds), waiting for the device to finish."""
    synchronize = getattr(getattr(torch, device, None), "synchronize", None)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    if synchronize is not None:
        synchronize()
    return result, time.perf_counter() - start
