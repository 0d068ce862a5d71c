"""Per-model transactions: plan outside the lock, commit under it.

A model's patch is all or nothing over its selected targets:

1. (lock) take the configuration and the generation of the current enable();
2. (no lock) decide the device (``import torch_npu``, once per enable()), load a plugin's
   targets, check each kernel's requirements (once per kernel per enable()), resolve every
   target, check it is still the model's own code, probe it against its kernel on the CPU
   reference ops and build the replacement;
3. (lock) if no enable()/disable() came in between and the targets are what was planned on,
   swap the attributes in through the ledger (a failing swap undoes those made), record.

A target whose kernel the installed torch_npu cannot run, or whose probe disagrees, is left
stock and named: the model is then ``partial`` (WARNING), which strict mode rejects
(rolled back, PatchError). Nothing here raises into an importer but that PatchError.

What runs under a module's import lock (the hook), and why it cannot deadlock: patching
waits for the package lock only around the plan's start and the commit, and for the module
locks of what it imports the first time: our own modules, torch_npu, transformers'
activations and integrations, logging. A deadlock needs a thread holding one of those
module locks while it waits for the package lock, i.e. a module among them whose import
imports a modeling module or calls enable()/status(); none does. Patching never starts or
joins a thread and writes its log lines after letting go of the package lock (_state.locked).
"""

import collections
import contextlib
import sys
from dataclasses import replace

from . import _device, _ledger, _log, _resolve
from ._failures import is_early_stop, is_op_failure
from ._records import PatchError, PatchRecord, ReasonCode, State, TargetReason
from ._state import STATE, locked
from ._types import BUILTIN_KERNELS, Calls
from .kernels import KERNELS, choose_variant


class _Failure(Exception):
    """A model cannot be patched; the message names the target and the cause."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = ReasonCode(code)


class _Skip(_Failure):
    """A model is deliberately left stock; the message says why."""


class _Changed(Exception):
    """A planned target changed before the commit; plan again."""


def patch_imported(module):
    """The hook's body: patch every model of ``module``; an internal error never fails the import.

    Only strict mode's PatchError, which the user asked for, gets through (the first one,
    after every model of the module had its turn).
    """
    name = getattr(module, "__name__", None)
    errors = []
    for model in [m for m in list(STATE.models.values()) if _resolve.claims(m, module)]:
        try:
            apply(model, module)
        except PatchError as exc:
            errors.append(exc)
        except Exception as exc:
            with locked:
                _record(
                    model, State.FAILED, ReasonCode.INTERNAL_ERROR, f"internal error, left stock: {exc!r}"
                )
            _log.warning(f"internal error while patching {model.model_type} in {name!r}, left stock: {exc!r}")
    if errors:
        raise errors[0]


def _record(model, state, code=None, cause=None, **fields):
    """Record (and return) the model's latest decision. Caller holds the lock."""
    rec = STATE.records[model.model_type] = PatchRecord(
        model.model_type,
        model.module,
        state,
        cause,
        code=None if code is None else ReasonCode(code),
        **fields,
    )
    return rec


def apply(model, module):
    """Patch one model in an imported module; return its PatchRecord (None if a newer decision won).

    Raises PatchError only in strict mode, after rolling the model back.
    """
    for _attempt in range(3):
        with locked:
            if not STATE.enabled:
                return None
            generation, config = STATE.generation, STATE.config
            if model.model_type in STATE.held and _ledger.moved(model.model_type, module) is None:
                return STATE.records[model.model_type]  # the hook and enable() may both get here
            unwanted = config.wants(model.model_type)
            if unwanted is not None:
                return _record(model, State.SKIPPED, *unwanted)
        try:
            plan = _plan(model, module, config, generation)
        except _Failure as failure:
            plan = failure
        with locked:
            if STATE.generation != generation or not STATE.enabled:
                return None  # enable()/disable() came in between: their decision holds
            if model.model_type in STATE.held and _ledger.moved(model.model_type, module) is None:
                return STATE.records[model.model_type]  # another thread committed meanwhile
            try:
                rec = _conclude(model, module, config, plan)
            except _Changed:
                continue
        # A model the kernel selection leaves out (the attention entry under NPU_AUTOPATCH_KERNELS=rms_norm)
        # is the user's choice, as an excluded model is: not a strict-mode failure.
        chosen = rec.code == ReasonCode.NO_KERNEL_SELECTED
        if config.strict and rec.state not in (State.APPLIED, State.PENDING) and not chosen:
            raise PatchError(f"npu_autopatch strict mode: {rec.model} {rec.state.value}: {rec.reason}")
        return rec
    raise RuntimeError(f"{model.model_type}: its targets kept changing while being checked")


