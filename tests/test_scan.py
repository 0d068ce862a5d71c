"""The scan: every modeling module's candidates by name, confirmed by the probes, then parity.

Discovery reads the package directory without importing anything; a module's candidates
are confirmed or refused with the probes' reason; a scan runs in child processes, reports
which targets ran and which fused ops they called, and a child that dies costs only its
directory. Then the comparison rules of its parity: gradients that are zero in exact
arithmetic, and the markdown/JSON renderings.
"""

import json
import os
import stat
import sys
import textwrap

import pytest
import torch
import transformers

from npu_autopatch import _candidates
from npu_autopatch.testing.parity import ParityReport, compare
from npu_autopatch.tools import scan

from .conftest import kernel_ops, run_python

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = pytest.mark.full


V4 = int(transformers.__version__.split(".")[0]) < 5


def test_modeling_modules_come_from_the_package_directory_without_importing_it():
    child = run_python(
        """
        import json, sys
        from npu_autopatch import _candidates
        layout = _candidates.modeling_modules()
        print(json.dumps({"layout": layout, "imported": "transformers" in sys.modules}))
        """
    )
    assert child.returncode == 0, child.stderr
    found = json.loads(child.stdout)
    assert not found["imported"]
    layout = found["layout"]
    assert layout["llama"] == ["transformers.models.llama.modeling_llama"]
    assert len(layout["data2vec"]) == 3  # audio, text and vision modules in one directory
    names = [name for names in layout.values() for name in names]
    assert not [n for n in names if ".modeling_tf_" in n or ".modeling_flax_" in n]
    models = os.path.join(_candidates.transformers_dir(), "models")
    on_disk = {
        f"transformers.models.{folder}.{name[:-3]}"
        for folder in os.listdir(models)
        if os.path.isdir(os.path.join(models, folder))
        for name in os.listdir(os.path.join(models, folder))
        if name.startswith("modeling_")
        and name.endswith(".py")
        and "_tf_" not in name
        and "_flax_" not in name
    }
    assert set(names) == on_disk


def test_the_probes_confirm_llamas_targets_and_name_the_variant():
    result, module = scan.scan_module("transformers.models.llama.modeling_llama")
    assert module is not None and result.import_error is None
    confirmed = {c.path: (c.kernel, c.variant) for c in result.confirmed}
    assert confirmed == {
        "LlamaRMSNorm.forward": ("rms_norm", "llama"),
        "LlamaMLP.forward": ("swiglu", "gate-up"),
        "apply_rotary_pos_emb": ("rope", "half"),
    }


def test_a_candidate_no_kernel_reproduces_is_listed_with_the_probes_reason():
    # Qwen3-VL's vision MLP is linear_fc2(act(linear_fc1(x))): not gated, so no SwiGLU.
    result, _module = scan.scan_module("transformers.models.qwen3_vl.modeling_qwen3_vl")
    (mlp,) = [c for c in result.candidates if c.path == "Qwen3VLVisionMLP.forward"]
    assert mlp.kernel is None and mlp.kind == "mlp"
    assert "has no attribute 'linear_fc2'" in mlp.refused["swiglu"]
    # The sparse block of 5.x calls the fused *Experts module: it is not itself a kernel target.
    result, _module = scan.scan_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    block = {c.path: c for c in result.candidates}["Qwen3MoeSparseMoeBlock.forward"]
    if V4:
        assert (block.kernel, block.variant) == ("moe", "sparse-block")
    else:
        assert block.kernel is None and "signature" in block.refused["moe"]


def test_counting_targets_counts_calls_and_ops_and_restores_every_attribute(npu_stand_in):
    from transformers.models.llama import modeling_llama as llama

    paths = ["LlamaRMSNorm.forward", "apply_rotary_pos_emb"]
    before = (vars(llama.LlamaRMSNorm)["forward"], llama.apply_rotary_pos_emb)
    norm = llama.LlamaRMSNorm(8)
    with scan.counting_targets(llama, paths, npu_stand_in) as (calls, fused):
        norm(torch.ones(2, 8))
        npu_stand_in.npu_rms_norm(torch.ones(2, 8), torch.ones(8))  # an op outside any target
    assert calls == {"LlamaRMSNorm.forward": 1} and fused["LlamaRMSNorm.forward"] == 0  # stock code ran
    assert (vars(llama.LlamaRMSNorm)["forward"], llama.apply_rotary_pos_emb) == before


def test_the_scan_compares_by_parity_s_rules_a_gradient_zero_in_exact_arithmetic_is_noise():
    # One comparison for the tests, verify and the scan: testing.parity.compare.
    big = torch.tensor([1.0, -0.5])
    stock = {"w": big, "k_bias": torch.tensor([1e-12, -2e-12]), "small": torch.tensor([1e-3])}
    patched = {"w": big * 1.5, "k_bias": torch.tensor([-1e-12, 1e-12]), "small": torch.tensor([2e-3])}
    logits = torch.ones(2, 3)
    report = ParityReport("m", "float32", "applied", None, (), tolerance=1e-4)
    compare(report, (logits, stock), (logits, patched))
    # k_bias: 1e-12 of a largest gradient of 1, in both runs: rounding noise, not compared.
    # small: 1e-3 is a real gradient, its error counts.
    assert report.over_tolerance == ("grad of w", "grad of small")


