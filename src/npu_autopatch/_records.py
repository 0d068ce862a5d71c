"""What status() reports for one model."""

from dataclasses import dataclass

PENDING = "pending"  # selected; its modeling module has not been imported yet
APPLIED = "applied"  # every planned target holds our kernel
SKIPPED = "skipped"  # deliberately left stock (not selected, no NPU, foreign patch, math differs)
FAILED = "failed"  # something went wrong; the model was rolled back and runs stock
REVERTED = "reverted"  # was applied, then disable() restored the originals
OVERRIDDEN = "overridden"  # was applied, then another library replaced one of our targets


@dataclass(frozen=True)
class PatchRecord:
    """The state of one model type, with the reason whenever it is not simply applied."""

    model: str
    module: str
    state: str
    reason: str | None = None
    kernels: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()  # what was replaced, as "module:qualname"

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "module": self.module,
            "state": self.state,
            "reason": self.reason,
            "kernels": list(self.kernels),
            "targets": list(self.targets),
        }
