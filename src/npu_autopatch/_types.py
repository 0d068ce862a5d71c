"""The public declarative types: a Model names Targets, a Target names a Kernel, a Kernel has Variants.

Pure data, importable at interpreter start (no torch, no typing, no dataclasses). The built-in
table (models.py), plugins and register() all declare models with these.
"""

from .kernels._catalog import NAMES as BUILTIN_KERNELS  # torch-free: the kernels' names, in report order

# A target's calls "mostly go stock" (Calls' one-time report) once more than 1 in
# MOSTLY_STOCK_SHARE of at least MOSTLY_STOCK_CALLS calls ran the stock code.
MOSTLY_STOCK_CALLS = 20
MOSTLY_STOCK_SHARE = 10


class Calls:
    """How the calls of one installed replacement ran: ``fused`` (an int) and ``stock`` ({reason: int}).

    The patcher hands one to every replacement it builds, as ``on_error.calls``; status() reads
    it. The replacement adds 1 to ``fused`` when its fused op ran, and calls ``went_stock(reason,
    tensors)`` when a per-call rule sent the call to the stock (or unfused) code, with the rule as
    a short reason (``"head-dim 896 > 895"``, ``"eval"``) or a function returning it (so that a
    reason built from shapes costs nothing on the fused path), and the call's input tensors. The
    patcher's ``on_error`` counts a fused op that raised as ``op-failed``.

    No lock and no device work: ``fused += 1`` is a plain increment, so two threads calling one
    replacement at once may lose an increment (the counts are read by people, never used for a
    decision). ``mostly_stock(calls, reason, tensors)``, when given, is called once, from the stock
    call that makes more than 1 in ``MOSTLY_STOCK_SHARE`` of at least ``MOSTLY_STOCK_CALLS`` calls
    stock; it must not raise. A routine reason (the caller's own choice, such as the loss kernel's
    ``eval``: the kernel declares which) is counted in ``stock`` but neither in ``stocked`` nor
    towards that warning: an evaluation loop is not a kernel the device refused.
    """

    __slots__ = ("fused", "mostly_stock", "stock", "stocked")

    def __init__(self, mostly_stock=None):
        self.fused = 0
        self.stock = {}
        self.stocked = 0  # the sum of ``stock`` but for its routine reasons
        self.mostly_stock = mostly_stock

    def went_stock(self, reason, tensors=(), routine=()):
        """Count one call the replacement sent to the stock code, and why (``tensors``: its inputs;
        ``routine``: the reasons that are the caller's own choice, never warned about)."""
        if callable(reason):
            reason = reason()
        stock = self.stock
        stock[reason] = stock.get(reason, 0) + 1
        if reason in routine:
            return
        self.stocked = stocked = self.stocked + 1
        if self.mostly_stock is not None:
            calls = stocked + self.fused
            if calls >= MOSTLY_STOCK_CALLS and stocked * MOSTLY_STOCK_SHARE > calls:
                tell, self.mostly_stock = self.mostly_stock, None
                tell(self, reason, tensors)

    def as_dict(self):
        """Plain JSON-ready data: ``{"fused": int, "stock": {reason: int}}``."""
        return {"fused": self.fused, "stock": dict(self.stock)}


class Variant:
    """One way to implement a kernel: ``build(stock, npu, on_error)`` and ``probe(stock, candidate)``.

    ``build`` returns the replacement for the stock function or method; it closes over
    ``npu`` (the torch_npu module) and calls the fused ops as its attributes, with the
    documented signatures: no extra frame. It reports how each call ran through
    ``on_error.calls`` (a ``Calls``; kernels/_calls.py gives the two functions to call). When a
    fused op raises inside the replacement (a device rule nobody knew), the replacement calls
    ``on_error(exc, *input_tensors)`` and returns the stock result for that call; the patcher's
    ``on_error`` puts the stock code back for the rest of the process and reports it. What is
    not the op's own failure (torch's control flow such as checkpoint's early stop, out of
    memory) ``on_error`` re-raises untouched (see _failures). ``probe`` runs the stock code and
    a candidate built on the CPU reference ops on tiny inputs and returns None when they
    agree, else why not. ``probe=None`` trusts the variant without checking (for a
    plugin's own kernel; the parity test is then the only proof). ``requires(npu)``, when
    given, returns None if the installed torch_npu can run this variant, else why not.

    ``probe_live()``, when given, returns True when a shipped verdict cannot speak for this
    variant here: its probe depends on an optional package our CI lacks (the gated delta rule's
    ``fla`` variant) and that package is installed, so the targets are probed live.
    """

    __slots__ = ("build", "name", "probe", "probe_live", "requires")

    def __init__(self, name, build, probe=None, requires=None, probe_live=None):
        self.name = name
        self.build = build
        self.probe = probe
        self.requires = requires
        self.probe_live = probe_live


