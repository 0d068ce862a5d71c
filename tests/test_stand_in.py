"""Tests of the torch_npu CPU stand-in (npu_autopatch.testing) against independent reference computations.

Every golden here is written from the formulas in torch_npu_ops.md (or HF's own code), not by calling the
stand-in's helpers, so a wrong stand-in fails. These run on the default profile (the newest torch_npu on
Atlas A2); the device rules and the differences between profiles are tested in test_stand_in_profiles.py.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import itertools
import math
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from npu_autopatch.testing import DEFAULT, OPS, make_torch_npu, stand_in

SRC = Path(__file__).resolve().parents[1] / "src"
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def npu() -> types.ModuleType:
    torch.manual_seed(0)
    return make_torch_npu()


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = FP32_TOL if actual.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual, expected, **tol)


def leaf(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).requires_grad_()


def grads_of(loss: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, inputs)


def collect_warnings(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if "an autograd kernel was not registered" in str(w.message)]


def assert_silent_no_grad(loss_fn, *inputs: torch.Tensor) -> None:
    """Generic fallback: the backward warns and every gradient stays None.

    (torch_npu's VariableFallbackKernel.cpp warns once per process; torch's own CPU fallback, which the
    stand-in's ops get, warns at every backward: the gradient is what matters.)"""
    assert len(collect_warnings(lambda: loss_fn().backward())) >= 1
    assert all(t.grad is None for t in inputs)
    assert collect_warnings(lambda: loss_fn().backward())  # no gradient the second time either
    assert all(t.grad is None for t in inputs)


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # HF's rotate_half
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out[..., 0::2] = -x[..., 1::2]
    out[..., 1::2] = x[..., 0::2]
    return out


# ------------------------------------------------------------------------------------------------------------
# The module object, stand_in() and the pytest fixture
# ------------------------------------------------------------------------------------------------------------


def test_module_looks_like_torch_npu() -> None:
    module = make_torch_npu()
    assert isinstance(module, types.ModuleType) and module.__name__ == "torch_npu"
    assert module.__spec__ is not None and module.__spec__.name == "torch_npu"
    assert module.__version__ == DEFAULT.torch_npu == "2.14.0" and module.STAND_IN is True
    assert module.PROFILE is DEFAULT and module.version.cann == DEFAULT.cann
    assert "torch_npu" not in sys.modules or sys.modules["torch_npu"] is not module
    assert module.npu.__name__ == "torch_npu.npu" and module.npu.__spec__.name == "torch_npu.npu"
    assert module.npu.is_available() is True and module.npu.device_count() == 1
    assert module.npu.get_device_name() == DEFAULT.soc == "Ascend910B1"  # the SoC name, as torch_npu's
    ops = {name for name in vars(module) if name.startswith("npu_")}
    assert ops == set(OPS)
    # Registered custom ops, as torch_npu's are: opaque to torch.compile and torch.export.
    assert all(isinstance(getattr(module, name), torch._ops.OpOverloadPacket) for name in OPS)
    assert make_torch_npu() is not module and make_torch_npu().calls is not module.calls


def test_unavailable_and_missing() -> None:
    module = make_torch_npu(available=False, missing=["npu_rms_norm", "npu_swiglu"])
    assert module.npu.is_available() is False and module.npu.device_count() == 0
    with pytest.raises(RuntimeError):
        module.npu.get_device_name(0)
    assert not hasattr(module, "npu_rms_norm") and not hasattr(module, "npu_swiglu")
    assert hasattr(module, "npu_rotary_mul")
    with pytest.raises(ValueError, match="npu_not_an_op"):
        make_torch_npu(missing=["npu_not_an_op"])


# Schemas as registered by torch_npu 2.14 (torch_npu_ops.md), plus the MoE and attention grad ops
# from op-plugin.
SCHEMAS = [
    "npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06)",
    "npu_rms_norm_backward(Tensor dy, Tensor input, Tensor gamma, Tensor rstd)",
    "npu_swiglu(Tensor input, int dim=-1)",
    "npu_swiglu_backward(Tensor grad_output, Tensor input, int dim=-1)",
    "npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None)",
    "npu_rotary_mul_backward(Tensor grad, Tensor input, Tensor r1, Tensor r2, str rotary_mode='half')",
    "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
    "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
    "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
    "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None, '
    "Tensor? dropout_mask=None, int seed=0, int offset=0)",
    # op-plugin's schema (op_plugin_functions.yaml); torch_npu_ops.md quotes only the forward's.
    "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
    "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
    "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, "
    "float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
    "int inner_precise=0, int seed=0, int offset=0, int numels=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None)',
    "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
    "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
    "int? per_token_scale_dtype=None)",
    "npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False)",
    "npu_moe_token_permute_grad_v2(Tensor grad_permuted_tokens, Tensor sorted_indices, int tokens_size_0, "
    "ScalarType tokens_dtype, int num_topK, bool padded_mode=False)",
    "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, "
    "bool padded_mode=False, int[]? restore_shape=None)",
    "npu_moe_token_unpermute_grad_v2(Tensor grad_unpermuted_tokens, Tensor sorted_indices, "
    "int permuted_tokens_size_0, ScalarType permuted_tokens_dtype, Tensor? probs=None, "
    "bool padded_mode=False, int[]? restore_shape=None, Tensor? permuted_tokens=None)",
    # The GELU family: op-plugin master's op_plugin_functions.yaml (the wheel's registered names unread).
    "npu_gelu(Tensor self, *, str approximate='none')",
    "npu_gelu_backward(Tensor grad_output, Tensor self, *, str approximate='none')",
    "npu_fast_gelu(Tensor self)",
    "npu_fast_gelu_backward(Tensor grad, Tensor self)",
    "npu_geglu(Tensor self, int dim=-1, int approximate=1, bool activate_left=False)",
    "npu_geglu_grad(Tensor grad_output, Tensor self, Tensor gelu, int dim=-1, int approximate=1, "
    "bool activate_left=False)",
]


def parse_schema(schema: str) -> tuple[str, list[tuple[str, object, str]]]:
    name, args = schema.rstrip(")").split("(", 1)
    params, kind = [], "POSITIONAL_OR_KEYWORD"
    for arg in args.split(", "):
        if arg == "*":
            kind = "KEYWORD_ONLY"
            continue
        declared, _, default = arg.split(" ", 1)[1].partition("=")
        value = ast.literal_eval(default) if default else inspect.Parameter.empty
        params.append((declared, value, kind))
    return name, params


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.split("(")[0])
def test_signatures_follow_the_schemas(npu: types.ModuleType, schema: str) -> None:
    name, params = parse_schema(schema)
    registered = getattr(npu, name).default._schema.arguments
    kinds = ("KEYWORD_ONLY" if a.kwarg_only else "POSITIONAL_OR_KEYWORD" for a in registered)
    defaults = (a.default_value if a.has_default_value() else inspect.Parameter.empty for a in registered)
    assert list(zip((a.name for a in registered), defaults, kinds, strict=True)) == params


