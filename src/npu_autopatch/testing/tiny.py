"""Tiny random models of any transformers model type, built from the type's own config class.

``tiny_config("qwen3_moe")`` takes the default config of the model type (what
``CONFIG_MAPPING[model_type]()`` gives), serialises it as a config.json would be, shrinks
its fields by what they mean (widths, depths, heads, experts, vocabularies, layer-type
lists, layer indexes, rotary sections, special token ids ...) in the model and in every
sub-config (text, vision, audio towers), and loads it back with ``from_dict``, the path
of a real checkpoint. There is no table of configs per model: a field is shrunk because
of its name, and fields that must agree (heads and key/value heads, ``head_dim`` and
the rotary sections, a projector's width and the text model's, a layer-type list and
the layer count) are shrunk together. Where a model's code has a default its config lacks
(the mRoPE sections of Qwen2-VL-style models), it is read from the modeling source.

``tiny_model`` builds the model with the head a user trains: image-text-to-text where
there is a vision tower, else causal LM, else the base model; a model whose trainable
part is a sub-model (Qwen-Omni's thinker) is built as that sub-model, and the modules
from_pretrained keeps in fp32 stay in fp32. ``model_inputs`` gives inputs for it: text,
plus one image (and one audio clip) per sample where the model has those towers, with as
many placeholder tokens as the tower really produces.

A shrunk config is checked on the meta device before any memory is allocated: a field
this module does not know could leave a model with billions of parameters, and that
must be an error, not a swap storm on a shared machine.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass

import torch

__all__ = [
    "TinyModelError",
    "build_config",
    "model_batch",
    "model_inputs",
    "tiny_config",
    "tiny_model",
    "vocab_size",
]

# The sizes of the tiny models (today's parity models: hidden 64, 4 heads of 16, 2 kv heads,
# two layers, vocabulary 128). Towers (vision, audio) are narrower and one block deep.
# FFN widths are twice the width.
TEXT = {"width": 64, "layers": 2, "heads": 4, "head_dim": 16, "vocab": 128}
TOWER = {"width": 32, "layers": 1, "heads": 2, "head_dim": 16, "vocab": 128}
EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 4, 2, 32, 64

# A shrunk model larger than this (parameters and buffers, in elements) is refused: it
# means a size field was not recognised.
MAX_ELEMENTS = 8_000_000

# Field names by meaning. A field is only ever shrunk (never grown), and only when it is an int.
_WIDTH = frozenset(
    [
        "hidden_size",
        "d_model",
        "n_embd",
        "n_embed",
        "embed_dim",
        "hidden_dim",
        "dim",
        "emb_dim",
        "model_dim",
        "word_embed_proj_dim",
    ]
)
_FFN = frozenset(
    [
        "intermediate_size",
        "ffn_dim",
        "d_ff",
        "n_inner",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "mlp_dim",
        "ffn_hidden_size",
        "decoder_intermediate_size",
        "dense_intermediate_size",
        "intermediate_size_mlp",
    ]
)
_LAYERS = (  # in order of preference: the first present is the config's layer count
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "depth",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "decoder_num_layers",
)
_HEADS = frozenset(
    [
        "num_attention_heads",
        "num_heads",
        "n_head",
        "n_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "attention_heads",
    ]
)
_KV_HEADS = frozenset(["num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"])
_HEAD_DIM = frozenset(
    ["head_dim", "d_kv", "kv_channels", "dim_head", "attention_head_dim", "attention_head_size"]
)
_ROTARY_DIM = frozenset(["rotary_dim", "rotary_emb_dim", "rope_dim"])  # a part of the head dim
_EXPERTS = frozenset(
    [
        "num_experts",
        "n_routed_experts",
        "num_local_experts",
        "moe_num_experts",
        "n_experts",
        "num_routed_experts",
        "zero_expert_num",
    ]
)
_TOP_K = frozenset(
    ["num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "num_selected_experts", "moe_top_k"]
)
_EXPERT_FFN = frozenset(
    ["moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size", "expert_ffn_hidden_size"]
)
_SHARED_FFN = frozenset(["shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"])
_SHARED_EXPERTS = frozenset(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"])
_FIRST_DENSE = frozenset(["first_k_dense_replace", "first_k_dense", "moe_layer_start_index"])
# Exact values for the rest: multi-head latent attention, sparse-attention indexers, linear
# attention and state-space layers, grouped routing, positions.
_FIXED = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "state_size": 16,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "num_position_embeddings": 16,  # a learned square grid of vision positions, interpolated
    "mm_tokens_per_image": 4,  # a square number of pooled image tokens
    "max_source_positions": 16,  # audio positions after the conv front end (Whisper-style)
}
# Fields that are never sizes even though their names look like one.
_KEEP = frozenset(
    [
        "patch_size",
        "temporal_patch_size",
        "spatial_merge_size",
        "in_channels",
        "num_channels",
        "num_mel_bins",
        "conv_kernel_size",
        "linear_conv_kernel_dim",
        "mamba_d_conv",
        "window_size",
    ]
)
# A tower's output width is the text model's (what its projector feeds into the text model).
_TO_TEXT_WIDTH = frozenset(["out_hidden_size", "text_hidden_size", "output_dim", "llm_hidden_size"])
# Probabilities of randomness in a training step (dropout, stochastic depth, router noise).
_RANDOM = ("dropout", "drop_path", "layerdrop", "jitter")
# The ends of width names not known one by one; shrunk only when large.
_OTHER_WIDTHS = ("hidden_size", "hidden_dim", "_channels")
_SIZE_WORDS = ("size", "dim", "hidden", "channels", "features", "width")


class TinyModelError(RuntimeError):
    """A tiny model of this type cannot be built or run; the message says at which step and why."""


@dataclass
class _Shrink:
    """What one pass over a config tree learned: old -> new widths, the text model's old widths."""

    widths: dict  # old width -> new width, text first (for projector fields elsewhere)
    text_widths: frozenset  # the text model's old hidden size(s)


