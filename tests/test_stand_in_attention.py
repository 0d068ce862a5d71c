"""transformers' own Ascend flash-attention path (integrations/npu_flash_attention.py) on the CPU stand-in.

With a torch_npu installed, transformers imports ``torch_npu.npu_fusion_attention`` when its modeling code
loads and routes ``attn_implementation="flash_attention_2"`` through it. Driving tiny Llama models through
that path and comparing with ``eager`` (same weights) checks the stand-in's golden against HF's causal
semantics: BSND with sparse_mode 3 and the 2048x2048 triu mask, TND for padded and packed (padding-free)
batches, and Sq < Skv during cached decoding.

transformers caches ``is_torch_npu_available`` (lru_cache, and sdpa_attention reads it at import), so every
check runs in a fresh interpreter and the other tests' process is left alone.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from .conftest import child_env, warm_run

SRC = Path(__file__).resolve().parents[1] / "src"

PRELUDE = """
import copy

import torch

from npu_autopatch.testing import stand_in

TOL = {"rtol": 1e-5, "atol": 1e-5}
seen, seq_lens = [], []


def spy(op):
    # Wraps the stand-in's op before transformers binds it, to record what HF passes.
    def npu_fusion_attention(*args, **kwargs):
        mask = kwargs.get("atten_mask")
        seq_lens.append((args[0].shape[-3], args[1].shape[-3]))  # (Sq, Skv) in BSND, (Tq, Tkv) in TND
        seen.append(
            (
                kwargs.get("input_layout", args[4] if len(args) > 4 else None),
                kwargs.get("sparse_mode", 0),
                None if mask is None else tuple(mask.shape),
                kwargs.get("actual_seq_qlen"),
            )
        )
        return op(*args, **kwargs)

    return npu_fusion_attention


def models(cfg):
    torch.manual_seed(0)
    fa = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2")
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.load_state_dict(fa.state_dict())
    assert fa.config._attn_implementation == "flash_attention_2"
    assert eager.config._attn_implementation == "eager"
    return fa, eager


def same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        p.grad = q.grad = None


with stand_in() as npu:
    npu.npu_fusion_attention = spy(npu.npu_fusion_attention)
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations import npu_flash_attention
    from transformers.utils import is_torch_npu_available

    assert is_torch_npu_available()
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, pad_token_id=0, max_position_embeddings=64,
    )
    fa, eager = models(cfg)
"""


def run_with_stand_in(body: str) -> None:
    """Run PRELUDE + body in a fresh interpreter of this venv; fail with its output if it fails."""
    code = textwrap.dedent(PRELUDE) + textwrap.indent(textwrap.dedent(body), "    ")
    result = warm_run(
        [sys.executable, "-c", code],
        env=child_env(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1"),  # tiny models: threads only contend
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    assert "OK" in result.stdout, result.stdout


def test_hf_flash_attention_2_matches_eager_through_the_stand_in() -> None:
    run_with_stand_in(
        """
        # Dense batch: BSND, sparse_mode 3 with HF's cached 2048x2048 triu mask, a real backward.
        ids = torch.randint(1, 128, (2, 12))
        out_fa, out_eager = fa(ids, labels=ids), eager(ids, labels=ids)
        torch.testing.assert_close(out_fa.logits, out_eager.logits, **TOL)
        out_fa.loss.backward()
        out_eager.loss.backward()
        same_grads(fa, eager)
        assert set(seen) == {("BSND", 3, (2048, 2048), None)}, seen
        assert npu.calls == {"npu_fusion_attention": 2, "npu_fusion_attention_grad": 2}, npu.calls
        seen.clear()

        # Right- and left-padded batch: HF unpads into TND with cumulative actual_seq_qlen.
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, 9:] = 0
        mask[1, :5] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[1, 5] = -100  # else the loss would read the logits of the pad before it (labels shift by one)
        out_fa = fa(ids, attention_mask=mask, labels=labels)
        out_eager = eager(ids, attention_mask=mask, labels=labels)
        valid = mask.bool()
        torch.testing.assert_close(out_fa.logits[valid], out_eager.logits[valid], **TOL)
        out_fa.loss.backward()
        out_eager.loss.backward()
        same_grads(fa, eager)
        assert set(seen) == {("TND", 3, (2048, 2048), (9, 16))}, seen
        seen.clear()

        # Padding-free packing (position_ids restart, no attention_mask): TND, one segment per sequence,
        # equal to running each sequence alone with eager.
        lengths = [5, 7]
        packed = torch.randint(1, 128, (1, sum(lengths)))
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        weight = torch.randn(1, sum(lengths), 128)
        logits = fa(packed, position_ids=positions).logits
        (logits * weight).sum().backward()
        pieces = [eager(chunk).logits for chunk in packed.split(lengths, dim=1)]
        sum((p * w).sum() for p, w in zip(pieces, weight.split(lengths, dim=1), strict=True)).backward()
        torch.testing.assert_close(logits, torch.cat(pieces, dim=1), **TOL)
        same_grads(fa, eager)
        assert set(seen) == {("TND", 3, (2048, 2048), (5, 12))}, seen
        seen.clear()

        # Cached greedy decoding: the prefill is causal, the decode steps have Sq = 1 < Skv.
        kwargs = {"max_new_tokens": 4, "do_sample": False, "output_logits": True}
        kwargs["return_dict_in_generate"] = True
        seq_lens.clear()
        with torch.no_grad():
            gen_fa = fa.generate(ids[:, :6], **kwargs)
            gen_eager = eager.generate(ids[:, :6], **kwargs)
        assert torch.equal(gen_fa.sequences, gen_eager.sequences)
        assert (6, 6) in seq_lens and (1, 9) in seq_lens, seq_lens
        for a, b in zip(gen_fa.logits, gen_eager.logits, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        assert npu_flash_attention.npu_fusion_attention is npu.npu_fusion_attention
        print("OK")
        """
    )
