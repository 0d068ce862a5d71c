"""The package's shape: no import cycles, the tools apart from the library, one version, what the
distributions ship (issue 10 item 13, issue 17)."""

import ast
import re
import tarfile
import zipfile
from pathlib import Path

import pytest

import npu_autopatch

from .conftest import ROOT

PACKAGE = Path(npu_autopatch.__file__).resolve().parent


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports():
    """{module: {package modules it imports, at any depth of its code}}, from the source."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
                if not node.level and not target.startswith("npu_autopatch"):
                    continue
                for alias in node.names:
                    candidate = f"{target}.{alias.name}"
                    edges.add(
                        candidate
                        if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                        or (PACKAGE.parent / candidate.replace(".", "/") / "__init__.py").exists()
                        else target
                    )
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.startswith("npu_autopatch"))
        graph[name] = {e for e in edges if e != name}
    return graph


def find_cycle(graph):
    """A list of modules that import each other in a ring (first == last), or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt, [*stack, nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


TOOLS = "npu_autopatch.tools"
# The command-line entry points: they import a tool when its command runs (and nothing imports them).
ENTRY_POINTS = frozenset(["npu_autopatch.__main__", "npu_autopatch.kernels.__main__"])


def _is_tool(name):
    return name == TOOLS or name.startswith(TOOLS + ".")


def tools_importers(graph, named=None):
    """The library modules (outside tools/ and the entry points) that import a tool: by an import
    statement (``graph``), or by name, e.g. for importlib (``named``: {module: dotted names in its
    string constants})."""
    named = named or {}
    return sorted(
        module
        for module, edges in graph.items()
        if not _is_tool(module)
        and module not in ENTRY_POINTS
        and any(_is_tool(name) for name in (*edges, *named.get(module, ())))
    )


def dotted_names_in_strings():
    """{module: the string constants of its source that name a module of the package}."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        names[_module_name(path)] = {
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"npu_autopatch(\.\w+)+", node.value)
        }
    return names


def test_the_package_has_no_import_cycle():
    graph = internal_imports()
    assert {"npu_autopatch.testing.parity", "npu_autopatch.tools.scan"} <= set(graph)  # all of it
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_library_module_imports_the_tools():
    graph = internal_imports()
    assert "npu_autopatch.tools.verify" in graph["npu_autopatch.__main__"]  # the graph sees the tools
    assert tools_importers(graph, dotted_names_in_strings()) == []


def test_the_tools_check_finds_an_import_of_a_tool():
    graph = {
        "npu_autopatch._control": {"npu_autopatch._state"},
        "npu_autopatch._patcher": {"npu_autopatch.tools.scan"},
        "npu_autopatch.tools.scan": {"npu_autopatch._candidates"},
        "npu_autopatch.__main__": {"npu_autopatch.tools.scan"},
    }
    assert tools_importers(graph) == ["npu_autopatch._patcher"]
    assert tools_importers(graph, {"npu_autopatch._control": {"npu_autopatch.tools.verify"}}) == [
        "npu_autopatch._control",
        "npu_autopatch._patcher",
    ]


def test_one_version_source():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert not re.search(r"^version\s*=", pyproject, re.MULTILINE), "the version is written in pyproject.toml"
    assert 'dynamic = ["version"]' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", npu_autopatch.__version__)


def test_license_and_py_typed_are_in_the_tree():
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert (PACKAGE / "py.typed").is_file()


@pytest.fixture(scope="module")
def distributions(tmp_path_factory):
    build = pytest.importorskip("hatchling.build")
    out = tmp_path_factory.mktemp("dist")
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        sdist = build.build_sdist(str(out))
        wheel = build.build_wheel(str(out))
    finally:
        os.chdir(cwd)
    return out / sdist, out / wheel


def test_the_sdist_is_lean_and_the_wheel_ships_license_and_py_typed(distributions):
    sdist, wheel = distributions
    with tarfile.open(sdist) as archive:
        names = [n.split("/", 1)[1] for n in archive.getnames() if "/" in n]
    assert "LICENSE" in names and "src/npu_autopatch/py.typed" in names
    assert not [n for n in names if n.startswith((".ci", "benchmarks", ".venv", "tests/", "examples"))], names
    with zipfile.ZipFile(wheel) as archive:
        members = archive.namelist()
    assert "npu_autopatch/py.typed" in members
    assert any(m.endswith("licenses/LICENSE") for m in members), members
    assert "npu_autopatch-env.pth" in members
