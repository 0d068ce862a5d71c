"""Gated DeltaNet (linear attention) layers with packed sequences kept apart.

Without ``fla`` (always the case on an Ascend NPU on 4.57, and whenever it is not installed on
5.x), the linear-attention layers of Qwen3.5, Qwen3.5-MoE and Qwen3-Next run transformers'
torch fallback, which knows nothing of packing: the recurrent state and the conv window of one
document flow into the next (position_ids restarting at 0), or it raises ``ValueError`` when the
caller passes ``cu_seq_lens_q``. The layer's token mixer never sees ``position_ids`` (and on
4.57 no keyword argument at all), so the target is the one place that does: the decoder
layer's ``forward``.

The replacement finds the documents of a call (``document_starts``): from ``cu_seq_lens_q``
when the caller passes them, else from ``position_ids`` restarting at their minimum in a batch
of one row, the rule of transformers' flash-attention path (``_is_packed_sequence``,
``prepare_fa_kwargs_from_position_ids``). It then lays each document out as its own batch row,
right-padded to the longest, runs the stock token mixer (``self.linear_attn``) once on those
rows and gathers the tokens back. The mixer is causal, so the padding after a document never
reaches it, and each row starts from a zero state and an empty conv window: exactly what the
documents give when run one by one, with no loop over documents or tokens, and with the stock
chunked scan running over the longest document instead of the whole packed row. The norms and
the MLP are per token and run on the packed row, as stock runs them.

Everything else is the stock layer, unchanged: a full-attention layer, a call without packing
(one document per row, with or without padding; decode, one token per row), a positional call,
a call being compiled (the documents are found from tensor values, which a graph cannot hold).
A packed call with a cache (5.x creates one whenever ``use_cache`` is on, as in a trainer's
forward) keeps the documents apart too and leaves the layer's cache entry as it was: a packed
row has no one state to continue from. The layer replacement calls no torch_npu op, so it
never reports an ``on_error``.

Two targets, one kernel, a variant each (status() names the one each target runs):

- ``chunk-scan`` replaces the module's ``torch_chunk_gated_delta_rule`` (every prompt and
  training row, packed or not) with ``gated_delta_scan``: the same math with the loop over
  64-token chunks replaced by a log2(chunks)-level associative scan (8k tokens: 11x fewer ops
  per layer, forward + backward; benchmarks/linear_attention.py). 4.x binds the function to
  each mixer at init: a mixer built before enable() adopts the scan at its layer's first call;
  once disable() (or on_error) put stock back, the scan a mixer holds calls stock. A call with
  ``cu_seqlens`` gets stock's answer. If the scan raises on the device (``solve_triangular``
  on an NPU is unsourced), that call runs stock and ``on_error`` takes the scan out.
- ``fla``, tried first: when an fla with an Ascend backend (>= 0.5.2, ``FLA_ASCEND_SINCE``) is
  installed, the same target calls ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, probed
  against transformers' torch function (the shipped verdicts were made without fla: with one
  installed the targets are probed live). The probe runs on the CPU: an fla whose kernels only
  run on the device is refused as unverified and the chunk scan runs (the fla path is exercised
  through the stand-in in ``testing/fla_stand_in``). If fla raises in a call, that call gets
  the chunk scan and ``on_error`` puts the stock function back (on 5.x, transformers' wrapper,
  which calls fla itself).
- ``decoder-layer`` replaces the layer's forward to keep packed documents apart (below).

The probe runs the stock layer with a stand-in causal mixer that does leak across documents
(a running sum and a one-token shift, as the conv window and the state would) and checks
that the candidate gives stock's own result unpacked, and, packed, what stock gives for each
document alone, with boundaries from ``position_ids`` and from ``cu_seq_lens_q``.
"""

import sys

import torch

from .._types import Kernel, Pattern, Variant
from ._calls import counters
from ._probe import (
    agree_strict,
    first_disagreement,
    generator,
    instance,
    linear,
    parameters,
    randn,
)
from .gated_delta_scan import chunk_gated_delta_rule

# The module function every Gated DeltaNet mixer calls for a prompt or a training row (4.x binds
# it to each mixer at init as ``chunk_gated_delta_rule``).
CHUNK_FUNCTION = "torch_chunk_gated_delta_rule"


