"""Cluster-wide npu-autopatch: put this directory on every node's PYTHONPATH.

Every Python process that has npu-autopatch installed then patches transformers models on
import, unless NPU_AUTOPATCH is set to a false value (0/false/no/off) for that process.
Interpreters without npu-autopatch are left alone.

Python runs only one module named ``sitecustomize``. Debian, Ubuntu and conda ship their
own, which this file shadows, so it runs that one first (with this directory hidden from
sys.path while it is found), then boots npu-autopatch. Nothing here may raise: a failing
sitecustomize would print a traceback in every process on the node.
"""

import os
import sys


def _run_shadowed_sitecustomize():
    """Import the next ``sitecustomize`` on sys.path (if any) and keep it reachable."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    ourselves = sys.modules.pop("sitecustomize", None)
    saved_path = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    try:
        import sitecustomize as shadowed

        return shadowed
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            sys.stderr.write(f"npu-autopatch sitecustomize: the shadowed sitecustomize failed: {exc!r}\n")
    except Exception as exc:
        sys.stderr.write(f"npu-autopatch sitecustomize: the shadowed sitecustomize failed: {exc!r}\n")
    finally:
        sys.path[:] = saved_path
        if ourselves is not None:
            sys.modules["sitecustomize"] = ourselves
    return None


shadowed_sitecustomize = _run_shadowed_sitecustomize()

try:
    from npu_autopatch._bootstrap import boot
except ImportError:  # npu-autopatch is not installed in this interpreter
    pass
else:
    boot(default=True)
