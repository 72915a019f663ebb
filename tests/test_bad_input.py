"""Bad input to a compiled quantized model: it raises the error eager raises (the same type, a message
that names the problem) or returns what eager returns, and where the input is valid the linear still
went through qfuse's fused op, not around it.

Forms (each as model code writes it): a hand-written dynamic per-token int8 linear, a static
per-tensor one with a Python-number scale, a PT2E Q/DQ linear, a bf16 int8 weight-only linear and
an fp8 `_scaled_mm` linear. Wrong devices cannot be tried on a CPU-only machine; tests/test_cuda.py
runs the forms on CUDA tensors.
"""

import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
import torch.nn.functional as F

import qfuse
from tests.helpers import FLOAT_WRITTEN_INT8

qd = torch.ops.quantized_decomposed
FP8 = torch.float8_e4m3fn
K, N = 32, 24


def dynamic_int8(x, w, w_scale, bias):
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / 127.0
    q = torch.clamp(torch.round(x / s), -128, 127).to(torch.int8)
    y = torch._int_mm(q.reshape(-1, q.shape[-1]), w.t()).to(torch.float32) * s.reshape(-1, 1) * w_scale
    return (y + bias).reshape(*x.shape[:-1], w.shape[0])


def static_int8(x, w, w_scale, bias):
    q = torch.clamp(torch.round(x / 0.05), -128, 127).to(torch.int8)
    return torch._int_mm(q, w.t()).to(torch.float32) * 0.05 * w_scale + bias


def pt2e(x, w, w_scale, bias):
    q = qd.quantize_per_tensor(x, 0.05, 3, -128, 127, torch.int8)
    x_hat = qd.dequantize_per_tensor(q, 0.05, 3, -128, 127, torch.int8)
    w_hat = qd.dequantize_per_channel(w, w_scale, torch.zeros(w.shape[0], dtype=torch.int64), 0, -128, 127, torch.int8)
    return F.linear(x_hat, w_hat, bias)


def weight_only(x, w, w_scale, bias):
    return F.linear(x, w.to(x.dtype) * w_scale.to(x.dtype)[:, None], bias.to(x.dtype))


def fp8(x, w, w_scale, bias):
    s = x.abs().amax(dim=-1, keepdim=True) / 448.0
    q = (x / s).clamp(-448, 448).to(FP8)
    one = torch.ones(())
    y = torch._scaled_mm(q, w.to(FP8).t(), one, one, out_dtype=torch.float32)
    return y * s * w_scale + bias


FORMS = {dynamic_int8: torch.float32, static_int8: torch.float32, pt2e: torch.float32,
         weight_only: torch.bfloat16, fp8: torch.float32}


def operands(form, rows=5, k=K):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=generator).to(FORMS[form])
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    return x, w, torch.rand(N, generator=generator) * 0.01 + 0.001, torch.randn(N, generator=generator)


def run_all(form, *args):
    """(eager's, plain Inductor's and qfuse's result or exception, qfuse's reports)."""
    def attempt(function):
        try:
            return function(*args)
        except Exception as error:  # noqa: BLE001 - compared below
            return error

    with torch.no_grad():
        expected = attempt(form)
        torch._dynamo.reset()
        inductor = attempt(torch.compile(form))
        torch._dynamo.reset()
        marker = qfuse.graphs_compiled()
        options = FLOAT_WRITTEN_INT8 if form is pt2e else {}  # the rewrite under test, on any CPU
        got = attempt(torch.compile(form, backend="qfuse", options=options or None))
    return expected, inductor, got, qfuse.reports_since(marker)


def assert_raises_like_eager(form, *args, naming: str):
    expected, _, got, _ = run_all(form, *args)
    assert isinstance(expected, Exception), f"eager returned; the case is no bad input: {expected}"
    assert isinstance(got, type(expected)), f"eager raises {expected!r}, qfuse {got!r}"
    assert naming in str(got), f"{naming!r} not in {got}"


def close(got, expected) -> bool:
    if isinstance(expected, Exception):
        return False
    tolerance = 3e-2 if got.dtype == torch.bfloat16 else 1e-4
    return got.shape == expected.shape and got.dtype == expected.dtype and torch.allclose(
        got.float(), expected.float(), rtol=tolerance, atol=tolerance, equal_nan=True)


def assert_returns_like_eager(form, *args, fused=True):
    """qfuse returns eager's result, or, where plain Inductor's differs from eager's (its code casts
    nan to int8 -128, eager to 0), Inductor's: the quantizer there is Inductor's code."""
    expected, inductor, got, reports = run_all(form, *args)
    assert not isinstance(expected, Exception), expected
    assert not isinstance(got, Exception), got
    assert close(got, expected) or (not close(inductor, expected) and close(got, inductor)), (got, expected, inductor)
    if fused:
        assert any(report.fused for report in reports), [report.summary() for report in reports]


