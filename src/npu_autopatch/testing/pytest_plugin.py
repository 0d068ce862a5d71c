"""pytest plugin providing the ``npu_stand_in`` fixture.

Registered through the ``pytest11`` entry point, so it is loaded by every pytest run: it must not import torch
at import time (the package ``npu_autopatch.testing`` is import-light for the same reason).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from npu_autopatch.testing import stand_in


@pytest.fixture
def npu_stand_in() -> Iterator[ModuleType]:
    """A fresh torch_npu stand-in installed for one test (sys.modules and torch.npu restored afterwards)."""
    with stand_in() as module:
        yield module
