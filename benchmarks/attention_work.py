"""Attention work per forward on transformers' default path: stock (sdpa) vs patched (default_attention).

Issue 27: on the NPU, sdpa with a mask computes every score of a padded, packed or windowed batch.
Per forward of a tiny mistral (2 layers, 4 query / 2 key-value heads of 16), nothing passed as
``attn_implementation``, under the CPU stand-in (``npu_autopatch.testing``), which counts what the
device computes (``testing.device.work``: score elements per call by sparse mode and layout, forward
only, at element granularity; the device rounds up to its tiles):

- score elements computed, against the minimum the batch needs (each query's causal keys within its
  own document and window), as a ratio;
- host syncs (``Tensor.item``, ``.tolist``, ``.cpu`` calls);
- mask memory: the largest mask transformers builds for the layers plus what torch_npu's sdpa copies
  of it (its ``logical_not``) or builds (the 2048x2048 causal mask).

Cases: a right-padded batch (8 rows, lengths spread over [S/4, S]), 16 packed documents in one row
(position_ids restarting, the default cache on), and one sliding-window layer past its window. The
last row, 32k tokens with a window of 1,024, is counted with the stand-in's own counting function
(``computed_elements``) for the calls each path makes, not run: the stand-in's dense CPU math at 32k
needs more memory than the machine has. Run with the venv's python:
    .venv/bin/python benchmarks/attention_work.py [--quick]
``--quick``: small sizes (tests/test_benchmarks.py: the script keeps working).
"""

import argparse
import copy

import torch

from npu_autopatch.testing import stand_in, tiny
from npu_autopatch.testing.device.work import attention_work, computed_elements

HEADS = 4


def minimum(lengths, window=None):
    """Score elements a causal (windowed) attention over these documents needs, per query head."""
    return sum(min(i + 1, window or i + 1) for n in lengths for i in range(n))


def model_for(window, patched):
    from transformers import AutoModelForCausalLM

    import npu_autopatch

    if patched:
        npu_autopatch.enable()
    else:
        npu_autopatch.disable()
    config = tiny.tiny_config(
        "mistral", sliding_window=window, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()


class Syncs:
    """Counts the device-to-host copies a forward makes (``item``, ``tolist``, ``cpu``)."""

    NAMES = ("item", "tolist", "cpu")

    def __enter__(self):
        self.count = 0
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def counted(original):
            def wrapper(tensor, *args, **kwargs):
                self.count += 1
                return original(tensor, *args, **kwargs)

            return wrapper

        for name, original in self.saved.items():
            setattr(torch.Tensor, name, counted(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


class Masks:
    """The largest 4-D mask transformers' masking functions hand the layers during a forward."""

    def __enter__(self):
        from transformers import masking_utils

        self.module, self.largest, self.saved = masking_utils, 0, {}
        for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
            original = getattr(masking_utils, name, None)
            if original is None:
                continue
            self.saved[name] = original

            def measured(*args, original=original, **kwargs):
                mask = original(*args, **kwargs)
                if isinstance(mask, torch.Tensor):
                    self.largest = max(self.largest, mask.numel() * mask.element_size())
                return mask

            setattr(masking_utils, name, measured)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.module, name, original)


def measure(model, inputs, layers):
    """(elements computed per layer and head, host syncs, mask bytes) of one no-grad forward."""
    import sys

    modeling = sys.modules[type(model).__module__]
    with torch.no_grad(), attention_work() as work, Syncs() as syncs, Masks() as masks:
        # The modeling module imported the masking functions by name: measure them there too.
        saved = {n: getattr(modeling, n) for n in masks.saved if hasattr(modeling, n)}
        for name in saved:
            setattr(modeling, name, getattr(masks.module, name))
        try:
            model(**inputs)
        finally:
            for name, original in saved.items():
                setattr(modeling, name, original)
    mask_bytes = (
        masks.largest + work.mask_copy_bytes // max(1, layers) + work.mask_built_bytes // max(1, layers)
    )
    return work.computed // (layers * HEADS), syncs.count, mask_bytes


def cases(quick):
    """(name, window, inputs, document lengths) of the three measured batches."""
    generator = torch.Generator().manual_seed(0)
    s = 64 if quick else 2048
    lengths = torch.linspace(s // 4, s, 8).round().int().tolist()
    ids = torch.randint(1, 100, (8, s), generator=generator)
    mask = torch.zeros(8, s, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    docs = [(256 if quick else 8192) // 16] * 16
    packed = torch.randint(1, 100, (1, sum(docs)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    long, window = (1024, 64) if quick else (8192, 1024)
    return [
        (
            f"right-padded 8 x {s} (lengths {lengths[0]}-{s})",
            None,
            {"input_ids": ids, "attention_mask": mask},
            lengths,
        ),
        (
            f"16 packed documents in {sum(docs)} tokens",
            None,
            {"input_ids": packed, "position_ids": positions},
            docs,
        ),
        (
            f"sliding window {window} over {long} tokens",
            window,
            {"input_ids": torch.randint(1, 100, (1, long))},
            [long],
        ),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    print("per forward, per layer and query head: score elements computed (x the minimum); per forward: host")
    print("syncs; mask bytes per layer (transformers' 4-D mask and torch_npu sdpa's copies)")
    with stand_in():
        for name, window, inputs, lengths in cases(quick):
            least = minimum(lengths, window)
            row = [f"{name}:"]
            for label, patched in (("stock default", False), ("patched default", True)):
                model = model_for(window or 4 * max(lengths), patched)
                layers = model.config.num_hidden_layers
                computed, syncs, mask_bytes = measure(model, inputs, layers)
                row.append(
                    f"{label} {computed:,} ({computed / least:.2f}x), {syncs} syncs, {mask_bytes:,} B mask"
                )
            print(f"  {row[0]} minimum {least:,}; " + "; ".join(row[1:]))
    # 32k tokens, window 1,024: stock's one dense masked call (sparse_mode 0, unbounded) per layer and
    # head against the patched band call (sparse_mode 4, pre = W - 1, next = 0), counted, not run.
    tokens, window = 32768, 1024
    stock = computed_elements(tokens, tokens, masked=True, sparse_mode=0)
    patched = computed_elements(
        tokens, tokens, masked=True, sparse_mode=4, pre_tokens=window - 1, next_tokens=0
    )
    least = minimum([tokens], window)
    print(
        f"  sliding window {window} over {tokens} tokens (counted): minimum {least:,}; "
        f"stock default {stock:,} ({stock / least:.2f}x); "
        f"patched default {patched:,} ({patched / least:.2f}x)"
    )


if __name__ == "__main__":
    main()
