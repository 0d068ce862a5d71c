"""verl's Ulysses sequence parallelism with npu-autopatch on (issue 41): 2 gloo ranks, verl 0.9.1's own
``apply_monkey_patch(model, ulysses_sp_size=2)``, a packed row whose second document straddles the
ranks' boundary.

verl replaces ``transformers.integrations.flash_attention._flash_attention_forward`` with its
``_ulysses_flash_attention_forward``: an all-to-all before the attention (each rank then holds every
token of half the heads) and one after. Every FA2 call that transformers' ``flash_attention_forward``
makes goes through it; sdpa does not. In verl's order (the model built, with npu-autopatch already on
at import, then verl's patch), on the CPU stand-in, one torchrun launch runs each scenario:

- ``verl alone``: explicit FA2 without npu-autopatch (transformers' stock Ascend functions);
- ``stock default``: no attn_implementation, without npu-autopatch: sdpa, which skips verl's all-to-all,
  so each rank attends over its own half only (the control: it is off);
- ``explicit FA2`` and ``default route``: the same with npu-autopatch enabled (the route sends the
  model that asked for nothing to FA2, and so through Ulysses).

Each scenario's loss and every gradient (summed over the ranks, as FSDP reduces them, over the sp size)
are compared with the same model run on the whole row in one rank (no sequence parallelism) and with
verl alone; the all-to-alls are counted (``torch.distributed.all_to_all``, which verl's ``SeqAllToAll``
calls), and so are the fused op's calls.

verl's files come from the verl 0.9.1 wheel (``tests/_wheels.py``, their hashes checked, never
committed): ``monkey_patch.py``, ``ulysses.py`` and ``transformers_compat.py`` as they ship. One
stand-in: ``verl/utils/import_utils.py`` says TRL is not installed. verl 0.9.1 patches TRL's value-head
model when TRL is importable, from a name the TRL installed here no longer exports (an ImportError
before Ulysses is set up); that patch has nothing to do with Ulysses.
"""

import json

import pytest

from ._wheels import package_site, wheel, wheel_files
from .conftest import FULL, ROOT, child_env
from .test_torchrun import two_ranks

VERL = "verl==0.9.1"
FILES = {  # path in the wheel: its sha256
    "verl/models/transformers/monkey_patch.py": (
        "13e502a0a7b1470fe37bc98a24f221719e312b3146c6fc9bac91a738f80d2783"
    ),
    "verl/utils/ulysses.py": "e6df6bcf1889b79beb9566e01dde0c274a498276314e966231500b219d13104a",
    "verl/utils/transformers_compat.py": "a275293fd133cbc09646b7027dbf40ff6fd3fa62dbc3f88203c58a21c749b251",
}
IMPORT_UTILS = '''"""Stand-in for verl/utils/import_utils.py: only what monkey_patch.py imports from it."""


def is_trl_available():
    return False  # verl's TRL value-head patch imports a name today's TRL no longer has
'''
LENGTHS = (5, 9, 6)  # 20 tokens, 10 per rank: the second document runs from token 5 to 13

