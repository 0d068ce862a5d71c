"""verl's fused log-probs and entropy, forward + backward, side by side: ours, verl's, stock (issue 42).

- ``ours``: verl's ``FusedLinearForPPO(impl_backend="torch").forward`` with ``NPU_AUTOPATCH=1`` on the
  CPU stand-in for torch_npu: ``npu_autopatch.losses.linear_logprobs`` computes it
  (integrations/verl_logprobs.py); the child checks that status() counted the call fused.
- ``verl``: the same call with ``NPU_AUTOPATCH_VERL_LOGPROBS=0``: verl's ``FusedLinearForPPOFunction``
  (chunks of 512 rows, each with its fp32 logits, softmax and log-softmax).
- ``stock``: the logits path: ``hidden @ W.T``, upcast to fp32, divided by the temperature,
  ``log_softmax``, the ids' log-probs gathered and the entropy ``-(p * log p).sum(-1)``.
verl's ``torch_functional.py`` is verl 0.9.1's, taken from its wheel (``pip download --no-deps``,
sha256 checked) unless ``--verl-site`` names a directory holding ``verl/utils/experimental/``.

The step: forward + backward of ``(logprobs * adv).sum() + 0.01 * entropy.sum()`` (a PPO policy loss
and an entropy bonus), temperature 0.7, vocab 151,936 (Qwen3), hidden 1,024, bf16 and fp32 weights
and hidden states. Each configuration runs in a fresh process and measures one step; peak and the
interleaved repeats as in loss_memory.py (whose helpers this imports): peak = the high-water mark of
the resident size minus the resident size before the step. Ratios are of medians within one run. A
stock step whose logits would not fit the available memory (32 bytes per logit) is left out and said so.

``--errors``: log-probs, entropy and the hidden states' and weight's gradients of each against an fp64
reference (the logits and their gradient rounded to the dtype where stock rounds them, every other
operation in fp64), relative Frobenius errors, one process per dtype and token count. There stock
runs by chunks of 256 rows, so that its logits fit: each row's log-softmax, entropy and hidden
gradient are computed as in the full call (row by row), the weight's gradient summed over the chunks
in fp32 from the logits' gradient in the dtype and rounded once, as its single matmul does.

Run with the venv's python:
    .venv/bin/python benchmarks/verl_logprobs.py [--modes ...] [--tokens N ...] [--impls ...] [--repeats N]
    .venv/bin/python benchmarks/verl_logprobs.py --errors --tokens 4096
``--quick``: vocab 8,192, hidden 256, 512 tokens, bf16, each implementation once, and the errors
(tests/test_benchmarks.py: the script's every step once).
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from loss_memory import _available_mb, _high_water_mb, _load, _median, _reset_high_water, _resident_mb

FULL = {
    "vocab": 151_936,
    "hidden": 1024,
    "modes": ("bfloat16", "float32"),
    "tokens": (4096, 8192),
    "impls": ("ours", "verl", "stock"),
    "repeats": 1,
}
QUICK = {
    "vocab": 8192,
    "hidden": 256,
    "modes": ("bfloat16",),
    "tokens": (512,),
    "impls": ("ours", "verl", "stock"),
    "repeats": 1,
}
TEMPERATURE = 0.7
ENTROPY_COEFF = 0.01
BYTES_PER_STOCK_LOGIT = 32  # fp32 logits, log-softmax, probabilities, their product, two gradients
VERL = "verl==0.9.1"
TORCH_FUNCTIONAL = "verl/utils/experimental/torch_functional.py"
TORCH_FUNCTIONAL_SHA256 = "812d6db39676454f6bdb4881eedc9eceeef28c8e08a1b505bb54346c7b6a7485"
STAND_IN_SITE = Path(__file__).resolve().parents[1] / "tests" / "stand_in_site"


def verl_site(directory):
    """A directory for PYTHONPATH holding verl 0.9.1's torch_functional.py (from its wheel)."""
    root = Path(directory)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            root,
            VERL,
        ],
        check=True,
    )
    (archive,) = root.glob("*.whl")
    with zipfile.ZipFile(archive) as opened:
        source = opened.read(TORCH_FUNCTIONAL)
    if hashlib.sha256(source).hexdigest() != TORCH_FUNCTIONAL_SHA256:
        raise SystemExit(f"{TORCH_FUNCTIONAL} of {archive.name} is not verl 0.9.1's")
    target = root / "site" / TORCH_FUNCTIONAL
    target.parent.mkdir(parents=True)
    target.write_bytes(source)
    for package in ("verl", "verl/utils", "verl/utils/experimental"):
        (root / "site" / package / "__init__.py").touch()
    return root / "site"


def _inputs(mode, tokens, vocab, hidden_size):
    import torch

    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    weight = (torch.randn(vocab, hidden_size) / hidden_size**0.5).to(dtype).requires_grad_()
    hidden = torch.randn(1, tokens, hidden_size).to(dtype).requires_grad_()  # verl's packed [1, T, H]
    ids = torch.randint(0, vocab, (1, tokens))
    advantages = torch.randn(1, tokens)
    return hidden, weight, ids, advantages