def _conclude(model, module, config, plan):
    """Commit the plan (or record why not). Caller holds the lock."""
    if isinstance(plan, _Failure):
        state = State.SKIPPED if isinstance(plan, _Skip) else State.FAILED
        verb = "skipped" if state is State.SKIPPED else "failed, left stock"
        # No NPU was said once, for every model; the kernels the user left out are their choice (a
        # selection that patches no model is one warning when it is made, _config.resolve).
        if plan.code not in (ReasonCode.NO_NPU, ReasonCode.NO_KERNEL_SELECTED):
            _log.warning(f"{model.model_type}: {verb}: {plan}")
        return _record(model, state, plan.code, str(plan))
    steps, stock = plan.steps, plan.stock
    for key, slot in steps:
        held = STATE.slots.get(key)
        now = _resolve.current(slot.owner, slot.attr)
        if now is not slot.seen and not (held is not None and now is held.replacement):
            raise _Changed
    stock_text = "; ".join(reason.text for reason in stock.values())
    first_code = next((reason.code for reason in stock.values()), None)
    if not steps:
        cause = "no selected target could take its kernel"
        _log.warning(f"{model.model_type}: skipped: {cause}: {stock_text}")
        return _record(model, State.SKIPPED, first_code, cause, stock_reasons=stock)
    if stock and config.strict:  # never committed: status() says stock, the caller raises
        _log.warning(f"{model.model_type}: partial, so strict mode left it stock: {stock_text}")
        refused = "strict mode refused a partial patch"
        rec = _record(model, State.SKIPPED, first_code, refused, stock_reasons=stock)
        return replace(rec, state=State.PARTIAL, cause=None)
    try:
        _ledger.commit(model.model_type, module, steps, plan.placed)
    except Exception as exc:
        cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, _ledger.SwapRefused) else str(exc)
        _log.warning(f"{model.model_type}: failed, left stock: {cause}")
        return _record(model, State.FAILED, ReasonCode.SWAP_FAILED, cause)
    STATE.calls.update(plan.counted)
    rec = STATE.records[model.model_type] = _applied_record(model, stock)
    if stock:
        listed = ", ".join(f"{where} ({reason.code.value})" for where, reason in stock.items())
        _log.warning(
            f"{model.model_type}: partial: applied {', '.join(rec.kernels)} to {_count(rec.targets)}; "
            f"left stock: {listed}: {stock_text}"
        )
    else:
        _log.info(f"{model.model_type}: applied {', '.join(rec.kernels)} to {_count(rec.targets)}")
    return rec


def _count(targets):
    return f"{len(targets)} target{'' if len(targets) == 1 else 's'}"


def _applied_record(model, stock):
    """The record of what the model holds now (after a commit or a demotion), with ``stock``
    ({target: TargetReason}) the selected targets left stock. Caller holds the lock."""
    slots = [STATE.slots[key] for key in STATE.held.get(model.model_type, ()) if key in STATE.slots]
    latest = {key for _path, key in STATE.placed[model.model_type][1]}
    mine = [s for s in slots if s.kernel is not None and (id(s.owner), s.attr) in latest]
    used = {s.kernel for s in mine}
    kernels = tuple(k for k in (*BUILTIN_KERNELS, *sorted(used - set(BUILTIN_KERNELS))) if k in used)
    return PatchRecord(
        model.model_type,
        model.module,
        State.PARTIAL if stock else State.APPLIED,
        code=next((reason.code for reason in stock.values()), None),
        kernels=kernels,
        targets=tuple(s.where for s in mine),
        variants={s.where: s.variant for s in mine if s.variant},
        stock_reasons=dict(stock),
        notes=tuple(s.note for s in mine if s.note),
    )


def _decide_device(generation):
    """(torch_npu module or None, reason), decided once per enable(), outside the lock, logged once."""
    decision = STATE.device
    if decision is not None and decision[0] == generation:
        return decision[1], decision[2]
    npu, reason = _device.probe()
    with locked:
        if STATE.generation == generation and (STATE.device is None or STATE.device[0] != generation):
            STATE.device = (generation, npu, reason)
            if npu is None:
                _log.warning(f"NPU kernels not used, models run stock: {reason}")
    return npu, reason


