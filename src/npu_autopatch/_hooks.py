"""The wrapt post-import hooks, one per supported modeling module.

Imported only once transformers is being imported (wrapt pulls asyncio: ~70 ms).

A hook runs right after the module body ran, while that module's import lock is held, and
wrapt lets any exception escape into the importer, which then fails the user's import and
drops the module from sys.modules. So the hook body is isolated
(``_control.patch_imported``): only a PatchError in strict mode, which the user asked for,
gets through. Normally the watcher's loader (_control) has patched the module already, and
the hook does nothing; it is the fallback for an import the watcher was not asked about.

What runs under that import lock, and why it cannot deadlock: patching waits only for the
package lock and for the module locks of what it imports the first time it runs, namely
our own modules (npu_autopatch._patcher, .kernels, .testing for the golden ops),
torch_npu, transformers.activations and logging. A deadlock needs a thread that holds
one of those module locks while it waits for the package lock, i.e. a module among them
whose import imports a supported modeling module or calls enable()/status(); none does.
Everything else they need (torch, transformers.activations, and on an NPU machine
torch_npu, which transformers' import checks call) the modeling module's own body has
already imported, under the same lock, before we run. Importing them earlier, when
``import transformers`` arms the hooks, would not be safer and would cost a process that
never builds a model the import of torch. Patching never starts or joins a thread, writes
its log lines only after letting go of the package lock (see _log), and runs the probes
on one intra-op thread (see _patcher).

wrapt calls the hooks of one module in registration order and stops at the first that
raises, failing the import. Our patch runs before any of them (from the loader), so a
raising hook of another library fails an import we patched: status() then says
``pending`` instead of ``applied`` (the module was dropped), and the next import of the
module is patched again.
"""

import sys

import wrapt

from . import _control, _remote

_registered = set()  # modules with a hook waiting in wrapt (wrapt drops a hook once it fired)


def _on_import(module):
    _registered.discard(getattr(module, "__name__", None))
    if not _control.watched(module):
        _control.patch_imported(module)


def arm(models):
    """Patch the modules already imported; hook the others. Safe to call again."""
    if "transformers.dynamic_module_utils" not in _registered:
        _registered.add("transformers.dynamic_module_utils")
        wrapt.register_post_import_hook(_remote.wrap, "transformers.dynamic_module_utils")
    for model in models:
        if _remote.is_remote(model):
            for name, module in list(sys.modules.items()):
                if _remote.matches(model, name):
                    _control.patch_module(module)
            continue
        module = sys.modules.get(model.module)
        if module is not None:
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                # Another thread is executing its body right now; patching a half-built module
                # could fail spuriously. It is reported as pending; enable() again patches it.
                continue
            _control.patch_module(module)
        elif model.module not in _registered:
            _registered.add(model.module)
            wrapt.register_post_import_hook(_on_import, model.module)
