"""Every script in benchmarks/ runs in its quick mode and prints its table: none can rot unnoticed.

The figures are the scripts' business (README, docs); here each one must start, run every part of
its measurement once and print the lines that carry its figures.
"""

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
}


def test_every_benchmark_has_a_quick_run_here():
    assert sorted(path.name for path in BENCHMARKS.glob("*.py")) == sorted(TABLES)


@pytest.mark.parametrize("script", sorted(TABLES))
def test_the_benchmark_runs_quick_and_prints_its_table(script):
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(re.fullmatch(TABLES[script], line) for line in lines), run.stdout
