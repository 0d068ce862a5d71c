"""``import torch_npu`` in the tests' child processes gives the CPU stand-in.

Only the tests put this directory on PYTHONPATH, so the stand-in can never load elsewhere.
The import replaces this package in sys.modules with the stand-in module itself.
"""

import sys

import torch

from npu_autopatch.testing import make_torch_npu

_stand_in = make_torch_npu()
sys.modules["torch_npu.npu"] = _stand_in.npu
torch.npu = _stand_in.npu
sys.modules[__name__] = _stand_in
