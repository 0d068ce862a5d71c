"""verl's own NPU patch (verl 0.9.1's real ``npu_patch.py``) steps aside for ours (issue 25 part 1).

verl's FSDP engine calls ``apply_npu_patches()`` after our hooks patched the modeling modules
(``FSDPEngine.__init__`` -> ``apply_npu_fsdp_patches``). With step-aside on, it patches only what
we do not; with ``NPU_AUTOPATCH_STEP_ASIDE=0`` it runs as without us, and each target it replaced
after us is one WARNING, told at the next import we hook, before anyone asks status().

verl's module file comes from the verl 0.9.1 wheel on PyPI (``pip download --no-deps``, its hash
checked), loaded under its own name from a package of empty ``__init__`` files: verl's code is
never committed, and its whole import chain (ray, its own dependencies) is not needed. Where the
wheel cannot be fetched (no registry) these tests skip with the reason, except in CI (``CI=true``,
which CI sets), where they fail. Each
scenario runs in a fresh interpreter on the CPU stand-in; every scenario builds the same tiny
models and runs one training step, so their op counts, logits and gradients compare.
"""

import json
import re

import pytest
import torch
import transformers

from npu_autopatch.testing.parity import TOLERANCE, relative_error

from ._wheels import package_site, wheel, wheel_files
from .conftest import FULL, STAND_IN_SITE, kernel_ops, present, run_python, selected_values

VERL = "verl==0.9.1"
NPU_PATCH = "verl/models/transformers/npu_patch.py"
NPU_PATCH_SHA256 = "3b78eee4ef8ae9631884e3ed1a5edd9015f799053f9338c50de262668e9f2964"
WHERE = "verl.models.transformers.npu_patch"
# verl 0.9.1's NPU_PATCHES, in its order; the ones this transformers has.
VERL_MODELS = (
    "qwen2",
    "qwen2_5_vl",
    "qwen3",
    "qwen3_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
)
PRESENT = [m for m in VERL_MODELS if present(m)]
V4 = transformers.__version__.startswith("4.")


@pytest.fixture(scope="module")
def verl_site(tmp_path_factory):
    """A directory for PYTHONPATH where ``verl.models.transformers.npu_patch`` is verl 0.9.1's file."""
    files = wheel_files(wheel(tmp_path_factory, VERL), {NPU_PATCH: NPU_PATCH_SHA256})
    return package_site(tmp_path_factory.mktemp("verl-site"), files)


# One training step of each tiny model after the scenario's patching: op counts, states, the
# report's counts, and (to a file) logits and gradients. A model whose step raises says so.
CHILD = """
import collections, json, logging, sys
import torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
import torch_npu
import npu_autopatch
from npu_autopatch.testing import parity, tiny

scenario, models, out = ARGUMENTS
facts = {}

def verl_apply():
    from verl.models.transformers.npu_patch import apply_npu_patches  # as apply_npu_fsdp_patches does
    apply_npu_patches()

if scenario in ("verl-order", "verl-order-off", "verl-alone"):
    verl_apply()
if scenario == "verl-order-off":
    import transformers.models.mistral.modeling_mistral  # any import we hook: overrides are told there
    print("MARK: status() not asked yet", file=sys.stderr, flush=True)
if scenario == "verl-first":
    verl_apply()
    npu_autopatch.enable()
    verl_apply()  # verl calls it again for each engine it starts
if scenario == "verl-order":
    from verl.models.transformers import npu_patch
    facts["wrapped"] = getattr(npu_patch.apply_npu_patches, "__wrapped__", None) is not None

results, tensors = {}, {}
for model_type in models:
    model = tiny.tiny_model(model_type)
    ids, labels, inputs = parity.model_batch(model, 1)
    before = collections.Counter(torch_npu.calls)
    try:
        tensors[model_type] = parity.forward_backward(model, ids, labels, **inputs)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    record = npu_autopatch.status()[model_type]
    coverage = npu_autopatch.report(model)
    results[model_type] = {
        "ops": dict(collections.Counter(torch_npu.calls) - before),
        "error": error,
        "state": str(record.state),
        "code": None if record.code is None else str(record.code),
        "reason": record.reason,
        "counts": coverage.counts,
        "norms": {e.name: [e.origin, e.defined_by] for e in coverage.modules if e.kind == "norm"},
    }
entry = npu_autopatch.status()["verl_npu_patch"]
facts["verl_npu_patch"] = [str(entry.state), None if entry.code is None else str(entry.code), entry.reason,
                           list(entry.targets)]
if scenario == "verl-order":
    from verl.models.transformers import npu_patch
    original = npu_patch.apply_npu_patches.__wrapped__
    npu_autopatch.disable()
    facts["restored"] = npu_patch.apply_npu_patches is original
torch.save(tensors, out)
print(json.dumps({"models": results, "facts": facts}))
"""


