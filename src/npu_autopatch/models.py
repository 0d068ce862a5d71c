"""The model table: which target of which modeling module gets which kernel.

Pure data, importable at interpreter start (no torch, no typing, no dataclasses).
Adding a model is one ``Model(...)`` entry here plus its expected op counts in the parity tests.

A target path is ``"Class.method"`` or ``"function"``, resolved in the model's modeling
module. Several paths mean alternatives across transformers versions: the first that
exists is used. Whether the kernel really reproduces the target's math is not trusted to
the name: the patcher probes every target against the kernel before swapping.
"""

from ._types import Model, Target
from .integrations import llamafactory, swift, verl, verl_logprobs

# types.MappingProxyType without importing types at interpreter start: the table is data, read-only.
_READ_ONLY = type(type.__dict__)


def _dense(model_type, prefix, rope=("apply_rotary_pos_emb",), since="4.57"):
    """The llama family: a llama-style RMSNorm, a gated SiLU MLP, the named rotary functions and
    the causal LM's forward (the opt-in loss kernel)."""
    return Model(
        model_type,
        Target("rms_norm", f"{prefix}RMSNorm.forward"),
        Target("swiglu", f"{prefix}MLP.forward"),
        *(Target("rope", path) for path in rope),
        Target("loss", f"{prefix}ForCausalLM.forward"),
        since=since,
    )


def _moe(
    model_type, prefix, block=None, rope=("apply_rotary_pos_emb",), since="4.57", experts="5.0", router=False
):
    """A dense-layer model plus routed experts: 5.x fused ``*Experts``, else the 4.x ``block``; with
    ``router``, 5.x's softmax ``*TopKRouter`` too (the moe kernel routes on the chosen logits only).

    Without ``block``, the experts target is left out before the release ``experts`` that fused
    them: the earlier experts are left to the other targets (``*MLP`` modules get swiglu) or stock,
    as their sparse block is a computation the moe kernel does not reproduce and a refused target
    would leave the model ``partial``.
    """
    dense = _dense(model_type, prefix, rope, since)
    fused = f"{prefix}Experts.forward"
    routed = Target("moe", fused, block) if block else Target("moe", fused, since=experts)
    routers = (Target("moe", f"{prefix}TopKRouter.forward", since=experts),) if router else ()
    return Model(model_type, *dense.targets, routed, *routers, since=since)


