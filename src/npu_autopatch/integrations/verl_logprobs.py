"""verl's fused log-probs and entropy computed by ``npu_autopatch.losses.linear_logprobs`` (issue 42).

With ``use_fused_kernels=True`` verl's actor forward (0.9.1: ``forward_with_torch_backend`` in
``verl/models/transformers/dense_common.py``, and its VL and qwen3_5 twins) calls
``FusedLinearForPPO(impl_backend=...).forward(hidden_states, vocab_weights, input_ids, temperature)``
from ``verl/utils/experimental/torch_functional.py``. Its "torch" backend, the only one on Ascend
(the other is Liger's Triton), is ``FusedLinearForPPOFunction``: chunks of 512 rows, each with its
full fp32 logits, softmax and log-softmax alive at once, and a bf16 weight gradient rounded once
per chunk. ``linear_logprobs`` computes the same values within rounding, in its scratch budget, with
the bf16 weight gradient rounded once and the entropy as exact as stock's: at 4k and 8k tokens of a
151,936 vocabulary under half verl's peak and no slower (docs/loss.md, benchmarks/verl_logprobs.py).
It changes no number beyond rounding, so it is on by default; ``enable(verl_logprobs=False)`` /
``NPU_AUTOPATCH_VERL_LOGPROBS=0`` leaves verl's own.

The target is ``FusedLinearForPPO.forward``, in whichever verl module defines it (models.py:
``module="verl.*"``). The replacement takes every call verl would run on its torch backend
(``impl_backend == "torch"``, or "liger" where verl's module found no Liger and falls back to it)
with its shapes: 2-D or 3-D ``hidden_states`` (the packed ``[1, tokens, H]`` of remove-padding and,
under Ulysses, each rank's slice with the globally rolled ``shift_labels`` verl passes as
``input_ids``), a float ``temperature``, ids of any integer dtype (cast to int64, as verl does).
It returns what verl's returns: fp32 log-probs and the entropy in the hidden states' dtype, shaped
as the ids. Liger's backend, inputs verl's own code refuses (hidden states neither 2-D nor 3-D, ids
not of their shape, dtypes that do not multiply) and a temperature that is not a positive number run
verl's code, each call counted stock with the reason.

The probe checks the code's shape (the method's parameters) and runs verl's forward and ours on a
tiny batch (3-D and 2-D, temperature 0.7, int32 ids, chunks smaller than the batch): log-probs,
entropy and both gradients must agree. Like integrations/verl.py this module is stdlib at import
(the table imports it) and reaches the package only at call time.
"""

import sys

from .._types import Kernel, Variant

PARAMETERS = ("self", "hidden_states", "vocab_weights", "input_ids", "temperature")
# verl's module-level handle on Liger's function: None where Liger is not installed, and then its
# "liger" backend runs the torch path too (0.9.1: FusedLinearForPPO.forward).
LIGER = "_LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY"
LIGER_BACKEND = "impl_backend 'liger' (Liger's kernel)"
_told = []  # the INFO line was logged in this process


def _where(stock):
    return f"{stock.__module__}.{getattr(stock, '__qualname__', stock)}"


def _takes_torch_path(module, stock):
    """Whether verl's forward would run its torch backend for ``module``: asked for, or "liger"
    without Liger (the module's handle present and None)."""
    backend = getattr(module, "impl_backend", None)
    if backend == "torch":
        return True
    return backend == "liger" and LIGER in stock.__globals__ and stock.__globals__[LIGER] is None


def _why_stock(module, stock, hidden, weight, ids, temperature):
    """None when ours computes the call, else the reason verl's code runs it."""
    from ..losses import _matmul_dtype

    if not _takes_torch_path(module, stock):
        return LIGER_BACKEND
    if hidden.dim() not in (2, 3) or weight.dim() != 2 or tuple(ids.shape) != tuple(hidden.shape[:-1]):
        return f"shapes hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, ids {tuple(ids.shape)}"
    if hidden.shape[-1] != weight.shape[1] or _matmul_dtype(hidden, weight) is None:
        return f"hidden {hidden.dtype} and weight {weight.dtype} do not multiply"
    if not isinstance(temperature, int | float) or temperature <= 0:
        return f"temperature {temperature!r} is not a positive number"
    return None