def _requirement(obj, npu):
    """``obj.requires(npu)`` (a Kernel's or a Variant's), asked once per enable()."""
    requires = getattr(obj, "requires", None)
    if requires is None:
        return None
    key = id(obj)
    if key not in STATE.requirements:
        try:
            STATE.requirements[key] = requires(npu)
        except Exception as exc:
            STATE.requirements[key] = f"its requirement check raised {type(exc).__name__}: {exc}"
    return STATE.requirements[key]


def _load_plugin(model):
    """A plugin's targets, imported now that its module is: a failure fails that model only."""
    try:
        return tuple(model.load(model))
    except Exception as exc:
        raise _Failure(
            "plugin-error", f"{model.load.source} failed to load: {type(exc).__name__}: {exc}"
        ) from exc


def _on_error(model_type, placed, fallback=None, calls=None):
    """Contract C1: the on_error a replacement calls when its fused op raised (``placed``: where the
    replacement was put, a ``_Placed`` filled once it is installed).

    It re-raises what is not the op's own failure (torch's control flow, out of memory: see
    _failures), else counts the call as stock (``op-failed``), demotes the target and never raises.
    ``on_error.calls`` is the replacement's ``Calls`` (how its calls ran, for status()).
    """

    def on_error(exc, *tensors):
        if not is_op_failure(exc):
            if is_early_stop(exc):
                # non-reentrant checkpointing's recomputation ran the fused op and stopped inside it once
                # it had what the backward needs: a fused call, which the replacement cannot count after
                on_error.calls.fused += 1
            raise exc
        on_error.calls.went_stock(OP_FAILED_CALL, tensors)
        try:
            _demote(placed, exc, tensors, fallback)
        except Exception as internal:  # the user's forward goes on with the stock result
            _log.warning(f"{model_type}: could not put the stock code back after {exc!r}: {internal!r}")

    on_error.calls = Calls() if calls is None else calls
    return on_error


# The reason a call is counted stock when its fused op raised (on_error).
OP_FAILED_CALL = "op-failed"


def _counter(where):
    """The Calls of a replacement built for ``where``: one rank-0 WARNING the first time its calls
    mostly go stock, naming the target, the rule that sent the call there and its shapes."""

    def mostly_stock(calls, reason, tensors):
        stocked = calls.stocked
        try:
            shapes = _describe(tensors)
        except Exception as exc:  # a tensor subclass whose shape cannot be read: still warn
            shapes = f"shapes unreadable: {exc!r}"
        _log.warning(
            f"{where}: {stocked} of {stocked + calls.fused} calls ran the stock code, not the fused op; "
            f"the latest because of {reason} ({shapes}); npu_autopatch.status() has the counts per reason"
        )

    return Calls(mostly_stock)


def _describe(tensors):
    shown = [f"{tuple(t.shape)} {t.dtype}" for t in tensors if hasattr(t, "shape") and hasattr(t, "dtype")]
    return ", ".join(shown) or "no tensors"


class _Placed:
    """Where a replacement was put: its ledger key and the replacement (None until it is installed)."""

    __slots__ = ("key", "replacement")

    def __init__(self):
        self.key = self.replacement = None


def _demote(placed, exc, tensors, fallback=None):
    """Put the stock object back for the rest of the process; record and log it once. A kernel with
    a ``fallback`` keeps its replacement in place: it runs that fallback itself from now on."""
    with locked:
        if placed.replacement is None:
            slot = None
        elif fallback is None:
            slot = _ledger.put_back(placed.key, placed.replacement)
        else:
            slot = STATE.slots.get(placed.key)
            if slot is not None and slot.replacement is not placed.replacement:
                slot = None
        if slot is None:
            return  # another call demoted it first (or disable() came)
        cause = f"{type(exc).__name__}: {exc}"
        done = "taken out of" if fallback is None else "fused op given up at"
        text = f"{slot.kernel} {done} {slot.where}: its fused op raised on {_describe(tensors)}: {cause}"
        told = []
        for model_type in sorted(slot.holders):
            old = STATE.records.get(model_type)
            model = STATE.models.get(model_type) or STATE.discovered.get(model_type)
            if old is None or model is None or model_type not in STATE.placed:
                continue
            if slot.where in old.stock_reasons:
                continue  # reported by another call already (a fallback leaves the slot in place)
            stock = {**old.stock_reasons, slot.where: TargetReason(ReasonCode.OP_FAILED, text)}
            STATE.records[model_type] = replace(_applied_record(model, stock), code=ReasonCode.OP_FAILED)
            told.append(model_type)
        if fallback is not None and not told:
            return
        models = ", ".join(sorted(slot.holders))
    _log.warning(f"{models}: {text}; that target runs {fallback or 'stock'} from now on")


