"""The default route decided per call (issue 32): what a routed model's call carries that the flash path
cannot take runs stock's sdpa for that call; a shape the fused op refuses runs unfused for that shape
only; one decision per model built, counted once and named right in report(); a wrapper that refuses
flash attention keeps its towers off it; torch.compile gets stock's path.

Every check runs in a fresh interpreter under the stand-in (transformers caches
``is_torch_npu_available`` and the flash functions it loaded).
"""

from __future__ import annotations

import json

import pytest
import transformers

from npu_autopatch.models import MODEL_TYPES

from .conftest import FULL, child_result, present

V4 = int(transformers.__version__.split(".")[0]) < 5

# The reproduction, generalised: 4-D masks (bool and float; causal, block-diagonal packing with
# restarting position_ids, left padding) on routed models against the same model on stock sdpa (the route
# switched off), logits and every gradient; the calls counted stock with their reason.
MASKS = r"""
import copy, json, sys
import torch
from npu_autopatch.testing import stand_in, tiny

model_types = json.loads(sys.argv[1])
S = 10


def masks():
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    doc = torch.tensor([0] * 4 + [1] * 6)
    packed = causal & (doc[:, None] == doc[None, :])
    positions = torch.cat([torch.arange(4), torch.arange(6)])
    pad = torch.ones(2, S, dtype=torch.bool)
    pad[0, :3] = False
    left = causal[None] & pad[:, None, :]
    left |= torch.eye(S, dtype=torch.bool)[None]  # a padded query sees itself: no fully masked row
    cases = {
        "causal": (causal[None, None].expand(2, 1, S, S), None),
        "packed": (packed[None, None].expand(2, 1, S, S), positions[None].expand(2, S)),
        "left-padded": (left[:, None], None),
    }
    out = {}
    for name, (mask, position_ids) in cases.items():
        out[name + " bool"] = (mask, position_ids)
        out[name + " float"] = ((~mask).float() * torch.finfo(torch.float32).min, position_ids)
    return out


def run(model, mask, position_ids, ids):
    out = model(ids, attention_mask=mask, position_ids=position_ids).logits
    out.mul(torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    found = {"logits": out.detach()}
    found.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    return found


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


with stand_in() as npu:
    import npu_autopatch

    npu_autopatch.enable()
    result = {}
    for model_type in model_types:
        cfg = tiny.tiny_config(model_type)
        routed = tiny.model_from_config(copy.deepcopy(cfg))
        explicit = copy.deepcopy(cfg)
        explicit._attn_implementation_internal = "sdpa"  # the user's choice (4.57's tiny_config drops it)
        stock = tiny.model_from_config(explicit)
        stock.load_state_dict(routed.state_dict())
        ids = torch.randint(1, 100, (2, S), generator=torch.Generator().manual_seed(0))
        errors = {}
        for name, (mask, position_ids) in masks().items():
            try:
                want = run(stock, mask, position_ids, ids)
            except Exception as exc:  # transformers' own code takes no 4-D mask here: nothing to compare
                errors[name] = f"stock: {type(exc).__name__}"
                continue
            got = run(routed, mask, position_ids, ids)
            errors[name] = max(rel(got[n], want[n]) for n in want if want[n].abs().max() > 0)
        result[model_type] = {"implementation": routed.config._attn_implementation, "errors": errors}
    calls = npu_autopatch.status()["default_attention"].calls
    (counts,) = calls.values()
    result["counts"] = counts
print("RESULT" + json.dumps(result))
"""

MASK_MODELS = ["qwen3", "mistral", "qwen3_moe"]


