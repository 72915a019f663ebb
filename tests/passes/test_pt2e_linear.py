"""pt2e_linear: PT2E Q/DQ linears are rewritten to a real int8 qfuse::scaled_mm, and match eager."""

import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

from qfuse.kernels import KERNELS
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.passes.families import pt2e_linear
from tests.helpers import FLOAT_WRITTEN_INT8, INT8_DOT_HERE, compile_and_run
from tests.passes.post_grad import run_family

qd = torch.ops.quantized_decomposed
SCALED_MM = "qfuse.scaled_mm.default"


class QDQLinear(torch.nn.Module):
    """x -> Q/DQ (per-tensor static, per-tensor tensor-scale, or per-token dynamic) -> linear."""

    def __init__(self, activation="per_tensor", dtype=torch.int8, weight="per_channel", bias=True,
                 k=64, n=48, weight_zero_point=0):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.activation, self.dtype, self.weight = activation, dtype, weight
        self.register_buffer("w_q", torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator))
        self.register_buffer("w_scale", torch.rand(n, generator=generator) * 0.01 + 0.001)
        self.register_buffer("w_zero_point", torch.full((n,), weight_zero_point, dtype=torch.int64))
        self.register_buffer("bias", torch.randn(n, generator=generator) if bias else None)
        self.register_buffer("x_scale", torch.tensor([0.05]))
        self.register_buffer("x_zero_point", torch.tensor([3]))

    def dequantized_weight(self):
        if self.weight == "per_channel":
            return qd.dequantize_per_channel(self.w_q, self.w_scale, self.w_zero_point, 0, -128, 127, torch.int8)
        return qd.dequantize_per_tensor(self.w_q, 0.002, 0, -128, 127, torch.int8)

    def dequantized_activation(self, x):
        low, high = (-128, 127) if self.dtype == torch.int8 else (0, 255)
        zero_point = 3 if self.dtype == torch.int8 else 131
        if self.activation == "per_tensor":
            q = qd.quantize_per_tensor(x, 0.05, zero_point, low, high, self.dtype)
            return qd.dequantize_per_tensor(q, 0.05, zero_point, low, high, self.dtype)
        if self.activation == "per_tensor_tensor":
            q = qd.quantize_per_tensor.tensor(x, self.x_scale, self.x_zero_point, low, high, self.dtype)
            return qd.dequantize_per_tensor.tensor(q, self.x_scale, self.x_zero_point, low, high, self.dtype)
        scales, zero_points = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
        q = qd.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
        return qd.dequantize_per_token(q, scales, zero_points, -128, 127, torch.int8, torch.float32)

    def forward(self, x):
        return torch.nn.functional.linear(self.dequantized_activation(x), self.dequantized_weight(), self.bias)


CASES = {
    "per_tensor_int8": dict(),
    "per_tensor_uint8": dict(dtype=torch.uint8),
    "per_tensor_tensor_overload": dict(activation="per_tensor_tensor"),
    "per_token_dynamic": dict(activation="per_token"),
    "per_tensor_weight_no_bias": dict(weight="per_tensor", bias=False),
    "asymmetric_weight": dict(weight_zero_point=2),
}