def test_schema_list_covers_every_op() -> None:
    assert sorted(parse_schema(s)[0] for s in SCHEMAS) == sorted(OPS)


def test_calls_count_forward_and_backward_ops(npu: types.ModuleType) -> None:
    x, g = leaf(2, 8), leaf(8)
    npu.npu_rms_norm(x, g)[0].sum().backward()
    npu.npu_rms_norm(x.detach(), g.detach())
    npu.npu_swiglu(leaf(2, 8)).sum().backward()
    with pytest.raises(RuntimeError):
        npu.npu_swiglu(torch.randn(2, 7))
    assert npu.calls == {
        "npu_rms_norm": 2,
        "npu_rms_norm_backward": 1,
        "npu_swiglu": 2,
        "npu_swiglu_backward": 1,
    }


def test_stand_in_installs_and_restores_absence() -> None:
    saved = {name: sys.modules.pop(name, None) for name in ("torch_npu", "torch_npu.npu")}
    saved_npu = vars(torch).pop("npu", None)
    try:
        with stand_in() as module:
            import torch_npu

            assert torch_npu is module and sys.modules["torch_npu.npu"] is module.npu
            assert torch.npu is module.npu and torch.npu.is_available()
            assert importlib.util.find_spec("torch_npu") is module.__spec__
        assert "torch_npu" not in sys.modules and "torch_npu.npu" not in sys.modules
        assert "npu" not in vars(torch)
    finally:
        sys.modules.update({k: v for k, v in saved.items() if v is not None})
        if saved_npu is not None:
            torch.npu = saved_npu


def test_stand_in_restores_previous_objects_and_nests() -> None:
    outer_modules = {name: types.ModuleType(name) for name in ("torch_npu", "torch_npu.npu")}
    sentinel = types.ModuleType("sentinel")
    saved = {name: sys.modules.get(name) for name in outer_modules}
    saved_npu = vars(torch).get("npu")
    sys.modules.update(outer_modules)
    torch.npu = sentinel
    try:
        with stand_in() as first:
            with stand_in(available=False) as second:
                assert sys.modules["torch_npu"] is second and not torch.npu.is_available()
            assert sys.modules["torch_npu"] is first and torch.npu is first.npu
            with pytest.raises(KeyError), stand_in():
                raise KeyError("restores on error too")
            assert sys.modules["torch_npu"] is first
        assert all(sys.modules[name] is mod for name, mod in outer_modules.items())
        assert torch.npu is sentinel
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
        if saved_npu is None:
            del torch.npu
        else:
            torch.npu = saved_npu


def test_transformers_detects_the_stand_in() -> None:
    from transformers.utils import import_utils

    detect = import_utils.is_torch_npu_available
    detect.cache_clear()
    try:
        with stand_in():
            assert detect() is True
        detect.cache_clear()
        with stand_in(available=False):
            assert detect() is False
    finally:
        detect.cache_clear()


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_pytest_plugin_fixture_and_light_import(tmp_path: Path) -> None:
    (tmp_path / "test_uses_fixture.py").write_text(
        textwrap.dedent(
            """
            import sys
            import torch

            def test_fixture(npu_stand_in):
                assert npu_stand_in.STAND_IN and sys.modules["torch_npu"] is npu_stand_in
                assert torch.npu is npu_stand_in.npu
                y, rstd = npu_stand_in.npu_rms_norm(torch.ones(2, 4), torch.ones(4))
                assert npu_stand_in.calls["npu_rms_norm"] == 1

            def test_restored_after_fixture():
                assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")
            """
        )
    )
    result = _run(
        ["-m", "pytest", "-p", "npu_autopatch.testing.pytest_plugin", "-q", "-p", "no:cacheprovider"],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
    light = _run(
        ["-c", "import sys, npu_autopatch.testing.pytest_plugin; assert 'torch' not in sys.modules"], tmp_path
    )
    assert light.returncode == 0, light.stderr


# ------------------------------------------------------------------------------------------------------------
# RMSNorm family
# ------------------------------------------------------------------------------------------------------------


def ref_rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + eps)  # the §12 golden recipe
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


