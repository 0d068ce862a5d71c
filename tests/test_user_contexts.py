"""Issue 24: every kernel in the torch contexts users run models in, patched against stock.

Evaluation loops, pipelines and RL rollouts run under ``torch.inference_mode()`` or ``torch.no_grad()``;
mixed-precision training (HF Trainer ``bf16=True``, accelerate) runs the forward under CPU/NPU autocast.
Each kernel's model runs a forward in each context and a training step where it applies, stock first
and then patched (every kernel, the opt-in loss too), in one fresh interpreter on the stand-in
(transformers decides whether it runs on an NPU once per process). Flash attention on the NPU is held
to eager attention on the same weights, for a padded batch and for packed sequences (by position_ids
and by ``cu_seq_lens_q/k``). Before the fixes of issue 24, the loss kernel's training step under
autocast raised TypeError, and FA2 on the NPU under inference_mode raised RuntimeError (inference tensors
have no version counter).
"""

import json
import sys
import textwrap

import pytest
import torch

import npu_autopatch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import tiny_model

from .conftest import child_env, warm_run
from .test_trainers import trainer_losses

CHILD = textwrap.dedent(
    """
    import contextlib, copy, json
    import torch
    from npu_autopatch.testing import stand_in
    from npu_autopatch.testing.parity import tiny_config, tiny_model

    CONTEXTS = {
        "grad": contextlib.nullcontext,
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }
    TRAINED_IN = ("grad", "autocast_bf16")  # the contexts a training step runs in
    # One model per kernel: qwen3 (rms_norm, swiglu, rope, and the loss), qwen3_moe (moe),
    # qwen3_next (gated_delta_rule, gated_rms_norm).
    MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next")


    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


    def forwards_and_steps(models, ids, labels):
        out = {}
        for name, model in models.items():
            for context, make in CONTEXTS.items():
                model.eval()
                with make():
                    out[f"{name}/{context}/forward"] = model(input_ids=ids).logits.float().clone()
                if context not in TRAINED_IN:
                    continue
                model.train()
                model.zero_grad(set_to_none=True)
                with make():
                    loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                out[f"{name}/{context}/loss"] = loss.detach().float().clone()
                for pname, p in model.named_parameters():
                    if p.grad is not None and p.grad.abs().max() > 0:
                        out[f"{name}/{context}/grad/{pname}"] = p.grad.float().clone()
        return out


    def attention_cases(fa, eager, vocab):
        # Flash attention on the NPU against eager on the same weights, per context.
        torch.manual_seed(1)
        ids = torch.randint(1, vocab, (2, 10))
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[1, 7:] = 0
        lengths = [6, 8]
        packed = torch.randint(1, vocab, (1, sum(lengths)))
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        cu = torch.tensor([0, 6, 14], dtype=torch.int32)
        varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 8, "max_length_k": 8}
        errors, outputs = {}, {}
        for context, make in CONTEXTS.items():
            for model in (fa, eager):
                model.eval()
            with make():
                valid = mask.bool()
                alone = torch.cat([eager(chunk).logits for chunk in packed.split(lengths, dim=1)], dim=1)
                outputs[context] = (
                    fa(ids, attention_mask=mask).logits[valid],
                    fa(packed, position_ids=positions).logits,
                    fa(packed, position_ids=positions, **varlen).logits,
                )
                padded_eager = eager(ids, attention_mask=mask).logits[valid]
                errors[f"{context}/padded"] = rel(outputs[context][0], padded_eager)
                errors[f"{context}/packed"] = rel(outputs[context][1], alone)
                errors[f"{context}/cu_seq_lens"] = rel(outputs[context][2], alone)
        # inference_mode gives exactly what no_grad gives (the same ops, no cache to differ by)
        same = all(torch.equal(a, b) for a, b in zip(outputs["inference_mode"], outputs["no_grad"]))
        return errors, same


    with stand_in() as npu:
        import npu_autopatch
        from transformers import AutoModelForCausalLM

        models = {name: tiny_model(name) for name in MODEL_TYPES}
        vocab = min(m.config.vocab_size for m in models.values())
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2, 12), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100
        stock = forwards_and_steps(models, ids, labels)

        npu_autopatch.enable(loss=True)  # every kernel, the opt-in loss too
        states = {name: npu_autopatch.status()[name].state.value for name in MODEL_TYPES}
        before = dict(npu.calls)
        patched = forwards_and_steps(models, ids, labels)
        fused = {op: n - before.get(op, 0) for op, n in npu.calls.items() if n > before.get(op, 0)}

        cfg = tiny_config("qwen3")
        torch.manual_seed(0)
        fa = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2")
        eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
        eager.load_state_dict(fa.state_dict())
        attention_before = npu.calls["npu_fusion_attention"]
        attention, inference_equals_no_grad = attention_cases(fa, eager, cfg.vocab_size)
        attention_calls = npu.calls["npu_fusion_attention"] - attention_before

    print("RESULT" + json.dumps({
        "states": states,
        "errors": {key: rel(patched[key], stock[key]) for key in stock},
        "missing": sorted(set(stock) ^ set(patched)),
        "fused": fused,
        "attention": attention,
        "attention_calls": attention_calls,
        "inference_equals_no_grad": inference_equals_no_grad,
        "flash_attention_state": npu_autopatch.status()["npu_flash_attention"].state.value,
    }))
    """
)

