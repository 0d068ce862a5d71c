"""What a live model runs, class by class: ours, stock or foreign (``report(model)``'s first job).

A class's code is *ours* (one of our replacements: a ledger slot's, or a function of this package
that carries ``__wrapped__``), *stock* (transformers' or torch's own code) or *foreign* (named by its
defining module); an instance runs its class's code unless its own ``forward`` was captured or set
(accelerate's hooks), or a kernel says it runs stock (``Report.instance_stock``), or the kernel
whose install reaches it reads it itself (``Report.origin``). The kernels' ``Report`` hooks are
asked through here.

Imports torch (through ``_candidates``); only imported when a report is asked for.
"""

from __future__ import annotations

import collections
import functools
import sys
from dataclasses import dataclass, field

from . import _candidates, _resolve
from ._state import STATE, locked

OURS, STOCK, FOREIGN = "ours", "stock", "foreign"


@dataclass
class ModuleEntry:
    """One module class of the model: what its code is and what its instances run."""

    name: str  # the class's qualified name
    module: str  # the module that defines the class
    count: int  # instances in the model
    origin: str  # ours / stock / foreign: what the class runs (per instance where a kernel reads it)
    via: str  # how: "forward", "moe", "experts interface 'npu_grouped_mm'", ...
    defined_by: str  # the module that defines the code that runs
    kind: str | None = None  # norm / mlp / moe when the name looks like a kernel's target
    kernel: str | None = None  # our kernel, when ours
    runs: dict[str, int] = field(default_factory=dict)  # instances by what they really run


@dataclass
class FunctionEntry:
    """One module-level rotary function or chunked gated delta rule of the model's modeling modules
    (or of the user's own modules its classes come from)."""

    name: str  # "module:function"
    origin: str
    defined_by: str
    kernel: str | None = None


@dataclass
class Flag:
    """Something a user wants to know: a target left stock, a gated kernel, a captured instance,
    code a kernel reproduces that nothing patches."""

    # stock / gated / unpatched / captured-before-patching / captured-while-patched / instance-forward / loss
    kind: str
    subject: str  # the class or function it is about
    message: str
    code: str | None = None  # status()'s reason code, when it has one
    instances: list[str] = field(default_factory=list)  # module names in the model (captured flags)


class Ours:
    """Our kernels' slots in the ledger, read once under the lock (or given by a caller that holds it):
    what counts as ours."""

    def __init__(self, slots=None):
        if slots is None:
            with locked:
                slots = list(STATE.slots.values())
        self.slots = [slot for slot in slots if slot.kernel is not None]
        self.kernels = {id(slot.replacement): slot.kernel for slot in self.slots}


def function_of(obj):
    """The plain function a callable runs: unwraps bound methods, partials and callable modules."""
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif hasattr(obj, "__func__"):
            obj = obj.__func__
        else:
            break
    return _resolve.stock_function(obj) or obj


def defining_module(function) -> str:
    """The module whose code this is (its globals), not the ``__module__`` a decorator copied."""
    namespace = getattr(function, "__globals__", None) or {}
    return namespace.get("__name__") or getattr(function, "__module__", None) or type(function).__module__


def code_from(code) -> str:
    """The module defining the code a callable runs (``function_of`` of it)."""
    return defining_module(function_of(code))


def origin_of(obj, ours) -> tuple[str, str, str | None]:
    """(ours/stock/foreign, the module defining the code, our kernel name or None).

    A torch, transformers or accelerate decorator (``torch.no_grad()``, ``can_return_tuple``,
    accelerate's mixed-precision ``convert_outputs_to_fp32`` around ``torch.autocast``, which its
    ``prepare`` sets on the model's instance) is looked through: the code it wraps decides.
    """
    function = function_of(obj)
    for _ in range(8):
        module = defining_module(function)
        if id(function) in ours.kernels:
            return OURS, module, ours.kernels[id(function)]
        wrapped = getattr(function, "__wrapped__", None)
        if module.startswith("npu_autopatch.") and wrapped is not None:
            return OURS, module, None  # a replacement disable() took out of its class, still referenced
        looked_through = module == "torch" or module.startswith(("torch.", "transformers.", "accelerate."))
        if wrapped is None or not looked_through:
            break
        function = function_of(wrapped)
    if module == "torch" or module.startswith("torch."):
        return STOCK, module, None
    if hasattr(function, "__code__") and _resolve.is_own(function):
        return STOCK, module, None
    return FOREIGN, module, None


def _class_origin(cls, ours):
    """(origin, via, defined_by, kernel) of a class's code: its forward, or another method we replaced."""
    origin, defined_by, kernel = origin_of(cls.forward, ours)
    if origin == STOCK:
        # A method other than forward (4.x DeepSeek-V3's ``moe``) of a module class that computes (has
        # a forward of its own): not a base class's bookkeeping method, such as the default attention
        # choice on ``PreTrainedModel``, which every model class inherits and none computes with. Only
        # while the class's forward is the model's own: one another library replaced after us (ms-swift's
        # 5.x experts forward) no longer calls what we replaced, and its code runs.
        for slot in ours.slots:
            if (
                isinstance(slot.owner, type)
                and issubclass(cls, slot.owner)
                and "forward" in vars(slot.owner)
                and slot.attr != "forward"
                and slot.current() is slot.replacement
            ):
                return OURS, slot.attr, defining_module(slot.replacement), slot.kernel
    return origin, "forward", defined_by, kernel