@pytest.mark.parametrize(
    ("x_dtype", "g_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_rms_norm_golden(npu: types.ModuleType, x_dtype: torch.dtype, g_dtype: torch.dtype) -> None:
    x, gamma = torch.randn(2, 3, 16).to(x_dtype), torch.randn(16).to(g_dtype)
    out = npu.npu_rms_norm(x, gamma, epsilon=1e-5)
    assert isinstance(out, tuple) and len(out) == 2
    y, rstd = out
    y_ref, rstd_ref = ref_rms_norm(x, gamma, 1e-5)
    # Bit-exact: fp32 inside and ONE cast at the end, as the golden does.
    assert torch.equal(y, y_ref) and torch.equal(rstd, rstd_ref)
    assert y.dtype == x_dtype and rstd.dtype == torch.float32 and rstd.shape == (2, 3, 1)
    # HF LlamaRMSNorm rounds x*rstd to the input dtype before the weight: at most ~1 ulp away.
    var = x.float().pow(2).mean(-1, keepdim=True)
    hf = gamma * (x.float() * torch.rsqrt(var + 1e-5)).to(x_dtype)
    torch.testing.assert_close(y.float(), hf.float(), **BF16_TOL)


def test_rms_norm_normalises_the_last_gamma_dims(npu: types.ModuleType) -> None:
    x, gamma = torch.randn(2, 3, 4, 8), torch.randn(4, 8)
    y, rstd = npu.npu_rms_norm(x, gamma)
    y_ref, rstd_ref = ref_rms_norm(x, gamma)
    close(y, y_ref)
    assert rstd.shape == (2, 3, 1, 1)
    close(rstd, rstd_ref)


@pytest.mark.parametrize(
    ("x_dtype", "g_dtype", "shape", "error"),
    [
        (torch.float16, torch.bfloat16, (8,), "dtypes"),
        (torch.float32, torch.float16, (8,), "dtypes"),
        (torch.float64, torch.float64, (8,), "dtypes"),
        (torch.float32, torch.float32, (4,), "gamma shape"),
        (torch.float32, torch.float32, (2, 8), "gamma shape"),
    ],
)
def test_rms_norm_limits(
    npu: types.ModuleType, x_dtype: torch.dtype, g_dtype: torch.dtype, shape, error
) -> None:
    with pytest.raises(RuntimeError, match=error):
        npu.npu_rms_norm(torch.randn(3, 8).to(x_dtype), torch.randn(*shape).to(g_dtype))


def test_rms_norm_autograd_matches_reference(npu: types.ModuleType) -> None:
    x, gamma = leaf(3, 5, 16), leaf(16)
    upstream = torch.randn(3, 5, 16)
    y, rstd = npu.npu_rms_norm(x, gamma)
    assert not rstd.requires_grad
    got = grads_of((y * upstream).sum(), x, gamma)
    want = grads_of((ref_rms_norm(x, gamma)[0] * upstream).sum(), x, gamma)
    for g, w in zip(got, want, strict=True):
        close(g, w)
    assert npu.calls["npu_rms_norm_backward"] == 1


@pytest.mark.parametrize("g_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_grad_dtypes(npu: types.ModuleType, g_dtype: torch.dtype) -> None:
    x, gamma = leaf(4, 16, dtype=torch.bfloat16), leaf(16, dtype=g_dtype)
    npu.npu_rms_norm(x, gamma)[0].sum().backward()
    assert x.grad.dtype == torch.bfloat16 and gamma.grad.dtype == g_dtype
    dx, dgamma = npu.npu_rms_norm_backward(
        torch.ones(4, 16, dtype=torch.bfloat16), x, gamma, torch.ones(4, 1)
    )
    assert dx.dtype == torch.bfloat16 and dgamma.dtype == torch.float32 and dgamma.shape == (16,)


# ------------------------------------------------------------------------------------------------------------
# SwiGLU
# ------------------------------------------------------------------------------------------------------------


def ref_swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
    half = x.shape[dim] // 2
    a, b = x.float().narrow(dim, 0, half), x.float().narrow(dim, half, half)
    return (a * torch.sigmoid(a) * b).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_swiglu_golden(npu: types.ModuleType, dtype: torch.dtype, dim: int) -> None:
    x = torch.randn(4, 6, 8).to(dtype)
    y = npu.npu_swiglu(x, dim=dim)
    close(y, ref_swiglu(x, dim))
    assert y.shape[dim] == x.shape[dim] // 2


def test_swiglu_gates_the_first_half(npu: types.ModuleType) -> None:
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    close(npu.npu_swiglu(torch.cat([gate, up], -1)), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_autograd_matches_reference(npu: types.ModuleType, dtype: torch.dtype) -> None:
    x, upstream = leaf(3, 4, 10, dtype=dtype), torch.randn(3, 4, 5)
    (got,) = grads_of((npu.npu_swiglu(x).float() * upstream).sum(), x)
    xf = x.detach().float().requires_grad_()
    (want,) = grads_of((ref_swiglu(xf, -1) * upstream).sum(), xf)
    close(got, want.to(dtype))
    assert npu.calls["npu_swiglu_backward"] == 1


@pytest.mark.parametrize(
    ("x", "dim", "error"),
    [
        (torch.randn(4, 7), -1, "even"),
        (torch.randn(8, 4).t(), -1, "contiguous"),
        (torch.randn(4, 8), 2, "out of range"),
        (torch.randn(0, 8), -1, "empty"),
        (torch.randn(()), 0, "1-8-D"),
        (torch.randn([1] * 8 + [2]), -1, "1-8-D"),
        (torch.randn(4, 8).double(), -1, "dtype"),
        (torch.ones(4, 8, dtype=torch.int32), -1, "dtype"),
    ],
    ids=["odd", "non-contiguous", "dim-range", "empty", "0-d", "9-d", "fp64", "int"],
)
def test_swiglu_limits(npu: types.ModuleType, x: torch.Tensor, dim: int, error: str) -> None:
    with pytest.raises(RuntimeError, match=error):
        npu.npu_swiglu(x, dim)


# ------------------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_mul_half_matches_hf(npu: types.ModuleType, dtype: torch.dtype) -> None:
    q = torch.randn(2, 4, 5, 16).to(dtype)  # BNSD, cos/sin B1SD as HF's unsqueeze(1)
    cos, sin = torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16)  # fp32: cast to q's dtype first
    out = npu.npu_rotary_mul(q, cos, sin)
    cos_q, sin_q = cos.to(dtype), sin.to(dtype)
    assert torch.equal(out, q * cos_q + rotate_half(q) * sin_q) and out.dtype == dtype


def test_rotary_mul_interleave_and_rotate_matrix(npu: types.ModuleType) -> None:
    x, cos, sin = torch.randn(2, 5, 3, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)  # BSND, 1S1D
    close(npu.npu_rotary_mul(x, cos, sin, "interleave"), x * cos + rotate_interleave(x) * sin)
    h = 4
    rotate = torch.zeros(8, 8)
    rotate[:h, h:], rotate[h:, :h] = torch.eye(h), -torch.eye(h)  # the doc's half-mode matrix
    close(npu.npu_rotary_mul(x, cos, sin, rotate=rotate), x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize(
    ("mode", "x_shape", "r_shape"),
    [
        ("half", (2, 3, 5, 8), (2, 1, 5, 8)),  # BNSD, B1SD (B < S)
        ("half", (2, 5, 3, 8), (1, 5, 1, 8)),  # BSND, 1S1D
        ("half", (2, 5, 3, 8), (2, 5, 3, 8)),  # no broadcast
        ("half", (1, 7, 3, 8), (1, 7, 1, 8)),  # BSND with B = 1, BS1D
        ("interleave", (2, 3, 5, 8), (1, 1, 5, 8)),  # BNSD, 11SD
        ("interleave", (7, 2, 3, 8), (7, 1, 1, 8)),  # SBND, S11D
    ],
)
def test_rotary_mul_autograd_matches_reference(npu: types.ModuleType, mode: str, x_shape, r_shape) -> None:
    x, cos, sin = leaf(*x_shape), leaf(*r_shape), leaf(*r_shape)
    upstream = torch.randn(*x_shape)
    rot = rotate_half if mode == "half" else rotate_interleave
    got = grads_of((npu.npu_rotary_mul(x, cos, sin, mode) * upstream).sum(), x, cos, sin)
    want = grads_of(((x * cos + rot(x) * sin) * upstream).sum(), x, cos, sin)
    for g, w in zip(got, want, strict=True):
        close(g, w)
    assert npu.calls["npu_rotary_mul_backward"] == 1


def test_rotary_mul_grads_keep_r_dtype_and_rotate_disables_backward(npu: types.ModuleType) -> None:
    x, cos, sin = leaf(1, 2, 3, 8, dtype=torch.bfloat16), leaf(1, 1, 3, 8), leaf(1, 1, 3, 8)
    npu.npu_rotary_mul(x, cos, sin).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and cos.grad.dtype == torch.float32
    out = npu.npu_rotary_mul(x, cos, sin, rotate=torch.eye(8))
    with pytest.raises(RuntimeError, match="rotate"):
        out.sum().backward()


@pytest.mark.parametrize(
    ("x_shape", "r_shape", "mode", "error"),
    [
        ((2, 3, 5, 7), (1, 1, 5, 7), "half", "even"),
        ((1, 1, 2, 898), (1, 1, 2, 898), "half", "at most 896"),
        ((5, 8), (5, 8), "half", "4-dimensional"),
        ((7, 3, 8), (7, 1, 8), "half", "4-dimensional"),  # TND is V2-only (unknown rules): refused
        ((1, 2, 3, 4, 8), (1, 1, 1, 4, 8), "half", "4-dimensional"),
        ((2, 3, 5, 8), (1, 1, 5, 8), "quarter", "half or interleave"),  # Ascend 950 only
        ((2, 3, 5, 8), (1, 1, 5, 4), "half", "should be equal"),  # half-dim cos
        ((2, 3, 5, 8), (1, 5, 8), "half", "4-dimensional"),
        ((2, 3, 5, 8), (1, 3, 5, 8), "half", "unknow input layout"),  # 1NSD is no layout
        ((2, 3, 5, 8), (1, 1, 1, 8), "half", "S lines unset"),  # does not span S
        ((2, 3, 5, 8), (2, 1, 5, 8), "interleave", "not supported"),  # B1SD is half-only
        ((2, 3, 5, 8), (1, 1, 2, 8), "half", "broadcast"),
        ((32, 8, 8, 64), (1, 1, 8, 64), "half", "please do not use"),  # BNSD, aligned D/2, B*N > 8*S
        ((2, 3, 5, 12), (1, 1, 5, 12), "half", "please do not use"),  # BNSD, D/2 unaligned, D < 80
        ((1000, 5, 2, 8), (1, 5, 1, 8), "half", "B < 1000"),
        ((40, 5, 25, 8), (1, 5, 1, 8), "interleave", "B\\*N < 1000"),
    ],
)
def test_rotary_mul_limits(npu: types.ModuleType, x_shape, r_shape, mode: str, error: str) -> None:
    with pytest.raises(RuntimeError, match=error):
        npu.npu_rotary_mul(torch.randn(*x_shape), torch.randn(*r_shape), torch.randn(*r_shape), mode)


def test_rotary_mul_grad_limit_applies_only_when_r_needs_grad(npu: types.ModuleType) -> None:
    x, r = torch.randn(33, 4, 32, 8), torch.randn(1, 4, 1, 8)  # BSND: B*N = 1056
    npu.npu_rotary_mul(x, r, r)
    npu.npu_rotary_mul(torch.randn(40, 4, 25, 8), r, r)  # B*N = 1000 is fine in half mode
    with pytest.raises(RuntimeError, match="1024"):
        npu.npu_rotary_mul(x, r.clone().requires_grad_(), r)
    with pytest.raises(RuntimeError, match=r"cos shape .* and sin shape .* differ"):
        npu.npu_rotary_mul(x, r, torch.randn(1, 1, 1, 8).expand(1, 4, 32, 8))


# ------------------------------------------------------------------------------------------------------------
# Fusion attention
# ------------------------------------------------------------------------------------------------------------

TRIU_2048 = torch.triu(torch.ones([2048, 2048]), diagonal=1).bool()  # HF's get_attn_mask_npu

# BNSD -> layout, and the output back to BNSD (given N).
FA_LAYOUTS = {
    "BNSD": (lambda t: t, lambda t, n: t),
    "BSND": (lambda t: t.transpose(1, 2), lambda t, n: t.transpose(1, 2)),
    "BSH": (lambda t: t.transpose(1, 2).flatten(2), lambda t, n: t.unflatten(2, (n, -1)).transpose(1, 2)),
    "SBH": (
        lambda t: t.permute(2, 0, 1, 3).flatten(2),
        lambda t, n: t.unflatten(2, (n, -1)).permute(1, 2, 0, 3),
    ),
}


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    masked: torch.Tensor | None = None,
    pse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain attention on fp32 [B, N, S, D] (masked: True = left out); query head h reads KV head
    h // (N / Nkv).

    Returns (out, row max, row sum of exp(s - max)); fully masked rows give out 0.
    """
    group = q.shape[1] // k.shape[1]
    heads = torch.tensor([h // group for h in range(q.shape[1])])
    k, v = k.index_select(1, heads), v.index_select(1, heads)
    s = torch.einsum("bnqd,bnkd->bnqk", q, k)
    s = (s if pse is None else s + pse) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    m = s.amax(-1, keepdim=True)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, m.squeeze(-1), torch.exp(s - m).sum(-1)


def band_masked(sq: int, skv: int, pre: int, nxt: int, delta: int = 0) -> torch.Tensor:
    """The op doc's band: triu(ones, next+1) | tril(ones, -pre-1) is masked, origin moved right by delta."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    return ones.triu(delta + nxt + 1) | ones.tril(delta - pre - 1)


def stats_of(row: torch.Tensor) -> torch.Tensor:
    return row.unsqueeze(-1).expand(*row.shape, 8)


def test_fusion_attention_schema_spelling_and_return(npu: types.ModuleType) -> None:
    """pre_tockens/next_tockens keep the schema's spelling; the int outputs are Python ints."""
    q = torch.randn(1, 2, 3, 8)
    result = npu.npu_fusion_attention(q, q, q, 2, "BNSD", pre_tockens=1, next_tockens=0)
    assert len(result) == 7 and [type(x) for x in result[4:]] == [int, int, int]
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'pre_tokens'"):
        npu.npu_fusion_attention(q, q, q, 2, "BNSD", pre_tokens=1)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_fusion_attention_layouts_gqa_and_backward(npu: types.ModuleType, layout: str) -> None:
    b, n, nkv, sq, skv, d, dv = 2, 4, 2, 5, 7, 16, 8
    q, k, v = leaf(b, n, sq, d), leaf(b, nkv, skv, d), leaf(b, nkv, skv, dv)
    to, back = FA_LAYOUTS[layout]
    out, smax, ssum, sout, seed, offset, numels = npu.npu_fusion_attention(
        to(q), to(k), to(v), n, layout.lower(), scale=0.3
    )
    ref, m, s = ref_attention(q, k, v, 0.3)
    close(back(out, n), ref)
    assert out.shape == to(ref).shape and out.is_contiguous()
    close(smax, stats_of(m))
    close(ssum, stats_of(s))
    assert sout.shape == (0,) and sout.dtype == torch.float32
    assert (seed, offset, numels) == (0, 0, b * n * sq * skv)
    weight = torch.randn(ref.shape)
    for actual, expected in zip(
        grads_of((back(out, n) * weight).sum(), q, k, v), grads_of((ref * weight).sum(), q, k, v), strict=True
    ):
        close(actual, expected)
    assert npu.calls == {"npu_fusion_attention": 1, "npu_fusion_attention_grad": 1}


def test_fusion_attention_without_a_mask_ignores_sparse_mode(npu: types.ModuleType) -> None:
    """§6.1 CRITICAL: without atten_mask, sparse_mode and pre/next do not take effect. scale defaults to 1."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    ref = ref_attention(q, k, v, 1.0)[0]
    for kwargs in ({"sparse_mode": 3}, {"sparse_mode": 2}, {"sparse_mode": 4, "pre_tockens": 0}, {}):
        close(npu.npu_fusion_attention(q, k, v, 2, "BNSD", next_tockens=0, **kwargs)[0], ref)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_fusion_attention_compressed_mask_rules(npu: types.ModuleType, mode: int, mask_dtype) -> None:
    """Modes 2-4 take the 2048x2048 mask as 'use the rule': left-up causal, right-down causal, band from
    the bottom-right (pre/next only count in mode 4)."""
    sq, skv, pre, nxt = 5, 8, 2, 1
    ones = torch.ones(sq, skv, dtype=torch.bool)
    masked = {2: ones.triu(1), 3: ones.triu(1 + skv - sq), 4: band_masked(sq, skv, pre, nxt, skv - sq)}[mode]
    q, k, v = torch.randn(2, 2, sq, 8), torch.randn(2, 1, skv, 8), torch.randn(2, 1, skv, 8)
    mask = TRIU_2048.to(mask_dtype)
    out, smax, ssum, *_ = npu.npu_fusion_attention(
        q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=mode, scale=0.5, pre_tockens=pre, next_tockens=nxt
    )
    ref, m, s = ref_attention(q, k, v, 0.5, masked)
    close(out, ref)
    close(smax, stats_of(m))
    close(ssum, stats_of(s))


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("mask_shape", ["SS", "11SS", "B1SS", "BNSS"])
def test_fusion_attention_full_masks(npu: types.ModuleType, mask_shape: str, mode: int) -> None:
    """True/1 = masked out; mode 0 also bands with pre/next from the top-left, mode 1 ignores them."""
    b, n, s, pre, nxt = 2, 2, 6, 1, 2
    dims = {"SS": (s, s), "11SS": (1, 1, s, s), "B1SS": (b, 1, s, s), "BNSS": (b, n, s, s)}[mask_shape]
    user = (torch.rand(dims) < 0.4) & ~torch.eye(s, dtype=torch.bool)  # the diagonal keeps every row live
    mask = user.to(torch.uint8) if mask_shape == "B1SS" else user
    q, k, v = (torch.randn(b, s, n, 8) for _ in range(3))
    out = npu.npu_fusion_attention(
        q, k, v, n, "BSND", atten_mask=mask, sparse_mode=mode, pre_tockens=pre, next_tockens=nxt, scale=0.4
    )[0]
    masked = user | band_masked(s, s, pre, nxt) if mode == 0 else user
    ref = ref_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.4, masked)[0]
    close(out, ref.transpose(1, 2))


def test_fusion_attention_fully_masked_rows_give_zero(npu: types.ModuleType) -> None:
    q, k, v = leaf(1, 2, 4, 8), leaf(1, 2, 4, 8), leaf(1, 2, 4, 8)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[1] = True
    out, smax, ssum, *_ = npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=1)
    ref = ref_attention(q, k, v, 1.0, mask)[0]
    close(out, ref)
    assert not out[:, :, 1].any()
    assert smax[:, :, 1].isneginf().all() and not ssum[:, :, 1].any()
    for actual, expected in zip(grads_of(out.sum(), q, k, v), grads_of(ref.sum(), q, k, v), strict=True):
        assert actual.isfinite().all()
        close(actual, expected)


@pytest.mark.parametrize("pse_shape", [(2, 4, 5, 6), (1, 4, 5, 6), (2, 4, 1, 6)])
def test_fusion_attention_pse_is_added_before_scale(npu: types.ModuleType, pse_shape: tuple) -> None:
    """pse_type 1: scale * (q k^T + pse); dpse comes back in pse's own (broadcast) shape."""
    q, k, v, pse = leaf(2, 4, 5, 8), leaf(2, 2, 6, 8), leaf(2, 2, 6, 8), leaf(*pse_shape)
    out = npu.npu_fusion_attention(
        q, k, v, 4, "BNSD", pse=pse, atten_mask=TRIU_2048, sparse_mode=3, scale=0.5
    )[0]
    ref = ref_attention(q, k, v, 0.5, torch.ones(5, 6, dtype=torch.bool).triu(2), pse)[0]
    close(out, ref)
    weight = torch.randn(ref.shape)
    inputs = (q, k, v, pse)
    for actual, expected in zip(
        grads_of((out * weight).sum(), *inputs), grads_of((ref * weight).sum(), *inputs), strict=True
    ):
        close(actual, expected)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_fusion_attention_tnd_varlen(npu: types.ModuleType, softmax_layout: str) -> None:
    """Cumulative offsets without the leading 0; each sequence attends within itself with its own Δ."""
    n, nkv, d, qlen, kvlen = 4, 2, 8, [2, 5, 9], [3, 6, 12]
    q, k, v = leaf(9, n, d), leaf(12, nkv, d), leaf(12, nkv, d)
    out, smax, ssum, _, seed, offset, numels = npu.npu_fusion_attention(
        q,
        k,
        v,
        n,
        "TND",
        atten_mask=TRIU_2048,
        sparse_mode=3,
        scale=0.35,
        actual_seq_qlen=qlen,
        actual_seq_kvlen=kvlen,
        softmax_layout=softmax_layout,
    )
    refs, maxes = [], []
    bounds = zip(itertools.pairwise([0, *qlen]), itertools.pairwise([0, *kvlen]), strict=True)
    for (q0, q1), (k0, k1) in bounds:
        bnsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1])]
        masked = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).triu(1 + (k1 - k0) - (q1 - q0))
        ref, m, _ = ref_attention(*bnsd, 0.35, masked)
        refs.append(ref[0].transpose(0, 1))
        maxes.append(m[0])
    ref, row_max = torch.cat(refs), torch.cat(maxes, dim=1)  # [T, N, D], [N, T]
    close(out, ref)
    # softmax_max is [T, N, 8] either way; the default memory order is NTD (§6.1).
    expected = stats_of(row_max.T) if softmax_layout == "TND" else stats_of(row_max).reshape(9, n, 8)
    close(smax, expected)
    assert ssum.shape == (9, n, 8) and (seed, offset, numels) == (0, 0, n * (2 * 3 + 3 * 3 + 4 * 6))
    weight = torch.randn(ref.shape)
    for actual, expected in zip(
        grads_of((out * weight).sum(), q, k, v), grads_of((ref * weight).sum(), q, k, v), strict=True
    ):
        close(actual, expected)


