"""Probe verdicts reused by fingerprint: the shipped table covers the model table, agrees with live
probes, and code that differs is probed (kernels/_fingerprint.py)."""

import types

import pytest
import transformers

from npu_autopatch.kernels import KERNELS, Kernel, Variant, _fingerprint, _verdicts, choose_variant
from npu_autopatch.tools import verdicts as generator

from .conftest import run_python

REGENERATE = (
    "the shipped verdicts are stale: run `python -m npu_autopatch.kernels --write` "
    "with .venv and with .venv-tf4, and commit kernels/_verdicts.py"
)


@pytest.fixture(autouse=True)
def fresh_memo():
    _fingerprint.forget()
    yield
    _fingerprint.forget()


def table_targets():
    return list(generator.table_targets())


def live(kernel, stock, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("NPU_AUTOPATCH_PROBE", "always")
        return choose_variant(kernel, stock)


def test_the_shipped_verdicts_are_for_these_kernels():
    assert _fingerprint.kernels_digest() == _verdicts.KERNELS_DIGEST, REGENERATE
    assert any(source.startswith("transformers 4.") for source in _verdicts.SOURCES), _verdicts.SOURCES
    assert any(source.startswith("transformers 5.") for source in _verdicts.SOURCES), _verdicts.SOURCES


def test_every_table_target_is_in_the_shipped_table_with_its_live_verdict(monkeypatch):
    """(i) each target of the model table hits the table; (ii) with the verdict a live probe gives."""
    targets = table_targets()
    assert len(targets) > 40
    for where, kernel, stock in targets:
        verdict = _fingerprint.shipped(kernel, _fingerprint.fingerprint(stock), stock)
        assert verdict is not None, f"{where} ({kernel.name}) is not in the shipped table: {REGENERATE}"
        assert live(kernel, stock, monkeypatch) == verdict, where


def test_no_fingerprint_of_the_table_has_two_verdicts():
    """(iii): over every target of the table, one fingerprint, one verdict (live_verdicts raises)."""
    verdicts = generator.live_verdicts(table_targets())
    assert sum(map(len, verdicts.values())) < len(table_targets())  # shared code is shared


def with_constant(function, old, new):
    """``function`` compiled with one constant changed, in the same module, under the same name."""
    code = function.__code__
    assert old in code.co_consts
    consts = tuple(new if c == old and type(c) is type(old) else c for c in code.co_consts)
    changed = types.FunctionType(code.replace(co_consts=consts), function.__globals__, function.__name__)
    changed.__qualname__ = function.__qualname__
    return changed


def test_code_that_differs_by_one_constant_is_probed(monkeypatch):
    """(iv): LlamaRMSNorm's mean of x^2 made a mean of x^3 has its own fingerprint; the probe refuses it."""
    from transformers.models.llama import modeling_llama

    stock = modeling_llama.LlamaRMSNorm.forward
    changed = with_constant(stock, 2, 3)
    assert _fingerprint.fingerprint(changed) != _fingerprint.fingerprint(stock)
    assert choose_variant(KERNELS["rms_norm"], stock)[0].name == "llama"
    variant, reason = choose_variant(KERNELS["rms_norm"], changed)
    assert variant is None and "math differs" in reason


class Counting:
    def __init__(self, variant):
        self.variant, self.calls = variant, 0

    def __call__(self, stock, candidate):
        self.calls += 1
        return self.variant.probe(stock, candidate)


def test_a_verdict_is_probed_once_per_process_unless_live_probing_is_asked(monkeypatch):
    """The in-process memo: the same code (here a reload's new function object) is not probed again;
    NPU_AUTOPATCH_PROBE=always probes every time."""
    from transformers.models.llama import modeling_llama

    llama = KERNELS["rms_norm"].variants[0]
    probe = Counting(llama)
    kernel = Kernel("rms_norm", KERNELS["rms_norm"].ops, (Variant("llama", llama.build, probe),))
    stock = modeling_llama.LlamaRMSNorm.forward
    reloaded = types.FunctionType(stock.__code__, stock.__globals__, stock.__name__, stock.__defaults__)
    reloaded.__qualname__ = stock.__qualname__
    assert choose_variant(kernel, stock)[0].name == "llama"
    assert choose_variant(kernel, reloaded)[0].name == "llama"
    assert probe.calls == 1
    live(kernel, stock, monkeypatch)
    assert probe.calls == 2


def test_the_shipped_table_needs_no_probe(monkeypatch):
    """A table target is patched from the shipped table: no probe runs (they would raise here)."""

    def no_probe(kernel, stock):
        raise AssertionError(f"probed {stock.__qualname__}")

    monkeypatch.setattr("npu_autopatch.kernels._choose._probe_variants", no_probe)
    for where, kernel, stock in table_targets():
        variant, reason = choose_variant(kernel, stock)
        assert (variant is None) == (reason is not None), where


def test_a_plugin_kernel_named_like_ours_is_probed(monkeypatch):
    """A shipped verdict is for our variants: a replacement variant of the same name is probed."""
    from transformers.models.llama import modeling_llama

    llama = KERNELS["rms_norm"].variants[0]
    refusing = Variant("llama", llama.build, lambda stock, candidate: "refused by the plugin")
    kernel = Kernel("rms_norm", KERNELS["rms_norm"].ops, (refusing,))
    variant, reason = choose_variant(kernel, modeling_llama.LlamaRMSNorm.forward)
    assert variant is None and reason == "refused by the plugin"


def test_the_generator_reports_this_transformers(capsys):
    assert generator.main([]) == 0
    assert f"transformers {transformers.__version__}: " in capsys.readouterr().out


def shipped_refusals():
    """(kernel, fingerprint, stock) of every shipped refusal whose code this transformers has."""
    import importlib

    from npu_autopatch import _resolve

    for kernel, table in _verdicts.REFUSED.items():
        for key in table:
            print_, name = key.split(" ")
            module_name, _, rest = name.rpartition(".modeling_")
            module_path, _, qualname = rest.partition(".")
            try:
                module = importlib.import_module(f"{module_name}.modeling_{module_path}")
            except ImportError:
                continue
            found = _resolve.resolve(module, [qualname])
            if found is not None:
                yield KERNELS[kernel], print_, _resolve.stock_function(found.current) or found.current


def test_a_shipped_refusal_is_the_live_one_word_for_word(monkeypatch):
    """A refused target of the table is not probed either; status() gets the probe's own reason."""
    checked = 0
    for kernel, print_, stock in shipped_refusals():
        if _fingerprint.fingerprint(stock) != print_:
            continue  # the other transformers major's code under the same name
        verdict = _fingerprint.shipped(kernel, print_, stock)
        assert verdict[0] is None and verdict == live(kernel, stock, monkeypatch), stock.__qualname__
        checked += 1
    if not checked:
        pytest.skip(f"no shipped refusal is for transformers {transformers.__version__}")


FLASH_PRINTS = """
from npu_autopatch.kernels import _fingerprint
from npu_autopatch.testing import stand_in
if ON_DEVICE:
    device = stand_in()
    device.__enter__()  # kept: a dropped context manager would close at once
import transformers.integrations.npu_flash_attention as m
print("PRINTS", *map(_fingerprint.fingerprint, (m.npu_flash_attn_func, m.npu_flash_attn_varlen_func)))
"""


def test_the_npu_flash_functions_have_one_fingerprint_with_or_without_torch_npu():
    """transformers' npu_flash_attention binds torch_npu and npu_fusion_attention only on an NPU: the
    verdicts, made on either side, must hit on the device, and not depend on which test imported it first."""
    found = []
    for on_device in (False, True):
        result = run_python(f"ON_DEVICE = {on_device}\n{FLASH_PRINTS}")
        assert result.returncode == 0, result.stderr[-3000:]
        found.append(result.stdout.split("PRINTS", 1)[1].split())
    assert found[0] == found[1] and "None" not in found[0], found


def test_a_fingerprint_does_not_depend_on_what_the_process_ran_before(monkeypatch):
    """transformers binds its flash-attention helpers lazily (None until the first FA2 model), and the
    default attention's route replaces a method of ``PreTrainedModel``: neither changes the fingerprint
    of the stock code that reads them, or the shipped verdicts would miss after either (seen under
    another test order)."""
    from transformers import modeling_flash_attention_utils as flash
    from transformers import modeling_utils

    import npu_autopatch
    from npu_autopatch.testing import stand_in

    readers = [
        flash._flash_attention_forward,
        modeling_utils.PreTrainedModel._check_and_adjust_attn_implementation,
    ]
    before = [_fingerprint.fingerprint(f) for f in readers]
    rebound = _fingerprint._state_names(vars(flash))
    assert {"_flash_fn", "_pad_fn"} <= rebound
    for name in rebound:  # as lazy_import_flash_attention binds them
        monkeypatch.setattr(flash, name, lambda *args, **kwargs: None)
    _fingerprint.forget()
    assert [_fingerprint.fingerprint(f) for f in readers] == before
    with stand_in():
        npu_autopatch.enable()  # the route on PreTrainedModel.get_correct_attn_implementation
        _fingerprint.forget()
        assert [_fingerprint.fingerprint(f) for f in readers] == before


def test_a_live_probe_gives_the_shipped_verdict_after_a_real_model_of_the_class_was_built(monkeypatch):
    """Building a model registers its class with transformers' output capture (4.57 then reads the
    output switches of the loss probe's fake config): the probe's verdict must not change with it."""
    from npu_autopatch.testing.parity import tiny_model

    tiny_model("qwen3_vl")
    checked = 0
    for where, kernel, stock in table_targets():
        if where.startswith("qwen3_vl:") and kernel.name == "loss":
            assert live(kernel, stock, monkeypatch) == _fingerprint.shipped(
                kernel, _fingerprint.fingerprint(stock), stock
            ), where
            checked += 1
    assert checked == 1