def _logprobs(hidden, weight, ids, temperature):
    """What verl's torch backend returns: (fp32 log-probs, entropy in the hidden states' dtype)."""
    import torch

    from ..losses import linear_logprobs

    logprobs, entropy = linear_logprobs(hidden, weight, ids.to(torch.int64), float(temperature))
    return logprobs, entropy.to(hidden.dtype)


def _announce(stock):
    """One rank-0 INFO line per process, at the first call ours computes."""
    if _told:
        return
    _told.append(True)
    sys.modules["npu_autopatch._log"].info(
        f"verl's fused log-probs and entropy ({_where(stock)}, impl_backend 'torch') are computed by "
        "npu_autopatch.losses.linear_logprobs (NPU_AUTOPATCH_VERL_LOGPROBS=0 runs verl's)"
    )


def build(stock, npu, on_error):
    """``FusedLinearForPPO.forward`` on ``linear_logprobs``. ``npu`` is not used: plain torch ops.

    Where ours raises, ``on_error`` puts verl's forward back and this call runs it."""
    import functools

    from ..kernels._calls import counters

    fused, went_stock = counters(on_error, routine=(LIGER_BACKEND,))

    @functools.wraps(stock)
    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        why = _why_stock(self, stock, hidden_states, vocab_weights, input_ids, temperature)
        if why is not None:
            went_stock(why, hidden_states, vocab_weights)
            return stock(self, hidden_states, vocab_weights, input_ids, temperature)
        try:
            result = _logprobs(hidden_states, vocab_weights, input_ids, temperature)
        except Exception as exc:
            on_error(exc, hidden_states, vocab_weights)
            return stock(self, hidden_states, vocab_weights, input_ids, temperature)
        fused()
        _announce(stock)
        return result

    return forward


def _outputs_and_grads(run, hidden, weight, upstream):
    """(log-probs, entropy, hidden's gradient, weight's gradient) of ``run`` under a PPO-like loss."""
    import torch

    with torch.enable_grad():
        hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs, entropy = run(hidden, weight)
        loss = (upstream[0] * logprobs).sum() + (upstream[1] * entropy.float()).sum()
        return (logprobs.detach(), entropy.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def probe(stock, candidate):
    """None when verl's forward has the parameters the replacement takes and computes what ours
    does (values and both gradients) on a tiny batch, else why not."""
    import torch

    from ..kernels import _probe

    why = _probe.signature_reason(stock, PARAMETERS)
    if why is not None:
        return f"{_where(stock)}: {why}; verl's code runs as without us"
    if getattr(candidate, "__wrapped__", None) is not stock:
        return "the replacement does not wrap verl's forward"
    gen = _probe.generator()
    hidden, weight = _probe.randn(gen, 2, 5, 8), _probe.randn(gen, 11, 8)
    ids = torch.randint(0, 11, (2, 5), generator=gen, dtype=torch.int32)
    upstream = _probe.randn(gen, 2, 5), _probe.randn(gen, 2, 5)
    module = _probe.instance(stock, impl_backend="torch", chunk_size=3)
    reasons = []
    for shape in ((2, 5), (10,)):  # verl's 3-D hidden states, and flat rows
        h, i, up = hidden.reshape(*shape, 8), ids.reshape(shape), [u.reshape(shape) for u in upstream]

        def verls(h_, w_, i=i):
            return stock(module, h_, w_, i, 0.7)

        def ours(h_, w_, i=i):
            return _logprobs(h_, w_, i, 0.7)

        reasons.append(
            _probe.agree_strict(
                lambda run=verls, h=h, up=up: _outputs_and_grads(run, h, weight, up),
                lambda run=ours, h=h, up=up: _outputs_and_grads(run, h, weight, up),
            )
        )
    why = _probe.first_disagreement(*reasons)
    return None if why is None else f"{_where(stock)}: {why}"


VERL_LOGPROBS = Kernel(
    "verl_logprobs", (), [Variant("linear_logprobs", build, probe)], switch="verl_logprobs", switched_on=True
)
