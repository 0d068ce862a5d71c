"""Rank-0 logging through the stdlib logger ``npu_autopatch``.

We attach no handler: with no logging configured, Python's ``logging.lastResort`` prints
WARNING and above on stderr (so a failure is seen, as with transformers), and once the
application configures logging, its configuration governs ours. ``logging`` itself is
imported only when something is logged, because it costs ~14 ms at interpreter start.

Hooks fire before torch.distributed is initialised, so the launcher's environment
variables decide the rank there; torch.distributed is asked only once it is initialised
(and never imported by us).

A line logged while the package lock is held (``_state.locked``) is written when the lock
is let go (see _state: logging's lock and ours must never be held together).
"""

import os
import sys

from ._config import ENV_LOG_ALL_RANKS, TRUE_WORDS
from ._state import defer

LOGGER_NAME = "npu_autopatch"
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def global_rank():
    """The global rank of this process, or None for a single process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return dist.get_rank()
        except Exception:  # a half-initialised process group must not stop logging
            pass
    for name in RANK_VARIABLES:
        raw = os.environ.get(name)
        if raw is not None:
            try:
                return int(raw.strip())
            except ValueError:
                continue
    return None


def _prefix():
    """'npu-autopatch: ' on rank 0 / single process, None on other ranks (silent)."""
    rank = global_rank()
    if os.environ.get(ENV_LOG_ALL_RANKS, "").strip().lower() in TRUE_WORDS:
        return "npu-autopatch: " if rank is None else f"npu-autopatch [rank {rank}]: "
    return "npu-autopatch: " if rank in (None, 0) else None


def _emit(level, message):
    if not defer(lambda: _write(level, message)):
        _write(level, message)


def _write(level, message):
    prefix = _prefix()
    if prefix is None:
        return
    import logging

    logging.getLogger(LOGGER_NAME).log(getattr(logging, level), "%s%s", prefix, message)


def warning(message):
    _emit("WARNING", message)


def info(message):
    _emit("INFO", message)


def debug(message):
    _emit("DEBUG", message)