def test_a_custom_4d_mask_on_a_routed_model_is_stock_sdpa():
    """The issue's crash (IndexError in transformers' FA2 unpadding): a 4-D mask now runs stock sdpa for
    that call, within 1e-4 of the same model on sdpa, logits and every gradient, bool and float masks."""
    found = child_result(MASKS, json.dumps([m for m in MASK_MODELS if present(m)]), timeout=900)
    counts = found.pop("counts")
    for model_type, case in found.items():
        assert case["implementation"] == "flash_attention_2", found
        assert all(error < 1e-4 for error in case["errors"].values()), (model_type, case)
    # each forward's attention calls (one per layer), counted stock with the reason
    assert counts["stock"]["attention call with a 4-D mask"] >= 6 * len(found), counts
    assert counts["fused"] == len(found), counts  # one routed decision per model built


# Not compared: the omni models' tiny builds have no auto class taking their config (their thinkers are
# tested through the default path's parity), and gpt-oss (and, on 5.x, gemma2: its softcap) has no sdpa
# in transformers (stock raises).
NO_STOCK_SDPA = {"qwen2_5_omni", "qwen3_omni_moe", "gpt_oss"} | (set() if V4 else {"gemma2"})


@FULL
def test_a_custom_4d_mask_is_stock_sdpa_on_every_table_model():
    models = [m for m in MODEL_TYPES if m not in NO_STOCK_SDPA and present(m)]
    found = child_result(MASKS, json.dumps(models), timeout=2400)
    found.pop("counts")
    compared = {m: [e for e in c["errors"].values() if not isinstance(e, str)] for m, c in found.items()}
    over = {m: found[m]["errors"] for m, errors in compared.items() if not all(e < 1e-4 for e in errors)}
    assert not over, over
    assert len(found) == len(models), found
    # stock refuses 4-D masks only where transformers' own code cannot take one (4.57's mRoPE index)
    assert sum(len(errors) == 6 for errors in compared.values()) >= len(models) - 10, found


# One process, two routed models: one with a head dim the fused op does not take (896 > 768: its
# documented limit), one within it; a third whose shape class the device refuses at run time. The
# others keep the fused op; every output equals eager.
SHAPES = r"""
import copy, json
import torch
from npu_autopatch.testing import stand_in, tiny

with stand_in() as npu:
    import npu_autopatch

    npu_autopatch.enable()
    models = {}
    for name, head_dim in (("normal", 16), ("wide", 896), ("refused", 32)):
        cfg = tiny.tiny_config("qwen3", head_dim=head_dim)
        routed = tiny.model_from_config(copy.deepcopy(cfg))
        eager = tiny.model_from_config(copy.deepcopy(cfg))
        eager.set_attn_implementation("eager")
        eager.load_state_dict(routed.state_dict())
        models[name] = (routed, eager)
    fused = npu.npu_fusion_attention

    def device_refuses_32(query, *args, **kwargs):
        out = fused(query, *args, **kwargs)  # counted as a call, as the device would have been asked
        if query.shape[-1] == 32:
            raise RuntimeError("EZ9999: a rule nobody knew")
        return out

    npu.npu_fusion_attention = device_refuses_32
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = {}
    for round in range(2):
        for name, (routed, eager) in models.items():
            before = npu.calls["npu_fusion_attention"]
            with torch.no_grad():
                got, want = routed(ids).logits, eager(ids).logits
            error = ((got - want).abs().max() / want.abs().max()).item()
            out[f"{name} {round}"] = [error, npu.calls["npu_fusion_attention"] - before]
    counts = npu_autopatch.status()["npu_flash_attention"].calls
    out["stock"] = {k: v for c in counts.values() for k, v in c["stock"].items()}
    out["implementations"] = [routed.config._attn_implementation for routed, _ in models.values()]
print("RESULT" + json.dumps(out))
"""


