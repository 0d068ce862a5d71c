"""Patched models under torch.compile and torch.export, as on the device: the fused ops are opaque custom ops.

The stand-in's ops are torch.library ops with fake kernels (as torch_npu's are), counted inside their kernels,
so dynamo traces a patched training step in one graph and does not recompile on the next call; the op counts
prove the fused ops ran inside the compiled graphs. The replacements' own call counts (status().calls) skip
compiled calls: counting there would make dynamo guard on the count and recompile. The aot_eager backend
traces forward and backward (AOTAutograd, the fake kernels, the registered backward formulas) without
inductor's C++ compile.
"""

import collections

import pytest
import torch
import transformers

import npu_autopatch
from npu_autopatch.testing.parity import forward_backward, model_batch, tiny_model

V4 = int(transformers.__version__.split(".")[0]) < 5

# The fused forward ops of one training step of each tiny model (see test_parity*.py); the grouped matmul
# also runs twice per forward call in the backward (dx and dW), under its own name.
STEP_OPS = {
    "qwen3": {"npu_rms_norm": 9, "npu_swiglu": 2, "npu_rotary_mul": 4},
    "qwen3_moe": {  # a dense layer and a sparse one
        "npu_rms_norm": 9,
        "npu_rotary_mul": 4,
        "npu_moe_token_permute": 1,
        "npu_grouped_matmul": 2 + 4,
    },
}
MODELS = ["qwen3"] + ([] if V4 else ["qwen3_moe"])  # 4.57's sparse block loops over experts on the host


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


@pytest.mark.parametrize("model_type", MODELS)
def test_a_patched_training_step_compiles_in_one_graph_without_recompiling(model_type, npu_stand_in, dynamo):
    npu_autopatch.enable(models=[model_type])  # first: on 5.x a MoE model built after it uses the kernel
    model = tiny_model(model_type)
    input_ids, labels, inputs = model_batch(model)
    assert npu_autopatch.status()[model_type].state == "applied"
    eager_logits, eager_grads = forward_backward(model, input_ids, labels, **inputs)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    before = dict(npu_stand_in.calls)
    counted = npu_autopatch.status()[model_type].calls
    assert counted and all(c["fused"] for c in counted.values())  # the eager step was counted
    with dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):  # a recompile would raise here
            logits, grads = forward_backward(compiled, input_ids, labels, **inputs)
    ran = {op: npu_stand_in.calls[op] - before.get(op, 0) for op in STEP_OPS[model_type]}
    assert ran == {op: 3 * n for op, n in STEP_OPS[model_type].items()}
    assert npu_autopatch.status()[model_type].calls == counted  # compiled calls are not counted
    torch.testing.assert_close(logits, eager_logits)
    for name, grad in eager_grads.items():
        if grad is not None:  # the compiled module names its parameters under _orig_mod
            torch.testing.assert_close(grads["_orig_mod." + name], grad, msg=name)


def test_a_patched_model_exports_with_the_fused_ops_in_its_graph(npu_stand_in, dynamo):
    model = tiny_model("qwen3").eval()
    input_ids, _, _ = model_batch(model)
    npu_autopatch.enable(models=["qwen3"])
    with torch.no_grad():
        eager = model(input_ids=input_ids, use_cache=False).logits
        exported = torch.export.export(model, (), {"input_ids": input_ids, "use_cache": False})
        fused = collections.Counter(
            node.target._opname
            for node in exported.graph.nodes
            if isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == npu_stand_in.PROFILE.namespace
        )
        # The model's default attention (sdpa) is torch_npu's on the device: the fused op, once per layer.
        assert fused == {**STEP_OPS["qwen3"], "npu_fusion_attention": 2}
        torch.testing.assert_close(exported.module()(input_ids=input_ids, use_cache=False).logits, eager)