# In 4.x a sparse block's experts are a ModuleList and the whole block forward (or the
# ``moe`` method of DeepSeek-V3/GLM-4-MoE) is replaced; 5.x fused the experts into one
# ``*Experts`` module. The shared experts are ordinary ``*MLP`` modules (swiglu).
_TABLE = {
    m.model_type: m
    for m in (
        # loss: every causal LM's forward (a VLM's: its text head), the opt-in chunked loss
        # (kernels/loss.py); a head that does more (softcapping, logit scaling) is refused by its probe.
        _dense("llama", "Llama"),
        _dense("mistral", "Mistral"),
        _dense("qwen2", "Qwen2"),
        _dense("qwen3", "Qwen3"),
        _moe("qwen2_moe", "Qwen2Moe", "Qwen2MoeSparseMoeBlock.forward", router=True),
        _moe("qwen3_moe", "Qwen3Moe", "Qwen3MoeSparseMoeBlock.forward", router=True),
        # The default path (config.rope_interleave=True); apply_rotary_pos_emb is the other one.
        _moe(
            "deepseek_v3",
            "DeepseekV3",
            "DeepseekV3MoE.moe",
            rope=("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"),
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
            Target("loss", "Qwen2_5_VLForConditionalGeneration.forward"),
        ),
        Model(
            "qwen3_vl",
            Target("rms_norm", "Qwen3VLTextRMSNorm.forward"),
            Target("swiglu", "Qwen3VLTextMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("loss", "Qwen3VLForConditionalGeneration.forward"),
        ),
        Model(
            "qwen3_vl_moe",
            Target("rms_norm", "Qwen3VLMoeTextRMSNorm.forward"),
            Target("swiglu", "Qwen3VLMoeTextMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("moe", "Qwen3VLMoeTextExperts.forward"),
            Target("loss", "Qwen3VLMoeForConditionalGeneration.forward"),
        ),
        Model(
            "qwen3_next",
            Target("rms_norm", "Qwen3NextRMSNorm.forward"),  # zero-centred: (1 + weight)
            Target("gated_rms_norm", "Qwen3NextRMSNormGated.forward"),
            Target("swiglu", "Qwen3NextMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),  # partial rotary
            Target("moe", "Qwen3NextExperts.forward", "Qwen3NextSparseMoeBlock.forward"),
            Target("gated_delta_rule", "Qwen3NextDecoderLayer.forward"),  # packed sequences kept apart
            Target("gated_delta_rule", "torch_chunk_gated_delta_rule"),  # chunks scanned, not looped
            Target("loss", "Qwen3NextForCausalLM.forward"),
        ),
        Model(
            "qwen3_5",
            Target("rms_norm", "Qwen3_5RMSNorm.forward"),
            Target("gated_rms_norm", "Qwen3_5RMSNormGated.forward"),
            Target("swiglu", "Qwen3_5MLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("gated_delta_rule", "Qwen3_5DecoderLayer.forward"),  # packed sequences kept apart
            Target("gated_delta_rule", "torch_chunk_gated_delta_rule"),  # chunks scanned, not looped
            Target("loss", "Qwen3_5ForCausalLM.forward"),
            Target("loss", "Qwen3_5ForConditionalGeneration.forward"),
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
            Target("gated_delta_rule", "Qwen3_5MoeDecoderLayer.forward"),  # packed sequences kept apart
            Target("gated_delta_rule", "torch_chunk_gated_delta_rule"),  # chunks scanned, not looped
            Target("loss", "Qwen3_5MoeForCausalLM.forward"),
            Target("loss", "Qwen3_5MoeForConditionalGeneration.forward"),
            since="5.2",
        ),
        # Gemma's MLPs are gated GELU (gelu_pytorch_tanh): npu_geglu (kernels/mlp.py, geglu).
        Model(
            "gemma3",
            Target("rms_norm", "Gemma3RMSNorm.forward"),
            Target("geglu", "Gemma3MLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("loss", "Gemma3ForCausalLM.forward"),
            Target("loss", "Gemma3ForConditionalGeneration.forward"),
        ),
        # --- issue 34: the Gemma family (gemma3n is not here: its text MLP sparsifies the gate of its
        # first layers with a Gaussian top-k before the GELU, which npu_geglu does not) ---
        Model(
            "gemma",
            Target("rms_norm", "GemmaRMSNorm.forward"),  # zero-centred: (1 + weight)
            Target("geglu", "GemmaMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("loss", "GemmaForCausalLM.forward"),
        ),
        # Gemma2ForCausalLM softcaps the final logits, which the loss kernel's probe refuses: no loss target.
        Model(
            "gemma2",
            Target("rms_norm", "Gemma2RMSNorm.forward"),
            Target("geglu", "Gemma2MLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
        ),
        # --- issue 11: the models NPU users train (tests/test_parity_models.py lists why each
        # target is or is not there; the scan, python -m npu_autopatch scan, lists the rest) ---
        Model(
            "qwen2_vl",
            # 4.57 imports qwen2's norm: a target shared with the qwen2 model, as Qwen2.5-VL's.
            Target("rms_norm", "Qwen2VLRMSNorm.forward", "Qwen2RMSNorm.forward"),
            Target("swiglu", "Qwen2MLP.forward"),
            # 4.57 mixes the mRoPE sections in the function, 5.x in the rotary embedding.
            Target("rope", "apply_multimodal_rotary_pos_emb", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("loss", "Qwen2VLForConditionalGeneration.forward"),
            # The vision MLP is fc2(GELU(fc1)): not gated, stock.
        ),
        Model(
            "qwen2_5_omni",  # the thinker: text and vision tower; the audio tower is LayerNorm + GELU
            Target("rms_norm", "Qwen2_5OmniRMSNorm.forward", "Qwen2RMSNorm.forward"),
            Target("swiglu", "Qwen2MLP.forward"),
            Target("swiglu", "Qwen2_5OmniMLP.forward"),  # the vision tower's SwiGLU (with bias)
            Target("rope", "apply_multimodal_rotary_pos_emb", "apply_rotary_pos_emb"),
            # Before 5.17 the vision rotary is (tensor, freqs), which no variant takes.
            Target("rope", "apply_rotary_pos_emb_vision", since="5.17"),
            Target("loss", "Qwen2_5OmniThinkerForConditionalGeneration.forward"),
        ),
        Model(
            "qwen3_omni_moe",  # the thinker: text (MoE) and vision tower; audio is LayerNorm + GELU
            Target("rms_norm", "Qwen3OmniMoeThinkerTextRMSNorm.forward"),
            Target("rms_norm", "Qwen3OmniMoeTextRMSNorm.forward"),  # the thinker's final norm
            Target("swiglu", "Qwen3OmniMoeThinkerTextMLP.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target(
                "moe",
                "Qwen3OmniMoeThinkerTextExperts.forward",
                "Qwen3OmniMoeThinkerTextSparseMoeBlock.forward",
            ),
            Target("loss", "Qwen3OmniMoeThinkerForConditionalGeneration.forward"),
        ),
        _dense("glm", "Glm"),  # fused gate_up_proj MLP; interleaved partial rotary, as glm4
        Model(
            "glm4v",
            Target("rms_norm", "Glm4vRMSNorm.forward"),  # text and vision tower
            Target("swiglu", "Glm4vTextMLP.forward"),  # fused gate_up_proj
            Target("swiglu", "Glm4VisionMlp.forward"),  # the vision tower's SwiGLU (with bias)
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("loss", "Glm4vForConditionalGeneration.forward"),
            # The text rotary (partial, even/odd, cos/sin used as given) is a form no variant has.
        ),
        Model(
            "glm4v_moe",
            Target("rms_norm", "Glm4vMoeTextRMSNorm.forward"),
            Target("rms_norm", "Glm4vMoeRMSNorm.forward"),  # the vision tower
            Target("swiglu", "Glm4vMoeTextMLP.forward"),
            Target("swiglu", "Glm4vMoeisionMlp.forward"),  # sic: transformers' name of the vision MLP
            Target("rope", "apply_rotary_pos_emb_vision"),
            Target("moe", "Glm4vMoeTextExperts.forward", "Glm4vMoeTextMoE.moe"),
            Target("loss", "Glm4vMoeForConditionalGeneration.forward"),
            # The text rotary is left out: 4.57's is a partial mRoPE, which the probes refuse.
        ),
        # The fused *Experts of GLM-4.7-Flash, GLM-5 (glm_moe_dsa), DeepSeek-V3.2 and GraniteMoE came
        # with 5.13 (checked in the released wheels); before, their experts run stock.
        _moe(
            "glm4_moe_lite",
            "Glm4MoeLite",
            rope=("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"),
            since="5.0",
            experts="5.13",
        ),
        Model(
            "glm_moe_dsa",
            Target("rms_norm", "GlmMoeDsaRMSNorm.forward"),
            Target("swiglu", "GlmMoeDsaMLP.forward"),
            Target("rope", "apply_rotary_pos_emb_interleave", since="5.11"),
            Target("moe", "GlmMoeDsaExperts.forward", since="5.13"),
            Target("loss", "GlmMoeDsaForCausalLM.forward"),
            since="5.2",
        ),
        # DeepSeek-V2's rotary is a complex product (view_as_complex): no variant reproduces it.
        _moe("deepseek_v2", "DeepseekV2", rope=()),
        _moe(
            "deepseek_v32",
            "DeepseekV32",
            rope=("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"),
            since="5.11",
            experts="5.13",
        ),
        # ERNIE 4.5's rotary (even/odd over the full head, in fp32, cast back) is a form no variant has.
        _dense("ernie4_5", "Ernie4_5", rope=()),
        _moe("ernie4_5_moe", "Ernie4_5_Moe", rope=()),
        _dense("hunyuan_v1_dense", "HunYuanDenseV1"),
        _moe("hunyuan_v1_moe", "HunYuanMoEV1"),
        Model(
            "seed_oss",  # its MLP drops out its output (residual_dropout): no swiglu target
            Target("rms_norm", "SeedOssRMSNorm.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("loss", "SeedOssForCausalLM.forward"),
        ),
        Model(
            "minimax_m2",  # every layer is sparse: no dense MLP
            Target("rms_norm", "MiniMaxM2RMSNorm.forward"),
            Target("rope", "apply_rotary_pos_emb"),  # partial
            Target("moe", "MiniMaxM2Experts.forward"),
            Target("loss", "MiniMaxM2ForCausalLM.forward"),
            since="5.0",
        ),
        # LongCat-Flash's zero-computation (identity) experts are not the moe kernel's: no moe target.
        _dense("longcat_flash", "LongcatFlash", rope=("apply_rotary_pos_emb_interleave",)),
        _moe("dots1", "Dots1", "Dots1MoE.moe"),
        Model(
            "kimi_linear",  # its gated norm gates with a sigmoid, not the gated kernel's SiLU
            Target("rms_norm", "KimiLinearRMSNorm.forward"),
            Target("swiglu", "KimiLinearMLP.forward"),
            Target("moe", "KimiLinearExperts.forward"),
            Target("loss", "KimiLinearForCausalLM.forward"),
            since="5.17",
        ),
        Model(  # 4.57's sparse block adds router jitter and names its experts w1/w3/w2: stock there
            "mixtral",
            Target("rms_norm", "MixtralRMSNorm.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("moe", "MixtralExperts.forward", since="5.0"),
            Target("moe", "MixtralTopKRouter.forward", since="5.0"),
            Target("loss", "MixtralForCausalLM.forward"),
        ),
        _dense("ministral", "Ministral"),
        # Mistral3, like LLaVA and InternVL, runs a text model of its own model type (mistral,
        # ministral, llama, qwen2 ...), patched by that entry; this is the projector's norm.
        Model(
            "mistral3",
            Target("rms_norm", "Mistral3RMSNorm.forward"),
            Target("loss", "Mistral3ForConditionalGeneration.forward"),
        ),
        _dense("phi3", "Phi3"),  # fused gate_up_proj; partial rotary
        # OLMo 2/3's rotary casts q and k back to their dtype, which the half variant does not.
        _dense("olmo2", "Olmo2", rope=()),
        _dense("olmo3", "Olmo3", rope=()),
        _dense("smollm3", "SmolLM3"),  # NoPE layers skip the rotary
        _dense("granite", "Granite"),
        Model(  # until 5.12 GraniteMoeMoE over ParallelExperts is another layout: stock there
            "granitemoe",
            Target("rms_norm", "GraniteMoeRMSNorm.forward"),
            Target("rope", "apply_rotary_pos_emb"),
            Target("moe", "GraniteMoeExperts.forward", since="5.13"),
            Target("loss", "GraniteMoeForCausalLM.forward"),
        ),
        # gpt-oss: the norm only. Its experts are a clamped SwiGLU with bias on an interleaved
        # [E, H, 2I] layout and its rotary halves cos: no kernel reproduces them.
        Model(
            "gpt_oss",
            Target("rms_norm", "GptOssRMSNorm.forward"),
            # 5.x swaps FA2 for a CUDA-only hub kernel: on the NPU it keeps FA2
            # (kernels/attention/_integration.py).
            Target("attention", "GptOssPreTrainedModel._check_and_adjust_attn_implementation", since="5.0"),
            Target("loss", "GptOssForCausalLM.forward"),
        ),
        # Not a model type: transformers' Ascend flash-attention functions, which every model running
        # attn_implementation="flash_attention_2" on an NPU calls (kernels/attention/_fused.py).
        Model(
            "npu_flash_attention",
            Target("attention", "npu_flash_attn_func"),
            Target("attention", "npu_flash_attn_varlen_func"),
            module="transformers.integrations.npu_flash_attention",
        ),
        # Not a model type either: the unpadding transformers' flash-attention path runs in every
        # layer of a padded batch, made once per mask (kernels/attention/_integration.py, unpad_once).
        Model(
            "flash_attention_utils",
            Target("attention", "_get_unpad_data"),
            module="transformers.modeling_flash_attention_utils",
        ),
        # Not a model type: transformers' choice of the default attention implementation, which on the
        # NPU becomes the flash-attention path above for a model that asked for none and supports it
        # (kernels/attention/_route.py, default_attention; its switch: NPU_AUTOPATCH_DEFAULT_ATTENTION=0).
        Model(
            "default_attention",
            Target("default_attention", "PreTrainedModel.get_correct_attn_implementation"),
            module="transformers.modeling_utils",
        ),
        # Not a model type: transformers' activation classes, which every model's ACT2FN[config.hidden_act]
        # instantiates (kernels/activations.py): the GELU forms on npu_gelu (exact GELU honoured, which
        # aten's gelu on the NPU is not), quick GELU on npu_fast_gelu where it has a backward.
        Model(
            "activations",
            Target("gelu", "GELUActivation.forward"),  # "gelu", "gelu_python"
            Target("gelu", "GELUTanh.forward"),  # "gelu_pytorch_tanh", "gelu_python_tanh"
            Target("gelu", "NewGELUActivation.forward"),  # "gelu_new"
            Target("gelu", "FastGELUActivation.forward"),  # "gelu_fast"
            Target("quick_gelu", "QuickGELUActivation.forward"),  # "quick_gelu"
            module="transformers.activations",
        ),
        # Not a model type: verl's own NPU patch, which would replace our kernels in the nine model
        # types it covers; it steps aside for the ones we patch (integrations/verl.py). Its module is
        # whichever module of verl defines apply_npu_patches, wherever verl moves it.
        Model("verl_npu_patch", Target(verl.STEP_ASIDE, "apply_npu_patches"), module="verl.*"),
        # Not a model type: ms-swift's own NPU patch, which its import runs on an NPU (ms-swift 4.6.0:
        # swift/model/npu_patch/model.py); it steps aside for the models we patch (integrations/swift.py).
        Model("swift_npu_patch", Target(swift.STEP_ASIDE, "apply_patch"), module="swift.*npu_patch.model"),
        # Not a model type: LLaMA-Factory's NPU kernels (use_v1_kernels, kernel_config), set on a built
        # model's instances; they step aside for the model types we patch (integrations/llamafactory.py).
        Model(
            "llamafactory_kernels",
            Target(llamafactory.STEP_ASIDE, "apply_kernels", "apply_kernel"),
            module="llamafactory.*kernels.interface",
        ),
        # Not a model type: verl's fused log-probs and entropy (use_fused_kernels, its torch backend),
        # computed by npu_autopatch.losses.linear_logprobs (integrations/verl_logprobs.py).
        Model(
            "verl_fused_logprobs",
            Target(verl_logprobs.VERL_LOGPROBS, "FusedLinearForPPO.forward"),
            module="verl.*",
        ),
    )
}

# The models this package ships, read-only. The live registry, this table with the entry-point
# plugins and register()'s models, is ``_state.STATE.models``.
MODELS = _READ_ONLY(_TABLE)
BUILTIN = tuple(MODELS)
# The entries that are no model type: a module every model calls (no tiny model, no modeling module).
INTEGRATIONS = frozenset(
    {
        "npu_flash_attention",
        "flash_attention_utils",
        "default_attention",
        "activations",
        "verl_npu_patch",
        "swift_npu_patch",
        "llamafactory_kernels",
        "verl_fused_logprobs",
    }
)
MODEL_TYPES = tuple(name for name in BUILTIN if name not in INTEGRATIONS)
