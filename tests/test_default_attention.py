"""transformers' default attention on the NPU (issue 27): a model that asks for no implementation runs
the patched flash-attention path (kernels/attention/_route.py, ``default_attention``), not sdpa.

Every check runs in a fresh interpreter under the stand-in (transformers caches
``is_torch_npu_available`` and the flash functions it loaded). The parity reference is eager on the
same weights; packed documents are compared with each document run alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers

from npu_autopatch.testing import DEFAULT, PROFILES

from .conftest import FULL, child_env, child_result, present, warm_run

SRC = Path(__file__).resolve().parents[1] / "src"
V4 = int(transformers.__version__.split(".")[0]) < 5
TOLERANCE = {"float32": 1e-4, "bfloat16": 4e-2}  # as testing.parity.TOLERANCE

# The parity cases, each on logits and every parameter's gradient. Sliding windows are made 4 tokens
# long, so that the "window" case's 12 tokens cut on every sliding layer.
PARITY = r"""
import copy, json, sys
import torch
from npu_autopatch.testing import stand_in, tiny

args = json.loads(sys.argv[1])


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


ROUTERS = ("router.weight", "router.classifier.weight", ".gate.weight")  # an MoE router's weight


# {name: tensor} of a run: its selected logits and every parameter's gradient.
def tensors(model, out):
    found = {"logits": out.detach().float()}
    found.update({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    return found


def run_case(model, forward):
    out = forward()
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    (out * w).sum().backward()
    return tensors(model, out)


# [logits error, worst gradient error] of the default path against eager, relative to eager's largest
# value. In bf16 a tensor beyond the tolerance passes when its distance to eager is within the rounding
# bf16 itself causes there: at most twice eager bf16's distance to the fp32 run of the same weights and
# inputs, plus the tolerance (testing.parity.closer_to_fp32 is the stricter half of this: patched no
# further from fp32 than stock). An MoE model's gradients are not compared in bf16 (None): its router
# sums expert outputs with heavy cancellation and its top-k turns on near ties, so one rounding upstream
# (the fused attention rounds once, eager after each op) moves the gradients below it by 10-75 % on the
# tiny models (longcat_flash, deepseek_v2, dots1); the logits are held to the rule above. The fp32
# runs hold every gradient of every model, MoE included, to 1e-4: that is the proof of the backward.
def compare(model, eager, exact, got, expected, truth, tolerance):
    a, b = run_case(model, got), run_case(eager, expected)
    missing = lambda t: torch.full_like(t, float("nan"))  # a gradient the default path did not reach
    errors = {n: rel(a.get(n, missing(t)), t) for n, t in b.items() if t.abs().max() > 0}
    moe = exact is not None and any("experts" in n or n.endswith(ROUTERS) for n in errors)
    if moe:
        errors = {"logits": errors["logits"]}
    over = [n for n, e in errors.items() if not e <= tolerance]
    if over and exact is not None:
        c = run_case(exact, truth)
        for n in over:
            if n in a and errors[n] <= 2 * rel(b[n], c[n]) + tolerance:
                errors[n] = 0.0
    return [errors.pop("logits"), None if moe else max(errors.values(), default=0.0)]


def cases(model, eager, vocab, long):
    torch.manual_seed(1)
    ids = torch.randint(1, vocab, (2, 10))
    right = torch.ones(2, 10, dtype=torch.long)
    right[1, 7:] = 0
    left = torch.ones(2, 10, dtype=torch.long)
    left[1, :4] = 0
    lengths = [6, 8]
    packed = torch.randint(1, vocab, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 8, "max_length_k": 8}
    alone = lambda: torch.cat([eager(chunk).logits for chunk in packed.split(lengths, dim=1)], dim=1)
    window = torch.randint(1, vocab, (1, long))
    return {
        "causal": (lambda: model(ids).logits, lambda: eager(ids).logits),
        "right_padded": (
            lambda: model(ids, attention_mask=right).logits[right.bool()],
            lambda: eager(ids, attention_mask=right).logits[right.bool()],
        ),
        "left_padded": (
            lambda: model(ids, attention_mask=left).logits[left.bool()],
            lambda: eager(ids, attention_mask=left).logits[left.bool()],
        ),
        # The model's default use_cache (True): transformers' own packed detection is then off.
        "packed": (lambda: model(packed, position_ids=positions).logits, alone),
        "cu_seq_lens": (lambda: model(packed, position_ids=positions, **varlen).logits, alone),
        "window": (lambda: model(window).logits, lambda: eager(window).logits),
    }


with stand_in(profile=args["profile"]) as npu:
    import npu_autopatch

    npu_autopatch.enable()  # as NPU_AUTOPATCH=1: every kernel, nothing asked of the attention
    out = {}
    for dtype_name in args["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for name, overrides in args["models"]:
            config = tiny.tiny_config(name, **overrides)
            trained = tiny.trained_config(config)
            text = trained.get_text_config()
            if getattr(text, "sliding_window", None):
                text.sliding_window = 4  # shorter than the "window" case's sequence
            cls = tiny.model_class(trained, by_name=trained is not config)[1]
            torch.manual_seed(0)
            model = cls._from_config(copy.deepcopy(trained), dtype=dtype).eval()
            found = out.setdefault(name, {})
            found["implementation"] = model.config._attn_implementation
            if found["implementation"] != "flash_attention_2":
                continue  # kept on sdpa (which model, and why, is the parent's to check): stock code
            eager = cls._from_config(copy.deepcopy(trained), attn_implementation="eager", dtype=dtype).eval()
            eager.load_state_dict(model.state_dict())
            exact = copy.deepcopy(eager).float() if dtype != torch.float32 else None
            errors = found[dtype_name] = {"fused": {}}
            vocab = min(text.vocab_size, 100)
            truths = cases(exact, exact, vocab, 12) if exact is not None else {}
            for case, (got, expected) in cases(model, eager, vocab, 12).items():
                if case in args["not_run"].get(name, ()):
                    continue
                before = npu.calls["npu_fusion_attention"]
                try:
                    truth = truths.get(case, (None, None))[1]
                    tolerance = args["tolerance"][dtype_name]
                    errors[case] = compare(model, eager, exact, got, expected, truth, tolerance)
                except Exception as exc:
                    errors[case] = f"{type(exc).__name__}: {exc}"[:300]
                errors["fused"][case] = npu.calls["npu_fusion_attention"] - before
    status = npu_autopatch.status()
    out["status"] = {name: [status[name].state.value, status[name].reason] for name in (
        "npu_flash_attention", "default_attention")}
    out["variants"] = sorted(set(status["npu_flash_attention"].variants.values()))
print("RESULT" + json.dumps(out))
"""

# Model types whose tiny model does not take FA2 (neither ``_supports_flash_attn`` nor 4.57's
# ``_supports_flash_attn_2``): they keep sdpa.
# 5.x: gemma3 is the vision-language wrapper (its text model, gemma3_text, takes FA2).
# Whose tiny model transformers 5 gives no flash attention; gemma3's (the vision-language wrapper, whose
# mask FA2 cannot hold) is kept on sdpa on 4.57 too (kernels/attention/_route.py ``_DROPS_BIDIRECTIONAL_4``).
NO_FA2 = {"gemma3"} if V4 else {"gemma3", "glm_moe_dsa", "deepseek_v32"}
_THINKER = "transformers raises with a padding mask: the thinker's config has no vision_start_token_id"
_MROPE = "transformers does not take restarting 2-D position_ids as packing for a 3-D (mrope) model"
_LINEAR = "its linear-attention layers mix packed sequences"
# Cases not run, and why; none is the attention kernel's: stock FA2 and sdpa give the same errors.
NOT_RUN = {
    **{name: {"packed": _MROPE} for name in ("qwen2_5_vl", "qwen2_vl", "glm4v", "glm4v_moe")},
    "qwen2_5_omni": {"packed": _MROPE, "right_padded": _THINKER, "left_padded": _THINKER},
    "qwen3_omni_moe": {"right_padded": _THINKER, "left_padded": _THINKER},
    "kimi_linear": {"packed": _LINEAR, "cu_seq_lens": _LINEAR},
}
# Model types the route leaves on sdpa (kernels/attention/_route.py ``_FA2_FAILS``): transformers' own FA2
# path fails for them (glm4v_moe at batch size 1; on 4.57 right padding refused, packed documents mixed).
KEPT_ON_SDPA = {"glm4v_moe"} | ({"qwen2_moe", "deepseek_v2", "granitemoe"} if V4 else set())
UNFUSED = {"gemma2"}  # attention softcap: the op has none, the kernel runs it unfused (exact)
ALL_CASES = {"causal", "right_padded", "left_padded", "packed", "cu_seq_lens", "window"}


def run_parity(profile, dtypes, models):
    """``models``: [(tiny config's model type, overrides)]."""
    options = {
        "profile": profile,
        "dtypes": dtypes,
        "models": models,
        "not_run": NOT_RUN,
        "tolerance": TOLERANCE,
    }
    return child_result(PARITY, json.dumps(options), timeout=1500)


def assert_parity(found, dtypes):
    status = found.pop("status")
    assert status["npu_flash_attention"][0] == "applied", status  # no fused call given up
    assert status["default_attention"][0] == "applied", status
    sinks_fused = found.pop("variants") == ["dense", "varlen"]  # else gpt-oss's sinks run unfused
    for name, result in found.items():
        routed = name not in NO_FA2 and name not in KEPT_ON_SDPA
        assert result["implementation"] == ("flash_attention_2" if routed else "sdpa"), (name, result)
        if not routed:
            continue
        for dtype in dtypes:
            errors = result[dtype]
            fused = errors.pop("fused")
            assert set(errors) == ALL_CASES - set(NOT_RUN.get(name, ())), (name, dtype, errors)
            bad = {
                case: e
                for case, e in errors.items()
                if not (isinstance(e, list) and all(x is None or x < TOLERANCE[dtype] for x in e))
            }
            assert not bad, (name, dtype, bad)  # [logits, worst gradient] relative errors
            if name not in UNFUSED and (sinks_fused or name != "gpt_oss"):
                assert all(fused[case] > 0 for case in errors), (name, dtype, fused)


CONTROLS = [
    ("llama", {}),
    ("mistral", {"sliding_window": 4}),
    ("gemma3_text", {"sliding_window": 4}),
    ("gpt_oss", {"sliding_window": 4}),
    ("gemma2", {"sliding_window": 4, "attn_logit_softcapping": 5.0}),
]


@pytest.mark.parametrize(
    "profile", [pytest.param(name, marks=() if name == DEFAULT.name else FULL) for name in PROFILES]
)
def test_the_default_path_matches_eager_with_the_fused_op(profile):
    """The control models (llama; sliding windows: mistral, gemma3's text model, gpt-oss with sinks;
    softcap: gemma2, unfused) in fp32 and bf16 on every release profile: causal, right- and left-padded,
    packed by position_ids (with the default cache on) and by cu_seq_lens, a sequence past the window;
    logits and every gradient within tolerance of eager, the fused op called (gpt-oss's sinks unfused
    where the release has no fused sink). They take every variant of the attention kernel; what a
    profile changes is the fused op's rules, which depend on these features, not on the model."""
    found = run_parity(profile, ["float32", "bfloat16"], CONTROLS)
    assert_parity(found, ["float32", "bfloat16"])


@FULL
def test_every_table_model_on_the_default_path_matches_eager():
    """Every table model, every case, fp32 and bf16, on the default profile: a model that supports flash
    attention runs it by default (fused), one that does not keeps sdpa. The release profiles share this
    code and the fused op's math; the controls above run on each of them."""
    from npu_autopatch.models import MODEL_TYPES

    models = [(name, {}) for name in MODEL_TYPES if present(name)]
    found = run_parity(DEFAULT.name, ["float32", "bfloat16"], models)
    assert_parity(found, ["float32", "bfloat16"])


BEHAVIOUR = r"""
import copy, json
import torch
from npu_autopatch.testing import stand_in, tiny


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


with stand_in() as npu:
    import npu_autopatch
    from transformers import AutoModelForCausalLM

    out = {}
    cfg = tiny.tiny_config("qwen3")
    build = lambda **kwargs: AutoModelForCausalLM.from_config(copy.deepcopy(cfg), **kwargs).eval()
    torch.manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    stock_sdpa, stock_eager = build(attn_implementation="sdpa"), build(attn_implementation="eager")
    stock_eager.load_state_dict(stock_sdpa.state_dict())
    weights = stock_sdpa.state_dict()
    with torch.no_grad():
        stock = {m.config._attn_implementation: m(ids, attention_mask=mask).logits
                 for m in (stock_sdpa, stock_eager)}

    npu_autopatch.enable(kernels=["attention"])  # only the attention, so that the rest is stock too
    routed, sdpa, eager = build(), build(attn_implementation="sdpa"), build(attn_implementation="eager")
    for model in (routed, sdpa, eager):
        model.load_state_dict(weights)
    out["implementations"] = [m.config._attn_implementation for m in (routed, sdpa, eager)]
    with torch.no_grad():
        out["explicit_is_stock"] = [torch.equal(m(ids, attention_mask=mask).logits, stock[name])
                                    for name, m in (("sdpa", sdpa), ("eager", eager))]
    out["chosen_by"] = [npu_autopatch.report(m).attention[0].chosen for m in (routed, sdpa)]

    # Packed documents, position_ids restarting, the model's default cache on: stock sdpa lets them
    # attend to each other; the default path keeps them apart.
    lengths = [6, 8]
    packed = torch.randint(1, cfg.vocab_size, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        alone = torch.cat([eager(chunk).logits for chunk in packed.split(lengths, dim=1)], dim=1)
        out["packed"] = [rel(m(packed, position_ids=positions).logits, alone) for m in (routed, sdpa)]

    # generate() with a cache, 1-token queries, with and without a (left) padding mask: stock's tokens
    # and scores; the decode steps run the fused op.
    prompt = torch.randint(1, cfg.vocab_size, (2, 6))
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    prompt_mask[0, :2] = 0
    generated = {}
    for name, kwargs in (("unmasked", {}), ("padded", {"attention_mask": prompt_mask})):
        runs = []
        for model in (routed, sdpa):
            before = npu.calls["npu_fusion_attention"]
            result = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                    output_scores=True, pad_token_id=0, **kwargs)
            runs.append((result, npu.calls["npu_fusion_attention"] - before))
        (mine, fused), (theirs, _) = runs
        generated[name] = {
            "tokens_equal": torch.equal(mine.sequences, theirs.sequences),
            "scores": max(rel(a, b) for a, b in zip(mine.scores, theirs.scores)),
            "fused": fused,
        }
    out["generate"] = generated
    out["calls"] = npu_autopatch.status()["default_attention"].calls

    # disable() gives a routed model stock's default back, enable() the route again; a model whose
    # implementation the user changed since is left alone.
    changed = build()
    changed.set_attn_implementation("eager")
    npu_autopatch.disable()
    out["after_disable"] = [routed.config._attn_implementation, changed.config._attn_implementation]
    npu_autopatch.enable(kernels=["attention"])
    out["after_enable"] = [routed.config._attn_implementation, changed.config._attn_implementation]
    npu_autopatch.enable(kernels=["attention"], default_attention=False)
    record = npu_autopatch.status()["default_attention"]
    out["switched_off"] = [routed.config._attn_implementation, build().config._attn_implementation,
                           record.state.value, record.reason]
print("RESULT" + json.dumps(out))
"""


def test_default_explicit_switch_disable_report_and_generate():
    """The user who chose nothing gets the flash-attention path, one who chose sdpa or eager runs
    exactly stock; packed documents with the cache on are kept apart (stock sdpa mixes them);
    generate() gives stock's tokens; status() counts the decisions, report() names who chose;
    disable() and the switch give stock's sdpa back."""
    found = child_result(BEHAVIOUR, timeout=600)
    assert found["implementations"] == ["flash_attention_2", "sdpa", "eager"], found
    assert found["explicit_is_stock"] == [True, True], found
    routed_by, chosen = found["chosen_by"]
    assert routed_by.startswith("default, routed from sdpa by npu-autopatch"), routed_by
    assert chosen == "the user", chosen
    mine, stock = found["packed"]
    assert mine < 1e-4 < 0.1 < stock, found["packed"]  # stock: the second document sees the first
    for name, run in found["generate"].items():
        assert run["tokens_equal"] and run["scores"] < 1e-4 and run["fused"] > 0, (name, run)
    (target, calls), *others = found["calls"].items()
    assert not others and target.endswith("PreTrainedModel.get_correct_attn_implementation"), found["calls"]
    assert calls["fused"] == 1 and set(calls["stock"]) == {"an explicit choice"}, calls  # routed; sdpa, eager
    assert found["after_disable"] == ["sdpa", "eager"], found
    assert found["after_enable"] == ["flash_attention_2", "eager"], found
    routed, new, state, reason = found["switched_off"]
    assert (routed, new, state) == ("sdpa", "sdpa", "skipped"), found["switched_off"]
    assert "NPU_AUTOPATCH_DEFAULT_ATTENTION=0" in reason, reason


def test_the_environment_switch_turns_the_route_off():
    """``NPU_AUTOPATCH_DEFAULT_ATTENTION=0`` with ``NPU_AUTOPATCH=1``: stock's sdpa, and status() says why."""
    code = (
        "import json, copy\n"
        "from npu_autopatch.testing import stand_in, tiny\n"
        "with stand_in():\n"
        "    import npu_autopatch\n"
        "    npu_autopatch.enable()\n"  # the environment decides: enable() without the argument
        "    from transformers import AutoModelForCausalLM\n"
        "    model = AutoModelForCausalLM.from_config(tiny.tiny_config('qwen3'))\n"
        "    record = npu_autopatch.status()['default_attention']\n"
        "    print(json.dumps([model.config._attn_implementation, record.state.value, record.reason]))\n"
    )
    for value, expected in (("0", ["sdpa", "skipped"]), ("1", ["flash_attention_2", "applied"])):
        result = warm_run(
            [sys.executable, "-c", code],
            env=child_env(PYTHONPATH=str(SRC), NPU_AUTOPATCH_DEFAULT_ATTENTION=value),
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        implementation, state, reason = json.loads(result.stdout.splitlines()[-1])
        assert [implementation, state] == expected, (value, implementation, state, reason)


DECODE = r"""
import copy, json
import torch
from npu_autopatch.testing import stand_in, tiny

with stand_in(profile="a2-2.7.1"):
    import npu_autopatch
    from transformers import AutoModelForCausalLM

    cfg = tiny.tiny_config("qwen3", num_attention_heads=4, num_key_value_heads=2)
    prompt = torch.randint(1, cfg.vocab_size, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    out = {}
    for name in ("stock", "patched"):
        if name == "patched":
            npu_autopatch.enable()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).eval()
        try:
            greedy = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
            tokens = model.generate(prompt, attention_mask=mask, **greedy)
            out[name] = [model.config._attn_implementation, tokens.shape[1]]
        except Exception as exc:
            out[name] = [model.config._attn_implementation, f"{type(exc).__name__}: {exc}"[:300]]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(V4, reason="4.57 repeats k/v for GQA on the NPU: no packed decode mask")
def test_padded_generate_with_gqa_runs_on_the_2_7_1_line_through_the_default_path():
    """transformers 5's sdpa packs a GQA decode query into [B, Nkv, n_rep, D] with a [B, 1, 1, Skv] mask,
    which the device refuses up to op-plugin 26.0.0 (docs/device-rules.md): stock generate() with a
    padded batch fails at its first decode step on the 2.7.1 line; the default path runs it."""
    found = child_result(DECODE, timeout=300)
    (stock_path, stock), (patched_path, patched) = found["stock"], found["patched"]
    assert stock_path == "sdpa" and "atten_mask" in str(stock), found
    assert patched_path == "flash_attention_2" and patched == 9, found