def away_from_rounding_ties(shape, step=0.05, seed=0):
    """Inputs at least 0.2 quantization steps away from a rounding tie of the static scale (0.05):
    compiled code may divide by the scale as a multiply by its reciprocal, and an input at a tie
    would then round to the neighbouring integer and move a whole output row by one step."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.randint(-60, 61, shape, generator=generator) + torch.rand(shape, generator=generator) * 0.6 - 0.3
    return steps * step


@pytest.mark.parametrize("kernel", ["torch", "reference"])
@pytest.mark.parametrize("shape", [(1, 64), (17, 64), (2, 9, 64)], ids=["M1", "M17", "3D"])
@pytest.mark.parametrize("case", list(CASES))
def test_qdq_linear_is_fused_and_matches_eager(case, shape, kernel):
    model, x = QDQLinear(**CASES[case]), away_from_rounding_ties(shape)
    with torch.no_grad():
        out, report = compile_and_run(model, x, kernel=kernel)
        expected = model(x)
    (record,) = report.records
    assert record.fused and record.family == "pt2e_linear" and record.kernel == kernel
    assert report.ops_after[SCALED_MM] == 1
    assert report.ops_after["aten.mm.default"] + report.ops_after["aten.addmm.default"] == 0
    assert report.ops_after["quantized_decomposed.dequantize_per_channel.default"] == 0
    # Integer GEMM vs float GEMM of the same integers: equal up to float32 summation order.
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


class TransposedInput(QDQLinear):
    """A non-contiguous 3D activation: the linear decomposes to bmm over expands."""

    def forward(self, x):
        return super().forward(x.transpose(0, 1))


def test_bmm_form_of_a_non_contiguous_3d_input():
    model, x = TransposedInput(), torch.randn(9, 2, 64)
    with torch.no_grad():
        out, report = compile_and_run(model, x, **FLOAT_WRITTEN_INT8)
        expected = model(x)
    (record,) = report.records
    assert record.fused and record.pattern == "dq_per_tensor x dq_per_channel + bmm"
    assert report.ops_after["aten.bmm.default"] == 0
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_dynamic_batch_sizes_compile_once_per_m_bucket():
    """One compile, or one per M bucket: the torch kernel on a CPU without int8 dot instructions has two, below and
    from FLOAT32_INT8_MIN_ROWS = 8 rows (M here: 6, 21, 120)."""
    import qfuse

    model = QDQLinear()
    compiled = torch.compile(model, backend="qfuse", dynamic=True, options=FLOAT_WRITTEN_INT8 or None)
    marker = qfuse.graphs_compiled()
    with torch.no_grad():
        for rows in (2, 7, 40):
            x = torch.randn(3, rows, 64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    reports = qfuse.reports_since(marker)
    assert len(reports) == (1 if INT8_DOT_HERE else 2)
    assert all([record.fused for record in report.records] == [True] for report in reports)


class WeightOnly(QDQLinear):
    """A bf16 activation times a weight PT2E dequantizes to bf16."""

    def forward(self, x):
        weight = qd.dequantize_per_channel(self.w_q, self.w_scale, self.w_zero_point, 0, -128, 127, torch.int8,
                                           out_dtype=torch.bfloat16)
        return torch.nn.functional.linear(x, weight, self.bias.to(torch.bfloat16))


@pytest.mark.parametrize("weight_zero_point", [0, 5])
@pytest.mark.parametrize("shape", [(5, 64), (1, 64), (2, 9, 64)], ids=str)
def test_a_weight_only_qdq_linear_runs_weight_only(weight_zero_point, shape):
    """A bf16 activation times a PT2E-dequantized int8 weight (its zero point a tensor, zero or not): the
    op drops an all-zero one at run time, so it stays an extern call rather than Inductor's lowering."""
    model, x = WeightOnly(weight_zero_point=weight_zero_point), torch.randn(shape).to(torch.bfloat16)
    with torch.no_grad():
        out, report = compile_and_run(model, x)
        expected = model(x)
    (record,) = report.records
    assert record.fused and record.scheme == "bf16 x int8 per-channel (weight-only)", report.table()
    assert record.kernel == "torch" and "weight zero point" in record.lowered
    assert report.ops_after[SCALED_MM] == 0 and report.ops_after["qfuse.weight_only_scaled_mm.default"] == 1
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.float().abs().max().item())


class WrongAxis(QDQLinear):
    def dequantized_weight(self):
        scale = torch.ones(self.w_q.shape[1]) * 0.002
        zero_point = torch.zeros(self.w_q.shape[1], dtype=torch.int64)
        return qd.dequantize_per_channel(self.w_q, scale, zero_point, 1, -128, 127, torch.int8)


@pytest.mark.parametrize("model_class, reason", [
    (WrongAxis, "per channel along axis 1, not along its output channels"),
])
def test_near_miss_is_left_alone(model_class, reason):
    model, x = model_class(), torch.randn(5, 64)
    with torch.no_grad():
        out, report = compile_and_run(model, x)
        expected = model(x)
    (record,) = report.records
    assert not record.fused and reason in record.reason
    assert report.ops_after[SCALED_MM] == 0
    torch.testing.assert_close(out, expected)


