"""Cost per unrelated import once the hooks are armed (goal: under 1 us).

Every first import of a module asks each finder in sys.meta_path in turn. Arming puts two
finders in front: our watcher and wrapt's post-import finder. This script times a find_spec
miss of each, called directly on names that are none of theirs, and the whole meta-path
miss (importlib.util.find_spec of a name that does not exist) with and without the two.
Run with the venv's python:
    .venv/bin/python benchmarks/import_overhead.py [--quick]
``--quick``: one run each (tests/test_benchmarks.py runs it, so that the script keeps working).
"""

import argparse
import importlib.util
import statistics
import sys
import timeit

NAMES = [f"unrelated_module_{i}" for i in range(1000)] + ["numpy.linalg", "json.decoder", "tokenizers"]


def per_call_ns(function, repeat):
    """Median over ``repeat`` runs of one call per name, in nanoseconds per call."""
    runs = timeit.repeat(lambda: [function(name) for name in NAMES], number=20, repeat=repeat)
    return statistics.median(runs) / (20 * len(NAMES)) * 1e9


def main():
    import npu_autopatch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run each")
    finder_runs, miss_runs = (1, 1) if parser.parse_args().quick else (7, 5)

    npu_autopatch.enable()
    import transformers  # noqa: F401  (arms the hooks: wrapt's finder goes in front of ours)

    finders = {type(f).__name__: f for f in sys.meta_path}
    watcher, wrapt_finder = finders["TransformersWatcher"], finders["ImportHookFinder"]
    empty_loop = per_call_ns(lambda name: None, finder_runs)
    ours = per_call_ns(watcher.find_spec, finder_runs) - empty_loop
    wrapts = per_call_ns(wrapt_finder.find_spec, finder_runs) - empty_loop

    def miss(name):
        importlib.util.find_spec("no_such_top_level_" + name.replace(".", "_"))

    armed = per_call_ns(miss, miss_runs)
    saved = sys.meta_path[:]
    sys.meta_path[:] = [f for f in saved if f is not watcher and f is not wrapt_finder]
    try:
        bare = per_call_ns(miss, miss_runs)
    finally:
        sys.meta_path[:] = saved
    print(f"meta path: {[type(f).__name__ for f in sys.meta_path]}")
    print(f"find_spec miss, our watcher:          {ours:7.0f} ns")
    print(f"find_spec miss, wrapt's finder:       {wrapts:7.0f} ns")
    print(f"both, per unrelated first import:     {ours + wrapts:7.0f} ns   (goal < 1000 ns)")
    print(f"whole meta-path miss, armed / bare:   {armed / 1000:7.1f} us / {bare / 1000:.1f} us")


if __name__ == "__main__":
    main()