WORKER = r"""
import datetime, json
import torch
import torch.distributed as dist

LENGTHS = LENGTHS_JSON
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()

from npu_autopatch.testing import stand_in, tiny

ALL_TO_ALL = [0]
_all_to_all = dist.all_to_all


def counted_all_to_all(*args, **kwargs):  # what verl's SeqAllToAll calls, forward and backward
    ALL_TO_ALL[0] += 1
    return _all_to_all(*args, **kwargs)


dist.all_to_all = counted_all_to_all

with stand_in() as npu:
    import npu_autopatch
    from transformers import AutoModelForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import ulysses

    total = sum(LENGTHS)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (1, total), generator=gen)
    labels = torch.randint(1, 100, (1, total), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]

    def step(model, sequence_parallel):
        # verl's rmpad step: pad and slice the row per rank, gather the logits, one loss on every rank;
        # the gradients summed over the ranks and divided by their number, as FSDP's reduction does
        ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD if sequence_parallel else None)
        if sequence_parallel:
            local_ids, local_positions, pad = ulysses.ulysses_pad_and_slice_inputs(ids, positions, world)
        else:
            local_ids, local_positions, pad = ids, positions, 0
        before_a2a, before = ALL_TO_ALL[0], npu.calls["npu_fusion_attention"]
        logits = model(input_ids=local_ids, position_ids=local_positions, use_cache=False).logits
        if sequence_parallel:
            logits = ulysses.gather_outputs_and_unpad(logits, gather_dim=1, unpad_dim=1, padding_size=pad)
        loss = torch.nn.functional.cross_entropy(logits[0], labels[0])
        loss.backward()
        grads = {}
        for name, parameter in model.named_parameters():
            grad = parameter.grad.clone()
            if sequence_parallel:
                dist.all_reduce(grad)
                grad /= world
            grads[name] = grad
        model.zero_grad(set_to_none=True)
        fused = npu.calls["npu_fusion_attention"] - before
        counts = {"all_to_all": ALL_TO_ALL[0] - before_a2a, "fused": fused}
        return loss.detach(), grads, counts

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    def scenario(attention):
        torch.manual_seed(0)
        kwargs = {} if attention is None else {"attn_implementation": attention}
        model = AutoModelForCausalLM.from_config(tiny.tiny_config("qwen3"), **kwargs)
        apply_monkey_patch(model, ulysses_sp_size=world)  # verl's order: after the model is built
        loss, grads, counts = step(model, sequence_parallel=True)
        whole_loss, whole_grads, _ = step(model, sequence_parallel=False)
        return {
            "implementation": model.config._attn_implementation,
            "counts": counts,
            "vs whole row": max([rel(loss, whole_loss)] + [rel(g, whole_grads[n]) for n, g in grads.items()]),
        }, (loss, grads)

    found, runs = {}, {}
    found["verl alone"], runs["verl alone"] = scenario("flash_attention_2")
    found["stock default"], runs["stock default"] = scenario(None)
    npu_autopatch.enable()  # as NPU_AUTOPATCH=1 at interpreter start: before verl builds its models
    found["explicit FA2"], runs["explicit FA2"] = scenario("flash_attention_2")
    found["default route"], runs["default route"] = scenario(None)
    loss0, grads0 = runs["verl alone"]
    for name, (loss, grads) in runs.items():
        found[name]["vs verl alone"] = max([rel(loss, loss0)] + [rel(g, grads0[n]) for n, g in grads.items()])
    found["state"] = {m: str(npu_autopatch.status()[m].state) for m in ("qwen3", "npu_flash_attention")}

gathered = [None] * world
dist.all_gather_object(gathered, found)
if rank == 0:
    print("RESULT " + json.dumps(gathered), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def verl_ulysses_site(tmp_path_factory):
    """A directory for PYTHONPATH with verl 0.9.1's Ulysses files and the one stand-in."""
    site = package_site(
        tmp_path_factory.mktemp("verl-ulysses"), wheel_files(wheel(tmp_path_factory, VERL), FILES)
    )
    (site / "verl" / "utils" / "import_utils.py").write_text(IMPORT_UTILS)
    return site


@FULL
def test_ulysses_runs_through_the_patched_flash_path_in_verls_order(verl_ulysses_site, tmp_path):
    env = child_env(
        PYTHONPATH=f"{verl_ulysses_site}:{ROOT / 'src'}", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"
    )
    run = two_ranks(WORKER.replace("LENGTHS_JSON", json.dumps(LENGTHS)), tmp_path, env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    rank0, rank1 = json.loads(
        next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:]
    )
    assert rank0["state"] == {"qwen3": "applied", "npu_flash_attention": "applied"}, rank0
    for name in ("verl alone", "explicit FA2", "default route"):
        for found in (rank0, rank1):
            case = found[name]
            assert case["implementation"] == "flash_attention_2", (name, case)
            # two layers: 4 all-to-alls each forward (q, k, v, the output), 4 back
            assert case["counts"]["all_to_all"] == 16, (name, case)
            assert case["counts"]["fused"] > 0, (name, case)
            assert case["vs whole row"] <= 1e-4, (name, case)  # the straddling document kept whole
            assert case["vs verl alone"] <= 1e-4, (name, case)
    control = rank0["stock default"]
    assert control["implementation"] == "sdpa" and control["counts"]["all_to_all"] == 0, control
    assert control["vs whole row"] > 1e-3, control  # each rank attended over its own half only
