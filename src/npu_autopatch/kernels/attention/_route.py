"""transformers' default attention on the NPU: the flash-attention path (issue 27), decided per model
and per call.

Per model, ``get_correct_attn_implementation`` turns transformers' default into FA2 where the model's
class, its containers and the table allow it (``_why_not_routed``). Per call, the ``flash_attention_2``
slots of transformers' attention and mask registries and ``prepare_inputs_for_generation`` send what
the flash path cannot take to stock's sdpa: a 4-D mask, a compiled call with a padding mask or a cache
beside its query, an exported call, a compileable cache's masks (``_build_route``, installed by
``_install_route``).
"""

import inspect
import logging
import sys
import threading

import torch

from .._calls import counters
from .._probe import signature_reason
from . import _fused
from ._choices import (
    _ROUTED,
    _ROUTINE,
    CHOICES,
    CHOSEN,
    DROPS_BIDIRECTIONAL,
    INSIDE_NO_FA2,
    KERNEL_OFF,
    KNOWN_FAILURE,
    LEFT_STOCK,
    MASK_4D,
    NO_FA2,
    NOT_NPU,
    NOT_SELECTED,
    NOT_TRANSFORMERS,
    _portable,
)
from ._integration import _INTEGRATION

_GET_CORRECT = ("self", "requested_attention", "is_init_check")
# Model types (modeling module's package) whose transformers FA2 code raises or computes wrong where
# its sdpa does not, on a transformers major ("4" or "5"; "*" both): they keep the default, with why.
# Found by the whole-table parity test (tests/test_default_attention.py), not by the kernel.
_FA2_FAILS = {
    "glm4v_moe": (
        "*",
        "transformers' FA2 path reads its 3-row mRoPE position_ids as packed sequences at batch size 1 "
        "(sequence lengths for 3x the tokens): the device refuses them",
    ),
    "qwen2_moe": ("4", "4.57 refuses right padding with flash_attention_2 (a ValueError)"),
    "deepseek_v2": ("4", "4.57's FA2 path mixes packed sequences"),
    "granitemoe": ("4", "4.57's FA2 path mixes packed sequences"),
}


def _model_type(cls) -> str | None:
    """The model type of a class of transformers' own modeling modules (``transformers.models.<type>.``)."""
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def _fa2_fails(model_type) -> str | None:
    on, why = _FA2_FAILS.get(model_type, (None, None))
    return why if on in ("*", _major()) else None


def _flash_functions_ours() -> str | None:
    """None when transformers' Ascend flash-attention functions are this kernel's, else why not.

    Imported here if transformers has not yet (an FA2 model would import it at once): our import
    hook patches it as it loads, under the package lock, which this code does not hold.
    """
    import importlib

    try:
        module = importlib.import_module(_INTEGRATION)
    except Exception as exc:  # a model's __init__ must not fail because of us: it keeps stock's choice
        return f"{KERNEL_OFF} ({_INTEGRATION} did not import: {type(exc).__name__}: {exc})"
    functions = (module.npu_flash_attn_func, module.npu_flash_attn_varlen_func)
    if all(getattr(f, "__module__", None) == _fused.__name__ for f in functions):
        return None
    record = sys.modules["npu_autopatch"].status().get("npu_flash_attention")
    state = f"{record.state.value}: {record.reason}" if record is not None else "not in the registry"
    return f"{KERNEL_OFF} ({state})"


# Classes 4.57 lets run FA2 although FA2 drops the bidirectional part of their mask (the image tokens,
# PaliGemma's prompt prefix): transformers 5 marks the same classes ``_supports_flash_attn = False``
# ("Flash Attention drops the bidirectional mask over image tokens"); the route reads 4.57 as 5 does.
_DROPS_BIDIRECTIONAL_4 = frozenset(
    {
        "Gemma3Model", "Gemma3ForConditionalGeneration", "Gemma3ForSequenceClassification",
        "PaliGemmaModel", "PaliGemmaForConditionalGeneration",
    }
)  # fmt: skip


def _fa2_refusal(cls) -> str | None:
    """Why a class is not to run FA2 (transformers' own test: 5.x ``_supports_flash_attn``, 4.57
    ``_supports_flash_attn_2``; and 4.57's classes whose mask FA2 cannot hold), or None."""
    if not (getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False)):
        return NO_FA2
    if _major() == "4" and cls.__name__ in _DROPS_BIDIRECTIONAL_4:
        return DROPS_BIDIRECTIONAL
    return None


