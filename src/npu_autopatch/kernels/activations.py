"""The GELU family on torch_npu's own ops: ``npu_gelu`` (exact or tanh) and ``npu_fast_gelu`` (quick GELU).

Targets are transformers' activation classes (``transformers.activations``, which every model's
``ACT2FN[config.hidden_act]`` instantiates), patched once for all models, as the table's integration
entries are (models.py, ``activations``):

- ``gelu``: exact GELU (``hidden_act="gelu"``: ``GELUActivation``, torch's gelu; ``gelu_python``, its erf
  formula) on ``npu_gelu(x, approximate="none")``, and the tanh forms (``gelu_new``, ``gelu_fast``,
  ``gelu_pytorch_tanh``, ``gelu_python_tanh``) on ``npu_gelu(x, approximate="tanh")``: one kernel where
  the Python formulas launch several. For exact GELU it is also a correction: torch's own ``gelu`` on
  the NPU ignores ``approximate`` and computes the tanh form (op-plugin ``gelu``/``gelu.out`` call
  ``aclnnGelu(self, out)``; torch_npu-npu_gelu.md says so; docs/device-rules.md), so a model trained
  with exact GELU runs another function there unless it is patched.
- ``quick_gelu``: ``x * sigmoid(1.702 x)`` (``QuickGELUActivation``: Qwen2-VL's vision tower, CLIP) on
  ``npu_fast_gelu``, whose Atlas A2/A3 formula is that one (torch_npu-npu_fast_gelu.md), where the release
  registers its backward (op-plugin 7.3.0 on) and the device is an A2 or A3; stock otherwise, with the
  reason in status().

Which GELU an instance computes is read from the instance (``gelu_mode``): ``GELUActivation`` and
``GELUTanh`` keep the function they call in ``act``. An instance whose function is none this kernel knows
runs the stock code, counted with the reason.
"""

import functools
import inspect

import torch

from .._types import Kernel, Report, Variant
from ._calls import counters
from ._probe import agree_strict, generator, instance, one_input, randn, with_stock_names
from ._requirements import fast_gelu_requirement, gelu_requirement

# torch's gelu itself (``torch.nn.functional.gelu`` is this builtin): what a GELU module's ``act`` must
# be, unwrapped, to run as npu_gelu. A wrapper (functools.wraps) around it counts as it.
_TORCH_GELU = torch._C._nn.gelu


def _is_torch_gelu(fn):
    try:
        return inspect.unwrap(fn) is _TORCH_GELU
    except ValueError:  # a cycle of __wrapped__
        return False


def _bound_to(fn, name):
    return getattr(getattr(fn, "__func__", None), "__name__", None) == name


def _exact_mode(module):
    """GELUActivation: torch's gelu (exact by default) or its erf formula, ``_gelu_python``."""
    act = getattr(module, "act", None)
    return "none" if _is_torch_gelu(act) or _bound_to(act, "_gelu_python") else None


def _tanh_mode(module):
    """GELUTanh: torch's gelu with approximate="tanh", or its tanh formula, ``_gelu_tanh_python``."""
    act = getattr(module, "act", None)
    if isinstance(act, functools.partial):
        if _is_torch_gelu(act.func) and not act.args and act.keywords == {"approximate": "tanh"}:
            return "tanh"
        return None
    return "tanh" if _bound_to(act, "_gelu_tanh_python") else None


def _torch_module_mode(module):
    approximate = getattr(module, "approximate", None)
    return approximate if approximate in ("none", "tanh") else None


def _always_tanh(module):
    return "tanh"


def gelu_modes():
    """{activation class: function of an instance giving its GELU, "none" or "tanh", or None}."""
    modes = {torch.nn.GELU: _torch_module_mode}
    try:
        from transformers import activations
    except ImportError:
        return modes
    for name, mode in (
        ("GELUActivation", _exact_mode),
        ("GELUTanh", _tanh_mode),
        ("NewGELUActivation", _always_tanh),  # 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
        ("FastGELUActivation", _always_tanh),  # the same with sqrt(2/pi) written 0.7978845608
    ):
        cls = getattr(activations, name, None)
        if cls is not None:
            modes[cls] = mode
    return modes


def gelu_mode(module, modes=None):
    """The GELU ``module`` computes as npu_gelu's ``approximate`` ("none" or "tanh"), or None when it is
    no GELU module this kernel knows (then it runs stock). ``modes``: gelu_modes(), read once by a build."""
    mode = (modes or gelu_modes()).get(type(module))
    return None if mode is None else mode(module)


def not_a_known_gelu(module):
    """For report() and the stock counts: why ``module`` runs the stock code, else None."""
    if gelu_mode(module) is not None:
        return None
    act = getattr(module, "act", module)
    name = getattr(act, "__name__", type(act).__name__)
    return f"{type(module).__name__} calls {name}, no GELU npu_gelu computes"


def _build_gelu(stock, npu, on_error):
    modes = gelu_modes()
    count_fused, count_stock = counters(on_error)

    def forward(self, input):
        mode = gelu_mode(self, modes)
        if mode is None:
            count_stock(lambda: not_a_known_gelu(self), input)
            return stock(self, input)
        try:
            out = npu.npu_gelu(input, approximate=mode)
        except Exception as exc:
            on_error(exc, input)
            return stock(self, input)
        count_fused()
        return out

    return with_stock_names(forward, stock)


def _default_instance(stock):
    """An instance of the class defining ``stock``, built by its own argument-free constructor (the
    activation classes take none and draw no random numbers), else None."""
    owner_name = getattr(stock, "__qualname__", "").rpartition(".")[0]
    owner = getattr(stock, "__globals__", {}).get(owner_name)
    if not (isinstance(owner, type) and issubclass(owner, torch.nn.Module)):
        return None
    try:
        return owner()
    except Exception:
        return None


def _agree_on_sample(stock, candidate, module):
    """None when ``stock`` (a ``forward(self, input)``) and the candidate agree on ``module`` over a
    sample reaching GELU's tails (where the tanh form and erf part), else why not."""
    reason = one_input(stock)
    if reason is not None:
        return reason
    x = randn(generator(), 2, 3, 16) * 3
    return agree_strict(lambda: stock(module, x), lambda: candidate(module, x))


def _probe_gelu(stock, candidate):
    module = _default_instance(stock)
    if module is None or gelu_mode(module) is None:
        return f"{getattr(stock, '__qualname__', stock)} is not a GELU class this kernel knows"
    return _agree_on_sample(stock, candidate, module)


GELU = Kernel(
    "gelu",
    ("npu_gelu",),
    (Variant("npu-gelu", _build_gelu, _probe_gelu),),
    requires=gelu_requirement,
    report=Report(instance_stock=not_a_known_gelu),
)


def _build_quick(stock, npu, on_error):
    count_fused = counters(on_error)[0]

    def forward(self, input):
        try:
            out = npu.npu_fast_gelu(input)
        except Exception as exc:
            on_error(exc, input)
            return stock(self, input)
        count_fused()
        return out

    return with_stock_names(forward, stock)


def _probe_quick(stock, candidate):
    return _agree_on_sample(stock, candidate, instance(stock))


QUICK_GELU = Kernel(
    "quick_gelu",
    ("npu_fast_gelu",),
    (Variant("fast-gelu", _build_quick, _probe_quick),),
    requires=fast_gelu_requirement,
)
