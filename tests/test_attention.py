"""The attention kernel: transformers' FA2-on-NPU path, patched, against ``attn_implementation="eager"``.

Each check runs in a fresh interpreter (transformers caches ``is_torch_npu_available`` and the flash
functions it loaded): tiny models with the same weights, FA2 through the stand-in's
``npu_fusion_attention`` vs eager, on a causal batch (BSND, with every gradient), a right-padded batch and
packed sequences (TND: position_ids restarting, and verl-style ``cu_seq_lens_q/k``). The sliding window
(W = 4) is shorter than every sequence. Unpatched, the window and the sinks are dropped: the control run
shows the same cases 27-84 % off (gradients 84-162 %; 5.x gpt-oss raises KeyError), so these tests fail
without the kernel.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from npu_autopatch.kernels import KERNELS, choose_variant, golden_ops
from npu_autopatch.kernels.attention import _fused as attention_kernel

from .conftest import FULL, child_env, child_result, warm_run

SRC = Path(__file__).resolve().parents[1] / "src"
V4 = int(transformers.__version__.split(".")[0]) < 5
# Sliding-window layers (gpt_oss also has sinks); exaone4 is not in the table: FA2 is patched for any model.
WINDOWED = ("mistral", "qwen2", "gemma3", "gpt_oss", "olmo3", "phi3", "exaone4")
MODELS = ("llama", *WINDOWED, "gemma2")  # llama: the control; gemma2: softcap (runs unfused)
CASES = ("causal", "causal_grad", "padded", "packed", "cu_seq_lens")
TOLERANCE = {"float32": 1e-4, "bfloat16": 4e-2}  # as testing.parity.TOLERANCE
FUSED_PER_RUN = 8  # two attention layers, four forwards

CHILD = r"""
import copy, json, sys
import torch
from npu_autopatch.testing import stand_in, tiny

args = json.loads(sys.argv[1])
W = 4


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def configs():
    return {
        "llama": tiny.tiny_config("llama"),
        "mistral": tiny.tiny_config("mistral", sliding_window=W),
        "qwen2": tiny.tiny_config(
            "qwen2", use_sliding_window=True, max_window_layers=0, sliding_window=W,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "gemma3": tiny.tiny_config("gemma3_text", sliding_window=W),
        "gpt_oss": tiny.tiny_config("gpt_oss", sliding_window=W),
        "olmo3": tiny.tiny_config("olmo3", sliding_window=W),
        "phi3": tiny.tiny_config("phi3", sliding_window=W),
        "exaone4": tiny.tiny_config("exaone4", sliding_window=W),
        "gemma2": tiny.tiny_config("gemma2", sliding_window=W, attn_logit_softcapping=5.0),
    }


def grad_error(fa, eager):
    return max(
        float("inf") if p.grad is None else rel(p.grad, q.grad)
        for p, q in zip(fa.parameters(), eager.parameters(), strict=True)
        if q.grad is not None and q.grad.abs().max() > 0
    )


with stand_in(profile=args["profile"]) as npu:
    import npu_autopatch

    if args["patch"]:  # every model: gpt-oss's own attention target keeps FA2 on 5.x
        npu_autopatch.enable(kernels=["attention"])
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in configs().items():
        if name not in args["models"]:
            continue
        errors = out[name] = {}
        dtype = getattr(torch, args["dtype"])
        torch.manual_seed(0)
        fa = AutoModelForCausalLM.from_config(
            copy.deepcopy(cfg), attn_implementation="flash_attention_2", dtype=dtype
        )
        eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype)
        eager.load_state_dict(fa.state_dict())
        ids = torch.randint(1, cfg.vocab_size, (2, 10))
        before = npu.calls["npu_fusion_attention"]
        try:
            a, b = fa(ids).logits, eager(ids).logits
            errors["causal"] = rel(a, b)
            w = torch.randn_like(a)
            (a * w).sum().backward()
            (b * w).sum().backward()
            errors["causal_grad"] = grad_error(fa, eager)
            mask = torch.ones(2, 10, dtype=torch.long)
            mask[1, 7:] = 0
            valid = mask.bool()
            with torch.no_grad():
                got = fa(ids, attention_mask=mask).logits[valid]
                errors["padded"] = rel(got, eager(ids, attention_mask=mask).logits[valid])
                lengths = [6, 8]
                packed = torch.randint(1, cfg.vocab_size, (1, sum(lengths)))
                positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
                alone = torch.cat([eager(chunk).logits for chunk in packed.split(lengths, dim=1)], dim=1)
                errors["packed"] = rel(fa(packed, position_ids=positions).logits, alone)
                cu = torch.tensor([0, 6, 14], dtype=torch.int32)
                kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 8, "max_length_k": 8}
                errors["cu_seq_lens"] = rel(fa(packed, position_ids=positions, **kwargs).logits, alone)
        except Exception as exc:
            errors["raised"] = f"{type(exc).__name__}: {exc}"[:300]
        errors["fused_calls"] = npu.calls["npu_fusion_attention"] - before
    status = npu_autopatch.status()
    out["status"] = {name: status[name].state.value for name in ("npu_flash_attention", "gpt_oss")}
    out["variants"] = sorted(set(status["npu_flash_attention"].variants.values()))
