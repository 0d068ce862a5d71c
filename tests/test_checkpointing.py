"""Gradient checkpointing trains patched models as stock (issue 15).

Non-reentrant checkpointing stops each recomputation by raising torch's own exception through
our replacements; a fallback that took it for a fused-op failure demoted the target and then
crashed in checkpoint's assertion. Each form runs in its own process: a demotion is
process-wide, so one form must not mask the other. The models of every selected case share that
process (one per form, not one per form and case).
"""

import importlib
import json

import pytest
import torch
import transformers

from npu_autopatch._failures import is_op_failure
from npu_autopatch.models import MODEL_TYPES

from .conftest import STAND_IN_SITE, run_python, selected_values
from .test_parity_models import present

# Every table model (both majors: the ones this transformers has), each step stock, then the
# same weights and batch patched twice: the loss, every gradient, the fused ops per step.
CHILD = """
import collections, json, sys, torch
import npu_autopatch
from npu_autopatch.testing import stand_in
from npu_autopatch.testing.parity import compare, forward_backward, model_batch, report_of, tiny_model

reentrant = {reentrant!r}
results = {{}}
with stand_in() as npu:
    for model_type in {models!r}:
        model = tiny_model(model_type)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": reentrant}})
        model.train()
        input_ids, labels, inputs = model_batch(model, 1)

        def step():  # parity's step seeds the RNG: the same dropout masks stock and patched
            return forward_backward(model, input_ids, labels, **inputs)

        try:
            stock = step()
        except Exception as exc:  # transformers' own code cannot train it so: nothing to compare
            results[model_type] = {{"stock_error": f"{{type(exc).__name__}}: {{exc}}"[:300]}}
            continue
        npu_autopatch.enable(models=[model_type])
        ops, patched = [], None
        for _ in range(2):
            before = collections.Counter(npu.calls)
            patched = step()
            ops.append(dict(collections.Counter(npu.calls) - before))
        record = npu_autopatch.status()[model_type]
        npu_autopatch.disable()
        report = compare(report_of(record, torch.float32), stock, patched)
        results[model_type] = {{
            "state": report.state, "reason": report.reason, "ops": ops,
            "over": list(report.over_tolerance), "missing": list(report.missing_grads),
            "error": max(report.logits_error, report.grad_error),
        }}
print(json.dumps(results))
"""

MODELS = sorted(m for m in MODEL_TYPES if present(m))

# transformers 4.57's GLM-4V cannot train with checkpointing at all: with the cache off, its text
# model expands the 3-D mRoPE position ids as 2-D ones. Nothing of ours to compare there.
STOCK_CANNOT = {"glm4v", "glm4v_moe"} if transformers.__version__.startswith("4.") else set()


# Two of the models that crashed, their layers ending in a replacement (the routed experts, a
# closing norm): the default selection runs them; CI's full matrix runs them and every other table
# model (not those two again: CI's time).
ENDING_IN_OURS = [m for m in ("glm4", "qwen3_moe") if m in MODELS]
REST_OF_TABLE = [m for m in MODELS if m not in ENDING_IN_OURS]


@pytest.fixture(scope="module")
def trained(request):
    """{reentrant: (the child's results, its stderr)}: one child per form, on every model the selected
    cases of this module ask for (CI's full matrix: the whole table in one child per form)."""
    models = selected_values(request, "models")
    done = {}

    def train(reentrant):
        if reentrant not in done:
            result = run_python(
                CHILD.format(reentrant=reentrant, models=models), timeout=900, PYTHONPATH=str(STAND_IN_SITE)
            )
            assert result.returncode == 0, result.stderr[-3000:]
            done[reentrant] = json.loads(result.stdout.strip().splitlines()[-1]), result.stderr
        return done[reentrant]

    return train


@pytest.mark.parametrize(
    "models",
    [
        pytest.param(ENDING_IN_OURS, id="crashed"),
        pytest.param(REST_OF_TABLE, id="rest-of-table", marks=pytest.mark.full),
    ],
)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_every_table_model_trains_with_checkpointing_as_stock(reentrant, models, trained):
    every, stderr = trained(reentrant)
    assert "taken out of" not in stderr, stderr[-3000:]  # no demotion warning (it names the model)
    results = {model_type: every[model_type] for model_type in models}
    stock_errors = {m: got["stock_error"] for m, got in results.items() if "stock_error" in got}
    assert set(stock_errors) == STOCK_CANNOT & set(models), stock_errors
    assert all("expand" in error for error in stock_errors.values()), stock_errors
    for model_type, got in results.items():
        if model_type in STOCK_CANNOT:
            continue
        assert got["state"] == "applied", (model_type, got["reason"])
        first, second = got["ops"]
        assert first and first == second, (model_type, got["ops"])  # the fused ops ran both steps
        assert not got["missing"] and not got["over"], (model_type, got)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.utils.checkpoint._StopRecomputationError(),
        lambda: torch.utils.checkpoint.CheckpointError("recomputed a different graph"),
        lambda: importlib.import_module("torch._dynamo.exc").Unsupported("graph break"),
        lambda: torch.OutOfMemoryError("NPU out of memory. Tried to allocate 2.00 GiB"),
        lambda: RuntimeError("NPU out of memory. Tried to allocate 138.00 MiB"),
        lambda: StopIteration(),
    ],
    ids=["stop-recomputation", "checkpoint-error", "dynamo", "torch-oom", "npu-oom-runtime-error", "stop"],
)
def test_torch_control_flow_and_out_of_memory_are_not_op_failures(make):
    assert not is_op_failure(make())


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("EZ1001: unsupported shape"), ValueError("group_list"), TypeError("bad argument")],
)
def test_a_fused_op_error_is_an_op_failure(exc):
    assert is_op_failure(exc)


OOM_KERNEL = """
import importlib
import json
import torch
import npu_autopatch
from npu_autopatch import Kernel, Target, Variant, register

def build(stock, npu, on_error):
    def forward(self, hidden_states):
        try:
            raise torch.OutOfMemoryError("NPU out of memory. Tried to allocate 64.00 GiB")
        except Exception as exc:
            on_error(exc, hidden_states)
            return stock(self, hidden_states)
    return forward

oom = Kernel("oom_norm", ("npu_rms_norm",), [Variant("v", build)])
register("oom", module="transformers.models.qwen3.modeling_qwen3",
         targets=[Target(oom, "Qwen3RMSNorm.forward")])
from transformers.models.qwen3 import modeling_qwen3
norm = modeling_qwen3.Qwen3RMSNorm(8)
try:
    norm(torch.randn(2, 8))
    raised = None
except torch.OutOfMemoryError as exc:
    raised = str(exc)
print(json.dumps({"raised": raised, "state": str(npu_autopatch.status()["oom"].state)}))
"""


def test_out_of_memory_reaches_the_caller_and_keeps_the_kernel():
    result = run_python(
        OOM_KERNEL, NPU_AUTOPATCH="1", NPU_AUTOPATCH_EXCLUDE="qwen3", PYTHONPATH=str(STAND_IN_SITE)
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == {"raised": "NPU out of memory. Tried to allocate 64.00 GiB", "state": "applied"}, got
    assert "taken out of" not in result.stderr
