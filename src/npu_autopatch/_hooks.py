"""How modeling modules reach the patcher: one mechanism, wrapt's post-import hooks.

1. enable() (or the .pth line) puts only a stdlib finder in ``sys.meta_path``: the watcher
   (_control.TransformersWatcher). It decides *when* this module and wrapt are imported
   (~70 ms, asyncio included): when transformers' body runs (the first import of one of its
   submodules), never on ``importlib.util.find_spec("transformers")``, which accelerate,
   peft and trl call to test availability. After that it answers None to every name at the
   cost of one attribute test.
2. Arming registers one wrapt hook per modeling module of the registry, all of them first
   (with discovery on, also one per installed modeling module no model covers: _discover);
   then the modules already imported are patched; then the collected strict errors are
   raised (by the caller). A strict failure never leaves a later model without its hook.
   disable() takes discovery's hooks out again; the registry's stay, inert while disabled.
3. wrapt runs a hook right after the module body, holding that module's import lock, and
   forgets it. Ours puts itself back, first in line, for the module's next execution
   (``importlib.reload``, an import retried after a failure), so those are patched in
   every order of enable(), ``import transformers`` and the modeling import. wrapt has no
   public API for a hook that outlives its first call: we use its table
   (``wrapt.importer._post_import_hooks``) under its lock; a wrapt without that table gets
   the public one-shot hook, and status() then reports a re-executed module as stock.
4. A module whose body another thread is running while we arm: wrapt's finder did not see
   that import begin, so nothing would call the hooks. We are told when the import system
   marks the spec done (``spec._initializing = False``, right after the body) and let wrapt
   call them then, in that thread.
5. trust_remote_code modules are loaded with ``spec_from_file_location`` + ``exec_module``,
   which import hooks never see: while a remote-code model is registered (and only then),
   ``transformers.dynamic_module_utils.get_class_in_module`` is wrapped to patch the module
   it returns (again when transformers re-executes it); disable() puts it back.
6. A family of modules (``Model.family``: ``module="verl.*"``, another library whose module we
   know by what it defines, not by its name): a second stdlib finder, in front of wrapt's,
   puts our hook on each module of the family as its import begins (one prefix test per
   other import); the hook patches the one that defines the model's targets
   (``_resolve.claims``) and passes over the others without importing anything.

After every hook (and at arming) a target we patched that another library replaced since
is logged once, as a WARNING (``_records.tell_overrides``): an override is said when first
seen, not only when status() is asked.

Limits: wrapt calls a module's hooks in order and stops at the first that raises, failing
the import; ours runs first, so another library's raising hook fails an import we patched
(status() then says ``pending`` / ``import-failed``, and the retried import is patched).
A finder placed in front of wrapt's later that loads modeling modules itself hides them
from every post-import hook. What runs under a module's import lock, and why it cannot
deadlock, is in _patcher.
"""

import sys

from . import _log, _resolve
from ._state import STATE, locked

REMOTE_PREFIX = "transformers_modules."
DYNAMIC = "transformers.dynamic_module_utils"


def is_remote(model):
    return model.module.startswith(REMOTE_PREFIX)


def _patcher():
    from . import _patcher  # torch comes with it: only once a modeling module is there to patch

    return _patcher


def arm_safely():
    """arm() from an import: never fail the user's import; a failure is reported, not raised."""
    try:
        for error in arm():
            _log.warning(f"strict mode: {error}")
    except Exception as exc:
        with locked:
            STATE.arm_error = f"{type(exc).__name__}: {exc}"
        _log.warning(f"could not arm the import hooks, nothing will be patched: {exc!r}")


def arm(models=None):
    """Hook every (or the given) model's module, then patch those already imported.

    With discovery on, arming every model also hooks the installed modeling modules that no
    model covers (_discover). Returns the strict-mode PatchErrors met while patching, for
    the caller to raise.
    """
    import wrapt.importer  # noqa: F401 - outside the lock: ~70 ms the first time

    listed = _listing() if models is None and _discovering() else ()  # outside the lock
    with locked:
        if not STATE.enabled:
            return []
        if models is None:
            from ._plugins import discover

            discover()
            models = list(STATE.models.values())
        remote = [m for m in STATE.models.values() if is_remote(m)]
        for model in models:
            if not is_remote(model) and not model.family:
                _hook(model.module)
        if remote:
            _hook(DYNAMIC)
        _watch_families()
        discovering = _discover().uncovered(listed) if listed and _discovering() else []
        _hook_all(discovering)
        STATE.discovery_hooked.update(discovering)
        STATE.armed = True
        STATE.arm_error = None
        imported = _imported(models) + [sys.modules[n] for n in discovering if sys.modules.get(n) is not None]
        dynamic = sys.modules.get(DYNAMIC) if remote else None
    if dynamic is not None:
        wrap_remote(dynamic)
    errors = []
    for module in imported:
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "_initializing", False):
            _call_hooks_when_done(module)  # another thread is running its body right now
            continue
        errors += _patch(module)
    tell_overrides()
    return errors


