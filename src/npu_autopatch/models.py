"""The model table: which target of which modeling module gets which kernel.

Pure data, importable at interpreter start (no torch, no typing, no dataclasses).
Adding a model is one ``Model(...)`` entry here plus one parameter in the parity tests.

A target path is ``"Class.method"`` or ``"function"``, resolved in the model's modeling
module. Several paths mean alternatives across transformers versions: the first that
exists is used. Whether the kernel really reproduces the target's math is not trusted to
the name: the patcher probes every target against the kernel before swapping.
"""

# Kernel names, in the order they are reported. The kernels package implements exactly these.
KERNEL_NAMES = ("rms_norm", "swiglu", "rope")


class Target:
    """One attribute to replace: a kernel name and the path(s) where it may live."""

    __slots__ = ("kernel", "paths")

    def __init__(self, kernel, *paths):
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNEL_NAMES)}")
        self.kernel = kernel
        self.paths = paths

    def __repr__(self):
        return f"Target({self.kernel!r}, {', '.join(map(repr, self.paths))})"


class Model:
    """A supported model type and its targets, patched together or not at all."""

    __slots__ = ("model_type", "module", "targets")

    def __init__(self, model_type, *targets, module=None):
        self.model_type = model_type
        self.module = module or f"transformers.models.{model_type}.modeling_{model_type}"
        self.targets = targets

    @property
    def kernels(self):
        return tuple(k for k in KERNEL_NAMES if any(t.kernel == k for t in self.targets))

    def __repr__(self):
        return f"Model({self.model_type!r}, {len(self.targets)} targets)"


def _dense(model_type, prefix):
    """The llama family: a llama-style RMSNorm, a gated SiLU MLP and the standard rotary function."""
    return Model(
        model_type,
        Target("rms_norm", f"{prefix}RMSNorm.forward"),
        Target("swiglu", f"{prefix}MLP.forward"),
        Target("rope", "apply_rotary_pos_emb"),
    )


MODELS = {
    m.model_type: m
    for m in (
        _dense("llama", "Llama"),
        _dense("mistral", "Mistral"),
        _dense("qwen2", "Qwen2"),
        _dense("qwen3", "Qwen3"),
    )
}
