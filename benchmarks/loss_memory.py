"""The LM head + loss, forward + backward, side by side: ours, stock and the peers here (issues 19, 35).

- ``ours``: ``npu_autopatch.losses.linear_cross_entropy`` (with ``--budget`` MB per chunk, else its default).
- ``stock``: what a ``*ForCausalLM`` does in training: ``lm_head`` (``F.linear``), then ``ForCausalLMLoss``.
- ``cce``: cut-cross-entropy's ``torch_compile`` implementation (its Triton kernels need a GPU: on this
  CPU its package is loaded without them); ``pip install --no-deps cut-cross-entropy``.
- ``trl``: TRL 1.x's chunked LM head (``trl.kernels.ChunkedLogProbFunction``, its SFTTrainer's default
  vocabulary chunk), the mean of minus the log-probs of the valid tokens.
A peer that is not installed is left out and said so. Modes: ``float32`` and ``bfloat16`` weights and
hidden states, and ``autocast`` (fp32 weights and hidden states, the forward under bf16 autocast, as
HF ``Trainer(bf16=True)`` runs it). Vocab 151,936 (Qwen3), hidden 1,024, one in ten labels -100.

Each configuration runs in a fresh process and measures one step (cut-cross-entropy's second: its
first compiles). Peak = the high-water mark of the resident size (VmHWM, reset just before the
step) minus the resident size then: the weight, the hidden states and torch are the baseline; the
gradients and everything the step allocates are in the peak. glibc is told to map every allocation
of 128 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``), so memory freed by a first step is given
back and counted again, and every step pays for the pages it touches alike. Time: the median over
``--repeats`` processes per configuration, run interleaved (configuration after configuration, then
again), since this machine's 2 cores are shared; the load average is printed before and after. A
stock step whose logits would not fit in the available memory (16 bytes per logit) is left out and
said so.

``--errors``: the weight and hidden-state gradients of each implementation against an fp64 reference
of stock's dtype flow (``testing.parity.lm_head_loss_reference``: the logits and their gradient
rounded where stock rounds them, every matmul and sum in fp64), in one process per mode and token
count: the largest absolute error, the relative Frobenius error, and the share of elements more than
one ulp away (a bf16 ulp for bf16 and autocast, an fp32 one for fp32).
``--sweep``: ours alone, its time and peak against the chunk budget (``--budgets`` MB).

Run with the venv's python:
    .venv/bin/python benchmarks/loss_memory.py [--quick] [--modes ...] [--tokens N ...] [--impls ...]
    .venv/bin/python benchmarks/loss_memory.py --errors --vocab 32000 --tokens 2048 8192
    .venv/bin/python benchmarks/loss_memory.py --sweep --tokens 8192 --budgets 32 64 128 256 512 1024
``--quick``: vocab 8,192, hidden 256, 512 tokens, bf16, ours and stock, one process each
(tests/test_benchmarks.py: the script's every step once).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

FULL = {
    "vocab": 151_936,
    "hidden": 1024,
    "modes": ("float32", "bfloat16", "autocast"),
    "tokens": (2048, 8192, 16384),
    "impls": ("ours", "cce", "trl", "stock"),
    "repeats": 3,
}
QUICK = {
    "vocab": 8192,
    "hidden": 256,
    "modes": ("bfloat16",),
    "tokens": (512,),
    "impls": ("ours", "stock"),
    "repeats": 1,
}
BYTES_PER_STOCK_LOGIT = 16  # the logits, their fp32 log-softmax and two gradients


def _resident_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _high_water_mb():
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) / 1024


def _reset_high_water():
    """Linux: writing 5 to clear_refs resets VmHWM to the current resident size."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _available_mb():
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) / 1024


def _installed(impl):
    import importlib.util

    module = {"cce": "cut_cross_entropy", "trl": "trl"}.get(impl)
    return module is None or importlib.util.find_spec(module) is not None


