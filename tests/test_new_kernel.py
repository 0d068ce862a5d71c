"""A complete new kernel from files of its own (tests/acme_kernel): a new op on the stand-in, its rows
and a flag in report(), an opt-in switch, discovery patterns, an install of its own; it patches a real
model and passes the parity harness with no change to the mechanism (issue 26)."""

import pytest
import transformers
from transformers.models.llama import modeling_llama  # noqa: F401 - imported, so enable() patches it
from transformers.models.mistral import modeling_mistral

import npu_autopatch
from npu_autopatch import Model, Target, _candidates, _config, models
from npu_autopatch._state import STATE
from npu_autopatch.testing.parity import check_parity, tiny_model

from .acme_kernel import OP, ROTARY_TABLE, TABLES

ROTARY = Target(ROTARY_TABLE, "LlamaRotaryEmbedding.forward")
# transformers 4.x wraps the rotary forward in torch.no_grad(), whose wrapper is torch's code: the
# patcher leaves such a target alone as someone else's (foreign-patch) unless force=True, which the
# parity harness does not pass. The candidate and the probe are checked on both majors.
ON_4X = pytest.mark.skipif(
    transformers.__version__.startswith("4."), reason="4.x: LlamaRotaryEmbedding.forward is torch.no_grad()'s"
)


@pytest.fixture
def acme(npu_stand_in):
    """The stand-in with the new op (counted as its own ops are), and llama's table entry with the new
    kernel's target added; both taken back after the test."""

    def cos_sin(emb):
        npu_stand_in.calls[OP] += 1
        return emb.cos(), emb.sin()

    setattr(npu_stand_in, OP, cos_sin)
    saved = models.MODELS["llama"]
    npu_autopatch.register(Model("llama", *saved.targets, ROTARY, module=saved.module), replace=True)
    yield npu_stand_in
    npu_autopatch.disable()
    npu_autopatch.unregister("llama")  # the built-in entry comes back
    assert STATE.models["llama"] is saved


@ON_4X
def test_the_switch_is_opt_in_and_named_by_the_kernel(acme, monkeypatch):
    npu_autopatch.enable(models=["llama"])
    assert "rotary_table" not in npu_autopatch.status()["llama"].kernels  # off by default
    npu_autopatch.enable(models=["llama"], rotary_table=True)
    record = npu_autopatch.status()["llama"]
    assert record.state == "applied" and "rotary_table" in record.kernels, record
    assert (
        record.variants["transformers.models.llama.modeling_llama:LlamaRotaryEmbedding.forward"] == "cos-sin"
    )
    npu_autopatch.disable()
    monkeypatch.setenv(_config.switch_variable("rotary_table"), "1")
    assert _config.switch_variable("rotary_table") == "NPU_AUTOPATCH_ROTARY_TABLE"
    npu_autopatch.enable(models=["llama"])
    assert "rotary_table" in npu_autopatch.status()["llama"].kernels
    with pytest.raises(TypeError, match="rotary_tabel"):
        npu_autopatch.enable(rotary_tabel=True)


@ON_4X
def test_it_passes_the_parity_harness(acme, monkeypatch):
    monkeypatch.setenv("NPU_AUTOPATCH_ROTARY_TABLE", "1")  # the harness enables as a user would
    report = check_parity("llama", npu=acme)
    assert report.passed, report
    assert "rotary_table" in report.kernels
    assert report.ops_called.get(OP, 0) > 0, report.ops_called


@ON_4X
def test_report_shows_its_rows_and_flags(acme):
    model = tiny_model("llama")
    model.model.rotary_emb.attention_scaling = 0.5
    npu_autopatch.enable(models=["llama"], rotary_table=True)
    coverage = npu_autopatch.report(model)
    assert [(row.name, row.count, row.scaling) for row in coverage.rotary_table] == [
        ("LlamaRotaryEmbedding", 1, "0.5")
    ]
    entry = next(e for e in coverage.modules if e.name == "LlamaRotaryEmbedding")
    assert (entry.origin, entry.kernel) == ("ours", "rotary_table")
    assert [f.message for f in coverage.flags if f.kind == "rotary_table"] == ["its table is scaled by 0.5"]
    assert "rotary_table" in coverage.as_dict() and "| rotary_table | n | scaling |" in coverage.markdown()


@ON_4X
def test_its_own_install_puts_its_entries_in_and_takes_them_out(acme):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    stock = LlamaRotaryEmbedding.__dict__["forward"]
    npu_autopatch.enable(models=["llama"], rotary_table=True)
    replacement = LlamaRotaryEmbedding.__dict__["forward"]
    assert replacement is not stock and dict(TABLES) == {"LlamaRotaryEmbedding": replacement}
    targets = npu_autopatch.status()["llama"].targets  # its plumbing is no target
    assert [t for t in targets if "Rotary" in t or "TABLES" in t] == [
        "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding.forward"
    ]
    npu_autopatch.disable()
    assert not TABLES and LlamaRotaryEmbedding.__dict__["forward"] is stock


def test_discovery_nominates_its_candidates(acme):
    found = {c.path: c.kind for c in _candidates.candidates(modeling_mistral)}
    assert found["MistralRotaryEmbedding.forward"] == "rotary_table"
    assert _candidates.kernels_for("rotary_table") == ("rotary_table",)
    candidate = _candidates.probe(
        modeling_mistral,
        _candidates.Candidate("MistralRotaryEmbedding.forward", "rotary_table", modeling_mistral.__name__),
    )
    assert (candidate.kernel, candidate.variant) == ("rotary_table", "cos-sin")