def _captured(instance):
    """The function an instance-level ``forward`` finally runs, or None if the instance has none.

    accelerate keeps the bound forward it wrapped in ``_old_forward``; other wrappers are
    followed through ``__wrapped__`` (functools.wraps / update_wrapper) down to a bound method.
    """
    if "forward" not in vars(instance):
        return None
    inner = vars(instance).get("_old_forward")
    if inner is None:
        inner = vars(instance)["forward"]
        for _ in range(8):
            wrapped = getattr(inner, "__wrapped__", None)
            if wrapped is None or getattr(inner, "__self__", None) is instance:
                break  # a bound method: its own __wrapped__ is its function's decorator's
            inner = wrapped
    return inner


def _hooker(instance) -> str:
    """Who set the instance's ``forward``, for a flag."""
    hook = vars(instance)["forward"]
    if getattr(hook, "__self__", None) is instance:  # e.g. what remove_hook_from_module leaves
        return "a bound method stored on the instance"
    return f"by {code_from(hook)}"


def report_hooks():
    """{kernel name: its Report} of every kernel that declares one (built in, or a registered model's)."""
    return {
        name: kernel.report for name, kernel in _candidates.kernels().items() if kernel.report is not None
    }


def instance_stock(hook, instance):
    """Why ``instance`` runs the stock code though its class runs the kernel of ``hook``, or None."""
    if hook is None or hook.instance_stock is None or instance is None:
        return None
    return hook.instance_stock(instance)


def first_answer(hooks, name, *args):
    """The first answer other than None of the kernels' Report hook ``name`` (``stock_reason``,
    ``origin``) to ``args``, else None."""
    for hook in hooks.values():
        function = getattr(hook, name)
        if function is not None:
            answer = function(*args)
            if answer is not None:
                return answer
    return None


def delegates(hooks, kind, instance):
    """Whether a module that looks like a kernel's target of ``kind`` leaves the computation to one
    inside it (``Report.delegates`` of the kernels judging that kind)."""
    if kind is None:
        return False

    def kind_of(module):
        return _candidates.kind_of(type(module).__name__, type(module))

    return any(
        hooks[name].delegates(instance, kind_of)
        for name in _candidates.kernels_for(kind)
        if name in hooks and hooks[name].delegates is not None
    )


def module_entry(cls, instances, ours, hooks):
    """The ModuleEntry of one class and the flags of its captured instances."""
    kind = _candidates.kind_of(cls.__name__, cls, vars(sys.modules.get(cls.__module__, sys)))
    forward = cls.forward
    claimed = False  # an instance a kernel's install reaches, read by that kernel (Report.origin)
    class_origin = None
    runs = collections.Counter()
    captured: dict[tuple[str, str, str], list[str]] = {}
    fallback: dict[str, list[str]] = {}  # why -> instances the kernel leaves to the stock code (Report)
    for name, instance in instances:
        read = first_answer(hooks, "origin", instance, lambda code: origin_of(code, ours), code_from)
        claimed = read is not None
        if not claimed:
            class_origin = class_origin or _class_origin(cls, ours)
            read = class_origin
        origin, via, defined_by, kernel = read
        runs_origin = origin
        why = instance_stock(hooks.get(kernel), instance) if origin == OURS else None
        if why is not None:
            runs_origin = STOCK
            fallback.setdefault(why, []).append(name)
        inner = _captured(instance)
        if inner is not None:
            inner_origin, inner_module, _kernel = origin_of(inner, ours)
            runs_origin = inner_origin
            differs = inner_origin != origin or inner_origin == FOREIGN  # not e.g. an older build of ours
            # An instance a kernel's install reaches is read by that kernel, but a forward of another
            # library's set on it (LLaMA-Factory's experts) is that library's code all the same.
            reached = claimed and inner_origin != FOREIGN
            if differs and function_of(inner) is not function_of(forward) and not reached:
                if inner_origin == STOCK and origin == OURS:
                    kind_of = "captured-before-patching"
                elif inner_origin == OURS:
                    kind_of = "captured-while-patched"
                else:
                    kind_of = "instance-forward"
                captured.setdefault((kind_of, _hooker(instance), inner_module), []).append(name)
        runs[runs_origin] += 1
    flags = []
    for (kind_of, hooker, inner_module), names in captured.items():
        message = {
            "captured-before-patching": (
                f"instance forward captured before patching ({hooker}): runs stock, not our "
                f"{kernel or 'kernel'}; class-level patching never reaches it"
            ),
            "captured-while-patched": (
                f"instance forward captured while patched ({hooker}): still runs our kernel "
                + ("after disable()" if origin == STOCK else f"instead of the class's {defined_by}")
            ),
            "instance-forward": (
                f"instance forward set {hooker} runs code from {inner_module}, not the class's ({defined_by})"
            ),
        }[kind_of]
        flags.append(Flag(kind_of, cls.__qualname__, f"{len(names)} instance(s): {message}", None, names))
    for why, names in fallback.items():
        message = f"{len(names)} instance(s) run stock code: {why}"
        flags.append(Flag("stock", cls.__qualname__, message, None, names))
    entry = ModuleEntry(
        cls.__qualname__, cls.__module__, len(instances), origin, via, defined_by, kind, kernel, dict(runs)
    )
    return entry, flags, claimed
