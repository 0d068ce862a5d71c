"""Every script in benchmarks/ runs in its quick mode and prints its table: none can rot unnoticed.

The figures are the scripts' business (README, docs); here each one must start, run every part of
its measurement once and print the lines that carry its figures.
"""

import functools
import re
import subprocess
import sys

import pytest

from .conftest import ROOT, child_env

# Child interpreters, clusters or the whole table: CI's full matrix (`pytest -m ""`), not the quick default.
pytestmark = [pytest.mark.full, pytest.mark.process]


BENCHMARKS = ROOT / "benchmarks"

# script -> a line of its table (a regular expression, matched against each printed line)
TABLES = {
    "attention_work.py": r"  16 packed documents in \d+ tokens: minimum [\d,]+; "
    r"stock default [\d,]+ \(\d+\.\d\dx\).*; patched default [\d,]+ \(1\.00x\).*",
    "aten_ops.py": r"  qwen3 +patched +\d+ ops = +\d+ aten \+ fused: .*npu_rms_norm \d+.*",
    "call_overhead.py": r"counting per call: fused [+-]\d+ ns, stock [+-]\d+ ns",
    "discovery_overhead.py": r"discovering \+ patching modeling_doge: +\d+\.\d\d ms",
    "import_overhead.py": r"both, per unrelated first import: +-?\d+ ns .*",
    "linear_attention.py": r"  +\d+ tokens, 4 documents *: stock +\d+ ops .* \| patched +\d+ ops +\d+\.\d ms",
    "loss_memory.py": r"bfloat16 at \d+ tokens: peak \d+\.\dx lower, time \d+\.\d\dx stock",
    "patch_time.py": r"first model of a process \(import modeling_qwen3\): \d+ ms stock, \d+ ms patched .*",
    "startup.py": r"  NPU_AUTOPATCH=1: +\d+\.\d ms .*",
    "traffic.py": r"  qwen3 +rms_norm +saves +\d+ kernels, +\d+\.\d\d GB, +\d+\.\d\d ms = +\d+\.\d % .*",
    "verl_logprobs.py": r"bfloat16 at \d+ tokens: ours \d+\.\d\dx verl's peak, \d+\.\d\dx its time",
}


def test_every_benchmark_has_a_quick_run_here():
    assert sorted(path.name for path in BENCHMARKS.glob("*.py")) == sorted(TABLES)


# Options of a script's quick run: traffic.py prints docs/performance.md's tables too (checked below).
QUICK_OPTIONS = {"traffic.py": ("--markdown",)}


@functools.cache
def quick(script: str) -> str:
    """The script's output in its quick mode (it must exit 0), run once per session."""
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *QUICK_OPTIONS.get(script, ())],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.parametrize("script", sorted(TABLES))
def test_the_benchmark_runs_quick_and_prints_its_table(script):
    out = quick(script)
    assert any(re.fullmatch(TABLES[script], line) for line in out.splitlines()), out


def test_traffic_counts_fewer_kernels_patched_than_stock():
    """traffic.py's qwen3 layer: a stock and a patched line, a line for each kernel qwen3's layer runs and for
    the candidates; the patched layer launches fewer kernels and moves fewer bytes than stock."""
    out = quick("traffic.py")
    totals = {
        label: (int(kernels), float(read) + float(written))
        for label, kernels, read, written in re.findall(
            r"^  qwen3 +(stock|patched) +(\d+) kernels  read +([\d.]+) GB  written +([\d.]+) GB  .* ms$",
            out,
            re.M,
        )
    }
    assert totals.keys() == {"stock", "patched"}, out
    assert totals["patched"][0] < totals["stock"][0], out
    assert totals["patched"][1] < totals["stock"][1], out
    saves = dict(
        re.findall(
            r"^  qwen3 +(\S.*?) +saves +(-?\d+) kernels, .* of the stock layer(?:, [+-]\d+ host syncs)?$",
            out,
            re.M,
        )
    )
    assert {"rms_norm", "swiglu", "rope", "attention", "candidate add+rms_norm"} <= saves.keys(), out
    assert any(label.startswith("candidate cross_entropy, per step") for label in saves), out
    assert int(saves["rms_norm"]) > 0 and int(saves["rope"]) > 0, out


def test_the_performance_docs_layer_table_holds_the_scripts_qwen3_row():
    """docs/performance.md's layer table is traffic.py's output (``--markdown``): its qwen3 row, which the
    quick run recounts, must be the script's, to the last digit (regenerate the tables when it is not)."""
    out = quick("traffic.py")
    rows = [line for line in out.splitlines() if line.startswith("| qwen3 (Qwen3-8B) |")]
    assert len(rows) == 1, out
    doc = (ROOT / "docs" / "performance.md").read_text().splitlines()
    assert rows[0] in doc, f"docs/performance.md's qwen3 row is not the script's:\n{rows[0]}"


def test_verl_logprobs_runs_ours_counted_fused_and_prints_every_error():
    """verl_logprobs.py: verl's forward ran ours (status() counted the call fused) and verl's own with
    the switch off; the error table has a row for each implementation."""
    out = quick("verl_logprobs.py")
    assert "  ran ours bfloat16 512 tokens: " in out and "counted fused/stock [1, 0]" in out, out
    assert re.search(r"  ran verl bfloat16 512 tokens: .*counted fused/stock \[0, 0\]", out), out
    for impl in ("stock", "ours", "verl", "linear_logprobs"):
        assert re.search(rf"^bfloat16 +512  {impl}( +\d\.\d\de-\d\d){{4}}$", out, re.M), (impl, out)
