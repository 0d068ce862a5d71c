"""Per-call cost of a patched target vs calling the fused op directly (goal: no extra frame).

The replacements are built for Qwen3's RMSNorm, MLP and rotary function as the patcher builds them,
on a stub torch_npu whose ops return a ready tensor at once, so that what is timed is our glue
alone: the replacement's frame, its attribute loads and dtype checks, and for the rotary function
the per-call shape check that sends a shape the kernel cannot take to the stock code. The direct
call does the same tensor work inline (gate and up written into the halves of one buffer for
npu_swiglu; for npu_rotary_mul the layout: q/k transposed to [B, S, N, D] and cos/sin to [1, S, 1,
D], or flattened to [1, B*S, N, D] with a per-sample cos), so the difference is the check and the
glue. Python frames are counted with sys.setprofile. Last, what counting each call costs (issue 26:
status().calls): the ``count_fused()`` / ``count_stock(reason)`` a replacement calls, each against
an empty function call, on a ``Calls`` as the patcher hands it (with its mostly-stock report armed,
the stock path's worst case). Run with the venv's python:
    .venv/bin/python benchmarks/call_overhead.py [--quick]
``--quick``: a hundredth of the calls, 3 runs (tests/test_benchmarks.py: the script keeps working).
"""

import argparse
import sys
import timeit
import types

import torch
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from npu_autopatch import Calls
from npu_autopatch.kernels import KERNELS, choose_variant
from npu_autopatch.kernels._calls import counters
from npu_autopatch.kernels.mlp import _GateUp


def stub_npu(x):
    """A torch_npu whose ops cost one Python call each and return a ready result."""
    normed = (x.clone(), torch.ones(1))
    return types.SimpleNamespace(
        npu_rms_norm=lambda input, gamma, epsilon=1e-6: normed,
        npu_swiglu=lambda input, dim=-1: input.narrow(dim, 0, input.shape[dim] // 2),
        npu_rotary_mul=lambda input, r1, r2, rotary_mode="half": input,
    )


def build(kernel, stock, npu):
    variant, reason = choose_variant(KERNELS[kernel], stock)
    assert variant is not None, reason
    return variant.build(stock, npu, None)


FULL, QUICK = (20000, 15), (200, 3)  # (calls per run, runs)


def ns_per_call(call, timing=FULL):
    """The fastest of the runs (timeit's advice): on a shared machine the others measure the neighbours."""
    number, repeat = timing
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e9


def frames(call):
    """(Python frames of npu_autopatch, all Python frames) entered during one call."""
    counted = []

    def profile(frame, event, arg):
        if event == "call":
            counted.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    ours = sum("npu_autopatch" in name for name in counted)
    return ours, len(counted)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls: does it run, not how fast")
    timing = QUICK if parser.parse_args().quick else FULL
    torch.set_num_threads(1)
    config = qwen3.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    x = torch.randn(2, 8, 64)
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)  # HF's default: batch-1 positions
    cos_b, sin_b = torch.randn(2, 8, 16), torch.randn(2, 8, 16)  # position_ids given: per sample
    npu = stub_npu(x)
    norm, mlp = qwen3.Qwen3RMSNorm(64), qwen3.Qwen3MLP(config)
    norm_forward = build("rms_norm", qwen3.Qwen3RMSNorm.forward, npu)
    mlp_forward = build("swiglu", qwen3.Qwen3MLP.forward, npu)
    rotary = build("rope", qwen3.apply_rotary_pos_emb, npu)

    rows = {
        "rms_norm (Qwen3RMSNorm.forward)": (
            lambda: norm_forward(norm, x),
            lambda: npu.npu_rms_norm(x, norm.weight, epsilon=norm.variance_epsilon)[0],
            lambda: qwen3.Qwen3RMSNorm.forward(norm, x),
        ),
        "swiglu (Qwen3MLP.forward)": (
            lambda: mlp_forward(mlp, x),
            lambda: mlp.down_proj(
                npu.npu_swiglu(
                    _GateUp.apply(x, mlp.gate_proj.weight, None, mlp.up_proj.weight, None), dim=0
                ).view(*x.shape[:-1], -1)
            ),
            lambda: qwen3.Qwen3MLP.forward(mlp, x),
        ),
        "rope, batch-1 cos (layout A)": (
            lambda: rotary(q, k, cos, sin),
            lambda: (
                lambda xq, xk, c, s: (
                    npu.npu_rotary_mul(xq, c, s).transpose(1, 2),
                    npu.npu_rotary_mul(xk, c, s).transpose(1, 2),
                )
            )(q.transpose(1, 2), k.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)),
            lambda: qwen3.apply_rotary_pos_emb(q, k, cos, sin),
        ),
        "rope, per-sample cos (layout B)": (
            lambda: rotary(q, k, cos_b, sin_b),
            lambda: (
                lambda xq, xk, c, s: (
                    npu.npu_rotary_mul(xq, c, s).view(2, 8, -1, 16).transpose(1, 2),
                    npu.npu_rotary_mul(xk, c, s).view(2, 8, -1, 16).transpose(1, 2),
                )
            )(
                q.transpose(1, 2).reshape(1, 16, -1, 16),
                k.transpose(1, 2).reshape(1, 16, -1, 16),
                cos_b.expand(2, 8, 16).reshape(1, 16, 1, 16),
                sin_b.expand(2, 8, 16).reshape(1, 16, 1, 16),
            ),
            lambda: qwen3.apply_rotary_pos_emb(q, k, cos_b, sin_b),
        ),
    }
    print("per call, stub ops (our glue only); frames = Python frames of npu_autopatch / all")
    for name, (patched, direct, stock) in rows.items():
        with torch.no_grad():
            t_patched, t_direct = ns_per_call(patched, timing), ns_per_call(direct, timing)
            t_stock = ns_per_call(stock, timing)
            ours, total = frames(patched)
        print(
            f"  {name:<34} patched {t_patched:7.0f} ns, direct {t_direct:7.0f} ns "
            f"({t_patched - t_direct:+5.0f} ns); stock on CPU {t_stock:7.0f} ns; frames {ours}/{total}"
        )
    print(f"rope per-call shape check: {check_ns(qwen3.apply_rotary_pos_emb, npu, timing):.0f} ns")
    fused, stock = counting_ns(timing)
    print(f"counting per call: fused {fused:+.0f} ns, stock {stock:+.0f} ns")