def test_fusion_attention_tnd_without_mask_and_disabled_batches(npu: types.ModuleType) -> None:
    """No mask: full attention inside each sequence. A repeated offset is an empty batch; trailing zeros
    disable batches (numels follows the C++ adapter's formula over the lists as given)."""
    q, k, v = (torch.randn(7, 2, 8) for _ in range(3))
    out, *_, numels = npu.npu_fusion_attention(
        q, k, v, 2, "TND", sparse_mode=3, actual_seq_qlen=[3, 3, 7, 0], actual_seq_kvlen=[3, 3, 7, 0]
    )
    for lo, hi in ((0, 3), (3, 7)):
        bnsd = [t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        close(out[lo:hi], ref_attention(*bnsd, 1.0)[0][0].transpose(0, 1))
    assert numels == 2 * (3 * 3 + 0 + 4 * 4 + 7 * 7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fusion_attention_half_dtypes(npu: types.ModuleType, dtype: torch.dtype) -> None:
    """fp32 softmax inside; out and grads in the input dtype, statistics fp32."""
    q, k, v = leaf(1, 8, 2, 16, dtype=dtype), leaf(1, 8, 1, 16, dtype=dtype), leaf(1, 8, 1, 16, dtype=dtype)
    out, smax, ssum, sout, *_ = npu.npu_fusion_attention(
        q, k, v, 2, "BSND", atten_mask=TRIU_2048, sparse_mode=2, scale=0.25
    )
    assert smax.dtype == ssum.dtype == torch.float32 and sout.dtype == dtype
    fq, fk, fv = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = ref_attention(fq, fk, fv, 0.25, torch.ones(8, 8, dtype=torch.bool).triu(1))[0]
    close(out, ref.transpose(1, 2).to(dtype))
    weight = torch.randn(ref.shape)
    for actual, expected in zip(
        grads_of((out.float() * weight.transpose(1, 2)).sum(), q, k, v),
        grads_of((ref * weight).sum(), fq, fk, fv),
        strict=True,
    ):
        close(actual, expected.transpose(1, 2).to(dtype))


def test_fusion_attention_grad_reads_the_saved_statistics(npu: types.ModuleType) -> None:
    """As on the device, P is rebuilt from softmax_max/softmax_sum (ring attention passes merged ones)."""
    q, k, v = leaf(1, 2, 5, 8), leaf(1, 2, 5, 8), leaf(1, 2, 5, 8)
    out, smax, ssum, sout, *_, numels = npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5)
    dy = torch.randn(out.shape)
    saved = {"softmax_sum": ssum, "softmax_in": sout, "attention_in": out.detach(), "scale_value": 0.5}
    dq, dk, dv, dpse, dsink = npu.npu_fusion_attention_grad(
        q, k, v, dy, 2, "BNSD", softmax_max=smax, numels=numels, **saved
    )
    assert dpse is None and dsink is None
    ref = ref_attention(q, k, v, 0.5)[0]
    for actual, expected in zip((dq, dk, dv), grads_of((ref * dy).sum(), q, k, v), strict=True):
        close(actual, expected)
    doubled = npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BNSD", softmax_max=smax - math.log(2), **saved)
    close(doubled[2], 2 * dv)  # a max lower by log 2 doubles P, hence dv
    with pytest.raises(NotImplementedError, match="softmax_max"):
        npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BNSD", attention_in=out)
    assert npu.calls == {"npu_fusion_attention": 1, "npu_fusion_attention_grad": 3}


def fa_call(
    npu: types.ModuleType,
    layout: str = "BSND",
    q: tuple | torch.Tensor = (1, 4, 2, 16),
    k: tuple | torch.Tensor | None = None,
    v: tuple | torch.Tensor | None = None,
    head_num: int = 2,
    **kwargs,
) -> tuple:
    """npu_fusion_attention on random tensors of the given shapes (or the given tensors)."""
    k = q if k is None else k
    v = k if v is None else v
    q, k, v = (torch.randn(t) if isinstance(t, tuple) else t for t in (q, k, v))
    return npu.npu_fusion_attention(q, k, v, head_num, layout, **kwargs)


TND = {"layout": "TND", "q": (6, 2, 16), "actual_seq_qlen": [6], "actual_seq_kvlen": [6]}
FA_LIMITS = {
    "layout": ({"layout": "NSD"}, "input_layout should be BSH/SBH/BNSD/BSND/TND"),
    "rank": ({"q": (4, 2, 16)}, "needs a 4-D query"),
    "keep_prob_0": ({"keep_prob": 0.0}, r"keep_prob value must be in range of \(0, 1\]"),
    "keep_prob_big": ({"keep_prob": 1.5}, r"keep_prob value must be in range of \(0, 1\]"),
    "sparse_mode": ({"sparse_mode": 7}, r"range of \[0,6\]"),
    "tnd_sparse_mode": ({**TND, "sparse_mode": 5}, r"range of \[0,5\) or \(5,8\]"),
    "head_num": ({"head_num": 3}, "query has 2 heads but head_num=3"),
    "heads_max": ({"q": (1, 4, 257, 8), "head_num": 257}, r"head_num=257 must be in 1\.\.256"),
    "d_max": ({"q": (1, 2, 1, 769), "head_num": 1}, "head dim D=769"),
    "dv_gt_d": ({"v": (1, 4, 2, 32)}, "value head dim 32"),
    "dk_ne_dq": ({"k": (1, 4, 2, 8)}, "head dims differ"),
    "gqa": ({"q": (1, 4, 3, 16), "k": (1, 4, 2, 16), "head_num": 3}, "3 query heads are not a multiple of 2"),
    "kv_shapes": ({"k": (1, 4, 2, 16), "v": (1, 5, 2, 16)}, "must match outside the last dim"),
    "dtypes": ({"k": torch.randn(1, 4, 2, 16).half()}, "must share one dtype"),
    "int_dtype": ({"q": torch.ones(1, 4, 2, 16, dtype=torch.int32)}, "unsupported dtype"),
    "bsh_heads": ({"layout": "BSH", "q": (1, 4, 30), "head_num": 4}, "not head_num=4 heads"),
    "mask_dtype": ({"atten_mask": torch.zeros(4, 4)}, "bool or uint8"),
    "mask_shape": ({"atten_mask": torch.zeros(2, 4, 4, dtype=torch.bool)}, "BNSS, B1SS, 11SS or SS"),
    "mode3_mask": ({"atten_mask": torch.ones(4, 4).triu(1).bool(), "sparse_mode": 3}, "2048x2048"),
    "mode3_sq_gt_skv": (
        {"k": (1, 2, 2, 16), "atten_mask": TRIU_2048, "sparse_mode": 3},
        "sparse_mode=3 requires Sq <= Skv",
    ),
    "tnd_lists": ({**TND, "actual_seq_kvlen": None}, "must be the same and cannot be empty"),
    "tnd_lengths": ({**TND, "actual_seq_kvlen": [3, 6]}, "must be the same and cannot be empty"),
    "tnd_cumulative": ({**TND, "actual_seq_qlen": [4, 2], "actual_seq_kvlen": [3, 6]}, "cumulative"),
    "tnd_past_t": ({**TND, "actual_seq_qlen": [7]}, "past T"),
    "pse_dtype": ({"pse": torch.zeros(1, 2, 4, 4, dtype=torch.float16)}, "pse dtype"),
}


@pytest.mark.parametrize(("kwargs", "error"), FA_LIMITS.values(), ids=FA_LIMITS.keys())
def test_fusion_attention_limits_raise(npu: types.ModuleType, kwargs: dict, error: str) -> None:
    with pytest.raises(RuntimeError, match=error) as raised:
        fa_call(npu, **kwargs)
    assert raised.type is RuntimeError


FA_UNMODELLED = {
    "dropout": {"keep_prob": 0.9},
    "padding_mask": {"padding_mask": torch.zeros(1, 1, 4, 4, dtype=torch.bool)},
    "prefix": {"prefix": [1]},
    "dropout_mask": {"dropout_mask": torch.zeros(8, dtype=torch.uint8)},
    "prefix_mode": {"sparse_mode": 5},
    "tnd_full_mask": {**TND, "atten_mask": torch.zeros(6, 6, dtype=torch.bool)},
    "tnd_pse": {**TND, "pse": torch.zeros(1, 2, 6, 6)},
    "pse_shape": {"pse": torch.zeros(1, 1, 4, 4)},
    "other_compressed_mask": {"atten_mask": ~TRIU_2048, "sparse_mode": 2},
    "softmax_layout": {"softmax_layout": "TND"},
    "varlen_bsnd": {"actual_seq_qlen": [4], "actual_seq_kvlen": [4]},
    "tnd_short_lists": {**TND, "actual_seq_qlen": [5], "actual_seq_kvlen": [5]},
    "inner_precise": {"inner_precise": 3},
}


@pytest.mark.parametrize("kwargs", FA_UNMODELLED.values(), ids=FA_UNMODELLED.keys())
def test_fusion_attention_unmodelled_paths_refuse(npu: types.ModuleType, kwargs: dict) -> None:
    with pytest.raises(NotImplementedError, match="torch_npu stand-in"):
        fa_call(npu, **kwargs)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_fusion_attention_sink_is_an_extra_logit_with_its_gradient(
    npu: types.ModuleType, layout: str
) -> None:
    """op doc: softmax(cat([scale*QK^T, sink]))[..., :-1] @ V, with the band of sparse_mode 4 (GQA 4:2);
    the grad op returns dsink (7.3.0's schema), which reaches the sink through autograd."""
    q, k, v = leaf(1, 4, 6, 8), leaf(1, 2, 6, 8), leaf(1, 2, 6, 8)
    sink = torch.randn(4).requires_grad_()
    masked = band_masked(6, 6, pre=2, nxt=0)
    scores = torch.einsum("bnqd,bnkd->bnqk", q, k.repeat_interleave(2, 1)) * 0.5
    logits = torch.cat(
        [scores.masked_fill(masked, float("-inf")), sink.view(1, 4, 1, 1).expand(1, 4, 6, 1)], -1
    )
    ref = torch.softmax(logits, -1)[..., :-1] @ v.repeat_interleave(2, 1)
    to_layout, back = (lambda t: t[0].transpose(0, 1), lambda t: t.transpose(0, 1)[None])
    if layout == "BSND":
        to_layout, back = (lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2))
    extra = {"actual_seq_qlen": [6], "actual_seq_kvlen": [6]} if layout == "TND" else {}
    out = npu.npu_fusion_attention(
        *(to_layout(t) for t in (q, k, v)), 4, layout, atten_mask=TRIU_2048, sparse_mode=4,
        pre_tockens=2, next_tockens=0, scale=0.5, sink=sink, **extra,
    )[0]  # fmt: skip
    close(back(out), ref)
    dy = torch.randn(ref.shape)
    for actual, expected in zip(
        grads_of((back(out) * dy).sum(), q, k, v, sink),
        grads_of((ref * dy).sum(), q, k, v, sink),
        strict=True,
    ):
        close(actual, expected)
    with pytest.raises(RuntimeError, match="sink must be float32"):
        fa_call(npu, sink=torch.zeros(2, dtype=torch.bfloat16))


