"""enable(), disable(), status(): the package state behind one lock.

Cheap to import (stdlib only): it runs at interpreter start when NPU_AUTOPATCH is set.
Nothing heavy happens until transformers is imported:

1. enable() records the configuration and, if transformers is not imported yet, puts a tiny
   finder at the front of sys.meta_path that only watches for the name "transformers".
2. When transformers is imported, the watcher arms the wrapt post-import hooks, one per
   supported modeling module (this is when wrapt itself is imported: ~70 ms that a process
   which never touches transformers does not pay).
3. When a modeling module is imported, its hook patches that one model (_patcher).
"""

from __future__ import annotations

import _thread
import sys

from . import _config, _log
from .models import MODELS

TYPE_CHECKING = False
if TYPE_CHECKING:  # without importing typing at interpreter start
    from collections.abc import Iterable

    from ._records import PatchRecord

_lock = _thread.RLock()
_enabled = False
_config_now = None  # the Config of the current enable()
_armed = False  # wrapt hooks registered (transformers has been imported)
_watcher = None
_PATCHER = __package__ + "._patcher"


class _TransformersWatcher:
    """Arms the wrapt hooks the moment ``import transformers`` starts, then stays inert.

    It never finds anything itself (returns None), so the import goes on through the
    normal finders. It stays in sys.meta_path even when inert: removing it while the import
    system is iterating over sys.meta_path could make the next finder be skipped.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformers" and _enabled and not _armed:
            try:
                _arm()
            except Exception as exc:  # never fail the user's import
                _log.warning(f"could not arm the import hooks, nothing will be patched: {exc!r}")
        return None


def _arm():
    """Register the wrapt hooks and patch the modeling modules already imported."""
    global _armed
    with _lock:
        from . import _hooks

        _hooks.arm(MODELS.values())
        _armed = True


def enable(
    models: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
    kernels: Iterable[str] | str | None = None,
    strict: bool | None = None,
    force: bool = False,
) -> None:
    """Patch every selected model as soon as (or if already) its modeling module is imported.

    Arguments override NPU_AUTOPATCH_MODELS / _EXCLUDE / _KERNELS / _STRICT. Calling it
    again with the same selection does nothing; with another selection, the models patched
    so far are reverted and the new selection is applied. Imports none of torch,
    transformers or torch_npu unless a modeling module is already imported.
    """
    global _enabled, _config_now, _watcher
    config = _config.resolve(models, exclude, kernels, strict, force, warn=_log.warning)
    with _lock:
        if _enabled and config == _config_now:
            return
        patcher = sys.modules.get(_PATCHER)
        if patcher is not None:
            patcher.revert_all()
            patcher.forget()  # decisions taken under the previous selection no longer hold
        _config_now = config
        _enabled = True
        if "transformers" in sys.modules:
            _arm()
        elif _watcher is None:
            _watcher = _TransformersWatcher()
            sys.meta_path.insert(0, _watcher)


def disable() -> None:
    """Put every replaced attribute back (the identical original object); later hooks do nothing.

    A target that another library replaced after us keeps that library's object.
    """
    global _enabled
    with _lock:
        _enabled = False
        patcher = sys.modules.get(_PATCHER)
        if patcher is not None:
            patcher.revert_all()


def is_enabled() -> bool:
    """Whether patching is on in this process (by NPU_AUTOPATCH, a sitecustomize or enable())."""
    return _enabled


def patch_module(module) -> None:
    """The body of every post-import hook: patch the models that live in ``module``."""
    with _lock:
        if not _enabled:
            return
        name = getattr(module, "__name__", None)
        from . import _patcher

        for model in [m for m in MODELS.values() if m.module == name]:
            _patcher.apply(model, module, _config_now)


def status() -> dict[str, PatchRecord]:
    """One record per supported model type: state, reason, kernels and replaced targets."""
    with _lock:
        from . import _patcher
        from ._records import PENDING, SKIPPED

        report = {}
        for model_type, model in MODELS.items():
            rec = _patcher.live_record(model_type)
            if rec is None:
                if not _enabled:
                    rec = _patcher.describe(model, PENDING, "patching is not enabled")
                elif _config_now.wants(model_type) is not None:
                    rec = _patcher.describe(model, SKIPPED, _config_now.wants(model_type))
                else:
                    rec = _patcher.describe(model, PENDING, f"waiting for the import of {model.module}")
            report[model_type] = rec
        return report