def document_starts(
    tokens: int, position_ids: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None
) -> torch.Tensor | None:
    """The index of each document's first token among the ``tokens`` flattened tokens, or None.

    None means one document per row: the stock layer is right as it is.
    """
    if cu_seq_lens_q is not None:
        ends = cu_seq_lens_q.flatten().to(torch.long)
        # A first token not listed, or tokens after the last end, still make a document each.
        return torch.cat((ends.new_zeros(1), ends[(ends > 0) & (ends < tokens)])).unique()
    if position_ids is None or position_ids.ndim != 2 or position_ids.shape[0] != 1 or tokens < 2:
        return None
    positions = position_ids[0]
    restarts = positions == positions.min()
    restarts[0] = True  # a row that begins mid-document still begins a document here
    starts = restarts.nonzero().flatten()
    return starts if starts.numel() > 1 else None


def _rows(starts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, valid): token index of each (document, offset) slot, and whether the slot is real."""
    lengths = torch.diff(starts, append=starts.new_full((1,), tokens))
    offsets = torch.arange(int(lengths.max()), device=starts.device)
    valid = offsets < lengths[:, None]
    index = torch.where(valid, starts[:, None] + offsets, 0)  # right padding repeats token 0: never read
    return index, valid


def mix_documents(
    mixer: torch.nn.Module,
    hidden_states: torch.Tensor,
    starts: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """``mixer`` run on each document alone, the documents side by side as batch rows."""
    batch, length, width = hidden_states.shape
    index, valid = _rows(starts, batch * length)
    rows = hidden_states.reshape(batch * length, width)[index]
    row_mask = None if attention_mask is None else attention_mask.reshape(-1)[index] * valid
    mixed = mixer(hidden_states=rows, attention_mask=row_mask)
    return mixed[valid].reshape(batch, length, -1)


# A call of a replacement no longer installed (disable() or on_error put stock back), reaching it
# through a 4.x mixer that keeps the function it was bound to.
_RETIRED = "taken out"


def _is_chunk_rule(stock) -> bool:
    return "chunk_size" in (parameters(stock) or ())


# The first fla release with an Ascend (triton_ascend) backend for the gated delta rule
# (fla/ops/gated_delta_rule/backends/triton_ascend/; /work/shared/reference/next_kernels.md).
FLA_ASCEND_SINCE = (0, 5, 2)


def _fla_rule():
    """fla's chunk_gated_delta_rule when an fla with an Ascend backend is installed, else why not."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        return None, "fla is not installed"
    import fla

    version = getattr(fla, "__version__", "0")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    if parts < FLA_ASCEND_SINCE:
        return None, f"fla {version} has no Ascend backend (first in {'.'.join(map(str, FLA_ASCEND_SINCE))})"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as rule

    return rule, None


def _retired(replacement, home) -> bool:
    """Whether ``replacement`` was patched in (the patcher sets ``__wrapped__``; a probe's
    candidate has none) and its module holds something else now: disable() or on_error put
    stock back, but a 4.x mixer keeps the function it was bound to."""
    return "__wrapped__" in replacement.__dict__ and getattr(home, CHUNK_FUNCTION, None) is not replacement


def _build_fla(stock, npu, on_error):
    """fla's kernel (its Ascend backend on an NPU); if it raises, the chunk scan for that call."""
    rule, _ = _fla_rule()
    scan = _build_chunk_scan(stock, npu, on_error, counted=False)
    home = sys.modules.get(stock.__module__)
    count_fused, count_stock = counters(on_error)

    def torch_chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        # What stock and the chunk scan are called with, in their order (fla's call takes its own).
        args = (
            query,
            key,
            value,
            g,
            beta,
            chunk_size,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
        )
        if _retired(torch_chunk_gated_delta_rule, home):
            count_stock(_RETIRED, query)
            return stock(*args)
        try:
            out = rule(
                query,
                key,
                value,
                g,
                beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=kwargs.get("cu_seqlens"),
            )
        except Exception as exc:
            on_error(exc, query, key, value)
            return scan(*args)
        count_fused()
        return out

    return torch_chunk_gated_delta_rule


def _probe_fla(stock, candidate):
    if not _is_chunk_rule(stock):
        return "not a chunked gated delta rule (no chunk_size parameter)"
    rule, reason = _fla_rule()
    if reason is not None:
        return reason
    gen = generator()
    try:  # the probe runs on the CPU: an fla whose kernels need the device cannot be compared here
        rule(*(randn(gen, 1, 2, 1, 2) for _ in range(3)), -randn(gen, 1, 2, 1).abs(), randn(gen, 1, 2, 1))
    except Exception as exc:
        return (
            f"fla's kernel does not run on the probe's CPU tensors ({type(exc).__name__}: {exc}): unverified"
        )
    # Against transformers' torch function (5.x's decorator wraps it, and calls fla itself when installed).
    return _probe_chunk_scan(getattr(stock, "__wrapped__", stock), candidate)


