"""The causal LM loss without the logits: ``*ForCausalLM.forward`` with a chunked LM head (issue 19).

One implementation for every causal LM, because it does not rewrite the forward: it calls the
model's own forward with ``labels=None`` and, for that call only, a forward pre-hook on
``self.lm_head`` that keeps the hidden states the head receives (already sliced by
``logits_to_keep``) and hands the head an empty slice of them, so the stock head computes
``[B, 0, V]`` logits and no loss. The loss is then ``losses.linear_cross_entropy`` of those
hidden states and ``self.lm_head.weight`` (read through the module, so that FSDP2 unshards it
and its gradient is reduced like any other; a tied embedding is the same parameter), against
the labels shifted as ``ForCausalLMLoss`` shifts them (or 5.x's ``shift_labels``), with its
``ignore_index`` and ``num_items_in_batch``. The forward's other terms come back with
``labels=None`` unadded: the MoE auxiliary loss is added as every table MoE model adds it,
``router_aux_loss_coef * aux_loss`` (the model's attribute, else its text config's). The output
is the stock one with ``logits=None``.

Why that is the stock loss: the probe runs the stock forward and this one on an instance of the
real class whose base model returns fixed hidden states (and router logits), and compares the
loss and its gradients w.r.t. the hidden states and the head's weight, with ``-100`` labels, with
and without ``num_items_in_batch``. Whatever the stock forward does between the head and the loss
shows there: its config reads any attribute it does not know as 0.5, so a final logit
softcapping or a logit scale changes the stock loss; a ``self.logit_scale``, a base model not
called ``model`` or a loss function of its own raises; each is refused with the reason.

Stock, untouched, for every call this does not reproduce or should not serve: eval, no
gradients, ``labels`` absent or positional, ``return_dict=False``, a loss function other than
``ForCausalLMLoss`` (a user's ``loss_function``), a head that is not a bias-free ``nn.Linear``
with no hooks of its own (PEFT, DeepSpeed, FSDP2 sharding the head alone, accelerate offload),
a head dtype other than the hidden states' outside autocast, and under torch.compile (dynamo would break
the graph at the hook and the chunk loop's data-dependent rows, and ``fullgraph=True`` refuses
them: compiled, the model runs its stock head and loss in the graph). When the head was not
called exactly once, or the labels do not match the kept positions, the loss is the stock head's
on the captured hidden states (the stock result, or the stock error: before issue 24 that call
raised a TypeError of ours, reached under autocast). Under autocast (HF ``Trainer(bf16=True)``,
accelerate's and TRL's mixed precision) the chunked loss runs with autocast's semantics, as the
stock head and loss do there: the matmul in autocast's dtype, the rest in fp32, each gradient in
its input's dtype (fp32 master weights get fp32 gradients). The forward is not thread-safe
across concurrent calls on one model instance (the hook is per module), as no trainer does.
"""

import functools
import inspect
import threading

import torch

from .._types import Kernel, Report, Variant
from ..losses import _matmul_dtype, linear_cross_entropy
from ._calls import counters
from ._probe import _set, agree_strict, first_disagreement, generator, linear, parameters, randn

_LINEAR_FORWARD = torch.nn.Linear.forward


def _head_differs(head) -> str | None:
    """Why the head's output is not plainly ``hidden @ weight.T`` (None: a bias-free nn.Linear
    whose forward nobody wraps)."""
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not _LINEAR_FORWARD:
        return f"its lm_head is a {type(head).__name__}, not an nn.Linear (PEFT on the head?)"
    if head.bias is not None:
        return "its lm_head has a bias"
    if head._forward_pre_hooks or head._forward_hooks:
        return "its lm_head has hooks of its own (FSDP2 sharding it by itself, DeepSpeed, accelerate offload)"
    return None


def steps_aside(model) -> str | None:
    """Why this instance's training calls with labels take the stock loss, or None (for report())."""
    why = _head_differs(getattr(model, "lm_head", None))
    if why is None and getattr(model, "loss_function", None) is not _stock_loss_function():
        why = "its loss_function is not transformers' ForCausalLMLoss"
    return why


