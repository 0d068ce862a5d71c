"""Device profiles of the stand-in: one torch_npu release line on one chip, as read from its sources.

A profile is what a torch_npu release gives a program on an Atlas A2 box: which ops exist with
which schema (the op-plugin branch's ``op_plugin_functions.yaml``, or the wheel's registered
schemas), which have a backward and through which op (``derivatives.yaml``), and the few rules
that changed between release lines. The rules every line shares (the CANN kernels' shape
checks) are in ops.py and attention.py; each rule names its source file there or here. Paths are in the public
repositories Ascend/op-plugin (one branch per release line), Ascend/pytorch (torch_npu:
``COMPATIBILITY.en.md`` pairs each release with its op-plugin branch and CANN) and
hicann/ops-transformer (the CANN kernels and their host-side tiling).

Chip: the ``a2-*`` profiles are an Atlas A2 training device (Ascend 910B, the aclnn path of
``RotaryMulKernelNpuOpApi.cpp``), taken with 48 vector cores (Ascend910B1): the block rule of the
rotary kernel refuses more shapes the more cores there are, so this is the strictest A2 part.
``950-newest`` is the newest torch_npu on an Ascend 950, modelled for one rule only: its
npu_fusion_attention forward passes no sink to the kernel while its backward does (below). Every
other rule of the 950 is the A2's here, which is not known to hold (docs/device-rules.md:
unknowns). Atlas training series (910A) and 310P are not modelled.

The device family is what ``torch.npu.get_device_name()`` returns on the device: the SoC name,
``aclrtGetSocName()`` (Ascend/pytorch torch_npu/csrc/npu/Module.cpp ``GetDeviceName``), e.g.
"Ascend910B1"; torch_npu itself counts every name that starts with "Ascend950" as the 950
(torch_npu/csrc/core/npu/NpuVariables.cpp ``SetSocVersion``), so the 950 profile answers "Ascend950".
"""

from __future__ import annotations

from dataclasses import dataclass, field

# torch_npu 2.14 (the wheel's registered schemas, torch_npu_ops.md WHEEL-SO), plus the MoE and
# attention grad ops of op-plugin master (op_plugin_functions.yaml at 517f2e7d). Only the ops a
# kernel calls, and npu_fusion_attention (+ grad), modelled for the attention kernel (issue 18).
_NEWEST_SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": (
        "npu_rms_norm_backward(Tensor dy, Tensor input, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)"
    ),
    "npu_swiglu": "npu_swiglu(Tensor input, int dim=-1) -> Tensor",
    "npu_swiglu_backward": "npu_swiglu_backward(Tensor grad_output, Tensor input, int dim=-1) -> Tensor",
    "npu_rotary_mul": (
        "npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) "
        "-> Tensor"
    ),
    "npu_rotary_mul_backward": (
        "npu_rotary_mul_backward(Tensor grad, Tensor input, Tensor r1, Tensor r2, str rotary_mode='half') "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "npu_fusion_attention": (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None, '
        "Tensor? dropout_mask=None, int seed=0, int offset=0) "
        "-> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    ),
    "npu_fusion_attention_grad": (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None) '
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]"
    ),
    "npu_moe_token_permute": (
        "npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, "
        "bool padded_mode=False) -> (Tensor, Tensor)"
    ),
    "npu_moe_token_permute_grad_v2": (
        "npu_moe_token_permute_grad_v2(Tensor grad_permuted_tokens, Tensor sorted_indices, "
        "int tokens_size_0, ScalarType tokens_dtype, int num_topK, bool padded_mode=False) -> Tensor"
    ),
    "npu_moe_token_unpermute": (
        "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, "
        "bool padded_mode=False, int[]? restore_shape=None) -> Tensor"
    ),
    "npu_moe_token_unpermute_grad_v2": (
        "npu_moe_token_unpermute_grad_v2(Tensor grad_unpermuted_tokens, Tensor sorted_indices, "
        "int permuted_tokens_size_0, ScalarType permuted_tokens_dtype, Tensor? probs=None, "
        "bool padded_mode=False, int[]? restore_shape=None, Tensor? permuted_tokens=None) -> (Tensor, Tensor)"
    ),
}

