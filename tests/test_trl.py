"""TRL's trainers, stock vs patched, loss by loss: the trainers Ascend users run as they ship.

``SFTTrainer`` with TRL's own defaults (bf16 and gradient checkpointing on), its padding-free mode
(sequences flattened into one row, FA2 on the NPU: the attention and the packed-sequence paths), and
``GRPOTrainer`` (generation, then the policy loss). The same weights and data give the same loss at
every step, the fused ops run, and no target is demoted.
"""

import collections
import json
import textwrap

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import npu_autopatch
from npu_autopatch.testing.parity import tiny_model

from .conftest import FULL, ROOT, child_result

trl = pytest.importorskip("trl")

STEPS = 4
# TRL logs the loss to 4 significant digits; in bf16 the fused kernels round once where the eager
# code rounds after every op, and Adam carries that into the next steps.
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's vocabulary (``t0`` ... plus pad and eos): no download."""
    words = {f"t{i}": i for i in range(vocab - 2)}
    words.update({"<pad>": vocab - 2, "<eos>": vocab - 1})
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def texts(vocab: int, rows: int = 16, column: str = "text", lengths=(5, 14)) -> datasets.Dataset:
    """Fixed random documents of different lengths, so batches are padded (or packed)."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(*lengths, (rows,), generator=generator)
    words = [torch.randint(0, vocab - 2, (int(n),), generator=generator) for n in sizes]
    return datasets.Dataset.from_dict({column: [" ".join(f"t{int(i)}" for i in row) for row in words]})


COMMON = dict(
    per_device_train_batch_size=4,
    max_steps=STEPS,
    logging_steps=1,
    learning_rate=1e-3,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    seed=0,
    dataloader_num_workers=0,
)


def sft_losses(model, tmp_path, **arguments) -> list[float]:
    """The logged loss of each step of an SFTTrainer run with TRL's defaults, plus ``arguments``."""
    args = trl.SFTConfig(output_dir=str(tmp_path), **COMMON, **arguments)
    vocab = model.config.vocab_size
    data, words = texts(vocab), tokenizer(vocab)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=words)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def fused_ops_during(npu_stand_in, run):
    before = collections.Counter(npu_stand_in.calls)
    result = run()
    return result, collections.Counter(npu_stand_in.calls) - before


@pytest.mark.parametrize("model_type", ["qwen3", pytest.param("qwen3_moe", marks=FULL)])
def test_sft_trainer_with_its_defaults_matches_stock_step_by_step(model_type, tmp_path, npu_stand_in):
    defaults = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert defaults.bf16 and defaults.gradient_checkpointing  # what TRL ships, and what this test runs
    stock = sft_losses(tiny_model(model_type), tmp_path / "stock")
    npu_autopatch.enable(models=[model_type])
    patched, ran = fused_ops_during(
        npu_stand_in, lambda: sft_losses(tiny_model(model_type), tmp_path / "patched")
    )
    record = npu_autopatch.status()[model_type]
    assert record.state == "applied", record.reason
    assert len(stock) == STEPS
    torch.testing.assert_close(patched, stock, rtol=LOSS_TOLERANCE["bf16"], atol=0)
    # Forward and backward of each kernel ran: checkpointing recomputes through them.
    assert all(ran[op] for op in ("npu_rms_norm", "npu_rms_norm_backward", "npu_swiglu_backward")), dict(ran)


def reward(completions, **_):
    """Any deterministic reward: the number of ``t1`` words, minus a length penalty."""
    return [float(text.count("t1")) - 0.01 * len(text) for text in completions]


def grpo_log(model, tmp_path) -> list[tuple[float, float]]:
    """(loss, mean reward) per step of a GRPOTrainer run: generation, reward, policy loss."""
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), **{**COMMON, "max_steps": 3}, num_generations=4, max_completion_length=8
    )
    vocab = model.config.vocab_size
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=texts(vocab, rows=8, column="prompt", lengths=(6, 7)),
        processing_class=tokenizer(vocab),
    )
    trainer.train()
    return [(entry["loss"], entry["reward"]) for entry in trainer.state.log_history if "loss" in entry]