print("RESULT" + json.dumps(out))
"""


def run(profile="a2-newest", patch=True, dtype="float32", models=MODELS):
    """The per-model errors of CHILD's cases, its fused-op calls, and the attention entry's status."""
    options = {"profile": profile, "patch": patch, "dtype": dtype, "models": list(models)}
    return child_result(CHILD, json.dumps(options), timeout=600)


def assert_matches(found, dtype, fused):
    """Every case of every model within the dtype's tolerance of eager, with ``fused(model)`` fused calls."""
    for model, errors in found.items():
        if model in ("status", "variants"):
            continue
        assert "raised" not in errors, (model, errors)
        assert all(errors[case] < TOLERANCE[dtype] for case in CASES), (model, errors)
        assert errors["fused_calls"] == fused(model), (model, errors)


def assert_applied(found):
    """The attention entry applied, and on 5.x gpt-oss's own attention target (it keeps FA2)."""
    status = found.pop("status")
    assert status["npu_flash_attention"] == "applied", status
    if not V4 and "gpt_oss" in found:
        assert status["gpt_oss"] == "applied", status


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fa2_on_npu_matches_eager(dtype):
    """Windows (BSND and TND, causal), sinks with their gradient, softcap unfused; the fused op runs.

    The older release profiles run these functions in tests/test_default_attention.py (the route calls
    them as this explicit choice does), and gpt-oss's unfused sinks in the test below."""
    found = run(dtype=dtype)
    assert_applied(found)
    assert found.pop("variants") == ["dense", "varlen"]  # the sinks fused
    assert_matches(found, dtype, lambda model: 0 if model == "gemma2" else FUSED_PER_RUN)


def test_without_the_kernel_the_window_and_sinks_are_dropped():
    """The control: stock FA2-on-NPU is exact on llama and far off wherever there is a window or a sink,
    so the parity cases above can fail. On 5.x stock gpt-oss does not even run: its hub-kernel swap
    names a kernel not registered on the NPU. (5.x stock refuses softcap with a clear error: not run.)"""
    found = run(patch=False, models=("llama", *WINDOWED))
    assert set(found.pop("status").values()) == {"off"}
    assert all(found["llama"][case] < 1e-4 for case in CASES), found["llama"]
    for model in WINDOWED:
        if model == "gpt_oss" and not V4:
            assert found[model]["raised"].startswith("KeyError"), found[model]
            continue
        assert min(found[model][case] for case in CASES) > 0.1, (model, found[model])


def test_before_sink_the_sinks_run_unfused():
    """op-plugin 7.2.0 (torch_npu 2.7.1) has no ``sink``: gpt-oss's layers take the unfused path, still
    exact, and status() names that path; the window models stay fused."""
    found = run(profile="a2-2.7.1", models=("mistral", "gpt_oss"))
    assert_applied(found)
    assert found.pop("variants") == ["dense_unfused_sinks", "varlen_unfused_sinks"]
    assert_matches(found, "float32", lambda model: 0 if model == "gpt_oss" else FUSED_PER_RUN)


