"""Opt-in discovery (issue 11 item 4): modeling modules outside the registry are patched at their
import as table models are, only when asked, and a table-only process pays nothing for it.

Import-time behaviour runs in fresh interpreters with the CPU stand-in as torch_npu. exaone4,
doge and diffllama are in neither the table nor the example plugin, and the probes take their
norm, MLP and rotary on both majors; doge also has an MoE-looking class no kernel reproduces.
"""

import json

import pytest

import npu_autopatch
from npu_autopatch import _config, _discover
from npu_autopatch._state import STATE

from .conftest import STAND_IN_SITE, kernel_ops, run_python, selected_values

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = pytest.mark.full

DISCOVERED = ("exaone4", "doge", "diffllama")


def child_json(code, **env):
    env.setdefault("PYTHONPATH", str(STAND_IN_SITE))
    child = run_python(code, **env)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.splitlines()[-1]), child.stderr


# A model built (and so its modeling module imported) with discovery on, trained patched,
# then trained stock after disable() on the same weights and inputs; each dtype from one seed.
# bf16 within rounding: a tensor beyond tolerance passes only if patched is no further from the
# fp32 run of the same weights than stock bf16 is (parity's rule: diffllama's lambda_* gradients).
PARITY = """
import collections, json, torch
import npu_autopatch
{enable}
import torch_npu
from npu_autopatch.testing import parity, tiny
from npu_autopatch.testing.parity import TOLERANCE, ParityReport, compare

out = {{}}
for model_type in {model_types!r}:
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny.tiny_model(model_type, dtype)
        batch = parity.model_batch(model)
        before = collections.Counter(torch_npu.calls)
        patched = parity.forward_backward(model, batch[0], batch[1], **batch[2])
        calls = dict(collections.Counter(torch_npu.calls) - before)
        rec = npu_autopatch.status()[model_type]
        npu_autopatch.disable()
        before = collections.Counter(torch_npu.calls)
        stock = parity.forward_backward(model, batch[0], batch[1], **batch[2])
        stock_calls = dict(collections.Counter(torch_npu.calls) - before)
        name = str(dtype).split(".")[-1]
        report = compare(ParityReport(model_type, name, rec.state, rec.reason, rec.kernels,
                                      tolerance=TOLERANCE[dtype]), stock, patched)
        parity.closer_to_fp32(report, model, batch, stock, patched)  # bf16: no further from fp32 than stock
        out.setdefault(model_type, {{}})[name] = {{
            "record": rec.as_dict(), "calls": calls, "stock_calls": stock_calls,
            "over": list(report.over_tolerance), "missing": list(report.missing_grads),
            "logits_error": report.logits_error, "grad_error": report.grad_error,
        }}
        {reenable}
print(json.dumps(out))
"""


def _check_parity(out, model_type):
    for dtype, result in out.items():
        rec = result["record"]
        assert rec["state"] == "applied" and rec["discovered"] is True, (dtype, rec)
        assert rec["kernels"] == ["rms_norm", "swiglu", "rope"], rec
        assert all(
            t.startswith(f"transformers.models.{model_type}.modeling_{model_type}:") for t in rec["targets"]
        )
        assert "discovered outside the model table" in rec["reason"]
        for op in ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul"):
            assert result["calls"].get(op, 0) > 0, (dtype, op, result["calls"])
        # disable() really put stock back (torch_npu's own sdpa, the default attention, runs the fused op)
        assert kernel_ops(result["stock_calls"]) == {}, result["stock_calls"]
        assert not result["over"] and not result["missing"], (dtype, result)
    assert out["float32"]["logits_error"] < 1e-5 and out["float32"]["grad_error"] < 1e-4


@pytest.fixture(scope="module")
def discovered_by_the_environment(request):
    """One child for every model type selected below: each discovered at its own modeling import."""
    code = PARITY.format(
        enable="",
        model_types=selected_values(request, "model_type"),
        reenable="npu_autopatch.enable()  # same selection as the env's",
    )
    return child_json(code, NPU_AUTOPATCH="1", NPU_AUTOPATCH_DISCOVER="1")[0]


@pytest.mark.parametrize("model_type", DISCOVERED)
def test_the_environment_variable_discovers_a_model_at_its_import_with_parity(
    model_type, discovered_by_the_environment
):
    _check_parity(discovered_by_the_environment[model_type], model_type)


