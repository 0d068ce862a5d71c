"""Real trainers on transformers' default attention (issue 27): stock (sdpa) vs patched (routed to the
flash-attention path), loss by loss, each with gradient checkpointing.

HF ``Trainer`` on padded batches and on packed ones (``DataCollatorWithFlattening``: position_ids
restarting), PEFT LoRA on every linear (packed), TRL ``SFTTrainer`` with its defaults (bf16, padded) and
padding-free. Nothing passes ``attn_implementation``: stock runs sdpa, patched runs the fused op.
Under gradient checkpointing the cache is off, so stock's sdpa keeps packed documents apart too (by
transformers' packed-sequence masks, densely): both are references for the packed runs.
"""

import textwrap

import pytest

from .conftest import FULL, ROOT, child_result

pytest.importorskip("trl")
pytest.importorskip("peft")

STEPS = 4
TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}  # the logged losses: 4 digits, Adam carries rounding on

CHILD = textwrap.dedent(
    """
    import collections, json
    import torch
    from torch.utils.data import Dataset
    from npu_autopatch.testing import stand_in, tiny
    from tests.test_trl import COMMON, texts, tokenizer

    STEPS = 4


    class Documents(Dataset):
        # Fixed random documents of 5-13 tokens, labels = inputs.
        def __init__(self, vocab, rows=16):
            generator = torch.Generator().manual_seed(0)
            sizes = torch.randint(5, 14, (rows,), generator=generator)
            self.rows = [torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in sizes]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": list(self.rows[i])}


    def padded(features):
        longest = max(len(f["input_ids"]) for f in features)
        pad = lambda row, value: row + [value] * (longest - len(row))
        return {
            "input_ids": torch.tensor([pad(f["input_ids"], 0) for f in features]),
            "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in features]),
            "labels": torch.tensor([pad(f["labels"], -100) for f in features]),
        }


    def model():
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(tiny.tiny_config("qwen3"))  # no attn_implementation


    def trainer_losses(collator, lora=False):
        from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

        net = model()
        if lora:
            from peft import LoraConfig, get_peft_model

            net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        args = TrainingArguments(
            output_dir="out", per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
            dataloader_num_workers=0, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
        collate = padded if collator == "padded" else DataCollatorWithFlattening()
        data = Documents(net.config.vocab_size)
        trainer = Trainer(model=net, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e], net.config._attn_implementation


    def sft_losses(**arguments):
        import trl

        net = model()
        vocab = net.config.vocab_size
        args = trl.SFTConfig(output_dir="out", **COMMON, **arguments)  # TRL's defaults: bf16, checkpointing
        data, words = texts(vocab), tokenizer(vocab)
        trainer = trl.SFTTrainer(model=net, args=args, train_dataset=data, processing_class=words)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e], net.config._attn_implementation


    RUNS = {
        "trainer_padded": lambda: trainer_losses("padded"),
        "trainer_packed": lambda: trainer_losses("flattening"),
        "lora_packed": lambda: trainer_losses("flattening", lora=True),
        "sft_default": lambda: sft_losses(),
        "sft_padding_free": lambda: sft_losses(padding_free=True, max_length=None),
    }

    with stand_in() as npu:
        import npu_autopatch

        result = {"stock": {name: run() for name, run in RUNS.items()}}
        npu_autopatch.enable()  # as NPU_AUTOPATCH=1
        result["patched"] = {}
        for name, run in RUNS.items():
            before = npu.calls["npu_fusion_attention_grad"]
            result["patched"][name] = [*run(), npu.calls["npu_fusion_attention_grad"] - before]
        status = npu_autopatch.status()
        entries = ("qwen3", "npu_flash_attention", "default_attention")
        result["state"] = {name: status[name].state.value for name in entries}
    print("RESULT" + json.dumps(result))
    """
)


@FULL
def test_trainers_on_the_default_attention_give_stock_losses(tmp_path):
    found = child_result(CHILD, timeout=900, pythonpath=ROOT, cwd=tmp_path)
    assert set(found["state"].values()) == {"applied"}, found["state"]
    for name, (stock, implementation) in found["stock"].items():
        losses, routed, backward_calls = found["patched"][name]
        assert implementation == "sdpa" and routed == "flash_attention_2", (name, implementation, routed)
        assert len(stock) == STEPS == len(losses), (name, stock, losses)
        tolerance = TOLERANCE["bf16" if name.startswith("sft_default") else "fp32"]
        worst = max(abs(p - s) / abs(s) for p, s in zip(losses, stock, strict=True))
        assert worst <= tolerance, (name, stock, losses)
        assert backward_calls > 0, (name, backward_calls)  # the fused attention's backward ran


# TRL's padding-free SFT compiled (``torch_compile=True``) on a routed model: its rows are packed
# (position_ids restarting, no mask, no cache), and the compiled steps take transformers' flash path as
# the uncompiled ones do (its ``_flash_attention_forward``, replaced here by a counting stand-in as
# verl's Ulysses replaces it, is called compiled too), with the same losses. dynamo's eager backend: the
# route decides while dynamo traces.
SFT_COMPILED = textwrap.dedent(
    """
    import json
    import torch
    from npu_autopatch.testing import stand_in, tiny
    from tests.test_trl import COMMON, texts, tokenizer


    def losses(**arguments):
        import trl
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        net = AutoModelForCausalLM.from_config(tiny.tiny_config("qwen3"))  # no attn_implementation
        vocab = net.config.vocab_size
        settings = {**COMMON, "max_steps": 2, "bf16": False, "gradient_checkpointing": False}
        args = trl.SFTConfig(output_dir="out", **settings, padding_free=True, max_length=None, **arguments)
        data, words = texts(vocab), tokenizer(vocab)
        trainer = trl.SFTTrainer(model=net, args=args, train_dataset=data, processing_class=words)
        calls.clear()
        trainer.train()
        found = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return {"losses": found, "implementation": net.config._attn_implementation, "flash calls": len(calls)}


    with stand_in() as npu:
        import npu_autopatch

        npu_autopatch.enable()
        import transformers.integrations.flash_attention as integration

        calls, original = [], integration._flash_attention_forward

        def replaced(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        integration._flash_attention_forward = replaced
        result = {"eager": losses(), "compiled": losses(torch_compile=True, torch_compile_backend="eager")}
    print("RESULT" + json.dumps(result))
    """
)


@FULL
def test_sft_padding_free_compiled_takes_the_flash_path_with_uncompiled_losses(tmp_path):
    found = child_result(SFT_COMPILED, timeout=600, pythonpath=ROOT, cwd=tmp_path)
    eager, compiled = found["eager"], found["compiled"]
    assert eager["implementation"] == compiled["implementation"] == "flash_attention_2", found
    assert len(eager["losses"]) == 2, found
    worst = max(abs(c - e) / abs(e) for c, e in zip(compiled["losses"], eager["losses"], strict=True))
    assert worst <= TOLERANCE["fp32"], found
    assert eager["flash calls"] > 0 and compiled["flash calls"] > 0, found