class Pattern:
    """How the scan and discovery nominate a kernel's candidate targets by name; the probes decide.

    ``kind`` names the candidates (kernels whose patterns share a kind judge the same candidates,
    in catalogue order: a norm is tried as ``rms_norm``, then ``gated_rms_norm``). ``classes``: a
    regular expression searched in the name of a ``torch.nn.Module`` subclass, whose ``methods``
    (the ones it defines itself, of those given) are the candidates; ``not_named``: a class whose
    name it matches is not one (an MLP pattern leaves experts out). ``functions``: a regular
    expression searched in the name of a module-level function, the candidate itself.
    ``only_beside``: the pattern applies only in a module that has a name containing this text
    (a decoder layer is a candidate only beside a Gated DeltaNet layer).
    """

    __slots__ = ("classes", "functions", "kind", "methods", "not_named", "only_beside")

    def __init__(
        self, kind, classes=None, functions=None, methods=("forward",), not_named=None, only_beside=None
    ):
        self.kind = kind
        self.classes = classes
        self.functions = functions
        self.methods = tuple(methods)
        self.not_named = not_named
        self.only_beside = only_beside


class Report:
    """What ``report(model)`` shows of a kernel beyond what it reads itself (each class's and rotary
    function's origin: ours, stock or foreign). Every hook is optional, and must not raise.

    ``instance_stock(instance)``: why an instance of a class running this kernel still runs the
    stock code (the swiglu kernel: an activation other than SiLU), else None; also said of a
    candidate this kernel's probes accept, as what the kernel would then run.
    ``flags(instance, defined_by)``: messages about an instance of a class running this kernel (the
    loss kernel: whose code computes the loss); ``defined_by(code)`` names the module code is from.
    ``rows(classes, records)``: the rows of this kernel's own table in the report (the attention
    kernel: per attention class, the implementation its config picks and what computes it), from
    ``{class: [(module name, instance)]}`` of the model and status(); each row an object whose
    attributes are the columns, the first naming the class; ``columns``: the other columns' titles.

    For a kernel whose ``install`` does more than swap an attribute, the report cannot read the
    class alone (the moe kernel on transformers 5.x: the config of each instance picks the experts
    implementation in transformers' registry):

    ``origin(instance, origin_of, defined_by)``: ``(origin, via, defined_by, kernel)`` of an instance
    this kernel's install reaches, else None (the report reads its class): ``origin`` is "ours",
    "stock" or "foreign", ``via`` how the code is reached, ``defined_by`` the module defining that
    code, ``kernel`` ours or None. ``origin_of(code)`` is the report's ``(origin, defined_by,
    kernel)`` of a piece of code.
    ``stock_reason(instance)``: why an instance of a class this kernel is installed on runs other
    code, when status() has no reason (an explicit choice in its config, and how to switch back),
    else None.
    ``delegates(instance, kind_of)``: whether an instance that looks like this kernel's target
    leaves the computation to a module inside it (a 5.x MoE block routes, its experts module
    computes and is reported itself): it is then never flagged. ``kind_of(module)`` is the kind of
    ``Pattern`` a module looks like, or None.
    """

    __slots__ = ("columns", "delegates", "flags", "instance_stock", "origin", "rows", "stock_reason")

    def __init__(
        self,
        instance_stock=None,
        flags=None,
        rows=None,
        columns=(),
        origin=None,
        stock_reason=None,
        delegates=None,
    ):
        self.instance_stock = instance_stock
        self.flags = flags
        self.rows = rows
        self.columns = tuple(columns)
        self.origin = origin
        self.stock_reason = stock_reason
        self.delegates = delegates