def _major() -> str:
    return sys.modules["transformers"].__version__.split(".", 1)[0]


def _containers(model) -> list:
    """The models whose ``__init__`` is building ``model``, innermost first: an inner base model is built
    by its task model, a vision-language model's towers by the wrapper (from the Python stack: asked
    only while a model is built). Empty for a model built on its own."""
    base = sys.modules["transformers.modeling_utils"].PreTrainedModel
    found, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, base) and all(owner is not f for f in found):
                found.append(owner)
        frame = frame.f_back
    return found


def _why_not_routed(model, requested, npu_available, containers) -> str | None:
    """None when ``model``'s default attention goes to the flash-attention path, else the reason."""
    if requested is not None:
        return CHOSEN
    if not npu_available():
        return NOT_NPU
    cls = type(model)
    refusal = _fa2_refusal(cls)
    if refusal is not None:
        return refusal
    if any(_fa2_refusal(type(container)) for container in containers):
        # a wrapper that refuses FA2 (Gemma 3's and PaliGemma's vision-language classes: their mask is
        # bidirectional over the image tokens or the prefix, which FA2 drops) keeps its towers on it too
        return INSIDE_NO_FA2
    model_type = _model_type(cls)
    if model_type is None:
        return NOT_TRANSFORMERS  # remote code may call the flash-attn package itself
    record = sys.modules["npu_autopatch"].status().get(model_type)
    code = record.code.value if record is not None and record.code is not None else None
    if code in ("excluded", "not-selected"):
        return NOT_SELECTED  # NPU_AUTOPATCH_EXCLUDE, or models= without it: stock, the attention too
    if record is not None and record.state.value == "failed":
        return LEFT_STOCK  # all or nothing: a model whose patch failed runs stock, its attention too
    if _fa2_fails(model_type):
        return KNOWN_FAILURE
    return _flash_functions_ours()


