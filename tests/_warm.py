"""Warm child interpreters: forked from a server that has imported torch, instead of started cold.

A child interpreter of the tests imports torch and transformers, and transformers' import pulls in
torch's compiler and distributed-tensor modules (``torch._dynamo``, ``torch.distributed.tensor``,
sympy): about 4 of the 5.5 s of CPU a child costs before its first line of work, paid again in each
of a few hundred children per CI run. A warm child is forked from a server process (this file, run
as a script, one per pytest process) that imported those torch modules once and nothing else of
note: not transformers, huggingface_hub or npu_autopatch, which the child imports itself, as a cold
one does. The child takes its environment, working directory, ``sys.path``, ``sys.argv`` and a
fresh ``__main__``, runs the code and exits as an interpreter does (non-daemon threads joined,
atexit handlers run). With ``NPU_AUTOPATCH`` set, the child first runs the import line of our
``npu_autopatch-env.pth``, as the start of an interpreter does (the server started without it).

Limits, stated: torch is imported before the child's first line (and before our ``.pth`` line),
under the server's environment. So a child whose environment changes what torch's import or the
rest of the start reads (the thread counts, ``TORCH*``, ``ATEN_*``, ``PYTHON*`` but ``PYTHONPATH``) runs cold,
and so does one whose subject is the interpreter's start or what is imported before the first line
(the caller's ``warm=False``: tests/test_startup.py). One child at a time per server: a pytest
process runs one test at a time.
"""

import atexit
import builtins
import json
import os
import runpy
import select
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

# The torch modules transformers' import pulls in (python -X importtime): about 4 s of a child's CPU.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.tensor", "torch.fx.experimental.symbolic_shapes")

_server = {}  # this process's server: "process", "env", "path"


def _read_at_start(name):
    """Whether the interpreter's start or torch's import reads the environment variable ``name``."""
    return name != "PYTHONPATH" and name.startswith(("TORCH", "ATEN_", "OMP_", "MKL_", "KMP_", "PYTHON"))


def _start():
    """Start this process's server in this process's environment, whatever the first child asks for
    (a child's differing thread count would send every later child cold), without NPU_AUTOPATCH
    (nothing armed in it) and PYTHONPATH (each child's own goes before the plain interpreter's path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NPU_AUTOPATCH", "PYTHONPATH")}
    pipe = subprocess.PIPE
    process = subprocess.Popen([sys.executable, __file__], env=env, stdin=pipe, stdout=pipe)
    _server.update(process=process, env=env, pending=b"")
    _server["path"] = json.loads(_answer(None))  # the sys.path of a plain interpreter, after [0]


def _answer(timeout):
    """The server's next answer line, or None after ``timeout`` seconds without one."""
    fd = _server["process"].stdout.fileno()
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in _server["pending"]:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError("the warm-child server ended")
        _server["pending"] += chunk
    line, _server["pending"] = _server["pending"].split(b"\n", 1)
    return line.decode()


def _warm_enough(args, env):
    """Whether ``args`` may run in a warm child: ``python -c`` or ``-m``, and nothing read at the start
    of an interpreter or by torch's import set otherwise than in the server."""
    if args[:2] not in ([sys.executable, "-c"], [sys.executable, "-m"]):
        return False
    if not _server:
        _start()
    started = _server["env"]
    return not any(_read_at_start(k) for k in set(env) | set(started) if env.get(k) != started.get(k))


def run(args, env, cwd=None, timeout=None, warm=True):
    """``subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``:
    warm for ``[sys.executable, "-c" or "-m", code or module, *argv]`` where the limits above allow."""
    if not (warm and _warm_enough(args, env)):
        return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as scratch:
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        request = {
            "how": args[1],
            "code": args[2],
            "argv": list(args[3:]),
            "env": env,
            "cwd": str(cwd or os.getcwd()),
            "path": ["", *pythonpath, *_server["path"]],
            "out": out,
            "err": err,
        }
        _server["process"].stdin.write(json.dumps(request).encode() + b"\n")
        _server["process"].stdin.flush()
        pid = int(_answer(None))
        status = _answer(timeout)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            _answer(None)
            raise subprocess.TimeoutExpired(args, timeout)
        with open(out, errors="replace") as stdout, open(err, errors="replace") as stderr:
            return subprocess.CompletedProcess(args, int(status), stdout.read(), stderr.read())


def _serve():
    """The server: import PRELOAD, then fork a child per request line and answer its pid and status."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    plain = sys.path[1:]  # sys.path[0] is this file's directory; a -c child's is ""
    requests, answers = sys.stdin, sys.stdout
    answers.write(json.dumps(plain) + "\n")
    answers.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(**request)
        answers.write(f"{pid}\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(f"{os.waitstatus_to_exitcode(status)}\n")
        answers.flush()


def _child(how, code, argv, env, cwd, path, out, err):
    """In the forked child: become ``python -c code *argv`` (or ``-m``) and exit as the interpreter does."""
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    for fd, name in ((1, out), (2, err)):
        opened = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [how, *argv]
    sys.path[:] = path
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    status = 0
    try:
        if env.get("NPU_AUTOPATCH"):
            _boot_as_at_start()
        if how == "-m":
            runpy._run_module_as_main(code)  # what ``python -m`` runs: sys.argv[0] becomes the file
        else:
            exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _boot_as_at_start():
    """What site does with our .pth file at an interpreter's start: run its import lines."""
    for directory in [*site.getsitepackages(), site.getusersitepackages()]:
        path = os.path.join(directory, "npu_autopatch-env.pth")
        if os.path.exists(path):
            with open(path) as lines:
                for line in lines:
                    if line.startswith(("import ", "import\t")):
                        exec(line)
            return


if __name__ == "__main__":
    _serve()
