"""Probe helpers: a neutral torch context, tiny seeded inputs and a stock-vs-candidate comparison.

A modeling module is often imported for the first time inside the user's own torch context:
``accelerate.init_empty_weights()`` (verl, on every rank but 0), ``torch.device("meta")``
(FSDP-style init), a bf16 or fp64 default dtype, autocast, inference mode. The probes must
reach the same verdict in all of them, or ranks would run different code. So they run in
``neutral_torch()`` and build every tensor and module through the helpers here, which give
an explicit dtype and device and do not go through ``nn.Module.register_parameter`` (which
init_empty_weights replaces). The probes use their own ``torch.Generator`` and never run an
``__init__`` that draws from the global RNG, so the user's RNG state is untouched.
"""

import contextlib
import inspect
import weakref

import torch

# Both sides run in fp32 on the same inputs; only the rounding order differs.
PROBE_RTOL = 1e-4
PROBE_ATOL = 1e-5
# The mixed-precision probes (bf16 activations with fp32 weights or cos/sin) are there for the
# output dtype: the math was compared in fp32; the values only have to agree to bf16 rounding.
MIXED_TOLERANCE = {"rtol": 1e-2, "atol": 1e-2}

BFLOAT16 = torch.bfloat16


FLOAT32 = torch.float32
CPU = torch.device("cpu")


class neutral_torch:
    """Run the probes in a torch state of their own; put the user's back afterwards.

    - Torch function modes (``torch.device("meta")``, ``set_default_device``) and dispatch
      modes (a fake-tensor mode) are switched off: tensors are real and on the CPU, where
      the reference ops run.
    - Autocast off, inference mode off (parameters cannot be made from inference tensors).
      These are thread-local, so only the probing thread sees the change.
    - The default dtype is float32 while the probes run. It is process-wide: another thread
      creating tensors without a dtype during those milliseconds would get float32 (only when
      the user changed the default; a stated limit).
    - One intra-op thread. The first parallel op of a process starts the OpenMP thread team,
      and a child forked after that hangs in its first parallel op (an OpenMP limitation;
      tests/test_processes.py). A process that only imported modeling modules has computed
      nothing and is safe to fork; the probes must not change that. torch's native pool
      (no OpenMP) is fork-safe and refuses a new count once used, so it is left alone.
    """

    def __enter__(self):
        stack = self._stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch._C.DisableTorchFunction())
            disable_dispatch_modes = getattr(torch.utils._python_dispatch, "_disable_current_modes", None)
            if disable_dispatch_modes is not None:
                stack.enter_context(disable_dispatch_modes())
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.autocast("cpu", enabled=False))
            dtype = torch.get_default_dtype()
            if dtype != FLOAT32:
                torch.set_default_dtype(FLOAT32)
                stack.callback(torch.set_default_dtype, dtype)
            threads = torch.get_num_threads() if getattr(torch._C, "has_openmp", False) else 1
            if threads != 1:
                torch.set_num_threads(1)
                stack.callback(torch.set_num_threads, threads)
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc_info):
        return self._stack.__exit__(*exc_info)


def generator():
    return torch.Generator(device=CPU).manual_seed(20240601)


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=FLOAT32, device=CPU)


def _set(module, name, value):
    """``setattr`` for a probe's module, parameters bypassing ``register_parameter`` (see above)."""
    if isinstance(value, torch.nn.Parameter):
        module.__dict__.pop(name, None)
        module._parameters[name] = value
    else:
        setattr(module, name, value)


def linear(gen, in_features, out_features, bias=False):
    """An nn.Linear with seeded weights, built without consuming the global RNG.

    Its parameters are set directly rather than initialised and overwritten: the probes
    run at every patch, and nn.Linear's own initialisation was 40% of a dense model's time.
    """
    layer = torch.nn.Linear.__new__(torch.nn.Linear)
    torch.nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    scale = in_features**-0.5
    _set(layer, "weight", torch.nn.Parameter(randn(gen, out_features, in_features) * scale))
    layer._parameters["bias"] = torch.nn.Parameter(randn(gen, out_features) * scale) if bias else None
    return layer


def fake_module(**attributes):
    """A bare nn.Module carrying exactly the attributes a kernel reads from ``self``."""
    module = torch.nn.Module()
    for name, value in attributes.items():
        _set(module, name, value)
    return module


