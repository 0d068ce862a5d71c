"""NPU kernels for Helium: the built-in kernels, declared for Helium's classes.

Helium's rotary function rotates interleaved pairs with cos/sin of half the head, a form none of
the built-in rope variants reproduces (their probes refuse it), so it stays stock: no rope target.
"""

from npu_autopatch import Model, Target

HELIUM = Model(
    "helium",
    Target("rms_norm", "HeliumRMSNorm.forward"),
    Target("swiglu", "HeliumMLP.forward"),
)
