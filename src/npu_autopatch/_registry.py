"""register(): add a model at run time, with the guarantees of the built-in ones.

The entry is the same declarative ``Model`` the built-in table uses, so a registered model
is lazy, patched in one transaction, logged on rank 0, reported by status() and undone by
disable() exactly like a built-in one.
"""

from __future__ import annotations

import sys

from ._types import Model
from .models import MODELS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._types import Target


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
    from . import _control

    model = model_type if isinstance(model_type, Model) else Model(model_type, *targets, module=module)
    if not model.targets and model.load is None:
        raise ValueError(f"register({model.model_type!r}): no targets given")
    with _control._locked:
        existing = MODELS.get(model.model_type)
        if existing is not None and not replace:
            kind = "a built-in model" if existing.load is None else "already registered"
            raise ValueError(f"{model.model_type!r} is {kind}; pass replace=True to replace it")
        patcher = sys.modules.get(__package__ + "._patcher")
        if existing is not None and patcher is not None:
            patcher.revert(model.model_type)
            patcher.forget(model.model_type)
        MODELS[model.model_type] = model
        _control.watch(model)
    return model