def _report_flags(model, defined_by) -> list[str]:
    """For report(): whose code computes the training loss of an instance of a class running this
    kernel, where it is not ours: an instance ``forward`` set over it (TRL's SFTTrainer puts its
    chunked LM head there, and computes the loss with it), or a head or loss function the kernel
    steps aside for (the stock loss)."""
    flags = []
    if "forward" in vars(model):
        flags.append(
            f"the loss is computed by the forward from {defined_by(vars(model)['forward'])} set on this "
            "instance, not by ours, in the calls it does not pass on to the class's forward"
        )
    why = steps_aside(model)
    if why is not None:
        flags.append(f"the stock loss runs, with the logits: {why}")
    return flags


def _stock_loss_function():
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING["ForCausalLM"]


# The stock rules that are the caller's choice (evaluation, inference, a loss of their own): counted,
# never warned about. The others (a wrapped head, its dtype) mean the kernel could not serve a training
# step, which the mostly-stock WARNING says.
_ROUTINE = ("no labels", "return_dict=False", "eval", "no_grad", "own loss_function")


def _why_stock(model, labels, return_dict, head):
    """The rule that sent a forward to the stock loss (for its count in status())."""
    if labels is None:
        return "no labels"
    if not return_dict:
        return "return_dict=False"
    if not model.training:
        return "eval"
    if not torch.is_grad_enabled():
        return "no_grad"
    if _head_differs(head) is not None:
        return "lm_head not a plain nn.Linear"
    return "own loss_function"


def _why_unchunked(hidden, head):
    """Why the loss of a forward that kept its hidden states was the stock head's."""
    return "lm_head not called once" if hidden is None else "lm_head dtype differs"


def _build(stock, npu, on_error):
    causal_lm_loss = _stock_loss_function()
    count_fused, count_stock = counters(on_error, routine=_ROUTINE)

    @functools.wraps(stock)
    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        return_dict = kwargs.get("return_dict")
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        head = getattr(self, "lm_head", None)
        if (
            labels is None
            or torch.compiler.is_compiling()
            or not return_dict
            or not self.training
            or not torch.is_grad_enabled()
            or _head_differs(head) is not None
            or self.loss_function is not causal_lm_loss
        ):
            count_stock(lambda: _why_stock(self, labels, return_dict, head), labels)
            return stock(self, *args, **kwargs)
        captured = []
        thread = threading.get_ident()

        def keep_hidden(module, inputs):
            if threading.get_ident() != thread:
                return None
            captured.append(inputs[0])
            return (inputs[0][..., :0, :],)

        handle = head.register_forward_pre_hook(keep_hidden)
        try:
            out = stock(self, *args, **{**kwargs, "labels": None})
        finally:
            handle.remove()
        hidden = captured[0] if len(captured) == 1 else None
        loss = None
        usable = hidden is not None and _matmul_dtype(hidden, head.weight) is not None
        if usable:
            try:
                loss = _chunked_loss(hidden, head.weight, labels, kwargs)
            except Exception as exc:
                on_error(exc, hidden, head.weight)
            else:
                if loss is None:
                    count_stock("labels not the kept positions", labels)
                else:
                    count_fused()
        else:
            count_stock(lambda: _why_unchunked(hidden, head), labels)
        if loss is None:
            if hidden is None:  # the head ran other than once: the stock forward, all of it
                return stock(self, *args, **kwargs)
            logits = head(hidden)
            loss = causal_lm_loss(logits, labels, head.out_features, **_loss_keywords(kwargs))
        else:
            logits = None
        aux_loss = getattr(out, "aux_loss", None)
        if aux_loss is not None:
            loss = loss + _aux_loss_coefficient(self) * aux_loss.to(loss.device)
        return type(out)(**{**out, "loss": loss, "logits": logits})

    return forward


def _loss_keywords(kwargs):
    """The forward's keywords as the stock forward hands them to its loss function: everything but
    the labels, which go positionally (passing them twice raised TypeError on every stock-head call)."""
    return {name: value for name, value in kwargs.items() if name != "labels"}


def _aux_loss_coefficient(model):
    """The MoE auxiliary loss's weight: the causal LM's own copy, else its text config's (a VLM)."""
    coefficient = getattr(model, "router_aux_loss_coef", None)
    return model.config.get_text_config().router_aux_loss_coef if coefficient is None else coefficient


