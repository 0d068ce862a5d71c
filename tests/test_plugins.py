"""Third-party models: register(), entry-point plugins and trust_remote_code modules."""

import json
import textwrap

import pytest
from transformers.models.helium import modeling_helium
from transformers.models.qwen3 import modeling_qwen3  # noqa: F401 - imported, so enable() patches it

import npu_autopatch
from npu_autopatch import Kernel, Model, Target, Variant
from npu_autopatch._state import STATE

from .conftest import STAND_IN_SITE, run_python

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = pytest.mark.full


# A model type outside the built-in table (its norm and MLP: enough for the mechanism tested here).
HELIUM = (
    Target("rms_norm", "HeliumRMSNorm.forward"),
    Target("swiglu", "HeliumMLP.forward"),
)


@pytest.fixture
def registry():
    """Registrations made by a test are dropped after it (the registry is process-wide)."""
    saved = dict(STATE.models)
    yield STATE.models
    npu_autopatch.disable()
    for model_type in set(STATE.models) | set(saved):
        if STATE.models.get(model_type) is not saved.get(model_type):
            npu_autopatch.unregister(model_type)
            if model_type in saved:
                STATE.models[model_type] = saved[model_type]


def test_register_after_enable_patches_at_once_and_disable_undoes_it(npu_stand_in, registry):
    registry.pop("helium", None)  # an installed example plugin may have declared it
    stock = modeling_helium.HeliumRMSNorm.__dict__["forward"]
    npu_autopatch.enable()
    npu_autopatch.register("helium", targets=HELIUM)
    record = npu_autopatch.status()["helium"]
    assert record.state == "applied" and record.kernels == ("rms_norm", "swiglu")
    assert modeling_helium.HeliumRMSNorm.__dict__["forward"] is not stock
    npu_autopatch.disable()
    assert modeling_helium.HeliumRMSNorm.__dict__["forward"] is stock


def test_register_refuses_an_existing_model_unless_replace(npu_stand_in, registry):
    with pytest.raises(ValueError, match="'qwen3' is a built-in model; pass replace=True"):
        npu_autopatch.register("qwen3", targets=[Target("rms_norm", "Qwen3RMSNorm.forward")])
    npu_autopatch.enable()
    assert npu_autopatch.status()["qwen3"].kernels == ("rms_norm", "swiglu", "rope")
    npu_autopatch.register("qwen3", targets=[Target("rms_norm", "Qwen3RMSNorm.forward")], replace=True)
    assert npu_autopatch.status()["qwen3"].kernels == ("rms_norm",)


def test_a_target_newer_than_the_installed_transformers_is_left_out(npu_stand_in, registry):
    """Target(since=...): older releases do not have that code; the model is whole without it."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    targets = [
        *HELIUM,
        Target("moe", "HeliumMoeFromTheFuture.forward", since=f"{major + 1}.0"),
        Target("swiglu", "HeliumMLP.forward", since=f"{major}.0"),
    ]
    npu_autopatch.register("helium_next", targets=targets, module=modeling_helium.__name__)
    npu_autopatch.enable(models=["helium_next"])
    record = npu_autopatch.status()["helium_next"]
    assert record.state == "applied", record.reason
    assert "moe" not in record.kernels and record.kernels == ("rms_norm", "swiglu")


def test_a_custom_kernel_function(npu_stand_in, registry):
    registry.pop("helium", None)

    def build(stock, npu, on_error):
        def forward(self, hidden_states):
            return npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]

        return forward

    mine = Kernel("my_rms_norm", ("npu_rms_norm",), [Variant("mine", build)])  # no probe: trusted
    npu_autopatch.register("helium", targets=[Target(mine, "HeliumRMSNorm.forward")])
    npu_autopatch.enable()
    record = npu_autopatch.status()["helium"]
    assert record.kernels == ("my_rms_norm",), record
    norm = modeling_helium.HeliumRMSNorm(8)
    import torch

    before = npu_stand_in.calls["npu_rms_norm"]
    norm(torch.ones(2, 8))
    assert npu_stand_in.calls["npu_rms_norm"] == before + 1


def _plugin_site(tmp_path, body, entry_name="helium", value="acme_npu:MODEL"):
    """A real installed distribution, as importlib.metadata sees one: code plus .dist-info."""
    (tmp_path / "acme_npu").mkdir()
    (tmp_path / "acme_npu" / "__init__.py").write_text(textwrap.dedent(body))
    info = tmp_path / "acme_npu-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-npu\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[npu_autopatch.patches]\n{entry_name} = {value}\n")
    return f"{tmp_path}:{STAND_IN_SITE}"


PLUGIN = """
    from npu_autopatch import Model, Target
    MODEL = Model("helium", Target("rms_norm", "HeliumRMSNorm.forward"),
                  Target("swiglu", "HeliumMLP.forward"))
"""

LAZY = """
    import json, sys
    import transformers
    import npu_autopatch
    listed = npu_autopatch.status()["helium"].state
    loaded_early = "acme_npu" in sys.modules
    from transformers.models.helium import modeling_helium
    from transformers.models.qwen3 import modeling_qwen3
    report = npu_autopatch.status()
    npu_autopatch.disable()
    print(json.dumps([listed, loaded_early, report["helium"].as_dict(), report["qwen3"].state,
                      modeling_helium.HeliumRMSNorm.forward.__module__]))