REFUSED = r"""
import json
import sys
import torch
from npu_autopatch.testing import stand_in, tiny

with stand_in():
    import npu_autopatch

    npu_autopatch.enable(kernels=["attention"], exclude=["npu_flash_attention"])
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt_oss import modeling_gpt_oss

    cfg = tiny.tiny_config("gpt_oss", sliding_window=4)
    out = {"status": npu_autopatch.status()["gpt_oss"].state.value}
    try:
        AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2")
    except ValueError as exc:
        out["refused"] = str(exc)
    npu_autopatch.disable()
    target = "_check_and_adjust_attn_implementation"
    out["after_disable"] = target in vars(modeling_gpt_oss.GptOssPreTrainedModel)
    print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(V4, reason="4.57 has no hub-kernel swap for gpt-oss")
def test_gpt_oss_fa2_refused_at_load_when_the_sinks_would_be_dropped():
    """With transformers' Ascend functions stock (here excluded), FA2 would drop gpt-oss's sinks: the load
    is refused with the reason, not a KeyError in the first forward; disable() takes the target out."""
    found = child_result(REFUSED, timeout=300)
    assert found["status"] == "applied", found
    assert "drop this model's attention sinks" in found["refused"], found
    assert "npu_flash_attention" in found["refused"] and "eager" in found["refused"], found
    assert found["after_disable"] is False, found


# The whole table through this path: tests/test_default_attention.py (every table model on the default
# attention, which the default_attention kernel routes here, fp32 and bf16; the controls on every profile).


SYNCS = r"""
import json, sys
import torch
from npu_autopatch.testing import stand_in, tiny

patch = json.loads(sys.argv[1])
with stand_in() as npu:
    import npu_autopatch

    if patch:
        npu_autopatch.enable(models=["npu_flash_attention", "flash_attention_utils"])
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny.tiny_config("llama", num_hidden_layers=4)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2")
    counts = {}

    def counted(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(self, *args, **kwargs)

        return original, wrapper

    def syncs(**inputs):
        wrapped = {name: counted(name) for name in ("cpu", "item", "tolist")}
        counts.clear()
        for name, (_, wrapper) in wrapped.items():
            setattr(torch.Tensor, name, wrapper)
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            for name, (original, _) in wrapped.items():
                setattr(torch.Tensor, name, original)
        return dict(counts)

    ids = torch.randint(1, cfg.vocab_size, (1, 14))
    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    positions = torch.cat([torch.arange(6), torch.arange(8)]).unsqueeze(0)
    varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 8, "max_length_k": 8}
    packed = syncs(input_ids=ids, position_ids=positions, **varlen)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    padded = syncs(input_ids=ids.view(2, 7), attention_mask=mask)
    fused = npu.calls["npu_fusion_attention"]
    print("RESULT" + json.dumps({"cu_seq_lens": packed, "padded": padded, "fused": fused}))
"""


def syncs(patch):
    return child_result(SYNCS, json.dumps(patch), timeout=300)


def test_host_copies_of_the_sequence_lengths_per_forward():
    """A 4-layer model: stock copies cu_seqlens to the host twice per layer (q and k), and when padded
    unpads the same mask again in every layer (its ``.item()`` for the longest row, and a ``nonzero``
    that this count does not see); patched, once per forward: verl-style cu_seq_lens are copied once,
    and the mask is unpadded once (``unpad_once``), so its one cu_seqlens is copied once."""
    stock, patched = syncs(False), syncs(True)
    assert stock["cu_seq_lens"] == {"cpu": 8}, stock
    assert patched["cu_seq_lens"] == {"tolist": 1}, patched
    assert stock["padded"] == {"cpu": 8, "item": 4}, stock
    assert patched["padded"] == {"tolist": 1, "item": 1}, patched
    assert stock["fused"] == patched["fused"] == 8


def test_the_probe_refuses_a_band_off_by_one(monkeypatch):
    """The probes compare the band with eager's window before the kernel is used: one token too many fails."""
    stock_band = attention_kernel._band

    def one_more(causal, window_size):
        pre, nxt = stock_band(causal, window_size)
        return (pre + 1 if pre < attention_kernel._UNBOUNDED else pre), nxt

    from transformers.integrations import npu_flash_attention as integration

    for target in (integration.npu_flash_attn_func, integration.npu_flash_attn_varlen_func):
        assert choose_variant(KERNELS["attention"], target, live=True)[0] is not None
        with monkeypatch.context() as patched:
            patched.setattr(attention_kernel, "_band", one_more)
            variant, reason = choose_variant(KERNELS["attention"], target, live=True)
        assert variant is None and "differs" in reason, reason