def _discovering():
    return STATE.enabled and STATE.config is not None and STATE.config.discover


def _discover():
    from . import _discover  # only with discovery on

    return _discover


def _listing():
    """The installed modeling modules; a failure to list them costs discovery only, never the table."""
    try:
        return _discover().listing()
    except Exception as exc:
        _log.warning(f"discovery: could not list transformers' modeling modules, none is discovered: {exc!r}")
        return ()


def _imported(models):
    """The modules of ``models`` already in sys.modules (patterns matched against every name).

    A family's module whose body is still running gets our hook (it cannot say yet what it
    defines); a finished one is listed only if it defines the model's targets.
    """
    names = {m.module for m in models if not is_remote(m) and not m.family}
    patterns = [m for m in models if is_remote(m) or m.family]
    heads = tuple(m.module.split("*", 1)[0] for m in patterns)  # a prefix test before fnmatch
    matching = [n for n in list(sys.modules) if n.startswith(heads) and any(m.matches(n) for m in patterns)]
    for name in matching:
        module = sys.modules.get(name)
        if module is None:
            continue
        family = [m for m in patterns if m.family and m.matches(name)]
        if family and getattr(getattr(module, "__spec__", None), "_initializing", False):
            _hook(name)
        elif family and not any(_resolve.claims(m, module) for m in family):
            continue
        names.add(name)
    return [sys.modules[n] for n in sorted(names) if sys.modules.get(n) is not None]


class FamilyWatcher:
    """Hooks each module of a family (``Model.family``) as its import begins: wrapt's finder, behind
    this one, then runs our hook after its body. One prefix test per import of any other module."""

    def __init__(self):
        self.prefixes = ()  # what every family's pattern starts with ("verl.")

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self.prefixes) or not STATE.enabled or fullname in STATE.hooked:
            return None
        if any(m.family and m.matches(fullname) for m in list(STATE.models.values())):
            with locked:
                _hook(fullname)
        return None


def _watch_families():
    """Put the family watcher before wrapt's finder, with the registry's prefixes (caller holds the lock)."""
    heads = {m.module.split("*", 1)[0] for m in STATE.models.values() if m.family}
    prefixes = tuple(sorted(head for head in heads if head))
    watcher = STATE.family_watcher
    if watcher is None:
        if not prefixes or _table() is None:
            return
        watcher = STATE.family_watcher = FamilyWatcher()
    watcher.prefixes = prefixes
    importer = sys.modules["wrapt.importer"]
    if not importer._post_import_hooks_init:  # what register_post_import_hook does first
        importer._post_import_hooks_init = True
        sys.meta_path.insert(0, importer.ImportHookFinder())
    if watcher not in sys.meta_path:
        sys.meta_path.insert(0, watcher)


def tell_overrides():
    """Log, once each, the targets another library replaced after we patched them (never raises)."""
    if not STATE.placed:
        return  # nothing patched: nothing to override (and no need for the records' module)
    try:
        from . import _instances, _records

        _instances.watch()  # forwards set on instances are found when their model first runs
        _records.tell_overrides()
    except Exception as exc:  # a hook must not fail the import that ran it
        _log.warning(f"could not check for overridden targets: {exc!r}")


def _patch(module):
    from ._records import PatchError

    try:
        _patch_module(module)
    except PatchError as exc:
        return [exc]
    return []


def _patch_module(module):
    """Patch the registered models of ``module``, or discover it; raises only strict mode's PatchError."""
    if any(_resolve.claims(m, module) for m in list(STATE.models.values())):
        _patcher().patch_imported(module)
    if module.__name__ in STATE.discovery_hooked:
        _discover().patch(module)


def _table():
    """wrapt's pending-hook table and its lock, or None (see the module docstring, point 3)."""
    importer = sys.modules["wrapt.importer"]
    table = getattr(importer, "_post_import_hooks", None)
    lock = getattr(importer, "_post_import_hooks_lock", None)
    if not isinstance(table, dict) or lock is None:
        return None
    return importer, table, lock