def test_fusion_attention_sink_is_refused_before_op_plugin_7_3() -> None:
    """7.2.0's op_plugin_functions.yaml has no sink: the keyword is unknown to the op."""
    old = make_torch_npu(profile="a2-2.7.1")
    with pytest.raises(RuntimeError, match="sink"):
        fa_call(old, sink=torch.zeros(2))


# ------------------------------------------------------------------------------------------------------------
# Grouped matmul
# ------------------------------------------------------------------------------------------------------------


def ref_moe_gmm(x, w_ekn, counts, bias=None) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w_ekn.shape[2])
    start = 0
    for e, c in enumerate(counts):
        y = x[start : start + c].float() @ w_ekn[e].float()
        out[start : start + c] = y if bias is None else y + bias[e].float()
        start += c
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group_list_type", "split_item"), [(1, 3), (0, 2), (0, 3)])
def test_grouped_matmul_moe_golden(npu, dtype: torch.dtype, group_list_type: int, split_item: int) -> None:
    counts = [3, 0, 4]  # 7 of 10 rows: the device never writes the tail rows (uninitialised: NaN here)
    x, w = torch.randn(10, 6).to(dtype), torch.randn(3, 6, 5).to(dtype)
    bias = torch.randn(3, 5).to(torch.float16 if dtype == torch.float16 else torch.float32)
    group_list = torch.tensor(counts if group_list_type == 1 else [3, 3, 7], dtype=torch.int64)
    out = npu.npu_grouped_matmul(
        [x],
        [w],
        bias=list(bias),
        group_list=group_list,
        group_list_type=group_list_type,
        split_item=split_item,
        group_type=0,
    )
    assert isinstance(out, list) and len(out) == 1
    close(out[0][:7], ref_moe_gmm(x, w, counts, bias)[:7])
    assert out[0][7:].isnan().all()


