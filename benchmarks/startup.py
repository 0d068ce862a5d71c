"""Interpreter start-up with NPU_AUTOPATCH=1 vs =0, in a process that never imports transformers.

Goal (issue 2): within 30% of the unpatched start. Run with the venv's python:
    .venv/bin/python benchmarks/startup.py [runs] [--quick]
Interleaves the two settings, ten starts at a time, so that machine noise hits both alike; reports
medians. ``--quick``: two starts each (tests/test_benchmarks.py: the script keeps working).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


def time_start(env, runs):
    samples = []
    for _ in range(runs):
        begin = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        samples.append(time.perf_counter() - begin)
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="?", type=int, default=60, help="starts of each setting")
    parser.add_argument("--quick", action="store_true", help="two starts of each setting")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    base = {k: v for k, v in os.environ.items() if not k.startswith("NPU_AUTOPATCH")}
    off, on = [], []
    for begin in range(0, runs, 10):
        batch = min(10, runs - begin)
        off += time_start({**base, "NPU_AUTOPATCH": "0"}, batch)
        on += time_start({**base, "NPU_AUTOPATCH": "1"}, batch)
    off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
    print(f"python -c pass, median of {len(off)} runs each")
    print(f"  NPU_AUTOPATCH=0: {off_ms:6.1f} ms")
    print(f"  NPU_AUTOPATCH=1: {on_ms:6.1f} ms  ({(on_ms / off_ms - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