# max |patched - stock| / max |stock|: fp32 to rounding order; under bf16 autocast the fused kernels
# round once where stock's ops round after each, and the gated DeltaNet decay gradients (a sum with
# heavy cancellation) move most: as testing.parity's bf16 tolerances.
TOLERANCE = {"grad": 1e-4, "no_grad": 1e-4, "inference_mode": 1e-4, "autocast_bf16": 4e-2}
LOOSER = {"linear_attn.A_log": 1.5e-1, "linear_attn.dt_bias": 1.5e-1}


@pytest.fixture(scope="module")
def result():
    run = warm_run([sys.executable, "-c", CHILD], env=child_env(), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_every_kernel_is_applied_and_its_ops_are_called(result):
    assert result["states"] == {"qwen3": "applied", "qwen3_moe": "applied", "qwen3_next": "applied"}
    for op in ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_grouped_matmul"):
        assert result["fused"].get(op, 0) > 0, (op, result["fused"])


@pytest.mark.parametrize("context", list(TOLERANCE))
def test_every_forward_and_training_step_matches_stock(result, context):
    assert result["missing"] == []  # the same outputs and gradients came back, no step raised
    errors = {key: error for key, error in result["errors"].items() if key.split("/")[1] == context}
    assert errors, "no case ran in this context"
    too_far = {
        key: error
        for key, error in errors.items()
        if error > max([TOLERANCE[context]] + [t for end, t in LOOSER.items() if key.endswith(end)])
    }
    assert too_far == {}


@pytest.mark.parametrize("context", list(TOLERANCE))
def test_flash_attention_on_the_npu_matches_eager_for_padded_and_packed_batches(result, context):
    assert result["flash_attention_state"] == "applied"
    assert result["inference_equals_no_grad"] is True
    # two layers, three forwards, four contexts: every call reached the fused op
    assert result["attention_calls"] == 2 * 3 * len(TOLERANCE)
    errors = {key: error for key, error in result["attention"].items() if key.startswith(f"{context}/")}
    assert len(errors) == 3
    assert all(error <= TOLERANCE[context] for error in errors.values()), errors


def test_the_loss_kernel_under_autocast_runs_chunked_and_stocks_error_stays_stocks():
    """In-process, the case of issue 24's report: a bf16 autocast training step with the loss switch on
    (it raised TypeError). Since issue 35 the chunked loss runs there, with autocast's semantics; the
    path that raised, the stock head's loss on the captured hidden states, gives stock's own error."""
    model = tiny_model("qwen3")
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with stand_in():
        # Stock on the device too: its attention (sdpa) is torch_npu's there, not torch's CPU kernel.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stock = model(input_ids=ids, labels=ids)
        npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            calls = npu_autopatch.status()["qwen3"].calls
        finally:
            npu_autopatch.disable()
    assert out.logits is None  # the chunked loss ran
    assert {"fused": 1, "stock": {}} in calls.values(), calls
    torch.testing.assert_close(out.loss, stock.loss, rtol=2e-2, atol=0)
    # labels that do not fit the logits: stock's own error, not ours
    with pytest.raises(ValueError), stand_in(), torch.autocast("cpu", dtype=torch.bfloat16):
        npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
        model(input_ids=ids, labels=ids[:, :5])


@pytest.mark.parametrize("loss", [False, True], ids=["loss-off", "loss-on"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_hf_trainer_gives_stock_losses_in_fp32_and_bf16(bf16, loss, tmp_path, npu_stand_in):
    """``Trainer(bf16=True)`` wraps the forward in autocast (accelerate): the first step used to raise
    with the loss switch on. Every kernel on; the same losses as stock, step by step."""
    stock = trainer_losses(tiny_model("qwen3"), tmp_path / "stock", prompts=True, bf16=bf16)
    npu_autopatch.enable(models=["qwen3"], loss=loss)
    patched = trainer_losses(tiny_model("qwen3"), tmp_path / "patched", prompts=True, bf16=bf16)
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "applied" and ("loss" in record.kernels) == loss, record
    assert npu_stand_in.calls["npu_rms_norm"] > 0 and npu_stand_in.calls["npu_swiglu"] > 0
    assert len(stock) == len(patched) == 4
    torch.testing.assert_close(patched, stock, rtol=2e-2 if bf16 else 1e-4, atol=0)
