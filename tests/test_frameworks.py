"""ms-swift's and LLaMA-Factory's own NPU patches, run from their real files, in their own order (issue 40).

- ms-swift 4.6.0 patches on import: ``swift/model/npu_patcher.py`` runs ``apply_all_patches()``, which
  imports ``npu_patch/model.py`` and calls its ``apply_patch()`` (the modeling modules are imported,
  and patched by us, on the way). The child imports ``swift.model.npu_patcher`` as ``swift/model/
  __init__.py`` does on an NPU.
- LLaMA-Factory 0.9.5 patches after the build: ``use_v1_kernels: true`` makes its loader call
  ``apply_default_kernels(model, include_kernels=True)`` on the trainable model, which sets ``forward``
  on each norm, MLP and MoE instance and rebinds the module's ``apply_rotary_pos_emb``. The child does
  the same (``config.architectures`` set as a checkpoint's config has it: LLaMA-Factory's MoE kernel
  picks its classes by it).

The files come from each framework's wheel on PyPI (tests/_wheels.py, each hash checked), never
committed. Their imports of the rest of their package get the package's own files where the patch
code needs them (ms-swift's ``npu_patch`` package and ``swift/utils/logger.py``; LLaMA-Factory's
kernels' ``base``, ``registry``, ``interface``, the four NPU ops modules, ``v1/accelerator/helper.py``
and ``v1/utils/{types,packages,logging,plugin,env}.py``) and, for what does not concern the patch, a
stand-in written here: ``modelscope.utils.logger.get_logger`` (a logger with one stream handler, all
ms-swift's logger asks of it). LLaMA-Factory's kernels register only on an NPU accelerator, which
``torch.accelerator`` reports on the device: the child makes LLaMA-Factory's
``get_current_accelerator`` answer ``npu`` (the stand-in's torch has no such backend).

Each scenario runs once, in one fresh interpreter, on qwen3 and qwen3_moe (a dense and an MoE model),
one training step each, so op counts, states, reports, logits and gradients compare across scenarios.
"""

import json
import re

import pytest
import torch
import transformers

from ._wheels import package_site, wheel, wheel_files
from .conftest import STAND_IN_SITE, kernel_ops, run_python
from .test_verl import assert_same_step

V4 = transformers.__version__.startswith("4.")
MODELS = ["qwen3", "qwen3_moe"]

SWIFT = "ms-swift==4.6.0"
SWIFT_FILES = {
    "swift/model/npu_patcher.py": "8a5830e8d9dba285099fc53f5003c7fd37af0c6ac7e9a6cb5effc12427270a98",
    "swift/model/npu_patch/__init__.py": "602c8453b708cafd07dbea9e31727674c24b4aba79d499124c226c19f752f099",
    "swift/model/npu_patch/env.py": "d77807cec1cdb807af324b9f9fcda56ba3380b0bde816f165f2ed9721821a53e",
    "swift/model/npu_patch/fsdp.py": "143bc5c539a4d2a034df5e1a12a6b1406977b6c728bee951858a2898560e089e",
    "swift/model/npu_patch/mindspeed.py": "d57966427d36b815efe262882806f3fd93788b505e88bff837277b3bf70feddb",
    "swift/model/npu_patch/model.py": "38f48a1c8430615544040b7dd56d32de1a117c1a1290823e9555e9f4d44bef33",
    "swift/model/npu_patch/utils.py": "7d0dee6a876e7a5fede6da2f9c19c573e2ea0c94d2ac08ea24d3573b178c5741",
    "swift/utils/logger.py": "0da3c479def5459653ea0dc42ec09d9a715a72884417b6ffa6b802c8a566e97d",
}
# modelscope is not installed: ms-swift's logger asks it for a logger with a handler, nothing more.
MODELSCOPE_LOGGER = b"""import logging


def get_logger():
    logger = logging.getLogger("modelscope")
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
    return logger
"""