# The GELU family (issue 34), the same in every branch modelled here (op_plugin_functions.yaml of 7.1.0,
# 7.2.0, 7.3.0, 26.0.0, 26.1.0 and master): npu_gelu with ``approximate`` from 6.0.0; npu_fast_gelu and
# npu_geglu in every branch (npu_geglu's activate_left from 6.0.rc1). Which have a backward differs:
# _GELU_AUTOGRAD and _FAST_GELU_AUTOGRAD below.
_GELU_SCHEMAS = {
    "npu_gelu": "npu_gelu(Tensor self, *, str approximate='none') -> Tensor",
    "npu_gelu_backward": (
        "npu_gelu_backward(Tensor grad_output, Tensor self, *, str approximate='none') -> Tensor"
    ),
    "npu_fast_gelu": "npu_fast_gelu(Tensor self) -> Tensor",
    "npu_fast_gelu_backward": "npu_fast_gelu_backward(Tensor grad, Tensor self) -> Tensor",
    "npu_geglu": (
        "npu_geglu(Tensor self, int dim=-1, int approximate=1, bool activate_left=False) -> (Tensor, Tensor)"
    ),
    "npu_geglu_grad": (
        "npu_geglu_grad(Tensor grad_output, Tensor self, Tensor gelu, int dim=-1, int approximate=1, "
        "bool activate_left=False) -> Tensor"
    ),
}
_NEWEST_SCHEMAS.update(_GELU_SCHEMAS)

# op-plugin 7.2.0's op_plugin_functions.yaml, where it differs from the newest: no ``rotate`` for
# npu_rotary_mul, ScalarType output_dtype for npu_grouped_matmul, the v1 backward ops of the
# token permute/unpermute ops, and fusion attention without sink/dropout_mask.
_V72_SCHEMAS = {
    **{name: schema for name, schema in _NEWEST_SCHEMAS.items() if not name.endswith("_grad_v2")},
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": (
        "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)"
    ),
    "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_swiglu_backward": "npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
    "npu_rotary_mul": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
    "npu_rotary_mul_backward": (
        "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "npu_fusion_attention": (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="") '
        "-> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    ),
    "npu_fusion_attention_grad": (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="") '
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "ScalarType? output_dtype=None) -> Tensor[]"
    ),
    "npu_moe_token_permute_grad": (
        "npu_moe_token_permute_grad(Tensor tokens, Tensor grad_permuted_tokens, Tensor indices, "
        "Tensor sorted_indices, bool padded_mode=False) -> Tensor"
    ),
    "npu_moe_token_unpermute_grad": (
        "npu_moe_token_unpermute_grad(Tensor permuted_tokens, Tensor grad_unpermuted_tokens, "
        "Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) "
        "-> (Tensor, Tensor)"
    ),
}