def counting_ns(timing):
    """(ns added to a fused call, ns added to a stock call) by counting it: ``count_fused()`` and
    ``count_stock("eval", x)`` against calling an empty function with the same arguments."""
    calls = Calls(lambda *args: None)  # armed: every stock call checks the share (it never fires here)
    calls.fused = 10**9
    on_error = types.SimpleNamespace(calls=calls)
    count_fused, count_stock = counters(on_error)
    x = torch.randn(2)

    def empty(*args):
        return None

    timing = (timing[0] * 5, timing[1])  # well under a microsecond each: more calls per run
    base = ns_per_call(empty, timing)
    fused = ns_per_call(count_fused, timing) - base
    stock = ns_per_call(lambda: count_stock("eval", x), timing) - ns_per_call(
        lambda: empty("eval", x), timing
    )
    return fused, stock


def check_ns(stock_function, npu, timing):
    """What the rotary replacement's shape check costs: the replacement built on a no-op stock, called
    with an empty sequence, which passes every comparison but the last and then calls stock, against
    calling that no-op directly (the difference also holds the replacement's own frame)."""

    def no_op(q, k, cos, sin, unsqueeze_dim=1):
        return None

    variant, reason = choose_variant(KERNELS["rope"], stock_function)
    assert variant is not None, reason
    rotary = variant.build(no_op, npu, None)
    q, k, cos = torch.randn(2, 4, 0, 16), torch.randn(2, 2, 0, 16), torch.randn(1, 0, 16)
    timing = (timing[0] * 5, timing[1])  # a few ns each: more calls per run
    patched = ns_per_call(lambda: rotary(q, k, cos, cos), timing)
    return patched - ns_per_call(lambda: no_op(q, k, cos, cos), timing)


if __name__ == "__main__":
    main()
