"""Interpreter start-up with NPU_AUTOPATCH=1 vs =0, in a process that never imports transformers.

Goal (issue 2): within 30% of the unpatched start. Run with the venv's python:
    .venv/bin/python benchmarks/startup.py [runs]
Interleaves the two settings so that machine noise hits both alike; reports medians.
"""

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
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    base = {k: v for k, v in os.environ.items() if not k.startswith("NPU_AUTOPATCH")}
    off, on = [], []
    for _ in range(runs // 10):
        off += time_start({**base, "NPU_AUTOPATCH": "0"}, 10)
        on += time_start({**base, "NPU_AUTOPATCH": "1"}, 10)
    off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
    print(f"python -c pass, median of {len(off)} runs each")
    print(f"  NPU_AUTOPATCH=0: {off_ms:6.1f} ms")
    print(f"  NPU_AUTOPATCH=1: {on_ms:6.1f} ms  ({(on_ms / off_ms - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
