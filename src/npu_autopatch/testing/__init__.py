"""A CPU stand-in for the Ascend ``torch_npu`` module, modelling a device, not its documentation.

There is no NPU in CI and installing torch_npu without CANN breaks ``import torch``, so this package is the
project's only witness of the device. Two parts:

- the device model (``testing.device``): one torch_npu release on one Atlas A2 device (a *profile*), the ops
  that release has with its schemas, the shapes the CANN kernels refuse, which ops have a backward and
  through which op; each rule names its source file. The math of the ops the kernels use is
  ``kernels._reference``, the same the probes run. Only the ops the kernels call are modelled, and the
  ones a coming kernel needs (each marked with its issue);
- the harness (here): ``make_torch_npu()`` builds a module of the model's ops, registered as torch.library
  custom ops with fake kernels (as torch_npu's own are, so torch.compile and torch.export treat them alike)
  that count their calls (``_library.py``); ``stand_in()`` installs one as ``torch_npu``; the pytest
  fixture ``npu_stand_in`` (``pytest_plugin.py``) does so for one test.

The default profile is the strictest current device: the newest torch_npu on Atlas A2. Older release lines
are ``make_torch_npu(profile="a2-2.6.0")`` etc. (``PROFILES``).

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

from .device import DEFAULT, PROFILES, Profile

__all__ = ["DEFAULT", "OPS", "PROFILES", "Profile", "make_torch_npu", "stand_in"]

# The ops of the default profile; older profiles have fewer or other backward ops (PROFILES[...].schemas).
OPS: tuple[str, ...] = tuple(DEFAULT.schemas)

_DEVICE_NAME = "CPU stand-in for torch_npu"
_MODULE_NAMES = ("torch_npu", "torch_npu.npu")
_ABSENT = object()


def _make_npu_submodule(available: bool, profile: Profile) -> types.ModuleType:
    """``torch_npu.npu``: the device queries HF's is_torch_npu_available() and device code ask."""
    npu = types.ModuleType("torch_npu.npu", "Device queries of the torch_npu stand-in.")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None)
    count = 1 if available else 0

    def is_available() -> bool:
        return available

    def device_count() -> int:
        return count

    def get_device_name(i: int = 0) -> str:
        # torch_npu returns the SoC name, aclrtGetSocName() (its Module.cpp GetDeviceName).
        if not 0 <= i < count:
            raise RuntimeError(f"Invalid device id {i}: the torch_npu stand-in has {count} device(s)")
        return profile.soc

    npu.is_available, npu.device_count, npu.get_device_name = is_available, device_count, get_device_name

    def get_cann_version(module: str = "CANN") -> str:
        # torch_npu.npu.utils.get_cann_version (op-plugin docs): the installed CANN's version, "" for an
        # unknown module; the profile's CANN for every module here.
        known = ("CANN", "RUNTIME", "COMPILER", "HCCL", "TOOLKIT", "OPP", "OPP_KERNEL")
        return profile.cann if module in known else ""

    npu.utils = types.SimpleNamespace(get_cann_version=get_cann_version)

    class Event:
        """torch_npu.npu.Event: the stand-in's ops run synchronously, so every event has passed."""

        def record(self, stream: object = None) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

    npu.Event = Event
    # What trainers call on torch.npu around a run whose tensors stay on the CPU (accelerate's
    # set_seed and free_memory, Trainer's memory metrics): no device state to touch.
    npu.empty_cache = npu.synchronize = npu.reset_peak_memory_stats = lambda *args, **kwargs: None
    npu.manual_seed = npu.manual_seed_all = npu.set_device = lambda *args, **kwargs: None
    npu.memory_allocated = npu.max_memory_allocated = lambda *args, **kwargs: 0
    npu.current_device = lambda: 0
    npu.is_bf16_supported = lambda *args, **kwargs: True
    return npu


def _profile(profile: Profile | str | None) -> Profile:
    if profile is None:
        return DEFAULT
    if isinstance(profile, Profile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown stand-in profile {profile!r}; known: {', '.join(PROFILES)}") from None


def make_torch_npu(
    *, available: bool = True, missing: Iterable[str] = (), profile: Profile | str | None = None
) -> types.ModuleType:
    """Build a fresh ``torch_npu`` module object (not registered in ``sys.modules``).

    ``profile`` is the torch_npu release and device it models (default: the newest on Atlas A2);
    ``available`` is what ``torch_npu.npu.is_available()`` reports; ops named in ``missing`` are left out.
    Every op call, backward ops included, is counted in the module's ``calls`` Counter.
    """
    from npu_autopatch.testing import _library  # torch is imported here, not with the package

    chosen = _profile(profile)
    missing = frozenset(missing)
    unknown = sorted(missing.difference(chosen.schemas))
    if unknown:
        raise ValueError(f"missing= names ops the stand-in's {chosen.name} profile does not have: {unknown}")
    registration = _library.registration(chosen)
    module = types.ModuleType("torch_npu", f"{_DEVICE_NAME}: {chosen.describe()}.")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = chosen.torch_npu
    module.version = types.SimpleNamespace(__version__=chosen.torch_npu, cann=chosen.cann)
    module.STAND_IN = True
    module.PROFILE = chosen
    module.calls = Counter()
    registration.modules.add(module)
    module.npu = _make_npu_submodule(available, chosen)
    for name in chosen.schemas:
        if name not in missing:
            setattr(module, name, registration.op(name))
    return module


@contextlib.contextmanager
def stand_in(
    *, available: bool = True, missing: Iterable[str] = (), profile: Profile | str | None = None
) -> Iterator[types.ModuleType]:
    """Install a fresh stand-in as ``torch_npu``, ``torch_npu.npu`` and ``torch.npu``; restore on exit.

    With a device ``available``, ``torch.nn.functional.scaled_dot_product_attention`` is torch_npu's own
    for the profile's release meanwhile (``device/sdpa.py``), as on the device, where torch_npu registers
    it for NPU tensors. Whatever was there before (another module, or nothing at all; torch's sdpa) is put
    back exactly, so uses may nest.
    """
    import torch

    from .device import sdpa

    module = make_torch_npu(available=available, missing=missing, profile=profile)
    saved_modules = {name: sys.modules.get(name, _ABSENT) for name in _MODULE_NAMES}
    saved_npu = vars(torch).get("npu", _ABSENT)  # vars(): no lazy torch.__getattr__ lookup
    sys.modules["torch_npu"] = module
    sys.modules["torch_npu.npu"] = module.npu
    torch.npu = module.npu
    restore_sdpa = sdpa.install(module) if available else None
    try:
        yield module
    finally:
        if restore_sdpa is not None:
            restore_sdpa()
        for name, previous in saved_modules.items():
            if previous is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
        if saved_npu is _ABSENT:
            vars(torch).pop("npu", None)
        else:
            torch.npu = saved_npu
