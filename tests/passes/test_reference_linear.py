"""reference_linear: hand-written W8A8 linears are rewritten to qfuse::scaled_mm, and match eager."""

import pytest
import torch

import qfuse
from qfuse.passes.families import reference_linear
from tests.helpers import compile_and_run
from tests.passes.post_grad import run_family

FP8 = torch.float8_e4m3fn
SCALED_MM = "qfuse.scaled_mm.default"


def dynamic_int8(x, eps=1e-5, low=-128):
    s = x.abs().amax(dim=-1, keepdim=True)
    s = (s.clamp(min=eps) if eps else s) / 127.0
    return torch.clamp(torch.round(x / s), low, 127).to(torch.int8), s


def dynamic_fp8(x):
    s = x.abs().amax(dim=-1, keepdim=True) / 448.0
    return (x / s).clamp(-448, 448).to(FP8), s


def int_mm_linear(x, w, w_scale, bias):
    """The most common form: per-token int8 activation, [N, K] weight, 3D-capable."""
    q, s = dynamic_int8(x)
    y = torch._int_mm(q.reshape(-1, q.shape[-1]), w.t())
    y = y.to(torch.float32) * s.reshape(-1, 1) * w_scale
    return (y + bias).reshape(*x.shape[:-1], -1)


def int_mm_weight_first(x, w, w_scale, bias):
    """Scales in the other order, no eps clamp, symmetric clamp, bf16 output, 2D only."""
    q, s = dynamic_int8(x, eps=0.0, low=-127)
    return (w_scale * (torch._int_mm(q, w.t()).float() * s)).to(torch.bfloat16)