def scenario(name, models, site, tmp_path, **env):
    """Run one scenario in a fresh interpreter: (its JSON, its logits and gradients, its stderr)."""
    out = tmp_path / f"{name}.pt"
    code = CHILD.replace("ARGUMENTS", repr((name, models, str(out))))
    done = run_python(code, timeout=900, PYTHONPATH=f"{STAND_IN_SITE}:{site}", **env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out), done.stderr


def assert_same_step(got, expected, models, tolerance=TOLERANCE[torch.float32]):
    """Logits and every gradient within the fp32 parity tolerance of ``expected``'s, model by model."""
    for model_type in models:
        (logits, grads), (stock_logits, stock_grads) = got[model_type], expected[model_type]
        assert relative_error(logits, stock_logits) <= tolerance, model_type
        for name, grad in stock_grads.items():
            if grad is not None:
                assert relative_error(grads[name], grad) <= tolerance, (model_type, name)


def _same_step(got, expected, model_type):
    try:
        assert_same_step(got, expected, [model_type])
    except AssertionError:
        return False
    return True


def _ours_op(ops):
    return sum(ops.values())


@pytest.fixture(scope="module")
def runs(verl_site, tmp_path_factory, request):
    """Each scenario once, in one interpreter, on every model the selected tests of this module ask for
    (qwen3 in the default selection; with ``-m full`` every verl model): each test reads its own models."""
    every = selected_values(request, "models")
    cache = {}

    def run(name, models, **env):
        assert set(models) <= set(every), (models, every)
        key = (name, tuple(sorted(env.items())))
        if key not in cache:
            cache[key] = scenario(name, every, verl_site, tmp_path_factory.mktemp(name), **env)
        return cache[key]

    return run


MODEL_SETS = [
    pytest.param(["qwen3"], id="qwen3"),
    pytest.param([m for m in PRESENT if m != "qwen3"], id="verl-models", marks=FULL),
]


@pytest.mark.parametrize("models", MODEL_SETS)
def test_in_verls_order_verls_patch_steps_aside_and_ours_run(runs, models):
    """NPU_AUTOPATCH=1, then verl's engine calls apply_npu_patches: every model as patched by us alone
    (same state, same op counts, none of verl's code in the model), stock's logits and gradients."""
    stock, stock_tensors, _ = runs("stock", models)
    ours, _, _ = runs("ours-alone", models, NPU_AUTOPATCH="1")
    got, tensors, stderr = runs("verl-order", models, NPU_AUTOPATCH="1")
    for model_type in models:
        mine, alone = got["models"][model_type], ours["models"][model_type]
        assert mine["error"] is None and mine["state"] == alone["state"], (model_type, mine)
        assert mine["state"] in ("applied", "partial"), (model_type, mine)
        assert mine["ops"] == alone["ops"] and _ours_op(mine["ops"]) > 0, (model_type, mine["ops"])
        assert mine["counts"] == alone["counts"], model_type
        assert mine["counts"]["modules_foreign"] == mine["counts"]["functions_foreign"] == 0, model_type
        assert mine["norms"] and all(
            origin == "ours" and by.startswith("npu_autopatch.") for origin, by in mine["norms"].values()
        ), (model_type, mine["norms"])
        assert kernel_ops(stock["models"][model_type]["ops"]) == {}  # but torch_npu's sdpa
    assert_same_step(tensors, stock_tensors, models)
    state, code, _reason, targets = got["facts"]["verl_npu_patch"]
    assert (state, code, targets) == ("applied", None, [f"{WHERE}:apply_npu_patches"])
    assert got["facts"]["wrapped"] and got["facts"]["restored"]  # disable() puts verl's function back
    told = [line for line in stderr.splitlines() if "steps aside" in line]
    assert len(told) == 1, stderr[-3000:]
    assert told[0].startswith("npu_autopatch INFO npu-autopatch: verl's NPU patch (verl.models.transformers")
    assert f"steps aside for {', '.join(PRESENT)}: npu-autopatch patches them" in told[0]
    assert "verl's still patches: none" in told[0]
    assert "replaced-after-us" not in stderr


