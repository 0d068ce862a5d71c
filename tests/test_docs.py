"""The docs cannot drift from the code: the supported-models table, the troubleshooting table, links."""

import importlib.util

import pytest
import transformers

from npu_autopatch.__main__ import models_markdown
from npu_autopatch.models import BUILTIN, MODELS

from .conftest import ROOT


def test_models_table_is_the_generated_one():
    page = (ROOT / "docs" / "models.md").read_text()
    table = page.split("<!-- models:begin (python -m npu_autopatch models) -->\n")[1]
    assert table.split("\n<!-- models:end -->")[0] == models_markdown()


def _version(text):
    return tuple(int(part) for part in text.split(".")[:2])


@pytest.mark.parametrize("model", [MODELS[name] for name in BUILTIN], ids=BUILTIN)
def test_since_says_which_transformers_has_the_model(model):
    try:
        has_it = importlib.util.find_spec(model.module) is not None
    except ModuleNotFoundError:  # the model's package itself is missing
        has_it = False
    assert has_it == (_version(transformers.__version__) >= _version(model.since))