def test_the_scan_trains_parity_s_tiny_model_hunyuan_moe_with_four_experts(npu_stand_in):
    # parity.OVERRIDES: HunYuan-MoE's default config has one expert, which is no routing (and a
    # group list the device refuses); the scan builds the model the parity tests build.
    result, module = scan.scan_module("transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe")
    model = scan.check_model("hunyuan_v1_moe", module, result.confirmed, npu_stand_in, ("float32",))
    assert model.passed, model
    (parity,) = model.parity
    if V4:
        # 4.x: each expert is a HunYuanMoEV1MLP, as is the shared one. One expert would make two
        # calls per layer (four in all); four experts, top-2 over 16 tokens, make more.
        calls, _ops = model.ran["HunYuanMoEV1MLP.forward"]
        assert calls > 4, model.ran
    else:
        # 5.x: the experts are fused: per layer a gate-up and a down grouped matmul over the
        # four experts (one expert: a group list the device refuses), one permute and unpermute.
        assert parity.forward_ops["npu_grouped_matmul"] == 4, parity.forward_ops
        assert parity.forward_ops["npu_moe_token_unpermute"] == 2, parity.forward_ops


def test_a_scan_reports_targets_that_ran_fused_ops_and_parity():
    result = scan.scan(["llama", "gemma3"], dtypes=("float32",))
    models = {m.model_type: m for m in result.models}
    llama = models["llama"]
    assert llama.passed and llama.model_class == "LlamaForCausalLM"
    assert all(calls > 0 and ops > 0 for calls, ops in llama.ran.values()), llama.ran
    # two layers: 2 norms each + the final one; one MLP and one q/k rotary per layer
    # (the attention is the default one's: torch_npu's own sdpa runs the fused op, stock and patched)
    assert kernel_ops(llama.parity[0].forward_ops) == {
        "npu_rms_norm": 5,
        "npu_rotary_mul": 4,
        "npu_swiglu": 2,
    }
    assert kernel_ops(llama.parity[0].backward_ops) == {
        "npu_rms_norm_backward": 5,
        "npu_rotary_mul_backward": 4,
        "npu_swiglu_backward": 2,
    }
    # Gemma3's MLP has the gated layout (the probe accepts it) but a GELU activation: each
    # instance runs the stock code, which the scan reports rather than hides.
    gemma3 = models["gemma3"]
    assert gemma3.passed
    calls, ops = gemma3.ran["Gemma3MLP.forward"]
    assert calls > 0 and ops == 0
    assert "npu_swiglu" not in gemma3.parity[0].forward_ops
    text = scan.markdown(result)
    assert scan.summary(result) in text
    assert "ran stock code: Gemma3MLP.forward" in text
    assert json.loads(scan.to_json(result))["summary"] == scan.summary(result)
    assert (
        scan.markdown(scan.from_dict(json.loads(scan.to_json(result)))) == text
    )  # stored JSON renders again


def test_the_command_prints_json(capsys):
    # Probes only: the parity of a scan is the test above's (child processes and all).
    assert scan.main(["--dirs", "llama", "--no-parity", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["summary"].startswith(f"transformers {transformers.__version__}: 1 modeling modules")
    (module,) = printed["modules"]
    assert module["module"] == "transformers.models.llama.modeling_llama"
    assert {c["path"] for c in module["candidates"] if c["kernel"]} >= {"LlamaRMSNorm.forward"}


FAKE_PYTHON = """\
#!{python}
# Stands in for the scan's child: answers for each directory, dies in "b".
import json, sys
folders = [a for a in sys.argv[1:] if a.isalpha() and len(a) == 1]
for folder in folders:
    if folder == "b":
        sys.exit(3)
    print(json.dumps({{"kind": "module", "module": f"transformers.models.{{folder}}.modeling_{{folder}}",
                      "import_error": None, "candidates": []}}), flush=True)
    print(json.dumps({{"kind": "done", "folder": folder}}), flush=True)
"""


def test_a_child_that_dies_costs_only_the_directory_it_was_in(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(FAKE_PYTHON.format(python=sys.executable)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    lines = scan._run_batch(["a", "b", "c"], ("float32",), False, str(fake))
    modules = [line["module"] for line in lines if line["kind"] == "module"]
    assert modules == ["transformers.models.a.modeling_a", "transformers.models.c.modeling_c"]  # c: retried
    (error,) = [line for line in lines if line["kind"] == "error"]
    assert error["folder"] == "b" and "died in this directory (exit status 3)" in error["error"]
