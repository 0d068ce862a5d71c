"""Interpreter start and the lazy path, as a user meets them: each test is a fresh interpreter."""

import json
import os

import pytest

from npu_autopatch._config import SELECTABLE_KERNELS as KERNELS
from npu_autopatch.models import MODELS

from .conftest import ROOT, STAND_IN_SITE
from .conftest import run_python as _run_python

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = [pytest.mark.full, pytest.mark.process]


def run_python(code, **env):
    """A cold interpreter: the subject here is the interpreter's start (tests/_warm.py's limits)."""
    return _run_python(code, warm=False, **env)


STATE_AT_START = """
import json, sys
HEAVY = ("wrapt", "torch", "transformers", "logging", "typing", "dataclasses", "asyncio")
npu = sys.modules.get("npu_autopatch")
print(json.dumps({
    "enabled": bool(npu and npu.is_enabled()),
    "watchers": sum(type(f).__name__ == "TransformersWatcher" for f in sys.meta_path),
    "heavy": sorted(m for m in HEAVY if m in sys.modules),
}))
"""


def start(**env):
    child = run_python(STATE_AT_START, **env)
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr
    return json.loads(child.stdout), child.stderr


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", " on ", "On"])
def test_true_words_arm_the_watcher_and_nothing_heavy(value):
    state, stderr = start(NPU_AUTOPATCH=value)
    assert state == {"enabled": True, "watchers": 1, "heavy": []}
    assert stderr == ""


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF", "", "  "])
def test_false_words_do_nothing_silently(value):
    state, stderr = start(NPU_AUTOPATCH=value)
    assert state["enabled"] is False and state["watchers"] == 0
    assert stderr == ""


def test_unset_does_not_even_import_the_package():
    child = run_python("import sys; print('npu_autopatch' in sys.modules)")
    assert child.stdout.strip() == "False"


@pytest.mark.parametrize("value", ["2", "maybe", "enable", "1; rm -rf /", "\uff4f\uff4e", "x" * 10000])
def test_unrecognised_switch_warns_once_and_does_nothing(value):
    state, stderr = start(NPU_AUTOPATCH=value)
    assert state["enabled"] is False
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npu-autopatch: ignoring NPU_AUTOPATCH=")
    assert len(lines[0]) < 300


def test_unknown_model_and_kernel_names_warn_with_the_valid_ones():
    state, stderr = start(
        NPU_AUTOPATCH="1", NPU_AUTOPATCH_MODELS="qwen3, bogus", NPU_AUTOPATCH_KERNELS="rope,__import__('os')"
    )
    assert state["enabled"] is True
    lines = stderr.splitlines()
    assert len(lines) == 2
    assert f"unknown models in NPU_AUTOPATCH_MODELS: 'bogus'; valid models: {', '.join(MODELS)}" in lines[0]
    assert "unknown kernels in NPU_AUTOPATCH_KERNELS" in lines[1] and ", ".join(KERNELS) in lines[1]


def test_a_pth_line_run_twice_boots_once():
    # A venv's site-packages can be processed twice; re-process it to run the .pth line again.
    child = run_python(
        """
        import site, sys, sysconfig
        site.addsitedir(sysconfig.get_paths()["purelib"])
        print(sum(type(f).__name__ == "TransformersWatcher" for f in sys.meta_path))
        """,
        NPU_AUTOPATCH="1",
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "1"


def test_hostile_values_are_never_imported_or_executed(tmp_path):
    marker = tmp_path / "executed"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    child = run_python(
        "import transformers.models.llama.modeling_llama",
        NPU_AUTOPATCH="1",
        NPU_AUTOPATCH_MODELS=f"llama,{payload},$(touch {marker})",
        NPU_AUTOPATCH_EXCLUDE="`touch " + str(marker) + "`",
        NPU_AUTOPATCH_KERNELS=payload,
        NPU_AUTOPATCH_STRICT="$(touch x)",
    )
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr
    assert not marker.exists()


LAZY_STATUS = """
import json
import transformers
from transformers.models.qwen3 import modeling_qwen3
import npu_autopatch
print(json.dumps({m: r.as_dict() for m, r in npu_autopatch.status().items()}))
"""


def test_env_var_alone_patches_a_child_process():
    # No code of ours runs in the child before the import: the .pth line and the hooks do it.
    child = run_python(LAZY_STATUS, NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE))
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert report["qwen3"]["state"] == "applied"
    assert report["qwen3"]["kernels"] == ["rms_norm", "swiglu", "rope"]
    assert report["llama"]["state"] == "pending"