# --- the config ---------------------------------------------------------------------------


def _quiet():
    """Silence transformers' config/model warnings about the odd tiny values."""
    from transformers.utils import logging as hf_logging

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    stack.callback(hf_logging.set_verbosity, level)
    return stack


def _config_class(model_type: str):
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        raise TinyModelError(f"{model_type}: not a model type of this transformers") from None


def _is_config(value) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _role(key: str, fields: dict) -> str:
    """'text', or 'tower' for a vision or audio encoder (narrower and shallower)."""
    if any(word in key for word in ("vision", "visual", "audio", "speech", "image")):
        return "tower"
    if "vocab_size" not in fields and any(
        k in fields for k in ("patch_size", "image_size", "num_mel_bins", "num_channels")
    ):
        return "tower"
    return "text"


def _walk(fields: dict, key: str = ""):
    """(key, dict) of every config in the tree, parents first."""
    yield key, fields
    for name, value in fields.items():
        if _is_config(value):
            yield from _walk(value, name)


def text_fields(fields: dict) -> dict:
    """The dict of the text model in a config tree: ``text_config`` (shallowest) or the root."""
    found = [
        (depth, sub) for depth, (name, sub) in _depths(fields) if name in ("text_config", "language_config")
    ]
    if found:
        return min(found, key=lambda pair: pair[0])[1]
    return fields


def _depths(fields: dict, depth: int = 0):
    for name, value in fields.items():
        if _is_config(value):
            yield depth + 1, (name, value)
            yield from _depths(value, depth + 1)


def _layer_count(fields: dict):
    for name in _LAYERS:
        value = fields.get(name)
        if _int(value) and value > 0:
            return name, value
    return None, None


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_field(name: str) -> bool:
    return name.endswith(("token_id", "token_index", "token_ids"))


def _collect_tokens(fields: dict, vocab: int) -> dict:
    """Every special token id of the tree, old -> new, new ones at the top of the tiny vocab."""
    old = []
    for _key, sub in _walk(fields):
        for name, value in sub.items():
            if not _token_field(name):
                continue
            for v in value if isinstance(value, list | tuple) else (value,):
                if _int(v) and v >= 0 and v not in old:
                    old.append(v)
    if len(old) > vocab // 2:
        raise TinyModelError(f"{len(old)} special tokens do not fit a vocabulary of {vocab}")
    return {v: vocab - 1 - i for i, v in enumerate(old)}


def _remap_tokens(value, tokens):
    if isinstance(value, list | tuple):
        return type(value)(tokens.get(v, v) if _int(v) else v for v in value)
    return tokens.get(value, value) if _int(value) else value


def _per_layer(name: str, value, layers: int) -> bool:
    """A list (or pattern string) with one entry per layer: layer types, dense/sparse, no-rope flags."""
    return isinstance(value, list | tuple | str) and len(value) == layers > 1 and not _token_field(name)


def _index_list(name: str, value, layers: int) -> bool:
    """A list of layer indexes: full-attention blocks, deepstack layers, dense-only layers."""
    if not (isinstance(value, list | tuple) and value and all(_int(v) for v in value)):
        return False
    if not any(word in name for word in ("layer", "index", "idx", "block")):
        return False
    return all(-layers <= v < layers for v in value) and len(set(value)) == len(value)


def _layer_keyed(name: str, value, layers: int) -> bool:
    """A dict keyed by layer index (per-layer overrides, e.g. ``per_layer_config``)."""
    if "layer" not in name or not (isinstance(value, dict) and value):
        return False
    try:
        return all(0 <= int(k) < layers for k in value)
    except (TypeError, ValueError):
        return False


