"""What every op of the device model shares: how the device refuses a call, and how it allocates."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check(condition: bool, message: str) -> None:
    """Raise like the device's TORCH_CHECK (or a failed tiling) does."""
    if not condition:
        raise RuntimeError(message)


def unsupported(condition: bool, message: str) -> None:
    """Refuse a path the device supports but the stand-in does not model, so no test passes by accident."""
    if condition:
        raise NotImplementedError(f"torch_npu stand-in: {message}")


def uninitialised(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Memory the device allocates and never writes: NaN here, so that nothing can rely on it."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


def fake_empty(shape: Sequence[int], dtype: torch.dtype, like: Tensor) -> Tensor:
    """A fake kernel's output: shape and dtype only, on ``like``'s device."""
    return like.new_empty(tuple(shape), dtype=dtype)


def fake_like(t: Tensor) -> Tensor:
    """A contiguous tensor of t's shape and dtype: the device's outputs are fresh, contiguous
    allocations whatever the input's strides (and the CPU kernels return the same; _library.py)."""
    return t.new_empty(t.shape)
