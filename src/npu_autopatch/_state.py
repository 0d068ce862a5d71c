"""The package state: every piece of it, in one object, behind one lock.

Stdlib only (it is imported at interpreter start when NPU_AUTOPATCH is set). Other modules
read and write ``STATE``; none keeps state of its own. Writers hold the package lock through
``locked``, which also holds back what the thread defers meanwhile (its log lines, _log)
until the lock is let go.

Nothing is written to a log while the lock is held: logging takes its own lock, and holding
ours while waiting for it would order the two locks against logging's fork handler, which
takes logging's lock before ours (a hang found by tests/test_processes.py: a fork while
another thread was patching).

A fork while another thread holds the lock would give the child a lock held by a thread
that does not exist there (every later hook, enable() or status() in the child would hang)
and a half-made change. As the logging module does for its own lock, the lock is taken
around ``fork()``: the fork waits for the (short) critical section, and the child starts
with the lock free and the state consistent. Only commits run under the lock: importing
torch_npu, detecting the device and probing run outside it, so a fork (a DataLoader
worker) never waits for them.
"""

import _thread
import os
import weakref  # already imported by the interpreter's start-up

from .models import MODELS


class _State:
    __slots__ = (
        "arm_error",
        "armed",
        "booted",
        "calls",
        "config",
        "default_experts",
        "deferred",
        "device",
        "discovered",
        "discovery_hooked",
        "enabled",
        "family_watcher",
        "generation",
        "held",
        "hooked",
        "kernel_notes",
        "listing",
        "lock",
        "models",
        "overrides_told",
        "placed",
        "plugins_discovered",
        "records",
        "refused",
        "remote_wrapped",
        "requirements",
        "slots",
        "stock_experts",
        "watcher",
    )

    def __init__(self):
        self.lock = _thread.RLock()
        self.booted = False  # the .pth line / sitecustomize ran boot() (a site dir may be processed twice)
        self.enabled = False
        self.config = None  # the Config of the current enable()
        self.generation = 0  # bumped by enable()/disable(): a plan made under an older one is dropped
        # The model registry, what every reader of the models known now reads: the built-in table
        # (models.MODELS, read-only), then entry-point plugins and register() (through _control and
        # _plugins only).
        self.models = dict(MODELS)
        self.plugins_discovered = False
        # Hooks (_hooks): the stdlib watcher, whether the wrapt hooks are armed (or why not),
        # the modules with a hook of ours in wrapt's table, the get_class_in_module we wrapped.
        self.watcher = None
        self.armed = False
        self.arm_error = None
        self.hooked = set()
        self.remote_wrapped = None  # (dynamic_module_utils, original) while we wrap it
        self.family_watcher = None  # the finder that hooks the modules of a family (Model.family)
        # Discovery (_discover): the installed modeling modules (root, names), listed once; the
        # ones hooked for discovery; the Model built for each discovered module when it was
        # imported (model type -> Model, kept after disable() for status()) and the candidates
        # its probes refused (model type -> {path: why}).
        self.listing = None
        self.discovery_hooked = set()
        self.discovered = {}
        self.refused = {}
        # Per enable(): the device decision (torch_npu module or None, reason) and each
        # kernel's and variant's requirement verdict, keyed by id().
        self.device = None
        self.requirements = {}
        # The ledger (_ledger): what we replaced and who holds it.
        self.slots = {}  # (id(owner), attr) -> _ledger.Slot
        self.held = {}  # model type -> [ledger keys it holds]
        self.placed = {}  # model type -> (module, ((path, key), ...)) of its latest application
        self.records = {}  # model type -> PatchRecord of its latest decision
        self.overrides_told = set()  # (model type, cause) of each replaced-after-us logged already
        # target path -> _types.Calls of the replacement installed there: how its calls ran. Kept
        # after disable() (status() of a reverted model still shows them), new with each enable().
        self.calls = {}
        # model type -> {kernel name: what that installed kernel adds to the model's notes in
        # status(), read with str() when asked}: a kernel keeps there what its note says (the moe
        # kernel: the experts implementations users chose since, which run instead of it). New with
        # each enable().
        self.kernel_notes = {}
        # The moe kernel's install (kernels/moe/_experts_registry.py): id(config) -> config whose
        # "grouped_mm" is transformers' default, and of the models explicitly given "grouped_mm",
        # in this process: weakly held, so that nothing is written into the config itself.
        self.default_experts = weakref.WeakValueDictionary()
        self.stock_experts = weakref.WeakValueDictionary()
        self.deferred = {}  # thread ident -> [depth, actions to run once it lets go] while it holds the lock


STATE = _State()


class _Locked:
    """``with locked:`` holds the package lock; what this thread defers meanwhile runs after."""

    def __enter__(self):
        STATE.lock.acquire()
        STATE.deferred.setdefault(_thread.get_ident(), [0, []])[0] += 1

    def __exit__(self, *exc_info):
        me = _thread.get_ident()
        actions = ()
        try:
            entry = STATE.deferred[me]
            entry[0] -= 1
            if not entry[0]:
                del STATE.deferred[me]
                actions = entry[1]
        finally:
            STATE.lock.release()
        for action in actions:
            action()


locked = _Locked()


def defer(action):
    """Run ``action()`` when this thread lets go of the lock; False (not run) if it does not hold it."""
    entry = STATE.deferred.get(_thread.get_ident())
    if entry is None:
        return False
    entry[1].append(action)
    return True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=STATE.lock.acquire, after_in_parent=STATE.lock.release, after_in_child=STATE.lock.release
    )