def test_a_refused_shape_runs_unfused_for_that_shape_only():
    """A head dim the op does not take runs unfused without asking it; a shape class the op raised on
    runs unfused from then on; the other model's calls stay fused (before: the first failure turned fused
    attention off for the whole process)."""
    found = child_result(SHAPES, timeout=600)
    assert found.pop("implementations") == ["flash_attention_2"] * 3, found
    stock = found.pop("stock")
    layers = 2  # the tiny qwen3's attention calls per forward
    for name, (error, fused_calls) in found.items():
        assert error < 1e-4, found
        if name.startswith("normal"):
            assert fused_calls == layers, found  # still fused after the other two were refused
        elif name.startswith("wide") or name == "refused 1":
            assert fused_calls == 0, found  # never asked (the rule), not asked again (the failure)
    assert found["refused 0"][1] == 1, found  # asked once, raised, the shape remembered
    assert stock["device rule: head dim outside 1..768"] == 2 * layers, stock
    assert stock["op-failed"] == 2 * layers, stock


# One decision per model built, counted once, and report()'s "chosen by" naming who chose.
COUNTS = r"""
import copy, json, sys
import torch
from npu_autopatch.testing import stand_in, tiny

cases = json.loads(sys.argv[1])
with stand_in() as npu:
    import npu_autopatch

    npu_autopatch.enable()

    def counts():
        calls = npu_autopatch.status()["default_attention"].calls
        (entry,) = calls.values() or [{"fused": 0, "stock": {}}]
        return {"routed": entry["fused"], **entry["stock"]}

    out = {}
    for model_type, explicit in cases:
        before = counts()
        cfg = tiny.tiny_config(model_type)
        if explicit:
            cfg._attn_implementation_internal = explicit  # the user's choice, as from_pretrained's
        model = tiny.model_from_config(cfg)
        after = counts()
        out[f"{model_type} {explicit}"] = {
            "counted": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)},
            "chosen": sorted({entry.chosen for entry in npu_autopatch.report(model).attention}),
        }
print("RESULT" + json.dumps(out))
"""

ROUTED = "default, routed from sdpa by npu-autopatch (packed documents kept apart)"


def test_each_model_build_is_counted_once_with_its_reason():
    cases = [("qwen3", None), ("qwen3", "sdpa"), ("qwen2_5_vl", None), ("glm4v_moe", None)]
    if not V4:
        cases.append(("deepseek_v32", None))  # no flash attention in transformers 5
    cases = [case for case in cases if present(case[0])]
    found = child_result(COUNTS, json.dumps(cases), timeout=600)
    expected = {
        "qwen3 None": ({"routed": 1}, [ROUTED]),
        "qwen3 sdpa": ({"an explicit choice": 1}, ["the user"]),
        "qwen2_5_vl None": ({"routed": 1}, [ROUTED]),
        "glm4v_moe None": (
            {"transformers' FA2 path fails for it": 1},
            ["transformers' default (transformers' FA2 path fails for it)"],
        ),
        "deepseek_v32 None": (
            {"no flash attention in transformers": 1},
            ["transformers' default (no flash attention in transformers)"],
        ),
    }
    for case, got in found.items():
        counted, chosen = expected[case]
        assert got == {"counted": counted, "chosen": chosen}, (case, found)


# A wrapper whose mask is not causal-only (bidirectional over the image tokens, PaliGemma's prefix)
# refuses FA2 in transformers 5: its towers, built as models of their own, stay on stock's path too.
WRAPPERS = r"""
import copy, inspect, json, sys
import torch
from npu_autopatch.testing import stand_in, tiny, parity

model_types = json.loads(sys.argv[1])
with stand_in() as npu:
    import npu_autopatch

    if json.loads(sys.argv[2]):
        npu_autopatch.enable()
    out = {}
    for model_type in model_types:
        cfg = tiny.tiny_config(model_type)
        model = tiny.model_from_config(copy.deepcopy(cfg))
        eager = tiny.model_from_config(copy.deepcopy(cfg))
        eager.set_attn_implementation("eager")
        eager.load_state_dict(model.state_dict())
        ids, labels, inputs = tiny.model_batch(model)
        image = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", None)
        marks = (ids == image).long()
        if model_type == "paligemma":
            marks = torch.ones_like(ids)
            marks[:, : ids.shape[1] // 2] = 0  # prefix (bidirectional) then suffix
        if "token_type_ids" in inspect.signature(model.forward).parameters:
            inputs["token_type_ids"] = marks
        model.train(), eager.train()
        got, want = parity.forward(model, ids, **inputs), parity.forward(eager, ids, **inputs)
        implementations = {
            name: getattr(getattr(model.config, name), "_attn_implementation", None)
            for name in getattr(model.config, "sub_configs", {})
        }
        out[model_type] = {
            "error": ((got - want).abs().max() / want.abs().max()).item(),
            "implementations": sorted(set(implementations.values())),
            "images": int((ids == image).sum()),
        }
print("RESULT" + json.dumps(out))
"""