def _loss_function(impl, budget_mb):
    """``loss(hidden, weight, labels)`` of one implementation (imported here, in the child)."""
    import torch

    if impl == "ours":
        from npu_autopatch.losses import linear_cross_entropy

        budget = None if budget_mb is None else int(budget_mb * 2**20)
        return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, chunk_bytes=budget)
    if impl == "stock":
        from transformers.loss.loss_utils import ForCausalLMLoss

        def stock(hidden, weight, labels):
            logits = torch.nn.functional.linear(hidden, weight)
            return ForCausalLMLoss(logits, None, weight.shape[0], shift_labels=labels)

        return stock
    if impl == "cce":
        import importlib.util
        import types

        # The package's __init__ imports its Triton kernels; the torch_compile implementation needs none.
        spec = importlib.util.find_spec("cut_cross_entropy")
        package = types.ModuleType("cut_cross_entropy")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["cut_cross_entropy"] = package
        from cut_cross_entropy.torch_compile import torch_compile_linear_cross_entropy

        return lambda hidden, weight, labels: torch_compile_linear_cross_entropy(hidden, weight, labels)
    if impl == "trl":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def trl(hidden, weight, labels):
            keep = labels != -100
            args = (hidden[keep], weight, None, labels[keep], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ())
            return -ChunkedLogProbFunction.apply(*args)[0].mean()

        return trl
    raise ValueError(impl)


def _inputs(mode, tokens, vocab, hidden_size):
    import torch

    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    weight = (torch.randn(vocab, hidden_size) / hidden_size**0.5).to(dtype).requires_grad_()
    hidden = torch.randn(tokens, hidden_size).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    labels[::10] = -100
    return hidden, weight, labels


def _step(loss, mode, hidden, weight, labels):
    import torch

    weight.grad = hidden.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        value = loss(hidden, weight, labels)
    value.backward()


def child(impl, mode, tokens, vocab, hidden_size, budget_mb):
    """One configuration in this process: {peak_mb, seconds} of its measured step on stdout."""
    hidden, weight, labels = _inputs(mode, tokens, vocab, hidden_size)
    loss = _loss_function(impl, budget_mb)
    if impl == "cce":
        _step(loss, mode, hidden, weight, labels)  # torch.compile compiles at the first call
        weight.grad = hidden.grad = None
    _reset_high_water()
    before = _resident_mb()
    start = time.perf_counter()
    _step(loss, mode, hidden, weight, labels)
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_mb": _high_water_mb() - before, "seconds": seconds}))


def errors(mode, tokens, vocab, hidden_size, impls):
    """{impl: {"weight": errors, "hidden": errors}} against the fp64 reference of stock's dtype flow."""
    import torch

    from npu_autopatch.testing.parity import errors_vs_fp64, lm_head_loss_reference

    hidden, weight, labels = _inputs(mode, tokens, vocab, hidden_size)
    dtype = torch.float32 if mode == "float32" else torch.bfloat16
    exact = lm_head_loss_reference(hidden.detach().to(dtype), weight.detach().to(dtype), labels, dtype)
    found = {}
    for impl in impls:
        _step(_loss_function(impl, None), mode, hidden, weight, labels)
        found[impl] = {
            name: errors_vs_fp64(tensor.grad, reference, dtype)
            for name, tensor, reference in (("weight", weight, exact[1]), ("hidden", hidden, exact[0]))
        }
    return found


