"""The reference ops live with the kernels: the probes build on them, never on the testing stand-in."""

from .conftest import run_python

# A torch_npu made of the reference math alone: the child must not import npu_autopatch.testing to
# get one, so that what is proven is the patching path, not the test tools.
PATCH_WITH_PROBES = """
import importlib.machinery, sys, types
import torch
from npu_autopatch.kernels import _reference

torch_npu = types.ModuleType("torch_npu")
torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
torch_npu.__version__ = "2.14.0"  # a release with every requirement the kernels declare
for name in dir(_reference):
    if name.startswith("npu_"):
        setattr(torch_npu, name, getattr(_reference, name))
torch_npu.npu_fusion_attention = None  # transformers' NPU flash-attention integration imports it
torch_npu.npu = types.SimpleNamespace(is_available=lambda: True)
sys.modules["torch_npu"] = torch_npu
torch.npu = torch_npu.npu

import npu_autopatch
npu_autopatch.enable(models=["qwen3", "qwen3_moe"])
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe
status = npu_autopatch.status()
print(status["qwen3"].state, status["qwen3"].kernels)
print(status["qwen3_moe"].state, status["qwen3_moe"].kernels)
print("testing imported:", [m for m in sys.modules if m.startswith("npu_autopatch.testing")])
"""


def test_patching_with_probes_never_imports_the_testing_stand_in():
    child = run_python(PATCH_WITH_PROBES)
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert lines[0] == "applied ('rms_norm', 'swiglu', 'rope')", lines
    assert lines[1] == "applied ('rms_norm', 'swiglu', 'rope', 'moe')", lines
    assert lines[2] == "testing imported: []"
