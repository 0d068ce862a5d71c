"""npu-autopatch: swap torch_npu fused kernels into HuggingFace transformers models.

Each supported modeling module is patched the moment it is imported, per model, all or
nothing. Turn it on with NPU_AUTOPATCH=1, a cluster sitecustomize, or ``enable()``; see
``status()`` or ``python -m npu_autopatch status`` for what was patched and why not.

Importing this package is cheap (no torch, transformers, wrapt or logging).
"""

from ._control import disable, enable, is_enabled, status
from ._errors import PatchError
from ._registry import register
from ._types import Kernel, Model, Target, Variant

__version__ = "0.1.0"
__all__ = [
    "Kernel",
    "Model",
    "PatchError",
    "Target",
    "Variant",
    "disable",
    "enable",
    "is_enabled",
    "register",
    "status",
]
