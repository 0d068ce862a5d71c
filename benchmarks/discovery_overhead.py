"""What opt-in discovery costs, in fresh interpreters (docs/performance.md).

- arming (when transformers' body starts): the hooks of the table, plus with discovery on
  the directory listing of transformers/models (once per process) and one wrapt hook per
  modeling module no model covers;
- a table model's import (modeling_qwen3) with discovery on and off: discovery must add
  nothing there (no probe, no import);
- a discovered model's patch at its import (modeling_doge), probes included.

Each figure is the median over RUNS child processes, on and off alternating. Run with the
venv's python, e.g. ``.venv/bin/python benchmarks/discovery_overhead.py [--quick]``
(``--quick``: one process each, as tests/test_benchmarks.py runs it so that the script keeps working).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from importlib.metadata import version  # the parent only starts the children: no transformers import here

RUNS = 7

CHILD = r"""
import json, sys, time
import npu_autopatch
from npu_autopatch import _discover, _hooks, _patcher
from npu_autopatch._state import STATE

spent = {"arm": 0.0, "listing": 0.0, "patch_qwen3": 0.0, "discover_doge": 0.0}

def timed(owner, name, key):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - begin
    setattr(owner, name, wrapper)

timed(_hooks, "arm", "arm")
timed(_discover, "listing", "listing")
timed(_discover, "patch", "discover_doge")
original_patch = _patcher.patch_imported
def patch_imported(module):
    begin = time.perf_counter()
    try:
        return original_patch(module)
    finally:
        if module.__name__.endswith("modeling_qwen3"):
            spent["patch_qwen3"] += time.perf_counter() - begin
_patcher.patch_imported = patch_imported

import wrapt.importer  # its ~70 ms import is the same on and off: kept out of the arm figure
npu_autopatch.enable(discover=DISCOVER)
import transformers
from transformers.models.qwen3 import modeling_qwen3
if DISCOVER:
    from transformers.models.doge import modeling_doge
    assert npu_autopatch.status()["doge"].state == "applied", npu_autopatch.status()["doge"]
assert npu_autopatch.status()["qwen3"].state == "applied"
spent["hooked"] = len(STATE.discovery_hooked)
print(json.dumps(spent))
"""


def run(discover: bool, stand_in: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_AUTOPATCH")}
    env["PYTHONPATH"] = stand_in
    code = CHILD.replace("DISCOVER", repr(discover))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one process each")
    count = 1 if parser.parse_args().quick else RUNS
    stand_in = os.path.join(os.path.dirname(__file__), "..", "tests", "stand_in_site")
    runs = {True: [], False: []}
    for _ in range(count):
        for discover in (True, False):
            runs[discover].append(run(discover, os.path.abspath(stand_in)))

    def ms(discover, key):
        return statistics.median(r[key] for r in runs[discover]) * 1e3

    print(f"transformers {version('transformers')}, median of {count} fresh processes each")
    print(f"modules hooked for discovery:           {runs[True][0]['hooked']}")
    print(f"arming, discovery off:                  {ms(False, 'arm'):7.2f} ms")
    print(f"arming, discovery on:                   {ms(True, 'arm'):7.2f} ms")
    print(f"  of which the directory listing:       {ms(True, 'listing'):7.2f} ms")
    print(f"patching modeling_qwen3, discovery off: {ms(False, 'patch_qwen3'):7.2f} ms")
    print(f"patching modeling_qwen3, discovery on:  {ms(True, 'patch_qwen3'):7.2f} ms")
    print(f"discovering + patching modeling_doge:   {ms(True, 'discover_doge'):7.2f} ms")


if __name__ == "__main__":
    main()