@pytest.mark.parametrize("models", MODEL_SETS)
def test_with_step_aside_off_verls_patch_runs_as_without_us_and_each_override_is_told(runs, models):
    """NPU_AUTOPATCH_STEP_ASIDE=0: verl's patch replaces what it replaces without us (its modules and
    functions run its code, each of its ops runs at least as often: our kernels keep the targets
    verl has no code for), status() and report() say whose code runs, and each override is a
    WARNING at the next import we hook, before status() is asked."""
    _stock, stock_tensors, _ = runs("stock", models)
    verl, verl_tensors, _ = runs("verl-alone", models, NPU_AUTOPATCH="0")
    got, tensors, stderr = runs("verl-order-off", models, NPU_AUTOPATCH="1", NPU_AUTOPATCH_STEP_ASIDE="0")
    before_status = stderr.split("MARK: status() not asked yet")[0]
    for model_type in models:
        mine, alone = got["models"][model_type], verl["models"][model_type]
        assert mine["error"] == alone["error"], (model_type, mine, alone)
        # 5.x experts go through transformers' experts registry, where ours stays: <=, not ==.
        foreign = mine["counts"]["modules_foreign"]
        assert 0 < foreign <= alone["counts"]["modules_foreign"], (model_type, mine, alone)
        assert mine["counts"]["functions_foreign"] == alone["counts"]["functions_foreign"], model_type
        if alone["error"] is None:  # else the same error of verl's code (qwen3_5_moe: CPU histc on Long)
            # The attention ops are the default attention's (sdpa alone, the flash path routed with us).
            ops = kernel_ops(alone["ops"]).items()
            assert all(mine["ops"].get(op, 0) >= n for op, n in ops), (model_type, mine)
            if _same_step(verl_tensors, stock_tensors, model_type):
                assert _same_step(tensors, stock_tensors, model_type), model_type
        if (mine["state"], mine["code"]) == ("skipped", "foreign-patch"):
            # 4.57: Qwen2.5-VL's norm is qwen2's Qwen2RMSNorm, which verl replaced before its import
            assert (model_type, V4) == ("qwen2_5_vl", True) and f"by {WHERE}." in mine["reason"]
            continue
        assert (mine["state"], mine["code"]) == ("overridden", "replaced-after-us"), (model_type, mine)
        assert f"by {WHERE}." in mine["reason"]
        told = rf"WARNING npu-autopatch: {model_type}: overridden \(replaced-after-us\): .*"
        warned = re.findall(told, stderr)
        assert len(warned) == 1 and f"by {WHERE}." in warned[0], (model_type, stderr[-3000:])
        assert warned[0] in before_status, model_type  # told at the next import we hooked, unasked
    state, code, reason, _targets = got["facts"]["verl_npu_patch"]
    assert (state, code) == ("skipped", "not-selected") and "NPU_AUTOPATCH_STEP_ASIDE=0" in reason
    assert "steps aside" not in stderr


@pytest.mark.parametrize("models", MODEL_SETS)
def test_verls_patch_applied_before_enable_is_named_and_left_running(runs, models):
    """verl's apply_npu_patches, then enable(): its targets are verl's (foreign-patch names verl), its
    kernels run as with verl alone; its next call (the next engine) changes nothing."""
    verl, verl_tensors, _ = runs("verl-alone", models, NPU_AUTOPATCH="0")
    # The default attention and the activations left as they are: verl's patch has neither, and its
    # kernels are compared exactly.
    got, tensors, _stderr = runs(
        "verl-first", models, NPU_AUTOPATCH_DEFAULT_ATTENTION="0", NPU_AUTOPATCH_EXCLUDE="activations"
    )
    for model_type in models:
        mine, alone = got["models"][model_type], verl["models"][model_type]
        assert mine["ops"] == alone["ops"] and mine["error"] == alone["error"], (model_type, mine, alone)
        if alone["error"] is None:
            assert_same_step(tensors, verl_tensors, [model_type], tolerance=0.0)
        assert (mine["state"], mine["code"]) == ("skipped", "foreign-patch"), (model_type, mine)
        assert f"already replaced by {WHERE}." in mine["reason"], model_type
        # NPU_AUTOPATCH=0: verl's patch runs its kernels, its norms are verl's code
        assert alone["state"] == "off" and alone["ops"].get("npu_rms_norm"), (model_type, alone)
        assert alone["norms"] and all(by == WHERE for _origin, by in alone["norms"].values()), alone["norms"]
    assert got["facts"]["verl_npu_patch"][:2] == ["applied", None]