@pytest.mark.parametrize("model_type", ["gemma3", "paligemma"])
def test_the_towers_of_a_wrapper_without_flash_attention_stay_off_the_route(model_type):
    """Gemma 3's and PaliGemma's vision-language classes (transformers 5: ``_supports_flash_attn =
    False``, FA2 drops their bidirectional mask; 4.57 lets them run FA2): logits equal eager within 1e-4
    on the default path, their text and vision models on sdpa."""
    found = child_result(WRAPPERS, json.dumps([model_type]), "true", timeout=600)[model_type]
    assert found["images"] > 0, found
    assert found["implementations"] == ["sdpa"], found
    assert found["error"] < 1e-4, found


@pytest.mark.parametrize("model_type", [pytest.param("gemma3", marks=FULL)])
def test_the_wrapper_case_fails_on_flash_attention(model_type):
    """The control: the same model with its towers on FA2 (explicitly, the route off) is more than 1e-3
    off eager, so the test above can fail."""
    code = WRAPPERS.replace(
        "model = tiny.model_from_config(copy.deepcopy(cfg))",
        "model = tiny.model_from_config(copy.deepcopy(cfg)); model.set_attn_implementation("
        "{'text_config': 'flash_attention_2', 'vision_config': 'flash_attention_2', '': 'sdpa'})",
    )
    found = child_result(code, json.dumps([model_type]), "false", timeout=600)[model_type]
    assert found["error"] > 1e-3, found


# torch.compile on the default path: the compiled forward is stock's (sdpa's mask and function, no host
# copies), fullgraph with a padded mask; output_attentions and the fp32 message as stock.
COMPILE = r"""
import copy, io, json, logging, sys
import torch
import torch._dynamo
from npu_autopatch.testing import stand_in, tiny

route = json.loads(sys.argv[1])
with stand_in() as npu:
    import npu_autopatch

    if route:
        npu_autopatch.enable()
    from transformers.utils import logging as hf_logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    hf_logging.get_logger("transformers").addHandler(handler)
    cfg = tiny.tiny_config("qwen3")
    model = tiny.model_from_config(copy.deepcopy(cfg)).eval()
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        eager_logits = model(ids, attention_mask=mask).logits
        attentions = model(ids, attention_mask=mask, output_attentions=True)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model, fullgraph=True)
        first = compiled(ids, attention_mask=mask).logits
        second = compiled(ids + 1, attention_mask=mask.clone()).logits
    out = {
        "implementation": model.config._attn_implementation,
        "error": ((first - eager_logits).abs().max() / eager_logits.abs().max()).item(),
        "graphs": dict(torch._dynamo.utils.counters["stats"]),
        "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "recompiles": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "attentions": not any(a is not None for a in attentions.attentions or ()),
        "fp32 message": "Casting fp32 inputs back" in stream.getvalue(),
    }
print("RESULT" + json.dumps(out))
"""


