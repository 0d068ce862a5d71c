"""The public declarative types: a Model names Targets, a Target names a Kernel, a Kernel has Variants.

Pure data, importable at interpreter start (no torch, no typing, no dataclasses). The built-in
table (models.py), plugins and register() all declare models with these.
"""

# The built-in kernels, in the order they are reported. The kernels package implements them.
KERNEL_NAMES = (
    "rms_norm",
    "gated_rms_norm",
    "swiglu",
    "rope",
    "moe",
    "attention",
    "gated_delta_rule",
    "loss",
)
# Kernels that change what a forward returns (the loss kernel's ``logits=None``): never on by
# default nor through ``kernels=``; each has its own switch (enable(loss=True), NPU_AUTOPATCH_LOSS).
OPT_IN_KERNELS = ("loss",)
# Kernels that make another library's own NPU patch step aside for ours (integrations/): on by
# default, outside ``kernels=``, with one switch of their own (enable(step_aside=False),
# NPU_AUTOPATCH_STEP_ASIDE=0). An entry whose targets all take one is selected by that switch alone.
STEP_ASIDE_KERNELS = ("step_aside",)


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
    """

    __slots__ = ("build", "name", "probe", "requires")

    def __init__(self, name, build, probe=None, requires=None):
        self.name = name
        self.build = build
        self.probe = probe
        self.requires = requires


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
    """

    __slots__ = ("fallback", "name", "ops", "refresh", "requires", "variants")

    def __init__(self, name, ops, variants, requires=None, fallback=None, refresh=None):
        self.name = name
        self.ops = tuple(ops)
        self.variants = tuple(variants)
        self.requires = requires
        self.fallback = fallback
        self.refresh = refresh


class Target:
    """One attribute to replace: a kernel (a built-in name or a Kernel) and where it may live.

    ``since``: the first transformers release whose code this kernel reproduces (e.g. 5.x's fused
    ``*Experts`` where 4.x's sparse block is a different computation). Older releases leave the
    target out of the model altogether, rather than reporting a target the kernel cannot take.
    """

    __slots__ = ("kernel", "paths", "since")

    def __init__(self, kernel, *paths, since=None):
        if not isinstance(kernel, Kernel) and kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {kernel!r}; built in: {', '.join(KERNEL_NAMES)}")
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
        return tuple(sorted(set(names), key=lambda n: (KERNEL_NAMES + tuple(names)).index(n)))

    def __repr__(self):
        return f"Model({self.model_type!r}, {len(self.targets)} targets)"
