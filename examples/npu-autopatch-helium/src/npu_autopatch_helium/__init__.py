"""NPU kernels for Helium: the built-in kernels, declared for Helium's classes.

Helium's rotary function rotates interleaved pairs at the full head width: the rope kernel's
interleave variant reproduces it (its probe checks that on the function's own shapes).
"""

from npu_autopatch import Model, Target

HELIUM = Model(
    "helium",
    Target("rms_norm", "HeliumRMSNorm.forward"),
    Target("swiglu", "HeliumMLP.forward"),
    Target("rope", "apply_rotary_pos_emb"),
)
