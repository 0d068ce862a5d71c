"""NPU kernels for Helium: the built-in kernels, declared for Helium's classes.

Helium's rotary function rotates interleaved pairs at the full head width. The rope kernel's
interleave variant reproduces it (its probe checks that on the function's own shapes), but the
shape sweep (testing/rope_sweep.py) still builds interleaved inputs at the table's partial width,
so the example leaves the rotary out until the sweep covers it.
"""

from npu_autopatch import Model, Target

HELIUM = Model(
    "helium",
    Target("rms_norm", "HeliumRMSNorm.forward"),
    Target("swiglu", "HeliumMLP.forward"),
)
