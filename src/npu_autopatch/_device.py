"""Whether the NPU kernels can be used here: torch_npu imports and an NPU is visible.

Decided at the first hook after enable(), never in enable() itself, so that enabling stays
free of torch imports. Any exception from importing torch_npu (a missing CANN library, a
CUDA build of torch next to it, a broken install) is a reason to skip, never a crash.
"""


def probe():
    """(torch_npu module, None) when usable, else (None, reason)."""
    try:
        import torch_npu
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return None, f"torch_npu not importable: {type(exc).__name__}: {exc}"
    try:
        import torch

        npu = getattr(torch, "npu", None)
        if npu is None:
            return None, "torch_npu imported but torch.npu is missing"
        if not npu.is_available():
            return None, (
                "torch_npu imported but torch.npu.is_available() is False "
                "(no NPU visible: check ASCEND_RT_VISIBLE_DEVICES and the CANN environment)"
            )
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return None, f"torch.npu.is_available() raised {type(exc).__name__}: {exc}"
    return torch_npu, None
