"""LLaMA-Factory's own NPU kernels step aside for the models npu-autopatch patches.

LLaMA-Factory applies its NPU kernels only when asked (``use_v1_kernels: true`` in the classic
loader, a ``kernel_config`` in the v1 engine), after the model is built (after LoRA): each kernel
sets ``forward`` on the instances of the model's RMSNorm, MLP and MoE experts or block classes
(chosen by class name and ``config.architectures``) and rebinds ``apply_rotary_pos_emb`` in the
attention classes' modeling module. An instance's ``forward`` is out of reach of class-level patching:
without this, those modules ran LLaMA-Factory's code and status() could still say ``applied``.

The target is the one function every kernel goes through in the kernels' ``interface`` module
(models.py: a family, ``llamafactory.*kernels.interface``, found by what it defines):
``apply_kernels`` where it exists (main: the v1 engine and ``apply_v1_kernels`` call it), else
``apply_kernel`` (0.9.5: ``apply_default_kernels``, which ``use_v1_kernels`` runs, calls it for each
kernel). The replacement decides per model, from ``model.config.model_type``: a model whose type is
ours (``pending``, ``applied`` or ``partial`` in status()) is returned as it is, any other goes to
LLaMA-Factory's function. One rank-0 INFO line names LLaMA-Factory and the model it stepped aside for.

Not reached: main's kernels called one by one (``KernelPlugin(name).apply(model=...)``, main's
``BaseKernel.apply``, a classmethod) and 0.9.5's kernel classes' ``apply`` called directly. Those
still set instance forwards, and status() says so: the model becomes ``overridden`` with the
holder named, at the latest when it first runs (_instances).

The probe checks the shape this relies on: a plain function that takes the model as ``model=`` (a
parameter of that name, or keyword arguments). Code of another shape is refused with the reason and
LLaMA-Factory's kernels run as without us. ``enable(step_aside=False)`` /
``NPU_AUTOPATCH_STEP_ASIDE=0`` leaves it alone.
"""

from .._types import Kernel, Variant
from ._step_aside import FUNCTION, OURS, announce, shape_probe, states

FRAMEWORK = "LLaMA-Factory"
_VARKEYWORDS = 0x08  # inspect.CO_VARKEYWORDS, without importing inspect at interpreter start


def _shape(stock):
    """None if ``stock`` is LLaMA-Factory's apply_kernels / apply_kernel as this step-aside knows it."""
    if type(stock) is not FUNCTION:
        return f"it is a {type(stock).__name__}, not a plain function"
    code = stock.__code__
    named = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if "model" not in named and not code.co_flags & _VARKEYWORDS:
        return "it takes no model= argument"
    return None


def _model_of(stock, args, kwargs):
    """The model a call of ``stock`` is about: its ``model`` argument, by name or by position."""
    if "model" in kwargs:
        return kwargs["model"]
    code = stock.__code__
    names = code.co_varnames[: code.co_argcount]
    if "model" in names and names.index("model") < len(args):
        return args[names.index("model")]
    return None


def build(stock, npu, on_error):
    """LLaMA-Factory's function, skipped for a model whose type npu-autopatch patches.

    ``npu`` is not used: no fused op runs here. If deciding raises (a bug of ours), ``on_error``
    puts LLaMA-Factory's function back and this call runs it; what its code raises is its own.
    """
    import functools

    @functools.wraps(stock)
    def apply_kernels(*args, **kwargs):
        try:
            model = _model_of(stock, args, kwargs)
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            ours = model_type is not None and states([model_type]).get(model_type) in OURS
        except Exception as exc:
            on_error(exc)
            return stock(*args, **kwargs)
        if not ours:
            return stock(*args, **kwargs)
        announce(FRAMEWORK, f"{stock.__module__}.{stock.__qualname__}", [model_type], [])
        return model

    return apply_kernels


STEP_ASIDE = Kernel(
    "step_aside",
    (),
    [Variant("llamafactory_kernels", build, shape_probe(_shape, FRAMEWORK))],
    switch="step_aside",
    switched_on=True,
)
