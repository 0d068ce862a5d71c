"""The ``rotary_table`` kernel (see the package's docstring)."""

from dataclasses import dataclass

import torch

from npu_autopatch import Calls, Kernel, Pattern, Report, Variant

OP = "npu_acme_cos_sin"
# {rotary class: the replacement serving it}, while patched: the entry the kernel's own install adds
# beside the swap (as a library keeps a table of what serves which class), taken out with it.
TABLES = {}


def reference_cos_sin(emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's math on the CPU: what the probe builds its candidate on."""
    return emb.cos(), emb.sin()


def _build(stock, npu, on_error):
    cos_sin = getattr(npu, OP)
    calls = getattr(on_error, "calls", None) or Calls()  # a probe's build gets none: counted for nobody

    def forward(self, x, position_ids):
        if getattr(self, "rope_type", "default") != "default":  # a dynamic table: stock updates it
            calls.went_stock("rope_type " + self.rope_type)
            return stock(self, x, position_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        try:
            cos, sin = cos_sin(emb)
        except Exception as exc:
            on_error(exc, emb)
            return stock(self, x, position_ids)
        calls.fused += 1
        scaling = self.attention_scaling
        return (cos * scaling).to(dtype=x.dtype), (sin * scaling).to(dtype=x.dtype)

    return forward


def _probe(stock, candidate):
    """None when the candidate computes the stock table on a tiny rotary module, else why not."""
    module = torch.nn.Module()
    module.inv_freq = torch.tensor([1.0, 0.5, 0.25])
    module.attention_scaling = 0.5
    module.rope_type = "default"
    x = torch.zeros(1, 4, 6)
    positions = torch.arange(4)[None]
    try:
        expected = stock(module, x, positions)
    except Exception as exc:
        return f"the stock code needs more than a rotary table: {type(exc).__name__}: {exc}"
    got = candidate(module, x, positions)
    same = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    return None if same else "the table differs from stock"


def _install(target, build, slot):
    """The class's forward swapped, as the patcher would, and the class in TABLES while it holds it."""
    replacement = build(target.stock)
    name = target.owner.__qualname__
    return [
        slot(
            target.owner,
            target.attr,
            target.current,
            replacement,
            target.had_own,
            target.where,
            path=target.path,
        ),
        slot(TABLES, name, None, replacement, False, f"TABLES[{name!r}]", plumbing=True),
    ]


@dataclass
class TableRow:
    """One rotary embedding class of a model, for report(): its instances and their scaling."""

    name: str
    count: int
    scaling: str


def _rows(classes, records):
    return [
        TableRow(cls.__qualname__, len(instances), str(getattr(instances[0][1], "attention_scaling", "?")))
        for cls, instances in classes.items()
        if cls.__name__.endswith("RotaryEmbedding")
    ]


def _flags(instance, defined_by):
    scaling = getattr(instance, "attention_scaling", 1.0)
    return [] if scaling == 1.0 else [f"its table is scaled by {scaling}"]


ROTARY_TABLE = Kernel(
    "rotary_table",
    (OP,),
    (Variant("cos-sin", _build, _probe),),
    switch="rotary_table",
    candidates=(Pattern("rotary_table", classes=r"RotaryEmbedding$"),),
    report=Report(flags=_flags, rows=_rows, columns=("n", "scaling")),
    reference={OP: reference_cos_sin},
    install=_install,
)
