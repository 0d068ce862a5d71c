"""Every NPU_AUTOPATCH* variable against a deterministic corpus of hostile values.

At start-up (fresh interpreters, ~10 ms each): never a failure or a traceback, exactly the
warnings the rules call for (one per bad variable, listing the valid names), and no module
imported that a value names. Then once through the lazy path, with the whole corpus in every
variable at once: valid names among the junk still select, nothing is executed.
"""

import json
import subprocess
import sys

from npu_autopatch import _control, _state
from npu_autopatch._config import FALSE_WORDS, SELECTABLE_KERNELS, TRUE_WORDS
from npu_autopatch.models import MODELS

from .conftest import ROOT, STAND_IN_SITE, child_env

LISTS = {
    "NPU_AUTOPATCH_MODELS": ("models", tuple(MODELS)),
    "NPU_AUTOPATCH_EXCLUDE": ("models", tuple(MODELS)),
    "NPU_AUTOPATCH_KERNELS": ("kernels", SELECTABLE_KERNELS),
}
FLAGS = ("NPU_AUTOPATCH_STRICT", "NPU_AUTOPATCH_LOG_ALL_RANKS", "NPU_AUTOPATCH_LOSS")


def corpus(marker):
    """Empty, blank, valid and unknown names, huge, non-ASCII, control characters, shell and
    Python payloads that would touch ``marker`` if anything ran them, and module names."""
    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return [
        "",
        " ",
        "\t\n",
        ",",
        " , ,, ",
        "1",
        " YES ",
        "off",
        "qwen3",
        " Qwen3 ,LLAMA",
        "rms_norm,rope",
        "qwen3,bogus",
        "bogus",
        "rms-norm",
        "x" * 100_000,
        "a," * 20_000,
        "\u00e9t\u00e9,\u4e2d\u6587,\U0001f600",
        "\x1b[31mred\x1b[0m",
        "line1\nline2\r\n",
        f"$(touch {marker})",
        f"`touch {marker}`; touch {marker} | cat && touch {marker}",
        touch,
        f"exec({touch!r})",
        "{0.__class__}%s%n%x",
        "os,subprocess,ctypes",
        "transformers.models.llama.modeling_llama",
        "npu_autopatch._patcher,npu_autopatch.kernels",
        "../../../../etc/passwd",
    ]


STATE = """
import json, sys
npu = sys.modules.get("npu_autopatch")
state = sys.modules.get("npu_autopatch._state")
print(json.dumps({
    "enabled": bool(npu and npu.is_enabled()),
    "config": repr(state.STATE.config) if state and state.STATE.config else None,
    "modules": sorted(sys.modules),
}))
"""


def start(env):
    child = subprocess.run(
        [sys.executable, "-c", STATE],
        env={**child_env(), **env},
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=60,
        cwd=ROOT,
    )
    assert child.returncode == 0, (env, child.stderr)
    assert "Traceback" not in child.stderr, (env, child.stderr)
    return json.loads(child.stdout), child.stderr.splitlines()


def names(value):
    return [n.strip().lower() for n in value.split(",") if n.strip()]


def expected_warnings(env):
    """The rules of _config, stated independently: one warning per variable with a bad value."""
    word = env["NPU_AUTOPATCH"].strip().lower()
    if word not in TRUE_WORDS:
        return [] if word in FALSE_WORDS else ["NPU_AUTOPATCH="]
    warnings = []
    for variable, (what, valid) in LISTS.items():
        if any(n not in valid for n in names(env[variable])):
            warnings.append(f"unknown {what} in {variable}: ")
    for flag in ("NPU_AUTOPATCH_STRICT", "NPU_AUTOPATCH_LOSS"):  # in the order they are read
        if env[flag].strip().lower() not in TRUE_WORDS + FALSE_WORDS:
            warnings.append(f"{flag}=")
    return warnings