def test_compiled_forward_takes_stock_path():
    stock = child_result(COMPILE, "false", timeout=900)
    routed = child_result(COMPILE, "true", timeout=900)
    assert routed["implementation"] == "flash_attention_2", routed
    assert routed["error"] < 1e-4, routed
    assert routed["breaks"] == stock["breaks"] == 0, (routed, stock)
    assert routed["recompiles"] <= stock["recompiles"], (routed, stock)
    assert routed["attentions"] == stock["attentions"], (routed, stock)
    assert not routed["fp32 message"], routed  # stock sdpa prints nothing; neither does the route


# A torch_npu without npu_rotary_mul: llama's patch fails (all or nothing: op-missing), so its
# attention is not routed either; status says what runs.
LEFT_STOCK = r"""
import json
from npu_autopatch.testing import stand_in, tiny

with stand_in(missing=["npu_rotary_mul"]) as npu:
    import npu_autopatch

    npu_autopatch.enable()
    model = tiny.model_from_config(tiny.tiny_config("llama"))
    record = npu_autopatch.status()["llama"]
    (calls,) = npu_autopatch.status()["default_attention"].calls.values()
    out = {"state": record.state.value, "implementation": model.config._attn_implementation, "calls": calls}
print("RESULT" + json.dumps(out))
"""


def test_a_model_left_stock_keeps_stock_attention():
    found = child_result(LEFT_STOCK, timeout=300)
    assert found["state"] == "failed", found
    assert found["implementation"] == "sdpa", found
    assert found["calls"] == {"fused": 0, "stock": {"model left stock": 1}}, found


# The experts' fused calls under gradient checkpointing: non-reentrant checkpointing stops the
# recomputation inside npu_moe_token_unpermute (it has what the backward needs), before the replacement
# counts its call; the call is counted all the same, as the fused op it is.
MOE_COUNTS = r"""
import collections, json
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import forward_backward, model_batch, tiny_model

with stand_in() as npu:
    import npu_autopatch

    out = {}
    for reentrant in (True, False):
        model = tiny_model("qwen3_moe")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        ids, labels, inputs = model_batch(model, 1)
        npu_autopatch.enable(models=["qwen3_moe"])
        before = collections.Counter(npu.calls)
        forward_backward(model, ids, labels, **inputs)
        ops = collections.Counter(npu.calls) - before
        calls = npu_autopatch.status()["qwen3_moe"].calls
        experts = [c["fused"] for target, c in calls.items() if "Experts" in target or "SparseMoe" in target]
        out[str(reentrant)] = {"unpermute": ops["npu_moe_token_unpermute"], "fused": sum(experts)}
        npu_autopatch.disable()
print("RESULT" + json.dumps(out))
"""


def test_moe_fused_counts_match_the_op_calls_under_both_checkpointing_forms():
    found = child_result(MOE_COUNTS, timeout=600)
    for form, got in found.items():
        assert got["unpermute"] >= 2, found  # the forward and its recomputation
        assert got["fused"] == got["unpermute"], (form, found)


# Compiled generate with a static cache (transformers' compileable cache; 5.x compiles its decode on
# its own): transformers builds its masks up front, outside the compiled forward; a routed model's are
# stock's sdpa masks, so the compiled forward is stock's: fullgraph, the same graphs, the same tokens.
GENERATE = r"""
import json, sys
import torch, torch._dynamo
from npu_autopatch.testing import stand_in, tiny

with stand_in() as npu:
    import npu_autopatch

    if json.loads(sys.argv[1]):
        npu_autopatch.enable()
    model = tiny.model_from_config(tiny.tiny_config("qwen3")).eval()
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.forward = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation="static"
        )
    counters = torch._dynamo.utils.counters
    print("RESULT" + json.dumps({
        "tokens": out.tolist(),
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "implementation": model.config._attn_implementation,
    }))
"""


def test_compiled_static_cache_generate_compiles_as_stock():
    stock = child_result(GENERATE, "false", timeout=900)
    routed = child_result(GENERATE, "true", timeout=900)
    assert routed.pop("implementation") == "flash_attention_2", routed
    assert stock.pop("implementation") == "sdpa", stock
    assert routed == stock, (routed, stock)
