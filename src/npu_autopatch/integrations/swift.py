"""ms-swift's own NPU patch steps aside for the models npu-autopatch patches.

ms-swift (4.6.0) patches on import whenever transformers reports an NPU: ``swift/model/__init__.py``
imports ``npu_patcher``, whose import runs ``npu_patch.apply_all_patches()``, which imports
``swift/model/npu_patch/model.py`` and calls its ``apply_patch()``. That function imports the qwen2,
qwen3, qwen3_vl, qwen3_moe, qwen3_vl_moe and qwen3_5(_moe) modeling modules (our hooks patch them
there) and rebinds their attributes with ``apply_patch_map(module, table)``: the norm class's name
pointed at its own ``NpuRMSNorm``, ``apply_rotary_pos_emb``, the MLP's and the MoE block's (5.x: the
experts class's) ``forward``. Without this, ms-swift's code replaced our kernels in those models.

The target is ``apply_patch`` of ms-swift's ``npu_patch.model`` module (models.py: a family,
``swift.*npu_patch.model``, found by what it defines). Its list of models is local to the function,
so the replacement runs ms-swift's very function (its code, defaults, module namespace) reading a
narrowed ``apply_patch_map``: a call for a modeling module whose models are ours (``pending``,
``applied`` or ``partial`` in status()) is skipped, every other call runs ms-swift's. What
``apply_patch`` does beside the map (Qwen3.5's ``FusedRMSNormGated`` set to None, transformers'
flash-linear-attention probe) is left to it. One rank-0 INFO line names ms-swift and the models it
stepped aside for.

The probe checks the shape this relies on: a plain function with no required argument that reads
the global ``apply_patch_map`` (directly or in nested code), and a callable ``apply_patch_map`` in its
module. Code of another shape is refused with the reason and ms-swift's patch runs as without us.
``enable(step_aside=False)`` / ``NPU_AUTOPATCH_STEP_ASIDE=0`` leaves it alone; ms-swift's own
switch, ``--enable_npu_model_patch false``, turns its model patch off either way.
"""

from .._types import Kernel, Variant
from ._step_aside import (
    FUNCTION,
    announce,
    modules_ours,
    reads_global,
    required_arguments,
    shape_probe,
    with_globals,
)

MAP = "apply_patch_map"  # ms-swift's helper: (modeling module, {path: object}) -> setattr each
FRAMEWORK = "ms-swift"


def _shape(stock):
    """None if ``stock`` is ms-swift's apply_patch as this step-aside knows it, else why not."""
    if type(stock) is not FUNCTION:
        return f"it is a {type(stock).__name__}, not a plain function"
    if required_arguments(stock):
        return "it takes required arguments"
    if not reads_global(stock.__code__, MAP):
        return f"it does not apply its tables through the global {MAP}"
    if not callable(stock.__globals__.get(MAP)):
        return f"its module's {MAP} is not callable"
    return None


def build(stock, npu, on_error):
    """ms-swift's apply_patch, run with its apply_patch_map skipping the modeling modules we patch.

    ``npu`` is not used: no fused op runs here. If deciding raises (a bug of ours), ``on_error``
    puts ms-swift's function back and this call runs it whole; what ms-swift's code raises is its own.
    """
    import functools

    @functools.wraps(stock)
    def apply_patch(*args, **kwargs):
        try:
            ours = modules_ours()
            original = stock.__globals__[MAP]
            stepped, kept = [], []

            def apply_patch_map(root, patch_map):
                models = ours.get(getattr(root, "__name__", None))
                if models:
                    stepped.extend(m for m in models if m not in stepped)
                    return None
                kept.append(getattr(root, "__name__", repr(root)).rpartition(".modeling_")[2])
                return original(root, patch_map)

            run = with_globals(stock, {MAP: apply_patch_map})
        except Exception as exc:
            on_error(exc)
            return stock(*args, **kwargs)
        result = run(*args, **kwargs)
        if stepped:
            announce(FRAMEWORK, f"{stock.__module__}.{stock.__qualname__}", stepped, kept)
        return result

    return apply_patch


STEP_ASIDE = Kernel(
    "step_aside",
    (),
    [Variant("swift_patch_map", build, shape_probe(_shape, FRAMEWORK))],
    switch="step_aside",
    switched_on=True,
)