def _hook(name):
    """Our hook first in wrapt's list for ``name``'s next execution (once), under wrapt's lock."""
    found = _table()
    if found is None:
        if name not in STATE.hooked and name not in sys.modules:
            STATE.hooked.add(name)
            import wrapt

            wrapt.register_post_import_hook(_on_import, name)
        return
    importer, table, lock = found
    with lock:
        if not importer._post_import_hooks_init:  # what register_post_import_hook does first
            importer._post_import_hooks_init = True
            sys.meta_path.insert(0, importer.ImportHookFinder())
        pending = table.setdefault(name, [])
        if _on_import not in pending:
            pending.insert(0, _on_import)
    STATE.hooked.add(name)


def _hook_all(names):
    """_hook() for many module names (discovery's hundreds), under one acquisition of wrapt's lock."""
    found = _table()
    if found is None:
        for name in names:
            _hook(name)
        return
    with found[2]:
        for name in names:
            _hook(name)  # wrapt's lock is reentrant


def unhook_discovered():
    """Take discovery's hooks out of wrapt's table (disable(), a new selection). Caller holds the lock."""
    covered = {m.module for m in STATE.models.values()}  # a model registered since shares the hook
    names, STATE.discovery_hooked = STATE.discovery_hooked - covered, set()
    STATE.hooked -= names
    found = _table() if "wrapt.importer" in sys.modules else None
    if found is None:
        return  # wrapt's one-shot hooks stay; _on_import finds the name no longer hooked
    _importer, table, lock = found
    with lock:
        for name in names:
            pending = table.get(name)
            if pending and _on_import in pending:
                pending.remove(_on_import)
                if not pending:
                    del table[name]


def _on_import(module):
    """The hook: wrapt calls it right after ``module``'s body ran."""
    name = getattr(module, "__name__", None)
    if _table() is not None and name in STATE.hooked:
        _hook(name)  # first, so that an import failing after us is hooked when retried
    else:
        STATE.hooked.discard(name)
    if name == DYNAMIC:
        wrap_remote(module)
    elif STATE.enabled:
        try:
            _patch_module(module)  # raises only strict mode's PatchError
        finally:
            tell_overrides()


def _call_hooks_when_done(module):
    """Call wrapt's hooks for ``module`` when the import system marks its spec done."""
    spec = module.__spec__
    base = type(spec)
    importer = sys.modules["wrapt.importer"]

    def finished():
        try:
            if sys.modules.get(module.__name__) is module:  # the body did not fail
                importer.notify_module_loaded(module)
        except Exception as exc:  # inside the import system's finally: report, never raise
            _log.warning(f"{module.__name__}: not patched after its import finished: {exc!r}")

    class DoneSpec(base):
        def __setattr__(self, name, value):
            base.__setattr__(self, name, value)
            if name == "_initializing" and not value and type(self) is DoneSpec:
                self.__class__ = base
                finished()

    spec.__class__ = DoneSpec
    if not getattr(spec, "_initializing", False) and type(spec) is DoneSpec:  # it ended meanwhile
        spec.__class__ = base
        finished()


def wrap_remote(dynamic_module_utils):
    """Wrap get_class_in_module while a remote-code model is registered; never raise."""
    import functools  # not at interpreter start: it pulls in collections (~1 ms)

    try:
        with locked:
            if STATE.remote_wrapped is not None or not STATE.enabled:
                return
            if not any(is_remote(m) for m in STATE.models.values()):
                return
            original = dynamic_module_utils.get_class_in_module

            @functools.wraps(original)
            def get_class_in_module(*args, **kwargs):
                cls = original(*args, **kwargs)
                module = sys.modules.get(getattr(cls, "__module__", ""))
                if module is not None and STATE.enabled:
                    _patcher().patch_imported(module)
                return cls

            dynamic_module_utils.get_class_in_module = get_class_in_module
            STATE.remote_wrapped = (dynamic_module_utils, original, get_class_in_module)
    except Exception as exc:  # a post-import hook must not fail transformers' import
        _log.warning(f"trust_remote_code models will not be patched: {exc!r}")


def unwrap_remote():
    """Put get_class_in_module back (unless another library wrapped it after us). Caller holds the lock."""
    if STATE.remote_wrapped is None:
        return
    dynamic_module_utils, original, ours = STATE.remote_wrapped
    STATE.remote_wrapped = None
    if dynamic_module_utils.get_class_in_module is ours:
        dynamic_module_utils.get_class_in_module = original