def _selection(fields: dict, layers: int, minimum: int) -> list:
    """Which old layers the tiny model keeps: one of each kind, one of each index list.

    A per-layer list keeps the first layer of each kind; an index list and a dict of
    per-layer overrides keep their first member; a first-k-dense boundary keeps layer 0 and
    layer k. Padded with the first layers up to ``minimum``.
    """
    chosen = set()
    for name, value in fields.items():
        if _per_layer(name, value, layers) and not _index_list(name, value, layers):
            first = {}
            for i, item in enumerate(value):
                first.setdefault(repr(item), i)
            chosen.update(first.values())
        elif _index_list(name, value, layers):
            chosen.add(value[0] % layers)
        elif _layer_keyed(name, value, layers):
            chosen.add(min(int(k) for k in value))
    for name in _FIRST_DENSE:
        k = fields.get(name)
        if _int(k) and 0 < k < layers:
            chosen.update((0, k))
    chosen = sorted(chosen)
    for i in range(layers):
        if len(chosen) >= minimum:
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def _resample(name, value, layers, keep):
    """A per-layer list, an index list or a layer-keyed dict, for the kept layers ``keep``."""
    position = {old: new for new, old in enumerate(keep)}
    if isinstance(value, dict):
        return {type(k)(position[int(k)]): v for k, v in value.items() if int(k) in position}
    if isinstance(value, str):
        return "".join(value[i] for i in keep)
    if _index_list(name, value, layers):
        return type(value)(position[v % layers] for v in value if v % layers in position)
    return type(value)(value[i] for i in keep)


def _shrink_rope(rope: dict, head_dim: int, fields: dict) -> dict:
    """Rotary parameters for the tiny head: mRoPE sections summing to half the rotary dims,
    per-frequency factor lists of the right length. Nested per-layer-type dicts recurse."""
    rope = dict(rope)
    for name, value in rope.items():
        if isinstance(value, dict):
            rope[name] = _shrink_rope(value, head_dim, fields)
    factor = rope.get("partial_rotary_factor", fields.get("partial_rotary_factor")) or 1.0
    half = int(head_dim * factor) // 2
    for name in ("mrope_section", "mrope_sections"):
        if isinstance(rope.get(name), list | tuple):
            rope[name] = _split(half, rope[name])
    for name in ("short_factor", "long_factor"):
        if isinstance(rope.get(name), list | tuple) and rope[name]:
            rope[name] = [rope[name][0]] * half
    if _int(rope.get("original_max_position_embeddings")):
        rope["original_max_position_embeddings"] = min(
            rope["original_max_position_embeddings"], _FIXED["max_position_embeddings"] // 2
        )
    return rope


