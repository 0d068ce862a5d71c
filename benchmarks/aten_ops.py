"""Operators dispatched per decoder layer, forward + backward, stock vs patched.

A hardware-independent figure: each op is a kernel launch on the device. A stand-in fused op
counts as one (it is one kernel on the NPU); the aten ops the CPU stand-in runs inside its
Python implementation, forward or backward, are not counted. One decoder layer is the
difference between tiny models with one layer more and one less (for qwen3_moe both extra
layers are sparse MoE layers). Run with the venv's python:
    .venv/bin/python benchmarks/aten_ops.py [--quick]
``--quick``: qwen3 only (tests/test_benchmarks.py runs it, so that the script keeps working).
"""

import argparse
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import npu_autopatch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.device import ops
from npu_autopatch.testing.parity import forward_backward, model_batch, tiny_config, tiny_model

STAND_IN_CODE = ops.__file__


def inside_stand_in():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == STAND_IN_CODE:
            return True
        frame = frame.f_back
    return False


class CountAten(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not inside_stand_in():
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def with_layers(model_type, layers):
    """Config overrides for ``layers`` decoder layers: the per-layer type list (transformers 5.x
    checks that it has one entry per layer) is cut or grown with its last entry."""
    text = tiny_config(model_type).get_text_config()
    overrides = {"num_hidden_layers": layers}
    kinds = getattr(text, "layer_types", None)
    if kinds:
        overrides["layer_types"] = [*kinds[:layers], *kinds[-1:] * (layers - len(kinds))]
    return overrides


def count(model_type, layers, npu, patched):
    model = tiny_model(model_type, **with_layers(model_type, layers))
    input_ids, labels, inputs = model_batch(model)
    if patched:
        npu_autopatch.enable(models=[model_type])
        assert npu_autopatch.status()[model_type].state == "applied", npu_autopatch.status()[model_type]
    before = Counter(npu.calls)
    try:
        with CountAten() as mode:
            forward_backward(model, input_ids, labels, **inputs)
    finally:
        npu_autopatch.disable()
    fused = Counter(npu.calls)
    fused.subtract(before)
    return mode.ops, +fused


def per_layer(model_type, npu, patched):
    layers = tiny_config(model_type).get_text_config().num_hidden_layers
    small_aten, small_fused = count(model_type, layers, npu, patched)
    big_aten, big_fused = count(model_type, layers + 1, npu, patched)
    aten = sum(big_aten.values()) - sum(small_aten.values())
    fused = big_fused.copy()
    fused.subtract(small_fused)
    return aten, +fused


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="qwen3 only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("ops per decoder layer, forward + backward (fused stand-in ops count one each)")
    with stand_in() as npu:
        for model_type in ("qwen3",) if args.quick else ("qwen3", "qwen3_moe"):
            for patched in (False, True):
                aten, fused = per_layer(model_type, npu, patched)
                total = aten + sum(fused.values())
                label = "patched" if patched else "stock"
                detail = ", ".join(f"{op} {n}" for op, n in sorted(fused.items())) or "-"
                print(f"  {model_type:<10} {label:<8} {total:5d} ops = {aten:5d} aten + fused: {detail}")


if __name__ == "__main__":
    main()
