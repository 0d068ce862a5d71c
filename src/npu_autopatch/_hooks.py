"""The wrapt post-import hooks, one per supported modeling module.

Imported only once transformers is being imported (wrapt pulls asyncio: ~70 ms).

wrapt calls a hook right after the module body ran, while that module's import lock is
held, and lets any exception escape into the importer, which then fails the user's import
and drops the module from sys.modules. So the hook body is isolated: only a PatchError in
strict mode, which the user asked for, gets through. Hooks never start or join threads and
import nothing but torch_npu (once, at the first hook).
"""

import sys

import wrapt

from . import _control, _log
from ._errors import PatchError

_registered = set()  # modules with a hook waiting in wrapt (wrapt drops a hook once it fired)


def _on_import(module):
    _registered.discard(getattr(module, "__name__", None))
    try:
        _control.patch_module(module)
    except PatchError:
        raise
    except Exception as exc:
        _log.warning(
            f"internal error while patching {getattr(module, '__name__', module)!r}, left stock: {exc!r}"
        )


def arm(models):
    """Patch the modules already imported; hook the others. Safe to call again."""
    for model in models:
        module = sys.modules.get(model.module)
        if module is not None:
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                # Another thread is executing its body right now; patching a half-built module
                # could fail spuriously. It is reported as pending; enable() again patches it.
                continue
            _control.patch_module(module)
        elif model.module not in _registered:
            _registered.add(model.module)
            wrapt.register_post_import_hook(_on_import, model.module)