def test_enable_discover_true_after_transformers_is_imported_discovers_with_parity():
    code = PARITY.format(
        enable="import transformers\nnpu_autopatch.enable(discover=True)",
        model_types=["doge"],
        reenable="npu_autopatch.enable(discover=True)",
    )
    out = child_json(code)[0]["doge"]
    _check_parity(out, "doge")
    # DogeCDMoE is nominated by its name only; no MoE kernel reproduces it: listed, not a target.
    rec = out["float32"]["record"]
    assert list(rec["refused"]) == ["DogeCDMoE.forward"] and rec["stock"] == {}
    assert "DogeCDMoE.forward" in rec["reason"]


# --- a table-only process ----------------------------------------------------------------------

TABLE_ONLY = """
import json, sys, collections
import npu_autopatch
from npu_autopatch import _candidates, kernels
from npu_autopatch._state import STATE
listings, probes = [], collections.Counter()
original_listing, original_choose = _candidates.modeling_modules, kernels.choose_variant
def listing(*args, **kwargs):
    listings.append(args)
    return original_listing(*args, **kwargs)
def choose(kernel, stock):
    probes[getattr(stock, "__qualname__", "?")] += 1
    return original_choose(kernel, stock)
_candidates.modeling_modules = listing
kernels.choose_variant = choose
import npu_autopatch._patcher as patcher
patcher.choose_variant = choose
npu_autopatch.enable({args})
from transformers.models.qwen3 import modeling_qwen3
import wrapt.importer
table = wrapt.importer._post_import_hooks
ours = sorted(name for name, hooks in table.items() if any(getattr(h, "__module__", "") ==
              "npu_autopatch._hooks" for h in hooks))
print(json.dumps({{
    "listings": len(listings), "probes": dict(probes), "hooked": ours,
    "discovery_hooked": len(STATE.discovery_hooked),
    "models": sorted(n for n in sys.modules if n.startswith("transformers.models.") and ".modeling_" in n),
    "status": sorted(npu_autopatch.status()), "qwen3": npu_autopatch.status()["qwen3"].state,
}}))
"""


def test_discovery_off_lists_nothing_and_on_adds_no_probe_and_no_import_to_a_table_model():
    off, _ = child_json(TABLE_ONLY.format(args=""))
    assert off["listings"] == 0 and off["discovery_hooked"] == 0
    # A pattern (trust_remote_code's, or a family such as verl's) is hooked by a finder of ours as its
    # modules are imported, not in wrapt's table by name.
    registered = sorted(m.module for m in STATE.models.values() if "*" not in m.module)
    assert off["hooked"] == registered  # qwen3's hook re-armed itself for a reload
    on, _ = child_json(TABLE_ONLY.format(args="discover=True"))
    assert on["listings"] == 1 and on["discovery_hooked"] > 100  # hundreds of modules, one listing
    assert on["probes"] == off["probes"] and on["probes"]  # only qwen3's targets were probed
    assert on["models"] == off["models"]  # nothing imported to find the modules
    assert on["status"] == off["status"]  # no discovered model listed: none was imported
    assert off["qwen3"] == on["qwen3"] == "applied"


# --- disable, enable again, strict, failures, configuration ---------------------------------------

LIFECYCLE = """
import json, sys
import npu_autopatch
import wrapt.importer
from npu_autopatch._state import STATE
npu_autopatch.enable(discover=True)
from transformers.models.exaone4 import modeling_exaone4 as m
kernel = m.Exaone4RMSNorm.__dict__["forward"]
original = kernel.__wrapped__
patched = kernel.__module__.startswith("npu_autopatch.kernels") and original.__module__ == m.__name__
npu_autopatch.disable()
restored = m.Exaone4RMSNorm.__dict__["forward"] is original
table = wrapt.importer._post_import_hooks
left = [n for n in table if ".doge." in n or ".diffllama." in n]
after_disable = npu_autopatch.status()["exaone4"].as_dict()
from transformers.models.diffllama import modeling_diffllama  # imported while disabled: stock
stock_import = "diffllama" not in npu_autopatch.status()
npu_autopatch.enable(discover=True)
again = npu_autopatch.status()
patched_again = m.Exaone4RMSNorm.forward.__wrapped__ is original
import importlib
importlib.reload(m)  # new classes: patched by the hook that re-armed itself
reloaded = m.Exaone4RMSNorm.__dict__["forward"].__wrapped__ is not original
after_reload = npu_autopatch.status()["exaone4"].state
npu_autopatch.enable()  # a new selection without discovery: discovered models reverted, unhooked
switched_off = {
    "restored": m.Exaone4RMSNorm.__dict__["forward"].__module__ == m.__name__,
    "listed": "exaone4" in npu_autopatch.status(),
    "hooks": [n for n in table if ".exaone4." in n or ".doge." in n],
}
print(json.dumps({
    "switched_off": switched_off,
    "patched": patched, "restored": restored, "hooks_left": left, "after_disable": after_disable,
    "stock_import": stock_import, "again": {k: again[k].state for k in ("exaone4", "diffllama")},
    "patched_again": patched_again, "reloaded": reloaded,
    "after_reload": after_reload,
}))
"""


