"""python -m npu_autopatch verify: the parity suite and the rotary sweep, as a user on an NPU runs them."""

import json
import re
import sys

import pytest
import transformers

from .conftest import ROOT, STAND_IN_SITE, child_env, run_python, warm_run

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = pytest.mark.full


SIMULATE = ["verify", "--device", "cpu", "--simulate"]


def cli(*args):
    return warm_run(
        [sys.executable, "-m", "npu_autopatch", *args],
        env=child_env(),
        timeout=600,
        cwd=ROOT,
    )


# A dense model, an MoE and a vision-language one: the tool's behaviour on each kind of model. Per-model
# parity over the whole table is the parity tests' (tests/test_parity_models.py), not repeated here.
REPRESENTATIVE = ("llama", "qwen3_moe", "qwen2_5_vl")


def test_a_dense_an_moe_and_a_vl_model_verify_on_the_stand_in():
    # bf16, the dtype with the rounding rules (fp32: the tests below).
    run = cli(*SIMULATE, "--models", ",".join(REPRESENTATIVE), "--dtype", "bfloat16", "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["passed"] is True
    assert report["environment"]["simulated"] is True
    assert report["environment"]["transformers"] == transformers.__version__
    results = {r["model"]: r for r in report["results"]}
    assert set(results) == set(REPRESENTATIVE)
    for result in results.values():
        assert (result["status"], result["state"], result["dtype"]) == ("pass", "applied", "bfloat16"), result
        assert result["ops_called"].get("npu_rms_norm", 0) > 0, result
    assert "moe" in results["qwen3_moe"]["kernels"]
    assert results["qwen3_moe"]["ops_called"].get("npu_grouped_matmul", 0) > 0, results["qwen3_moe"]
    assert "npu_rotary_mul" in results["qwen2_5_vl"]["ops_called"]  # its mRoPE text rotary
    # The decisions for this torch_npu, and the rotary shape sweep on it.
    assert report["decisions"]["torch_npu"] == report["environment"]["torch_npu"]
    assert report["decisions"]["gated"] == {}
    assert set(report["decisions"]["rotary_layouts"]) == {"A", "B", "stock"}
    sweep = report["rope_sweep"]
    assert sweep["passed"] is True and sweep["cases"]
    assert {c["dtype"] for c in sweep["cases"]} == {"bfloat16"}
    assert all(c["status"] == "pass" for c in sweep["cases"])
    # FA2 on the NPU: windows and sinks, BSND and TND, each case through the fused op.
    attention = report["attention"]
    assert attention["passed"] is True and len(attention["cases"]) == 12, attention
    assert all(c["fused_calls"] > 0 and c["variant"] in ("dense", "varlen") for c in attention["cases"])


def test_on_torch_npu_2_6_the_report_says_what_was_gated_and_why():
    run = cli(*SIMULATE, "a2-2.6.0", "--models", "qwen3_moe,llama", "--dtype", "float32", "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["environment"]["torch_npu"] == "2.6.0"
    assert report["decisions"]["op_plugin"] == "7.1.0"
    assert list(report["decisions"]["gated"]) == ["quick_gelu", "moe", "attention/dense", "attention/varlen"]
    assert "no sink before op-plugin 7.3.0" in report["decisions"]["gated"]["attention/dense"]
    assert (
        "before op-plugin 7.2.0 (torch_npu 2.6.0 has op-plugin 7.1.0)" in report["decisions"]["gated"]["moe"]
    )
    results = {r["model"]: r for r in report["results"]}
    assert results["qwen3_moe"]["status"] == "pass" and "moe" not in results["qwen3_moe"]["kernels"]
    assert (results["qwen3_moe"]["state"], results["qwen3_moe"]["code"]) == ("partial", "kernel-unsupported")
    assert (results["llama"]["state"], results["llama"]["code"]) == ("applied", None)
    assert not any(op.startswith("npu_moe") for op in results["qwen3_moe"]["ops_called"])
    assert report["rope_sweep"]["passed"] is True
    # No sink on 2.6.0: those cases run unfused (and match), the others fused.
    attention = report["attention"]
    assert attention["passed"] is True, attention
    for case in attention["cases"]:
        assert (case["fused_calls"] > 0) == ("sinks" not in case["case"]), case
        assert case["variant"].endswith("_unfused_sinks"), case


def test_an_unknown_profile_is_refused():
    run = cli(*SIMULATE, "a2-1.0", "--models", "llama")
    assert run.returncode == 2
    assert "unknown stand-in profile: 'a2-1.0'" in run.stderr


def test_the_table_reads_in_ten_seconds_and_ends_with_a_verdict():
    run = cli(*SIMULATE, "--models", "llama,qwen3", "--dtype", "float32")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split()[:3] == ["model", "dtype", "result"]
    assert lines[1].split()[:3] == ["llama", "float32", "pass"]
    assert lines[2].split()[:3] == ["qwen3", "float32", "pass"]
    sweep = [
        re.fullmatch(r"rotary shape sweep: (\d+) cases, (\d+) pass, the fused op ran in (\d+)", line)
        for line in lines
    ]
    (counts,) = [m.groups() for m in sweep if m]
    assert counts[0] == counts[1] and int(counts[2]) > 0
    assert lines[-1].startswith("VERIFIED: patched matches stock for every model on cpu")


MISWIRED = """
import sys
from npu_autopatch.kernels import KERNELS
from npu_autopatch.__main__ import main

variant = KERNELS["rope"].variants[0]
build = variant.build

def miswired(stock, npu, on_error):  # cos and sin swapped: wrong math
    right = build(stock, npu, on_error)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        return right(q, k, sin, cos, *args, **kwargs)
    return apply_rotary_pos_emb

variant.build = miswired
variant.probe = lambda stock, candidate: None  # a probe that sees nothing
sys.exit(main(["verify", "--device", "cpu", "--simulate", "--models", "llama,qwen3", "--dtype", "float32"]))
"""


OFF_BY_ONE = """
import sys
from npu_autopatch.kernels.attention import _fused as attention
from npu_autopatch.__main__ import main

band = attention._band
attention._band = lambda causal, window_size: (lambda pre, nxt: (pre + 1, nxt))(*band(causal, window_size))
sys.exit(main(["verify", "--device", "cpu", "--simulate", "--models", "llama", "--dtype", "float32"]))
"""


def test_a_window_one_token_too_wide_fails_the_attention_cases():
    """The attention cases compare with eager on the device: a band off by one fails the windowed ones."""
    run = run_python(OFF_BY_ONE)
    assert run.returncode == 1, run.stdout + run.stderr
    failed = [line for line in run.stdout.splitlines() if line.strip().startswith("FAIL npu_flash_attn")]
    assert failed and all("window 3" in line for line in failed), run.stdout
    assert "attention: npu_flash_attn_func window 3, causal float32" in run.stdout.splitlines()[-1]


def test_a_miswired_kernel_fails_verify_naming_model_and_tensor():
    run = run_python(MISWIRED)
    assert run.returncode == 1, run.stdout + run.stderr
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.startswith(("llama", "qwen3"))}
    assert "FAIL" in rows["llama"] and "FAIL" in rows["qwen3"]
    assert "logits: error" in rows["qwen3"] or "grad of" in rows["qwen3"]
    assert run.stdout.splitlines()[-1].startswith("FAILED: llama/float32, qwen3/float32")
    assert "rope sweep: half" in run.stdout.splitlines()[-1]  # the sweep catches it too


def test_verify_leaves_patching_as_it_found_it():
    run = run_python(
        """
        import npu_autopatch
        from npu_autopatch.__main__ import main
        main(["verify", "--device", "cpu", "--simulate", "--models", "qwen2", "--dtype", "float32"])
        print("enabled:", npu_autopatch.is_enabled())
        from transformers.models.qwen2 import modeling_qwen2
        print("stock:", modeling_qwen2.Qwen2RMSNorm.forward.__module__)
        """
    )
    assert run.returncode == 0, run.stderr
    assert "enabled: False" in run.stdout
    assert "stock: transformers.models.qwen2.modeling_qwen2" in run.stdout


def test_verify_puts_back_the_users_very_selection():
    # On an NPU (here the stand-in site's torch_npu), patching enabled with a selection of the
    # user's: verify turns patching off for its runs, then enables exactly that selection again.
    run = run_python(
        """
        import npu_autopatch
        from npu_autopatch._state import STATE
        from npu_autopatch.__main__ import main
        from transformers.models.qwen2 import modeling_qwen2
        from transformers.models.qwen3 import modeling_qwen3

        npu_autopatch.enable(models=["qwen2", "qwen3"], exclude=["qwen3"], kernels=["rms_norm"], strict=True)
        before = repr(STATE.config)
        main(["verify", "--device", "cpu", "--simulate", "--models", "llama", "--dtype", "float32"])
        print("config:", repr(STATE.config) == before, repr(STATE.config))
        status = npu_autopatch.status()
        print("qwen2:", status["qwen2"].state, ",".join(status["qwen2"].kernels))
        print("qwen3:", status["qwen3"].state, status["qwen3"].code)
        """,
        PYTHONPATH=str(STAND_IN_SITE),
    )
    assert run.returncode == 0, run.stderr
    assert "config: True" in run.stdout, run.stdout
    assert "qwen2: applied rms_norm" in run.stdout
    assert "qwen3: skipped excluded" in run.stdout


def test_without_an_npu_verify_says_how_to_simulate():
    run = cli("verify")
    assert run.returncode == 2
    assert "cannot verify: torch_npu not importable" in run.stderr and "try --simulate" in run.stderr
