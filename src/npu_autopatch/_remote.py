"""trust_remote_code models: the modules transformers loads from a repository's own code.

transformers loads them with ``spec_from_file_location`` + ``exec_module`` in
``dynamic_module_utils.get_class_in_module``, which import hooks never see, and runs the
module again whenever its file changes. So we wrap that function: after each call, the
module the class came from is matched against the models whose ``module`` is a pattern
(``"transformers_modules.*.modeling_acme"``) and patched like any other, again if its
body ran again. The wrapper is installed once transformers is armed and is inert while
patching is disabled.
"""

import fnmatch
import functools
import sys

REMOTE_PREFIX = "transformers_modules."


def is_remote(model):
    return model.module.startswith(REMOTE_PREFIX)


def matches(model, module_name):
    return fnmatch.fnmatchcase(module_name, model.module)


def wrap(dynamic_module_utils):
    """Wrap get_class_in_module in transformers.dynamic_module_utils (once); never raise."""
    try:
        _wrap(dynamic_module_utils)
    except Exception as exc:  # a post-import hook must not fail transformers' import
        from . import _log

        _log.warning(f"trust_remote_code models will not be patched: {exc!r}")


def _wrap(dynamic_module_utils):
    from . import _control

    original = dynamic_module_utils.get_class_in_module
    if getattr(original, "__npu_autopatch_remote__", False):
        return

    @functools.wraps(original)
    def get_class_in_module(*args, **kwargs):
        cls = original(*args, **kwargs)
        module = sys.modules.get(getattr(cls, "__module__", ""))
        if module is not None:
            _control.patch_imported(module)
        return cls

    get_class_in_module.__npu_autopatch_remote__ = True
    dynamic_module_utils.get_class_in_module = get_class_in_module
