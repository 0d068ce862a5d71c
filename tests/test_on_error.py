"""The patcher's side of contracts C1 (a fused op raising at run time) and C2 (kernel requirements)."""

import json

import pytest
import torch
from transformers.models.llama import modeling_llama  # noqa: F401 - imported: enable() patches it
from transformers.models.mistral import modeling_mistral  # noqa: F401
from transformers.models.qwen3 import modeling_qwen3

import npu_autopatch
from npu_autopatch import Kernel, Variant
from npu_autopatch.kernels import KERNELS

from .conftest import STAND_IN_SITE, run_python

QWEN3 = modeling_qwen3.__name__

# A registered kernel that follows contract C1: the fused path in a try, on_error, then stock.
RAISING_KERNEL = """
import json, logging, sys, threading
import torch
import npu_autopatch
from npu_autopatch import Kernel, Target, Variant, register

messages = []
class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("npu_autopatch").addHandler(Collect())

def build(stock, npu, on_error):
    def forward(self, hidden_states):
        try:
            if hidden_states.shape[-1] == 7:  # a device rule nobody knew
                raise RuntimeError("EZ1001: unsupported shape")
            return npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]
        except Exception as exc:
            on_error(exc, hidden_states)
            return stock(self, hidden_states)
    return forward

fragile = Kernel("fragile_norm", ("npu_rms_norm",), [Variant("v", build)])
register("fragile", module="transformers.models.qwen3.modeling_qwen3",
         targets=[Target(fragile, "Qwen3RMSNorm.forward"), Target("swiglu", "Qwen3MLP.forward")])
from transformers.models.qwen3 import modeling_qwen3  # patched by the import hook
cls = modeling_qwen3.Qwen3RMSNorm
patched = cls.__dict__["forward"]
stock = patched.__wrapped__
norm = cls(7)
x = torch.randn(2, 7)
results = []
barrier = threading.Barrier(8)
def call():  # eight threads inside the replacement at once, each meeting the failing op
    barrier.wait()
    results.append(torch.equal(patched(norm, x), stock(norm, x)))
threads = [threading.Thread(target=call) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
ok = len(results) == 8 and all(results)
record = npu_autopatch.status()["fragile"]
print(json.dumps({
    "stock_result": ok,
    "stock_back": cls.__dict__["forward"] is stock,
    "state": record.state, "code": record.code, "reason": record.reason, "stock": record.stock,
    "kernels": list(record.kernels),
    "warnings": [m for m in messages if "fragile" in m],
}))
"""


def test_a_fused_op_raising_at_run_time_demotes_that_target_once():
    # qwen3 itself is excluded: its own rms_norm kernel would hold the shared class first.
    child = run_python(
        RAISING_KERNEL, NPU_AUTOPATCH="1", NPU_AUTOPATCH_EXCLUDE="qwen3", PYTHONPATH=str(STAND_IN_SITE)
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.splitlines()[-1])
    target = f"{QWEN3}:Qwen3RMSNorm.forward"
    assert out["stock_result"] is True  # the failing call returned the stock result
    assert out["stock_back"] is True  # the stock object is back for the rest of the process
    assert (out["state"], out["code"]) == ("partial", "op-failed")
    assert out["stock"] == {target: "op-failed"}
    assert out["kernels"] == ["swiglu"]
    for text in (target, "(2, 7) torch.float32", "EZ1001: unsupported shape"):
        assert text in out["reason"], (text, out["reason"])
    assert len(out["warnings"]) == 1, out["warnings"]  # one warning, though eight calls failed
    warning = out["warnings"][0]
    assert "fragile" in warning and target in warning and "(2, 7)" in warning and "EZ1001" in warning


def test_a_kernel_whose_requirement_fails_leaves_its_targets_stock(npu_stand_in, monkeypatch):
    asked = []

    def too_old(npu):
        asked.append(npu)
        return "npu_swiglu needs torch_npu >= 9.9.9 (installed: 0.0.0)"

    monkeypatch.setattr(KERNELS["swiglu"], "requires", too_old)
    mlp = modeling_qwen3.Qwen3MLP.__dict__["forward"]
    npu_autopatch.enable(models=["qwen3", "llama", "mistral"])
    report = npu_autopatch.status()
    assert len(asked) == 1  # once per kernel per enable(), not per model
    for model_type in ("qwen3", "llama", "mistral"):
        record = report[model_type]
        assert (record.state, record.code) == ("partial", "kernel-unsupported"), (model_type, record)
        assert record.kernels == ("rms_norm", "rope")
        assert "npu_swiglu needs torch_npu >= 9.9.9" in record.reason
    assert modeling_qwen3.Qwen3MLP.__dict__["forward"] is mlp


def test_a_variant_whose_requirement_fails_is_passed_over(npu_stand_in, monkeypatch):
    norm = KERNELS["rms_norm"]
    llama, *others = norm.variants
    gated = Variant(llama.name, llama.build, llama.probe, requires=lambda npu: "llama variant needs X")
    monkeypatch.setattr(norm, "variants", (gated, *others))
    npu_autopatch.enable(models=["qwen3"])
    record = npu_autopatch.status()["qwen3"]
    assert record.state == "partial" and record.code == "kernel-unsupported"
    assert "llama variant needs X" in record.reason


def test_a_raising_on_error_callers_probe_refuses_the_candidate(npu_stand_in):
    # choose_variant's on_error re-raises: a candidate whose fused op raises is refused.
    from npu_autopatch.kernels import choose_variant

    def build(stock, npu, on_error):
        def forward(self, hidden_states):
            try:
                raise RuntimeError("fused op broke")
            except Exception as exc:
                on_error(exc, hidden_states)
                return stock(self, hidden_states)

        return forward

    probe = KERNELS["rms_norm"].variants[0].probe
    kernel = Kernel("k", ("npu_rms_norm",), [Variant("v", build, probe)])
    with pytest.raises(RuntimeError, match="fused op broke"):
        choose_variant(kernel, modeling_qwen3.Qwen3RMSNorm.forward)
    assert torch.get_default_dtype() == torch.float32