@pytest.mark.skipif(V4, reason="4.57 has no hub-kernel swap: gpt-oss has no attention target there")
def test_the_keep_fa2_probe_takes_only_the_method_that_reads_the_hub_list():
    """gpt-oss's target: the replacement hides the hub list from the stock method per instance, which is
    only right for a stock method that reads that list through the instance."""
    from transformers.modeling_utils import PreTrainedModel

    stock = PreTrainedModel._check_and_adjust_attn_implementation
    variant, reason = choose_variant(KERNELS["attention"], stock, live=True)
    assert variant is not None and variant.name == "keep_fa2", reason

    def _check_and_adjust_attn_implementation(
        self, attn_implementation, is_init_check=False, allow_all_kernels=False
    ):
        return attn_implementation  # same parameters, never reads the list

    variant, reason = choose_variant(KERNELS["attention"], _check_and_adjust_attn_implementation, live=True)
    assert variant is None and "does not read _compatible_flash_implementations" in reason, reason


def test_the_replacements_expose_what_transformers_looks_for():
    """transformers builds its keyword arguments from the varlen function's signature
    (``_lazy_define_process_function``), which ``inspect.signature`` reads through ``__wrapped__`` (the
    patcher sets it to the stock function): the replacement pins its own, or the window would be dropped."""
    from transformers.integrations import npu_flash_attention as integration

    def reraise(exc, *tensors):
        raise exc

    stocks = (integration.npu_flash_attn_func, integration.npu_flash_attn_varlen_func)
    flash_variants = [v for v in KERNELS["attention"].variants if v.name in ("dense", "varlen")]
    for variant, stock in zip(flash_variants, stocks, strict=True):
        replacement = variant.build(stock, golden_ops(), reraise)
        replacement.__wrapped__ = stock
        assert {"window_size", "s_aux", "softcap"} <= set(inspect.signature(replacement).parameters)
    # transformers' window_size = (W - 1, W - 1): W - 1 tokens back, none ahead when causal.
    assert attention_kernel._band(True, (3, 3)) == (3, 0)
    assert attention_kernel._band(False, (3, 3)) == (3, 3)


FAILING = r"""
import copy, json
import torch
from npu_autopatch.testing import stand_in, tiny

with stand_in() as npu:
    import npu_autopatch

    npu_autopatch.enable(models=["npu_flash_attention"])
    from transformers import AutoModelForCausalLM

    cfg = tiny.tiny_config("mistral", sliding_window=4)
    torch.manual_seed(0)
    fa = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2")
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.load_state_dict(fa.state_dict())
    ids = torch.randint(1, cfg.vocab_size, (2, 10))
    fused = npu.npu_fusion_attention

    def device_refuses(*args, **kwargs):
        fused(*args, **kwargs)  # counted as a call, as the device would have been asked
        raise RuntimeError("EZ9999: a rule nobody knew")

    npu.npu_fusion_attention = device_refuses
    def error():
        expected = eager(ids).logits
        return ((fa(ids).logits - expected).abs().max() / expected.abs().max()).item()

    with torch.no_grad():
        errors = [error()]
        calls = npu.calls["npu_fusion_attention"]
        errors.append(error())
    record = npu_autopatch.status()["npu_flash_attention"]
    out = {"errors": errors, "calls": [calls, npu.calls["npu_fusion_attention"]], "state": record.state.value}
    out["code"] = None if record.code is None else record.code.value
    from transformers.integrations import npu_flash_attention as integration
    import inspect

    out["kept"] = "window_size" in inspect.signature(integration.npu_flash_attn_func).parameters
    out["report"] = sorted({entry.path for entry in npu_autopatch.report(fa).attention})
    print("RESULT" + json.dumps(out))
"""


