"""Installing npu-autopatch never pulls or replaces torch, torch_npu or transformers."""

import tomllib
from packaging.requirements import Requirement

from .conftest import ROOT


def test_no_requirement_or_extra_pulls_torch_or_torch_npu():
    """torch_npu pins one torch line: any unpinned torch_npu requirement would replace the user's torch."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    requirements = [*project["dependencies"], *(r for extra in extras.values() for r in extra)]
    names = {Requirement(r).name.lower().replace("_", "-") for r in requirements}
    assert not names & {"torch", "torch-npu", "transformers"}, requirements
    assert "npu" not in extras