def test_grouped_matmul_split_outputs_treat_group_list_as_cumulative(npu: types.ModuleType) -> None:
    x, w = torch.randn(7, 6), torch.randn(3, 6, 5)
    outs = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([3, 3, 7]), split_item=0, group_type=0)
    assert [o.shape for o in outs] == [(3, 5), (0, 5), (4, 5)]
    close(torch.cat(outs), ref_moe_gmm(x, w, [3, 0, 4]))
    # The C++ pitfall: counts [1, 2, 3] with split_item 0/1 are read as offsets 1, 2, 3.
    outs = npu.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor([1, 2, 3]), group_list_type=1, split_item=1, group_type=0
    )
    assert [o.shape[0] for o in outs] == [1, 1, 1]
    close(outs[2], x[2:3] @ w[2])


def test_grouped_matmul_transposed_weights_and_ungrouped_lists(npu: types.ModuleType) -> None:
    x, w_enk = torch.randn(6, 4), torch.randn(2, 5, 4)  # HF nn.Linear layout [E, N, K]
    (out,) = npu.npu_grouped_matmul(
        [x], [w_enk.transpose(1, 2)], group_list=torch.tensor([2, 6]), split_item=3, group_type=0
    )
    close(out, torch.cat([x[:2] @ w_enk[0].T, x[2:] @ w_enk[1].T]))
    xs, ws = [torch.randn(3, 4), torch.randn(2, 4)], [torch.randn(4, 5), torch.randn(4, 6)]
    outs = npu.npu_grouped_matmul(xs, ws, bias=[torch.randn(5), torch.randn(6)], group_type=-1)
    assert len(outs) == 2 and outs[1].shape == (2, 6)
    close(npu.npu_grouped_matmul(xs, ws, group_type=-1)[0], xs[0] @ ws[0])
    (joined,) = npu.npu_grouped_matmul(xs, [ws[0], ws[0]], group_type=-1, split_item=2)
    close(joined, torch.cat(xs) @ ws[0])