def _run(*args):
    command = [sys.executable, __file__, *map(str, args)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load():
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _median(runs, key):
    return statistics.median(run[key] for run in runs)


def _measure(configurations, repeats, setting):
    """{configuration: [results]}: every configuration once, then again, ``repeats`` times."""
    results = {configuration: [] for configuration in configurations}
    for _ in range(repeats):
        for impl, mode, tokens, budget in configurations:
            args = ("--child", impl, mode, tokens, setting["vocab"], setting["hidden"], budget or 0)
            results[(impl, mode, tokens, budget)].append(_run(*args))
            run = results[(impl, mode, tokens, budget)][-1]
            cells = f"{run['peak_mb']:.0f} MB, {run['seconds']:.2f} s"
            print(f"  ran {impl} {mode} {tokens} tokens (budget {budget or 'default'}): {cells}", flush=True)
    return results


def side_by_side(setting, budget):
    impls = [impl for impl in setting["impls"] if _installed(impl)]
    for impl in setting["impls"]:
        if impl not in impls:
            print(f"{impl}: not installed here, left out")
    configurations = []
    for mode in setting["modes"]:
        for tokens in setting["tokens"]:
            for impl in impls:
                if (
                    impl == "stock"
                    and tokens * setting["vocab"] * BYTES_PER_STOCK_LOGIT / 2**20 > _available_mb()
                ):
                    print(f"stock {mode} {tokens} tokens: no room for its logits, left out")
                    continue
                configurations.append((impl, mode, tokens, budget))
    results = _measure(configurations, setting["repeats"], setting)
    print(
        f"{'mode':<9}{'tokens':>8}  {'impl':<6}{'peak MB':>9}{'time s':>9}  (median of {setting['repeats']})"
    )
    table = {}
    for (impl, mode, tokens, _), runs in results.items():
        table[(impl, mode, tokens)] = (_median(runs, "peak_mb"), _median(runs, "seconds"))
        peak, seconds = table[(impl, mode, tokens)]
        print(f"{mode:<9}{tokens:>8}  {impl:<6}{peak:>9.0f}{seconds:>9.2f}", flush=True)
    for mode in setting["modes"]:
        for tokens in setting["tokens"]:
            ours = table.get(("ours", mode, tokens))
            for peer in ("stock", "cce", "trl"):
                theirs = table.get((peer, mode, tokens))
                if ours and theirs and peer == "stock":
                    label = "bfloat16" if mode == "bfloat16" else mode
                    print(
                        f"{label} at {tokens} tokens: peak {theirs[0] / ours[0]:.1f}x lower, "
                        f"time {ours[1] / theirs[1]:.2f}x stock"
                    )
                elif ours and theirs:
                    print(
                        f"{mode} at {tokens} tokens: ours {ours[1] / theirs[1]:.2f}x {peer}'s time, "
                        f"peak {ours[0] / theirs[0]:.2f}x {peer}'s"
                    )


def sweep(setting, budgets):
    configurations = [
        ("ours", mode, tokens, budget)
        for mode in setting["modes"]
        for tokens in setting["tokens"]
        for budget in budgets
    ]
    results = _measure(configurations, setting["repeats"], setting)
    header = f"{'mode':<9}{'tokens':>8}{'budget MB':>11}{'peak MB':>9}{'time s':>9}"
    print(f"{header}  (median of {setting['repeats']})")
    for (_, mode, tokens, budget), runs in results.items():
        peak, seconds = _median(runs, "peak_mb"), _median(runs, "seconds")
        print(f"{mode:<9}{tokens:>8}{budget:>11.0f}{peak:>9.0f}{seconds:>9.2f}", flush=True)


def error_table(setting):
    impls = [impl for impl in setting["impls"] if _installed(impl)]
    print(
        f"{'mode':<9}{'tokens':>8}  {'impl':<6}{'grad':<7}{'max abs':>10}{'rel. Frob.':>11}{'over 1 ulp':>11}"
    )
    for mode in setting["modes"]:
        for tokens in setting["tokens"]:
            found = _run("--errors-child", mode, tokens, setting["vocab"], setting["hidden"], ",".join(impls))
            for impl, grads in found.items():
                for name, e in grads.items():
                    cells = f"{e['max_abs']:>10.2e}{e['rel_frobenius']:>11.3e}{100 * e['over_ulp']:>10.2f}%"
                    print(f"{mode:<9}{tokens:>8}  {impl:<6}{name:<7}{cells}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--errors", action="store_true", help="gradient errors against fp64")
    parser.add_argument("--sweep", action="store_true", help="ours: time and peak against the chunk budget")
    parser.add_argument("--modes", nargs="+", choices=FULL["modes"])
    parser.add_argument("--tokens", type=int, nargs="+")
    parser.add_argument("--impls", nargs="+", choices=FULL["impls"])
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--budget", type=float, help="ours: MB per chunk (default: losses.CHUNK_BYTES)")
    parser.add_argument("--budgets", type=float, nargs="+", default=(32, 64, 128, 256, 512, 1024))
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--errors-child", nargs=5, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        impl, mode, tokens, vocab, hidden, budget = options.child
        return child(impl, mode, int(tokens), int(vocab), int(hidden), float(budget) or None)
    if options.errors_child:
        mode, tokens, vocab, hidden, impls = options.errors_child
        return print(json.dumps(errors(mode, int(tokens), int(vocab), int(hidden), impls.split(","))))
    setting = dict(QUICK if options.quick else FULL)
    for name in ("modes", "tokens", "impls", "vocab", "hidden", "repeats"):
        if getattr(options, name) is not None:
            setting[name] = getattr(options, name)
    size = f"vocab {setting['vocab']:,}, hidden {setting['hidden']:,}"
    print(f"LM head + loss, forward + backward: {size}; {_load()}")
    if options.errors:
        error_table(setting)
    elif options.sweep:
        sweep(setting, options.budgets)
    else:
        side_by_side(setting, options.budget)
    print(_load())


if __name__ == "__main__":
    main()
