"""Interpreter-start entry: the .pth line and the example sitecustomize call boot().

Runs inside site.py, so it must never raise or print a traceback, whatever the environment
holds, and must stay cheap (os and sys only until a warning is due). A venv's site-packages
can be processed twice in one process, so boot() is idempotent.
"""

import os
import sys


def boot(default: bool = False) -> None:
    """Enable patching if NPU_AUTOPATCH says so (``default`` when it is unset)."""
    try:
        from . import _config, _control, _log
        from ._state import STATE

        if STATE.booted:
            return
        STATE.booted = True

        raw = os.environ.get(_config.ENV_SWITCH)
        switched_on = default if raw is None else _config.parse_bool(_config.ENV_SWITCH, raw, _log.warning)
        if switched_on:
            _control.enable()
    except Exception as exc:  # a broken install must not stop the interpreter
        sys.stderr.write(f"npu-autopatch: not enabled at start-up: {exc!r}\n")
