"""The built-in kernels by name, readable without torch: what interpreter start needs of them.

Each kernel declares everything about itself in its own module (a ``Kernel``), but those modules
import torch, and interpreter start (``_config`` validating ``NPU_AUTOPATCH_KERNELS``, reading an
opt-in switch such as ``NPU_AUTOPATCH_LOSS``) must not. So this one torch-free line per kernel says
where its ``Kernel`` lives and, for an opt-in kernel, the name of its switch; ``kernels.KERNELS``
imports the modules and checks that each ``Kernel`` declares the same name and switch.

Order is the order status() and report() list kernels in.
"""

# (kernel name, module under kernels/, the attribute holding its Kernel, opt-in switch or None).
# An opt-in kernel changes what a forward returns (the loss kernel's ``logits=None``): it is never
# on by default nor through ``kernels=``, only through ``enable(<switch>=True)`` or
# ``NPU_AUTOPATCH_<SWITCH>=1``.
BUILTIN = (
    ("rms_norm", "norm", "RMS_NORM", None),
    ("gated_rms_norm", "norm", "GATED_RMS_NORM", None),
    ("swiglu", "mlp", "SWIGLU", None),
    ("rope", "rope", "ROPE", None),
    ("moe", "moe", "MOE", None),
    ("attention", "attention", "ATTENTION", None),
    ("gated_delta_rule", "linear_attention", "GATED_DELTA_RULE", None),
    ("loss", "loss", "LOSS", "loss"),
)

NAMES = tuple(name for name, _module, _attr, _switch in BUILTIN)
# {opt-in kernel: its switch}
SWITCHES = {name: switch for name, _module, _attr, switch in BUILTIN if switch is not None}
