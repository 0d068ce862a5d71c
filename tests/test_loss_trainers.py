"""The loss kernel under TRL's SFTTrainer (issue 19 item 2): a real trainer, a tiny model, a few steps.

TRL 1.x's SFTTrainer puts its own chunked LM head on the model instance and computes the training
loss (and its token accuracy and entropy) with it: with the loss kernel on too, exactly one of them
computes the loss (TRL's), the losses are the stock run's step by step, and report() says whose, in
fp32 and with TRL's default bf16 (autocast). TRL 0.x's SFTTrainer reads ``outputs.logits`` in
training: the switch must stay off with it (the README and docs/loss.md say so; the test pins that
behaviour, in bf16 too since issue 35 runs the chunked loss under autocast). Trainer runs: CI's full matrix.
"""

import pytest
import torch
from packaging.version import Version

import npu_autopatch
from npu_autopatch.kernels import loss as loss_kernel
from npu_autopatch.testing.parity import tiny_model

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


def _sft(model, tmp_path, bf16=False):
    """(losses, mean token accuracies) of each logged step of a 3-step SFTTrainer run (``bf16=None``:
    TRL's default, bf16)."""
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
        **({} if bf16 is None else {"bf16": bf16}),
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
@pytest.mark.parametrize("bf16", [False, None], ids=["fp32", "trl-default-bf16"])
def test_sft_trainer_computes_the_loss_with_its_own_head_and_report_says_so(
    bf16, tmp_path, npu_stand_in, monkeypatch
):
    stock_losses, stock_accuracy, _ = _sft(tiny_model("qwen3"), tmp_path / "stock", bf16)
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    ours = []
    chunked = loss_kernel.linear_cross_entropy
    monkeypatch.setattr(
        loss_kernel, "linear_cross_entropy", lambda *a, **k: ours.append(1) or chunked(*a, **k)
    )
    losses, accuracy, trainer = _sft(tiny_model("qwen3"), tmp_path / "patched", bf16)
    assert npu_autopatch.status()["qwen3"].kernels == ("loss",)
    assert ours == []  # TRL's head computed every loss, ours none
    assert len(losses) == 3
    tolerance = 1e-4 if bf16 is False else 1e-2
    torch.testing.assert_close(losses, stock_losses, rtol=tolerance, atol=0)
    torch.testing.assert_close(accuracy, stock_accuracy, rtol=tolerance, atol=0)
    text = str(npu_autopatch.report(trainer.model))
    # Under bf16 accelerate wraps TRL's instance forward in its autocast one: report() names the outer.
    assert "FLAG loss" in text and ("trl" if bf16 is False else "accelerate") in text, text


def test_a_bf16_trainers_arguments_before_it_make_the_history_of_ci(tmp_path):
    """CI's worker ran bf16 trainers before the next test (its order): 4.57's TrainingArguments writes
    ACCELERATE_MIXED_PRECISION=bf16 into os.environ, and the next test's Trainer ran under bf16 autocast
    though it said ``bf16=False``. conftest's ``environment_kept`` undoes it; the next test is the witness."""
    trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[])


@pytest.mark.skipif(TRL_1, reason="TRL 0.x reads the logits in training")
@pytest.mark.parametrize("bf16", [False, None], ids=["fp32", "trl-default-bf16"])
def test_sft_trainer_0x_reads_the_logits_so_the_switch_stays_off_with_it(bf16, tmp_path, npu_stand_in):
    """What docs/loss.md tells TRL 0.x users: its entropy metric needs outputs.logits in training,
    with its default bf16 too (before issue 35 the loss kernel ran stock under autocast, with the
    logits; now the chunked loss runs there)."""
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    model = tiny_model("qwen3")
    record = npu_autopatch.status()["qwen3"]
    assert record.kernels == ("loss",), record  # the switch took (else the logits are there anyway)
    try:
        _sft(model, tmp_path, bf16)
    except AttributeError as exc:
        assert "NoneType" in str(exc)
    else:
        calls = npu_autopatch.status()["qwen3"].as_dict()["calls"]
        pytest.fail(f"no AttributeError: the loss kernel's calls {calls}")
