"""Peak memory and time of the LM head + loss, forward + backward: stock vs chunked (issue 19 item 6).

Stock is what a ``*ForCausalLM`` does in training: ``logits = hidden @ W.T`` in the model dtype,
then ``ForCausalLMLoss`` (fp32 upcast, cross-entropy), then backward to the hidden states and the
weight. Chunked is ``npu_autopatch.losses.linear_cross_entropy`` on the same tensors. Each
configuration runs in a fresh process: its peak is the process's high-water mark (VmHWM, reset
just before the step, so the setup's temporaries do not mask it) minus its resident size then (the
weight, the hidden states and torch are in the baseline; the weight's gradient and everything the
step allocates are in the peak). The time is
the best of the timed steps after that first one. Vocab 151,936 (Qwen3), hidden 1,024 (and
4,096 with ``--hidden 4096``), one in ten labels -100. A stock step whose logits would not fit
in the available memory (16 bytes per logit: the logits, their log-softmax and two gradients)
is left out and said so.
Run with the venv's python:
    .venv/bin/python benchmarks/loss_memory.py [--quick] [--tokens N ...] [--hidden H ...]
``--quick``: vocab 8,192, hidden 256, 512 tokens, bf16 only, one timed step (tests/test_benchmarks.py:
the script's every step once, two processes instead of four: fp32 takes the same path).
"""

import argparse
import json
import resource
import subprocess
import sys
import time

FULL = {
    "vocab": 151_936,
    "hidden": (1024,),
    "dtypes": ("float32", "bfloat16"),
    "tokens": (1024, 2048, 4096, 8192),
    "steps": 2,
}
QUICK = {"vocab": 8192, "hidden": (256,), "dtypes": ("bfloat16",), "tokens": (512,), "steps": 1}
RATIO_TOKENS = 4096


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


def child(impl, dtype_name, tokens, vocab, hidden_size, steps):
    """One configuration in this process: {peak_mb, seconds} on stdout."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from npu_autopatch.losses import linear_cross_entropy

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    weight = (torch.randn(vocab, hidden_size) / hidden_size**0.5).to(dtype).requires_grad_()
    hidden = torch.randn(tokens, hidden_size).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    labels[::10] = -100

    def step():
        weight.grad = hidden.grad = None
        if impl == "stock":
            loss = ForCausalLMLoss(hidden @ weight.T, None, vocab, shift_labels=labels)
        else:
            loss = linear_cross_entropy(hidden, weight, labels)
        loss.backward()

    _reset_high_water()
    before = _resident_mb()
    start = time.perf_counter()
    step()
    times = [time.perf_counter() - start]
    peak = _high_water_mb() - before
    for _ in range(steps - 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak_mb": peak, "seconds": min(times[1:] or times)}))


def _row(*cells):
    return f"{cells[0]:<9}" + "".join(f"{cell:>12}" for cell in cells[1:])


def run(impl, dtype, tokens, hidden, setting):
    args = [sys.executable, __file__, "--child", impl, dtype, str(tokens), str(setting["vocab"])]
    args += [str(hidden), str(setting["steps"])]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default 1,024-8,192)")
    parser.add_argument("--hidden", type=int, nargs="+", help="hidden sizes (default 1,024)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        impl, dtype, tokens, vocab, hidden, steps = options.child
        return child(impl, dtype, int(tokens), int(vocab), int(hidden), int(steps))
    setting = QUICK if options.quick else FULL
    if options.tokens:
        setting = {**setting, "tokens": tuple(options.tokens)}
    if options.hidden:
        setting = {**setting, "hidden": tuple(options.hidden)}
    print(f"LM head + loss, forward + backward: vocab {setting['vocab']:,}")
    print(_row("dtype", "hidden", "tokens", "stock MB", "chunked MB", "peak ratio", "stock s", "chunked s"))
    for hidden in setting["hidden"]:
        for dtype in setting["dtypes"]:
            for tokens in setting["tokens"]:
                chunked = run("chunked", dtype, tokens, hidden, setting)
                peak, seconds = f"{chunked['peak_mb']:.0f}", f"{chunked['seconds']:.2f}"
                if tokens * setting["vocab"] * 16 / 2**20 > _available_mb():
                    print(_row(dtype, hidden, tokens, "(no room)", peak, "-", "-", seconds))
                    continue
                stock = run("stock", dtype, tokens, hidden, setting)
                ratio = stock["peak_mb"] / chunked["peak_mb"]
                cells = (f"{stock['peak_mb']:.0f}", peak, f"{ratio:.1f}x", f"{stock['seconds']:.2f}", seconds)
                print(_row(dtype, hidden, tokens, *cells), flush=True)
                if tokens == RATIO_TOKENS or options.quick:
                    speed = chunked["seconds"] / stock["seconds"]
                    print(
                        f"{dtype} at {tokens} tokens: peak {ratio:.1f}x lower, time {speed:.2f}x stock",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
