"""verl's fused log-probs (verl 0.9.1's real ``torch_functional.py``) computed by ours (issue 42).

verl's ``FusedLinearForPPO.forward`` with ``impl_backend="torch"`` runs ``linear_logprobs``
(integrations/verl_logprobs.py): the same log-probs, entropy and gradients as verl's own path within
fp32 and bf16 rounding, for its 3-D hidden states, a temperature and int32 or int64 ids; Liger's
backend and inputs verl's code refuses run verl's, counted stock. ``forward_with_torch_backend``
(verl's ``dense_common.py``) on tiny qwen3 and qwen3_moe, with the switch on and off, in fresh
interpreters: the same values, ours counted fused, verl's own with the switch off.

verl's files come from the verl 0.9.1 wheel (``tests/_wheels.py``, hashes checked): the two below,
nothing else. ``torch_functional.py`` imports Liger and flash-attn only if present (neither is
here: its torch fallback runs, as on Ascend); ``dense_common.py`` imports only torch and
transformers at module level and verl's ``torch_functional`` inside the function.
"""

import importlib.util
import json

import pytest
import torch

from npu_autopatch._types import Calls
from npu_autopatch.integrations import verl_logprobs

from ._wheels import package_site, wheel, wheel_files
from .conftest import STAND_IN_SITE, run_python

VERL = "verl==0.9.1"
TORCH_FUNCTIONAL = "verl/utils/experimental/torch_functional.py"
DENSE_COMMON = "verl/models/transformers/dense_common.py"
HASHES = {
    TORCH_FUNCTIONAL: "812d6db39676454f6bdb4881eedc9eceeef28c8e08a1b505bb54346c7b6a7485",
    DENSE_COMMON: "9a26fd6e64acdf1a780be1ba0304b2808364611292628da9847ff6b6d31f1e07",
}
TARGET = "verl.utils.experimental.torch_functional:FusedLinearForPPO.forward"
# (rtol, atol as a share of the tensor's largest value). fp32: the same math, other rounding orders;
# bf16: a couple of units in the last place (verl rounds the weight's gradient per 512-row chunk and
# divides the logits and their gradient by the temperature in bf16; ours rounds each once).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2**-6)}


@pytest.fixture(scope="module")
def verl_site(tmp_path_factory):
    """A directory for PYTHONPATH holding verl 0.9.1's two files, under packages of empty ``__init__``."""
    files = wheel_files(wheel(tmp_path_factory, VERL), HASHES)
    return package_site(tmp_path_factory.mktemp("verl-site"), files)


