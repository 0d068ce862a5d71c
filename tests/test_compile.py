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

from .conftest import child_result

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


# A routed model (no attn_implementation: the default route chose FA2) under torch.compile, called with
# no mask: a packed batch (position_ids restarting per document, TRL's padding-free and verl's rmpad
# batches) and a plain unpadded one go through transformers' flash path as they do uncompiled, with its
# ``_flash_attention_forward`` looked up at call time (verl's Ulysses replaces it: here a counting
# stand-in does). A cache beside the query (generate's decode steps) keeps stock's sdpa masks. One child
# for all cases (transformers caches is_torch_npu_available and the flash functions it loaded); dynamo's
# eager backend: the route decides while dynamo traces, whatever backend then runs the graphs.
ROUTED_COMPILE = r"""
import io, json, logging
import torch, torch._dynamo
from npu_autopatch.testing import stand_in, tiny

LENGTHS = (5, 7, 4)  # three documents packed in one row


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def step(model, ids, position_ids):
    # logits and every gradient of one forward-backward (a fixed random cotangent)
    logits = model(ids, position_ids=position_ids, use_cache=True).logits
    logits.mul(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


with stand_in() as npu:
    import npu_autopatch

    npu_autopatch.enable()
    import transformers.integrations.flash_attention as integration

    calls = []
    original = integration._flash_attention_forward

    def replaced(*args, **kwargs):  # what verl's Ulysses does: a function of its own in that slot
        calls.append(1)
        return original(*args, **kwargs)

    integration._flash_attention_forward = replaced
    # transformers' FA2 code prints "Casting fp32 inputs back ..." for an fp32 model, once per process
    # (warning_once): not for a routed one (stock sdpa prints nothing), compiled or not
    from transformers.utils import logging as hf_logging

    stream = io.StringIO()
    hf_logging.get_logger("transformers").addHandler(logging.StreamHandler(stream))
    out = {"cases": {}}
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(1, 100, (1, sum(LENGTHS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    unpadded = torch.randint(1, 100, (2, 9), generator=gen)
    # fp32 for the packed rows (compared with each document alone); the unpadded batch in bf16, where
    # transformers' flash path has no data-dependent step and prints nothing: one graph, as explicit FA2
    for name, ids, position_ids, dtype in (
        ("packed", packed, positions, torch.float32), ("unpadded", unpadded, None, torch.bfloat16)
    ):
        model = tiny.model_from_config(tiny.tiny_config("qwen3"), dtype=dtype)
        out["implementation"] = model.config._attn_implementation
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        calls.clear()
        compiled = step(torch.compile(model, backend="eager"), ids, position_ids)  # first: see the log below
        compiled_calls = len(calls)
        calls.clear()
        eager = step(model, ids, position_ids)
        case = {
            "calls": [len(calls), compiled_calls],
            "logits": rel(compiled[0], eager[0]),
            "grads": max(rel(compiled[1][n], g) for n, g in eager[1].items()),
            "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        }
        if name == "packed":
            with torch.no_grad():
                starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
                alone = [
                    model(ids[:, a : a + n], position_ids=torch.arange(n)[None]).logits
                    for a, n in zip(starts, LENGTHS)
                ]
            case["alone"] = rel(compiled[0], torch.cat(alone, dim=1))
            # torch.export keeps stock's path (FA2's packed test reads the position_ids, which an
            # exported graph cannot guard on): the exported row still equals its documents alone
            arguments = {"input_ids": ids, "position_ids": position_ids, "use_cache": False}
            with torch.no_grad():
                exported = torch.export.export(model.eval(), (), arguments).module()(**arguments).logits
            case["exported"] = rel(exported, torch.cat(alone, dim=1))
        out["cases"][name] = case
    # generate with the default (dynamic) cache and no mask: the prefill takes the flash path, the decode
    # steps (a cache beside the query) stock's sdpa; a compiled forward gives the uncompiled tokens
    model.eval()
    prompt = packed[:, :6]
    with torch.no_grad():
        eager_tokens = model.generate(prompt, max_new_tokens=3, do_sample=False).tolist()
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="eager")
        out["generate"] = model.generate(prompt, max_new_tokens=3, do_sample=False).tolist() == eager_tokens
    out["fp32 message"] = "Casting fp32 inputs back" in stream.getvalue()
print("RESULT" + json.dumps(out))
"""


def test_a_compiled_routed_model_takes_the_flash_path_as_uncompiled():
    found = child_result(ROUTED_COMPILE, timeout=600)
    assert found["implementation"] == "flash_attention_2", found
    for name, case in found["cases"].items():
        eager_calls, compiled_calls = case["calls"]
        # the replaced function ran, uncompiled and compiled alike
        assert eager_calls > 0 and compiled_calls == eager_calls, (name, case)
        assert case["logits"] <= 1e-4 and case["grads"] <= 1e-4, (name, case)
    # documents apart when compiled: each equals itself run alone (stock's sdpa mask mixed them)
    assert found["cases"]["packed"]["alone"] <= 1e-4, found
    assert found["cases"]["packed"]["exported"] <= 1e-4, found
    assert found["cases"]["unpadded"]["breaks"] == 0, found
    assert found["generate"], found
    assert not found["fp32 message"], found
