"""Issue 10 item 1: patching is the same whatever torch state the first import happens in.

verl builds its models inside ``accelerate.init_empty_weights()`` on every rank but 0, FSDP
users inside ``torch.device("meta")``, others after ``torch.set_default_dtype(bf16)`` or
under autocast. The probes must not care, and must leave the user's state as they found it.
"""

import contextlib
import json

import pytest
import torch
from accelerate import init_empty_weights

# Imported before enable(): enable() then patches them at once, inside the context.
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.qwen3 import modeling_qwen3  # noqa: F401
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

import npu_autopatch
from npu_autopatch.models import MODELS

from .conftest import STAND_IN_SITE, child_result, run_python

CHECKED = ("qwen3", "llama", "qwen3_moe", "deepseek_v3")


@contextlib.contextmanager
def default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def default_device(device):
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


@contextlib.contextmanager
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


CONTEXTS = {
    "meta-device": lambda: torch.device("meta"),
    "default-device-meta": lambda: default_device("meta"),
    "init_empty_weights": init_empty_weights,
    "init_empty_weights-buffers": lambda: init_empty_weights(include_buffers=True),
    "default-dtype-bf16": lambda: default_dtype(torch.bfloat16),
    "default-dtype-fp64": lambda: default_dtype(torch.float64),
    "autocast-cpu": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "deterministic": deterministic,
}


def user_state():
    return {
        "rng": torch.get_rng_state(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def same_state(before, after):
    return torch.equal(before.pop("rng"), after.pop("rng")) and before == after


@pytest.fixture
def two_threads():
    """Two intra-op threads whatever the test run has (CI: OMP_NUM_THREADS=1): the probes run on one
    and must give the user's count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("context", list(CONTEXTS), ids=list(CONTEXTS))
def test_every_torch_context_patches_every_target_and_leaves_the_state_alone(
    context, npu_stand_in, two_threads
):
    with CONTEXTS[context]():
        before = user_state()
        npu_autopatch.enable(models=list(CHECKED), loss=True)  # every target, the opt-in loss too
        after = user_state()
    assert same_state(before, after), (before, after)
    report = npu_autopatch.status()
    for model_type in CHECKED:
        record = report[model_type]
        assert record.state == "applied", (context, model_type, record.reason)
        assert record.kernels == MODELS[model_type].kernels, (context, model_type, record.kernels)
        assert record.reason is None, (context, model_type, record.reason)


LAZY = """
import json, torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM
import npu_autopatch
config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
torch.set_default_dtype(torch.bfloat16)
with init_empty_weights():
    model = AutoModelForCausalLM.from_config(config)  # the first import of modeling_qwen3
record = npu_autopatch.status()["qwen3"]
print(json.dumps([record.state, list(record.kernels), record.reason, str(torch.get_default_dtype()),
                  str(next(model.parameters()).device)]))
"""


def test_a_model_first_built_inside_init_empty_weights_in_bf16_is_fully_patched():
    # What verl does on every rank but 0, through the import hook, in a fresh interpreter.
    child = run_python(LAZY, NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE))
    assert child.returncode == 0, child.stderr
    state, kernels, reason, dtype, device = json.loads(child.stdout.splitlines()[-1])
    assert [state, kernels, reason] == ["applied", ["rms_norm", "swiglu", "rope"], None]
    assert dtype == "torch.bfloat16" and device == "meta"  # the user's context did its job


# verl's other ranks, on the default attention: the model is built on meta (the route decides then),
# its weights are assigned after, and it must run the fused attention and match eager on them.
ROUTED = r"""
import copy, json, torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM
import npu_autopatch
from npu_autopatch.testing import stand_in

config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
with stand_in() as npu:
    npu_autopatch.enable()  # nothing asked of the attention: the default path
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    on_meta = str(next(model.parameters()).device)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    model.load_state_dict(eager.state_dict(), assign=True)
    ids = torch.randint(1, 64, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    before = npu.calls["npu_fusion_attention"]
    got = model.eval()(ids, attention_mask=mask).logits[mask.bool()]
    fused = npu.calls["npu_fusion_attention"] - before
    want = eager(ids, attention_mask=mask).logits[mask.bool()]
print("RESULT" + json.dumps({"on_meta": on_meta, "implementation": model.config._attn_implementation,
                             "fused": fused, "error": ((got - want).abs().max() / want.abs().max()).item()}))
"""


def test_a_model_built_inside_init_empty_weights_takes_the_default_route_and_matches_eager():
    found = child_result(ROUTED)
    assert found["on_meta"] == "meta" and found["implementation"] == "flash_attention_2", found
    assert found["fused"] > 0 and found["error"] < 1e-4, found  # fp32, left-padded: fused and exact
