"""Every call of a replacement is counted, fused or stock by reason (issue 26 item 4), and the device
family decides whether gpt-oss's sinks are fused (item 5: never on the Ascend 950)."""

import json
import logging
import math

import torch
from transformers.models.qwen3 import modeling_qwen3

import npu_autopatch
from npu_autopatch import Calls
from npu_autopatch.__main__ import format_table
from npu_autopatch.kernels import KERNELS
from npu_autopatch.kernels._requirements import device_family, sink_requirement
from npu_autopatch.kernels.attention import _fused as attention_kernel
from npu_autopatch.testing import PROFILES, stand_in, tiny

from .conftest import child_result

QWEN3 = modeling_qwen3.__name__
NORM = f"{QWEN3}:Qwen3RMSNorm.forward"
ROTARY = f"{QWEN3}:apply_rotary_pos_emb"
LAYERS = 7  # 3 forwards x 7 layers = 21 rotary calls: past the 20 the mostly-stock WARNING waits for


def three_forwards(npu):
    """A tiny qwen3 at the rotary kernel's per-call limit (head dim 896), patched, run three times."""
    npu_autopatch.enable(models=["qwen3"])
    model = tiny.tiny_model(
        "qwen3",
        head_dim=896,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=LAYERS,
        layer_types=["full_attention"] * LAYERS,
    )
    npu.calls.clear()
    ids = torch.randint(1, 50, (1, 5))
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=ids)
    return model


def test_qwen3_at_head_dim_896_counts_fused_norms_and_stock_rotaries_with_one_warning(npu_stand_in, caplog):
    with caplog.at_level(logging.WARNING, logger="npu_autopatch"):
        three_forwards(npu_stand_in)
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "applied"
    assert record.calls[NORM] == {"fused": npu_stand_in.calls["npu_rms_norm"], "stock": {}}
    assert npu_stand_in.calls["npu_rms_norm"] == 3 * (
        4 * LAYERS + 1
    )  # 2 layer norms + q/k norms, the final one
    assert record.calls[ROTARY] == {"fused": 0, "stock": {"head-dim 896 > 895": 3 * LAYERS}}
    assert npu_stand_in.calls["npu_rotary_mul"] == 0
    assert json.loads(json.dumps(record.as_dict()))["calls"] == record.calls
    warnings = [r.getMessage() for r in caplog.records if "calls ran the stock code" in r.getMessage()]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    assert warning.startswith(f"npu-autopatch: {ROTARY}: 20 of 20 calls ran the stock code")
    assert "head-dim 896 > 895" in warning and "(1, 2, 5, 896) torch.float32" in warning
    table = format_table({"qwen3": record})
    assert f"{ROTARY}: fused 0, stock {3 * LAYERS} (head-dim 896 > 895: {3 * LAYERS})" in table
    assert f"{NORM}: fused {npu_stand_in.calls['npu_rms_norm']}, stock 0" in table


def test_report_shows_the_calls_of_the_model_targets(npu_stand_in):
    from npu_autopatch import report

    model = three_forwards(npu_stand_in)
    coverage = report(model)
    assert coverage.calls[ROTARY]["stock"] == {"head-dim 896 > 895": 3 * LAYERS}
    assert coverage.as_dict()["calls"] == coverage.calls
    (row,) = [line for line in str(coverage).splitlines() if line.startswith(ROTARY) and "fused" in line]
    assert row.split(maxsplit=1)[1] == f"fused 0, stock {3 * LAYERS} (head-dim 896 > 895: {3 * LAYERS})"


def test_disable_keeps_the_counts_and_the_next_enable_starts_from_zero(npu_stand_in):
    three_forwards(npu_stand_in)
    counted = npu_autopatch.status()["qwen3"].calls
    npu_autopatch.disable()
    reverted = npu_autopatch.status()["qwen3"]
    assert reverted.state == "reverted" and reverted.calls == counted
    npu_autopatch.enable(models=["qwen3"])
    again = npu_autopatch.status()["qwen3"]
    assert again.state == "applied"
    assert again.calls and all(c == {"fused": 0, "stock": {}} for c in again.calls.values()), again.calls


def test_the_mostly_stock_report_needs_twenty_calls_and_more_than_a_tenth_stock():
    told = []
    calls = Calls(lambda c, reason, tensors: told.append((reason, c.fused, dict(c.stock))))
    calls.fused = 18
    calls.went_stock("eval")
    assert not told  # 19 calls
    calls.went_stock(lambda: "no_grad", (torch.ones(2),))  # 20 calls, 2 stock: not more than a tenth
    assert not told
    calls.went_stock("eval")  # 21 calls, 3 stock
    assert told == [("eval", 18, {"eval": 2, "no_grad": 1})]
    calls.went_stock("eval")
    assert len(told) == 1  # once
    assert calls.as_dict() == {"fused": 18, "stock": {"eval": 3, "no_grad": 1}}


