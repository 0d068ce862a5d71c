"""The tiny-model builder: any model type, from its own config class, shrunk by what its fields mean.

The shrinking rules on plain config.json dicts (no model is built). That every model of the table
builds tiny with no hand-written config and trains is checked where the parity tests build those
very models (test_parity_models.py: assert_a_sound_tiny_model).
"""

import pytest

from npu_autopatch.testing import tiny


def shrunk(**fields):
    return tiny.shrink({"model_type": "x", **fields})


def test_widths_depth_heads_and_vocab_shrink_and_only_shrink():
    out = shrunk(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
    )
    assert (out["vocab_size"], out["hidden_size"], out["intermediate_size"]) == (128, 64, 128)
    assert (out["num_hidden_layers"], out["num_attention_heads"], out["num_key_value_heads"]) == (2, 4, 2)
    assert (out["head_dim"], out["max_position_embeddings"]) == (16, 512)
    assert (out["rms_norm_eps"], out["linear_conv_kernel_dim"]) == (1e-6, 4)  # not sizes
    # Never grown: a field already smaller than the tiny size keeps its value.
    assert shrunk(hidden_size=32, num_attention_heads=2)["hidden_size"] == 32


def test_a_derived_head_dim_follows_the_width():
    # No head_dim field: the model computes hidden_size // heads, so the width sets it.
    out = shrunk(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32)
    assert out["hidden_size"] // out["num_attention_heads"] == 16
    assert out["num_key_value_heads"] == out["num_attention_heads"]  # multi-head stays multi-head


def test_per_layer_lists_keep_one_layer_of_each_kind_and_index_lists_follow():
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    out = shrunk(
        num_hidden_layers=48,
        layer_types=kinds * 12,
        mlp_layer_types=["dense"] + ["sparse"] * 47,
        num_experts=512,
    )
    assert out["num_hidden_layers"] == 3  # old layer 0 (dense, linear), 1 (sparse), 3 (full attention)
    assert out["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    assert out["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    tower = tiny.shrink(
        {
            "model_type": "x",
            "vision_config": {"model_type": "v", "depth": 32, "fullatt_block_indexes": [7, 15]},
        }
    )["vision_config"]
    assert (tower["depth"], tower["fullatt_block_indexes"]) == (1, [0])


def test_an_moe_model_keeps_a_dense_layer_and_grouped_routing_stays_valid():
    out = shrunk(
        num_hidden_layers=61,
        first_k_dense_replace=3,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        moe_intermediate_size=2048,
    )
    assert (out["num_hidden_layers"], out["first_k_dense_replace"]) == (2, 1)
    assert out["n_routed_experts"] % out["n_group"] == 0 and out["topk_group"] <= out["n_group"]
    assert out["n_routed_experts"] // out["n_group"] >= out["num_experts_per_tok"] == 2
    assert shrunk(num_hidden_layers=48, num_experts=128, mlp_only_layers=[])["mlp_only_layers"] == [0]


def test_mrope_sections_sum_to_half_the_rotary_dims():
    out = shrunk(
        hidden_size=2048,
        num_attention_heads=16,
        head_dim=256,
        rope_parameters={
            "rope_type": "default",
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    )
    rope = out["rope_parameters"]
    assert sum(rope["mrope_section"]) == int(out["head_dim"] * 0.25) // 2
    assert all(part >= 1 for part in rope["mrope_section"])


def test_special_tokens_move_inside_the_tiny_vocab_and_stay_distinct():
    out = tiny.shrink(
        {
            "model_type": "x",
            "image_token_id": 151655,
            "video_token_id": 151656,
            "text_config": {
                "model_type": "t",
                "vocab_size": 151936,
                "pad_token_id": 151643,
                "eos_token_id": [1, 2],
            },
        }
    )
    ids = [out["image_token_id"], out["video_token_id"], out["text_config"]["pad_token_id"]]
    ids += out["text_config"]["eos_token_id"]
    assert len(set(ids)) == len(ids) and all(0 <= i < out["text_config"]["vocab_size"] for i in ids)


def test_a_towers_output_width_is_the_text_models():
    out = tiny.shrink(
        {
            "model_type": "x",
            "text_config": {"model_type": "t", "hidden_size": 3584, "num_attention_heads": 28},
            "vision_config": {
                "model_type": "v",
                "hidden_size": 1280,
                "num_heads": 16,
                "out_hidden_size": 8192,
            },
        }
    )
    assert out["vision_config"]["out_hidden_size"] == out["text_config"]["hidden_size"] == 64
    assert out["vision_config"]["hidden_size"] == 32


def test_overrides_replace_fields_of_the_text_model():
    config = tiny.tiny_config("llama", num_hidden_layers=3, rms_norm_eps=1e-5)
    assert (config.num_hidden_layers, config.rms_norm_eps, config.hidden_size) == (3, 1e-5, 64)


def test_a_size_field_the_builder_does_not_know_is_an_error_not_a_huge_model():
    with pytest.raises(tiny.TinyModelError, match="after shrinking"):
        tiny.tiny_model("llama", vocab_size=2_000_000)  # 128M parameters: refused on the meta device
