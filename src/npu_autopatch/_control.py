"""enable(), disable(), status(): the package state behind one lock.

Cheap to import (stdlib only): it runs at interpreter start when NPU_AUTOPATCH is set.
Nothing heavy happens until transformers is imported:

1. enable() records the configuration and, if transformers is not imported yet, puts a tiny
   finder at the front of sys.meta_path (the watcher).
2. When transformers is imported, the watcher arms the wrapt post-import hooks, one per
   supported modeling module (this is when wrapt itself is imported: ~70 ms that a process
   which never touches transformers does not pay).
3. Every time a supported modeling module's body is about to run, the watcher wraps the
   module's loader, so that the model is patched right after the body (_patcher). That
   covers the first import, ``importlib.reload`` and an import retried after one that
   failed: wrapt's hooks run only once per name and never on reload. Our patch comes before
   any wrapt hook, whoever registered first (wrapt's finder asks the meta path again, and
   so asks the watcher). The wrapt hook is the fallback for an import that a finder in
   front of the watcher takes without asking the meta path again; it does nothing when
   the watcher's loader ran for that execution of the module.
"""

from __future__ import annotations

import _thread
import os
import sys

from . import _config, _log
from ._errors import PatchError
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
_MODULES = {model.module for model in MODELS.values()}  # refreshed when arming: models may be added
_watched = {}  # module name -> the spec whose loader the watcher wrapped last

# A fork while another thread is inside a patch transaction would give the child a lock
# held by a thread that does not exist there (every later hook, enable() or status() in
# the child would hang) and a half-made transaction. As the logging module does for its
# own lock, take the lock around fork(): the fork waits for the transaction to end, and
# the child starts with the lock free and the state consistent.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_lock.release)


class _Locked:
    """``with _locked:`` holds the package lock; what is logged meanwhile is written after."""

    def __enter__(self):
        _lock.acquire()
        _log.defer()

    def __exit__(self, *exc_info):
        try:
            messages = _log.resume()
        finally:
            _lock.release()
        _log.write(messages)


_locked = _Locked()


class _TransformersWatcher:
    """Arms the wrapt hooks when ``import transformers`` starts; patches modeling modules.

    For every other name it returns None at once (one comparison and one set lookup per
    import), so the import goes on through the normal finders. It stays in sys.meta_path
    even when inert: removing it while the import system is iterating over sys.meta_path
    could make the next finder be skipped.
    """

    def __init__(self):
        self._busy = set()  # (thread, name) while we ask the finders after us ourselves

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformers":
            if _enabled and not _armed:
                try:
                    _arm()
                except Exception as exc:  # never fail the user's import
                    _log.warning(f"could not arm the import hooks, nothing will be patched: {exc!r}")
            return None
        if fullname in _MODULES and _enabled and _armed:
            return self._spec_patched_after_exec(fullname, path, target)
        return None

    def _spec_patched_after_exec(self, fullname, path, target):
        """The spec the finders after us give, its loader wrapped to patch after exec.

        A finder after us may ask the whole meta path again (wrapt's does, when it stands
        after us because it was installed before enable()); we then answer None, and wrap
        whatever loader it returns.
        """
        busy = (_thread.get_ident(), fullname)
        if busy in self._busy:  # a finder after us asked the whole meta path again
            return None
        self._busy.add(busy)
        try:
            spec = None
            after_us = False
            for finder in list(sys.meta_path):
                if finder is self:
                    after_us = True
                    continue
                find_spec = getattr(finder, "find_spec", None) if after_us else None
                if find_spec is not None:
                    spec = find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._busy.discard(busy)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _PatchAfterExec(loader)
            _watched[fullname] = spec
        return spec


def watched(module) -> bool:
    """Whether the watcher's loader runs this execution of ``module`` (the wrapt hook then waits)."""
    return _watched.get(getattr(module, "__name__", None)) is getattr(module, "__spec__", None)


class _PatchAfterExec:
    """A module loader that runs the real one, then patches the models of the module.

    Everything but create_module/exec_module goes to the real loader, which is also put
    back in ``__loader__`` and ``__spec__.loader`` before the body runs, as wrapt does.
    """

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "loader", None) is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        patch_imported(module)


def _arm():
    """Register the wrapt hooks and patch the modeling modules already imported."""
    global _armed
    with _locked:
        from . import _hooks, _plugins

        _plugins.discover()
        models = list(MODELS.values())
        _hooks.arm(models)
        _MODULES.update(model.module for model in models)
        _armed = True


def watch(model) -> None:
    """Start watching a model added at run time (register()); patch it now if imported."""
    with _locked:
        _MODULES.add(model.module)
        if _armed:
            from . import _hooks

            _hooks.arm([model])


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
    with _locked:
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
    with _locked:
        _enabled = False
        patcher = sys.modules.get(_PATCHER)
        if patcher is not None:
            patcher.revert_all()


def is_enabled() -> bool:
    """Whether patching is on in this process (by NPU_AUTOPATCH, a sitecustomize or enable())."""
    return _enabled


def patch_imported(module) -> None:
    """The post-import hook: patch ``module``, never failing the import that ran it.

    Only a PatchError in strict mode, which the user asked for, gets through.
    """
    try:
        patch_module(module)
    except PatchError:
        raise
    except Exception as exc:
        _log.warning(
            f"internal error while patching {getattr(module, '__name__', module)!r}, left stock: {exc!r}"
        )


def patch_module(module) -> None:
    """Patch the models that live in ``module`` (again, if its body ran again)."""
    with _locked:
        if not _enabled:
            return
        name = getattr(module, "__name__", None)
        from . import _patcher

        for model in [m for m in MODELS.values() if m.module == name or _remote_match(m, name)]:
            _patcher.apply(model, module, _config_now)


def _remote_match(model, name):
    """A trust_remote_code model's module pattern ("transformers_modules.*.modeling_x")."""
    if not model.module.startswith("transformers_modules.") or not name:
        return False
    from ._remote import matches

    return matches(model, name)


def status() -> dict[str, PatchRecord]:
    """One record per supported model type: state, reason, kernels and replaced targets."""
    with _locked:
        from . import _patcher, _plugins
        from ._records import PENDING, SKIPPED

        _plugins.discover()  # so that installed plugins are listed before they are imported

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