def _split(total: int, weights) -> list:
    """``total`` split in proportion to ``weights`` (largest remainder), every part at least 1."""
    weights = [max(w, 1) for w in weights]
    raw = [total * w / sum(weights) for w in weights]
    parts = [max(1, math.floor(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - math.floor(raw[i]), reverse=True)
    i = 0
    while sum(parts) < total:
        parts[order[i % len(order)]] += 1
        i += 1
    while sum(parts) > total:
        j = max(range(len(parts)), key=lambda i: parts[i])
        parts[j] -= 1
    return parts


def _head_dim_for(fields: dict, sizes: dict) -> int:
    """The tiny head dim: 16, more when a partial rotary with mRoPE sections needs room."""
    head_dim = sizes["head_dim"]
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    factor = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or fields.get(
        "partial_rotary_factor"
    )
    if sections and factor and factor < 1:
        while int(head_dim * factor) // 2 < len(sections) + 1:
            head_dim *= 2
    return head_dim


def _moe(fields: dict) -> bool:
    return any(_int(fields.get(n)) and fields[n] > 0 for n in _EXPERTS | _EXPERT_FFN)


def _shrink_fields(key: str, fields: dict, learned: _Shrink) -> dict:
    """One config's fields, shrunk by meaning (sub-configs are done by the caller)."""
    tower = _role(key, fields) == "tower"
    sizes = TOWER if tower else TEXT
    out = dict(fields)
    old_heads = next((fields[n] for n in _HEADS if _int(fields.get(n))), None)
    old_width = next((fields[n] for n in _WIDTH if _int(fields.get(n))), None)
    heads = min(old_heads or sizes["heads"], sizes["heads"])
    head_dim = _head_dim_for(fields, sizes)
    explicit_head_dim = any(_int(fields.get(n)) for n in _HEAD_DIM)
    # With a derived head dim (hidden / heads), the width is what sets it.
    width = sizes["width"] if explicit_head_dim or old_heads is None else heads * head_dim
    old_head_dim = next((fields[n] for n in _HEAD_DIM if _int(fields.get(n))), None)
    if old_head_dim is None and old_width and old_heads:
        old_head_dim = old_width // old_heads
    grouped = _int(fields.get("n_group")) and fields["n_group"] > 1
    experts = EXPERTS * (2 if grouped else 1)

    def new_value(name, value):
        if name in _KEEP:
            return value
        if tower and value in learned.text_widths and (name in _WIDTH or name in _TO_TEXT_WIDTH):
            return TEXT["width"]  # a tower width that is the text model's (Qwen2-VL's merger output)
        if tower and name in _TO_TEXT_WIDTH:
            return TEXT["width"]
        if tower and name == "hidden_size" and _int(fields.get("embed_dim")):
            return TEXT["width"]  # a tower with its own embed_dim outputs hidden_size (Qwen2-VL)
        if name in _WIDTH:
            return min(value, width)
        if name in _FFN:
            return min(value, 2 * width)
        if name in _HEADS:
            return heads
        if name in _KV_HEADS:
            if old_heads and value >= old_heads:
                return heads
            return 1 if value == 1 else max(1, heads // 2)
        if name in _HEAD_DIM:
            return min(value, head_dim) if value > 0 else value
        if name in _ROTARY_DIM and old_head_dim:
            return max(2, 2 * round(value / old_head_dim * head_dim / 2))
        if "vocab_size" in name:
            return min(value, sizes["vocab"])
        if name in _EXPERTS:
            return min(value, experts) if value > 0 else value
        if name in _TOP_K:
            return min(value, TOP_K)
        if name in _EXPERT_FFN:
            return min(value, EXPERT_FFN)
        if name in _SHARED_FFN:
            return min(value, SHARED_FFN)
        if name in _SHARED_EXPERTS:
            return min(value, 1)
        if name in ("n_group", "num_expert_group"):
            return 2 if value > 1 else value
        if name in ("topk_group", "topk_groups"):
            return min(value, 1)
        if name in _FIXED:
            return min(value, _FIXED[name])
        if name == "image_size" and _int(fields.get("patch_size")):
            return min(value, 4 * fields["patch_size"])
        if name.endswith(_OTHER_WIDTHS) and value > 4 * width:
            return 2 * width  # a width this module does not know by name (a conv's channels)
        return value

    for name, value in fields.items():
        if _int(value) and not _token_field(name):
            out[name] = new_value(name, value)
        elif isinstance(value, float) and any(word in name for word in _RANDOM):
            out[name] = 0.0  # deterministic training steps: stock and patched runs must see the same math
    _fill_missing(fields, out, head_dim)
    # Fields derived from others that the default config stores explicitly.
    if _int(fields.get("mamba_n_heads")) and _int(out.get("mamba_d_head")):
        expand = fields.get("mamba_expand") or 2
        inner = int(expand * out.get("hidden_size", width))
        if _int(fields.get("mamba_d_ssm")):  # Falcon-H1: the SSM width is its own field
            out["mamba_d_ssm"] = inner
        out["mamba_n_heads"] = max(1, inner // out["mamba_d_head"])
    # A layer period (Jamba: attention every 8th layer, from the 4th) becomes 2, so the tiny
    # model has both kinds of layer.
    for name, value in fields.items():
        if name.endswith("_period") and _int(value) and value > 2:
            out[name] = 2
            offset = name[: -len("period")] + "offset"
            if _int(fields.get(offset)):
                out[offset] = fields[offset] % 2
    # Per-layer overrides ({"5": {"head_dim": 512}}) are shrunk like the fields they override.
    for name, value in fields.items():
        if _overrides(name, value):
            out[name] = {
                k: {f: new_value(f, v) if _int(v) else v for f, v in inner.items()}
                for k, inner in value.items()
            }
    # A head dim that was another field's (DeepSeek: head_dim is qk_rope_head_dim) stays equal to it.
    for name in _HEAD_DIM:
        if _int(fields.get(name)):
            twin = next((n for n in _FIXED if n.endswith("head_dim") and fields.get(n) == fields[name]), None)
            if twin is not None:
                out[name] = out[twin]
    _shrink_layers(fields, out, sizes)
    for name in ("rope_parameters", "rope_scaling"):
        if isinstance(fields.get(name), dict):
            final_head_dim = next((out[n] for n in _HEAD_DIM if _int(out.get(n))), None)
            final_head_dim = final_head_dim or out.get("hidden_size", width) // heads
            out[name] = _shrink_rope(fields[name], final_head_dim, out)
    # Backbones name the stages they return; the tiny one returns its last.
    if "out_features" in fields and "stage_names" in fields:
        out["out_features"] = out["out_indices"] = None
    # Remember this config's widths, so that projector fields elsewhere follow.
    for name in _WIDTH | _FFN:
        if _int(fields.get(name)) and fields[name] != out[name]:
            learned.widths.setdefault(fields[name], out[name])
    return out


def _overrides(name: str, value) -> bool:
    """A dict of per-layer (or per-kind) field overrides, e.g. ``{"5": {"head_dim": 512}}``."""
    if not (isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values())):
        return False
    return not _is_config(value) and name not in ("rope_parameters", "rope_scaling")


def _fill_missing(fields: dict, out: dict, head_dim: int) -> None:
    """Fields some default configs leave None although the model needs them (the checkpoints
    set them): a head dim, the experts per token and the expert count of an MoE model."""
    if "head_dim" in fields and fields["head_dim"] is None and any(_int(fields.get(n)) for n in _HEADS):
        out["head_dim"] = head_dim
    if fields.get("num_key_value_heads", 0) is None and any(_int(out.get(n)) for n in _HEADS):
        out["num_key_value_heads"] = next(out[n] for n in _HEADS if _int(out.get(n)))
    if _moe(fields):
        for name in _TOP_K & fields.keys():
            if fields[name] is None:
                out[name] = TOP_K
        for name in ("n_routed_experts", "num_experts"):
            if name in fields and fields[name] is None and _int(fields.get("moe_intermediate_size")):
                out[name] = EXPERTS
        for name in _SHARED_EXPERTS & fields.keys():
            if fields[name] is None:
                out[name] = 1


def _shrink_layers(fields: dict, out: dict, sizes: dict) -> None:
    """The layer count, and every per-layer list, index list and first-k boundary with it."""
    count_name, layers = _layer_count(fields)
    if not layers:
        return
    keep = _selection(fields, layers, min(layers, sizes["layers"]))
    for name, value in fields.items():
        if name in _FIRST_DENSE and _int(value) and value > 0:
            out[name] = sum(1 for i in keep if i < value)
        elif (
            _per_layer(name, value, layers)
            or _index_list(name, value, layers)
            or _layer_keyed(name, value, layers)
        ):
            out[name] = _resample(name, out[name], layers, keep)
    for name in _LAYERS:  # every count: LongCat-Flash builds num_layers, 4.57 also stores 2x as hidden
        if _int(fields.get(name)) and fields[name] > 0:
            out[name] = min(fields[name], len(keep))
    # MoE models that can have dense layers get one (layer 0), so that the dense MLP runs too.
    if isinstance(fields.get("mlp_only_layers"), list) and _moe(out):
        out["mlp_only_layers"] = [0]
        out[count_name] = max(out[count_name], 2)


def _alias_sizes(fields: dict, original: dict, learned: _Shrink) -> None:
    """Size-like fields not known by name that equal an old width (a projector's output, a
    tower's ``out_hidden_size``) take the new width. The text model's widths come first."""
    for name, value in original.items():
        if name in _KEEP or not _int(value) or fields.get(name) != value:
            continue
        if any(word in name for word in _SIZE_WORDS) and value in learned.widths:
            fields[name] = learned.widths[value]


def _clamp_feature_layers(fields: dict) -> None:
    """``vision_feature_layer`` indexes the tower's hidden states (layers + 1 of them)."""
    vision = fields.get("vision_config")
    if not _is_config(vision):
        return
    _, layers = _layer_count(vision)
    if not layers:
        return
    for name in ("vision_feature_layer", "vision_feature_layers"):
        value = fields.get(name)
        if _int(value):
            fields[name] = max(min(value, layers), -(layers + 1))
        elif isinstance(value, list | tuple) and value and all(_int(v) for v in value):
            fields[name] = sorted({max(min(v, layers), -(layers + 1)) for v in value}, key=value.index)


_MROPE_DEFAULT = re.compile(r"""["']mrope_section["']\s*(?:,\s*\[([\d,\s]+)\])?""")


@functools.cache
def source_mrope_section(model_type: str):
    """The mRoPE sections the model's code uses when its config has none, from its source.

    Qwen2-VL-style models read ``rope_parameters.get("mrope_section", [16, 24, 24])`` (5.x)
    or require ``rope_scaling["mrope_section"]`` (4.x) while their default config has none:
    the tiny config must then say it explicitly. None if the code has no mRoPE.
    """
    module = sys.modules.get(_config_class(model_type).__module__)
    folder = os.path.dirname(getattr(module, "__file__", "") or "")
    weights = None
    for name in sorted(os.listdir(folder)) if folder else ():
        if not (name.startswith("modeling_") and name.endswith(".py")):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as source:
            for match in _MROPE_DEFAULT.finditer(source.read()):
                found = [int(v) for v in match.group(1).split(",") if v.strip()] if match.group(1) else None
                weights = found or weights or [1, 1, 1]
    return weights


def _add_mrope(text: dict, weights) -> None:
    """Give the text config explicit mRoPE sections (scaled later) where its code needs them."""
    if "rope_parameters" in text:  # 5.x: always a dict once standardised
        key, rope = "rope_parameters", text["rope_parameters"]
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            return  # none, or per-layer-type parameters: not a Qwen2-VL-style model
    else:  # 4.x: rope_scaling is None for the plain rotary
        key, rope = "rope_scaling", text.get("rope_scaling") or {"rope_type": "default"}
    if "mrope_section" not in rope:
        text[key] = {**rope, "mrope_section": list(weights)}


def shrink(fields: dict, overrides: dict | None = None, mrope=None) -> dict:
    """A config.json dict made tiny (a new dict); ``overrides`` replace fields of the text model.

    ``mrope``: the sections the model's code defaults to (source_mrope_section), made explicit.
    """
    fields = copy.deepcopy(fields)
    text = text_fields(fields)
    if mrope:
        _add_mrope(text, mrope)
    text_widths = frozenset(text[n] for n in _WIDTH if _int(text.get(n)))
    learned = _Shrink(widths={}, text_widths=text_widths)
    # The text model first, so that its widths win when a projector field matches two.
    order = sorted(_walk(fields), key=lambda pair: pair[1] is not text)
    originals = {id(sub): dict(sub) for _key, sub in order}
    for key, sub in order:
        sub.update(_shrink_fields(key, sub, learned))
    for _key, sub in order:
        _alias_sizes(sub, originals[id(sub)], learned)
    tokens = _collect_tokens(fields, TEXT["vocab"])
    for _key, sub in _walk(fields):
        for name, value in list(sub.items()):
            if _token_field(name):
                sub[name] = _remap_tokens(value, tokens)
        _clamp_feature_layers(sub)
    if overrides:
        text.update(overrides)
    return fields


def build_config(model_type: str, fields: dict):
    """The config object of ``model_type`` from a (tiny) config.json dict, as from_pretrained does."""
    cls = _config_class(model_type)
    with _quiet():
        return cls.from_dict(copy.deepcopy(fields))


def default_fields(model_type: str) -> dict:
    """The model type's default config as a config.json dict (a fresh copy)."""
    return copy.deepcopy(_default_fields(model_type))


@functools.cache
def _default_fields(model_type: str) -> dict:
    cls = _config_class(model_type)
    with _quiet():
        return cls().to_dict()


def tiny_config(model_type: str, **overrides):
    """The tiny config of ``model_type``; ``overrides`` replace fields of its text model."""
    fields = shrink(
        default_fields(model_type),
        overrides,
        mrope=source_mrope_section(model_type),
    )
    return build_config(model_type, fields)


# --- the model --------------------------------------------------------------------------

# The heads tried in order: the one a user trains first; the base model where there is no LM head.
_HEADS_IN_ORDER = (
    "AutoModelForImageTextToText",
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModel",
)


_TRAINED_HEADS = ("AutoModelForImageTextToText", "AutoModelForCausalLM")
# The head classes a sub-model without an auto class is looked up by (4.57's Qwen-Omni thinker).
_HEAD_SUFFIXES = {
    "AutoModelForImageTextToText": "ForConditionalGeneration",
    "AutoModelForCausalLM": "ForCausalLM",
}


def model_class(config, by_name: bool = False):
    """(auto class name, model class) for ``config``, or None if no auto class takes it.

    ``by_name``: for a sub-model that no auto class maps (4.57 registers no class for
    Qwen-Omni's thinker config), fall back to transformers' naming convention,
    ``XConfig`` -> ``XForConditionalGeneration`` / ``XForCausalLM``.
    """
    import transformers

    for name in _HEADS_IN_ORDER:
        auto = getattr(transformers, name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is None:
            continue
        try:
            if type(config) not in mapping:
                continue
            classes = mapping[type(config)]
        except Exception:  # a mapping entry whose module cannot be imported
            continue
        cls = classes[0] if isinstance(classes, list | tuple) else classes
        return name, cls
    base = type(config).__name__.removesuffix("Config")
    for name, suffix in _HEAD_SUFFIXES.items() if by_name else ():
        cls = getattr(transformers, base + suffix, None)
        if isinstance(cls, type) and getattr(cls, "config_class", None) is type(config):
            return name, cls
    return None


def trained_config(config):
    """The config of the part a user trains: the model itself, or the one sub-model with a
    text head when the model has none (Qwen-Omni: the thinker, not the talker/vocoder)."""
    found = model_class(config)
    if found is not None and found[0] in _TRAINED_HEADS:
        return config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        sub_found = model_class(sub, by_name=True) if hasattr(sub, "to_dict") else None
        if sub_found is not None and sub_found[0] in _TRAINED_HEADS:
            return sub
    return config


# A field this large in a shrunk config may be a size the rules missed: the model is then
# sized on the meta device before it is built (which costs as much as building it).
_LARGE = 1024
_SIZE_LIKE = ("size", "dim", "hidden", "vocab", "channels", "embed", "expert", "position", "inner", "rank")


def _large_field(config) -> bool:
    for cfg in _configs(config):
        for name, value in vars(cfg).items():
            values = value if isinstance(value, list | tuple) else (value,)  # ResNet's hidden_sizes
            if any(_int(v) and v > _LARGE for v in values) and any(word in name for word in _SIZE_LIKE):
                return True
    return False


def _count_meta(cls, config) -> int:
    with torch.device("meta"):
        return _elements(cls._from_config(config))


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random model of ``model_type`` in ``dtype``, initialised from ``seed``, in train mode."""
    config = tiny_config(model_type, **overrides)
    trained = trained_config(config)
    return model_from_config(trained, dtype, seed, by_name=trained is not config)


def model_from_config(config, dtype: torch.dtype = torch.float32, seed: int = 0, by_name: bool = False):
    """The model of ``config`` with its head (see model_class), in ``dtype``, in train mode."""
    found = model_class(config, by_name)
    if found is None:
        raise TinyModelError(f"{config.model_type}: no auto model class takes {type(config).__name__}")
    _auto, cls = found
    with _quiet():
        # Sized on the meta device first when a field is suspiciously large; checked after the
        # build in any case, so that "tiny" always means at most MAX_ELEMENTS.
        _refuse_large(config, _count_meta(cls, config) if _large_field(config) else 0)
        torch.manual_seed(seed)
        model = cls._from_config(config)
        _refuse_large(config, _elements(model))
    return _keep_in_fp32(model.to(dtype), dtype).train()


def _elements(model) -> int:
    return sum(t.numel() for t in model.parameters()) + sum(t.numel() for t in model.buffers())


def _refuse_large(config, elements: int) -> None:
    if elements > MAX_ELEMENTS:
        raise TinyModelError(
            f"{config.model_type}: {elements / 1e6:.0f}M elements after shrinking (limit "
            f"{MAX_ELEMENTS / 1e6:.0f}M): a size field was not recognised"
        )


def _keep_in_fp32(model, dtype):
    """Put back in fp32 the modules from_pretrained keeps there: ``_keep_in_fp32_modules_strict``
    in bf16 and fp16 (an MoE router's gate, DeepSeek's score correction bias), and also
    ``_keep_in_fp32_modules`` in fp16. A bf16 model otherwise differs from what users train,
    and some fail (4.57's ERNIE-4.5-MoE runs its router on fp32 inputs)."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in _HALF else set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not names:
        return model
    pattern = re.compile("|".join(rf"((^|\.){re.escape(name)}($|\.))" for name in sorted(names)))
    for name, param in list(model.named_parameters()) + list(model.named_buffers()):
        if pattern.search(name) and param.is_floating_point():
            param.data = param.data.float()
    return model


_HALF = (torch.bfloat16, torch.float16)


# --- the inputs ---------------------------------------------------------------------------

BATCH, TEXT_TOKENS = 2, 8
_IMAGE_GRID = (1, 4, 4)  # temporal, height, width patches of each image (Qwen-style towers)


def _special_ids(config) -> set:
    ids = set()
    for cfg in _configs(config):
        for name, value in vars(cfg).items():
            if _token_field(name):
                for v in value if isinstance(value, list | tuple) else (value,):
                    if _int(v) and v >= 0:
                        ids.add(v)
    return ids


def _configs(config):
    yield config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            yield from _configs(sub)


def _find(config, *names):
    """The first of ``names`` set on the config or its sub-configs (parents first)."""
    for cfg in _configs(config):
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return None


def vocab_size(config) -> int:
    """The text vocabulary of a (tiny) model's config: what its logits range over."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None) or TEXT["vocab"]


def _accepts(model) -> set:
    return set(inspect.signature(model.forward).parameters)


def _qwen_image(vision, dtype, gen, grid=_IMAGE_GRID):
    """Flattened patches and grid of one image per sample, for towers that take image_grid_thw."""
    patch = getattr(vision, "patch_size", 14)
    temporal = getattr(vision, "temporal_patch_size", 2) or 1
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    patches = math.prod(grid)
    pixels = torch.randn(BATCH * patches, channels * temporal * patch * patch, generator=gen).to(dtype)
    return pixels, torch.tensor([grid] * BATCH)


def _square_image(vision, dtype, gen):
    size = getattr(vision, "image_size", 32)
    size = size if _int(size) else size[0]
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", 3)
    return torch.randn(BATCH, channels, size, size, generator=gen).to(dtype)


def _audio(audio, dtype, gen):
    """Mel features [B, mels, frames] and their mask; Whisper-style encoders want exactly
    2 * max_source_positions frames."""
    mels = getattr(audio, "num_mel_bins", None) or getattr(audio, "feature_size", None) or 80
    frames = 32
    if not getattr(audio, "n_window", None) and _int(getattr(audio, "max_source_positions", None)):
        frames = 2 * audio.max_source_positions
    features = torch.randn(BATCH, mels, frames, generator=gen).to(dtype)
    return features, torch.ones(BATCH, frames, dtype=torch.long)


def _count(features) -> int:
    """Rows of tower output: a tensor, a tuple of per-item tensors, or a model output."""
    if hasattr(features, "pooler_output") and features.pooler_output is not None:
        features = features.pooler_output
    elif hasattr(features, "last_hidden_state"):
        features = features.last_hidden_state
    if isinstance(features, tuple) and len(features) == 2 and isinstance(features[1], list | tuple):
        return _count(features[0])  # 4.x Qwen3-VL/Omni: (embeddings, deepstack features per layer)
    if isinstance(features, list | tuple):
        return sum(_count(f) for f in features)
    if isinstance(features, torch.Tensor):
        return features.shape[0] * features.shape[1] if features.dim() == 3 else features.shape[0]
    raise TinyModelError(f"cannot count tower output of type {type(features).__name__}")


def _image(config, accepted, dtype, gen, sizes=False) -> dict:
    """One image per sample in the layout the model takes: flattened patches with their grid
    (Qwen-style towers), else a square image (with its size when ``sizes``: Mistral3 needs it,
    LLaVA must not get it with a CLIP tower)."""
    vision = getattr(config, "vision_config", None) or config
    grid_name = next((n for n in ("image_grid_thw", "grid_thw") if n in accepted), None)
    if grid_name is not None:
        pixels, grid = _qwen_image(vision, dtype, gen)
        return {"pixel_values": pixels, grid_name: grid}
    pixels = _square_image(vision, dtype, gen)
    inputs = {"pixel_values": pixels}
    if sizes:
        inputs["image_sizes"] = torch.tensor([list(pixels.shape[-2:])] * BATCH)
    return inputs


def _modal_inputs(model, dtype, gen) -> dict:
    """{modality: forward inputs} of one image and one audio clip per sample, for the towers present."""
    config = model.config
    accepted = _accepts(model)
    modal = {}
    if getattr(config, "vision_config", None) is not None and "pixel_values" in accepted:
        modal["image"] = _image(config, accepted, dtype, gen, sizes=_requires(model, "image", "image_sizes"))
    audio = getattr(config, "audio_config", None)
    if audio is not None and "input_features" in accepted:
        features, mask = _audio(audio, dtype, gen)
        modal["audio"] = {"input_features": features}
        if "feature_attention_mask" in accepted:
            modal["audio"]["feature_attention_mask"] = mask
    return modal


def _features_getter(model, modality):
    """The model's ``get_<modality>_features`` (on it or its inner ``model``), or None."""
    owner = model
    while owner is not None:
        getter = getattr(owner, f"get_{modality}_features", None)
        if getter is not None:
            return getter
        owner = getattr(owner, "model", None)
    return None


def _requires(model, modality, name) -> bool:
    """Whether the tower's feature getter has a parameter ``name`` without a default."""
    getter = _features_getter(model, modality)
    if getter is None:
        return False
    parameter = inspect.signature(getter).parameters.get(name)
    return parameter is not None and parameter.default is parameter.empty


def _tower_tokens(model, modality, inputs) -> int:
    """How many placeholder tokens the tower's features fill, per sample (the tower is run once)."""
    getter = _features_getter(model, modality)
    if getter is None:
        raise TinyModelError(
            f"{model.config.model_type}: no get_{modality}_features to size its placeholders"
        )
    params = inspect.signature(getter).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    with torch.no_grad():
        features = getter(**{k: v for k, v in inputs.items() if k in params or takes_all})
    total = _count(features)
    if total % BATCH:
        raise TinyModelError(f"{model.config.model_type}: {total} {modality} features for {BATCH} samples")
    return total // BATCH


_PLACEHOLDER = {
    "image": ("image_token_id", "image_token_index"),
    "audio": ("audio_token_id", "audio_token_index"),
}
_BOUNDS = {
    "image": (
        ("vision_start_token_id", "image_start_token_id"),
        ("vision_end_token_id", "image_end_token_id"),
    ),
    "audio": (("audio_start_token_id", "audio_bos_token_id"), ("audio_end_token_id", "audio_eos_token_id")),
}


def _tower_only_inputs(model, dtype, gen) -> dict:
    """Inputs of a model without text input (a vision or audio encoder on its own): its
    required forward parameters, filled by name."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    accepted = set(params)
    required = [n for n, p in params.items() if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    main = getattr(model, "main_input_name", None)
    wanted = set(required) | ({main} if main in accepted else set())
    inputs = {}
    if wanted & {"pixel_values", "hidden_states"}:
        image = _image(config, accepted, dtype, gen)
        if "hidden_states" in wanted and "pixel_values" not in accepted:
            image["hidden_states"] = image.pop("pixel_values")  # Qwen-style towers: patches in
        inputs.update(image)
    if "input_features" in wanted:
        features, mask = _audio(config, dtype, gen)
        inputs["input_features"] = features
        for name in ("attention_mask", "feature_attention_mask"):
            if name in accepted and getattr(config, "n_window", None):
                inputs[name] = mask
    if "input_values" in wanted:
        inputs["input_values"] = torch.randn(BATCH, 4000, generator=gen).to(dtype)
    missing = sorted(set(required) - set(inputs))
    if missing:
        raise TinyModelError(f"{config.model_type}: no tiny input for {', '.join(missing)}")
    return inputs


def model_inputs(model, seed: int = 1) -> tuple[dict, torch.Tensor]:
    """(forward kwargs, labels) of two samples for this tiny model.

    Each sample is text, with one image and one audio clip (each between its start and end
    tokens) for the towers the model has; text tokens are drawn below the special tokens;
    labels are random text tokens. A model without text input gets its tower's inputs.
    """
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    dtype = next(model.parameters()).dtype
    accepted = _accepts(model)
    if "input_ids" not in accepted:
        inputs = _tower_only_inputs(model, dtype, gen)
        return inputs, torch.zeros(BATCH, dtype=torch.long)
    vocab = vocab_size(config)
    low = min([vocab, *(_special_ids(config))])
    if low < 4:
        raise TinyModelError(f"{config.model_type}: no room for text tokens below the special ids")
    pieces, inputs = [], {}
    for modality, modal in _modal_inputs(model, dtype, gen).items():
        placeholder = _find(config, *_PLACEHOLDER[modality])
        if placeholder is None:
            continue
        count = _tower_tokens(model, modality, modal)
        start = _find(config, *_BOUNDS[modality][0])
        end = _find(config, *_BOUNDS[modality][1])
        tokens = [start] * (start is not None) + [placeholder] * count + [end] * (end is not None)
        pieces.append(torch.tensor([tokens] * BATCH))
        inputs.update(modal)
    text = torch.randint(1, low, (BATCH, TEXT_TOKENS), generator=gen)
    input_ids = torch.cat([text[:, :2], *pieces, text[:, 2:]], dim=1)
    inputs["input_ids"] = input_ids
    if "mm_token_type_ids" in accepted and "pixel_values" in inputs:
        inputs["mm_token_type_ids"] = (input_ids == _find(config, *_PLACEHOLDER["image"])).long()
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in accepted:
        inputs["decoder_input_ids"] = torch.randint(1, low, (BATCH, TEXT_TOKENS), generator=gen)
    labels = torch.randint(1, low, inputs.get("decoder_input_ids", input_ids).shape, generator=gen)
    return inputs, labels


def model_batch(model, seed: int = 1):
    """(input_ids, labels, other inputs): the shape of ``testing.parity.model_batch``; input_ids is
    None for a model without text input (a tower on its own)."""
    inputs, labels = model_inputs(model, seed)
    return inputs.pop("input_ids", None), labels, inputs
