"""Third-party models: installed packages declare patches under ``npu_autopatch.patches``.

An entry point's name is the model type, optionally followed by ``@`` and the modeling
module (default ``transformers.models.<type>.modeling_<type>``); its value names a
``Model`` (or a callable returning one). Discovery reads only the installed packages'
metadata: a plugin's own code is imported when its target module is imported, never at
interpreter start. A plugin that fails to load is that one model failing.

Discovery happens when the hooks are armed (transformers is imported), when a
configuration names a model nobody has heard of yet, in status() once patching is on, and in
the CLI; never at interpreter start, which must stay cheap (reading every distribution's
metadata costs tens of milliseconds).
"""

from . import _log
from ._state import STATE
from ._types import Model

GROUP = "npu_autopatch.patches"


def discover():
    """Add a placeholder Model for every installed plugin (once per process). Caller holds the lock."""
    if STATE.plugins_discovered:
        return
    STATE.plugins_discovered = True
    registry = STATE.models
    try:
        import importlib.metadata

        entry_points = list(importlib.metadata.entry_points(group=GROUP))
    except Exception as exc:  # a broken metadata directory must not stop anything else
        _log.warning(f"could not read the {GROUP} entry points: {exc!r}")
        return
    for entry_point in entry_points:
        model_type, _, module = entry_point.name.partition("@")
        if model_type in registry:
            owner = "built in" if registry[model_type].load is None else "declared by another plugin"
            _log.warning(
                f"plugin entry point {entry_point.name} = {entry_point.value} ignored: "
                f"{model_type} is {owner} (use npu_autopatch.register(..., replace=True) to override)"
            )
            continue
        registry[model_type] = Model(model_type, module=module or None, load=_loader(entry_point))


def _loader(entry_point):
    """Load the plugin's Model when its module is imported; check it matches its name."""

    def load(placeholder):
        declared = entry_point.load()
        model = declared() if callable(declared) and not isinstance(declared, Model) else declared
        if not isinstance(model, Model):
            raise TypeError(f"{entry_point.value} is a {type(model).__name__}, not an npu_autopatch.Model")
        if model.model_type != placeholder.model_type:
            raise ValueError(
                f"{entry_point.value} is for {model.model_type!r}, not {placeholder.model_type!r}"
            )
        if model.module != placeholder.module:
            raise ValueError(
                f"{entry_point.value} targets {model.module}, its entry point name {placeholder.module}"
            )
        return model.targets

    load.source = f"plugin {entry_point.name} = {entry_point.value}"
    return load
