"""The public API: enable(), disable(), status(), is_enabled(), register(), unregister().

Cheap to import (stdlib only): it runs at interpreter start when NPU_AUTOPATCH is set.
Nothing heavy happens until transformers is imported (see _hooks); status() imports
neither torch nor wrapt and reads no package metadata.

enable() and disable() are symmetric: enable() arms the hooks and patches what is already
imported; disable() puts back every object we replaced or wrapped (our kernels, the
experts-registry entries, get_class_in_module), leaving later imports stock.
"""

from __future__ import annotations

import os
import sys

from . import _config, _hooks, _log
from ._state import STATE
from ._types import Model

TYPE_CHECKING = False
if TYPE_CHECKING:  # without importing typing at interpreter start
    from collections.abc import Iterable

    from ._records import PatchRecord
    from ._types import Target

_BUILTIN = dict(STATE.models)  # the shipped table, to restore a built-in after unregister()


def _ledger():
    """The ledger module, imported when first needed (nothing is in it at interpreter start)."""
    from . import _ledger as ledger

    return ledger


def discover_plugins() -> None:
    """Read the installed plugins' entry points now (the CLI lists them before any import)."""
    from . import _plugins

    with _log.locked:
        _plugins.discover()


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
    transformers or torch_npu unless a modeling module is already imported. In strict mode
    a PatchError is raised after every hook is armed and every imported module was tried.
    """
    with _log.locked:
        if not _config.requested_models(models, exclude) <= set(STATE.models):
            from . import _plugins  # perhaps an installed plugin's model: look (rarely needed)

            _plugins.discover()
        config = _config.resolve(models, exclude, kernels, strict, force, _log.warning, STATE.models)
        if STATE.enabled and config == STATE.config:
            return
        _revert_all("a new selection replaced the previous one")
        STATE.records.clear()  # decisions taken under the previous selection no longer hold
        STATE.config = config
        STATE.enabled = True
        _new_generation()
        arm_now = "transformers" in sys.modules
        if not arm_now:
            _hooks.install_watcher()
    if arm_now:
        errors = _arm()
        if errors:
            raise errors[0]


def _arm(models=None):
    """Arm the hooks; a failure to arm is recorded and logged, never raised. Returns strict errors."""
    try:
        return _hooks.arm(models)
    except Exception as exc:
        with _log.locked:
            STATE.arm_error = f"{type(exc).__name__}: {exc}"
        _log.warning(f"could not arm the import hooks, nothing will be patched: {exc!r}")
        return []


def _new_generation():
    """Decisions cached for the previous enable() (device, requirements) no longer hold."""
    STATE.generation += 1
    STATE.device = None
    STATE.requirements.clear()
    STATE.explicit_experts.clear()


def _revert_all(why):
    """Release every slot; a patched model's record says ``reverted``, the others are forgotten."""
    for model_type in list(STATE.held):
        _ledger().release_all(model_type)
    if not STATE.records:
        return  # at interpreter start: no need for the records' module (dataclasses, enum)
    from ._records import ReasonCode, State

    for model_type, rec in list(STATE.records.items()):
        if rec.state in (State.APPLIED, State.PARTIAL, State.OVERRIDDEN):
            STATE.records[model_type] = type(rec)(
                rec.model,
                rec.module,
                State.REVERTED,
                why,
                rec.kernels,
                rec.targets,
                ReasonCode.DISABLED,
                rec.variants,
                rec.stock,
            )
        elif rec.state is not State.REVERTED:
            del STATE.records[model_type]


def disable() -> None:
    """Put every replaced attribute back (the identical original object); later imports stay stock.

    A target that another library replaced after us keeps that library's object.
    """
    with _log.locked:
        STATE.enabled = False
        _new_generation()
        _revert_all("disable() restored the originals")
        _hooks.unwrap_remote()


def is_enabled() -> bool:
    """Whether patching is on in this process (by NPU_AUTOPATCH, a sitecustomize or enable())."""
    return STATE.enabled


def register(
    model_type: str | Model,
    *,
    targets: Iterable[Target] = (),
    module: str | None = None,
    replace: bool = False,
) -> Model:
    """Add (or with ``replace=True`` replace) a model: ``register("acme", targets=[Target(...)])``.

    ``module`` defaults to ``transformers.models.<type>.modeling_<type>``; for a
    ``trust_remote_code`` model, give a pattern such as ``"transformers_modules.*.modeling_acme"``.
    Registering after enable() arms the hook at once (and patches the module now if it is
    already imported). Registering a model type that exists raises ValueError unless
    ``replace=True``: the model patched so far is then reverted first.
    """
    model = model_type if isinstance(model_type, Model) else Model(model_type, *targets, module=module)
    if not model.targets and model.load is None:
        raise ValueError(f"register({model.model_type!r}): no targets given")
    with _log.locked:
        existing = STATE.models.get(model.model_type)
        if existing is not None and not replace:
            kind = (
                "a built-in model"
                if existing.load is None and model.model_type in _BUILTIN
                else "already registered"
            )
            raise ValueError(f"{model.model_type!r} is {kind}; pass replace=True to replace it")
        _forget(model.model_type)
        STATE.models[model.model_type] = model
        arm_now = STATE.enabled and STATE.armed
    if arm_now:
        errors = _arm([model])
        if errors:
            raise errors[0]
    return model