MOVED = "verl/workers/npu/patches.py"


def test_verls_function_is_found_by_what_its_module_defines_wherever_it_moves(verl_site, tmp_path):
    """verl 0.9.1's file under another module name of verl, beside a module that only imports its
    function: the one that defines it is patched, the other left alone."""
    site = package_site(tmp_path, {MOVED: (verl_site / NPU_PATCH).read_bytes()})
    (site / "verl" / "reexport.py").write_text("from verl.workers.npu.patches import apply_npu_patches\n")
    done = run_python(
        """
        import npu_autopatch, torch_npu
        import verl.workers.npu.patches as patches
        import verl.reexport
        patches.apply_npu_patches()
        record = npu_autopatch.status()["verl_npu_patch"]
        print(record.state, record.targets, verl.reexport.apply_npu_patches is patches.apply_npu_patches)
        print(npu_autopatch.status()["qwen3"].state)
        """,
        PYTHONPATH=f"{STAND_IN_SITE}:{site}",
        NPU_AUTOPATCH="1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "applied ('verl.workers.npu.patches:apply_npu_patches',) True",
        "pending",  # verl's patch stepped aside: nothing imported modeling_qwen3
    ], done.stderr[-3000:]


SHAPES = {
    "no table": "def apply_npu_patches():\n    return None\n",
    "a table read by another function": (
        "NPU_PATCHES = {}\n"
        "def _table():\n    return NPU_PATCHES\n"
        "def apply_npu_patches():\n    for name, patch in _table().items():\n        patch()\n"
    ),
    "required arguments": "NPU_PATCHES = {}\ndef apply_npu_patches(models):\n    return NPU_PATCHES\n",
    "a table that is no dict": "NPU_PATCHES = ['qwen3']\ndef apply_npu_patches():\n    return NPU_PATCHES\n",
}


# One shape in the default selection, the others under -m full.
SHAPE_CASES = [
    pytest.param(code, id=name, marks=() if name == "no table" else FULL) for name, code in SHAPES.items()
]


@pytest.mark.parametrize("source", SHAPE_CASES)
def test_code_of_another_shape_is_refused_with_the_reason_and_left_running(source, tmp_path):
    site = package_site(tmp_path, {"verl/npu_patch.py": source.encode()})
    done = run_python(
        """
        import npu_autopatch, torch_npu, transformers
        import verl.npu_patch as npu_patch
        record = npu_autopatch.status()["verl_npu_patch"]
        print(record.state, record.code, npu_patch.apply_npu_patches.__module__, "|", record.reason)
        """,
        PYTHONPATH=f"{STAND_IN_SITE}:{site}",
        NPU_AUTOPATCH="1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip()
    assert line.startswith("skipped math-differs verl.npu_patch |"), line
    assert "verl.npu_patch.apply_npu_patches: " in line and "verl's patch runs as without us" in line, line


def test_a_replaced_after_us_override_is_a_warning_once_whoever_replaced_it(npu_stand_in, caplog):
    """Any library, not only verl: the WARNING comes once per override, at the first look (a hook,
    status(), report()), and again after a new enable() patched the target and it was replaced again."""
    from transformers.models.qwen3 import modeling_qwen3

    import npu_autopatch

    def foreign_forward(self, hidden_states):
        return hidden_states

    stock = vars(modeling_qwen3.Qwen3RMSNorm)["forward"]
    caplog.set_level("WARNING", logger="npu_autopatch")
    try:
        for _round in range(2):
            npu_autopatch.enable(models=["qwen3"])
            assert npu_autopatch.status()["qwen3"].state == "applied"
            caplog.clear()
            modeling_qwen3.Qwen3RMSNorm.forward = foreign_forward
            for _look in range(3):
                assert npu_autopatch.status()["qwen3"].code == "replaced-after-us"
            told = [r.getMessage() for r in caplog.records if "replaced-after-us" in r.getMessage()]
            assert len(told) == 1 and "foreign_forward" in told[0], told
            assert told[0].startswith("npu-autopatch: qwen3: overridden (replaced-after-us): ")
            npu_autopatch.disable()  # another library's object stays: put stock back by hand
            modeling_qwen3.Qwen3RMSNorm.forward = stock
    finally:
        modeling_qwen3.Qwen3RMSNorm.forward = stock
