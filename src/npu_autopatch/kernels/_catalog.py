"""The built-in kernels by name, readable without torch: what interpreter start needs of them.

Each kernel declares everything about itself in its own module (a ``Kernel``), but those modules
import torch, and interpreter start (``_config`` validating ``NPU_AUTOPATCH_KERNELS``, reading an
opt-in switch such as ``NPU_AUTOPATCH_LOSS``) must not. So this one torch-free line per kernel says
where its ``Kernel`` lives and, for an opt-in kernel, the name of its switch; ``kernels.KERNELS``
imports the modules and checks that each ``Kernel`` declares the same name and switch.

Order is the order status() and report() list kernels in.
"""

# (kernel name, module under kernels/, the attribute holding its Kernel, its own switch or None,
# whether that switch is on by default). A kernel with a switch is outside ``kernels=``: only
# ``enable(<switch>=...)`` or ``NPU_AUTOPATCH_<SWITCH>`` turn it on or off. An opt-in one (off by
# default) changes what a forward returns (the loss kernel's ``logits=None``); a switched-on one
# changes a choice transformers makes for the user (default_attention: the default attention
# implementation), which a user may want back as it was.
BUILTIN = (
    ("rms_norm", "norm", "RMS_NORM", None, False),
    ("gated_rms_norm", "norm", "GATED_RMS_NORM", None, False),
    ("swiglu", "mlp", "SWIGLU", None, False),
    ("geglu", "mlp", "GEGLU", None, False),
    ("gelu", "activations", "GELU", None, False),
    ("quick_gelu", "activations", "QUICK_GELU", None, False),
    ("rope", "rope", "ROPE", None, False),
    ("moe", "moe", "MOE", None, False),
    ("attention", "attention", "ATTENTION", None, False),
    ("default_attention", "attention", "DEFAULT_ATTENTION", "default_attention", True),
    ("gated_delta_rule", "linear_attention", "GATED_DELTA_RULE", None, False),
    ("loss", "loss", "LOSS", "loss", False),
)

NAMES = tuple(line[0] for line in BUILTIN)
# {kernel with a switch of its own: its switch}
SWITCHES = {name: switch for name, _module, _attr, switch, _on in BUILTIN if switch is not None}
# {switch: on by default}
SWITCH_DEFAULTS = {switch: on for _name, _module, _attr, switch, on in BUILTIN if switch is not None}
