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
import copy
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import npu_autopatch

from .._state import STATE
from . import tiny

# The tiny models are testing.tiny's: any model type, from its own config class, with a vision
# (and audio) tower fed an image (and a clip) where the model has one. One builder for our tests,
# ``scan``, ``verify`` and plugin authors.
model_batch = tiny.model_batch

# The few fields the generic builder's defaults leave unfit for parity: HunYuan-MoE's default
# config has one expert (real checkpoints have 64), which is no routing at all.
OVERRIDES = {"hunyuan_v1_moe": {"num_experts": 4}}


def tiny_config(model_type: str, **overrides):
    """testing.tiny's config of this model type, with OVERRIDES and then ``overrides`` applied."""
    return tiny.tiny_config(model_type, **{**OVERRIDES.get(model_type, {}), **overrides})


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """testing.tiny's model of this model type (the head a user trains), with OVERRIDES applied."""
    return tiny.tiny_model(model_type, dtype, seed, **{**OVERRIDES.get(model_type, {}), **overrides})


# max |patched - stock| / max |stock|, per tensor. fp32: only rounding order differs between
# a fused kernel and the eager code. bf16: a fused kernel rounds once where the eager code
# rounds after every op, and the differences add up over two layers and the backward pass.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}

# Gradients compared more loosely in bf16 (by the end of the parameter name): the decay of the
# Gated DeltaNet layers (Qwen3-Next, Qwen3.5), four values per layer, each a sum with heavy
# cancellation. One bf16 rounding upstream (the fused SwiGLU rounds once where the eager MLP
# rounds twice) moves them by several percent: over a few batches of the tiny models, stock
# bf16 is up to 1.4e-1 away from stock fp32 there, and patched from stock up to 8e-2. The
# fp32 runs hold them to TOLERANCE. LongCat-Flash's router weight likewise: its gradient sums the
# experts' outputs with heavy cancellation, and since the stand-in's sdpa runs the fused attention (one
# rounding where aten's sdpa rounds per op) its bf16 gradient moves by up to 1.1e-1 between two runs.
BF16_TOLERANCE = {"linear_attn.A_log": 1e-1, "linear_attn.dt_bias": 1e-1, "router.classifier.weight": 1.5e-1}


@dataclass
class ParityReport:
    """How one patched model compares with stock.

    ``passed``: every selected target runs its kernel (``applied``), or the ones left stock
    are gated because the installed torch_npu cannot run their kernel (``partial``, every code
    in ``stock`` ``kernel-unsupported``: the right decision, told in ``reason``); every
    gradient reached; and no tensor beyond its bound: ``tolerance``, or in bf16
    BF16_TOLERANCE for the parameters listed there (see also ``rounding`` and NOISE_FLOOR).
    ``logits_error``, ``grad_error`` and ``worst_tensor`` are the maxima over all tensors.
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
    rounding: tuple[str, ...] = ()  # bf16 tensors beyond it, but no further from fp32 than stock
    stock_seconds: float = float("nan")  # one forward and backward, stock
    patched_seconds: float = float("nan")  # the same, patched

    @property
    def passed(self) -> bool:
        gated = self.state == "partial" and all(code == "kernel-unsupported" for code in self.stock.values())
        return (self.state == "applied" or gated) and not self.missing_grads and not self.over_tolerance


# The global RNG seed of every training step: a model that draws random numbers in training (dropout
# the shrinking missed, DINOv3's rotary jitter) draws the same ones stock and patched, since the
# kernels draw none.
STEP_SEED = 0


def forward(model, input_ids, **inputs) -> torch.Tensor:
    """The main output of one training forward: the logits, else the last hidden state (a base model,
    a tower). The RNG is seeded with STEP_SEED, and the caller's RNG state left as it was.

    ``input_ids`` is None for a model without text input; ``inputs`` are its other inputs (images).
    """
    if input_ids is not None:
        inputs = {"input_ids": input_ids, **inputs}
    with torch.random.fork_rng():
        torch.manual_seed(STEP_SEED)
        output = model(**inputs)
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise tiny.TinyModelError(f"no tensor output in {type(output).__name__}")


def backward(model, output: torch.Tensor, labels: torch.Tensor):
    """(``output`` in fp32, {parameter name: gradient in fp32 or None}) after the backward of its loss.

    The loss is cross-entropy of the logits against ``labels`` when the model has an LM head, else a
    fixed random projection of its main output (base models, towers).
    """
    if (
        output.dim() == 3
        and output.shape[:2] == labels.shape
        and output.shape[-1] >= tiny.vocab_size(model.config)
    ):
        loss = torch.nn.functional.cross_entropy(output.float().flatten(0, 1), labels.flatten())
    else:
        gen = torch.Generator().manual_seed(0)
        loss = (output.float() * torch.randn(output.shape, generator=gen).to(output.device)).mean()
    loss.backward()
    grads = {
        name: None if p.grad is None else p.grad.detach().float().clone()
        for name, p in model.named_parameters()
    }
    return output.detach().float(), grads


def report_of(record, dtype: torch.dtype, **measured) -> ParityReport:
    """An empty ParityReport of a model patched as ``record`` (its status()) says, in ``dtype``'s
    tolerance; ``measured``: further fields (ops called, seconds). compare() fills in the errors."""
    return ParityReport(
        model=record.model,
        dtype=str(dtype).replace("torch.", ""),
        state=str(record.state),
        reason=record.reason,
        kernels=record.kernels,
        code=None if record.code is None else str(record.code),
        stock={target: str(code) for target, code in record.stock.items()},
        tolerance=TOLERANCE[dtype],
        **measured,
    )


def forward_backward(model, input_ids, labels, **inputs):
    """(main output in fp32, {parameter name: gradient in fp32 or None}) of one training step: the
    one step of the tests, ``scan``, ``verify`` and plugin authors (forward, then backward).

    ``input_ids`` is None for a model without text input; ``inputs`` are its other inputs (images).
    """
    model.zero_grad(set_to_none=True)
    return backward(model, forward(model, input_ids, **inputs), labels)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|; 0 for an empty tensor (DINOv3's zero register tokens)."""
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().clamp_min(1e-12)
    return ((got - expected).abs().max() / scale).item()