@FULL
def test_grpo_trainer_matches_stock_step_by_step(tmp_path, npu_stand_in):
    torch.manual_seed(0)
    stock = grpo_log(tiny_model("qwen3"), tmp_path / "stock")
    npu_autopatch.enable(models=["qwen3"])
    torch.manual_seed(0)
    patched, ran = fused_ops_during(npu_stand_in, lambda: grpo_log(tiny_model("qwen3"), tmp_path / "patched"))
    assert npu_autopatch.status()["qwen3"].state == "applied"
    # The same completions were sampled (same rewards), then the same policy loss.
    assert [r for _, r in patched] == pytest.approx([r for _, r in stock], rel=1e-5)
    assert [loss for loss, _ in patched] == pytest.approx([loss for loss, _ in stock], rel=1e-2, abs=1e-3)
    assert ran["npu_rms_norm"] and ran["npu_rms_norm_backward"], dict(ran)  # generation and training


# Padding-free needs FA2, which transformers routes to its NPU integration once it has seen torch_npu:
# a fresh interpreter (transformers caches which flash functions it loaded).
PADDING_FREE = textwrap.dedent(
    """
    import collections, json, sys
    import torch
    from npu_autopatch.testing import stand_in

    with stand_in() as npu:
        import trl
        from transformers import AutoModelForCausalLM
        import npu_autopatch
        from npu_autopatch.testing import tiny
        from tests.test_trl import COMMON, texts, tokenizer

        model_type, overrides = sys.argv[1], json.loads(sys.argv[2])

        def losses(attention, **arguments):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(
                tiny.tiny_config(model_type, **overrides), attn_implementation=attention
            )
            vocab = model.config.vocab_size
            args = trl.SFTConfig(output_dir="out", **COMMON, bf16=False, **arguments)
            trainer = trl.SFTTrainer(
                model=model, args=args, train_dataset=texts(vocab), processing_class=tokenizer(vocab)
            )
            trainer.train()
            return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

        free = dict(padding_free=True, max_length=None)
        result = {"eager": losses("eager", **free), "stock": losses("flash_attention_2", **free)}
        npu_autopatch.enable(models=[model_type, "npu_flash_attention"])
        before = collections.Counter(npu.calls)
        result["patched"] = losses("flash_attention_2", **free)
        result["ran"] = collections.Counter(npu.calls) - before
        status = npu_autopatch.status()
        result["state"] = {name: str(status[name].state) for name in (model_type, "npu_flash_attention")}
    print("RESULT" + json.dumps(result))
    """
)


@FULL
@pytest.mark.parametrize(
    "model_type, overrides",
    [("qwen3", {}), ("mistral", {"sliding_window": 4})],
    ids=["qwen3", "mistral-window"],
)
def test_sft_padding_free_through_npu_flash_attention_matches_eager(model_type, overrides, tmp_path):
    """fp32, padding-free FA2 on the NPU vs eager on the same packed rows: the same loss at each step.

    Eager keeps the documents apart by the restarting position_ids (transformers' packed-sequence
    masks), and it counts the tokens of the loss as padding-free does: a padded run is no reference
    on 4.57, whose Trainer counts the unshifted labels (each step's loss is then 41/45 of it).

    The stock FA2 run comes first, in the same process, as a notebook or a comparison script does:
    enabling after transformers has loaded its flash functions must still take effect. For the
    sliding-window model, stock FA2 drops the window: that run is the control, and it is off.
    """
    found = child_result(
        PADDING_FREE, model_type, json.dumps(overrides), timeout=600, pythonpath=ROOT, cwd=tmp_path
    )
    eager, patched = found["eager"], found["patched"]
    assert len(eager) == STEPS
    torch.testing.assert_close(patched, eager, rtol=LOSS_TOLERANCE["fp32"], atol=0)
    if overrides.get("sliding_window"):
        assert max(abs(s - e) / e for s, e in zip(found["stock"], eager, strict=True)) > 3e-3, found
    assert set(found["state"].values()) == {"applied"}, found["state"]
    ran = found["ran"]
    assert ran.get("npu_fusion_attention") and ran.get("npu_fusion_attention_grad"), ran
