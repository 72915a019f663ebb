"""Models quantized by torchao (PT2E with X86InductorQuantizer, quantize_ configs) fuse with qfuse on
this machine's fast kernel and match eager."""

import pytest
import torch

import qfuse
from qfuse.kernels import get_kernel
from qfuse.platform import current_platform
from tests.helpers import FLOAT_WRITTEN_INT8
from tests.peers import torchao_models

AVAILABLE, WHY = torchao_models.available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=WHY), pytest.mark.slow]  # torchao's recipes: CI's slow tier


def onednn_runs_here() -> bool:
    return get_kernel("onednn").is_supported(current_platform("cpu"))[0]


def check(model, x, scheme_prefix, tolerance, default_options=None):
    """Every linear fuses by default (with `default_options`); and oneDNN, the fast CPU kernel for large weights,
    can run each one (forcing a kernel raises if it cannot)."""
    with torch.no_grad():
        expected = model(x)
        for options in [default_options] + ([{"kernel": "onednn"}] if onednn_runs_here() else []):
            explanation = qfuse.explain(model, x, options=options)
            assert len(explanation.records) == 2 and all(record.fused for record in explanation.records), explanation
            assert all(record.scheme.startswith(scheme_prefix) for record in explanation.records), explanation
            out = torch.compile(model, backend="qfuse", options=options)(x)
            torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("batch", [None, 2], ids=["2D", "3D"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_pt2e_x86_inductor_quantizer(dynamic, batch):
    model, x = torchao_models.pt2e_x86_mlp(dynamic=dynamic, batch=batch)
    check(model, x, "int8 dyn-tensor" if dynamic else "int8 static-tensor", 1e-4, FLOAT_WRITTEN_INT8 or None)


@pytest.mark.parametrize("batch", [None, 2], ids=["2D", "3D"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_dynamic_activation_int8_weight(dtype, batch):
    model, x = torchao_models.torchao_int8_dynamic_mlp(dtype=dtype, batch=batch)
    check(model, x, "int8 dyn-token", 1e-4 if dtype == torch.float32 else 2e-2)
    # in bf16 torchao applies the weight's per-row scale after its cast to bf16, where the fused op stops: the
    # record says so rather than leaving "per-tensor" unexplained
    records = qfuse.explain(model, x).records
    per_column = ["per-column weight scale" in record.note for record in records]
    assert per_column == [dtype == torch.bfloat16] * 2, [(record.scheme, record.note) for record in records]
    assert all(record.scheme.endswith("per-tensor" if dtype == torch.bfloat16 else "per-channel") for record in records)


@pytest.mark.parametrize("batch", [None, 2], ids=["2D", "3D"])
@pytest.mark.parametrize("dtype, tokens", [(torch.bfloat16, 4), (torch.float32, 1), (torch.float32, 8)],
                         ids=["bf16", "fp32-M1", "fp32-M8"])
@pytest.mark.parametrize("config", ["intx_int4_weight_only", "int8_dynamic_intx_int4"])
def test_int4_intx_weights_fuse_as_int4_weight_only(config, dtype, tokens, batch):
    """torchao's int4 configs that run on a CPU keep int4 values unpacked in int8, with a scale and a
    zero point per group of 32 input channels (all zero: symmetric). Each linear becomes one
    qfuse::int4_weight_only_mm on the stored tensors (int8 storage: the op checks int4's range once
    per weight); 8da4w's fake-quantized activation stays in the graph and feeds the op (in float32 too: qfuse's
    C++ kernel takes float32 int4 up to 128 rows). At most 8 rows (16 in float32, the 3D cases twice the tokens): on
    an AMX CPU Inductor's own code takes int4 stored a byte a value above (`int4_cpu.max_rows`)."""
    model, x = torchao_models.torchao_mlp(config, dtype=dtype, tokens=tokens, batch=batch)
    with torch.no_grad():
        expected = model(x)
        explanation = qfuse.explain(model, x)
        out = torch.compile(model, backend="qfuse")(x)
    assert len(explanation.records) == 2, explanation
    for record in explanation.records:
        assert record.family == "intx_weight_only", explanation
        assert record.fused and record.kernel == "torch", explanation
        assert record.scheme.endswith("x int4 per-group (weight-only)"), explanation
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


def test_freezing_lets_inductor_take_pt2e_linears_and_the_report_says_so():
    """With freezing=True (the documented recipe) Inductor's own passes lower PT2E linears to oneDNN
    before qfuse's pass runs; qfuse leaves them and says so instead of "0 of 0"."""
    model, x = torchao_models.pt2e_x86_mlp(dynamic=False)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        marker = qfuse.graphs_compiled()
        out = torch.compile(model, backend="qfuse")(x)
        expected = model(x)
    (report,) = qfuse.reports_since(marker)
    assert len(report.inductor_quantized) == 2 and "2 taken by Inductor's own quantization passes" in report.headline()
    platform = current_platform("cpu")
    if not platform.cpu_has_int8_dot_products:
        # Inductor's own output, not qfuse's: its oneDNN u8s8 GEMM without VNNI saturates 16-bit sums (plain
        # torch.compile gave 0.18 off on a 0.97-large output on a CPU without AVX2, 2026-11-27)
        pytest.skip("Inductor's oneDNN int8 linear is exact only with AVX-512 VNNI or AMX")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_weight_only_runs_weight_only(dtype):
    """torchao's int8 weight-only linear (x @ w.to(float) * scale): Inductor's own weight-only pattern takes
    the bf16 form before qfuse runs, and qfuse takes it back (`passes/core/inductor_woq.py`) and fuses it (ATen's
    int8pack on CPU, as Inductor's pattern); qfuse recognises the fp32 one as weight-only, which no CPU
    kernel takes (int8pack in fp32 is slower than Inductor's code), and says so."""
    model, x = torchao_models.torchao_int8_weight_only_mlp(dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        explanation = qfuse.explain(model, x)
        out = torch.compile(model, backend="qfuse")(x)
    report = explanation.reports[-1]
    assert len(report.records) == 2 and not report.inductor_quantized, report.table()
    assert len(report.reclaimed_from_inductor) == (2 if dtype == torch.bfloat16 else 0), report.table()
    for record in report.records:
        assert record.scheme.endswith("x int8 per-channel (weight-only)"), report.table()
        if dtype == torch.bfloat16:
            assert record.fused and "_weight_int8pack_mm" in record.lowered, report.table()
            assert "taken back from Inductor's int8 weight-only pattern" in record.note, report.table()
        else:
            assert not record.fused and record.reason.startswith("no kernel can run it"), report.table()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="torchao's fp8 configs need a GPU with fp8 tensor cores")
@pytest.mark.parametrize("config", ["float8_dynamic_rowwise", "float8_dynamic_tensorwise"])
def test_float8_dynamic_configs_on_the_gpu(config):
    model, x = torchao_models.torchao_mlp(config, torch.bfloat16, in_features=256, hidden=512, out=256,
                                          tokens=32, device="cuda")
    with torch.no_grad():
        expected = model(x).float()
        explanation = qfuse.explain(model, x)
        out = torch.compile(model, backend="qfuse")(x).float()
        torch._dynamo.reset()
        inductor = torch.compile(model)(x).float()
    assert len(explanation.records) == 2 and all(record.fused for record in explanation.records), explanation
    error, inductor_error = ((y - expected).norm() / expected.norm() for y in (out, inductor))
    print(f"{config}: relative error vs eager: qfuse {error:.2e}, Inductor {inductor_error:.2e}")
    assert error < max(1.5 * inductor_error, 1e-2)


@pytest.mark.parametrize("weight_dtype, packing", [(torch.int2, "int4pack_cpu"), (torch.int8, "dense")])
def test_intx_weights_of_other_widths_run_exactly(weight_dtype, packing):
    """torchao's intx stores int1-int8 values alike, and the graph does not say which: int2 values run
    on the int4 kernel, int8 ones (outside int4's range) on the weight dequantized once."""
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup, quantize_

    from qfuse.ops.int4_weight_only import prepared_int4_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128)).to(torch.bfloat16).eval()
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=PerGroup(32)))
    x = torch.randn(4, 256).to(torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        explanation = qfuse.explain(model, x)
        out = torch.compile(model, backend="qfuse")(x)
    (record,) = explanation.records
    assert record.fused and record.family == "intx_weight_only", explanation
    weight = model[0].weight
    _, prepared = prepared_int4_weight("torch", weight.qdata, None, weight.scale, weight.zero_point, 32)
    assert prepared.packing == packing
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
