"""status() lists the installed plugins' models once patching is on, before transformers is imported
(issue 33: the example plugin's own test, run alone, found no ``helium`` in status())."""

import json

import pytest

from .conftest import run_python

MODULE = "transformers.models.helium.modeling_helium"


def status(enable=False):
    """A child's code: status() of the plugin's model (after enable() if asked), and what is imported."""
    return STATUS.replace("ENABLE", "npu_autopatch.enable()" if enable else "pass")


STATUS = """
    import json, sys
    import npu_autopatch
    ENABLE
    before = npu_autopatch.status().get("acme_helium")
    print(json.dumps([before and before.state, before and before.module, "transformers" in sys.modules,
                      "acme_npu" in sys.modules]))
"""


def _distribution(root):
    """An installed distribution, as importlib.metadata sees one, declaring one model under its own name."""
    (root / "acme_npu").mkdir()
    (root / "acme_npu" / "__init__.py").write_text(
        "from npu_autopatch import Model, Target\n"
        f"MODEL = Model('acme_helium', Target('rms_norm', 'HeliumRMSNorm.forward'), module={MODULE!r})\n"
    )
    info = root / "acme_npu-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-npu\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[npu_autopatch.patches]\nacme_helium@{MODULE} = acme_npu:MODEL\n"
    )
    return str(root)


@pytest.mark.parametrize("how", ["environment", "enable"])
def test_status_lists_an_installed_plugin_once_patching_is_on(tmp_path, how):
    env = {"NPU_AUTOPATCH": "1"} if how == "environment" else {}
    child = run_python(status(enable=how == "enable"), PYTHONPATH=_distribution(tmp_path), **env)
    assert child.returncode == 0, child.stderr
    state, module, transformers_imported, plugin_imported = json.loads(child.stdout)
    assert (state, module) == ("pending", MODULE)
    assert not transformers_imported and not plugin_imported  # its metadata read, not its code


def test_status_reads_no_plugin_while_patching_is_off(tmp_path):
    child = run_python(status(), PYTHONPATH=_distribution(tmp_path))
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout)[0] is None  # status() stays cheap: no package metadata read