def test_disable_reverts_discovered_models_and_removes_their_hooks_and_enable_again_works():
    out, _ = child_json(LIFECYCLE)
    assert out["patched"] and out["restored"]
    assert out["hooks_left"] == []
    assert out["after_disable"]["state"] == "reverted" and out["after_disable"]["discovered"] is True
    assert out["stock_import"]
    assert out["again"] == {"exaone4": "applied", "diffllama": "applied"}
    assert out["patched_again"]
    assert out["reloaded"] and out["after_reload"] == "applied"
    assert out["switched_off"] == {"restored": True, "listed": False, "hooks": []}


STRICT = """
import json
import npu_autopatch
from transformers.models.doge import modeling_doge  # refused candidate: DogeCDMoE
from transformers.models.gpt2 import modeling_gpt2  # GPT2MLP: a GELU MLP no kernel reproduces
npu_autopatch.enable(discover=True, strict=True)
report = npu_autopatch.status()
print(json.dumps({k: report[k].as_dict() for k in ("doge", "gpt2")}))
"""


def test_strict_mode_never_raises_for_a_candidate_nominated_by_its_name_only():
    out, stderr = child_json(STRICT, RANK="0")
    assert out["doge"]["state"] == "applied" and list(out["doge"]["refused"]) == ["DogeCDMoE.forward"]
    assert out["gpt2"]["state"] == "skipped" and out["gpt2"]["code"] == "no-target", out["gpt2"]
    assert list(out["gpt2"]["refused"]) == ["GPT2MLP.forward"] and out["gpt2"]["discovered"] is True
    assert "gpt2" not in stderr  # DEBUG only: no noise


STRICT_NO_NPU = """
import npu_autopatch
from npu_autopatch.models import INTEGRATIONS
# Without the integrations, whose modules transformers imports first (they would be the ones named).
npu_autopatch.enable(discover=True, strict=True, exclude=sorted(INTEGRATIONS))
try:
    from transformers.models.doge import modeling_doge
except npu_autopatch.PatchError as exc:
    print(exc)
"""


def test_strict_mode_raises_for_a_discovered_model_with_targets_left_stock():
    # No torch_npu at all: doge's accepted targets cannot run, as a table model's would not.
    child = run_python(STRICT_NO_NPU, NPU_AUTOPATCH_DISCOVER="0")
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.startswith("npu_autopatch strict mode: doge skipped: torch_npu not importable")


LOGS = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.DEBUG, format="%(name)s|%(message)s")
import npu_autopatch
npu_autopatch.enable(discover=True)
from transformers.models.doge import modeling_doge
print("done")
"""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_discovered_model_logs_on_rank_0_only(rank):
    child = run_python(LOGS, PYTHONPATH=str(STAND_IN_SITE), RANK=rank)
    assert child.returncode == 0, child.stderr[-3000:]
    ours = [line for line in child.stdout.splitlines() if line.startswith("npu_autopatch|")]
    if rank == "1":
        assert ours == []
    else:
        assert "npu_autopatch|npu-autopatch: doge: applied rms_norm, swiglu, rope to 3 targets" in ours
        assert any("doge (discovered): candidates the probes refused" in line for line in ours)


LISTING_FAILS = """
import json
import npu_autopatch
from npu_autopatch import _candidates
def broken(root=None):
    raise PermissionError("models/")