class Kernel:
    """A named kernel: the torch_npu ops it needs and its variants, tried in order.

    ``requires(npu)``, when given, returns None if the installed torch_npu can run this
    kernel, else a reason naming the missing capability and the first release that has
    it. It must not run an op on the device (that would open a device context in every
    rank at import): it reads the version or asks the dispatcher what is registered.

    ``fallback``, when given, names what a replacement runs by itself once its fused op raised
    (the attention kernel: eager math on the device, since stock would drop the window): the
    replacement then stays in place and the WARNING and status() say so. Without it, the stock
    code is put back.

    ``refresh()``, when given, runs right after one of the kernel's targets is swapped in or
    put back, under the package lock: for a kernel whose targets someone else caches (transformers
    keeps the flash-attention functions it loaded), it points that cache at what the target holds
    now. It must be quick and must not raise.

    ``switch``, when given, puts the kernel under a switch of its own, outside ``kernels=``:
    ``enable(<switch>=...)`` or ``NPU_AUTOPATCH_<SWITCH>``. Off unless turned on for an opt-in kernel
    (it changes what a forward returns, as the loss kernel's ``logits=None``); with
    ``switched_on=True``, on unless turned off (integrations/verl.py: another library's own NPU patch
    giving way to ours, which a user may want back). An entry of the table whose targets all take
    switched-on kernels is selected by their switch alone, whatever ``models=`` lists: such a kernel
    acts for the selected models (verl's patch steps aside for exactly those). A built-in kernel's
    switch is also written in ``kernels/_catalog.py``, where interpreter start reads it without torch.

    ``candidates``: the ``Pattern``s by which the scan and discovery nominate code this kernel's
    probes then judge (none: the kernel patches only the targets a model names).

    ``report``: a ``Report``, what report(model) shows of this kernel beyond each class's origin.

    ``reference``: {op name: CPU function} for the kernel's ops that ``kernels/_reference`` (the
    reference math of the built-in kernels' ops) has not: the probes build candidates on these.

    ``install(target, build, slot)``, when given, puts the replacement in place when that is more
    than swapping the target's attribute (the moe kernel on transformers 5.x, whose experts
    transformers dispatches through its experts registry: kernels/moe/_experts_registry.py).
    ``target`` is the located target: its ``model_type``, ``module``, ``path`` in the module,
    ``owner``, ``attr``, what it holds now (``current``), whether the owner defines it itself
    (``had_own``), the code the chosen variant reproduces (``stock``) and how status() names it
    (``where``).
    ``build(stock)`` builds the chosen variant's replacement, running ``stock`` for a call it does
    not take. ``slot(owner, attr, original, replacement, had_own, where, path=None, plumbing=False,
    seen=<original>)`` is one ledger entry: ``owner.attr`` (``owner`` a class, a module or a dict)
    holds ``replacement`` until the last model holding it lets go, then ``original`` again (or
    nothing, ``had_own=False``); ``where`` names it in status(); ``path``, its path in the module
    when it has one (checked by status() as the target's is); ``plumbing``, what the replacement
    needs around it, not a target status() lists; ``seen``, what the plan found there when that is
    not ``original``. It returns None, before calling ``build``, for a target it leaves to the
    attribute swap, else the list of entries, the replacement's own first: the patcher commits them
    all or none, and a fused op's failure puts the first one back.
    """

    __slots__ = (
        "candidates",
        "fallback",
        "install",
        "name",
        "ops",
        "reference",
        "refresh",
        "report",
        "requires",
        "switch",
        "switched_on",
        "variants",
    )

    def __init__(
        self,
        name,
        ops,
        variants,
        requires=None,
        fallback=None,
        refresh=None,
        switch=None,
        switched_on=False,
        candidates=(),
        report=None,
        reference=None,
        install=None,
    ):
        self.name = name
        self.install = install
        self.reference = dict(reference or {})
        self.candidates = tuple(candidates)
        self.report = report
        self.ops = tuple(ops)
        self.variants = tuple(variants)
        self.requires = requires
        self.fallback = fallback
        self.refresh = refresh
        self.switch = switch
        self.switched_on = switched_on


class Target:
    """One attribute to replace: a kernel (a built-in name or a Kernel) and where it may live.

    ``since``: the first transformers release whose code this kernel reproduces (e.g. 5.x's fused
    ``*Experts`` where 4.x's sparse block is a different computation). Older releases leave the
    target out of the model altogether, rather than reporting a target the kernel cannot take.
    """

    __slots__ = ("kernel", "paths", "since")

    def __init__(self, kernel, *paths, since=None):
        if not isinstance(kernel, Kernel) and kernel not in BUILTIN_KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; built in: {', '.join(BUILTIN_KERNELS)}")
        if not paths:
            raise ValueError("a Target needs at least one path, e.g. 'MyModelRMSNorm.forward'")
        self.kernel = kernel
        self.paths = paths
        self.since = since

    @property
    def kernel_name(self):
        return self.kernel.name if isinstance(self.kernel, Kernel) else self.kernel

    def __repr__(self):
        return f"Target({self.kernel_name!r}, {', '.join(map(repr, self.paths))})"


class Model:
    """A supported model type and its targets, patched together or not at all.

    ``since`` is the first transformers release that has the model (documentation, and
    checked by the tests against the installed transformers). ``load``, for a plugin's
    model, returns the targets when the module is imported (see _plugins.py).

    ``module`` may be a pattern: ``transformers_modules.*.modeling_x`` for trust_remote_code
    code, or, elsewhere, a family of modules (``verl.*``) in which the model's module is the one
    that defines its targets, found by what it defines wherever that library moves it.
    """

    __slots__ = ("load", "model_type", "module", "since", "targets")

    def __init__(self, model_type, *targets, module=None, since="4.57", load=None):
        self.model_type = model_type
        self.module = module or f"transformers.models.{model_type}.modeling_{model_type}"
        self.targets = targets
        self.since = since
        self.load = load

    def matches(self, module_name):
        """Whether ``module_name`` is this model's module, or matches its trust_remote_code pattern."""
        if not module_name:
            return False
        if "*" in self.module:
            import fnmatch

            return fnmatch.fnmatchcase(module_name, self.module)
        return module_name == self.module

    @property
    def family(self):
        """Whether ``module`` names a family of modules (a pattern outside trust_remote_code's)."""
        return "*" in self.module and not self.module.startswith("transformers_modules.")

    @property
    def kernels(self):
        names = [t.kernel_name for t in self.targets]
        return tuple(sorted(set(names), key=lambda n: (BUILTIN_KERNELS + tuple(names)).index(n)))

    def __repr__(self):
        return f"Model({self.model_type!r}, {len(self.targets)} targets)"
