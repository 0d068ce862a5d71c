"""The loss kernel under TRL's SFTTrainer (issue 19 item 2): a real trainer, a tiny model, a few steps.

TRL 1.x's SFTTrainer puts its own chunked LM head on the model instance and computes the training
loss (and its token accuracy and entropy) with it: with the loss kernel on too, exactly one of them
computes the loss (TRL's), the losses are the stock run's step by step, and report() says whose.
TRL 0.x's SFTTrainer reads ``outputs.logits`` in training: the switch must stay off with it (the
README and docs/loss.md say so; the test pins that behaviour). Trainer runs: CI's full matrix.
"""

import pytest
import torch
from packaging.version import Version

import npu_autopatch
from npu_autopatch.kernels import loss as loss_kernel
from npu_autopatch.testing.parity import tiny_model

from .conftest import ROOT, child_result

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
TRL_1 = Version(trl.__version__) >= Version("1.0")
pytestmark = pytest.mark.full


def _tokenizer(vocab):
    """A word-level tokenizer over the tiny model's vocabulary (SFTTrainer wants one for padding)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t1", eos_token="t2", unk_token="t0")


def _sft(model, tmp_path):
    """(losses, mean token accuracies) of each logged step of a 3-step SFTTrainer run."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, model.config.vocab_size, (int(n),), generator=gen).tolist() for n in (9, 12) * 6]
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        bf16=False,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
        processing_class=_tokenizer(model.config.vocab_size),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [e["loss"] for e in logs], [e["mean_token_accuracy"] for e in logs], trainer


@pytest.mark.skipif(not TRL_1, reason="TRL 1.x puts its fused LM head on the model")
def test_sft_trainer_computes_the_loss_with_its_own_head_and_report_says_so(
    tmp_path, npu_stand_in, monkeypatch
):
    stock_losses, stock_accuracy, _ = _sft(tiny_model("qwen3"), tmp_path / "stock")
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    ours = []
    chunked = loss_kernel.linear_cross_entropy
    monkeypatch.setattr(
        loss_kernel, "linear_cross_entropy", lambda *a, **k: ours.append(1) or chunked(*a, **k)
    )
    losses, accuracy, trainer = _sft(tiny_model("qwen3"), tmp_path / "patched")
    assert npu_autopatch.status()["qwen3"].kernels == ("loss",)
    assert ours == []  # TRL's head computed every loss, ours none
    assert len(losses) == 3
    torch.testing.assert_close(losses, stock_losses, rtol=1e-4, atol=0)
    torch.testing.assert_close(accuracy, stock_accuracy, rtol=1e-4, atol=0)
    text = str(npu_autopatch.report(trainer.model))
    assert "FLAG loss" in text and "trl" in text, text


# In a fresh interpreter: in CI's full matrix on 4.57 this run once in a few kept its logits, after an
# unknown history of the worker process (not reproduced in-process since; see the issue note). The child
# prints how the loss kernel's calls ran, so a failure names the rule that sent them to the stock loss.
SFT_0X = r"""
import json, sys
import npu_autopatch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import tiny_model
from tests.test_loss_trainers import _sft

with stand_in():
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    model = tiny_model("qwen3")
    kernels = npu_autopatch.status()["qwen3"].kernels
    try:
        _sft(model, sys.argv[1])
    except AttributeError as exc:
        error = str(exc)
    else:
        error = None
    calls = npu_autopatch.status()["qwen3"].as_dict()["calls"]
print("RESULT " + json.dumps({"kernels": list(kernels), "error": error, "calls": calls}))
"""


@pytest.mark.skipif(TRL_1, reason="TRL 0.x reads the logits in training")
def test_sft_trainer_0x_reads_the_logits_so_the_switch_stays_off_with_it(tmp_path):
    """What docs/loss.md tells TRL 0.x users: its entropy metric needs outputs.logits in training."""
    out = child_result(SFT_0X, str(tmp_path), cwd=ROOT)
    assert out["kernels"] == ["loss"], out  # the switch took (else the logits are there anyway)
    assert out["error"] is not None, f"no AttributeError: the loss kernel's calls {out['calls']}"
    assert "NoneType" in out["error"], out