def test_env_var_without_torch_npu_warns_once_and_runs_stock():
    child = run_python(
        LAZY_STATUS.replace("import transformers", "from transformers.models.llama import modeling_llama"),
        NPU_AUTOPATCH="1",
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert report["qwen3"]["state"] == "skipped"
    assert report["llama"]["state"] == "skipped"
    warnings = [line for line in child.stderr.splitlines() if line.startswith("npu-autopatch")]
    assert warnings == [
        "npu-autopatch: NPU kernels not used, models run stock: "
        "torch_npu not importable: ModuleNotFoundError: No module named 'torch_npu'"
    ]


def test_strict_env_turns_a_failure_into_an_import_error_naming_model_and_cause():
    # qwen3 alone: with every entry, npu_flash_attention fails first (transformers' modeling utilities
    # import its integration module before any modeling module), naming itself.
    child = run_python(
        "from transformers.models.qwen3 import modeling_qwen3",
        NPU_AUTOPATCH="1",
        NPU_AUTOPATCH_STRICT="1",
        NPU_AUTOPATCH_MODELS="qwen3",
        NPU_AUTOPATCH_DEFAULT_ATTENTION="0",  # its entry (transformers' modeling utilities) would come first
    )
    assert child.returncode == 1
    assert "npu_autopatch.PatchError" in child.stderr or "PatchError" in child.stderr
    assert "qwen3 skipped: torch_npu not importable" in child.stderr


def test_a_failing_hook_never_breaks_the_users_import():
    # The kernel raises inside the post-import hook; the import must still succeed, stock.
    child = run_python(
        """
        import json
        from npu_autopatch import kernels
        def boom(stock, npu):
            raise RuntimeError("boom")
        kernels.KERNELS["swiglu"].variants[0].build = boom
        from transformers.models.qwen3 import modeling_qwen3
        import npu_autopatch
        rec = npu_autopatch.status()["qwen3"]
        print(json.dumps([rec.state, rec.reason, modeling_qwen3.Qwen3RMSNorm.forward.__module__]))
        """,
        NPU_AUTOPATCH="1",
        PYTHONPATH=str(STAND_IN_SITE),
    )
    assert child.returncode == 0, child.stderr
    state, reason, norm_module = json.loads(child.stdout)
    assert state == "failed" and "boom" in reason
    assert norm_module == "transformers.models.qwen3.modeling_qwen3"


def test_sitecustomize_chains_to_the_one_it_shadows(tmp_path):
    system_site = tmp_path / "system"
    system_site.mkdir()
    (system_site / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = 'yes'\n")
    path = os.pathsep.join([str(ROOT / "sitecustomize_example"), str(system_site)])
    script = """
        import os, sys
        import npu_autopatch
        print(os.environ.get("SHADOWED_RAN"), npu_autopatch.is_enabled(),
              sys.modules["sitecustomize"].__file__.endswith("sitecustomize_example/sitecustomize.py"))
    """
    child = run_python(script, PYTHONPATH=path)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["yes", "True", "True"]
    assert child.stderr == ""

    opted_out = run_python(script, PYTHONPATH=path, NPU_AUTOPATCH="0")
    assert opted_out.stdout.split() == ["yes", "False", "True"]