def instance(stock, **attributes):
    """An object of the class that defines the method ``stock``, carrying exactly ``attributes``.

    The stock forward may call other methods of its class (the zero-centred RMSNorm calls
    ``self._norm``): they are the real ones. ``__init__`` is not run (it would draw from the
    global RNG and needs a config). A bare nn.Module when ``stock`` is not a method of a
    module-level nn.Module class.
    """
    owner_name = getattr(stock, "__qualname__", "").rpartition(".")[0]
    owner = getattr(stock, "__globals__", {}).get(owner_name)
    if not (isinstance(owner, type) and issubclass(owner, torch.nn.Module)):
        return fake_module(**attributes)
    module = owner.__new__(owner)
    torch.nn.Module.__init__(module)
    for name, value in attributes.items():
        _set(module, name, value)
    return module


_PARAMETERS = weakref.WeakKeyDictionary()


def parameters(stock):
    """The parameter names of a function (or callable module), or None if it has no signature.

    Memoised per function: every variant's probe and builder asks, and inspect.signature was
    a tenth of the probing time.
    """
    try:
        return _PARAMETERS[stock]
    except (KeyError, TypeError):
        pass
    try:
        params = tuple(inspect.signature(stock).parameters)
    except (TypeError, ValueError):
        params = None
    with contextlib.suppress(TypeError):  # not weakly referenceable: not memoised
        _PARAMETERS[stock] = params
    return params


def one_input(stock):
    """None if ``stock`` is a method taking exactly one tensor (``forward(self, x)``), else why not.

    A norm or MLP kernel replaces ``forward(self, x)``; a forward with more parameters (a gated
    norm's ``gate=None``) would lose them.
    """
    params = parameters(stock)
    if params is not None and len(params) == 2 and params[0] == "self":
        sig = inspect.signature(stock).parameters[params[1]]
        if sig.kind in (sig.POSITIONAL_ONLY, sig.POSITIONAL_OR_KEYWORD):
            return None
    return f"the signature {params} is not (self, <one input>)"


def with_stock_names(forward, stock):
    """``forward`` with the parameter names of ``stock`` (one MLP calls its input ``hidden_state``,
    another ``x``), so that keyword calls keep working."""
    names = parameters(stock)
    code = forward.__code__
    if names is not None and len(names) == code.co_argcount:
        forward.__code__ = code.replace(co_varnames=names + code.co_varnames[code.co_argcount :])
    return forward


def signature_reason(stock, *signatures):
    """None if the stock callable's parameter names are one of ``signatures``, else why not."""
    params = parameters(stock)
    if params in signatures:
        return None
    return f"the signature {params} is not {' or '.join(map(str, signatures))}"


def _tensors(result):
    return result if isinstance(result, tuple | list) else (result,)


def agree(run_stock, run_candidate, rtol=PROBE_RTOL, atol=PROBE_ATOL):
    """None when stock and candidate give the same tensors (shape, dtype, values); a reason otherwise.

    An input that the stock code itself rejects does not count against the kernel: the
    kernel only has to match stock where stock works.
    """
    try:
        with torch.no_grad():
            stock = _tensors(run_stock())
    except AttributeError as exc:
        return f"the stock code reads state this kernel does not provide ({exc})"
    except Exception:
        return None
    return _same(stock, run_candidate, rtol, atol)


def _same(stock, run_candidate, rtol, atol):
    with torch.no_grad():
        candidate = _tensors(run_candidate())
    if len(stock) != len(candidate):
        return f"stock returns {len(stock)} values, the kernel {len(candidate)}"
    for expected, got in zip(stock, candidate, strict=True):
        if expected.shape != got.shape or expected.dtype != got.dtype:
            return (
                f"stock returns {tuple(expected.shape)} {expected.dtype}, "
                f"the kernel {tuple(got.shape)} {got.dtype}"
            )
        if not torch.allclose(expected, got, rtol=rtol, atol=atol):
            error = (expected - got).abs().max().item()
            return f"the math differs from stock (max abs error {error:.2e})"
    return None


def first_disagreement(*reasons):
    return next((r for r in reasons if r is not None), None)


def agree_strict(run_stock, run_candidate, rtol=PROBE_RTOL, atol=PROBE_ATOL):
    """Like ``agree``, but the stock code must run on the probe input (it runs once).

    For probes whose input is the one the stock code is built for (a whole MoE block on a
    fake module): if the stock code fails there, the fake module is wrong, and calling
    that agreement would approve a kernel that was never compared.
    """
    try:
        with torch.no_grad():
            stock = _tensors(run_stock())
    except AttributeError as exc:
        return f"the stock code reads state this kernel does not provide ({exc})"
    except Exception as exc:
        return f"the stock code fails on the probe input ({type(exc).__name__}: {exc})"
    return _same(stock, run_candidate, rtol, atol)