"""


def test_an_installed_plugin_is_discovered_applied_lazily_and_removable(tmp_path):
    child = run_python(LAZY, NPU_AUTOPATCH="1", PYTHONPATH=_plugin_site(tmp_path, PLUGIN))
    assert child.returncode == 0, child.stderr
    listed, loaded_early, helium, qwen3, module_after_disable = json.loads(child.stdout)
    assert listed == "pending" and loaded_early is False
    assert helium["state"] == "applied" and helium["kernels"] == ["rms_norm", "swiglu"]
    assert qwen3 == "applied"
    assert module_after_disable == "transformers.models.helium.modeling_helium"


def test_the_cli_lists_an_installed_plugin(tmp_path):
    child = run_python(
        "import sys; from npu_autopatch.__main__ import main; sys.exit(main(['status', '--json']))",
        PYTHONPATH=_plugin_site(tmp_path, PLUGIN),
    )
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout)["models"]["helium"]["module"].endswith("modeling_helium")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            "raise ImportError('acme needs libfoo')",
            "plugin helium = acme_npu:MODEL failed to load: ImportError: acme needs libfoo",
        ),
        (
            PLUGIN.replace("HeliumMLP", "HeliumMlp"),
            "target HeliumMlp.forward not found in transformers.models.helium.modeling_helium",
        ),
        ("MODEL = 42", "plugin helium = acme_npu:MODEL failed to load: TypeError: acme_npu:MODEL is a int"),
    ],
    ids=["import-error", "bad-target", "not-a-model"],
)
def test_a_broken_plugin_is_one_model_failing(tmp_path, body, why):
    child = run_python(LAZY, NPU_AUTOPATCH="1", PYTHONPATH=_plugin_site(tmp_path, body))
    assert child.returncode == 0, child.stderr
    _listed, _early, helium, qwen3, module_after = json.loads(child.stdout)
    assert helium["state"] == "failed" and helium["reason"].startswith(why), helium
    assert qwen3 == "applied"
    assert module_after == "transformers.models.helium.modeling_helium"


TAKEOVER = """
import json, sys
from transformers.models.qwen3 import modeling_qwen3
import npu_autopatch
record = npu_autopatch.status()["qwen3"]
print(json.dumps([record.state, list(record.kernels), "acme_npu" in sys.modules,
                  modeling_qwen3.Qwen3RMSNorm.forward.__module__]))
"""


def test_a_plugin_cannot_take_over_a_built_in_model(tmp_path):
    plugin = PLUGIN.replace('"helium"', '"qwen3"').replace("Helium", "Qwen3")
    site = _plugin_site(tmp_path, plugin.replace("Qwen3MLP", "Qwen3Nothing"), entry_name="qwen3")
    child = run_python(TAKEOVER, NPU_AUTOPATCH="1", PYTHONPATH=site)
    assert child.returncode == 0, child.stderr
    assert "plugin entry point qwen3 = acme_npu:MODEL ignored: qwen3 is built in" in child.stderr
    state, kernels, plugin_loaded, norm_module = json.loads(child.stdout)
    # The built-in entry patched qwen3 (the plugin's broken target would have failed it), and
    # the plugin's code was never imported.
    assert [state, kernels, plugin_loaded] == ["applied", ["rms_norm", "swiglu", "rope"], False]
    assert norm_module == "npu_autopatch.kernels.norm"


REMOTE = """
    import json, os, pathlib, torch
    cache = pathlib.Path(os.environ["HF_MODULES_CACHE"]) / "transformers_modules" / "acme"
    cache.mkdir(parents=True)
    source = pathlib.Path(__import__("transformers.models.llama.modeling_llama", fromlist=["x"]).__file__)
    (cache / "modeling_acme.py").write_text(
        "import torch\\nfrom torch import nn\\n\\n"
        "class AcmeRMSNorm(nn.Module):\\n"
        "    def __init__(self, hidden_size, eps=1e-6):\\n"
        "        super().__init__()\\n"
        "        self.weight = nn.Parameter(torch.ones(hidden_size))\\n"
        "        self.variance_epsilon = eps\\n\\n"
        "    def forward(self, hidden_states):\\n"
        "        input_dtype = hidden_states.dtype\\n"
        "        hidden_states = hidden_states.to(torch.float32)\\n"
        "        variance = hidden_states.pow(2).mean(-1, keepdim=True)\\n"
        "        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)\\n"
        "        return self.weight * hidden_states.to(input_dtype)\\n")
    import npu_autopatch
    from npu_autopatch import Target
    npu_autopatch.register("acme", module="transformers_modules.*.modeling_acme",
                           targets=[Target("rms_norm", "AcmeRMSNorm.forward")])
    npu_autopatch.enable()
    from transformers.dynamic_module_utils import get_class_in_module
    cls = get_class_in_module("AcmeRMSNorm", "transformers_modules/acme/modeling_acme.py")
    import torch_npu
    x = torch.randn(2, 8)
    before = torch_npu.calls["npu_rms_norm"]
    patched = cls(8)(x)
    rec = npu_autopatch.status()["acme"]
    npu_autopatch.disable()
    stock = cls(8)(x)
    print(json.dumps([rec.state, rec.targets, torch_npu.calls["npu_rms_norm"] - before,
                      (patched - stock).abs().max().item()]))
"""


def test_a_trust_remote_code_module_is_patched_by_pattern(tmp_path):
    child = run_python(REMOTE, HF_MODULES_CACHE=str(tmp_path), PYTHONPATH=str(STAND_IN_SITE))
    assert child.returncode == 0, child.stderr
    state, targets, calls, error = json.loads(child.stdout)
    assert state == "applied"
    assert targets == ["transformers_modules.acme.modeling_acme:AcmeRMSNorm.forward"]
    assert calls == 1 and error < 1e-6


def test_model_declarations_are_checked():
    with pytest.raises(ValueError, match="unknown kernel 'flash'"):
        Target("flash", "X.forward")
    with pytest.raises(ValueError, match="needs at least one path"):
        Target("rms_norm")
    with pytest.raises(ValueError, match="no targets given"):
        npu_autopatch.register(Model("nothing"))
