"""The docs cannot drift from the code: the supported-models table, the troubleshooting table, links."""

import importlib.util
import re

import pytest
import transformers

from npu_autopatch import ReasonCode
from npu_autopatch.__main__ import models_markdown
from npu_autopatch.models import BUILTIN, MODEL_TYPES, MODELS

from .conftest import ROOT


def test_models_table_is_the_generated_one():
    page = (ROOT / "docs" / "models.md").read_text()
    table = page.split("<!-- models:begin (python -m npu_autopatch models) -->\n")[1]
    assert table.split("\n<!-- models:end -->")[0] == models_markdown()


def _version(text):
    return tuple(int(part) for part in text.split(".")[:2])


# A family (verl's module, found by what it defines) is another library's, not transformers'.
IN_TRANSFORMERS = [name for name in BUILTIN if not MODELS[name].family]


@pytest.mark.parametrize("model", [MODELS[name] for name in IN_TRANSFORMERS], ids=IN_TRANSFORMERS)
def test_since_says_which_transformers_has_the_model(model):
    try:
        has_it = importlib.util.find_spec(model.module) is not None
    except ModuleNotFoundError:  # the model's package itself is missing
        has_it = False
    assert has_it == (_version(transformers.__version__) >= _version(model.since))


def test_readme_lists_every_built_in_model_type():
    """Model types only: the attention kernel's ``npu_flash_attention`` (transformers' integration every
    FA2-on-NPU model calls) is an entry of the table, not a model type."""
    readme = (ROOT / "README.md").read_text()
    listed = readme.split("<!-- model-types:begin -->\n")[1].split("\n<!-- model-types:end -->")[0]
    assert listed == ", ".join(MODEL_TYPES)
    assert f"({len(MODEL_TYPES)} model types;" in readme


def _section(text, heading):
    """The lines of a markdown section, from its heading to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1
    for end in range(start, len(lines)):
        hashes = len(lines[end]) - len(lines[end].lstrip("#"))
        if 0 < hashes <= level and lines[end][hashes : hashes + 1] == " ":
            return lines[start:end]
    return lines[start:]


def test_every_reason_code_has_a_remedy_in_the_readme():
    """A new ReasonCode cannot ship without a row in the README's troubleshooting table."""
    section = _section((ROOT / "README.md").read_text(), "## Troubleshooting")
    first = next(i for i, line in enumerate(section) if line.startswith("| code |"))
    rows = []
    for line in section[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    codes = [row[0].strip("`") for row in rows]
    assert len(codes) == len(set(codes)), "a code is listed twice"
    values = {code.value for code in ReasonCode}
    assert not values - set(codes), f"no troubleshooting row in the README for {sorted(values - set(codes))}"
    assert not set(codes) - values, f"not a ReasonCode: {sorted(set(codes) - values)}"
    assert all(row[-1] for row in rows), "every code says what to do"


_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _anchors(path):
    """GitHub's heading anchors of a markdown file."""
    text = _FENCE.sub("", path.read_text())
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", _PAGES, ids=[p.relative_to(ROOT).as_posix() for p in _PAGES])
def test_relative_links_point_to_what_exists(page):
    broken = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:: not ours to check
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        checked = linked.exists() and linked.suffix == ".md"
        if not linked.exists() or (anchor and checked and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"