_candidates.modeling_modules = broken
npu_autopatch.enable(discover=True)
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.doge import modeling_doge
report = npu_autopatch.status()
print(json.dumps([report["qwen3"].state, "doge" in report]))
"""


def test_a_listing_that_fails_costs_discovery_only():
    (qwen3, doge_listed), stderr = child_json(LISTING_FAILS)
    assert qwen3 == "applied" and doge_listed is False
    assert "could not list transformers' modeling modules" in stderr and "PermissionError" in stderr


DISCOVERY_RAISES = """
import json
import npu_autopatch
from npu_autopatch import _candidates
def broken(module):
    raise RuntimeError("a bug of ours")
_candidates.candidates = broken
npu_autopatch.enable(discover=True)
from transformers.models.doge import modeling_doge  # the import itself must not fail
rec = npu_autopatch.status()["doge"]
print(json.dumps([rec.state, rec.code, rec.discovered, rec.reason]))
"""


def test_an_error_while_discovering_fails_that_model_only_never_the_import():
    (state, code, discovered, reason), stderr = child_json(DISCOVERY_RAISES)
    assert (state, code, discovered) == ("failed", "internal-error", True)
    assert "a bug of ours" in reason and "internal error while discovering doge" in stderr


IMPORT_FAILS = """
import json, sys
import npu_autopatch
npu_autopatch.enable(discover=True)
import transformers
sys.modules["transformers.models.doge.configuration_doge"] = None  # its import raises
try:
    from transformers.models.doge import modeling_doge
    first = "imported"
except ImportError as exc:
    first = type(exc).__name__
listed = "doge" in npu_autopatch.status()
del sys.modules["transformers.models.doge.configuration_doge"]
from transformers.models.doge import modeling_doge
print(json.dumps([first, listed, npu_autopatch.status()["doge"].state]))
"""


def test_a_module_that_fails_to_import_is_not_listed_and_its_retried_import_is_discovered():
    (first, listed, state), _ = child_json(IMPORT_FAILS)
    assert first in ("ImportError", "ModuleNotFoundError")
    assert listed is False
    assert state == "applied"


SELECTION = """
import json
import npu_autopatch
from transformers.models.doge import modeling_doge
from transformers.models.exaone4 import modeling_exaone4
npu_autopatch.enable(discover=True)
report = npu_autopatch.status()
print(json.dumps({k: [report[k].state, report[k].code] for k in ("doge", "exaone4", "qwen3")}))
"""


def test_a_discovered_model_type_can_be_excluded_from_the_environment():
    out, stderr = child_json(SELECTION, NPU_AUTOPATCH_EXCLUDE="doge,qwen3")
    assert out["doge"] == ["skipped", "excluded"]
    assert out["exaone4"] == ["applied", None]
    assert out["qwen3"] == ["skipped", "excluded"]
    assert "ignoring unknown" not in stderr


def test_discovery_is_off_by_default_and_read_from_the_environment():
    assert _config.discover_wanted(None, pytest.fail, environ={}) is False
    assert _config.discover_wanted(None, pytest.fail, environ={"NPU_AUTOPATCH_DISCOVER": "yes"}) is True
    assert _config.discover_wanted(False, pytest.fail, environ={"NPU_AUTOPATCH_DISCOVER": "1"}) is False
    warnings = []
    assert (
        _config.discover_wanted(None, warnings.append, environ={"NPU_AUTOPATCH_DISCOVER": "maybe"}) is False
    )
    assert len(warnings) == 1 and "NPU_AUTOPATCH_DISCOVER" in warnings[0]


def test_names_of_discoverable_model_types_are_valid_only_with_discovery():
    assert _discover.installed({"doge", "esm.esmfold", "nonexistent", "../doge", "doge.x.y"}) == {
        "doge",
        "esm.esmfold",
    }
    with pytest.raises(ValueError, match="unknown models"):
        npu_autopatch.enable(exclude=["doge"])
    npu_autopatch.enable(exclude=["doge"], discover=True)
    assert STATE.config.exclude == frozenset({"doge"}) and STATE.config.discover


def test_model_types_of_modules():
    assert _discover.model_type_for("transformers.models.exaone4.modeling_exaone4") == "exaone4"
    assert _discover.model_type_for("transformers.models.esm.modeling_esmfold") == "esm.esmfold"
    assert _discover.model_type_for("transformers.models.data2vec.modeling_data2vec_text") == (
        "data2vec.data2vec_text"
    )
