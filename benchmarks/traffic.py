"""Device kernels per decoder layer and the bytes each moves, forward + backward, stock vs patched, and a
roofline model of the layer's time on an Atlas A2 (910B): a model, not a measurement.

We cannot time a device here, but we can count what it would launch and move. Every op the model dispatches
is recorded by a TorchDispatchMode: an aten op is one kernel with its own inputs and outputs; a torch_npu op
of the CPU stand-in is one kernel with its own inputs and outputs (the mode sees the registered op, whose
fake kernel gives its outputs: the stand-in's Python inside it never runs here); view and allocation ops
(``view``, ``t``, ``detach``, ``empty``...) launch nothing. Bytes read are each distinct input tensor's
elements (a broadcast dimension, stride 0, read once), bytes written each output's; an in-place index write
counts the rows it touches. Matmul FLOPs come from torch's flop formulas, grouped matmuls' and
``npu_fusion_attention``'s (and its grad's: 2.5x the forward's) from their shapes and, for attention, the
score elements the stand-in's work accounting says the device computes (``testing/device/work.py``).

At the training shape, not by scaling: the models are built and run at full size on fake tensors
(``FakeTensorMode``: shapes, dtypes and strides, no data; the stand-in's ops have fake kernels, as torch_npu's
have). What the host computes from the batch layout (positions, the vision tower's windows and sequence ends,
which are read back to the host) runs for real: an op none of whose inputs is fake runs on real tensors.
One layer is the difference between a model with two layers and one with one (every layer of the same
kind: gemma3's sliding-window layers, 5 of its 6; the vision tower's windowed blocks, 28 of its 32);
qwen3_moe's layers are all sparse.

Stock is transformers as it is, with the stand-in installed (its sdpa is torch_npu's: the fused op on the
causal path); patched is ``npu_autopatch.enable()`` with nothing chosen. Each kernel's own line is stock with
only that kernel enabled (``enable(kernels=[name])``; the attention kernel brings the default attention
routed to it), for every kernel of the catalogue that changes the layer: a kernel added later is counted
with no change here. Candidates not built yet are modelled on the same records: the kernels a fused op would
replace become one kernel reading the group's inputs from outside it and writing the outputs used after it.

As the device runs it: torch's ``_grouped_mm`` (transformers' default experts) has no NPU kernel, so it counts
as what its composite does there, the offsets read back to the host (a host sync) and one ``mm`` per expert.
A value the host reads from device data (``item()``, ``tolist()``) is a host sync; read from a fake tensor, it
is answered 1 (every expert has rows). The moe kernel's line is also counted on the old release's rules
(torch_npu 2.7.1), where the device leaves an empty expert's weight gradient unwritten.

The roofline of one kernel is max(bytes / HBM bandwidth, matmul FLOPs / bf16 cube peak) + a launch cost;
a layer is the sum of its kernels (no overlap between kernels; a host sync costs nothing here, though it
stalls the host). Sources, docs/performance.md.

Run with the venv's python:
    .venv/bin/python benchmarks/traffic.py [--quick] [--models NAME ...] [--json] [--markdown] [--launch-us 5]
``--quick``: qwen3 only (tests/test_benchmarks.py runs it). ``--json``: one object per line (model, variant:
"stock", "patched" or a kernel's name, profile, kernels, bytes read + written, host_syncs, model_ms; a
kernel's line also what it saves against stock), no table. ``--markdown``: docs/performance.md's two tables
too, as they are written there (tests/test_benchmarks.py checks the qwen3 row against the doc).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import transformers
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

import npu_autopatch
from npu_autopatch.kernels._catalog import BUILTIN
from npu_autopatch.testing import DEFAULT, stand_in
from npu_autopatch.testing.device import attention

aten = torch.ops.aten

# --- the Atlas A2 (docs/performance.md says where each comes from) ---------------------------------------
HBM_BYTES_PER_S = 1.6e12  # Atlas A2 memory bandwidth, CANN ops-cv cross-platform migration guide
CUBE_FLOPS = 24 * 16**3 * 2 * 1.8e9  # 24 AI cores x 16x16x16 MACs x 2 x 1.8 GHz (Ascend910B2 platform ini)
LAUNCH_S = 5e-6  # an assumption, not sourced (docs/performance.md)

TOKENS = 4096

# Ops that launch no kernel: metadata, allocation without a fill.
NO_KERNEL = {
    aten.detach,
    aten.alias,
    aten._unsafe_view,
    aten.lift_fresh,
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
}
# Ops whose result the host reads (``item()``, ``tolist()``, a tensor's truth value): the host waits for the
# device. They launch no kernel here (the copy to the host is the runtime's).
HOST_SYNC = {aten._local_scalar_dense}
# Ops that overwrite their first argument without reading it.
OVERWRITE = {aten.copy_, aten.fill_, aten.zero_}
# In-place index writes: (op, the argument holding what is written). They read and write those rows only.
INDEX_WRITE = {
    aten.index_put_: "values",
    aten.index_add_: "source",
    aten.index_copy_: "source",
    aten.scatter_: "src",
    aten.scatter_add_: "src",
    aten.masked_scatter_: "source",
}


@dataclass(frozen=True)
class Launch:
    """One kernel: what it is, what it moves and computes, and where (module, forward or backward); or a host
    sync (``kernels`` 0, ``host_syncs`` 1): the host waits for the device to read a value back."""

    op: str
    read: int
    written: int
    flops: int
    where: str
    backward: bool
    kernels: int = 1
    host_syncs: int = 0

    def seconds(self, launch: float) -> float:
        moved = max((self.read + self.written) / HBM_BYTES_PER_S, self.flops / CUBE_FLOPS)
        return moved + self.kernels * launch


@dataclass
class Record:
    """A launch with the storages it read and wrote, in dispatch order (for the fusion model)."""

    launch: Launch
    inputs: dict[int, int]  # storage -> bytes
    outputs: dict[int, int]
    last_dims: frozenset[int]  # the last dimension of every tensor it touched


def footprint(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t`` (a stride-0 dimension is one element)."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride:
            n *= size
    return n * t.element_size()


def tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def arguments(func, args, kwargs) -> dict:
    """Every schema argument of ``func`` by name, defaults filled in."""
    values = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            values[argument.name] = args[i]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def grouped_flops(pairs) -> int:
    """A grouped matmul: each row of x meets one group's weight, 2 * rows * K * N in all; x [M, K] with
    weight [.., K, N] (M-split), or x [K, M] with dy [M, N] (K-split): 2 * x.numel() * N either way."""
    return sum(2 * x.numel() * w.shape[-1] for x, w in pairs)


def attention_flops(func, args, kwargs, backward: bool) -> int:
    """2 FLOPs per score element per head dim and matmul: QK^T and PV forward; the grad op recomputes QK^T
    and computes dP, dV, dQ, dK. The elements are the stand-in's work accounting's (its private helpers: the
    geometry and the sparse mode's count, testing/device/attention.py and work.py)."""
    given = arguments(func, args, kwargs)
    q, k, v, layout = given["query"], given["key"], given["value"], given["input_layout"].upper()
    heads = given["head_num"]
    geo = attention._fa_geometry(
        "npu_fusion_attention",
        q,
        k,
        v,
        heads,
        layout,
        given.get("actual_seq_qlen"),
        given.get("actual_seq_kvlen"),
    )
    call = attention._fa_work(geo, given.get("atten_mask") is not None, given)
    d = q.shape[-1] // heads if layout in ("BSH", "SBH") else q.shape[-1]
    per_element = 3 * d + 2 * geo.v_dim if backward else d + geo.v_dim
    return 2 * call.computed * per_element


class Traffic(TorchDispatchMode):
    """Records every kernel dispatched; runs an op on real tensors when none of its inputs is fake."""

    def __init__(self, namespace: str, tracker: ModuleTracker, experts: int | None = None) -> None:
        super().__init__()
        self.namespace, self.tracker, self.experts = namespace, tracker, experts
        self.records: list[Record] = []
        self._alive: list = []  # storages seen, kept alive so that their ids stay theirs
        self._last_read: int | None = None  # the storage the host read last, if no kernel ran since

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors((args, kwargs))
        if func.overloadpacket in HOST_SYNC:
            return self._host_read(func, args, kwargs, inputs[0])
        if func.overloadpacket is aten.nonzero and isinstance(inputs[0], FakeTensor) and self.experts:
            return self._routed_nonzero(inputs[0])
        if any(isinstance(t, FakeTensor) for t in inputs):
            out = func(*args, **kwargs)
        else:
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
        if func.namespace != "prim" and not func.is_view and func.overloadpacket not in NO_KERNEL:
            self._record(func, args, kwargs, inputs, out)
        return out

    def _host_read(self, func, args, kwargs, tensor: torch.Tensor):
        """A value the host reads. From a fake tensor (device data): one host sync per tensor read
        (``tolist()`` reads its elements one by one), answered 1 (True, 1.0), i.e. every expert has rows
        (the routing data the fake tensors lack; the moe kernel reads its counts back where the device
        leaves an empty expert's gradient unwritten). From a real one (what the host computed from the
        batch layout): no sync, its value."""
        if not isinstance(tensor, FakeTensor):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        key = self._key(tensor)
        if key != self._last_read:
            launch = Launch(
                f"aten.{func.overloadpacket.__name__}", 0, 0, 0, where(self.tracker), self.tracker.is_bw
            )
            self.records.append(
                Record(dataclasses.replace(launch, kernels=0, host_syncs=1), {}, {}, frozenset())
            )
        self._last_read = key
        return True if tensor.dtype == torch.bool else 1 if not tensor.is_floating_point() else 1.0

    def _routed_nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        """``nonzero`` of routing data (4.x's expert loops: which experts the batch hit, which rows each
        expert got) answered as a routing that sends every expert the same number of rows: a mask of E
        elements is all set, a larger one has 1/E of its elements set, spread evenly. A real index tensor,
        so that the loop the host runs over it is the device's; one kernel and one host sync (its size)."""
        count = mask.numel() if mask.numel() == self.experts else mask.numel() // self.experts
        with unset_fake_temporarily():  # real: the host reads it
            flat = torch.arange(count) * (mask.numel() // max(count, 1))
            index = (
                torch.stack(torch.unravel_index(flat, mask.shape), dim=-1) if mask.dim() else flat[:, None]
            )
        launch = Launch(
            "aten.nonzero",
            footprint(mask),
            index.numel() * index.element_size(),
            0,
            where(self.tracker),
            self.tracker.is_bw,
            host_syncs=1,
        )
        self.records.append(
            Record(launch, {self._key(mask): footprint(mask)}, {}, frozenset({mask.shape[-1]}))
        )
        self._last_read = None
        return index

    def _key(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        self._alive.append(storage)
        return storage._cdata

    def _record(self, func, args, kwargs, inputs, out) -> None:
        packet, outputs = func.overloadpacket, tensors(out)
        self._last_read = None
        if packet is aten._grouped_mm:
            self._record_grouped_mm(args, inputs, out)
            return
        read = {self._key(t): footprint(t) for t in inputs}
        written = {self._key(t): footprint(t) for t in outputs}
        for out_arg in tensors(kwargs.get("out")):  # an out= variant writes it, does not read it
            read.pop(self._key(out_arg), None)
        if packet in OVERWRITE:
            read.pop(self._key(inputs[0]), None)
        elif packet in INDEX_WRITE:
            rows = footprint(arguments(func, args, kwargs)[INDEX_WRITE[packet]])
            read[self._key(inputs[0])] = rows
            written = {key: rows for key in written}
        if func.namespace == self.namespace:
            name = func._schema.name.split("::")[-1]
            op = f"torch_npu.{name}"
        else:
            name, op = None, f"{func.namespace}.{packet.__name__}"
        launch = Launch(
            op,
            sum(read.values()),
            sum(written.values()),
            self._flops(func, name, args, kwargs, out),
            where(self.tracker),
            self.tracker.is_bw,
        )
        last_dims = frozenset(t.shape[-1] for t in (*inputs, *outputs) if t.dim())
        self.records.append(Record(launch, read, written, last_dims))

    def _record_grouped_mm(self, args, inputs, out) -> None:
        """torch's ``_grouped_mm`` as an NPU runs it: torch 2.13 registers no PrivateUse1 kernel for it
        (``torch._C._dispatch_has_kernel_for_dispatch_key("aten::_grouped_mm", "PrivateUse1")`` is False)
        and op-plugin none (only ``_scaled_grouped_mm``, from 26.1.0), so its CompositeExplicitAutograd
        kernel runs: ``_grouped_mm_fallback`` (aten/src/ATen/native/GroupedMMUtils.h) copies the offsets
        to the host (a host sync) and calls one ``mm`` per group. The groups share the call's bytes and
        FLOPs evenly (the routing's split is data the fake tensors lack)."""
        offsets = args[2]
        groups = offsets.shape[0]
        read = {self._key(t): footprint(t) for t in inputs}
        written = {self._key(t): footprint(t) for t in tensors(out)}
        flops = grouped_flops([args[:2]])
        where_, backward = where(self.tracker), self.tracker.is_bw
        sync = Launch("aten._grouped_mm: offsets to the host", 0, 0, 0, where_, backward, 0, 1)
        self.records.append(Record(sync, {}, {}, frozenset()))
        last_dims = frozenset(t.shape[-1] for t in (*inputs, *tensors(out)) if t.dim())
        for _group in range(groups):
            share = (
                {key: n // groups for key, n in read.items()},
                {key: n // groups for key, n in written.items()},
            )
            launch = Launch(
                "aten.mm",
                sum(share[0].values()),
                sum(share[1].values()),
                flops // groups,
                where_,
                backward,
            )
            self.records.append(Record(launch, *share, last_dims))

    @staticmethod
    def _flops(func, name, args, kwargs, out) -> int:
        packet = func.overloadpacket
        if packet in flop_registry:
            return int(flop_registry[packet](*args, **kwargs, out_val=out))
        if packet is aten._grouped_mm:
            return grouped_flops([args[:2]])
        if name == "npu_grouped_matmul":
            return grouped_flops(zip(args[0], args[1], strict=False))
        if name in ("npu_fusion_attention", "npu_fusion_attention_grad"):
            return attention_flops(func, args, kwargs, backward=name.endswith("_grad"))
        return 0


# A module of a decoder layer (or vision block), as ``where`` writes it.
IN_LAYER = re.compile(r"\.(layers|blocks)\.N(\.|$)")


def where(tracker: ModuleTracker) -> str:
    """The innermost module running, its layer index written N (so that two layers' records compare)."""
    innermost = max(tracker.parents, key=len)
    return re.sub(r"\.(layers|blocks)\.\d+\.", r".\1.N.", innermost + ".").rstrip(".")


# --- the models, at their training shape ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One model's layer: how to build it with ``layers`` layers, and one training step of it."""

    name: str
    shape: str
    build: Callable[[int], torch.nn.Module]
    step: Callable[[torch.nn.Module], None]
    vocab: int | None = None  # a causal LM's: its loss is modelled too
    title: str = ""  # its row in docs/performance.md's tables
    experts: int | None = None  # routed experts: 4.x's loops over them are counted with every expert hit


def causal_lm(model_type: str, **dims) -> Callable[[int], torch.nn.Module]:
    def build(layers: int) -> torch.nn.Module:
        config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=layers, **dims)
        kinds = getattr(config, "layer_types", None)
        if kinds:  # every layer of the first layer's kind
            config.layer_types = [kinds[0]] * layers
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)

    return build


def lm_step(model: torch.nn.Module) -> None:
    ids = torch.randint(0, 1000, (1, TOKENS))
    model(input_ids=ids, labels=ids).loss.backward()


def vision_tower(layers: int) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    config = transformers.Qwen2_5_VLConfig(vision_config=VISION).vision_config
    config.depth, config.fullatt_block_indexes = layers, []
    tower = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
    return tower._from_config(config, dtype=torch.bfloat16)


def vision_step(model: torch.nn.Module) -> None:
    side = int(TOKENS**0.5)  # one image of side x side patches of 14 px: 896 x 896 px for 4,096 patches
    config = model.config
    patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.zeros(TOKENS, patch, dtype=torch.bfloat16)
    out = model(pixels, grid_thw=torch.tensor([[1, side, side]]))
    merged = out.pooler_output if hasattr(out, "pooler_output") else out
    merged.float().sum().backward()


# Qwen2.5-VL-7B's vision tower (its config.json's vision_config).
VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "hidden_act": "silu",
}

# The dims of Qwen3-8B, Qwen3-235B-A22B, Qwen3-30B-A3B, Gemma-3-12B (text) and Qwen2.5-VL-7B's vision tower,
# 4,096 tokens.
CASES = (
    Case(
        "qwen3",
        "Qwen3-8B: hidden 4,096, 32/8 heads of 128, MLP 12,288",
        causal_lm(
            "qwen3",
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ),
        lm_step,
        151936,  # its loss is modelled (qwen3_moe's head is the same)
        title="qwen3 (Qwen3-8B)",
    ),
    Case(
        "qwen3_moe",
        "Qwen3-235B-A22B: hidden 4,096, 64/4 heads of 128, 128 experts of 1,536, top-8",
        causal_lm(
            "qwen3_moe",
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
        ),
        lm_step,
        title="qwen3_moe (Qwen3-235B-A22B)",
        experts=128,
    ),
    Case(
        "qwen3_moe_30b",
        "Qwen3-30B-A3B: hidden 2,048, 32/4 heads of 128, 128 experts of 768, top-8",
        causal_lm(
            "qwen3_moe",
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
        ),
        lm_step,
        title="qwen3_moe_30b (Qwen3-30B-A3B)",
        experts=128,
    ),
    Case(
        "gemma3",
        "Gemma-3-12B text, a sliding-window layer (1,024): hidden 3,840, 16/8 heads of 256, MLP 15,360",
        causal_lm(
            "gemma3_text",
            hidden_size=3840,
            intermediate_size=15360,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            vocab_size=262208,
        ),
        lm_step,
        title="gemma3 (Gemma-3-12B text)",
    ),
    Case(
        "qwen2_5_vl vision",
        "Qwen2.5-VL-7B vision tower, a windowed block: hidden 1,280, 16 heads, MLP 3,420, one 896x896 image",
        vision_tower,
        vision_step,
        title="qwen2_5_vl vision tower",
    ),
)


# --- counting ---------------------------------------------------------------------------------------------


def run(case: Case, layers: int, npu) -> list[Record]:
    """The records of one training step of ``case`` with ``layers`` layers, at full size on fake tensors."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = case.build(layers)
    model.train()
    tracker = ModuleTracker()
    traffic = Traffic(npu.PROFILE.namespace, tracker, case.experts)
    with fake, tracker, traffic:
        case.step(model)
    return traffic.records


def per_layer(case: Case, npu) -> tuple[list[Launch], list[Record], list[Record]]:
    """(one layer's launches, the records of the two-layer step, those of the one-layer step): the layer is
    the difference of the two steps, compared launch by launch. A one-layer step runs first, uncounted:
    what a process makes once and keeps (the fused attention's causal mask) is then made before either
    counted step, as in a training loop's steady state, not counted in whichever step came first (it
    was, when a probe had not already made it: 3 kernels more per qwen3 layer with shipped verdicts
    than with live probes)."""
    run(case, 1, npu)
    two, one = run(case, 2, npu), run(case, 1, npu)
    layer = Counter(unplaced(r.launch) for r in two)
    layer.subtract(unplaced(r.launch) for r in one)
    negative = {launch: n for launch, n in layer.items() if n < 0}
    assert not negative, (
        f"{case.name}: launches of the one-layer step missing from the two-layer one: {negative}"
    )
    return list(layer.elements()), two, one


def unplaced(launch: Launch) -> Launch:
    """The launch without its module: the backward's attribution to modules is approximate
    (ModuleTracker), so two steps are compared by what each kernel is and moves."""
    return dataclasses.replace(launch, where="")


@dataclass(frozen=True)
class Totals:
    kernels: int
    read: int
    written: int
    flops: int
    seconds: float
    host_syncs: int

    @classmethod
    def of(cls, launches: list[Launch], launch: float) -> Totals:
        return cls(
            sum(x.kernels for x in launches),
            sum(x.read for x in launches),
            sum(x.written for x in launches),
            sum(x.flops for x in launches),
            sum(x.seconds(launch) for x in launches),
            sum(x.host_syncs for x in launches),
        )

    @property
    def moved(self) -> int:
        return self.read + self.written


@contextlib.contextmanager
def patched(**selection) -> Iterator[None]:
    npu_autopatch.enable(**selection)
    try:
        yield
    finally:
        npu_autopatch.disable()


# The catalogue's kernels without a switch of their own, in its order: each is tried alone on every model,
# and listed where it changes the layer. (The opt-in loss is per step, not per layer: loss_report.)
KERNELS = tuple(name for name, _module, _attribute, switch, _on in BUILTIN if switch is None)


# --- candidates: kernels not built, modelled on the same records ------------------------------------------


def fused(group: list[Record], after: list[Record], kernels: int = 1, extra: int = 0) -> tuple[int, int]:
    """(kernels, bytes) that ``kernels`` fused kernels save over ``group``: they read what the group reads
    from outside it, write what is read after it (``after``: every later record, backward included), and
    move ``extra`` bytes between themselves."""
    made = {key for r in group for key in r.outputs}
    needed = {key for r in after for key in r.inputs}
    reads = {key: n for r in group for key, n in r.inputs.items() if key not in made}
    writes = {key: n for r in group for key, n in r.outputs.items() if key in needed}
    moved = sum(r.launch.read + r.launch.written for r in group)
    return len(group) - kernels, moved - sum(reads.values()) - sum(writes.values()) - extra


def add_rms_norm(records: list[Record]) -> list[list[Record]]:
    """Residual add + RMSNorm (``npu_add_rms_norm``): each forward stand-in RMSNorm of layer N whose input
    (not its weight) an add made. Forward only: torch_npu registers no backward for it."""
    made_by, groups = {}, []
    for record in records:
        x = record.launch
        if x.op == "torch_npu.npu_rms_norm" and not x.backward and IN_LAYER.search(x.where):
            producer = made_by.get(next(iter(record.inputs)))
            if producer is not None and producer.launch.op == "aten.add" and not producer.launch.backward:
                groups.append([producer, record])
        made_by.update(dict.fromkeys(record.outputs, record))
    return groups


def runs(records: list[Record], member: Callable[[Launch], bool]) -> list[list[Record]]:
    """Maximal runs of consecutive records that ``member`` accepts."""
    groups, current = [], []
    for record in records:
        if member(record.launch):
            current.append(record)
        elif current:
            groups.append(current)
            current = []
    return [*groups, current] if current else groups


MATMULS = {"aten.mm", "aten.addmm", "aten.bmm", "aten._grouped_mm", "torch_npu.npu_grouped_matmul"}


def router(records: list[Record]) -> list[list[Record]]:
    """The MoE router after its matmul (softmax, top-k, renormalisation, casts) of layer N, forward, in the
    module Qwen's MoE blocks call ``gate``: what ``npu_moe_gating_top_k_softmax`` fuses. Forward only:
    torch_npu registers no backward for it."""
    return runs(
        records,
        lambda x: ".layers.N.mlp.gate" in x.where and not x.backward and x.op not in MATMULS,
    )


def cross_entropy_chunks(records: list[Record], vocab: int) -> list[list[Record]]:
    """The loss kernel's chunks outside the layers: each run of non-matmul kernels between two matmuls that
    touches a [*, vocab] tensor (the chunk's log-sum-exp, its gradient made in the forward)."""
    head = [r for r in records if not IN_LAYER.search(r.launch.where)]
    return [g for g in runs(head, lambda x: x.op not in MATMULS) if any(vocab in r.last_dims for r in g)]


def candidate_saving(
    records: list[Record], groups: list[list[Record]], launch: float, pair: bool = False
) -> tuple[int, int, float]:
    """(kernels, bytes, seconds) fused kernels would save over ``groups`` in ``records``: one per group, or
    with ``pair`` a forward and a backward kernel per group that pass the group's largest tensor (the fp32
    log-probabilities of a loss chunk) between them, written once and read once."""
    position = {id(r): i for i, r in enumerate(records)}
    kernels = moved = 0
    for group in groups:
        largest = max(n for r in group for n in (*r.inputs.values(), *r.outputs.values()))
        after = records[position[id(group[-1])] + 1 :]
        k, b = fused(group, after, 2, 2 * largest) if pair else fused(group, after)
        kernels, moved = kernels + k, moved + b
    return kernels, moved, kernels * launch + moved / HBM_BYTES_PER_S


# --- output -----------------------------------------------------------------------------------------------

# The release line whose rules the moe kernel's line is also counted on: torch_npu 2.7.1 (op-plugin 7.2.0,
# CANN 8.3), whose K-split leaves an empty expert's block unwritten (testing/device/profiles.py).
OLD_RELEASE = "a2-2.7.1"


@dataclass(frozen=True)
class Line:
    """One line of the table: a layer's totals (stock, patched, or stock with one kernel), or what a kernel
    or a candidate saves against stock (``saves``: kernels, bytes, seconds)."""

    model: str
    variant: str
    profile: str
    totals: Totals | None
    saves: tuple[int, int, float] | None = None
    share: float | None = None  # of the stock layer's modelled time
    syncs: int | None = None  # host syncs the kernel adds to the stock layer's

    def json(self) -> dict:
        row: dict = {"model": self.model, "variant": self.variant, "profile": self.profile}
        if self.totals is not None:
            t = self.totals
            row.update(
                kernels=t.kernels,
                bytes=t.moved,
                read=t.read,
                written=t.written,
                host_syncs=t.host_syncs,
                flops=t.flops,
                model_ms=round(t.seconds * 1e3, 3),
            )
        if self.saves is not None:
            kernels, moved, seconds = self.saves
            row.update(saves_kernels=kernels, saves_bytes=moved, saves_ms=round(seconds * 1e3, 3))
            row.update(saves_share=round(self.share, 4))
        if self.syncs is not None:
            row.update(adds_host_syncs=self.syncs)
        return row

    def text(self) -> str:
        if self.saves is None:
            t = self.totals
            return (
                f"  {self.model:<18} {self.variant:<9} {t.kernels:5d} kernels  read {gb(t.read)}  written "
                f"{gb(t.written)}  {t.host_syncs:4d} syncs  {t.flops / 1e12:6.2f} TFLOP  "
                f"model {t.seconds * 1e3:7.2f} ms"
            )
        kernels, moved, seconds = self.saves
        label = self.variant if self.profile == DEFAULT.name else f"{self.variant} ({self.profile})"
        syncs = "" if self.syncs is None else f", {self.syncs:+d} host syncs"
        return (
            f"  {self.model:<18} {label:<32} saves {kernels:4d} kernels, {gb(moved)}, "
            f"{seconds * 1e3:6.2f} ms = {100 * self.share:5.1f} % of the stock layer{syncs}"
        )


def gb(n: int) -> str:
    return f"{n / 1e9:7.2f} GB"


def kernel_line(case: Case, name: str, stock: Totals, alone: Totals, profile: str) -> Line:
    saves = (stock.kernels - alone.kernels, stock.moved - alone.moved, stock.seconds - alone.seconds)
    syncs = alone.host_syncs - stock.host_syncs
    return Line(case.name, name, profile, alone, saves, saves[2] / stock.seconds, syncs)


def report(case: Case, npu, launch: float) -> tuple[list[Line], Totals]:
    """The case's lines on ``npu``'s profile, and its stock layer."""
    profile = npu.PROFILE.name
    stock = Totals.of(per_layer(case, npu)[0], launch)
    with patched():
        launches, two, one = per_layer(case, npu)
    lines = [
        Line(case.name, "stock", profile, stock),
        Line(case.name, "patched", profile, Totals.of(launches, launch)),
    ]
    for name in KERNELS:
        with patched(kernels=[name]):
            alone = Totals.of(per_layer(case, npu)[0], launch)
        if alone != stock:
            lines.append(kernel_line(case, name, stock, alone, profile))
    for name, groups in (("candidate add+rms_norm", add_rms_norm), ("candidate moe router", router)):
        if groups(two):  # one layer's saving: the two-layer step's less the one-layer step's
            more, less = (
                candidate_saving(two, groups(two), launch),
                candidate_saving(one, groups(one), launch),
            )
            saves = tuple(a - b for a, b in zip(more, less, strict=True))
            lines.append(Line(case.name, name, profile, None, saves, saves[2] / stock.seconds))
    return lines, stock


def old_release_lines(case: Case, launch: float) -> list[Line]:
    """The moe kernel's line on the old release's rules, for a case whose layer it changes."""
    with stand_in(profile=OLD_RELEASE) as npu:
        stock = Totals.of(per_layer(case, npu)[0], launch)
        with patched(kernels=["moe"]):
            alone = Totals.of(per_layer(case, npu)[0], launch)
    if alone == stock:
        return []
    return [kernel_line(case, "moe", stock, alone, OLD_RELEASE)]


def loss_report(case: Case, npu, launch: float, layer: float) -> list[Line]:
    """npu_cross_entropy_loss (and its backward) in the loss kernel's chunks: per training step, not per
    layer, against the stock layer's time."""
    with patched(loss=True):
        records = run(case, 1, npu)
    chunks = cross_entropy_chunks(records, case.vocab)
    if not chunks:
        return []
    label = f"candidate cross_entropy, per step ({len(chunks)} chunks)"
    saves = candidate_saving(records, chunks, launch, pair=True)
    return [Line(case.name, label, npu.PROFILE.name, None, saves, saves[2] / layer)]


def markdown(cases: list[Case], lines: list[Line], launch: float) -> list[str]:
    """docs/performance.md's two tables: the layer's totals per model, and what each kernel saves."""
    by_case = {case.name: [line for line in lines if line.model == case.name] for case in cases}
    counted = [case for case in cases if by_case[case.name]]

    def totals(case: Case, variant: str) -> Totals:
        return next(line.totals for line in by_case[case.name] if line.variant == variant)

    def at(t: Totals, seconds_per_launch: float) -> float:  # the model's time at another launch cost, ms
        return (t.seconds + t.kernels * (seconds_per_launch - launch)) * 1e3

    def cell(t: Totals) -> str:
        return f"{t.kernels}, {t.moved / 1e9:.2f} GB, {t.host_syncs} syncs, {t.seconds * 1e3:.1f} ms"

    out = [
        "| model | stock: kernels, GB moved, host syncs, model | patched "
        "| model at 0 / 20 us a launch, stock vs patched |",
        "|---|---|---|---|",
    ]
    for case in counted:
        stock, patched_ = totals(case, "stock"), totals(case, "patched")
        times = " / ".join(f"{at(stock, us * 1e-6):.1f} vs {at(patched_, us * 1e-6):.1f}" for us in (0, 20))
        out.append(f"| {case.title} | {cell(stock)} | {cell(patched_)} | {times} ms |")
    variants = []
    for line in lines:
        key = (line.variant, line.profile)
        if line.saves is not None and key not in variants:
            variants.append(key)
    out += [
        "",
        "| kernel | " + " | ".join(case.title for case in counted) + " |",
        "|---" * (len(counted) + 1) + "|",
    ]
    for variant, profile in variants:
        cells = []
        for case in counted:
            found = [x for x in by_case[case.name] if (x.variant, x.profile) == (variant, profile)]
            if found:
                kernels, moved, _seconds = found[0].saves
                cells.append(f"{kernels}, {moved / 1e9:.2f} GB, {100 * found[0].share:.1f} %")
            else:
                cells.append("")
        label = variant if profile == DEFAULT.name else f"{variant} ({profile})"
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    names = [case.name for case in CASES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="qwen3 only")
    parser.add_argument("--models", nargs="+", choices=names, metavar="MODEL", help=f"of {', '.join(names)}")
    parser.add_argument("--json", action="store_true", help="one JSON object per line, no table")
    parser.add_argument("--markdown", action="store_true", help="and docs/performance.md's tables")
    parser.add_argument("--launch-us", type=float, default=LAUNCH_S * 1e6, help="the launch cost assumed, us")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("npu_autopatch").setLevel(logging.ERROR)  # "skipped: none of its kernels is selected"
    launch = args.launch_us * 1e-6
    chosen = ["qwen3"] if args.quick else args.models or names
    show = (lambda line: print(json.dumps(line.json()))) if args.json else (lambda line: print(line.text()))
    if not args.json:
        print(
            f"per decoder layer, forward + backward, {TOKENS:,} tokens, bf16, counted at full size on fake "
            f"tensors; roofline model of an Atlas A2: {HBM_BYTES_PER_S / 1e12:.1f} TB/s, "
            f"{CUBE_FLOPS / 1e12:.1f} TFLOPS bf16, {args.launch_us:g} us a launch "
            "(a model, not a measurement)"
        )
    every_line = []
    for case in (case for case in CASES if case.name in chosen):
        if not args.json:
            print(f"{case.name}: {case.shape}")
        try:
            with stand_in() as npu:
                lines, stock = report(case, npu, launch)
                if case.vocab:
                    lines += loss_report(case, npu, launch, stock.seconds)
            if any(line.variant == "moe" for line in lines):
                lines += old_release_lines(case, launch)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            # transformers 4.57's MoE experts loop over the experts the routing hit (stock, and our
            # 4.x kernel finds them too): how many tokens each gets is data, which fake tensors lack.
            reason = f"it reads routed data on the host ({exc.func})"
            if args.json:
                print(json.dumps({"model": case.name, "variant": None, "not_counted": reason}))
            else:
                print(f"  {case.name:<18} not counted: {reason}")
            continue
        for line in lines:
            show(line)
        every_line += lines
    if args.markdown:
        print("\n".join(markdown([c for c in CASES if c.name in chosen], every_line, launch)))


if __name__ == "__main__":
    main()
