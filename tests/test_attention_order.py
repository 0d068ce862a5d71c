"""The attention kernel takes effect whenever enable() and disable() come, not only before the first forward.

transformers loads the NPU flash-attention functions on the first flash-attention model or forward and
keeps them (5.x for the process, 4.57 until the next model is built), with its keyword filter built from
their signature. A stock FA2 run first, then enable(), as a notebook or a comparison script does, must
run the patched functions on the same model and report it; disable() must bring stock back the same way.
In a fresh interpreter: transformers caches whether it runs on an NPU.
"""

import json
import sys
import textwrap

import torch

from .conftest import child_env, warm_run

CHILD = textwrap.dedent(
    """
    import copy, json
    import torch
    from npu_autopatch.testing import stand_in, tiny

    with stand_in() as npu:
        import npu_autopatch
        from transformers import AutoModelForCausalLM

        cfg = tiny.tiny_config("mistral", sliding_window=4)
        torch.manual_seed(0)
        fa = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2")
        eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
        eager.load_state_dict(fa.state_dict())
        ids = torch.randint(1, cfg.vocab_size, (2, 10))

        def error():
            with torch.no_grad():
                a, b = fa(ids).logits, eager(ids).logits
            return ((a - b).abs().max() / b.abs().max()).item()

        out = {"stock": error()}
        npu_autopatch.enable(models=["npu_flash_attention"])
        out["enabled"], out["state"] = error(), npu_autopatch.status()["npu_flash_attention"].state.value
        npu_autopatch.disable()
        out["disabled"] = error()
        out["fused_calls"] = npu.calls["npu_fusion_attention"]
    print("RESULT" + json.dumps(out))
    """
)


def test_enable_and_disable_after_the_first_flash_attention_forward_reach_the_model():
    result = warm_run(
        [sys.executable, "-c", CHILD],
        env=child_env(OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    found = json.loads(result.stdout.split("RESULT", 1)[1])
    assert found["state"] == "applied"
    assert found["stock"] > 1e-2, found  # stock drops the window: the control
    torch.testing.assert_close(found["enabled"], 0.0, atol=1e-5, rtol=0)
    assert found["disabled"] == found["stock"], found  # stock again, to the bit
    assert found["fused_calls"] == 6, found  # two layers, three forwards, every one fused