def test_a_fused_call_that_raises_is_reported_and_the_call_stays_right():
    """Not stock (which would drop the window): the replacement stays in the module (a later lookup gets it
    too) and runs calls of that shape unfused from then on; status says op-failed, the WARNING and report()
    say unfused."""
    result = warm_run(
        [sys.executable, "-c", FAILING],
        env=child_env(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    found = json.loads(result.stdout.split("RESULT", 1)[1])
    assert all(error < 1e-4 for error in found["errors"]), found
    assert found["calls"] == [1, 1], found  # one failed fused call, then none
    assert (found["state"], found["code"]) == ("partial", "op-failed"), found
    assert found["kept"], found
    (path,) = found["report"]
    assert (
        path == "FA2 on the NPU, patched (attention kernel: fused op given up for some shapes: unfused there)"
    ), found
    assert "fused op given up at" in result.stderr and "EZ9999" in result.stderr
    assert "that target runs unfused attention for calls of that shape" in result.stderr


REPORT = r"""
import json, sys
from npu_autopatch.testing import stand_in, tiny

with stand_in():
    import npu_autopatch

    if json.loads(sys.argv[1]):
        npu_autopatch.enable(kernels=["attention"])
    from transformers import AutoModelForCausalLM

    cfg = tiny.tiny_config("mistral", sliding_window=4)
    out = {}
    for implementation in ("flash_attention_2", "sdpa", "eager"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=implementation)
        out[implementation] = [vars(entry) for entry in npu_autopatch.report(model).attention]
    print("RESULT" + json.dumps(out))
"""


@pytest.mark.parametrize("patch", [True, pytest.param(False, marks=FULL)], ids=["patched", "stock"])
def test_report_names_each_attention_path(patch):
    """report(model) says what each attention module runs: FA2 on the NPU patched (with the variants) or
    stock (which drops windows and sinks), sdpa, eager."""
    found = child_result(REPORT, json.dumps(patch), timeout=300)
    fa2 = "FA2 on the NPU, patched (attention kernel: dense, varlen)" if patch else "FA2 on the NPU, stock"
    for implementation, path in (("flash_attention_2", fa2), ("sdpa", "sdpa"), ("eager", "eager")):
        (entry,) = found[implementation]
        assert entry["name"] == "MistralAttention" and entry["count"] == 2, found
        assert entry["implementation"] == implementation and entry["path"].startswith(path), found


def test_the_host_copy_is_made_again_for_a_modified_or_new_tensor():
    ends = attention_kernel._PerTensor(attention_kernel.HOST_ENDS._compute, size=2)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert ends(cu) == (3, 5)
    cu[2] = 6  # in place: its version moves on
    assert ends(cu) == (3, 6)
    # Kept alive: a freed tensor's id may be reused by the next one, which would replace its entry.
    new, other = torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    assert ends(new) == (2, 4)
    assert ends(other) == (1,)
    assert len(ends._entries) == 2


def test_an_inference_tensor_is_copied_every_time_it_has_no_version_to_tell_a_change():
    ends = attention_kernel._PerTensor(attention_kernel.HOST_ENDS._compute)
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 5], dtype=torch.int32)
        assert ends(cu) == (3, 5)
        cu[2] = 6  # allowed on an inference tensor, and invisible without a version counter
        assert ends(cu) == (3, 6)
    assert ends._entries == {}


GENERATE = r"""
import copy, json
import torch
from npu_autopatch.testing import stand_in, tiny

with stand_in() as npu:
    import npu_autopatch

    npu_autopatch.enable(models=["npu_flash_attention"])
    from transformers import AutoModelForCausalLM

    cfg = tiny.tiny_config("mistral", sliding_window=4)
    torch.manual_seed(0)
    fa = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2")
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.load_state_dict(fa.state_dict())
    ids = torch.randint(1, cfg.vocab_size, (2, 6))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    kwargs["pad_token_id"] = 0
    with torch.no_grad():
        got, expected = fa.generate(ids, **kwargs), eager.generate(ids, **kwargs)
    error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got.logits, expected.logits))
    same = torch.equal(got.sequences, expected.sequences)
    print("RESULT" + json.dumps({"same": same, "error": error, "fused": npu.calls["npu_fusion_attention"]}))
"""


def test_cached_decoding_keeps_the_window():
    """Decode steps have Sq = 1 < Skv: the band counts from the bottom-right corner, as eager's window."""
    found = child_result(GENERATE, timeout=300)
    assert found["same"] and found["error"] < 1e-4 and found["fused"] == 12, found  # 6 steps, 2 layers