LLAMAFACTORY = "llamafactory==0.9.5"
_KERNELS = "llamafactory/v1/plugins/model_plugins/kernels"
_OPS = f"{_KERNELS}/ops"
_V1 = "llamafactory/v1"
LLAMAFACTORY_FILES = {
    f"{_KERNELS}/base.py": "69a2b229a5486a54bfeb803c0a6c6a10279744eba3fa57af78edd40aa78b414a",
    f"{_KERNELS}/registry.py": "91348c7e7710d2c85bc0344d51d3518d12178f02a069b0206aa2214f2945e64d",
    f"{_KERNELS}/interface.py": "0ef7c995c34a01c22f77ac5f8e59ea672ee7c70cb279e6b8ca40ab996ae5992f",
    f"{_OPS}/rms_norm/npu_rms_norm.py": "6eed558e411714927c36c4b3cb1a07e0969e080916fe3f6e2942e7a929d6be7b",
    f"{_OPS}/mlp/npu_swiglu.py": "af165fe5d7a2aba6bbdc513a077ece3f958eeb969d5c7ec8da4d43536cbc671a",
    f"{_OPS}/mlp/npu_fused_moe.py": "1ae1b05f690488a64df32d4f9d87f725515c7e6500b4a427afd0453ac99218fe",
    f"{_OPS}/rope/npu_rope.py": "7e3e1a27fd57a1e8fc1abf18b5f89c0770456abd032d687ba6e0b26c94d1d95b",
    f"{_V1}/accelerator/helper.py": "c01cfeecab553878f4530381f8c792eda858efe7e2dd1e565b75a58ba102e464",
    f"{_V1}/utils/types.py": "d124ca46ab2931255c85fbd56c6e5b43bd52c904ec2da69bdcec1f5a29ea99ae",
    f"{_V1}/utils/packages.py": "f29693ba5a5be8dc9bd4fae421d5d3143e178ce845a89bf0e385bf7f8bc2aaae",
    f"{_V1}/utils/logging.py": "ff5bee9e15ef900cd56a4bf6a794ab6a22e116ec0b51ff40e986f5141099403f",
    f"{_V1}/utils/plugin.py": "595e2db1e3edaaccce8fdea46ee5726c12f2132f85864b638df36eb748065682",
    f"{_V1}/utils/env.py": "1a692278bb2dbf083976c244accf7f76f3aa9f4dfa92d34710e54c6a39985dad",
}
SWIFT_WHERE = "swift.model.npu_patch.model"
LF_WHERE = "llamafactory.v1.plugins.model_plugins.kernels"


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """PYTHONPATH directories holding ms-swift 4.6.0's and llamafactory 0.9.5's patch files."""
    swift = wheel_files(wheel(tmp_path_factory, SWIFT), SWIFT_FILES)
    swift["modelscope/utils/logger.py"] = MODELSCOPE_LOGGER
    llamafactory = wheel_files(wheel(tmp_path_factory, LLAMAFACTORY), LLAMAFACTORY_FILES)
    return {
        "swift": package_site(tmp_path_factory.mktemp("swift-site"), swift),
        "llamafactory": package_site(tmp_path_factory.mktemp("llamafactory-site"), llamafactory),
    }


# One training step of each tiny model after the scenario's framework did its patching; the root
# logger configured at INFO first, as a training script does (ms-swift then sets its handler to ERROR).
CHILD = """
import collections, json, logging, sys, types
import torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
import torch_npu
import npu_autopatch
from npu_autopatch.testing import parity, tiny

scenario, kernels, models, out = ARGUMENTS
if scenario == "swift":
    import swift.model.npu_patcher  # what swift/model/__init__.py does when transformers sees an NPU
if scenario == "llamafactory":
    from llamafactory.v1.accelerator import helper
    helper.get_current_accelerator = lambda check_available=True: types.SimpleNamespace(type="npu")
    from llamafactory.v1.plugins.model_plugins.kernels.interface import apply_default_kernels

KINDS = ("norm", "mlp", "moe")
results, tensors, built = {}, {}, {}
for model_type in models:
    model = tiny.tiny_model(model_type)
    if scenario == "llamafactory":  # its loader, use_v1_kernels: after the build, on the trainable model
        model.config.architectures = [type(model).__name__]
        model.train()
        model = apply_default_kernels(model, include_kernels=kernels)
    ids, labels, inputs = parity.model_batch(model, 1)
    before = collections.Counter(torch_npu.calls)
    try:
        tensors[model_type] = parity.forward_backward(model, ids, labels, **inputs)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    built[model_type] = model
    results[model_type] = {"ops": dict(collections.Counter(torch_npu.calls) - before), "error": error}
print("MARK: status() not asked yet", file=sys.stderr, flush=True)
for model_type, model in built.items():
    record = npu_autopatch.status()[model_type]
    coverage = npu_autopatch.report(model)
    results[model_type].update(
        state=str(record.state),
        code=None if record.code is None else str(record.code),
        reason=record.reason,
        counts=coverage.counts,
        targets={e.name: [e.runs, e.defined_by] for e in coverage.modules if e.kind in KINDS},
        rope={f.name.rpartition(":")[2]: [f.origin, f.defined_by] for f in coverage.functions},
        flags=[[f.kind, f.subject, f.message] for f in coverage.flags],
    )
facts = {}
for entry in ("swift_npu_patch", "llamafactory_kernels"):
    record = npu_autopatch.status()[entry]
    facts[entry] = [str(record.state), None if record.code is None else str(record.code), record.reason]
torch.save(tensors, out)
print(json.dumps({"models": results, "facts": facts}))
"""