def test_grouped_matmul_k_split_gives_weight_gradients(npu: types.ModuleType) -> None:
    x, dy, counts = torch.randn(9, 4), torch.randn(9, 5), [2, 4, 3]
    (dw,) = npu.npu_grouped_matmul(
        [x.T], [dy], group_list=torch.tensor(counts), group_list_type=1, split_item=3, group_type=2
    )
    starts = [0, 2, 6, 9]
    want = torch.stack([x[s:e].T @ dy[s:e] for s, e in itertools.pairwise(starts)])
    close(dw, want)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"group_list": torch.tensor([3, 6])}, "Requires manual passing group_type"),
        ({"group_list": torch.tensor([3, 6], dtype=torch.int32), "group_type": 0}, "int64"),
        ({"group_list": torch.tensor([3, 7]), "group_type": 0, "split_item": 3}, "covers 7 > 6"),
        ({"group_list": torch.tensor([4, 3]), "group_type": 0, "split_item": 3}, "non-decreasing"),
        ({"group_list": torch.tensor([1] * 1025), "group_type": 0}, "1024"),
        ({"group_list": torch.tensor([3, 6]), "group_type": 1}, "group_type"),
        ({"group_list": torch.tensor([3, 6]), "group_type": 0, "split_item": 4}, "split_item"),
        (
            {"group_list": torch.tensor([3, 6]), "group_type": 0, "bias": [torch.randn(5).bfloat16()] * 2},
            "bias",
        ),
        ({"group_list": torch.tensor([3, 6]), "group_type": 0, "scale": [torch.ones(5)]}, "quantised"),
        ({"group_list": [3, 6], "group_type": 0}, "Expected a value of type 'Optional\\[Tensor\\]'"),
    ],
)
def test_grouped_matmul_limits(npu: types.ModuleType, kwargs: dict, error: str) -> None:
    x, w = torch.randn(6, 4).bfloat16(), torch.randn(2, 4, 5).bfloat16()
    with pytest.raises(RuntimeError, match=error):
        npu.npu_grouped_matmul([x], [w], **kwargs)