def _stock(hidden, weight, ids, temperature):
    import torch

    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    return logp.gather(-1, ids[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _forward(impl):
    """``forward(hidden, weight, ids, temperature)`` of one implementation, in this child."""
    if impl == "stock":
        return _stock
    import transformers  # noqa: F401  (npu-autopatch's hooks arm with transformers, as in verl's process)
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    module = FusedLinearForPPO(impl_backend="torch")
    return lambda hidden, weight, ids, temperature: module.forward(hidden, weight, ids, temperature)


def _step(forward, hidden, weight, ids, advantages):
    """The step; its (log-probs, entropy), the gradients left in ``.grad``."""
    weight.grad = hidden.grad = None
    logprobs, entropy = forward(hidden, weight, ids, TEMPERATURE)
    ((logprobs * advantages).sum() + ENTROPY_COEFF * entropy.float().sum()).backward()
    return logprobs.detach(), entropy.detach()


def _counted(impl):
    """How status() counted verl's forward in this child: (fused, stock) calls, or None for stock."""
    if impl == "stock":
        return None
    import npu_autopatch

    calls = npu_autopatch.status()["verl_fused_logprobs"].calls
    return [sum(c["fused"] for c in calls.values()), sum(sum(c["stock"].values()) for c in calls.values())]


def child(impl, mode, tokens, vocab, hidden_size):
    """One configuration in this process: {peak_mb, seconds, counted} on stdout."""
    hidden, weight, ids, advantages = _inputs(mode, tokens, vocab, hidden_size)
    forward = _forward(impl)
    _reset_high_water()
    before = _resident_mb()
    start = time.perf_counter()
    _step(forward, hidden, weight, ids, advantages)
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_mb": _high_water_mb() - before, "seconds": seconds, "counted": _counted(impl)}))


def _reference(hidden, weight, ids, advantages, dtype, rows=256):
    """(log-probs, entropy, hidden's gradient, weight's gradient) in fp64 but for the logits and their
    gradient, rounded to ``dtype`` where stock rounds them; by rows, so that fp64 logits stay small."""
    import torch

    hidden, weight = hidden.double(), weight.double()
    logprobs, entropy = (torch.empty(hidden.shape[0], dtype=torch.float64) for _ in range(2))
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
    for start in range(0, hidden.shape[0], rows):
        part = slice(start, start + rows)
        logp = torch.log_softmax((hidden[part] @ weight.T).to(dtype).double() / TEMPERATURE, dim=-1)
        probs = logp.exp()
        entropy[part] = -(probs * logp).sum(-1)
        logprobs[part] = logp.gather(1, ids[part, None]).squeeze(1)
        adv = advantages[part, None].double()
        grad = -ENTROPY_COEFF * probs * (logp + entropy[part, None]) - adv * probs
        grad[torch.arange(grad.shape[0]), ids[part]] += adv[:, 0]
        grad = (grad / TEMPERATURE).to(dtype).double()
        grad_hidden[part] = grad @ weight
        grad_weight += grad.T @ hidden[part]
    return logprobs, entropy, grad_hidden, grad_weight


def _stock_by_rows(hidden, weight, ids, advantages, rows=256):
    """Stock's four outputs computed 256 rows at a time (see the module docstring)."""
    import torch

    outputs = [[], [], []]
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32)
    for start in range(0, hidden.shape[0], rows):
        part = slice(start, start + rows)
        h = hidden[part].detach().requires_grad_()
        logits = (h @ weight.detach().T).detach().requires_grad_()
        logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
        logprobs, entropy = logp.gather(-1, ids[part, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        loss = (logprobs * advantages[part]).sum() + ENTROPY_COEFF * entropy.sum()
        (grad,) = torch.autograd.grad(loss, logits)
        outputs[0].append(logprobs.detach())
        outputs[1].append(entropy.detach())
        outputs[2].append(grad @ weight.detach())
        grad_weight += grad.float().T @ h.detach().float()
    return [*(torch.cat(o) for o in outputs), grad_weight.to(weight.dtype)]


def errors(mode, tokens, vocab, hidden_size):
    """{impl: [relative Frobenius error of log-probs, entropy, hidden's gradient, weight's gradient]}."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    from npu_autopatch.integrations.verl_logprobs import build
    from npu_autopatch.losses import linear_logprobs
    from npu_autopatch.testing.parity import errors_vs_fp64

    hidden, weight, ids, advantages = _inputs(mode, tokens, vocab, hidden_size)
    flat = [hidden[0].detach(), weight.detach(), ids[0], advantages[0]]
    exact = _reference(*flat, dtype=weight.dtype)

    def on_error(exc, *tensors):
        raise exc

    module = FusedLinearForPPO(impl_backend="torch")
    verls = FusedLinearForPPO.forward
    found = {"stock": _stock_by_rows(*flat)}
    for impl, forward in (("ours", build(verls, None, on_error)), ("verl", verls)):
        run = lambda *args, forward=forward: forward(module, *args)  # noqa: E731
        logprobs, entropy = _step(run, hidden, weight, ids, advantages)
        found[impl] = [logprobs[0], entropy[0].float(), hidden.grad[0], weight.grad]
    # The function itself: its entropy before verl's contract rounds it to the hidden states' dtype.
    logprobs, entropy = _step(linear_logprobs, hidden, weight, ids, advantages)
    found["linear_logprobs"] = [logprobs[0], entropy[0], hidden.grad[0], weight.grad]
    return {
        impl: [errors_vs_fp64(g, e, weight.dtype)["rel_frobenius"] for g, e in zip(got, exact, strict=True)]
        for impl, got in found.items()
    }


def _run(site, impl, *args):
    """One child: ours with NPU_AUTOPATCH=1 on the stand-in, verl's with its switch off."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": f"{STAND_IN_SITE}:{site}"}
    env.update(NPU_AUTOPATCH="1", NPU_AUTOPATCH_VERL_LOGPROBS="1" if impl == "ours" else "0")
    command = [sys.executable, __file__, *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def side_by_side(site, setting):
    configurations = []
    for mode in setting["modes"]:
        for tokens in setting["tokens"]:
            for impl in setting["impls"]:
                if (
                    impl == "stock"
                    and tokens * setting["vocab"] * BYTES_PER_STOCK_LOGIT / 2**20 > _available_mb()
                ):
                    print(f"stock {mode} {tokens} tokens: no room for its logits, left out")
                    continue
                configurations.append((impl, mode, tokens))
    results = {configuration: [] for configuration in configurations}
    for _ in range(setting["repeats"]):
        for impl, mode, tokens in configurations:
            run = _run(site, impl, "--child", impl, mode, tokens, setting["vocab"], setting["hidden"])
            results[(impl, mode, tokens)].append(run)
            counted = (
                "" if run["counted"] is None else f", verl's forward counted fused/stock {run['counted']}"
            )
            cells = f"{run['peak_mb']:.0f} MB, {run['seconds']:.2f} s{counted}"
            print(f"  ran {impl} {mode} {tokens} tokens: {cells}", flush=True)
    print(
        f"{'mode':<9}{'tokens':>8}  {'impl':<6}{'peak MB':>9}{'time s':>9}  (median of {setting['repeats']})"
    )
    table = {}
    for (impl, mode, tokens), runs in results.items():
        table[(impl, mode, tokens)] = peak, seconds = _median(runs, "peak_mb"), _median(runs, "seconds")
        print(f"{mode:<9}{tokens:>8}  {impl:<6}{peak:>9.0f}{seconds:>9.2f}", flush=True)
    for mode in setting["modes"]:
        for tokens in setting["tokens"]:
            ours = table.get(("ours", mode, tokens))
            for peer in ("verl", "stock"):
                theirs = table.get((peer, mode, tokens))
                if ours and theirs:
                    print(
                        f"{mode} at {tokens} tokens: ours {ours[0] / theirs[0]:.2f}x {peer}'s peak, "
                        f"{ours[1] / theirs[1]:.2f}x its time"
                    )


def error_table(site, setting):
    columns = "".join(f"{name:>10}" for name in ("log-prob", "entropy", "d hidden", "d weight"))
    print(f"{'mode':<9}{'tokens':>8}  {'impl':<16}{columns}  (relative Frobenius error vs fp64)")
    for mode in setting["modes"]:
        for tokens in setting["tokens"]:
            found = _run(site, "verl", "--errors-child", mode, tokens, setting["vocab"], setting["hidden"])
            for impl, errs in found.items():
                print(f"{mode:<9}{tokens:>8}  {impl:<16}" + "".join(f"{e:>10.2e}" for e in errs), flush=True)
            ratio = found["linear_logprobs"][1] / found["stock"][1]
            print(
                f"{mode} at {tokens} tokens: linear_logprobs' entropy error {ratio:.2f}x stock's", flush=True
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--errors", action="store_true", help="errors against fp64 (alone)")
    parser.add_argument("--modes", nargs="+", choices=("bfloat16", "float32"))
    parser.add_argument("--tokens", type=int, nargs="+")
    parser.add_argument("--impls", nargs="+", choices=FULL["impls"])
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--verl-site", help="a directory holding verl/utils/experimental/torch_functional.py")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--errors-child", nargs=4, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        impl, mode, tokens, vocab, hidden = options.child
        return child(impl, mode, int(tokens), int(vocab), int(hidden))
    if options.errors_child:
        mode, tokens, vocab, hidden = options.errors_child
        return print(json.dumps(errors(mode, int(tokens), int(vocab), int(hidden))))
    given = {name: value for name, value in vars(options).items() if name in FULL and value is not None}
    setting = {**(QUICK if options.quick else FULL), **given}
    size = f"vocab {setting['vocab']:,}, hidden {setting['hidden']:,}"
    print(f"verl's log-probs + entropy, forward + backward: {size}")
    print(_load())
    with tempfile.TemporaryDirectory() as directory:
        site = options.verl_site or verl_site(directory)
        if not options.errors:
            side_by_side(site, setting)
        if options.errors or options.quick:
            error_table(site, setting)
    print(_load())


if __name__ == "__main__":
    main()
