"""The package's shape: no import cycles, one version, what the distributions ship (issue 10 item 13)."""

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
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith("npu_autopatch.testing") or nxt not in graph:
                continue
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt] if nxt in stack else [node, nxt]
            if nxt not in state:
                found = visit(nxt, [*stack, nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and not node.startswith("npu_autopatch.testing"):
            found = visit(node, [node])
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(internal_imports())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


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
