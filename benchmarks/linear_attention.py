"""Ops and CPU wall time of one Gated DeltaNet decoder layer, forward + backward, stock vs patched.

The layer is the first linear-attention layer of the tiny qwen3_next (testing.tiny: hidden 64,
2 key and 4 value heads of 16), fp32, on this CPU. One row of tokens, as one document
(unpacked: the stock layer around the chunk scan, ``torch_chunk_gated_delta_rule`` without its
Python loop over 64-token chunks) and as several documents of equal length with position_ids
restarting at 0 (packed: stock lets each document see the ones before it; the kernel runs each
alone, as its own batch row, through the chunk scan too). Ops are aten ops dispatched (each a
kernel launch on a device); the wall time is the best of a few runs. Run with the venv's python:
    .venv/bin/python benchmarks/linear_attention.py [--quick]
``--quick``: short rows, one run (tests/test_benchmarks.py runs it, so that the script keeps working).
"""

import argparse
import time

import torch
from aten_ops import CountAten

import npu_autopatch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import tiny_model

MODEL = "qwen3_next"


def linear_attention_layer():
    model = tiny_model(MODEL)
    return next(module for module in model.modules() if hasattr(module, "linear_attn"))


def forward_backward(layer, tokens, documents):
    width = layer.input_layernorm.weight.shape[0]
    hidden = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(0), requires_grad=True)
    position_ids = torch.arange(tokens // documents).repeat(documents)[None]
    layer.zero_grad(set_to_none=True)
    layer(hidden, position_embeddings=None, position_ids=position_ids).sum().backward()


def measure(layer, tokens, documents, runs):
    """(ops, best seconds) of one forward + backward."""
    with CountAten() as mode:
        forward_backward(layer, tokens, documents)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        forward_backward(layer, tokens, documents)
        best = min(best, time.perf_counter() - start)
    return sum(mode.ops.values()), best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = ((256, 1), (256, 4)) if args.quick else ((2048, 1), (2048, 4), (8192, 1), (8192, 4), (8192, 16))
    runs = 1 if args.quick else 3
    torch.manual_seed(0)
    print(f"one {MODEL} linear-attention decoder layer, forward + backward, fp32, CPU")
    with stand_in():
        layer = linear_attention_layer()
        for tokens, documents in sizes:
            stock_ops, stock_seconds = measure(layer, tokens, documents, runs)
            npu_autopatch.enable(models=[MODEL], kernels=["gated_delta_rule"])
            try:
                assert npu_autopatch.status()[MODEL].state == "applied", npu_autopatch.status()[MODEL]
                ops, seconds = measure(layer, tokens, documents, runs)
            finally:
                npu_autopatch.disable()
            label = f"{documents} document{'s' if documents > 1 else ''}"
            print(
                f"  {tokens:5d} tokens, {label:12s}: stock {stock_ops:5d} ops {stock_seconds * 1e3:8.1f} ms"
                f" | patched {ops:5d} ops {seconds * 1e3:8.1f} ms"
            )


if __name__ == "__main__":
    main()