def errors_vs_fp64(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """How far ``got`` is from an fp64 ``reference``: the largest absolute error, the relative
    Frobenius error, and the share of elements more than one unit in the last place of ``dtype``
    (at the reference's own magnitude) away from it."""
    difference = (got.double() - reference).abs()
    exponent = torch.frexp(reference)[1].double() - 1  # |reference| in [2**e, 2**(e+1))
    ulp = torch.exp2(exponent) * torch.finfo(dtype).eps
    return {
        "max_abs": difference.max().item(),
        "rel_frobenius": (difference.norm() / reference.norm().clamp_min(1e-300)).item(),
        "over_ulp": (difference > ulp).double().mean().item(),
    }


def lm_head_loss_reference(
    hidden, weight, labels, dtype: torch.dtype, ignore_index: int = -100, rows: int = 1024
):
    """The gradients (hidden, weight) of the mean cross-entropy of ``hidden @ weight.T`` as stock's
    dtype flow makes them, with every matmul and sum in fp64: the logits and their gradient rounded
    to ``dtype`` where lm_head and its backward round them, nothing else. The floor a chunked or
    fused loss in ``dtype`` is held to (the hidden states and weight are already ``dtype`` values)."""
    hidden, weight = hidden.double(), weight.double()
    keep = labels != ignore_index
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
    for start in range(0, hidden.shape[0], rows):  # fp64 sums: chunked as exactly as not
        part = slice(start, start + rows)
        logits = (hidden[part] @ weight.T).to(dtype).double()
        grad = torch.softmax(logits, dim=-1)
        valid = keep[part].nonzero().squeeze(1)
        grad[valid, labels[part][valid]] -= 1
        grad = (grad * keep[part, None] / keep.sum()).to(dtype).double()
        grad_hidden[part] = grad @ weight
        grad_weight.addmm_(grad.T, hidden[part])
    return grad_hidden, grad_weight


# A gradient that is zero in exact arithmetic (the key bias of softmax attention, the router of a
# top-1 MoE whose weight is renormalised to 1) is rounding noise in both runs; relative to its own
# size the difference means nothing. Below this fraction of the largest stock gradient, in both
# runs, it counts as zero.
NOISE_FLOOR = 1e-6


def compare(report: ParityReport, stock, patched) -> ParityReport:
    """Fill in the errors: logits, the worst gradient, gradients that vanished, and the tensors
    beyond their bound (gradients that are rounding noise in both runs are not)."""
    (stock_logits, stock_grads), (patched_logits, patched_grads) = stock, patched
    errors = {"logits": relative_error(patched_logits, stock_logits)}
    largest = max(
        (g.abs().max().item() for g in stock_grads.values() if g is not None and g.numel()), default=0
    )
    missing = []
    for name, expected in stock_grads.items():
        got = patched_grads.get(name)
        if expected is not None and got is None:
            missing.append(name)
        elif expected is not None and not _noise(expected, got, NOISE_FLOOR * largest):
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


def _noise(expected: torch.Tensor, got: torch.Tensor, floor: float) -> bool:
    return expected.numel() > 0 and max(expected.abs().max().item(), got.abs().max().item()) < floor


def closer_to_fp32(report: ParityReport, model, batch, stock, patched) -> ParityReport:
    """Accept the bf16 tensors beyond tolerance only because stock bf16 rounds more.

    A fused kernel rounds once where the eager code rounds after every op, so in bf16 the patched
    result can be closer to the exact one than stock is (an MoE router's gradient, summed with
    heavy cancellation). Such a tensor passes when patched is no further from the fp32 run of the
    same weights and inputs than stock bf16 is, plus the tolerance; it is named in ``rounding``.
    """
    if report.dtype != "bfloat16" or not report.over_tolerance:
        return report
    input_ids, labels, inputs = batch
    reference = copy.deepcopy(model).float()
    exact = forward_backward(
        reference,
        input_ids,
        labels,
        **{k: v.float() if v.is_floating_point() else v for k, v in inputs.items()},
    )
    accepted = []
    for name in report.over_tolerance:
        param = name.removeprefix("grad of ")
        tensors = (
            (patched[0], stock[0], exact[0])
            if name == "logits"
            else (patched[1][param], stock[1][param], exact[1].get(param))
        )
        got, want, truth = tensors
        if truth is not None and relative_error(got, truth) <= relative_error(want, truth) + report.tolerance:
            accepted.append(name)
    report.rounding = tuple(accepted)
    report.over_tolerance = tuple(name for name in report.over_tolerance if name not in accepted)
    return report


def check_parity(
    model_type: str,
    dtype: torch.dtype = torch.float32,
    npu=None,
    lazy: bool = False,
    kernels: Sequence[str] | None = None,
    device: str = "cpu",
    seed: int = 1,
    integrations: Sequence[str] = (),
    **overrides,
) -> ParityReport:
    """Stock vs patched for one model, in one process; patching is left disabled.

    ``lazy=False`` builds the model stock, then patches the imported module (the
    already-imported path). ``lazy=True`` enables patching before the modeling module is
    imported, so the post-import hook patches it (the path of NPU_AUTOPATCH=1); it needs a
    process that has not imported that module yet. ``npu`` is the torch_npu module whose
    ``calls`` counter (the stand-in has one) tells which ops ran. ``kernels`` selects kernels
    as ``enable()`` does (default: all); ``seed`` draws the batch; ``overrides`` replace fields of
    the tiny (text) config; ``integrations``: table entries that are no model type patched beside it
    (``activations``: the activation classes every model instantiates).
    """
    if npu_autopatch.is_enabled():
        npu_autopatch.disable()
    calls = getattr(npu, "calls", None)
    if lazy:
        module = STATE.models[model_type].module  # the registry: a registered model too
        if module in sys.modules:
            raise RuntimeError(f"lazy parity needs a process that has not imported {module}")
        # the hook patches the module on import
        npu_autopatch.enable(models=[model_type, *integrations], kernels=kernels)
    model = tiny_model(model_type, dtype, **overrides).to(device)
    input_ids, labels, inputs = (_to(t, device) for t in model_batch(model, seed))
    # Counted from here: building the batch runs a vision tower once to size its placeholders.
    before = collections.Counter(calls) if calls is not None else collections.Counter()
    if not lazy:
        stock, stock_seconds = _timed(device, forward_backward, model, input_ids, labels, **inputs)
        # Patches the imported module at once; the model, built before, gets the kernels too.
        npu_autopatch.enable(models=[model_type, *integrations], kernels=kernels)
    try:
        record = npu_autopatch.status()[model_type]
        patched, patched_seconds = _timed(device, forward_backward, model, input_ids, labels, **inputs)
    finally:
        npu_autopatch.disable()
    if lazy:
        stock, stock_seconds = _timed(device, forward_backward, model, input_ids, labels, **inputs)
    ops = dict(collections.Counter(calls) - before) if calls is not None else {}
    report = report_of(
        record, dtype, ops_called=ops, stock_seconds=stock_seconds, patched_seconds=patched_seconds
    )
    compare(report, stock, patched)
    return closer_to_fp32(report, model, (input_ids, labels, inputs), stock, patched)


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