def test_an_evaluation_loop_with_the_loss_switch_is_counted_but_not_warned_about(npu_stand_in, caplog):
    """eval and no_grad are the caller's choices (routine); a head wrapped by hooks (FSDP2 sharding it
    alone, DeepSpeed, offload) means no training step got the chunked loss: only that is the
    mostly-stock WARNING's business. (Autocast was that example until issue 35 made it chunked.)"""
    npu_autopatch.enable(models=["qwen3"], kernels=[], loss=True)
    model = tiny.tiny_model("qwen3")
    ids = torch.randint(1, 50, (2, 6))
    target = f"{QWEN3}:Qwen3ForCausalLM.forward"
    model.eval()
    with caplog.at_level(logging.WARNING, logger="npu_autopatch"), torch.no_grad():
        for _ in range(25):
            model(input_ids=ids, labels=ids)
    assert npu_autopatch.status()["qwen3"].calls[target] == {"fused": 0, "stock": {"eval": 25}}
    assert not [r for r in caplog.records if "calls ran the stock code" in r.getMessage()]
    model.train()
    model.lm_head.register_forward_pre_hook(lambda module, inputs: None)
    with caplog.at_level(logging.WARNING, logger="npu_autopatch"):
        for _ in range(25):
            model(input_ids=ids, labels=ids)
    told = [r.getMessage() for r in caplog.records if "calls ran the stock code" in r.getMessage()]
    assert len(told) == 1 and target in told[0] and "lm_head not a plain nn.Linear" in told[0], told


def test_a_fused_op_that_raises_is_counted_op_failed(npu_stand_in, monkeypatch):
    npu_autopatch.enable(models=["qwen3"], kernels=["rms_norm"])
    model = tiny.tiny_model("qwen3")

    def refuse(*args, **kwargs):
        raise RuntimeError("EZ1001: a device rule nobody knew")

    monkeypatch.setattr(npu_stand_in, "npu_rms_norm", refuse)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 50, (1, 5)))
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "partial" and record.stock == {NORM: "op-failed"}
    assert record.calls[NORM] == {"fused": 0, "stock": {"op-failed": 1}}  # then stock is back in place


def test_the_stand_in_answers_the_soc_name_as_torch_npu_does():
    with stand_in() as npu:
        assert npu.npu.get_device_name(0) == device_family(npu) == "Ascend910B1"
        assert sink_requirement(npu) is None
    with stand_in(profile="950-newest") as npu:
        assert device_family(npu) == "Ascend950" and npu.__version__ == PROFILES["a2-newest"].torch_npu
        assert "Ascend 950" in sink_requirement(
            npu
        ) and "FlashAttentionKernelNpuOpApi.cpp" in sink_requirement(npu)
    with stand_in() as npu:
        npu.npu.get_device_name = lambda i=0: "Ascend310P3"  # a family the stand-in does not model
        assert "Ascend310P3" in sink_requirement(npu)


def test_the_950_profile_drops_the_sink_in_the_fused_forward():
    """The control for the gpt-oss test below: on the 950 profile the fused sink path is wrong (as on the
    device), on the A2 profile right; so only the unfused variant may run there."""
    q, k, v, sink = attention_kernel._probe_inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    expected = attention_kernel._eager(q, k, v, scale, True, None, sink)
    dense = next(v for v in KERNELS["attention"].variants if v.name == "dense")

    def fused_error(profile):
        with stand_in(profile=profile) as npu:
            from transformers.integrations import npu_flash_attention

            built = dense.build(npu_flash_attention.npu_flash_attn_func, npu, lambda exc, *t: None)
            got = built(q, k, v, softmax_scale=scale, causal=True, s_aux=sink)
            return (got - expected).abs().max().item()

    assert fused_error("a2-newest") < 1e-5
    assert fused_error("950-newest") > 1e-2


GPT_OSS = r"""
import copy, json
import torch
from npu_autopatch.testing import stand_in, tiny

with stand_in(profile="950-newest") as npu:
    import npu_autopatch

    npu_autopatch.enable(kernels=["attention"])
    from transformers import AutoModelForCausalLM

    cfg = tiny.tiny_config("gpt_oss", sliding_window=4)
    torch.manual_seed(0)
    fa = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2")
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.load_state_dict(fa.state_dict())
    ids = torch.randint(1, cfg.vocab_size, (2, 10))
    a, b = fa(ids).logits, eager(ids).logits
    (a.sum()).backward()
    (b.sum()).backward()
    pairs = zip(fa.named_parameters(), eager.parameters())
    sinks = [(p.grad, q.grad) for (name, p), q in pairs if "sinks" in name]
    record = npu_autopatch.status()["npu_flash_attention"]
    out = {
        "error": ((a - b).abs().max() / b.abs().max()).item(),
        "sink_grad_error": max((g - e).abs().max().item() for g, e in sinks),
        "fused": npu.calls["npu_fusion_attention"],
        "state": record.state.value,
        "variants": sorted(set(record.variants.values())),
        "reason": record.reason,
        "calls": record.calls,
    }
print("RESULT" + json.dumps(out))
"""


def test_gpt_oss_on_the_950_runs_its_sinks_unfused_and_status_says_why():
    found = child_result(GPT_OSS, timeout=600)
    assert found["state"] == "applied", found
    assert found["variants"] == ["dense_unfused_sinks", "varlen_unfused_sinks"], found
    assert found["fused"] == 0 and found["error"] < 1e-4 and found["sink_grad_error"] < 1e-4, found
    assert "runs its dense_unfused_sinks variant, not dense" in found["reason"], found["reason"]
    assert "on Ascend950 (Ascend 950)" in found["reason"], found["reason"]
    dense = next(c for where, c in found["calls"].items() if where.endswith(":npu_flash_attn_func"))
    assert dense == {"fused": 0, "stock": {"sinks unfused": 2}}, found["calls"]  # two layers, one forward
