"""Opt-in discovery: patch the modeling modules no registered model covers, as table models are.

On with ``enable(discover=True)`` or ``NPU_AUTOPATCH_DISCOVER=1``; off, nothing here runs.
When the hooks are armed (transformers' body runs), the installed transformers' modeling
modules are listed from its directory (once per process, nothing imported) and each one that
no registered model (table, plugin, register()) covers gets the same post-import hook as a
table model. When such a module is imported, its own classes and functions whose names look
like a target are nominated (_candidates) and probed; the accepted ones become the Targets of
a Model that goes through the table models' transaction (_patcher.apply): requirements, probes
again, commit, status(), disable(), strict mode.

Decisions (docs/design.md's "Discovery (opt-in)" says the same):

- Model type: the package directory (``exaone4``); a directory's other modeling modules get
  ``<directory>.<rest of the file name>`` (``esm.esmfold`` for ``esm/modeling_esmfold.py``).
  A module whose model type is already registered (a plugin for another module) is left alone.
- Targets are the candidates the probes accept. A candidate nominated by its name only and
  refused by every kernel is not a target: status() lists it under ``refused``; it never makes
  the model ``partial`` and never raises in strict mode. ``partial`` still comes from the
  device (an accepted target the installed torch_npu cannot run), as for table models.
- Only code the module defines: a class it imports from another modeling module belongs to
  that module's model, so discovery never puts a kernel into an excluded table model's class.
- No accepted candidate: ``skipped`` with ``no-target`` (the refused ones listed), logged at
  DEBUG only; a module where nothing even looks like a target (``modeling_bert``,
  ``modeling_auto``) is not listed at all: importing a module with nothing to patch is not news.
"""

import os
import sys

from . import _log
from ._state import STATE, locked

PREFIX = "transformers.models."


def model_type_for(module_name):
    """``transformers.models.esm.modeling_esmfold`` -> ``esm.esmfold`` (the directory's own: ``esm``)."""
    folder, stem = module_name[len(PREFIX) :].split(".")
    rest = stem[len("modeling_") :]
    return folder if rest == folder else f"{folder}.{rest}"


def _module_file(root, model_type):
    folder, _, rest = model_type.partition(".")
    return os.path.join(root, "models", folder, f"modeling_{rest or folder}.py")


def _roots():
    """transformers' package directories, found without importing it."""
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        return list(getattr(transformers, "__path__", ()))
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("transformers")
    return list(spec.submodule_search_locations or ()) if spec is not None else []


def installed(names):
    """The names among ``names`` that are model types discovery can meet (one stat each, nothing
    imported): so that ``enable(exclude=["doge"], discover=True)`` is valid before doge is imported."""
    roots = _roots()
    wellformed = [
        n for n in names if 1 <= len(n.split(".")) <= 2 and all(p.isidentifier() for p in n.split("."))
    ]
    return {n for n in wellformed if any(os.path.isfile(_module_file(r, n)) for r in roots)}


def listing():
    """Every modeling module name of the imported transformers, listed once per process.

    Called outside the package lock (a directory walk); the caller chooses what to hook.
    """
    roots = list(getattr(sys.modules.get("transformers"), "__path__", ()))[:1]
    cached = STATE.listing
    if cached is not None and cached[0] == roots:
        return cached[1]
    from ._candidates import modeling_modules

    names = tuple(n for root in roots for found in modeling_modules(root).values() for n in found)
    STATE.listing = (roots, names)
    return names


def uncovered(names):
    """The module names no registered model covers (caller holds the lock)."""
    covered = {m.module for m in STATE.models.values()}
    return [n for n in names if n not in covered and model_type_for(n) not in STATE.models]


def patch(module):
    """The discovery half of a hook: build ``module``'s Model and apply it.

    Raises only strict mode's PatchError (from _patcher.apply); anything else is that model
    failing, reported, never the user's import failing.
    """
    from ._records import PatchRecord, ReasonCode, State
    from ._types import Model

    name = module.__name__
    model_type = model_type_for(name)
    with locked:
        if not (STATE.enabled and STATE.config.discover) or uncovered([name]) != [name]:
            return
        config, generation = STATE.config, STATE.generation
    try:
        model, refused = _model(module, model_type, config)
    except Exception as exc:
        with locked:
            STATE.discovered[model_type] = Model(model_type, module=name)  # so that status() lists it
            STATE.records[model_type] = PatchRecord(
                model_type,
                name,
                State.FAILED,
                f"internal error, left stock: {exc!r}",
                code=ReasonCode.INTERNAL_ERROR,
            )
        _log.warning(f"internal error while discovering {model_type} in {name!r}, left stock: {exc!r}")
        return
    wanted = config.wants(model_type) is None
    if wanted and not model.targets and not refused:
        return  # nothing here even looks like a target (bert, auto): not a model we could patch
    with locked:
        if STATE.generation != generation:
            return  # enable()/disable() came in between: their decision holds
        STATE.discovered[model_type] = model
        STATE.refused[model_type] = refused
        if wanted and not model.targets:
            STATE.records[model_type] = PatchRecord(
                model_type,
                name,
                State.SKIPPED,
                "no candidate is a target: the kernels' probes refused each (see refused)",
                code=ReasonCode.NO_TARGET,
            )
            _log.debug(f"{model_type} (discovered): no target in {name}")
            return
    if refused:
        _log.debug(f"{model_type} (discovered): candidates the probes refused: {refused}")
    from . import _patcher

    _patcher.apply(model, module)


def _model(module, model_type, config):
    """(Model of the accepted candidates, {refused candidate: why}); an unwanted model is not probed."""
    from ._candidates import candidates, kernels, probe
    from ._types import BUILTIN_KERNELS, Model, Target

    if config.wants(model_type) is not None:
        return Model(model_type, module=module.__name__), {}
    accepted, refused = [], {}
    for candidate in candidates(module):
        if candidate.defined_in != module.__name__:
            continue
        probe(module, candidate)
        if candidate.kernel is None:
            refused[candidate.path] = "; ".join(f"{k}: {why}" for k, why in candidate.refused.items())
        else:  # kernels= is the patcher's to apply, as for a table model
            kernel = candidate.kernel  # a built-in's name, else the registered models' Kernel itself
            if kernel not in BUILTIN_KERNELS:
                kernel = kernels()[kernel]
            accepted.append(Target(kernel, candidate.path))
    return Model(model_type, *accepted, module=module.__name__), refused