def _transformers_has(release):
    """Whether the imported transformers is ``release`` ("5.0") or newer."""
    installed = sys.modules["transformers"].__version__.split(".")[:2]
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in installed) >= tuple(
        int(part) for part in release.split(".")
    )


def present_targets(targets):
    """The targets the imported transformers has (a target with ``since`` from that release on): the
    ones the patcher tries, and the verdict generator probes."""
    return [t for t in targets if t.since is None or _transformers_has(t.since)]


def _plan(model, module, config, generation):
    """Locate, choose and install every selected target, in a plan; swap nothing.

    Returns the ``_Plan``; raises _Failure/_Skip.
    """
    npu, reason = _decide_device(generation)
    if npu is None:
        raise _Skip("no-npu", reason)
    targets = model.targets
    if model.load is not None and not targets:
        targets = model.targets = _load_plugin(model)
    plan = _Plan()
    selected = [t for t in present_targets(targets) if config.selects(t.kernel)]
    if not selected:
        raise _Skip("no-kernel-selected", "none of its kernels is selected")
    for target in selected:
        site = _locate(module, target, config)
        if site.joined is not None:  # another model put our kernel here: this one joins it
            plan.steps.append((site.key, site.joined))
            plan.placed.append((site.found.path, site.key))
            continue
        kernel = KERNELS.get(target.kernel) or target.kernel  # a built-in name, or a plugin's Kernel
        choice = _choose(kernel, site, npu)
        if choice.variant is None:
            plan.stock[site.where] = _left_stock(choice.code, kernel, site.where, choice.why)
            continue
        _install(model, module, site, kernel, choice, npu, plan)
    return plan


class _Plan:
    """What a model's plan commits: ledger steps (key, Slot), the paths placed (path, key), the targets
    left stock ({where: TargetReason}) and the Calls of each replacement built ({where: Calls})."""

    __slots__ = ("counted", "placed", "steps", "stock")

    def __init__(self):
        self.steps, self.placed, self.stock, self.counted = [], [], {}, {}


class _Site:
    """A located target: what ``_resolve`` found, how status() names it, its ledger key, and the slot
    of ours it already holds (another model's) or None."""

    __slots__ = ("found", "joined", "key", "where")

    def __init__(self, found, where, key, joined):
        self.found, self.where, self.key, self.joined = found, where, key, joined


def _locate(module, target, config):
    """Find the target in the module and check it is the model's own code (or ours, another model's)."""
    found = _resolve.resolve(module, target.paths)
    if found is None:
        raise _Failure(
            "target-missing",
            f"target {' or '.join(target.paths)} not found in {module.__name__} "
            "(renamed or removed in this transformers version?)",
        )
    where = _resolve.where(module, found.owner, found.path)
    key = (id(found.owner), found.attr)
    slot = STATE.slots.get(key)
    if slot is not None and found.current is slot.replacement:
        return _Site(found, where, key, slot)
    holder = _resolve.foreign_holder(found.current, module, found.owner)
    if holder is not None and not config.force:
        named = f"{module.__name__}:{found.path}"  # the model's name for it, whoever's class holds it now
        raise _Skip(
            "foreign-patch", f"{named} is already replaced by {holder}; pass force=True to replace it anyway"
        )
    return _Site(found, where, key, None)


class _Choice:
    """The variant chosen for a target and why not an earlier one (``note``), or why none
    (``code``, ``why``); ``stock`` is the code the variant reproduces."""

    __slots__ = ("code", "note", "stock", "variant", "why")

    def __init__(self, variant=None, stock=None, note=None, code=None, why=None):
        self.variant, self.stock, self.note, self.code, self.why = variant, stock, note, code, why