@pytest.fixture(scope="module")
def verl_functional(verl_site):
    """verl's torch_functional module, loaded under a name of its own (no hook of ours sees it)."""
    spec = importlib.util.spec_from_file_location("verl_torch_functional_0_9_1", verl_site / TORCH_FUNCTIONAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _on_error():
    def on_error(exc, *tensors):
        raise AssertionError(f"ours raised: {exc!r}")

    on_error.calls = Calls()
    return on_error


def _ours(functional):
    """verl's forward and our replacement of it, with the Calls it counts into."""
    stock = functional.FusedLinearForPPO.forward
    on_error = _on_error()
    return stock, verl_logprobs.build(stock, None, on_error), on_error.calls


def _inputs(dtype, shape, vocab=301, width=24, id_dtype=torch.int64):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(*shape, width, generator=gen).to(dtype)
    weight = (torch.randn(vocab, width, generator=gen) / width**0.5).to(dtype)
    ids = torch.randint(0, vocab, shape, generator=gen).to(id_dtype)
    upstream = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return hidden, weight, ids, upstream


def _step(forward, module, hidden, weight, ids, temperature, upstream):
    """(log-probs, entropy, hidden's gradient, weight's gradient) of a PPO-like loss on ``forward``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, entropy = forward(module, h, w, ids, temperature)
    loss = (upstream[0] * logprobs).sum() + 0.01 * (upstream[1] * entropy).sum()
    return [logprobs, entropy, *torch.autograd.grad(loss, (h, w))]


def _close(got, expected, dtype):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        rtol, atol = TOLERANCE[dtype]
        torch.testing.assert_close(g.float(), e.float(), rtol=rtol, atol=atol * e.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 37), (45,), (1, 700)], ids=["batch", "rows", "packed-over-a-chunk"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_ours_computes_verls_values_and_gradients(verl_functional, dtype, shape, temperature, id_dtype):
    """verl's 3-D hidden states (a batch, the packed [1, tokens, H] of remove-padding, longer than its
    512-row chunk) and flat rows: log-probs (fp32), entropy (the hidden states' dtype) and both
    gradients equal verl's own path within rounding; each call counted fused."""
    stock, ours, calls = _ours(verl_functional)
    module = verl_functional.FusedLinearForPPO(impl_backend="torch")
    hidden, weight, ids, upstream = _inputs(dtype, shape, id_dtype=id_dtype)
    expected = _step(stock, module, hidden, weight, ids, temperature, upstream)
    got = _step(ours, module, hidden, weight, ids, temperature, upstream)
    _close(got, expected, dtype)
    assert (calls.fused, calls.stock) == (1, {})


def test_under_autocast_ours_computes_verls_values(verl_functional):
    """verl's actor runs its forward under bf16 autocast with fp32 parameters: verl's matmul then runs
    in bf16 (its entropy rounded to bf16, stored in the fp32 hidden states' dtype), as ours does."""
    stock, ours, calls = _ours(verl_functional)
    module = verl_functional.FusedLinearForPPO(impl_backend="torch")
    hidden, weight, ids, upstream = _inputs(torch.float32, (2, 37))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _step(stock, module, hidden, weight, ids, 0.6, upstream)
        got = _step(ours, module, hidden, weight, ids, 0.6, upstream)
    _close(got, expected, torch.bfloat16)
    assert calls.fused == 1


def test_the_output_verls_loss_leaves_out_gets_no_gradient_from_it(verl_functional):
    """verl's Function does not materialise a missing output's gradient; ours gets zeros for it: the
    same gradients when the loss uses the log-probs only."""
    stock, ours, _calls = _ours(verl_functional)
    module = verl_functional.FusedLinearForPPO(impl_backend="torch")
    hidden, weight, ids, _ = _inputs(torch.float32, (2, 37))
    grads = []
    for forward in (stock, ours):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs, _entropy = forward(module, h, w, ids, 0.6)
        grads.append(torch.autograd.grad(logprobs.sum(), (h, w)))
    _close(grads[1], grads[0], torch.float32)


def test_ligers_backend_and_what_verl_refuses_run_verls_code_counted_stock(verl_functional, monkeypatch):
    """impl_backend "liger" with Liger present is Liger's (left alone, a routine reason); without it
    verl falls back to its torch path, which ours computes. Inputs verl's code refuses get verl's own
    error, counted stock with the reason."""
    stock, ours, calls = _ours(verl_functional)
    hidden, weight, ids, _ = _inputs(torch.float32, (2, 5))
    liger = verl_functional.FusedLinearForPPO(impl_backend="liger")
    ours(liger, hidden, weight, ids)  # no Liger here: verl's torch path, computed by ours
    assert (calls.fused, calls.stock) == (1, {})

    class Liger:
        @staticmethod
        def apply(hidden, weight, ids, temperature, *rest):
            return -torch.ones(ids.shape), torch.zeros(ids.shape)

    monkeypatch.setitem(stock.__globals__, verl_logprobs.LIGER, Liger)
    logprobs, _ = ours(liger, hidden, weight, ids)
    assert torch.equal(logprobs, torch.ones(2, 5))  # Liger's function ran, through verl's code
    assert calls.stock == {verl_logprobs.LIGER_BACKEND: 1} and calls.stocked == 0
    torch_module = verl_functional.FusedLinearForPPO(impl_backend="torch")
    with pytest.raises(AssertionError, match="input_ids shape doesn't match"):  # verl's own assert
        ours(torch_module, hidden, weight, ids.flatten())
    assert calls.fused == 1 and calls.stocked == 1
    assert any(reason.startswith("shapes hidden (2, 5, 24)") for reason in calls.stock), calls.stock


def test_the_probe_accepts_verls_code_and_refuses_other_math(verl_functional):
    """The live probe: verl 0.9.1's forward agrees with ours; a forward whose entropy differs is refused."""
    stock, ours, _calls = _ours(verl_functional)
    assert verl_logprobs.probe(stock, ours) is None

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        logprobs, entropy = stock(self, hidden_states, vocab_weights, input_ids, temperature)
        return logprobs, entropy * 0.5

    forward.__qualname__ = stock.__qualname__
    other = verl_logprobs.build(forward, None, _on_error())
    reason = verl_logprobs.probe(forward, other)
    assert reason is not None and "the math differs from stock" in reason, reason

    def renamed(self, hidden, weight, ids, temperature=1.0):
        return stock(self, hidden, weight, ids, temperature)

    reason = verl_logprobs.probe(renamed, verl_logprobs.build(renamed, None, _on_error()))
    assert reason is not None and "the signature" in reason, reason


# verl's model forward with use_fused_kernels, on each tiny model and dtype: the fused forward's
# outputs, every parameter's gradient, and what status() says. ``shift_labels``: what verl's FSDP
# engine passes under Ulysses (the globally rolled ids, sliced to this rank's part).
CHILD = """
import json, logging, sys
import torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
import torch_npu, transformers
import npu_autopatch
from npu_autopatch.testing import tiny
from verl.models.transformers.dense_common import forward_with_torch_backend
from verl.utils.experimental import torch_functional

out = sys.argv[1]
tensors, facts = {}, {}
for model_type in ("qwen3", "qwen3_moe"):
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = tiny.tiny_model(model_type).to(dtype).train()
        vocab = model.config.vocab_size
        everything = torch.randint(0, vocab, (1, 48))  # a packed sequence; rank 1 of 2 holds the last 24
        ids = everything[:, 24:]
        ulysses = {"shift_labels": torch.roll(everything, -1, 1)[:, 24:]}
        for case, extra in (("roll", {}), ("ulysses", ulysses)):
            model.zero_grad()
            result = forward_with_torch_backend(
                model, input_ids=ids, return_dict=True, temperature=0.7, **extra
            )
            adv = torch.linspace(-1, 1, 24)[None]
            ((result.log_probs * adv).sum() + 0.01 * result.entropy.float().sum()).backward()
            key = f"{model_type}-{dtype}-{case}"
            tensors[key] = [result.log_probs.detach(), result.entropy.detach(),
                            {n: p.grad for n, p in model.named_parameters() if p.grad is not None}]
record = npu_autopatch.status()["verl_fused_logprobs"]
facts["status"] = [str(record.state), None if record.code is None else str(record.code), record.reason]
facts["calls"] = {target: [c["fused"], c["stock"]] for target, c in record.calls.items()}
facts["ours"] = getattr(torch_functional.FusedLinearForPPO.forward, "__wrapped__", None) is not None
torch.save(tensors, out)
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def model_runs(verl_site, tmp_path_factory):
    """verl's forward_with_torch_backend with NPU_AUTOPATCH=1, the switch on (default) and off."""
    runs = {}
    for name, env in (("on", {}), ("off", {"NPU_AUTOPATCH_VERL_LOGPROBS": "0"})):
        out = tmp_path_factory.mktemp(name) / "tensors.pt"
        code = CHILD.replace("sys.argv[1]", repr(str(out)))
        site = f"{STAND_IN_SITE}:{verl_site}"
        done = run_python(code, timeout=900, PYTHONPATH=site, NPU_AUTOPATCH="1", **env)
        assert done.returncode == 0, done.stderr[-4000:]
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out), done.stderr
    return runs