class ShapePadded(QDQLinear):
    """The graph Inductor's shape padding (pad_mm, CUDA only) makes of a misaligned linear."""

    def forward(self, x):
        x_dq, w_t = self.dequantized_activation(x), self.dequantized_weight().t()
        padded = torch.addmm(torch.cat([self.bias, self.bias.new_zeros(3)]),
                             torch.nn.functional.pad(x_dq, [0, 4, 0, 2]),
                             torch.nn.functional.pad(w_t, [0, 3, 0, 4]))
        return padded[:-2, :-3]


def test_operands_padded_by_inductor_are_unpadded():
    model, x = ShapePadded(), torch.randn(5, 64)
    with torch.no_grad():
        out, report = compile_and_run(model, x, **FLOAT_WRITTEN_INT8)
        expected = model(x)
    (record,) = report.records
    assert record.fused, record.reason
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["torch", "onednn"])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_k_equal_one_is_exact(kernel, rows):
    """torch._int_mm on CPU returns garbage for K == 1 (torch 2.13); the fused linear must not."""
    from qfuse.platform import current_platform

    if kernel == "onednn" and not current_platform("cpu").cpu_has_avx512_vnni:
        pytest.skip("onednn needs AVX-512 VNNI or AMX")
    model, x = QDQLinear(k=1, weight_zero_point=0), away_from_rounding_ties((rows, 1))
    with torch.no_grad():
        out, report = compile_and_run(model, x, kernel=kernel)
        expected = model(x)
    (record,) = report.records
    assert record.fused and record.kernel == kernel
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["per_tensor_int8", "per_tensor_uint8", "per_token_dynamic"])
def test_all_zero_weight_zero_points_reach_the_default_cpu_kernel(case):
    """PT2E quantizers store symmetric weights' zero points as a tensor of zeros (a graph input):
    the default CPU kernel takes them, not only the slow generic one."""
    from qfuse.kernels import get_kernel
    from qfuse.platform import current_platform

    supported, reason = get_kernel("onednn").is_supported(current_platform("cpu"))
    if not supported:
        pytest.skip(reason)
    model = QDQLinear(**CASES[case], k=4096, n=4096)  # where onednn pays off on every engine (onednn.CROSSOVERS)
    x = away_from_rounding_ties((65, 4096))
    with torch.no_grad():
        out, report = compile_and_run(model, x)
        expected = model(x)
    (record,) = report.records
    assert record.fused and record.kernel in ("onednn", "zentorch"), record.rejected_kernels
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


class Int16Activation(QDQLinear):
    def dequantized_activation(self, x):
        q = qd.quantize_per_tensor(x, 0.05, 0, -32768, 32767, torch.int16)
        return qd.dequantize_per_tensor(q, 0.05, 0, -32768, 32767, torch.int16)


def test_a_near_miss_leaves_the_graph_untouched():
    """The weight's operand would need a transpose; the int16 activation fails its check: nothing is inserted."""
    run = run_family(pt2e_linear, Int16Activation(), torch.randn(5, 64))
    (record,) = run.report.records
    assert not record.fused and "dequantized from torch.int16" in record.reason
    assert run.untouched, run.code_after


def test_a_linear_no_kernel_can_run_leaves_the_graph_untouched():
    """A uint8 activation plans its shift to int8 and the weight its transpose; with every kernel
    disabled none of that is inserted."""
    run = run_family(pt2e_linear, QDQLinear(dtype=torch.uint8), torch.randn(5, 64), disabled_kernels=tuple(KERNELS))
    (record,) = run.report.records
    assert not record.fused and record.reason.startswith("no kernel can run it: ") and "torch: " in record.reason
    assert run.untouched, run.code_after


def test_the_planned_operands_are_inserted_when_the_linear_is_fused():
    run = run_family(pt2e_linear, QDQLinear(dtype=torch.uint8), torch.randn(5, 64), kernel="reference")
    (fused,) = run.graph.find_nodes(op="call_function", target=ScaledMmArgs.op)
    call = ScaledMmArgs.of(fused)
    assert call.as_args() == fused.args
    assert call.a.target == torch.ops.aten.bitwise_xor.Scalar and call.b.target == torch.ops.aten.permute.default
    assert call.kernel == "reference" and call.out_dtype == torch.float32