def _build_route(stock, npu, on_error):
    """transformers' default attention (``attn_implementation`` not given): the flash-attention path.

    ``get_correct_attn_implementation(requested)`` turns ``None`` into ``"sdpa"`` (else ``"eager"``)
    for every model, on every device; on the NPU, sdpa with a mask computes every score of a padded,
    packed or windowed batch (docs/attention.md). Here ``None`` becomes ``"flash_attention_2"`` for a
    model of transformers whose class supports it while this kernel's flash functions are in place:
    padded batches unpadded, packed documents apart, windows in band mode. Anything the user named
    (sdpa, eager, a hub kernel) goes to stock untouched. transformers' own checks for FA2 are not
    run for the route: on the NPU they only warn about dtypes the op takes (fp32) and devices the
    model is not on yet, which a user who chose nothing should not read.

    One decision per model built, counted once: the models its ``__init__`` builds (an inner base model
    on the same config, a vision-language model's towers on its sub-configs) follow it, uncounted, and
    a model inside one that refuses FA2 keeps stock's choice. What the flash path cannot take is
    decided per call, by the replacement's ``per_call`` functions (``_install_route``).
    """
    from transformers.utils import is_torch_npu_available

    count_routed, count_stock = counters(on_error, routine=_ROUTINE)

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False, *args, **kwargs):
        config = getattr(self, "config", None)
        decision = CHOICES.of(config)
        if requested_attention == _ROUTED and decision is not None and decision[0]:
            return _ROUTED  # transformers checking again what the route chose: not a new decision
        stock_choice = stock(self, requested_attention, is_init_check, *args, **kwargs)
        containers = _containers(self)
        if decision is not None and requested_attention == decision[2]:
            decider = CHOICES.decided_by(config)
            if decider is self or any(decider is container for container in containers):
                return stock_choice  # the choice written by this build's decision, read back
        why = _why_not_routed(self, requested_attention, is_torch_npu_available, containers)
        if config is not None:
            CHOICES.note(config, why is None, why, stock_choice, self)
        if why is None:
            _portable((type(config),), on=True)
        if not containers:  # the model being built, not one its __init__ builds: counted once
            if why is None:
                count_routed()
            else:
                count_stock(why.split(" (", 1)[0])
        return _ROUTED if why is None else stock_choice

    def attention(flash):
        """The registry's ``flash_attention_2`` function (``flash``), deciding per call for the models
        the route chose it for: what the flash path cannot take runs stock's sdpa, as transformers'
        default would have; an explicit FA2 model's calls go to ``flash`` untouched."""

        def flash_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
            if not _routed_config(getattr(module, "config", None)):
                return flash(module, query, key, value, attention_mask, *args, **kwargs)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
                # a custom mask (packed documents, a tree, a prefix) or transformers' compiled sdpa
                # mask: only sdpa reads it, FA2 would index it as a padding mask
                if not torch.compiler.is_compiling():
                    count_stock(MASK_4D, query)
                return _registry_function("sdpa")(module, query, key, value, attention_mask, *args, **kwargs)
            stock_masks = torch.compiler.is_compiling() and (
                torch.compiler.is_exporting() or key.shape[2] != query.shape[2]
            )
            if stock_masks and attention_mask is None:
                # exported, or compiled with keys of a cache beside the query: the masks were stock's
                # (``mask``), which leaves this call to sdpa's own causal flag
                return _registry_function("sdpa")(module, query, key, value, None, *args, **kwargs)
            _CALL.routed = True  # compiled too: dynamo replays it before the graph break at the message
            try:
                return flash(module, query, key, value, attention_mask, *args, **kwargs)
            finally:
                _CALL.routed = False

        return flash_attention_forward

    def mask(flash_mask):
        """The mask registry's ``flash_attention_2`` function (``flash_mask``): for a routed model, stock's
        sdpa mask where the compiled forward is then stock's (a call under ``torch.compile`` that
        carries a padding mask or a cache beside its query: no host copies, no data-dependent
        unpadding) and for a compileable cache's masks; otherwise ``flash_mask``. A compiled call with
        neither (a packed batch, its documents told apart by position_ids alone, or an unpadded one)
        takes the flash path as it does uncompiled: stock's mask would drop the documents' bounds
        wherever a cache is in use, and skip what replaces ``_flash_attention_forward`` (verl's Ulysses).
        ``torch.export`` keeps stock's masks: FA2's packed-sequence test reads the position_ids, which
        an exported graph cannot guard on (stock's exported mask keeps the documents apart itself)."""

        def flash_attention_mask(*args, config=None, **kwargs):
            traced = torch.compiler.is_compiling()
            compiled = traced and (torch.compiler.is_exporting() or not _unmasked_prefill(args, kwargs))
            if (compiled or _CALL.compileable_cache) and config is not None and _routed_config(config):
                return _mask_function("sdpa")(*args, config=config, **kwargs)
            return flash_mask(*args, config=config, **kwargs)

        return flash_attention_mask

    def generation_inputs(prepare):
        """``GenerationMixin.prepare_inputs_for_generation`` (``prepare``): for a routed model with a
        compileable cache, the masks it builds are stock's sdpa masks (``_Call.compileable_cache``)."""
        names = list(inspect.signature(prepare).parameters)
        index = next((names.index(name) for name in ("cache", "past_key_values") if name in names), None)

        def prepare_inputs_for_generation(self, *args, **kwargs):
            cache = None
            if index is not None:
                cache = kwargs.get(names[index]) if len(args) < index else args[index - 1]
            routed = _routed_config(getattr(self, "config", None))
            if not routed or not getattr(cache, "is_compileable", False):
                return prepare(self, *args, **kwargs)
            _CALL.compileable_cache = True
            try:
                return prepare(self, *args, **kwargs)
            finally:
                _CALL.compileable_cache = False

        return prepare_inputs_for_generation

    get_correct_attn_implementation.per_call = {
        "attention": attention,
        "mask": mask,
        "generation": generation_inputs,
    }
    return get_correct_attn_implementation


class _Call(threading.local):
    """What the route's per-call functions need to know of the call in progress, per thread.

    ``routed``: a routed call is running transformers' FA2 code, which prints "Casting fp32 inputs back
    to torch.float32 for flash-attn compatibility" once for an fp32 model (a cast to the dtype it has):
    a user who chose nothing never chose FA2, and stock sdpa prints nothing, so the filter on that
    logger drops the line meanwhile (it is inert otherwise; transformers' ``warning_once`` then
    remembers the line as printed, and an explicit FA2 model in the same process does not print it
    either). ``compileable_cache``: ``generate`` is building the masks of a static (compileable) cache,
    transformers' path to a compiled decode (5.x compiles it on its own): for a routed model they are
    stock's sdpa masks, so its forward runs as stock's, compiled or not.
    """

    routed = False
    compileable_cache = False

    def filter(self, record) -> bool:
        return not (self.routed and record.getMessage().startswith("Casting fp32 inputs back"))