# op-plugin 7.1.0: the token permute/unpermute ops exist without any backward op; fusion attention
# has no softmax_layout.
_V71_SCHEMAS = {
    **{name: schema for name, schema in _V72_SCHEMAS.items() if not name.endswith("_grad")},
    **_GELU_SCHEMAS,
    "npu_fusion_attention": (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    ),
    "npu_fusion_attention_grad": (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
}

# How an op behaves under autograd (derivatives.yaml of the branch; torch_npu's
# VariableFallbackKernel.cpp for ops without an entry):
#   "<op name>": a real backward through that backward op;
#   absent from the mapping: the generic fallback, warn and give NO gradient.
# (op-plugin's AutogradErrorFallback.cpp, whose backward raises, covers only ops no kernel calls:
# npu_add_rms_norm, npu_apply_rotary_pos_emb, npu_moe_gating_top_k_softmax. Not modelled.)

# derivatives.yaml: npu_gelu -> npu_gelu_backward from 6.0.0 (``version: [v2.1, newest]``); npu_geglu
# -> npu_geglu_grad (``output_differentiability: [true, false]``, result1 saved) in every branch;
# npu_fast_gelu -> npu_fast_gelu_backward only from 7.3.0 (before, only the beta ``fast_gelu`` has an
# entry, and npu_fast_gelu gets the fallback: no gradient).
_GELU_AUTOGRAD = {"npu_gelu": "npu_gelu_backward", "npu_geglu": "npu_geglu_grad"}
_FAST_GELU_AUTOGRAD = {"npu_fast_gelu": "npu_fast_gelu_backward"}

_NEWEST_AUTOGRAD = {
    "npu_rms_norm": "npu_rms_norm_backward",
    "npu_swiglu": "npu_swiglu_backward",
    "npu_rotary_mul": "npu_rotary_mul_backward",
    "npu_fusion_attention": "npu_fusion_attention_grad",
    "npu_moe_token_permute": "npu_moe_token_permute_grad_v2",
    "npu_moe_token_unpermute": "npu_moe_token_unpermute_grad_v2",
    **_GELU_AUTOGRAD,
    **_FAST_GELU_AUTOGRAD,
}

_V72_AUTOGRAD = {
    "npu_rms_norm": "npu_rms_norm_backward",
    "npu_swiglu": "npu_swiglu_backward",
    "npu_rotary_mul": "npu_rotary_mul_backward",
    "npu_fusion_attention": "npu_fusion_attention_grad",
    "npu_moe_token_permute": "npu_moe_token_permute_grad",
    "npu_moe_token_unpermute": "npu_moe_token_unpermute_grad",
    **_GELU_AUTOGRAD,
}

_V71_AUTOGRAD = {name: grad for name, grad in _V72_AUTOGRAD.items() if not name.startswith("npu_moe_token")}


@dataclass(frozen=True)
class SdpaRules:
    """torch_npu's ``scaled_dot_product_attention`` on one op-plugin branch, where the branches differ.

    Ascend/op-plugin ``op_plugin/ops/opapi/ScaledDotProductAttentionKernelNpuOpApi.cpp``, the torch >= 2.5
    variant (``VERSION_BETWEEN(V2R5, VERSION_NEWEST)``); sdpa.py models what every branch shares. Lines
    are 7.2.0's (blob a152fc60, the same file as 7.1.0's) and master's (517f2e7d, blob d97edcaf).
    """

    branch: str
    # A mask of rank other than 2 or 4 goes to the math path from inside the fused branch (7.2.0 :229-234);
    # removed in 26.1.0, where such a mask reaches the fused op (which refuses it).
    odd_rank_mask_to_math: bool
    # The math path is given enable_gqa (7.3.0 on; 7.2.0 :303-306 drops it).
    math_takes_enable_gqa: bool
    # preprocess_attn_mask_for_npu (26.1.0 on; master :117-143, :292): a 2-4-D mask broadcastable to
    # [B, N, Sq, Skv] and not already SS/B1SS/BNSS/11SS is expanded to [B, N, Sq, Skv].
    expands_masks: bool
    # calculate_inner_precise_for_fa (26.1.0 on; master :145-151, :310): inner_precise=2 (the op's
    # invalid-row mode, slower) for a masked, non-causal call with Sq > 1; 0 before.
    masked_inner_precise: bool
    # fp32 with any of q/k/v's last dims % 4 != 0 goes to math on every call (master :267-273, commit
    # 68ad4c26, 2026-08-12); on 26.1.0 only in compatible mode (:309), which the stand-in does not model.
    fp32_unaligned_to_math: bool


# Every branch read (git diff of the file between them); the profiles below use 7.1.0, 7.2.0 and master,
# the others are there to test a release line no profile models yet (dataclasses.replace(profile, sdpa=...)).
SDPA_RULES = {
    rules.branch: rules
    for rules in (
        SdpaRules("7.1.0", True, False, False, False, False),  # blob a152fc60, as 7.2.0
        SdpaRules("7.2.0", True, False, False, False, False),
        SdpaRules("7.3.0", True, True, False, False, False),
        SdpaRules("26.0.0", True, True, False, False, False),  # + npu_fusion_attention_v3 below Ascend950
        SdpaRules("26.1.0", False, True, True, True, False),
        SdpaRules("master", False, True, True, True, True),
    )
}


@dataclass(frozen=True)
class Profile:
    """One torch_npu release line on one device, as the stand-in models it."""

    name: str  # also the torch.library namespace suffix of its ops
    torch_npu: str  # what torch_npu.__version__ reports
    op_plugin: str  # the op-plugin branch that release pins
    cann: str  # the CANN release COMPATIBILITY.en.md pairs it with
    schemas: dict[str, str] = field(repr=False)
    autograd: dict[str, str] = field(repr=False)
    device: str = "Atlas A2"  # the product, for a reader
    soc: str = "Ascend910B1"  # what torch.npu.get_device_name() returns (aclrtGetSocName)
    # Whether npu_fusion_attention's forward hands ``sink`` to the kernel. op-plugin 26.0.0, 26.1.0 and
    # master, FlashAttentionKernelNpuOpApi.cpp: on Ascend 950 (``GetSocVersion() >= Ascend950``) the
    # forward calls aclnnFlashAttentionScoreV4 with no sink among its arguments (master ~1570-1585),
    # while the backward passes it to aclnnFlashAttentionScoreGradV4 (~1206-1224): the output ignores
    # the sinks, their gradient is computed as if it had not.
    forward_sink: bool = True
    # npu_grouped_matmul's accepted group_type values (GroupedMatmulKernelNpuOpApi.cpp of the branch).
    gmm_group_types: frozenset[int] = frozenset({-1, 0, 2})
    # Whether the K-split (group_type 2) writes zeros for a group with no rows. ops-transformer's
    # grouped_matmul_vector.h EmptyTensorCompute does, called from grouped_matmul.cpp's A2/A3 path
    # (``__CCE_AICORE__ == 220``, tiling key 1, x transposed), since the repository's first import
    # (2025-09, the CANN 8.5 line); for older CANN it is unverified, so the stand-in leaves
    # such blocks as uninitialised memory (NaN), the worst case. The moe kernel decides the same
    # from the SoC name and the CANN version (``npu.utils.get_cann_version``).
    gmm_zero_fills_empty_groups: bool = True
    # torch_npu's sdpa, by the op-plugin branch of ``op_plugin`` (sdpa.py).
    sdpa: SdpaRules = SDPA_RULES["master"]

    @property
    def namespace(self) -> str:
        return "npu_standin_" + self.name.replace("-", "_").replace(".", "_")

    def describe(self) -> str:
        return f"torch_npu {self.torch_npu} (op-plugin {self.op_plugin}, CANN {self.cann}) on {self.device}"


NEWEST = Profile(
    name="a2-newest",
    torch_npu="2.14.0",
    # Ascend/pytorch master (2.13.0, 2.14.0, 2.15.0 in version.txt) pins op-plugin master
    # (6b46b284, 2026-08); the 2.14.0 wheel registers master's schemas (torch_npu_ops.md).
    op_plugin="master (after 26.1.0)",
    # COMPATIBILITY.en.md does not list 2.14.0 yet; 2.11.0 and 2.12.0 pair with CANN 9.1.0.
    cann="9.1.0",
    schemas=_NEWEST_SCHEMAS,
    autograd=_NEWEST_AUTOGRAD,
)

V2_7_1 = Profile(
    name="a2-2.7.1",
    torch_npu="2.7.1",
    op_plugin="7.2.0",  # COMPATIBILITY.en.md: 2.7.1 -> v2.7.1-7.2.0, CANN 8.3.RC1
    cann="8.3.RC1",
    schemas=_V72_SCHEMAS,
    autograd=_V72_AUTOGRAD,
    gmm_zero_fills_empty_groups=False,
    sdpa=SDPA_RULES["7.2.0"],
)

V2_6_0 = Profile(
    name="a2-2.6.0",
    torch_npu="2.6.0",
    op_plugin="7.1.0",  # COMPATIBILITY.en.md: 2.6.0 -> v2.6.0-7.1.0, CANN 8.2.RC1
    cann="8.2.RC1",
    schemas=_V71_SCHEMAS,
    autograd=_V71_AUTOGRAD,
    # 7.1.0 GroupedMatmulKernelNpuOpApi.cpp: "group_type currently only support -1 and 0".
    gmm_group_types=frozenset({-1, 0}),
    gmm_zero_fills_empty_groups=False,
    sdpa=SDPA_RULES["7.1.0"],
)

ASCEND_950 = Profile(
    name="950-newest",
    torch_npu=NEWEST.torch_npu,
    op_plugin=NEWEST.op_plugin,
    cann=NEWEST.cann,
    schemas=_NEWEST_SCHEMAS,
    autograd=_NEWEST_AUTOGRAD,
    device="Ascend 950",
    soc="Ascend950",
    forward_sink=False,
    # The 950's grouped matmul (ops-transformer op_kernel/arch35) was not read: whether its K-split
    # zeroes an empty group is unknown, so the stand-in takes the worst case.
    gmm_zero_fills_empty_groups=False,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (NEWEST, V2_7_1, V2_6_0, ASCEND_950)}
DEFAULT = NEWEST
