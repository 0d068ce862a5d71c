"""The public API: enable(), disable(), status(), is_enabled(), register(), unregister().

Cheap to import (stdlib only): it runs at interpreter start when NPU_AUTOPATCH is set.
Nothing heavy happens until transformers is imported (see _hooks); status() imports
neither torch nor wrapt and reads no package metadata.

enable() and disable() are symmetric: enable() arms the hooks and patches what is already
imported; disable() puts back every object we replaced or wrapped (our kernels, the
experts-registry entries, get_class_in_module) and removes discovery's hooks, leaving later
imports stock.
"""

from __future__ import annotations

import sys

from . import _config, _log
from ._state import STATE, locked
from ._types import Model
from .models import MODELS  # the shipped table (read-only): a built-in comes back from it after unregister()

TYPE_CHECKING = False
if TYPE_CHECKING:  # without importing typing at interpreter start
    from collections.abc import Iterable

    from ._records import PatchRecord
    from ._types import Target


def _hooks():
    """The hooks module (wrapt's side), imported when first needed."""
    from . import _hooks as hooks

    return hooks


class TransformersWatcher:
    """Arms the hooks when transformers' body starts importing its own submodules.

    The only finder we put in sys.meta_path ourselves; it decides *when* wrapt is imported
    (see _hooks). One attribute test per unrelated import. It stays in sys.meta_path when
    inert: removing a finder while the import system iterates over it could skip the next.
    """

    def find_spec(self, fullname, path=None, target=None):
        if STATE.armed or not STATE.enabled or not fullname.startswith("transformers."):
            return None
        _hooks().arm_safely()
        return None


def _ledger():
    """The ledger module, imported when first needed (nothing is in it at interpreter start)."""
    from . import _ledger as ledger

    return ledger


def discover_plugins() -> None:
    """Read the installed plugins' entry points now (the CLI lists them before any import)."""
    from . import _plugins

    with locked:
        _plugins.discover()


def enable(
    models: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
    kernels: Iterable[str] | str | None = None,
    strict: bool | None = None,
    force: bool = False,
    discover: bool | None = None,
    **switches: bool | None,
) -> None:
    """Patch every selected model as soon as (or if already) its modeling module is imported.

    ``discover=True`` also patches the modeling modules no registered model covers, from the
    candidates the kernels' probes accept (see _discover). An opt-in kernel's switch turns it on
    (``loss=True``: the chunked loss kernel, kernels/loss.py, opt-in since a forward training with
    labels then returns ``logits=None``), a switched-on kernel's turns it off (``step_aside=False``:
    verl's own NPU patch runs as without us, integrations/verl.py); an unknown keyword raises
    TypeError. Arguments override
    NPU_AUTOPATCH_MODELS / _EXCLUDE / _KERNELS / _STRICT / _DISCOVER / _<SWITCH>. Calling it
    again with the same selection does nothing; with another selection, the models patched
    so far are reverted and the new selection is applied. Imports none of torch,
    transformers or torch_npu unless a modeling module is already imported. In strict mode
    a PatchError is raised after every hook is armed and every imported module was tried.
    """
    mistakes: list[str] = []
    config = _resolve(models, exclude, kernels, strict, force, discover, switches, mistakes.append)
    for line in mistakes:  # one rank-0 WARNING per mistake in the environment's selection
        _log.warning(line)
    _apply(config)


def selection_mistakes() -> list[str]:
    """What enable() with no arguments would warn about the environment's selection, one line per
    mistake (an unknown name, a selection that patches no model, a word that is no boolean): for
    ``check``, which fails on them where a job would only warn. Applies nothing."""
    mistakes: list[str] = []
    _resolve(None, None, None, None, False, None, {}, mistakes.append)
    return mistakes


def _resolve(models, exclude, kernels, strict, force, discover, switches, warn):
    """The selection enable() applies (``_config.resolve``), its mistakes given to ``warn``."""
    with locked:
        discover = _config.discover_wanted(discover, warn)
        unknown = _config.requested_models(models, exclude) - set(STATE.models)
        if unknown:
            from . import _plugins  # perhaps an installed plugin's model: look (rarely needed)

            _plugins.discover()
            unknown -= set(STATE.models)
        valid = list(STATE.models)
        if unknown and discover:  # a model type discovery will meet (a stat per name, no import)
            from . import _discover

            valid += sorted(_discover.installed(unknown))
        return _config.resolve(
            models, exclude, kernels, strict, force, warn, valid, discover=discover, **switches
        )


def _apply(config):
    """enable() with a resolved selection."""
    with locked:
        if STATE.enabled and config == STATE.config:
            return
        _revert_all("a new selection replaced the previous one")
        _forget_discovered()
        STATE.records.clear()  # decisions taken under the previous selection no longer hold
        STATE.calls.clear()  # each enable() counts its replacements' calls from zero
        STATE.config = config
        STATE.enabled = True
        _new_generation()
        arm_now = "transformers" in sys.modules
        if not arm_now and STATE.watcher is None:
            STATE.watcher = TransformersWatcher()
            sys.meta_path.insert(0, STATE.watcher)
    if arm_now:
        errors = _arm()
        if errors:
            raise errors[0]


