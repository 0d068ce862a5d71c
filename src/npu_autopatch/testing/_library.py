"""The harness's registration of the device model (``testing.device``) as torch.library custom ops, and the
call counting.

The device model's ops are registered one namespace per profile, as torch_npu registers its own.

Registered ops are opaque to torch.compile and torch.export: dynamo calls them as they are and traces
their fake (meta) kernels, as it does torch_npu's ``torch.ops.npu.*``, so a compiled patched model
neither recompiles per call nor traces into the stand-in's Python. Each profile gets its own
namespace (``torch.ops.npu_standin_<profile>``) because the profiles differ in schemas and in which
ops have a backward; the device's own namespace, ``npu``, is never used, so that the stand-in cannot
collide with a real torch_npu.

Calls are counted inside the CPU kernels, at run time, into the ``calls`` Counter of every live
stand-in module of the profile: the count is what ran, compiled or not.

Autograd per profile: an op with a backward op gets its formula (device/autograd.py), which calls that
backward op (counted too); an op without one gets nothing, and torch's own autograd fallback does what
torch_npu's VariableFallbackKernel.cpp does: warn, and give no gradient.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .device import attention, autograd, ops
from .device.profiles import Profile

_REQUIRED = object()
_lock = threading.Lock()
_registrations: dict[str, Registration] = {}
_OP_DEFS: dict[str, ops.OpDef] = {**ops.OP_DEFS, **attention.OP_DEFS}


class Registration:
    """The ops of one profile, registered once per process."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.namespace = profile.namespace
        self.modules: weakref.WeakSet[types.ModuleType] = weakref.WeakSet()  # live stand-ins
        self.library = torch.library.Library(self.namespace, "DEF")
        for name, schema in profile.schemas.items():
            self.library.define(schema)
            definition = _OP_DEFS[name]
            arguments = self.op(name).default._schema.arguments
            self.library.impl(name, self._kernel(name, definition.impl, arguments), "CPU")
            torch.library.register_fake(
                f"{self.namespace}::{name}", self._fake(definition.fake, arguments), lib=self.library
            )
        for name, backward in profile.autograd.items():
            setup, formula = autograd.FORMULAS[name](self.op(backward), backward)
            torch.library.register_autograd(
                f"{self.namespace}::{name}", formula, setup_context=setup, lib=self.library
            )

    def op(self, name: str) -> Any:
        """The registered op (an OpOverloadPacket), as torch_npu exposes ``torch.ops.npu.<name>``."""
        return getattr(getattr(torch.ops, self.namespace), name)

    def _kernel(self, name: str, impl: Callable[..., Any], arguments: list) -> Callable[..., Any]:
        profile, modules, values_of = self.profile, self.modules, _binder(arguments)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            for module in list(modules):
                module.calls[name] += 1
            # The device computes below autograd and below autocast: whatever happens here records no
            # graph, and the kernel's own arithmetic and output dtypes are the op's, not the caller's
            # autocast policy (a CPU autocast would otherwise round its fp32 statistics to bf16). Its
            # outputs are fresh contiguous allocations, as the fake kernels say.
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                result = impl(profile, *values_of(args, kwargs))
            return _contiguous(result)

        return kernel

    def _fake(self, fake: Callable[..., Any], arguments: list) -> Callable[..., Any]:
        profile, values_of = self.profile, _binder(arguments)

        def fake_kernel(*args: Any, **kwargs: Any) -> Any:
            return fake(profile, *values_of(args, kwargs))

        return fake_kernel


def _binder(arguments: list) -> Callable[[tuple, dict], list]:
    """A function giving every schema argument's value in schema order, defaults filled in.

    torch calls a Python kernel with only the arguments the caller passed, and the defaults of a
    profile's schema (e.g. init_routing_v2's quant_mode) are the profile's, not the kernel's.
    """
    names = [argument.name for argument in arguments]
    defaults = [
        argument.default_value if argument.has_default_value() else _REQUIRED for argument in arguments
    ]

    def values_of(args: tuple, kwargs: dict) -> list:
        values = list(args)
        for name, default in zip(names[len(args) :], defaults[len(args) :], strict=True):
            value = kwargs.get(name, default)
            if value is _REQUIRED:
                raise TypeError(f"missing required argument {name!r}")
            values.append(value)
        return values

    return values_of


def _contiguous(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return result.contiguous()
    if isinstance(result, (tuple, list)):
        return type(result)(_contiguous(r) for r in result)
    return result


def registration(profile: Profile) -> Registration:
    """The registered ops of ``profile`` (registered at the first call, once per process)."""
    with _lock:
        found = _registrations.get(profile.name)
        if found is None:
            found = _registrations[profile.name] = Registration(profile)
        return found