@pytest.fixture(scope="module")
def runs(sites, tmp_path_factory):
    """Each scenario once, in a fresh interpreter, on both models: (its JSON, tensors, stderr)."""
    cache = {}

    def run(name, framework=None, kernels=True, **env):
        key = (name, framework, kernels, tuple(sorted(env.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(name) / "step.pt"
            code = CHILD.replace("ARGUMENTS", repr((framework, kernels, MODELS, str(out))))
            path = f"{STAND_IN_SITE}:{sites[framework]}" if framework else str(STAND_IN_SITE)
            done = run_python(code, timeout=900, PYTHONPATH=path, OMP_NUM_THREADS="1", **env)
            assert done.returncode == 0, done.stderr[-4000:]
            cache[key] = json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out), done.stderr
        return cache[key]

    return run


FRAMEWORKS = [
    pytest.param("swift", "ms-swift", SWIFT_WHERE, "swift_npu_patch", id="ms-swift"),
    pytest.param("llamafactory", "LLaMA-Factory", LF_WHERE, "llamafactory_kernels", id="llamafactory"),
]


@pytest.mark.parametrize(("framework", "name", "where", "entry"), FRAMEWORKS)
def test_in_the_frameworks_order_its_patch_steps_aside_and_ours_run_with_stocks_numbers(
    runs, framework, name, where, entry
):
    """NPU_AUTOPATCH=1 in the framework's own order: every model as patched by us alone (state, op
    counts, report, no foreign code), stock's logits and gradients, one INFO line naming the framework
    and the models, shown although ms-swift set the root logger's handler to ERROR."""
    _stock, stock_tensors, _ = runs("stock", NPU_AUTOPATCH="0")
    ours, _, _ = runs("ours-alone", NPU_AUTOPATCH="1")
    got, tensors, stderr = runs(f"{framework}-order", framework, NPU_AUTOPATCH="1")
    for model_type in MODELS:
        mine, alone = got["models"][model_type], ours["models"][model_type]
        assert mine["error"] is None and mine["state"] == alone["state"] == "applied", (model_type, mine)
        assert mine["ops"] == alone["ops"] and kernel_ops(mine["ops"]), (model_type, mine["ops"])
        assert mine["counts"] == alone["counts"], model_type
        assert mine["counts"]["modules_foreign"] == mine["counts"]["functions_foreign"] == 0, model_type
        assert not any(runs_.get("foreign") for runs_, _by in mine["targets"].values()), mine["targets"]
        assert mine["rope"]["apply_rotary_pos_emb"][0] == "ours", mine["rope"]
    assert_same_step(tensors, stock_tensors, MODELS)
    assert got["facts"][entry][:2] == ["applied", None], got["facts"]
    told = [line for line in stderr.splitlines() if "steps aside" in line]
    # ms-swift steps aside once, for every model it patches; LLaMA-Factory once per model it is given.
    assert len(told) == (1 if framework == "swift" else len(MODELS)), stderr[-3000:]
    for line in told:
        assert line.startswith(f"npu_autopatch INFO npu-autopatch: {name}'s NPU patch ({where}"), told
    assert re.search(r"steps aside for [^:]*qwen3\b", "".join(told)) and "qwen3_moe" in "".join(told), told
    assert "replaced-after-us" not in stderr


# What each framework replaces in each model: the status() reason names every one.
REPLACED = {
    "swift": {
        "qwen3": ["Qwen3RMSNorm.forward", "Qwen3MLP.forward", "apply_rotary_pos_emb"],
        "qwen3_moe": [
            "Qwen3MoeRMSNorm.forward",
            "apply_rotary_pos_emb",
            "Qwen3MoeSparseMoeBlock.forward" if V4 else "Qwen3MoeExperts.forward",
        ],
    },
    "llamafactory": {
        "qwen3": ["Qwen3RMSNorm.forward", "Qwen3MLP.forward", "apply_rotary_pos_emb"],
        "qwen3_moe": [
            "Qwen3MoeRMSNorm.forward",
            "Qwen3MoeMLP.forward",
            "apply_rotary_pos_emb",
            "Qwen3MoeSparseMoeBlock.forward" if V4 else "Qwen3MoeExperts.forward",
        ],
    },
}
# The module classes report(model) says run the framework's code (ms-swift rebinds the norm's name).
THEIRS = {
    "swift": {
        "qwen3": {"NpuRMSNorm", "Qwen3MLP"},
        "qwen3_moe": {"NpuRMSNorm", "Qwen3MoeSparseMoeBlock"} | (set() if V4 else {"Qwen3MoeExperts"}),
    },
    "llamafactory": {
        "qwen3": {"Qwen3RMSNorm", "Qwen3MLP"},
        "qwen3_moe": {"Qwen3MoeRMSNorm", "Qwen3MoeMLP"}
        | ({"Qwen3MoeSparseMoeBlock"} if V4 else {"Qwen3MoeExperts"}),
    },
}
SUBSET = "npu_fused_rmsnorm,npu_fused_swiglu,npu_fused_moe"  # LLaMA-Factory's kernels but the rotary


@pytest.mark.parametrize(("framework", "name", "where", "entry"), FRAMEWORKS)
def test_with_step_aside_off_theirs_runs_and_status_names_every_target_it_replaced(
    runs, framework, name, where, entry
):
    """NPU_AUTOPATCH_STEP_ASIDE=0: the framework's code runs where it puts it; status() says
    ``overridden`` and names every target it replaced and its holder; report(model) names the
    framework as what runs each; one WARNING per model before status() is asked, though ms-swift sets
    the root logger's handler to ERROR."""
    got, _tensors, stderr = runs(
        f"{framework}-off", framework, NPU_AUTOPATCH="1", NPU_AUTOPATCH_STEP_ASIDE="0"
    )
    before_status = stderr.split("MARK: status() not asked yet")[0]
    home = where.split(".")[0] + "."
    for model_type in MODELS:
        mine = got["models"][model_type]
        assert (mine["state"], mine["code"]) == ("overridden", "replaced-after-us"), (model_type, mine)
        for target in REPLACED[framework][model_type]:
            how = "was replaced after us|is bypassed by a forward set on its instances"
            assert re.search(rf":{re.escape(target)} ({how}) by {home}", mine["reason"]), (
                target,
                mine["reason"],
            )
        _assert_theirs_in_report(mine, home, rope=True)
        foreign = {name for name, (runs_, _by) in mine["targets"].items() if runs_.get("foreign")}
        assert foreign == THEIRS[framework][model_type], (model_type, mine["targets"])
        warned = re.findall(
            rf"WARNING npu-autopatch: {model_type}: overridden \(replaced-after-us\): .*", stderr
        )
        assert len(warned) == 1 and warned[0] in before_status, (model_type, stderr[-3000:])
    assert got["facts"][entry][:2] == ["skipped", "not-selected"], got["facts"]
    assert "steps aside" not in stderr


def _assert_theirs_in_report(mine, home, rope):
    """report(model): each norm / MLP / MoE module of the framework's runs its code, named as the code
    of its class (ms-swift's class forwards) or in a flag of its instances (LLaMA-Factory's instance
    forwards); the rotary function is the framework's (``rope``) or ours."""
    foreign = {name: by for name, (runs_, by) in mine["targets"].items() if runs_.get("foreign")}
    assert foreign, mine["targets"]
    flagged = {s for kind, s, message in mine["flags"] if kind == "instance-forward" and home in message}
    for name, by in foreign.items():
        assert set(mine["targets"][name][0]) == {"foreign"}, (name, mine["targets"])
        assert by.startswith(home) or name in flagged, (name, by, mine["flags"])
    assert mine["rope"]["apply_rotary_pos_emb"][0] == ("foreign" if rope else "ours"), mine["rope"]
    if rope:
        assert mine["rope"]["apply_rotary_pos_emb"][1].startswith(home), mine["rope"]


def test_llamafactorys_subset_of_kernels_is_never_applied_while_its_code_runs(runs):
    """LLaMA-Factory's kernels but the rotary, step-aside off: its norm, MLP and MoE forwards are set
    on the instances, our rotary stays; status() is ``overridden`` (never ``applied``) and names each
    instance forward's holder but not the rotary; report(model) flags the instances."""
    got, _tensors, stderr = runs(
        "llamafactory-subset", "llamafactory", SUBSET, NPU_AUTOPATCH="1", NPU_AUTOPATCH_STEP_ASIDE="0"
    )
    for model_type in MODELS:
        mine = got["models"][model_type]
        assert mine["error"] is None, mine
        assert (mine["state"], mine["code"]) == ("overridden", "replaced-after-us"), (model_type, mine)
        for target in REPLACED["llamafactory"][model_type]:
            if target != "apply_rotary_pos_emb":
                assert (
                    f":{target} is bypassed by a forward set on its instances by {LF_WHERE}" in mine["reason"]
                ), (
                    target,
                    mine["reason"],
                )
        assert "apply_rotary_pos_emb" not in mine["reason"]
        assert mine["rope"]["apply_rotary_pos_emb"][0] == "ours"
        flagged = {subject for kind, subject, _message in mine["flags"] if kind == "instance-forward"}
        foreign = {name for name, (runs_, _by) in mine["targets"].items() if runs_.get("foreign")}
        assert foreign and foreign <= flagged, (foreign, mine["flags"])
        assert mine["ops"].get("npu_rotary_mul"), mine["ops"]
    assert len(re.findall(r"WARNING npu-autopatch: qwen3: overridden", stderr)) == 1, stderr[-3000:]


# LLaMA-Factory main's interface has no wheel on the package index (tests of its real file would need a
# download from GitHub at a pinned commit): its shape, written here, is what the step-aside relies on.
MAIN_SHAPED_INTERFACE = """
def apply_kernels(model, config, require_logits=False):
    model.kernels_applied = config["name"]
    return model


def apply_kernel(kernel_id, **kwargs):
    return apply_kernels(kwargs["model"], {"name": kernel_id})
"""
# ms-swift's apply_patch in another shape: no apply_patch_map to narrow.
SWIFT_OTHER_SHAPE = "def apply_patch():\n    return None\n"


def test_llamafactory_mains_apply_kernels_and_code_of_another_shape(tmp_path):
    """main's ``apply_kernels(model, config)`` (the v1 engine's and ``apply_v1_kernels``' way) is
    stepped aside for a model of ours, by position or keyword, and runs for a model we do not patch;
    ms-swift's ``apply_patch`` of another shape is refused with the reason and left running."""
    site = package_site(
        tmp_path,
        {
            "llamafactory/v1/plugins/model_plugins/kernels/interface.py": MAIN_SHAPED_INTERFACE.encode(),
            "swift/model/npu_patch/model.py": SWIFT_OTHER_SHAPE.encode(),
        },
    )
    done = run_python(
        """
        import json, logging
        logging.basicConfig(level=logging.INFO)
        import torch_npu, npu_autopatch
        from npu_autopatch.testing import tiny
        from llamafactory.v1.plugins.model_plugins.kernels import interface
        import swift.model.npu_patch.model as swift_model
        ours, other = tiny.tiny_model("qwen3"), tiny.tiny_model("llama")
        interface.apply_kernels(ours, {"name": "auto"})
        interface.apply_kernels(model=ours, config={"name": "auto"})
        interface.apply_kernel("npu_fused_rmsnorm", model=other)
        records = npu_autopatch.status()
        entries = {e: records[e] for e in ("llamafactory_kernels", "swift_npu_patch")}
        print(json.dumps({
            "ours": getattr(ours, "kernels_applied", None),
            "other": getattr(other, "kernels_applied", None),
            "entries": {e: [str(r.state), str(r.code), r.reason, list(r.targets)] for e, r in
                        entries.items()},
            "swift_left": swift_model.apply_patch.__module__,
        }))
        """,
        PYTHONPATH=f"{STAND_IN_SITE}:{site}",
        NPU_AUTOPATCH="1",
        NPU_AUTOPATCH_EXCLUDE="llama",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["ours"] is None and got["other"] == "npu_fused_rmsnorm", got
    state, code, _reason, targets = got["entries"]["llamafactory_kernels"]
    assert (state, code, targets) == ("applied", "None", [f"{LF_WHERE}.interface:apply_kernels"]), got
    state, code, reason, _targets = got["entries"]["swift_npu_patch"]
    assert (state, code) == ("skipped", "math-differs"), got
    assert (
        f"{SWIFT_WHERE}.apply_patch: it does not apply its tables through the global apply_patch_map"
        in reason
    )
    assert "ms-swift's patch runs as without us" in reason and got["swift_left"] == SWIFT_WHERE
    assert len(re.findall("LLaMA-Factory's NPU patch .* steps aside for qwen3", done.stderr)) == 1, (
        done.stderr
    )
