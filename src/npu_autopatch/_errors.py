"""The one exception npu_autopatch raises on purpose (strict mode only)."""


class PatchError(RuntimeError):
    """A selected model could not be patched and strict mode asked to fail loudly.

    The model has been rolled back to stock before this is raised.
    """
