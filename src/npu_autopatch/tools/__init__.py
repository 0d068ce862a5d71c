"""The command-line tools: ``scan``, ``verify`` and the verdict generator.

They import every modeling module, build tiny models or rewrite a shipped file: work a library must
never do on its user's behalf. So nothing in the library imports this package; the entry points
(``python -m npu_autopatch``, ``python -m npu_autopatch.kernels``) import it for the one way every
command refuses bad input (``UsageError``, ``Parser``, ``known``: one line, exit status 2), and a
tool when its command runs. The tools use the mechanism's public API and the internal functions it
keeps for them (``_candidates.stock_code``, ``_patcher.present_targets``,
``kernels.choose_variant(live=True)``, ``_control.selection``/``restore``), never another module's
private names.
"""

import argparse


class UsageError(Exception):
    """Bad input to a command (an unknown name, a missing directory, options that do not go together):
    ``python -m npu_autopatch`` prints it as one line on stderr, each line of it prefixed with the
    command, and exits 2; never a traceback."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line (a UsageError) instead of the usage and a line."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def known(names, valid, what: str, listed: bool = True):
    """``names`` if each is in ``valid``; else a UsageError for the first that is not: ``unknown <what>
    'qwen33' (did you mean 'qwen3'?)``, then the valid ones where ``listed`` (a short list)."""
    from .._config import did_you_mean

    for name in names:
        if name not in valid:
            hint = did_you_mean(name, list(valid))
            raise UsageError(
                f"unknown {what}: {name!r}"
                + (f" ({hint})" if hint else "")
                + (f"; valid: {', '.join(valid)}" if listed else "")
            )
    return names
