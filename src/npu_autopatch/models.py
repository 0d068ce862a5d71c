"""The model table: which target of which modeling module gets which kernel.

Pure data, importable at interpreter start (no torch, no typing, no dataclasses).
Adding a model is one ``Model(...)`` entry here plus one parameter in the parity tests.

A target path is ``"Class.method"`` or ``"function"``, resolved in the model's modeling
module. Several paths mean alternatives across transformers versions: the first that
exists is used. Whether the kernel really reproduces the target's math is not trusted to
the name: the patcher probes every target against the kernel before swapping.
"""

from ._types import Model, Target


def _dense(model_type, prefix):
    """The llama family: a llama-style RMSNorm, a gated SiLU MLP and the standard rotary function."""
    return Model(
        model_type,
        Target("rms_norm", f"{prefix}RMSNorm.forward"),
        Target("swiglu", f"{prefix}MLP.forward"),
        Target("rope", "apply_rotary_pos_emb"),
    )


def _moe(model_type, prefix, block):
    """A dense-layer model plus routed experts: 5.x fused ``*Experts``, else the 4.x block."""
    dense = _dense(model_type, prefix)
    return Model(model_type, *dense.targets, Target("moe", f"{prefix}Experts.forward", block))


# In 4.x a sparse block's experts are a ModuleList and the whole block forward (or the
# ``moe`` method of DeepSeek-V3/GLM-4-MoE) is replaced; 5.x fused the experts into one
# ``*Experts`` module. The shared experts are ordinary ``*MLP`` modules (swiglu).
MODELS = {
    m.model_type: m
    for m in (
        _dense("llama", "Llama"),
        _dense("mistral", "Mistral"),
        _dense("qwen2", "Qwen2"),
        _dense("qwen3", "Qwen3"),
        _moe("qwen2_moe", "Qwen2Moe", "Qwen2MoeSparseMoeBlock.forward"),
        _moe("qwen3_moe", "Qwen3Moe", "Qwen3MoeSparseMoeBlock.forward"),
        Model(
            "deepseek_v3",
            *_moe("deepseek_v3", "DeepseekV3", "DeepseekV3MoE.moe").targets,
            # The default path (config.rope_interleave=True); apply_rotary_pos_emb is the other one.
            Target("rope", "apply_rotary_pos_emb_interleave"),
        ),
        _dense("glm4", "Glm4"),  # fused gate_up_proj MLP; interleaved partial rotary
        _moe("glm4_moe", "Glm4Moe", "Glm4MoeMoE.moe"),
        Model(
            "qwen2_5_vl",
            # 4.57 and 5.0 import qwen2's Qwen2RMSNorm: a target shared with the qwen2 model.
            Target("rms_norm", "Qwen2_5_VLRMSNorm.forward", "Qwen2RMSNorm.forward"),
            Target("swiglu", "Qwen2MLP.forward"),
            Target("swiglu", "Qwen2_5_VLMLP.forward"),  # the vision tower's SwiGLU (with bias)
            Target("rope", "apply_multimodal_rotary_pos_emb", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
        ),
        Model(
            "qwen3_vl",
            Target("rms_norm", "Qwen3VLTextRMSNorm.forward"),
            Target("swiglu", "Qwen3VLTextMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
        ),
        Model(
            "qwen3_vl_moe",
            Target("rms_norm", "Qwen3VLMoeTextRMSNorm.forward"),
            Target("swiglu", "Qwen3VLMoeTextMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("moe", "Qwen3VLMoeTextExperts.forward"),
        ),
        Model(
            "qwen3_next",
            Target("rms_norm", "Qwen3NextRMSNorm.forward"),  # zero-centred: (1 + weight)
            Target("gated_rms_norm", "Qwen3NextRMSNormGated.forward"),
            Target("swiglu", "Qwen3NextMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),  # partial rotary
            Target("moe", "Qwen3NextExperts.forward", "Qwen3NextSparseMoeBlock.forward"),
        ),
        Model(
            "qwen3_5",
            Target("rms_norm", "Qwen3_5RMSNorm.forward"),
            Target("gated_rms_norm", "Qwen3_5RMSNormGated.forward"),
            Target("swiglu", "Qwen3_5MLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            since="5.2",
        ),
        Model(
            "qwen3_5_moe",
            Target("rms_norm", "Qwen3_5MoeRMSNorm.forward"),
            Target("gated_rms_norm", "Qwen3_5MoeRMSNormGated.forward"),
            Target("swiglu", "Qwen3_5MoeMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("moe", "Qwen3_5MoeExperts.forward"),
            since="5.2",
        ),
        # Gemma3's MLP is GELU (gelu_pytorch_tanh), which no SiLU kernel reproduces: no swiglu target.
        Model(
            "gemma3",
            Target("rms_norm", "Gemma3RMSNorm.forward"),
            Target("rope", "apply_rotary_pos_emb"),
        ),
    )
}

# The models this package ships. MODELS itself is the live registry (``_state.STATE.models``):
# entry-point plugins and register() add to it, through _control and _plugins only.
BUILTIN = tuple(MODELS)
