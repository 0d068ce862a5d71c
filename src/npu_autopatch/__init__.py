"""npu-autopatch: swap torch_npu fused kernels into HuggingFace transformers models.

Each supported modeling module is patched the moment it is imported, per model, all or
nothing. Turn it on with NPU_AUTOPATCH=1, a cluster sitecustomize, or ``enable()``; see
``status()`` or ``python -m npu_autopatch status`` for what was patched and why not.

Importing this package is cheap (no torch, transformers, wrapt, logging, typing, enum or
dataclasses): the status vocabulary (``PatchRecord``, ``TargetReason``, ``State``, ``ReasonCode``),
``PatchError`` and ``report()`` (what a live model runs: ours, stock or foreign, per module
class) are loaded on first use.
"""

from ._control import disable, enable, is_enabled, register, status, unregister
from ._types import Calls, Kernel, Model, Pattern, Report, Target, Variant

__version__ = "0.1.0"
__all__ = [
    "Calls",
    "CoverageReport",
    "Kernel",
    "Model",
    "PatchError",
    "PatchRecord",
    "Pattern",
    "ReasonCode",
    "Report",
    "State",
    "Target",
    "TargetReason",
    "Variant",
    "disable",
    "enable",
    "is_enabled",
    "register",
    "report",
    "status",
    "unregister",
]

_RECORDS = ("PatchError", "PatchRecord", "ReasonCode", "State", "TargetReason")
_REPORT = ("CoverageReport", "report")  # imports torch: only for a live model


def __getattr__(name):
    if name in _RECORDS:
        from . import _records

        return getattr(_records, name)
    if name in _REPORT:
        from . import _report

        return getattr(_report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._records import PatchError, PatchRecord, ReasonCode, State, TargetReason
    from ._report import CoverageReport, report
