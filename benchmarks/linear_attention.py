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
``--head-dim 128``: the gated delta rule function alone (transformers' torch fallback vs the chunk
scan) at Qwen3-Next's head dim, 4 key and 8 value heads, one run (the stock 8k run takes about a
minute here).
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


def rule_inputs(tokens, head_dim):
    gen = torch.Generator().manual_seed(0)
    shapes = ((1, tokens, 4, head_dim), (1, tokens, 4, head_dim), (1, tokens, 8, head_dim))
    query, key, value = (torch.randn(*shape, generator=gen, requires_grad=True) for shape in shapes)
    g = (-torch.rand(1, tokens, 8, generator=gen)).requires_grad_()
    beta = torch.rand(1, tokens, 8, generator=gen, requires_grad=True)
    return query, key, value, g, beta


def measure_rule(function, tokens, head_dim):
    """(ops, seconds) of the function's forward + backward, output and final state."""

    def run():
        output, state = function(
            *rule_inputs(tokens, head_dim), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        (output.sum() + state.sum()).backward()

    with CountAten() as mode:
        run()
    start = time.perf_counter()
    run()
    return sum(mode.ops.values()), time.perf_counter() - start


def main_rule(head_dim):
    from transformers.models.qwen3_next import modeling_qwen3_next

    from npu_autopatch.kernels.gated_delta_scan import chunk_gated_delta_rule

    stock = modeling_qwen3_next.torch_chunk_gated_delta_rule
    stock = getattr(stock, "__wrapped__", stock)
    print(f"the chunked gated delta rule alone, 4 key / 8 value heads of {head_dim}, fp32, CPU")
    for tokens in (2048, 8192):
        stock_ops, stock_seconds = measure_rule(stock, tokens, head_dim)
        ops, seconds = measure_rule(chunk_gated_delta_rule, tokens, head_dim)
        print(
            f"  {tokens:5d} tokens: stock {stock_ops:5d} ops {stock_seconds * 1e3:8.0f} ms"
            f" | chunk scan {ops:5d} ops {seconds * 1e3:8.0f} ms"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--head-dim", type=int)
    args = parser.parse_args()
    if args.head_dim:
        return main_rule(args.head_dim)
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