def test_verls_model_forward_runs_ours_with_the_switch_on(model_runs):
    facts, _tensors, stderr = model_runs["on"]
    assert facts["ours"] and facts["status"] == ["applied", None, None], facts
    assert facts["calls"] == {TARGET: [8, {}]}, facts  # 2 models x 2 dtypes x 2 cases, all fused
    told = [line for line in stderr.splitlines() if "verl's fused log-probs" in line]
    assert len(told) == 1, stderr[-3000:]
    assert told[0].startswith("npu_autopatch INFO npu-autopatch: verl's fused log-probs and entropy (")
    assert "FusedLinearForPPO.forward, impl_backend 'torch') are computed by npu_autopatch.losses" in told[0]


def test_with_the_switch_off_verls_own_runs(model_runs):
    facts, _tensors, stderr = model_runs["off"]
    assert not facts["ours"] and facts["calls"] == {}, facts
    assert facts["status"][:2] == ["skipped", "not-selected"], facts
    assert "NPU_AUTOPATCH_VERL_LOGPROBS=0" in facts["status"][2]
    assert "verl's fused log-probs" not in stderr


def test_verls_model_forward_gives_verls_values_with_ours(model_runs):
    """Log-probs, entropy and every parameter's gradient of qwen3 and qwen3_moe, fp32 and bf16, with
    the labels rolled by verl and with Ulysses' shift_labels: ours equal verl's own within rounding."""
    (_, ours, _), (_, verls, _) = model_runs["on"], model_runs["off"]
    assert sorted(ours) == sorted(verls) and len(ours) == 8
    for key, (logprobs, entropy, grads) in verls.items():
        dtype = torch.bfloat16 if "bfloat16" in key else torch.float32
        got_logprobs, got_entropy, got_grads = ours[key]
        _close([got_logprobs, got_entropy], [logprobs, entropy], dtype)
        assert sorted(got_grads) == sorted(grads), key
        _close([got_grads[name] for name in grads], list(grads.values()), dtype)