def test_every_variable_with_every_value_starts_cleanly(tmp_path):
    marker = tmp_path / "executed"
    values = corpus(marker)
    variables = ["NPU_AUTOPATCH", *LISTS, *FLAGS]
    # What start-up may import at most: our core, and logging when there is a warning to give.
    allowed = set(start({"NPU_AUTOPATCH": "1", "NPU_AUTOPATCH_MODELS": "bogus"})[0]["modules"])
    # An unknown name makes start-up look for the installed plugins' models: valid too.
    _control.discover_plugins()
    valid_models = ", ".join(_state.STATE.models)
    # Two passes over the corpus, each value in every variable once per pass (rotated): the
    # switch itself fuzzed, then the switch on so that the other variables are read.
    for switch_on in (False, True):
        for row in range(len(values)):
            env = {v: values[(row + 7 * i) % len(values)] for i, v in enumerate(variables)}
            if switch_on:
                env["NPU_AUTOPATCH"] = "1"
            state, lines = start(env)
            expected = expected_warnings(env)
            assert len(lines) == len(expected), (env, lines)
            for line, fragment in zip(lines, expected, strict=True):
                assert line.startswith("npu-autopatch: ignoring " + fragment), (env, line)
                assert len(line) < 2000, "a huge value must be echoed shortened"
                if "unknown models" in fragment:
                    assert line.endswith(f"valid models: {valid_models}"), line
                if "unknown kernels" in fragment:
                    assert line.endswith(f"valid kernels: {', '.join(SELECTABLE_KERNELS)}"), line
            assert state["enabled"] is (env["NPU_AUTOPATCH"].strip().lower() in TRUE_WORDS)
            assert set(state["modules"]) <= allowed, (env, sorted(set(state["modules"]) - allowed))
    assert not marker.exists()


def test_invalid_utf8_bytes_in_every_variable_start_cleanly():
    raw = b"\xff\xfe, qwen3,\x80"
    env = {variable.encode(): raw for variable in (*LISTS, *FLAGS)}
    env[b"NPU_AUTOPATCH"] = b"1"
    state, lines = start(env)
    assert state["enabled"] is True
    assert "models=qwen3," in state["config"]  # the valid name among the undecodable bytes
    assert [line.split(":")[1] for line in lines] == [
        " ignoring unknown models in NPU_AUTOPATCH_MODELS",
        " ignoring unknown models in NPU_AUTOPATCH_EXCLUDE",
        " ignoring unknown kernels in NPU_AUTOPATCH_KERNELS",
        " ignoring NPU_AUTOPATCH_STRICT='\\udcff\\udcfe, qwen3,\\udc80'",
        " ignoring NPU_AUTOPATCH_LOSS='\\udcff\\udcfe, qwen3,\\udc80'",
    ], lines


LAZY = """
import json, sys
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.llama import modeling_llama
import npu_autopatch
report = npu_autopatch.status()
print(json.dumps({m: [report[m].state, report[m].reason, report[m].kernels] for m in ("qwen3", "llama")}))
"""


def test_the_whole_corpus_at_once_through_the_lazy_path(tmp_path):
    marker = tmp_path / "executed"
    junk = ",".join(v for v in corpus(marker) if len(v) < 1000)
    child = subprocess.run(
        [sys.executable, "-c", LAZY],
        env=child_env(
            NPU_AUTOPATCH="1",
            NPU_AUTOPATCH_MODELS=junk,  # selects qwen3 and llama among the junk
            NPU_AUTOPATCH_EXCLUDE=junk.replace("qwen3", "").replace("Qwen3", ""),  # ... excludes llama
            NPU_AUTOPATCH_KERNELS=junk,  # rms_norm and rope, not swiglu
            NPU_AUTOPATCH_STRICT=junk,
            NPU_AUTOPATCH_LOG_ALL_RANKS=junk,
            PYTHONPATH=str(STAND_IN_SITE),
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["qwen3"] == ["applied", None, ["rms_norm", "rope"]]
    assert report["llama"] == ["skipped", "excluded by configuration", []]
    assert len(child.stderr.splitlines()) == 4  # models, exclude, kernels, strict: once each
    assert not marker.exists()


def test_a_list_with_no_name_in_it_counts_as_unset():
    # NPU_AUTOPATCH_MODELS=$MODELS with MODELS unset must not select nothing, silently.
    state, lines = start(
        {
            "NPU_AUTOPATCH": "1",
            "NPU_AUTOPATCH_MODELS": " , ",
            "NPU_AUTOPATCH_KERNELS": "",
            "NPU_AUTOPATCH_EXCLUDE": ",",
        }
    )
    assert lines == []
    assert state["config"] == "Config(models=all, exclude=none, kernels=all, strict=False, force=False)"
