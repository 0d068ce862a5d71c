"""python -m npu_autopatch status|check, as a user runs it."""

import json
import subprocess
import sys

import pytest

from npu_autopatch.testing import DEFAULT

from .conftest import ROOT, child_env, warm_run

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = [pytest.mark.full, pytest.mark.process]

DENSE = ["llama", "mistral", "qwen2", "qwen3"]


def cli(*args, **env):
    return warm_run(
        [sys.executable, "-m", "npu_autopatch", *args],
        env=child_env(**env),
        timeout=300,
        cwd=ROOT,
    )


def test_check_simulate_lists_every_dense_model_applied():
    run = cli("check", "--simulate")
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line.split()[1:4] for line in run.stdout.splitlines() if line[:1].islower()}
    for model in DENSE:
        assert rows[model] == ["applied", "-", "rms_norm,swiglu,rope"], run.stdout
    assert "simulated:        True" in run.stdout


def test_check_json_is_machine_readable_and_names_the_environment():
    run = cli("check", "--simulate", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["environment"]["torch_npu"] == DEFAULT.torch_npu  # the stand-in's default profile
    assert report["environment"]["transformers"]
    assert all(report["models"][m]["state"] == "applied" for m in DENSE)
    assert report["models"]["qwen3"]["targets"][0].endswith("modeling_qwen3:Qwen3RMSNorm.forward")


def test_check_without_npu_skips_every_model_and_succeeds():
    run = cli("check", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["environment"]["npu_visible"].startswith("no: torch_npu not importable")
    states = {(r["state"], r["code"]) for r in report["models"].values()}
    assert states <= {("skipped", "no-npu"), ("absent", "module-absent")}, states
    assert ("skipped", "no-npu") in states


def test_check_exits_1_when_a_model_fails():
    run = cli("check", "--simulate", NPU_AUTOPATCH_STRICT="1", NPU_AUTOPATCH_KERNELS="rms_norm")
    assert run.returncode == 0, run.stderr  # strict, but every selected model applies
    failing = warm_run(
        [
            sys.executable,
            "-c",
            "import sys; from npu_autopatch.__main__ import main\n"
            "from transformers.models.qwen3 import modeling_qwen3\n"
            "del modeling_qwen3.Qwen3MLP\n"
            "sys.exit(main(['check', '--simulate']))",
        ],
        env=child_env(),
        timeout=300,
        cwd=ROOT,
    )
    assert failing.returncode == 1, failing.stderr
    assert "qwen3 failed" in " ".join(failing.stdout.split())
    assert "target Qwen3MLP.forward not found" in failing.stdout


def test_status_prints_the_environment_and_every_model():
    run = cli("status", NPU_AUTOPATCH="1")
    assert run.returncode == 0, run.stderr
    assert "patching_enabled: True" in run.stdout
    for model in DENSE:
        assert f"\n{model} " in run.stdout
    assert "waiting for the import of transformers.models.llama.modeling_llama" in run.stdout


def test_the_tools_commands_answer_through_the_entry_points():
    # The tools live in npu_autopatch.tools; both entry points still reach them.
    scan = cli("scan", "--help")
    assert scan.returncode == 0, scan.stderr
    assert "--no-parity" in scan.stdout
    generator = warm_run(
        [sys.executable, "-m", "npu_autopatch.kernels", "--help"],
        env=child_env(),
        timeout=300,
        cwd=ROOT,
    )
    assert generator.returncode == 0, generator.stderr
    assert "--write" in generator.stdout and "python -m npu_autopatch.kernels" in generator.stdout


# Every command, as a job with patching on runs it (issue 24): its report printed, JSON that parses.
# Strict mode is the user's selection failing loudly on import; a tool only looks, so it still reports
# (verify used to lose its report when putting the strict selection back raised PatchError).
COMMANDS = {
    "status": ("status", "--json"),
    "check": ("check", "--simulate", "--json"),
    "report": ("report", "--model-type", "qwen3", "--json"),
    "verify": ("verify", "--device", "cpu", "--simulate", "--models", "qwen3", "--json"),
    "scan": ("scan", "--dirs", "qwen3", "--no-parity", "--json"),
    "models": ("models",),
}


@pytest.mark.parametrize("strict", ["0", "1"], ids=["lenient", "strict"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_prints_its_report_with_patching_on(command, strict):
    run = cli(*COMMANDS[command], NPU_AUTOPATCH="1", NPU_AUTOPATCH_STRICT=strict)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    if command == "models":
        assert "| qwen3 |" in run.stdout
        return
    printed = json.loads(run.stdout)
    assert printed, run.stderr
    if command == "verify":
        assert printed["passed"] is True
        if strict == "1":  # the selection put back raised on this node (no torch_npu): said, not fatal
            assert "strict" in run.stderr and "torch_npu" in run.stderr


def test_a_command_that_needs_torch_says_so_in_one_line_where_it_is_missing():
    """The base interpreter of this venv has neither torch nor transformers (a fresh login node)."""
    import os

    base = os.path.join(sys.base_prefix, "bin", "python3")
    probe = subprocess.run([base, "-c", "import torch"], capture_output=True, env=child_env())
    if probe.returncode == 0:
        pytest.skip("the base interpreter has torch: no interpreter without it here")
    for command in (
        ("check",),  # every model "absent" would pass: a node without transformers trains unpatched
        ("check", "--simulate"),
        ("report", "--model-type", "qwen3"),
        ("scan", "--json"),
        ("verify", "--simulate"),
    ):
        run = subprocess.run(
            [base, "-m", "npu_autopatch", *command],
            env=child_env(PYTHONPATH=str(ROOT / "src")),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2, run.stderr
        assert "Traceback" not in run.stderr and len(run.stderr.splitlines()) == 1, run.stderr
        assert "needs torch and transformers installed" in run.stderr
    status = subprocess.run(
        [base, "-m", "npu_autopatch", "status"],
        env=child_env(PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0 and "patching_enabled: False" in status.stdout, status.stderr


# Bad input, command by command (issue 33): one line on stderr naming the mistake, exit status 2, nothing
# on stdout, never a traceback. (verify's "not working" verdict, exit 1, is tests/test_verify.py's.)
BAD_INPUT = {
    "check-unknown-model": (
        ("check", "--simulate"),
        {"NPU_AUTOPATCH_MODELS": "nosuchmodel"},
        "'nosuchmodel'",
    ),
    "check-unknown-kernel": (("check", "--simulate"), {"NPU_AUTOPATCH_KERNELS": "bogus"}, "'bogus'"),
    "check-typo": (("check",), {"NPU_AUTOPATCH_MODELS": "qwen33,qwen3"}, "did you mean 'qwen3'"),
    "check-nothing-selected": (
        ("check", "--simulate"),
        {"NPU_AUTOPATCH_MODELS": "qwen3", "NPU_AUTOPATCH_EXCLUDE": "qwen3"},
        "no model will be patched",
    ),
    "check-option": (("check", "--bogus"), {}, "unrecognized arguments: --bogus"),
    "status-option": (("status", "--bogus"), {}, "unrecognized arguments: --bogus"),
    "models-option": (("models", "--bogus"), {}, "unrecognized arguments: --bogus"),
    "no-command": ((), {}, "required: command"),
    "unknown-command": (("nosuchcommand",), {}, "invalid choice: 'nosuchcommand'"),
    "report-unknown-model": (
        ("report", "--model-type", "nosuchmodel"),
        {},
        "unknown model type of transformers",
    ),
    "report-typo": (("report", "--model-type", "qwen33"), {}, "did you mean 'qwen3'"),
    "report-profile": (
        ("report", "--model-type", "qwen3", "--profile", "banana"),
        {},
        "invalid choice: 'banana'",
    ),
    "report-no-model-type": (("report",), {}, "required: --model-type"),
    "scan-missing-dir": (
        ("scan", "--dirs", "nosuchdir"),
        {},
        "unknown directory in transformers/models: 'nosuchdir'",
    ),
    "scan-typo": (("scan", "--dirs", "qwen33", "--no-parity"), {}, "did you mean 'qwen3'"),
    "scan-dtype": (("scan", "--dtype", "float16"), {}, "unknown dtype: 'float16'"),
    "verify-default-attention": (
        ("verify", "--simulate", "--models", "default_attention"),
        {},
        "not verifiable",
    ),
    "verify-verl": (("verify", "--simulate", "--models", "verl_npu_patch"), {}, "not verifiable"),
    "verify-typo": (("verify", "--simulate", "--models", "qwen33"), {}, "did you mean 'qwen3'"),
    "verify-dtype": (("verify", "--simulate", "--dtype", "fp8"), {}, "unknown dtype: 'fp8'"),
    "verify-profile": (("verify", "--simulate", "banana"), {}, "unknown stand-in profile: 'banana'"),
    "verify-npu-simulated": (("verify", "--simulate", "--device", "npu"), {}, "leave out --device npu"),
    "verify-cpu-unsimulated": (("verify", "--device", "cpu"), {}, "--device cpu needs --simulate"),
    "verify-no-npu": (("verify",), {}, "cannot verify: torch_npu not importable"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_status_2(case):
    argv, env, said = BAD_INPUT[case]
    run = cli(*argv, **env)
    assert run.returncode == 2, run.stdout[-1000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stdout == "", run.stdout[-1000:] + run.stderr[-2000:]
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m npu_autopatch"), run.stderr
    assert said in lines[0], lines[0]


def test_a_selection_mistake_at_start_and_in_check_is_two_lines_at_most():
    run = cli("check", "--simulate", NPU_AUTOPATCH="1", NPU_AUTOPATCH_KERNELS="bogus")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.splitlines()  # the start's WARNING, then check's verdict
    assert len(lines) == 2 and all("'bogus'" in line for line in lines), lines


def test_verify_simulate_alone_runs_on_the_cpu():
    run = cli("verify", "--simulate", "--models", "llama", "--dtype", "float32", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["environment"]["device"] == "cpu"


def test_report_says_it_ran_on_the_cpu_stand_in():
    run = cli("report", "--model-type", "qwen3")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "on the CPU stand-in for torch_npu" in run.stdout.splitlines()[0], run.stdout[:500]
    assert "CPU stand-in" in " ".join(cli("report", "--help").stdout.split())


def test_a_reader_that_stops_early_gets_no_traceback():
    """``models | head``: the pipe is closed before the table is written (deterministically so)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "npu_autopatch", "models"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        cwd=ROOT,
    )
    child.stdout.close()
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=120) == 1
    assert stderr == ""


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_help_page_describes_its_command_in_plain_text(command):
    run = cli(*command.split(), "--help")
    assert run.returncode == 0, run.stderr
    usage, description = run.stdout.split("\n\n")[:2]
    assert usage.startswith("usage: python -m npu_autopatch")
    assert not description.lstrip().startswith(("positional arguments", "options")), run.stdout
    assert "``" not in run.stdout