def _choose(kernel, site, npu):
    """The kernel's first variant that the installed torch_npu can run and that reproduces the target."""
    missing = [op for op in kernel.ops if not hasattr(npu, op)]
    if missing:
        raise _Failure(
            "op-missing",
            f"torch_npu has no {', '.join(missing)} (needed by {kernel.name}; torch_npu too old?)",
        )
    unsupported = _requirement(kernel, npu)
    allowed = [v for v in kernel.variants if _requirement(v, npu) is None]
    if unsupported is None and not allowed:
        unsupported = "; ".join(f"{v.name}: {_requirement(v, npu)}" for v in kernel.variants)
    if unsupported is not None:
        return _Choice(code=ReasonCode.KERNEL_UNSUPPORTED, why=unsupported)
    refused = [v for v in kernel.variants if v not in allowed]
    stock_code = _resolve.stock_function(site.found.current) or site.found.current  # what it must reproduce
    try:
        variant, mismatch = choose_variant(_narrowed(kernel, allowed) if refused else kernel, stock_code)
        # A refused variant that would reproduce the target: the torch_npu is the reason.
        wanted = choose_variant(_narrowed(kernel, refused), stock_code)[0] if refused else None
    except Exception as exc:
        raise _Failure(
            "probe-error",
            f"kernel {kernel.name} raised while checking {site.where}: {type(exc).__name__}: {exc}",
        ) from exc
    if variant is None and wanted is not None:
        why = f"its {wanted.name} variant needs a newer torch_npu: {_requirement(wanted, npu)}"
        return _Choice(code=ReasonCode.KERNEL_UNSUPPORTED, why=why)
    if variant is None:
        return _Choice(code=ReasonCode.MATH_DIFFERS, why=mismatch)
    note = None
    if wanted is not None and kernel.variants.index(wanted) < kernel.variants.index(variant):
        # e.g. the attention kernel's sinks unfused on a device whose fused op drops them
        why = _requirement(wanted, npu)
        note = f"{kernel.name} at {site.where} runs its {variant.name} variant, not {wanted.name}: {why}"
    return _Choice(variant, stock_code, note)


# A located target as a kernel's own install reads it (``Kernel.install``).
Located = collections.namedtuple("Located", "model_type module path owner attr current had_own stock where")
# One ledger entry of a plan: the slot, and its path in the module (None: not the module's, e.g. a registry).
_Entry = collections.namedtuple("_Entry", "slot path")


# A kernel narrowed to some of its variants (the ones the installed torch_npu can run, or the ones it
# refuses), as ``choose_variant`` judges it: by its name, its variants and its own reference ops.
_Narrowed = collections.namedtuple("_Narrowed", "name ops variants reference")


def _narrowed(kernel, variants):
    return _Narrowed(kernel.name, kernel.ops, tuple(variants), kernel.reference)


def _install(model, module, site, kernel, choice, npu, plan):
    """Build the chosen variant's replacement and add the ledger entries that put it in place: the
    kernel's own ``install`` when it has one for this target, else a swap of the target's attribute."""
    found, where = site.found, site.where
    calls = plan.counted[where] = _counter(where)
    placed = _Placed()
    on_error = _on_error(model.model_type, placed, getattr(kernel, "fallback", None), calls)

    def build(stock):
        try:
            replacement = choice.variant.build(stock, npu, on_error)
        except Exception as exc:
            raise _Failure(
                "build-error",
                f"kernel {kernel.name} raised while building for {where}: {type(exc).__name__}: {exc}",
            ) from exc
        with contextlib.suppress(AttributeError, TypeError):  # a plugin's callable may refuse it
            replacement.__wrapped__ = found.current  # what it replaces, as functools.wraps would say
        return replacement

    def slot(
        owner, attr, original, replacement, had_own, where, path=None, plumbing=False, seen=_ledger.ORIGINAL
    ):
        ours = {}  # plumbing: no kernel of ours, no target status() lists
        if not plumbing:
            ours = {"kernel": kernel.name, "variant": choice.variant.name}
            ours.update(refresh=kernel.refresh, note=choice.note)
        return _Entry(
            _ledger.Slot(owner, attr, original, replacement, had_own, where, seen=seen, **ours), path
        )

    install = getattr(kernel, "install", None)
    located = Located(
        model.model_type,
        module,
        found.path,
        found.owner,
        found.attr,
        found.current,
        found.had_own,
        choice.stock,
        where,
    )
    entries = install(located, build, slot) if install is not None else None
    if entries is None:
        replacement = build(choice.stock)
        entries = [
            slot(found.owner, found.attr, found.current, replacement, found.had_own, where, path=found.path)
        ]
    for entry in entries:
        key = (id(entry.slot.owner), entry.slot.attr)
        plan.steps.append((key, entry.slot))
        if entry.path is not None:
            plan.placed.append((entry.path, key))
    first = entries[0].slot  # the replacement's own: what a fused op's failure puts back
    placed.key, placed.replacement = (id(first.owner), first.attr), first.replacement


def _left_stock(code, kernel, where, why):
    return TargetReason(code, f"{kernel.name} not applied to {where}: {why}")


def revert_all():
    """Take every model's kernels out (disable(), or a new selection). Caller holds the lock."""
    for model_type in list(STATE.held):
        _ledger.release_all(model_type)
