"""Rank-0-only logging: each launcher's rank variable read in-process, and fresh interpreters launched as a
launcher would launch ranks."""

import pytest

from npu_autopatch._config import ENV_LOG_ALL_RANKS
from npu_autopatch._log import RANK_VARIABLES, _prefix

from .conftest import STAND_IN_SITE, run_python

IMPORT_QWEN3 = "from transformers.models.qwen3 import modeling_qwen3"
NO_NPU = (
    "npu-autopatch: NPU kernels not used, models run stock: "
    "torch_npu not importable: ModuleNotFoundError: No module named 'torch_npu'"
)


def our_lines(stderr):
    return [line for line in stderr.splitlines() if "npu-autopatch" in line]


@pytest.fixture
def no_launcher(monkeypatch):
    """An environment no launcher set: no rank variable, every rank's logging not asked for."""
    monkeypatch.delenv(ENV_LOG_ALL_RANKS, raising=False)
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# Each launcher's variable, read as the log line is written (in-process: the same function a child runs).
@pytest.mark.parametrize("variable", RANK_VARIABLES)
def test_each_launchers_rank_variable_decides_who_logs(variable, no_launcher):
    assert _prefix() == "npu-autopatch: "  # a single process
    no_launcher.setenv(variable, "0")
    assert _prefix() == "npu-autopatch: "
    no_launcher.setenv(variable, " 3 ")
    assert _prefix() is None
    no_launcher.setenv(variable, "not a rank")  # ignored: a single process
    assert _prefix() == "npu-autopatch: "


def test_the_first_rank_variable_set_wins(no_launcher):
    no_launcher.setenv("RANK", "5")
    no_launcher.setenv("SLURM_PROCID", "0")
    assert _prefix() is None


# The same in fresh interpreters, as a launcher starts ranks: the failure logged at the hooked import.
@pytest.mark.parametrize("rank_env", [{}, {"RANK": "0"}], ids=["single-process", "RANK"])
def test_rank_zero_or_single_process_logs_a_failure_once(rank_env):
    child = run_python(
        IMPORT_QWEN3 + "\nfrom transformers.models.llama import modeling_llama", NPU_AUTOPATCH="1", **rank_env
    )
    assert child.returncode == 0, child.stderr
    assert our_lines(child.stderr) == [NO_NPU]


def test_other_ranks_stay_silent():
    child = run_python(IMPORT_QWEN3, NPU_AUTOPATCH="1", SLURM_PROCID="7")
    assert child.returncode == 0, child.stderr
    assert our_lines(child.stderr) == []


def test_log_all_ranks_tags_each_line_with_the_rank():
    child = run_python(IMPORT_QWEN3, NPU_AUTOPATCH="1", RANK="3", NPU_AUTOPATCH_LOG_ALL_RANKS="1")
    assert our_lines(child.stderr) == [NO_NPU.replace("npu-autopatch:", "npu-autopatch [rank 3]:")]


def test_standard_logging_configuration_governs_our_messages():
    configured = """
        import logging, sys
        fmt = "%(levelname)s %(name)s %(message)s"
        logging.basicConfig(stream=sys.stdout, format=fmt, level=logging.INFO)
        from transformers.models.qwen3 import modeling_qwen3
    """
    child = run_python(configured, NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE))
    assert child.returncode == 0, child.stderr
    assert (
        "INFO npu_autopatch npu-autopatch: qwen3: applied rms_norm, swiglu, rope to 3 targets" in child.stdout
    )
    assert our_lines(child.stderr) == []

    silenced = configured.replace(
        "level=logging.INFO)",
        "level=logging.INFO)\n        logging.getLogger('npu_autopatch').setLevel(logging.ERROR)",
    )
    child = run_python(silenced, NPU_AUTOPATCH="1")
    assert child.returncode == 0, child.stderr
    assert "npu-autopatch" not in child.stdout + child.stderr


def test_success_is_not_printed_without_logging_configured():
    child = run_python(IMPORT_QWEN3, NPU_AUTOPATCH="1", PYTHONPATH=str(STAND_IN_SITE))
    assert child.returncode == 0, child.stderr
    assert our_lines(child.stderr) == []


def test_a_line_logged_under_the_package_lock_is_written_once_the_lock_is_let_go(caplog, monkeypatch):
    """Logging's lock is never taken while ours is held (see _state: logging's fork handler)."""
    import logging

    from npu_autopatch import _log
    from npu_autopatch._state import locked

    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="npu_autopatch"):
        with locked:
            with locked:  # reentrant: the lines wait for the outermost exit
                _log.warning("held back")
            assert caplog.messages == []
        assert caplog.messages == ["npu-autopatch: held back"]


def test_the_lines_that_insist_get_past_root_handlers_a_host_set_to_error():
    """ms-swift sets the root logger's stream handlers to ERROR (swift/utils/logger.py): the lines that
    another library replaced ours, or stepped aside, are still written (our own stderr handler, rank 0
    only); the other lines follow the host's configuration; a level set on our logger silences all."""
    child = run_python(
        """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        for handler in logging.root.handlers:
            handler.setLevel(logging.ERROR)  # as ms-swift's get_logger() does
        from npu_autopatch import _log
        _log.warning("replaced, insisting", insist=True)
        _log.info("stepped aside, insisting", insist=True)
        _log.warning("an ordinary warning")
        logging.getLogger("npu_autopatch").setLevel(logging.ERROR)  # the user's choice
        _log.warning("silenced by the user", insist=True)
        """
    )
    assert child.returncode == 0, child.stderr
    assert our_lines(child.stderr) == [
        "npu_autopatch WARNING npu-autopatch: replaced, insisting",
        "npu_autopatch INFO npu-autopatch: stepped aside, insisting",
    ]
    other_rank = run_python(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        logging.root.handlers[0].setLevel(logging.ERROR)
        from npu_autopatch import _log
        _log.warning("replaced, insisting", insist=True)
        """,
        RANK="1",
    )
    assert other_rank.returncode == 0 and our_lines(other_rank.stderr) == [], other_rank.stderr