def int_mm_premultiplied(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return torch._int_mm(q, w.t()) * (s * w_scale.reshape(1, -1)) + bias


def int_mm_static_float_scale(x, w, w_scale, bias):
    q = torch.clamp(torch.round(x / 0.05), -128, 127).to(torch.int8)
    return torch._int_mm(q, w.t()).float() * 0.05 * w_scale


def int_mm_static_tensor_scale_kn_weight(x, w, w_scale, bias):
    scale = torch.tensor(0.04)
    q = torch.clamp(torch.round(x / scale), -128, 127).to(torch.int8)
    w_kn = w.t().contiguous()
    return (torch._int_mm(q, w_kn).float() * scale * w_scale + bias).to(torch.bfloat16)


def float_mm_of_upcast(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return (q.float() @ w.float().t()) * s * w_scale + bias


def fp8_scaled_mm(x, w, w_scale, bias):
    q, s = dynamic_fp8(x.reshape(-1, x.shape[-1]))
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(q, w.to(FP8).t(), one, one, out_dtype=torch.float32)
    return (y * s * w_scale + bias).to(torch.bfloat16).reshape(*x.shape[:-1], -1)


FORMS = {
    int_mm_linear: "_int_mm + dequant epilogue",
    int_mm_weight_first: "_int_mm + dequant epilogue",
    int_mm_premultiplied: "_int_mm + dequant epilogue",
    int_mm_static_float_scale: "_int_mm + dequant epilogue",
    int_mm_static_tensor_scale_kn_weight: "_int_mm + dequant epilogue",
    float_mm_of_upcast: "float mm of upcast + dequant epilogue",
    fp8_scaled_mm: "_scaled_mm + dequant epilogue",
}
TWO_D_ONLY = {int_mm_weight_first, int_mm_premultiplied, int_mm_static_float_scale,
              int_mm_static_tensor_scale_kn_weight, float_mm_of_upcast}


def operands(shape, n=48, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(*shape, generator=generator)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    w_scale = torch.rand(n, generator=generator) * 0.01 + 0.001
    bias = torch.randn(n, generator=generator)
    return x, w, w_scale, bias


def fp8_weight(w):
    return (w.float() / 127 * 400).to(FP8)


def assert_close(out, expected):
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[expected.dtype]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernel", ["torch", "reference"])
@pytest.mark.parametrize("shape", [(1, 64), (17, 64), (2, 7, 64)], ids=["M1", "M17", "3D"])
@pytest.mark.parametrize("form", list(FORMS), ids=lambda form: form.__name__)
def test_form_is_fused_and_matches_eager(form, shape, kernel):
    if len(shape) == 3 and form in TWO_D_ONLY:
        pytest.skip("this form is written for 2D inputs")
    x, w, w_scale, bias = operands(shape)
    if form is fp8_scaled_mm:
        w = fp8_weight(w)
    out, report = compile_and_run(form, x, w, w_scale, bias, kernel=kernel)
    (record,) = report.records
    assert record.fused and record.kernel == kernel and record.pattern.startswith(FORMS[form])
    assert report.ops_after[SCALED_MM] + report.ops_after["qfuse.quant_scaled_mm.default"] == 1
    for original in ("aten._int_mm.default", "aten._scaled_mm.default", "aten.mm.default"):
        assert report.ops_after[original] == 0
    assert_close(out, form(x, w, w_scale, bias))


def test_scheme_is_reported():
    x, w, w_scale, bias = operands((5, 64))
    _, report = compile_and_run(int_mm_static_float_scale, x, w, w_scale, bias)
    assert report.records[0].scheme == "int8 static-tensor x per-channel"
    _, report = compile_and_run(int_mm_linear, x, w, w_scale, bias)
    assert report.records[0].scheme == "int8 dyn-token x per-channel"


def test_dynamic_batch_sizes_compile_once_and_all_fuse():
    _, w, w_scale, bias = operands((4, 64))
    compiled = torch.compile(int_mm_linear, backend="qfuse", dynamic=True)
    marker = qfuse.graphs_compiled()
    # M = 12 .. 63: 0 and 1 are always specialized by Dynamo, and kernel choice compiles a dynamic M once per bucket
    # of rows where a CPU's verdict changes (8 rows without int8 dot products, 64 on AMX: `speed_row_bounds`)
    for rows in (4, 5, 11, 21):
        x = torch.randn(3, rows, 64)
        assert_close(compiled(x, w, w_scale, bias), int_mm_linear(x, w, w_scale, bias))
    compiled_graphs = qfuse.reports_since(marker)
    assert len(compiled_graphs) == 1
    assert compiled_graphs[0].fused and not compiled_graphs[0].near_misses


TOKEN_PADDING = 17  # cuBLAS's int8 GEMM wants more than 16 rows


def padded_rows(x):
    rows = x.shape[0]
    return torch.nn.functional.pad(x, (0, 0, 0, TOKEN_PADDING - rows)) if rows < TOKEN_PADDING else x


def int8_padded_narrowed_after_cast(x, w, w_scale, bias):
    """vLLM's int8 form on CUDA: tokens padded to 17 rows, cut back after the output cast."""
    q, s = dynamic_int8(padded_rows(x))
    y = torch._int_mm(q, w.t()).float() * s * w_scale + bias
    return y.to(torch.bfloat16).narrow(0, 0, x.shape[0])


def fp8_padded_narrowed_before_cast(x, w, w_scale, bias):
    q, s = dynamic_fp8(padded_rows(x))
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(q, w.to(FP8).t(), one, one, out_dtype=torch.float32) * s
    return torch.narrow(y * w_scale, 0, 0, x.shape[0]).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 20])
@pytest.mark.parametrize("form", [int8_padded_narrowed_after_cast, fp8_padded_narrowed_before_cast],
                         ids=lambda form: form.__name__)
def test_padded_tokens_run_the_gemm_on_the_real_rows(form, rows):
    """The row slice moves onto the activation and its per-row scale: the GEMM sees M rows, not 17
    (at decode that is what picks the GPU's decode tile), and the result is eager's."""
    x, w, w_scale, bias = operands((rows, 64))
    if form is fp8_padded_narrowed_before_cast:
        w = fp8_weight(w)
    run = run_family(reference_linear, form, x, w, w_scale, bias)
    (record,) = run.report.records
    assert record.fused, record.reason
    (fused,) = [node for node in run.graph.nodes if str(node.target) == SCALED_MM]
    activation, scale_a = fused.args[0], fused.args[2]
    assert activation.meta["val"].shape[0] == rows and scale_a.meta["val"].shape[0] == rows
    assert not [node for node in run.graph.nodes if node.target == torch.ops.aten.slice.Tensor and node.users
                and fused in node.all_input_nodes]  # no slice left on the fused op's output
    out, _ = compile_and_run(form, x, w, w_scale, bias)
    assert_close(out, form(x, w, w_scale, bias))


def test_padded_tokens_with_a_dynamic_batch():
    _, w, w_scale, bias = operands((4, 64))
    compiled = torch.compile(int8_padded_narrowed_after_cast, backend="qfuse", dynamic=True)
    marker = qfuse.graphs_compiled()
    for rows in (2, 5, 9):
        x = torch.randn(rows, 64)
        assert_close(compiled(x, w, w_scale, bias), int8_padded_narrowed_after_cast(x, w, w_scale, bias))
    reports = qfuse.reports_since(marker)
    assert reports and all(report.fused and not report.near_misses for report in reports)


def weight_scale_with_extra_dim(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return torch._int_mm(q, w.t()).float() * w_scale.reshape(1, 1, -1) * s.unsqueeze(0)


def accumulator_has_another_user(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    acc = torch._int_mm(q, w.t())
    return acc.float() * s * w_scale, acc.sum()


def three_scale_factors(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return torch._int_mm(q, w.t()).float() * s * w_scale * s


def no_dequantize(x, w, w_scale, bias):
    q, _ = dynamic_int8(x)
    return torch._int_mm(q, w.t()) + 1


NEAR_MISSES = {
    weight_scale_with_extra_dim: "which would broadcast the [5, 48] output to more dims",
    accumulator_has_another_user: "_int_mm has 2 users, so what follows it cannot move into a fused op",
    no_dequantize: "no dequantize scale is applied to its output",
}


@pytest.mark.parametrize("form", list(NEAR_MISSES), ids=lambda form: form.__name__)
def test_near_miss_is_not_rewritten_and_stays_correct(form):
    x, w, w_scale, bias = operands((5, 64))
    out, report = compile_and_run(form, x, w, w_scale, bias)
    (record,) = report.records
    assert not record.fused and NEAR_MISSES[form] in record.reason
    assert report.ops_after[SCALED_MM] == 0 and report.ops_after["aten._int_mm.default"] == 1
    torch.testing.assert_close(out, form(x, w, w_scale, bias))


def divided_by_a_number_and_a_reciprocal(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return (torch._int_mm(q, w.t()).float() / 2.0 * w_scale.reciprocal().reciprocal() * s) / s * s


def number_first_and_outer_product(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return 3.0 * (torch._int_mm(q, w.t()) * (s * w_scale.reshape(1, -1))) + bias


def column_scale_as_transposed_n1(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return torch._int_mm(q, w.t()).float() * s * w_scale.reshape(-1, 1).t()


def swiglu_up_projection(x, w, w_scale, bias):
    """The linear ends at silu(gate) * up, whatever the dtype (float32: the output cast is a no-op)."""
    q, s = dynamic_int8(x)
    up = (torch._int_mm(q, w.t()).float() * s * w_scale).to(x.dtype)
    return torch.nn.functional.silu(x[:, :48]) * up


@pytest.mark.parametrize("form", [three_scale_factors, divided_by_a_number_and_a_reciprocal,
                                  number_first_and_outer_product, column_scale_as_transposed_n1,
                                  swiglu_up_projection], ids=lambda form: form.__name__)
def test_scale_factors_of_one_role_combine(form):
    x, w, w_scale, bias = operands((5, 64))
    out, report = compile_and_run(form, x, w, w_scale, bias)
    (record,) = report.records
    assert record.fused and record.scheme == "int8 dyn-token x per-channel", record.reason
    assert report.ops_after["aten._int_mm.default"] == 0
    torch.testing.assert_close(out, form(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)


def torchao_int_scaled_matmul(x, w, w_scale, bias):
    """torchao's int8 dynamic linear as it runs on CUDA under torch.compile (`Int8Tensor`'s linear ->
    `int_scaled_matmul` -> `safe_int_mm`): the per-row scale expanded to [M, N] before the product, the
    output cast, then the weight scale. Seen unfused on an H200 before `expand` was read as its input."""
    q, s = dynamic_int8(x)
    tmp = q.reshape(-1, q.shape[-1])
    c = torch._int_mm(tmp, w.t())
    y = (c * s.reshape(-1, 1).to(torch.float32).expand((tmp.shape[0], w.shape[0]))).to(x.dtype)
    return (y * w_scale.flatten()).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64)], ids=["M1", "M5", "3D"])
def test_a_scale_expanded_to_the_output_is_the_same_factor(shape):
    x, w, w_scale, _ = operands(shape)
    out, report = compile_and_run(torchao_int_scaled_matmul, x, w, w_scale, None)
    (record,) = report.records
    assert record.fused and record.scheme == "int8 dyn-token x per-channel", record.reason
    torch.testing.assert_close(out, torchao_int_scaled_matmul(x, w, w_scale, None), rtol=1e-4, atol=1e-4)


def test_a_factor_expanded_past_the_output_is_named():
    def grown(x, w, w_scale, bias):
        q, s = dynamic_int8(x)
        y = torch._int_mm(q, w.t()).float() * s * w_scale
        return y * torch.tensor(0.5).expand(2, 5, w.shape[0])  # broadcasts the [5, N] output to [2, 5, N]

    x, w, w_scale, bias = operands((5, 64))
    out, report = compile_and_run(grown, x, w, w_scale, bias)
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out, grown(x, w, w_scale, bias))


def test_a_factor_that_fits_no_role_is_named():
    def per_batch_factor(x, w, w_scale, bias):
        q, s = dynamic_int8(x)
        y = torch._int_mm(q.reshape(-1, 64), w.t()).float() * s.reshape(-1, 1) * w_scale
        return y.reshape(2, 5, -1) * torch.tensor([0.5, 2.0]).reshape(2, 1, 1)

    x, w, w_scale, bias = operands((2, 5, 64))
    out, report = compile_and_run(per_batch_factor, x, w, w_scale, bias)
    (record,) = report.records
    assert not record.fused and "has shape [2, 1, 1]: neither one value" in record.reason
    torch.testing.assert_close(out, per_batch_factor(x, w, w_scale, bias))


def test_plain_float_linear_is_not_a_candidate():
    x, weight = torch.randn(8, 32), torch.randn(16, 32)
    out, report = compile_and_run(lambda x, weight: x @ weight.t(), x, weight)
    assert report.records == [] and report.ops_after[SCALED_MM] == 0
    assert report.float_matmuls == ["mm"] and "1 float matmul left alone" in report.headline()
    torch.testing.assert_close(out, x @ weight.t())


def test_record_names_the_users_module():
    class QuantizedLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            _, self.w, self.w_scale, self.bias = operands((1, 64))

        def forward(self, x):
            return int_mm_linear(x, self.w, self.w_scale, self.bias)

    model = torch.nn.Sequential(torch.nn.Identity(), QuantizedLinear())
    _, report = compile_and_run(model, torch.randn(5, 64))
    assert report.records[0].module == "1"


def uint8_int_mm_without_dequantize(x, w, w_scale, bias):
    """torchao's u8s8 form with a zero point of 131 (the operand would need a shift to int8), no scale."""
    q = torch.clamp(torch.round(x / 0.05) + 131, 0, 255).to(torch.uint8)
    b = w.t()
    return (torch._int_mm(q, b) - b.sum(0, keepdim=True) * 131).float()


def upcast_mm_without_dequantize(x, w, w_scale, bias):
    """A float mm of upcast int8 operands (the weight would need a transpose), no scale."""
    q, _ = dynamic_int8(x)
    return q.float() @ w.float().t()


def _int_mm_takes_uint8() -> bool:
    """torch 2.13 multiplies a uint8 activation in torch._int_mm on CPU; torch 2.11 refuses it."""
    try:
        torch._int_mm(torch.zeros(17, 8, dtype=torch.uint8), torch.zeros(8, 8, dtype=torch.int8))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("form", [
    pytest.param(uint8_int_mm_without_dequantize, marks=pytest.mark.skipif(
        not _int_mm_takes_uint8(), reason="this torch's _int_mm takes no uint8 activation")),
    upcast_mm_without_dequantize,
], ids=lambda form: form.__name__)
def test_a_near_miss_leaves_the_graph_untouched(form):
    run = run_family(reference_linear, form, *operands((5, 64)))
    (record,) = run.report.records
    assert not record.fused and "no dequantize scale is applied to its output" in record.reason
    assert run.untouched, run.code_after
