"""Finding targets: where an attribute lives, what it holds, and whether that is the model's own code.

Stdlib only: status() reads it without importing torch. Nothing here changes anything; the
ledger (_ledger) records what we swap.

"Is this still the model's own code?" is decided by what the object is: a function whose
module namespace is the modeling module itself, or a module of the transformers package
(``sys.modules`` holds that very namespace), or failing both a file under transformers'
real directory. Never by comparing path strings, which differ through a symlinked
site-packages or a relative ``sys.path`` entry.
"""

import collections
import os
import sys

_FUNCTION = type(lambda: None)  # types.FunctionType, without importing types at interpreter start


def current(owner, attr):
    """What ``owner.attr`` holds now: a class's own entry first, else what it inherits."""
    if isinstance(owner, dict):
        return owner.get(attr)
    if isinstance(owner, type):
        return owner.__dict__.get(attr, getattr(owner, attr, None))
    return getattr(owner, attr, None)


def where(module, owner, path):
    """'module:qualname' of a target, naming the module that really defines the owner."""
    if isinstance(owner, type):
        return f"{owner.__module__}:{owner.__qualname__}.{path.rsplit('.', 1)[-1]}"
    return f"{module.__name__}:{path}"


# A target found in a module: the path that exists, the object holding the attribute, its name, what
# it holds now, and whether the owner defines it itself (False: a class inherits it).
Found = collections.namedtuple("Found", "path owner attr current had_own")


def resolve(module, paths):
    """The ``Found`` of the first of ``paths`` that exists in ``module``, else None."""
    for path in paths:
        *owner_path, attr = path.split(".")
        owner = module
        try:
            for name in owner_path:
                owner = getattr(owner, name)
            if isinstance(owner, type):
                had_own = attr in owner.__dict__
                found = owner.__dict__[attr] if had_own else getattr(owner, attr)
            else:
                had_own, found = True, getattr(owner, attr)
        except AttributeError:
            continue
        return Found(path, owner, attr, found, had_own)
    return None


def claims(model, module):
    """Whether ``module`` is ``model``'s: its name matches, and for a family of modules
    (``Model.family``) it defines every target itself (a module of that library that does not, or
    only imports one from the module that does, is not the model's)."""
    if not model.matches(getattr(module, "__name__", None)):
        return False
    if not model.family:
        return True
    for target in model.targets:
        found = resolve(module, target.paths)
        if found is None or not _defined_in(module, found.owner, found.current):
            return False
    return True


def _defined_in(module, owner, obj):
    """Whether ``obj`` (found on ``owner``) was defined by ``module``'s own code (ours wraps its original)."""
    if isinstance(owner, type):
        return owner.__module__ == module.__name__
    function = stock_function(getattr(obj, "__wrapped__", obj))
    return function is not None and function.__globals__ is module.__dict__


def stock_function(obj):
    """The plain function behind a target: itself, or the function a callable module wraps.

    With the ``kernels`` package installed, transformers 5.x turns a function decorated
    with ``use_kernel_forward_from_hub`` into an ``nn.Module`` instance whose ``forward``
    calls the original function; so do not rely on ``inspect.isfunction``.
    """
    if type(obj) is _FUNCTION:
        return obj
    forward = getattr(type(obj), "forward", None)
    for cell in getattr(forward, "__closure__", None) or ():
        if type(cell.cell_contents) is _FUNCTION:
            return cell.cell_contents
    return None


def _transformers_home():
    transformers = sys.modules.get("transformers")
    path = getattr(transformers, "__file__", None)
    return os.path.realpath(os.path.dirname(path)) + os.sep if path else None


def is_own(function, module=None):
    """Whether ``function`` is the model's own code: its module's, or transformers'."""
    namespace = function.__globals__
    if module is not None and namespace is getattr(module, "__dict__", None):
        return True
    name = namespace.get("__name__") or ""
    defining = sys.modules.get(name)
    if _in_transformers(name) and getattr(defining, "__dict__", None) is namespace:
        return True
    home = _transformers_home()
    return bool(home) and os.path.realpath(function.__code__.co_filename).startswith(home)


def foreign_holder(obj, module=None, owner=None):
    """None for the model's own code, else the name of whoever holds the target now.

    ``owner`` is the class the target was found on: one from outside transformers, bound in
    place of the model's own class (Liger-Kernel rebinds ``Qwen3RMSNorm`` to ``LigerRMSNorm``),
    is named as that class, since its method alone would not say which name it took.
    """
    function = stock_function(obj)
    if function is not None and is_own(function, module):
        return None
    home = getattr(owner, "__module__", None) or ""
    if isinstance(owner, type) and home != getattr(module, "__name__", None) and not _in_transformers(home):
        return f"{home}.{owner.__qualname__} (another library's class, bound in place of the model's)"
    if function is not None:
        return f"{function.__module__}.{function.__qualname__}"
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__} object"


def _in_transformers(name):
    return name == "transformers" or name.startswith("transformers.")