def selection() -> _config.Config | None:
    """The active selection (a ``_config.Config``), or None while patching is off.

    For a tool that turns patching off for a while (``verify``): restore() puts back exactly this,
    where a bare enable() would lose the user's models, exclusions, kernels and strictness.
    """
    with locked:
        return STATE.config if STATE.enabled else None


def restore(chosen: _config.Config | None) -> None:
    """Put back a selection() taken earlier: that very selection enabled, or patching off for None."""
    if chosen is None:
        disable()
    else:
        _apply(chosen)


def _arm(models=None):
    """Arm the hooks; a failure to arm is recorded and logged, never raised. Returns strict errors."""
    try:
        return _hooks().arm(models)
    except Exception as exc:
        with locked:
            STATE.arm_error = f"{type(exc).__name__}: {exc}"
        _log.warning(f"could not arm the import hooks, nothing will be patched: {exc!r}")
        return []


def _new_generation():
    """Decisions cached for the previous enable() (device, requirements) no longer hold."""
    STATE.generation += 1
    STATE.device = None
    STATE.requirements.clear()
    STATE.kernel_notes.clear()


def _revert_all(why):
    """Release every slot; a patched model's record says ``reverted``, the others are forgotten."""
    for model_type in list(STATE.held):
        _ledger().release_all(model_type)
    STATE.overrides_told.clear()  # a later patch that is overridden again is told again
    if not STATE.records:
        return  # at interpreter start: no need for the records' module (dataclasses, enum)
    from dataclasses import replace

    from ._records import ReasonCode, State

    for model_type, rec in list(STATE.records.items()):
        if rec.state in (State.APPLIED, State.PARTIAL, State.OVERRIDDEN):
            STATE.records[model_type] = replace(
                rec, state=State.REVERTED, cause=why, code=ReasonCode.DISABLED, stock_reasons={}
            )
        elif rec.state is not State.REVERTED:
            del STATE.records[model_type]


def _forget_discovered():
    """Drop discovery's hooks and models: a new selection discovers afresh. Caller holds the lock."""
    if STATE.discovery_hooked:
        _hooks().unhook_discovered()
    STATE.discovered.clear()
    STATE.refused.clear()


def disable() -> None:
    """Put every replaced attribute back (the identical original object); later imports stay stock.

    A target that another library replaced after us keeps that library's object. Discovery's
    hooks are removed; the discovered models stay listed by status() (``reverted``).
    """
    with locked:
        STATE.enabled = False
        _new_generation()
        _revert_all("disable() restored the originals")
        if STATE.discovery_hooked:
            _hooks().unhook_discovered()
        if STATE.remote_wrapped is not None:
            _hooks().unwrap_remote()


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
    with locked:
        existing = STATE.models.get(model.model_type)
        if existing is not None and not replace:
            kind = (
                "a built-in model"
                if existing.load is None and model.model_type in MODELS
                else "already registered"
            )
            raise ValueError(f"{model.model_type!r} is {kind}; pass replace=True to replace it")
        for discovered in [t for t, m in STATE.discovered.items() if m.module == model.module]:
            _forget(discovered)  # a registered model replaces what discovery made of its module
            STATE.discovered.pop(discovered)
            STATE.refused.pop(discovered, None)
            STATE.discovery_hooked.discard(model.module)
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
    with locked:
        if model_type not in STATE.models:
            raise ValueError(f"{model_type!r} is not registered")
        _forget(model_type)
        if model_type in MODELS:
            STATE.models[model_type] = MODELS[model_type]
        else:
            del STATE.models[model_type]
        if STATE.remote_wrapped is not None and not any(_hooks().is_remote(m) for m in STATE.models.values()):
            _hooks().unwrap_remote()


def _forget(model_type):
    _ledger().release_all(model_type)
    STATE.records.pop(model_type, None)
    STATE.kernel_notes.pop(model_type, None)


def status() -> dict[str, PatchRecord]:
    """One record per known model type: state, reason code and text, kernels, targets, variants.

    Cheap: no torch, no wrapt. Once patching is on, the installed plugins' models are listed too
    (read from their entry points, once per process: tens of milliseconds, never at interpreter
    start), before transformers is imported: a job asking whether its plugin's model will be patched
    gets the answer. While patching is off nothing reads package metadata
    (``python -m npu_autopatch status`` lists them all the same).
    """
    from ._records import live_records  # dataclasses and enum: only when asked

    with locked:
        if STATE.enabled:
            from . import _plugins

            _plugins.discover()  # once per process
        return live_records()
