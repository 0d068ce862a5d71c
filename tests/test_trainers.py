"""Real trainers with gradient checkpointing, stock vs patched, loss by loss (issue 15).

HF ``Trainer(gradient_checkpointing=True)`` on a dense and an MoE model, and PEFT LoRA on every
linear with checkpointing: the same weights and data give the same loss at every step, the
fused ops run, and no target is demoted.
"""

import collections

import pytest
import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

import npu_autopatch
from npu_autopatch.testing.parity import tiny_model

STEPS = 4


class Tokens(Dataset):
    """Fixed random sequences, labels = inputs (the model shifts them): a causal-LM epoch. With
    ``prompts``, each row's first 2-4 labels are -100, so ``num_items_in_batch`` matters."""

    def __init__(self, vocab, rows=8, length=12, prompts=False):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, length), generator=generator)
        self.prompts = prompts

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        if self.prompts:
            labels[: 2 + i % 3] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def trainer_losses(model, tmp_path, prompts=False, **arguments):
    """The loss of each of STEPS logged steps of an HF Trainer run (2 x 2 accumulated micro-batches)."""
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        **arguments,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(model.config.vocab_size, prompts=prompts))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _losses(model_type, tmp_path, reentrant, lora=False):
    model = tiny_model(model_type)
    if lora:
        from peft import LoraConfig, get_peft_model

        model.enable_input_require_grads()  # frozen embeddings: reentrant checkpoints need a grad input
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return trainer_losses(
        model,
        tmp_path,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )


@pytest.mark.parametrize(
    "model_type, reentrant, lora",
    [
        ("qwen3", False, False),
        ("qwen3_moe", False, False),
        pytest.param("qwen3", True, True, marks=pytest.mark.full),
        pytest.param("qwen3_moe", False, True, marks=pytest.mark.full),
    ],
    ids=["dense", "moe", "dense-lora-reentrant", "moe-lora"],
)
def test_trainer_with_checkpointing_matches_stock_step_by_step(
    model_type, reentrant, lora, tmp_path, npu_stand_in
):
    stock = _losses(model_type, tmp_path / "stock", reentrant, lora)
    npu_autopatch.enable(models=[model_type])
    before = collections.Counter(npu_stand_in.calls)
    patched = _losses(model_type, tmp_path / "patched", reentrant, lora)
    ran = collections.Counter(npu_stand_in.calls) - before
    record = npu_autopatch.status()[model_type]
    assert record.state == "applied", record.reason
    assert len(stock) == STEPS and len(patched) == STEPS
    # Trainer logs the loss to 4 decimals, and from the second step on the weights carry Adam's
    # updates of gradients that differ from stock by fp32 rounding (an MoE's routing amplifies it).
    torch.testing.assert_close(patched, stock, rtol=1e-3, atol=0)
    used = ["npu_rms_norm", "npu_rotary_mul", "npu_swiglu"]
    used += [op + "_backward" for op in used[:2]]
    if "moe" in model_type:  # the experts' backward is grouped matmul again
        used.append("npu_grouped_matmul")
    assert all(ran[op] for op in used), dict(ran)
