"""NPU kernels for Granite: the built-in kernels, declared for Granite's classes."""

from npu_autopatch import Model, Target

GRANITE = Model(
    "granite",
    Target("rms_norm", "GraniteRMSNorm.forward"),
    Target("swiglu", "GraniteMLP.forward"),
    Target("rope", "apply_rotary_pos_emb"),
)
