"""Which exceptions a replacement's fallback may take for its fused op's own failure.

A replacement runs its fused op in ``try: ... except Exception: on_error(...); return stock(...)``
(contract C1). ``except Exception`` also catches what torch raises *through* user code on
purpose, and a fallback that takes that for a kernel failure breaks torch: non-reentrant
gradient checkpointing stops a recomputation by raising ``_StopRecomputationError`` from a
saved-tensor hook, and rerunning the stock code then trips checkpoint's own assertion (issue
15). So ``on_error`` re-raises, untouched, with no demotion and no warning:

- torch's control flow, by the module that defines the exception's class (read in torch
  2.13's source): ``torch.utils.checkpoint`` (``_StopRecomputationError``, the early stop of a
  recomputation; ``CheckpointError``, a recomputation that diverged), ``torch._dynamo``
  (``TorchDynamoException`` and ``ObservedException`` with their subclasses: graph breaks,
  restarts, unsupported code), ``torch._subclasses`` (fake-tensor tracing: data-dependent
  outputs, operators without a fake kernel), ``torch.fx`` (symbolic shapes: a guard on a
  data-dependent value), ``torch._guards``, ``torch._export`` and ``torch.export``;
- ``StopIteration`` and ``StopAsyncIteration``, Python's own control flow;
- out of memory: ``torch.OutOfMemoryError`` (recent torch_npu raises it), or a
  ``RuntimeError`` whose message says "out of memory" (older torch_npu: "NPU out of
  memory. Tried to allocate ..."). A transient memory state is not a shape rule: the
  kernel stays, and the caller (or the trainer's OOM handling) sees the real error.

``KeyboardInterrupt``, ``SystemExit`` and ``GeneratorExit`` are not ``Exception``: the
replacements never catch them. Everything else a fused op raises is its failure: that call
runs stock and the target is demoted (``_patcher._demote``).
"""

import sys

_TORCH_CONTROL_FLOW = (
    "torch.utils.checkpoint",
    "torch._dynamo",
    "torch._subclasses",
    "torch.fx",
    "torch._guards",
    "torch._export",
    "torch.export",
)


def is_op_failure(exc: BaseException) -> bool:
    """Whether ``exc``, caught around a fused op, is that op's failure (see the module docstring)."""
    if not isinstance(exc, Exception) or isinstance(exc, (StopIteration, StopAsyncIteration)):
        return False
    if _out_of_memory(exc):
        return False
    return not any(_is_torch_control_flow(cls.__module__) for cls in type(exc).__mro__)


def is_early_stop(exc: BaseException) -> bool:
    """Whether ``exc`` is non-reentrant checkpointing's early stop of a recomputation (raised from a
    saved-tensor hook once every tensor the backward needs is recomputed: the op ran)."""
    cls = type(exc)
    return cls.__name__ == "_StopRecomputationError" and cls.__module__ == "torch.utils.checkpoint"


def _is_torch_control_flow(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in _TORCH_CONTROL_FLOW)


def _out_of_memory(exc: Exception) -> bool:
    out_of_memory = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    if out_of_memory is not None and isinstance(exc, out_of_memory):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc)
