"""A CPU stand-in for the Ascend ``torch_npu`` module.

There is no NPU in CI and installing torch_npu without CANN breaks ``import torch``, so this module is the
project's only witness of the device. It is strict on purpose: documented limits raise, outputs have the
device's tuple arity, dtypes and shapes, and every op has the device's autograd behaviour (a real backward, a
backward that raises, or silently no gradient), all per ``torch_npu_ops.md``.

This package must stay import-light (no torch at import time): ``pytest_plugin`` lives inside it and is loaded
by every pytest run through the ``pytest11`` entry point. torch is imported when a stand-in is built.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections import Counter
from collections.abc import Iterable, Iterator

__all__ = ["OPS", "make_torch_npu", "stand_in"]

OPS: tuple[str, ...] = (
    "npu_rms_norm",
    "npu_rms_norm_backward",
    "npu_gemma_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_swiglu_backward",
    "npu_rotary_mul",
    "npu_rotary_mul_backward",
    "npu_apply_rotary_pos_emb",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_grouped_matmul",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_compute_expert_tokens",
    "npu_moe_init_routing_v2",
    "npu_moe_finalize_routing",
    "npu_moe_token_permute",
    "npu_moe_token_permute_grad_v2",
    "npu_moe_token_unpermute",
    "npu_moe_token_unpermute_grad_v2",
)

_DEVICE_NAME = "CPU stand-in for torch_npu"
_MODULE_NAMES = ("torch_npu", "torch_npu.npu")
_ABSENT = object()


def _make_npu_submodule(available: bool) -> types.ModuleType:
    """``torch_npu.npu``: the device queries HF's is_torch_npu_available() and device code ask."""
    npu = types.ModuleType("torch_npu.npu", "Device queries of the torch_npu stand-in.")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None)
    count = 1 if available else 0

    def is_available() -> bool:
        return available

    def device_count() -> int:
        return count

    def get_device_name(i: int = 0) -> str:
        if not 0 <= i < count:
            raise RuntimeError(f"Invalid device id {i}: the torch_npu stand-in has {count} device(s)")
        return _DEVICE_NAME

    npu.is_available, npu.device_count, npu.get_device_name = is_available, device_count, get_device_name
    return npu


def make_torch_npu(*, available: bool = True, missing: Iterable[str] = ()) -> types.ModuleType:
    """Build a fresh ``torch_npu`` module object (not registered in ``sys.modules``).

    ``available`` is what ``torch_npu.npu.is_available()`` reports; ops named in ``missing`` are left out, as
    in an older torch_npu release. Every op call is counted in the module's ``calls`` Counter.
    """
    from npu_autopatch.testing import _ops  # torch is imported here, not with the package

    missing = frozenset(missing)
    unknown = sorted(missing.difference(OPS))
    if unknown:
        raise ValueError(f"missing= names ops the stand-in does not have: {unknown}")
    module = types.ModuleType("torch_npu", "CPU stand-in for torch_npu (npu_autopatch.testing).")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = "0.0.0+cpu.standin"
    module.STAND_IN = True
    module.calls = Counter()
    module.npu = _make_npu_submodule(available)
    for name, op in _ops.build_ops(module.calls).items():
        if name not in missing:
            setattr(module, name, op)
    return module


@contextlib.contextmanager
def stand_in(*, available: bool = True, missing: Iterable[str] = ()) -> Iterator[types.ModuleType]:
    """Install a fresh stand-in as ``torch_npu``, ``torch_npu.npu`` and ``torch.npu``; restore on exit.

    Whatever was there before (another module, or nothing at all) is put back exactly, so uses may nest.
    """
    import torch

    module = make_torch_npu(available=available, missing=missing)
    saved_modules = {name: sys.modules.get(name, _ABSENT) for name in _MODULE_NAMES}
    saved_npu = vars(torch).get("npu", _ABSENT)  # vars(): no lazy torch.__getattr__ lookup
    sys.modules["torch_npu"] = module
    sys.modules["torch_npu.npu"] = module.npu
    torch.npu = module.npu
    try:
        yield module
    finally:
        for name, previous in saved_modules.items():
            if previous is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
        if saved_npu is _ABSENT:
            vars(torch).pop("npu", None)
        else:
            torch.npu = saved_npu