def _fla_installed():
    """The shipped verdicts were probed without fla: with one installed, the targets are probed live."""
    return _fla_rule()[1] is None


def _build_chunk_scan(stock, npu, on_error, counted=True):
    """``torch_chunk_gated_delta_rule`` with the chunks scanned in log2(chunks) batched steps.

    ``counted=False``: fla's fallback, whose calls the fla replacement counts itself."""
    home = sys.modules.get(stock.__module__)
    count_fused, count_stock = counters(on_error if counted else None)

    def torch_chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        args = (query, key, value, g, beta, chunk_size, initial_state, output_final_state)
        if kwargs.get("cu_seqlens") is not None or _retired(torch_chunk_gated_delta_rule, home):
            # Stock's own answer (fla's packed kernel, else its ValueError): the decoder layer
            # never passes them, it lays the documents out as rows.
            count_stock("cu_seqlens" if kwargs.get("cu_seqlens") is not None else _RETIRED, query)
            return stock(*args, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        try:
            out = chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        except Exception as exc:  # an op the device cannot take: stock for this call, and on_error
            on_error(exc, query, key, value)
            return stock(*args, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        count_fused()
        return out

    return torch_chunk_gated_delta_rule


def _probe_chunk_scan(stock, candidate):
    if not _is_chunk_rule(stock):
        return "not a chunked gated delta rule (no chunk_size parameter)"
    gen = generator()
    batch, tokens, heads, key_dim, value_dim = 2, 11, 2, 4, 3
    query, key = randn(gen, batch, tokens, heads, key_dim), randn(gen, batch, tokens, heads, key_dim)
    value = randn(gen, batch, tokens, heads, value_dim)
    g = -randn(gen, batch, tokens, heads).abs()
    beta = randn(gen, batch, tokens, heads).sigmoid()
    state = randn(gen, batch, heads, key_dim, value_dim)

    def run(function, **kwargs):
        # Chunks of 4: 11 tokens are three chunks, the last one padded; the scan pairs chunks.
        return lambda: function(query, key, value, g=g, beta=beta, chunk_size=4, **kwargs)

    return first_disagreement(
        *(
            agree_strict(
                run(stock, output_final_state=True, **kwargs),
                run(candidate, output_final_state=True, **kwargs),
            )
            for kwargs in (
                {"use_qk_l2norm_in_kernel": True},
                {"initial_state": state, "use_qk_l2norm_in_kernel": True},
                {},
            )
        )
    )


def _build_decoder_layer(stock, npu, on_error):
    # 5.x's GradientCheckpointingLayer wraps each layer class's forward and checkpoints only when
    # that wrapper is the class's forward: the replacement is wrapped the same way, around the
    # stock layer without its wrapper, or checkpointing would silently stop.
    checkpointing_layer = _checkpointing_base(stock)
    layer = stock.__wrapped__ if checkpointing_layer is not None else stock
    # The modeling module's namespace (4.x decorates the forward: its __globals__ are the decorator's).
    namespace = vars(sys.modules[layer.__module__])
    # One unpacked sequence per row is stock's own case (nothing to keep apart): counted, not warned.
    count_fused, count_stock = counters(on_error, routine=("unpacked",))

    def forward(self, hidden_states, *args, **kwargs):
        mixer = getattr(self, "linear_attn", None)
        if mixer is None:  # a full-attention layer: not this kernel's computation, not counted
            return layer(self, hidden_states, *args, **kwargs)
        _adopt_chunk_function(mixer, namespace)
        attention_mask = kwargs.get("attention_mask")
        if (
            args
            or (attention_mask is not None and attention_mask.ndim != 2)
            or torch.compiler.is_compiling()  # finding documents reads values: no graph could hold it
        ):
            count_stock("positional arguments" if args else "mask not 2-D", hidden_states)
            return layer(self, hidden_states, *args, **kwargs)
        batch, length = hidden_states.shape[:2]
        # As in flash attention, position_ids tell documents apart only where no padding mask does.
        position_ids = kwargs.get("position_ids") if attention_mask is None else None
        starts = document_starts(batch * length, position_ids, kwargs.get("cu_seq_lens_q"))
        if starts is None:
            count_stock("unpacked", hidden_states)
            return layer(self, hidden_states, *args, **kwargs)
        residual = hidden_states
        mixed = mix_documents(mixer, self.input_layernorm(hidden_states), starts, attention_mask)
        hidden_states = residual + mixed
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        if isinstance(hidden_states, tuple):  # a 4.x sparse block returns (hidden, router_logits)
            hidden_states = hidden_states[0]
        count_fused()
        return residual + hidden_states

    if checkpointing_layer is None:
        return forward
    return type("PackedDecoderLayer", (checkpointing_layer,), {"forward": forward}).forward


def _adopt_chunk_function(mixer, namespace) -> None:
    """A 4.x mixer keeps the function it was built with (bound at init): stock's, or the one of
    an earlier enable(). It takes the module's current one, as a mixer built now would."""
    bound = mixer.__dict__.get("chunk_gated_delta_rule")
    current = namespace.get(CHUNK_FUNCTION)
    stock = getattr(current, "__wrapped__", None)
    if bound is not None and bound is not current and stock in (bound, getattr(bound, "__wrapped__", None)):
        mixer.chunk_gated_delta_rule = current  # stock's, or a replacement of an earlier enable()


def _checkpointing_base(stock):
    """5.x's GradientCheckpointingLayer when ``stock`` is the forward it wrapped, else None."""
    if getattr(getattr(stock, "__code__", None), "co_name", "") != "forward_with_checkpointing":
        return None
    base = stock.__globals__.get("GradientCheckpointingLayer")
    return base if isinstance(base, type) and hasattr(stock, "__wrapped__") else None


class _LeakyCausalMixer(torch.nn.Module):
    """A causal token mixer that carries state across a row, as the Gated DeltaNet does."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        shifted = torch.nn.functional.pad(hidden_states, (0, 0, 1, 0))[:, :-1]
        return hidden_states.cumsum(1) * 0.25 + shifted


def _probe_decoder_layer(stock, candidate):
    if _is_chunk_rule(stock):
        return "a gated delta rule function, not a decoder layer"
    gen = generator()
    width = 8
    layer = instance(
        stock,
        input_layernorm=linear(gen, width, width),
        post_attention_layernorm=linear(gen, width, width),
        mlp=linear(gen, width, width),
        linear_attn=_LeakyCausalMixer(),
        block_type="linear_attention",
        layer_type="linear_attention",
        gradient_checkpointing=False,  # 5.x's deprecate_kwarg wrapper reads it
    )
    lengths = (3, 5, 2)
    docs = [randn(gen, 1, n, width) for n in lengths]
    packed = torch.cat(docs, dim=1)
    restarting = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_seq_lens = torch.tensor((0, 3, 8, 10), dtype=torch.int32)
    batch = randn(gen, 2, 4, width)

    def run(function, x, **kwargs):
        return function(layer, x, position_embeddings=None, attention_mask=None, **kwargs)

    def separately():
        return torch.cat(
            [run(stock, doc, position_ids=torch.arange(doc.shape[1])[None]) for doc in docs], dim=1
        )

    return first_disagreement(
        agree_strict(
            lambda: run(stock, batch, position_ids=torch.arange(4)[None].expand(2, 4)),
            lambda: run(candidate, batch, position_ids=torch.arange(4)[None].expand(2, 4)),
        ),
        agree_strict(separately, lambda: run(candidate, packed, position_ids=restarting)),
        agree_strict(
            separately, lambda: run(candidate, packed, cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens)
        ),
    )


GATED_DELTA_RULE = Kernel(
    "gated_delta_rule",
    (),
    (
        Variant("fla", _build_fla, _probe_fla, probe_live=_fla_installed),
        Variant("chunk-scan", _build_chunk_scan, _probe_chunk_scan),
        Variant("decoder-layer", _build_decoder_layer, _probe_decoder_layer),
    ),
    # Only in a module with a Gated DeltaNet layer: its decoder layer's forward (packed sequences
    # kept apart) and its chunked gated delta rule.
    candidates=(
        Pattern("linear", classes=r"DecoderLayer$", only_beside="GatedDeltaNet"),
        Pattern("linear", functions=rf"^{CHUNK_FUNCTION}$", only_beside="GatedDeltaNet"),
    ),
)
