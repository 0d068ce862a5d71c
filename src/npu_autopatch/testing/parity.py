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
import sys
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

# Per-model additions to TINY, keyed by model type (checked to build on 4.57 and 5.x).
EXTRA = {
    "qwen3": {"head_dim": 16},
    "glm4": {"head_dim": 16},
    "gemma3": {"head_dim": 16, "sliding_window": 16},
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 64},
    "qwen3_moe": {**_MOE, "head_dim": 16, "decoder_sparse_step": 1, "norm_topk_prob": True},
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
    "qwen3_next": {
        **_MOE,
        "num_hidden_layers": 4,  # the default layer types put full attention on every 4th layer
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "shared_expert_intermediate_size": 32,
    },
}

# Where our model type and the config's model type differ.
CONFIG_TYPE = {"gemma3": "gemma3_text"}

# max |patched - stock| / max |stock|, per tensor. fp32: only rounding order differs between
# a fused kernel and the eager code. bf16: a fused kernel rounds once where the eager code
# rounds after every op, and the differences add up over two layers and the backward pass.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


@dataclass
class ParityReport:
    """How one patched model compares with stock."""

    model: str
    dtype: str
    state: str  # the model's status() state while patched
    reason: str | None
    kernels: tuple[str, ...]
    ops_called: dict[str, int] = field(default_factory=dict)
    logits_error: float = float("nan")
    grad_error: float = float("nan")
    worst_tensor: str = ""
    missing_grads: tuple[str, ...] = ()  # parameters with a stock gradient but none patched
    tolerance: float = 0.0

    @property
    def passed(self) -> bool:
        return (
            self.state == "applied"
            and not self.missing_grads
            and self.logits_error <= self.tolerance
            and self.grad_error <= self.tolerance
        )


def tiny_config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        CONFIG_TYPE.get(model_type, model_type), **{**TINY, **EXTRA.get(model_type, {})}
    )


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny random causal LM of this type, in ``dtype``, initialised from ``seed``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()


def tiny_batch(vocab_size: int = TINY["vocab_size"], seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (2, 8), generator=gen)
    labels = torch.randint(1, vocab_size, (2, 8), generator=gen)
    return input_ids, labels


def forward_backward(model, input_ids, labels):
    """(logits in fp32, {parameter name: gradient in fp32 or None}) of one training step."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
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
    """Fill in the errors: logits, the worst gradient, and gradients that vanished."""
    (stock_logits, stock_grads), (patched_logits, patched_grads) = stock, patched
    errors = {"logits": relative_error(patched_logits, stock_logits)}
    missing = []
    for name, expected in stock_grads.items():
        got = patched_grads.get(name)
        if expected is not None and got is None:
            missing.append(name)
        elif expected is not None:
            errors[f"grad of {name}"] = relative_error(got, expected)
    report.logits_error = errors.pop("logits")
    report.grad_error = max(errors.values(), default=0.0)
    report.worst_tensor = max(errors, key=errors.get, default="logits")
    report.missing_grads = tuple(missing)
    return report


def check_parity(
    model_type: str, dtype: torch.dtype = torch.float32, npu=None, lazy: bool = False
) -> ParityReport:
    """Stock vs patched for one model, in one process; patching is left disabled.

    ``lazy=False`` builds the model stock, then patches the imported module (the
    already-imported path). ``lazy=True`` enables patching before the modeling module is
    imported, so the post-import hook patches it (the path of NPU_AUTOPATCH=1); it needs a
    process that has not imported that module yet. ``npu`` is the torch_npu module whose
    ``calls`` counter (the stand-in has one) tells which ops ran.
    """
    if npu_autopatch.is_enabled():
        npu_autopatch.disable()
    calls = getattr(npu, "calls", None)
    before = collections.Counter(calls) if calls is not None else collections.Counter()
    if lazy:
        module = MODELS[model_type].module
        if module in sys.modules:
            raise RuntimeError(f"lazy parity needs a process that has not imported {module}")
        npu_autopatch.enable(models=[model_type])  # the hook patches the module on import
    model = tiny_model(model_type, dtype)
    batch = tiny_batch(model.config.vocab_size)
    if not lazy:
        stock = forward_backward(model, *batch)
        npu_autopatch.enable(models=[model_type])  # patches the imported module at once
    try:
        record = npu_autopatch.status()[model_type]
        patched = forward_backward(model, *batch)
    finally:
        npu_autopatch.disable()
    if lazy:
        stock = forward_backward(model, *batch)
    ops = dict(collections.Counter(calls) - before) if calls is not None else {}
    report = ParityReport(
        model=model_type,
        dtype=str(dtype).replace("torch.", ""),
        state=record.state,
        reason=record.reason,
        kernels=record.kernels,
        ops_called=ops,
        tolerance=TOLERANCE[dtype],
    )
    return compare(report, stock, patched)