def _chunked_loss(hidden, weight, labels, kwargs):
    """ForCausalLMLoss's shift and reduction on the kept hidden states; None if they do not match."""
    ignore_index = kwargs.get("ignore_index", -100)
    shifted = kwargs.get("shift_labels")
    if shifted is None:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shifted.numel() != hidden.shape[:-1].numel():
        return None  # the stock head's loss raises its own error for this
    return linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        shifted.reshape(-1),
        ignore_index=ignore_index,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
    )


class _ProbeConfig:
    """The probe's config: what it is given, else 0.5, so a config-driven extra in the head shows.

    A vision-language model's text settings are its ``text_config`` (or ``get_text_config()``),
    another such config; the vision feature switches that transformers validates are given
    their defaults, as they select nothing in the head. So are the output switches: once a real
    model of the class was built in the process, transformers' output-capturing wrapper reads them
    (``_CAN_RECORD_REGISTRY``), and 0.5 there sent the stock code into another path.
    """

    def __init__(self, **known):
        self.__dict__.update(output_attentions=False, output_hidden_states=False, sub_configs={})
        self.__dict__.update(known)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return 0.5

    def get_text_config(self, *args, **kwargs):
        return self.text_config


class _ProbeOutput(dict):
    """The base model's output: hidden states first; any other field (a VLM's rope deltas,
    image outputs) reads None, as a text-only batch leaves them."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else super().__getitem__(key)


class _ProbeBase(torch.nn.Module):
    """A base model that returns fixed hidden states and router logits, whatever it is asked."""

    def __init__(self, hidden, router_logits):
        super().__init__()
        self.hidden, self.router_logits = hidden, router_logits

    def forward(self, *args, **kwargs):
        return _ProbeOutput(last_hidden_state=self.hidden, router_logits=self.router_logits)


def _owner(stock):
    """The class defining the forward (decorators' wrappers live in another module's globals)."""
    owner_name = getattr(stock, "__qualname__", "").rpartition(".")[0]
    owner = inspect.unwrap(stock).__globals__.get(owner_name)
    return owner if isinstance(owner, type) and issubclass(owner, torch.nn.Module) else None


def _probe(stock, candidate):
    params = parameters(stock) or ()
    if "labels" not in params:
        return f"the forward {params} takes no labels"
    owner = _owner(stock)
    if owner is None:
        return "the forward is not a method of a module class"
    gen = generator()
    vocab, width = 11, 8
    hidden = randn(gen, 2, 5, width).requires_grad_()
    head = linear(gen, width, vocab)
    router_logits = (randn(gen, 10, 4),)
    labels = torch.randint(0, vocab, (2, 5), generator=gen)
    labels[0, :2] = -100

    def run(forward, **extra):
        model = owner.__new__(owner)
        torch.nn.Module.__init__(model)
        attributes = {
            "config": _ProbeConfig(
                vocab_size=vocab,
                return_dict=True,
                use_return_dict=True,
                text_config=_ProbeConfig(
                    vocab_size=vocab, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.37
                ),
                vision_feature_select_strategy="default",
                vision_feature_layer=-1,
            ),
            "model": _ProbeBase(hidden, router_logits),
            "lm_head": head,
            "vocab_size": vocab,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.37,  # as its text config's: a real model copies it from there
            "loss_type": "ForCausalLM",
        }
        for name, value in attributes.items():
            _set(model, name, value)
        with torch.enable_grad():
            ids = labels.clamp(min=0)
            out = forward(model, input_ids=ids, labels=labels, output_router_logits=True, **extra)
            chunked = out.logits is None
            return (out.loss, *torch.autograd.grad(out.loss, (hidden, head.weight))), chunked

    def compare(extra):
        def run_candidate():
            values, chunked = run(candidate, **extra)
            ran.append(chunked)
            return values

        ran = []
        reason = agree_strict(lambda: run(stock, **extra)[0], run_candidate)
        if reason is None and not all(ran):
            return "the forward did not take the chunked loss on the probe's call"
        return reason

    # 7 labels count: a divisor other than 7 shows a forward that drops num_items_in_batch.
    return first_disagreement(compare({}), compare({"num_items_in_batch": torch.tensor(5)}))


LOSS = Kernel(
    "loss", (), (Variant("chunked", _build, _probe),), switch="loss", report=Report(flags=_report_flags)
)