_CALL = _Call()


def _routed_config(config) -> bool:
    """Whether the route chose FA2 for this config (a dict lookup: dynamo traces it as a constant)."""
    decision = CHOICES.of(config)
    return decision is not None and decision[0]


def _unmasked_prefill(args, kwargs) -> bool:
    """Whether a mask function's call (keywords, as transformers passes them) is for a batch with no
    padding mask whose keys are its own tokens, no cache beside them (4.57 gives the query's length
    as ``cache_position``, 5.x as ``q_length``). False when that cannot be read: stock's masks then."""
    if args or kwargs.get("attention_mask") is not None or "kv_length" not in kwargs:
        return False
    if "q_length" in kwargs:
        return kwargs["q_length"] == kwargs["kv_length"]
    positions = kwargs.get("cache_position")
    return isinstance(positions, torch.Tensor) and positions.shape[0] == kwargs["kv_length"]


def _registry_function(name):
    """transformers' attention function of that name now (a user's registration included)."""
    return sys.modules["transformers.modeling_utils"].AttentionInterface._global_mapping[name]


def _mask_function(name):
    """transformers' mask function of that name now."""
    return sys.modules["transformers.masking_utils"].AttentionMaskInterface._global_mapping[name]


def _install_route(target, build, slot):
    """The route's ledger entries: the method that decides per model, and the two registry entries of
    ``flash_attention_2`` (attention and mask functions) that decide per call for the routed models
    (``_build_route``). All or none; ``disable()`` puts back what each held."""
    import importlib

    route = build(target.stock)
    logging.getLogger("transformers.modeling_flash_attention_utils").addFilter(_CALL)  # once: a set
    entries = [
        slot(target.owner, target.attr, target.current, route, target.had_own, target.where, path=target.path)
    ]
    registries = (
        ("transformers.modeling_utils", "AttentionInterface", "ALL_ATTENTION_FUNCTIONS", "attention"),
        ("transformers.masking_utils", "AttentionMaskInterface", "ALL_MASK_ATTENTION_FUNCTIONS", "mask"),
    )
    for module, interface, shown, kind in registries:
        registry = getattr(importlib.import_module(module), interface)._global_mapping
        current = registry.get(_ROUTED)
        if current is None:
            continue
        where = f"{shown}[{_ROUTED!r}]"
        entries.append(
            slot(registry, _ROUTED, current, route.per_call[kind](current), True, where, plumbing=True)
        )
    mixin = importlib.import_module("transformers.generation.utils").GenerationMixin
    prepare = mixin.__dict__.get("prepare_inputs_for_generation")
    if prepare is not None:
        where = "transformers.generation.utils:GenerationMixin.prepare_inputs_for_generation"
        wrapped = route.per_call["generation"](prepare)
        name = "prepare_inputs_for_generation"
        entries.append(slot(mixin, name, prepare, wrapped, True, where, plumbing=True))
    return entries


def _probe_route(stock, candidate):
    """The stock method must be transformers' default-picking one: ``(requested_attention,
    is_init_check)``, turning ``None`` into ``"sdpa"`` (read in its constants)."""
    wrong = signature_reason(stock, _GET_CORRECT)
    if wrong:
        return wrong
    code = getattr(stock, "__code__", None)
    if code is None or "sdpa" not in code.co_consts:
        return "the stock method does not pick sdpa for a model that asks for nothing"
    return None


def _refresh_routed():
    """After the route is swapped in or out: the configs it routed follow (FA2 while it is in place,
    stock's default after disable() or with the switch off), unless their implementation was changed
    since (``set_attn_implementation``: the user's choice, left alone)."""
    utils = sys.modules.get("transformers.modeling_utils")
    method = getattr(getattr(utils, "PreTrainedModel", None), "get_correct_attn_implementation", None)
    routing = getattr(method, "__module__", None) == __name__
    routed = CHOICES.routed()
    for config, stock_choice in routed:
        now, then = (stock_choice, _ROUTED) if routing else (_ROUTED, stock_choice)
        if config._attn_implementation_internal == now:
            config._attn_implementation_internal = then
    _portable({type(config) for config, _choice in routed}, on=routing)