@pytest.mark.parametrize("form", list(FORMS), ids=lambda form: form.__name__)
def test_wrong_k(form):
    x, w, w_scale, bias = operands(form, k=K + 3)
    assert_raises_like_eager(form, x, w, w_scale, bias, naming=str(K + 3))


@pytest.mark.parametrize("form", [dynamic_int8, static_int8], ids=lambda form: form.__name__)
def test_weight_of_the_wrong_dtype(form):
    x, w, w_scale, bias = operands(form)
    assert_raises_like_eager(form, x, w.to(torch.int16), w_scale, bias, naming="int16")


# (PT2E's dequantize_per_channel takes a scale of another length without an error in eager)
@pytest.mark.parametrize("form", [dynamic_int8, static_int8, weight_only], ids=lambda form: form.__name__)
def test_weight_scale_of_the_wrong_shape(form):
    x, w, _, bias = operands(form)
    assert_raises_like_eager(form, x, w, torch.rand(N + 1), bias, naming=str(N + 1))


@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("form", list(FORMS), ids=lambda form: form.__name__)
def test_non_contiguous_activations(form, layout):
    x, w, w_scale, bias = operands(form, rows=7)
    if layout == "transposed":
        x = x.t().contiguous().t()
    else:
        x = torch.cat([x, x], dim=1)[:, ::2]
    assert not x.is_contiguous()
    assert_returns_like_eager(form, x, w, w_scale, bias)


@pytest.mark.parametrize("shape", [(0, K), (2, 0, K)], ids=["M0", "3D_empty"])
def test_empty_batches(shape):
    x = torch.randn(shape)
    _, w, w_scale, bias = operands(dynamic_int8)
    assert_returns_like_eager(dynamic_int8, x, w, w_scale, bias)


@pytest.mark.parametrize("form", [static_int8, pt2e, weight_only], ids=lambda form: form.__name__)
def test_empty_batch_2d(form):
    x, w, w_scale, bias = operands(form, rows=0)
    assert_returns_like_eager(form, x, w, w_scale, bias)


@pytest.mark.parametrize("special", [float("inf"), -float("inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("form", list(FORMS), ids=lambda form: form.__name__)
def test_inf_and_nan_in_the_activation(form, special):
    x, w, w_scale, bias = operands(form)
    x[2, 5] = special
    assert_returns_like_eager(form, x, w, w_scale, bias)


DEQUANTIZED_FIRST_INF = pytest.mark.xfail(strict=True, reason=(
    "an inf weight scale where the weight is dequantized before the matmul (PT2E): eager sums +inf and "
    "-inf products to nan, the fused op scales the exact integer sum to +-inf; not fixed, since a scale "
    "computed per call would defeat the kernels' weights prepared once"))


WEIGHT_SCALE_CASES = [
    pytest.param(form, special, id=f"{form.__name__}-{name}",
                 marks=[DEQUANTIZED_FIRST_INF] if (form, name) == (pt2e, "inf") else [])
    for form in FORMS for name, special in (("inf", float("inf")), ("nan", float("nan")))
]


@pytest.mark.parametrize("form, special", WEIGHT_SCALE_CASES)
def test_inf_and_nan_in_the_weight_scale(form, special):
    x, w, w_scale, bias = operands(form)
    w_scale[3] = special
    assert_returns_like_eager(form, x, w, w_scale, bias)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=["fp64", "fp16"])
@pytest.mark.parametrize("form", list(FORMS), ids=lambda form: form.__name__)
def test_activation_of_another_dtype(form, dtype):
    """Whatever eager does with it: raise (the same error type, or, as Dynamo wraps an error raised
    while tracing, plain Inductor's, with eager's message) or compute (the same result). Where plain
    Inductor alone refuses it (its PT2E quantize lowering takes float32 only), qfuse raises as it does."""
    x, w, w_scale, bias = operands(form)
    x = x.to(dtype)
    expected, inductor, got, _ = run_all(form, x, w, w_scale, bias)
    if isinstance(expected, Exception):
        assert isinstance(got, type(expected)) or type(got) is type(inductor), f"eager raises {expected!r}, qfuse {got!r}"
        assert str(expected) in str(got)
    elif isinstance(inductor, Exception):
        assert type(got) is type(inductor), f"Inductor raises {inductor!r}, qfuse {got!r}"
    else:
        assert not isinstance(got, Exception), got
        assert close(got, expected) or (not close(inductor, expected) and close(got, inductor)), (got, expected)