def test_grouped_matmul_rejects_bare_tensors_and_wide_dims(npu: types.ModuleType) -> None:
    with pytest.raises(RuntimeError, match="Expected a value of type 'List\\[Tensor\\]'"):
        npu.npu_grouped_matmul(torch.randn(6, 4), [torch.randn(4, 5)], group_type=-1)
    with pytest.raises(RuntimeError, match="65536"):
        npu.npu_grouped_matmul([torch.randn(1, 1)], [torch.randn(1, 65536)], group_type=-1)


def test_grouped_matmul_gives_silently_no_gradient(npu: types.ModuleType) -> None:
    x, w = leaf(6, 4), leaf(2, 4, 5)
    out = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([3, 6]), split_item=3, group_type=0)
    assert out[0].grad_fn is not None

    def loss() -> torch.Tensor:
        groups = torch.tensor([3, 6])
        return npu.npu_grouped_matmul([x], [w], group_list=groups, split_item=3, group_type=0)[0].sum()

    assert_silent_no_grad(loss, x, w)


# ------------------------------------------------------------------------------------------------------------
# MoE routing
# ------------------------------------------------------------------------------------------------------------


def ref_stable_order(flat: list[int]) -> list[int]:
    return sorted(range(len(flat)), key=lambda f: (flat[f], f))


def test_token_permute_and_unpermute_golden(npu: types.ModuleType) -> None:
    tokens, topk = torch.randn(5, 4), 2
    indices = torch.tensor([[3, 1], [0, 3], [1, 1], [2, 0], [3, 2]])
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    order = ref_stable_order(indices.flatten().tolist())
    assert torch.equal(permuted, tokens[[f // topk for f in order]])
    assert sorted_indices.dtype == torch.int32
    for f in range(10):  # the inverse permutation
        assert torch.equal(permuted[sorted_indices[f]], tokens[f // topk])
    probs = torch.rand(5, 2)
    out = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    want = torch.stack(
        [sum(probs[t, k] * permuted[sorted_indices[t * 2 + k]] for k in range(2)) for t in range(5)]
    )
    close(out, want)
    close(npu.npu_moe_token_unpermute(permuted, sorted_indices, torch.full((5, 2), 0.5)), tokens)
    short, _ = npu.npu_moe_token_permute(tokens, indices, num_out_tokens=6)
    assert torch.equal(short, permuted[:6])
    single, single_idx = npu.npu_moe_token_permute(tokens.bfloat16(), indices[:, 0].int())
    assert single.dtype == torch.bfloat16 and torch.equal(
        npu.npu_moe_token_unpermute(single, single_idx), tokens.bfloat16()
    )


def test_token_permute_unpermute_autograd(npu: types.ModuleType) -> None:
    tokens, probs = leaf(6, 4), leaf(6, 2)
    indices = torch.tensor([[1, 0], [2, 1], [0, 2], [1, 2], [0, 1], [2, 0]])
    upstream = torch.randn(6, 4)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices, num_out_tokens=10)
    loss = (npu.npu_moe_token_unpermute(permuted * 3, sorted_indices, probs) * upstream).sum()
    got = grads_of(loss, tokens, probs)
    order = torch.tensor(ref_stable_order(indices.flatten().tolist()))
    ref_permuted = torch.cat([tokens[order[:10] // 2], torch.zeros(2, 4)]) * 3  # dropped copies read zero
    inverse = torch.argsort(order)
    ref_out = (ref_permuted[inverse].reshape(6, 2, 4) * probs.unsqueeze(-1)).sum(1)
    want = grads_of((ref_out * upstream).sum(), tokens, probs)
    for g, w in zip(got, want, strict=True):
        close(g, w)
    assert (
        npu.calls["npu_moe_token_permute_grad_v2"] == 1 and npu.calls["npu_moe_token_unpermute_grad_v2"] == 1
    )


def test_a_kernel_keeps_its_own_dtypes_under_the_callers_autocast(npu):
    """The device computes below autocast: under a CPU bf16 autocast (a Trainer's mixed precision),
    npu_fusion_attention still returns its softmax statistics in fp32, and its backward, which checks
    them, runs. The stand-in once ran its kernels under the caller's autocast and failed here."""
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, softmax_max, softmax_sum, *_ = npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.25)
    assert out.dtype == torch.bfloat16
    assert softmax_max.dtype == softmax_sum.dtype == torch.float32
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
