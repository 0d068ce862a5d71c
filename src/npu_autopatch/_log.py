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

Two kinds of line *insist* (``insist=True``): that another library's code replaced ours, and that
another library's NPU patch stepped aside for ours. A host program may set the handlers of the root
logger above them without meaning to silence us (ms-swift sets the root's stream handlers to ERROR,
against DDP's duplicate lines on other ranks: ``swift/utils/logger.py``). So where our logger is
enabled for the line's level and yet no handler on its way up would emit it, such a line is written
by a stderr handler of our own, on rank 0 only. A level set on our logger itself
(``logging.getLogger("npu_autopatch").setLevel(logging.ERROR)``) is the user's choice and silences it.
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


def _emit(level, message, insist=False):
    if not defer(lambda: _write(level, message, insist)):
        _write(level, message, insist)


def _write(level, message, insist=False):
    prefix = _prefix()
    if prefix is None:
        return
    import logging

    logger = logging.getLogger(LOGGER_NAME)
    levelno = getattr(logging, level)
    if insist and logger.isEnabledFor(levelno) and not _handled(logger, levelno):
        _own_handler().handle(
            logger.makeRecord(LOGGER_NAME, levelno, __file__, 0, "%s%s", (prefix, message), None)
        )
        return
    logger.log(levelno, "%s%s", prefix, message)


def _handled(logger, levelno):
    """Whether a record of ``levelno`` from ``logger`` reaches a handler that emits it (logging's own
    walk up the hierarchy, Logger.callHandlers; with no handler at all, ``logging.lastResort``)."""
    import logging

    seen = False
    current = logger
    while current is not None:
        for handler in current.handlers:
            seen = True
            if levelno >= handler.level:
                return True
        if not current.propagate:
            break
        current = current.parent
    last = logging.lastResort
    return not seen and last is not None and levelno >= last.level


def _own_handler():
    """A stderr handler of ours, made for the rare line that needs it (the sys.stderr of that moment)."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    return handler


def warning(message, insist=False):
    _emit("WARNING", message, insist)


def info(message, insist=False):
    _emit("INFO", message, insist)


def debug(message):
    _emit("DEBUG", message)