def unregister(model_type: str) -> None:
    """Undo register(): revert the model and drop it (a replaced built-in model comes back)."""
    with _log.locked:
        if model_type not in STATE.models:
            raise ValueError(f"{model_type!r} is not registered")
        _forget(model_type)
        if model_type in _BUILTIN:
            STATE.models[model_type] = _BUILTIN[model_type]
        else:
            del STATE.models[model_type]
        if not any(_hooks.is_remote(m) for m in STATE.models.values()):
            _hooks.unwrap_remote()


def _forget(model_type):
    _ledger().release_all(model_type)
    STATE.records.pop(model_type, None)
    STATE.explicit_experts.pop(model_type, None)


def status() -> dict[str, PatchRecord]:
    """One record per known model type: state, reason code and text, kernels, targets, variants.

    Cheap: no torch, no wrapt, no package metadata (installed plugins are listed once
    transformers is imported, or by ``python -m npu_autopatch status``).
    """
    with _log.locked:
        roots = _transformers_roots()
        return {model_type: _live(model, roots) for model_type, model in list(STATE.models.items())}


def _live(model, roots):
    """The record of ``model`` as things stand now (caller holds the lock)."""
    from ._experts import explicit_note
    from ._records import PatchRecord, ReasonCode, State

    model_type = model.model_type
    rec = STATE.records.get(model_type)
    if rec is None:
        unwanted = STATE.config.wants(model_type) if STATE.config is not None and STATE.enabled else None
        if not STATE.enabled:
            state, code, reason = State.OFF, "not-enabled", "patching is not enabled"
        elif STATE.arm_error is not None:
            state, code, reason = (
                State.FAILED,
                "hooks-failed",
                f"the import hooks could not be armed: {STATE.arm_error}",
            )
        elif unwanted is not None:
            state, (code, reason) = State.SKIPPED, unwanted
        elif _absent(model, roots):
            state, code, reason = (
                State.ABSENT,
                "module-absent",
                f"{model.module} is not in the installed transformers",
            )
        else:
            state, code, reason = (
                State.PENDING,
                "waiting-for-import",
                f"waiting for the import of {model.module}",
            )
        rec = PatchRecord(model_type, model.module, state, reason, code=ReasonCode(code))
    elif rec.state in (State.APPLIED, State.PARTIAL) and model_type in STATE.placed:
        rec = _downgraded(rec, model_type) or rec
        note = explicit_note(model_type)
        if note and rec.state in (State.APPLIED, State.PARTIAL):
            rec = _with(rec, reason="; ".join(r for r in (rec.reason, note) if r))
    module = sys.modules.get(model.module)
    if module is not None and model.targets:
        shared = _ledger().shared_targets(model, module)
        if shared:
            told = "; ".join(f"{where} (held by {', '.join(holders)})" for where, holders in shared.items())
            extra = f"still runs kernels through targets it shares with other models: {told}"
            if rec.state in (State.APPLIED, State.PARTIAL):
                extra = None  # a model that holds kernels itself: its targets say it
            rec = _with(rec, shared=shared, reason="; ".join(r for r in (rec.reason, extra) if r))
    return rec


def _with(rec, **changes):
    from dataclasses import replace

    return replace(rec, **changes)


def _downgraded(rec, model_type):
    """The record downgraded when what it claims no longer holds, else None."""
    from ._records import ReasonCode, State

    placed_module = STATE.placed[model_type][0]
    moved = _ledger().moved(model_type, sys.modules.get(placed_module.__name__))
    if moved is not None and moved[0] == "gone":
        return _with(
            rec,
            state=State.PENDING,
            code=ReasonCode.IMPORT_FAILED,
            reason=f"the import of {placed_module.__name__} failed after it was patched (did another "
            "library's post-import hook raise?); it is patched when imported again",
        )
    if moved is not None:
        return _with(rec, state=State.OVERRIDDEN, code=ReasonCode(moved[0]), reason=moved[1])
    latest = {key for _path, key in STATE.placed[model_type][1]}
    for key in STATE.held.get(model_type, ()):
        slot = STATE.slots.get(key)
        if slot is None or key not in latest:
            continue
        now = slot.current()
        if now is not slot.replacement:
            return _with(
                rec,
                state=State.OVERRIDDEN,
                code=ReasonCode.REPLACED_AFTER_US,
                reason=f"{slot.where} was replaced after us by {_ledger().foreign_holder(now)}",
            )
    return None


def _transformers_roots():
    """The directories transformers' package lives in, found without importing it (or None)."""
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        return list(getattr(transformers, "__path__", ()))
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("transformers")
    return list(spec.submodule_search_locations or ()) if spec is not None else []


def _absent(model, roots):
    """Whether a transformers.models.* module is missing from the installed transformers."""
    parts = model.module.split(".")
    if parts[:2] != ["transformers", "models"] or "*" in model.module:
        return False
    for root in roots:
        base = os.path.join(root, *parts[1:])
        if os.path.exists(base + ".py") or os.path.isdir(base):
            return False
    return True
