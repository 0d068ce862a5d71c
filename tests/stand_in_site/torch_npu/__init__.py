"""``import torch_npu`` in the tests' child processes gives the CPU stand-in.

Only the tests put this directory on PYTHONPATH, so the stand-in can never load elsewhere.
The import replaces this package in sys.modules with the stand-in module itself, and makes
``torch.nn.functional.scaled_dot_product_attention`` torch_npu's (testing/device/sdpa.py).
"""

import sys

import torch

from npu_autopatch.testing import make_torch_npu
from npu_autopatch.testing.device import sdpa

_stand_in = make_torch_npu()
sdpa.install(_stand_in)  # torch_npu's sdpa for the child's life, as the import of torch_npu gives it
sys.modules["torch_npu.npu"] = _stand_in.npu
torch.npu = _stand_in.npu
sys.modules[__name__] = _stand_in
