"""fp8 weight-only linears (W8A16: an fp8 e4m3fn weight, a float activation) -> qfuse::weight_only_scaled_mm.

The peer forms of `tests/peers/weight_only_models.Fp8WeightOnlyLinear`, each dequantized in float32
and cast to the activation's dtype: per channel, and 128 x 128 block scales expanded by
`repeat_interleave` (vLLM / SGLang) or against a blocked view (transformers). `fake_quant_linear`
recognises them (`qfuse.passes.forms.block_scales` for the blocks). Numerics through the reference kernel
on odd shapes (M = 0, 1, 17, 3D; N and K no multiples of 128, K = 1), with dynamic M; the kernel this
CPU picks (onednn's fp8 W8A16 for bf16 block weights; no CPU kernel takes a per-channel fp8 weight);
and the near misses that must not be rewritten: scales repeated by another block size, along one
axis only, or sliced from another row than the first.
"""

import pytest
import torch
import torch.nn.functional as F

from qfuse.kernels import get_kernel
from qfuse.platform import current_platform
from tests.helpers import compile_and_run
from tests.peers.weight_only_models import fp8_weight_only

BF16, FP32 = torch.bfloat16, torch.float32
WEIGHT_ONLY_OP = "qfuse.weight_only_scaled_mm.default"
TOLERANCE = {FP32: 1e-5, BF16: 2**-7}
FAMILY = "fake_quant_linear"
DTYPE_NAMES = {FP32: "fp32", BF16: "bf16"}


def assert_close(out, expected, dtype):
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if expected.numel() == 0:
        return
    scale = max(expected.float().abs().max().item(), 1.0)
    assert (out.double() - expected.double()).abs().max().item() <= 2 * TOLERANCE[dtype] * scale


def fused_record(report):
    (record,) = [record for record in report.records if record.family == FAMILY]
    return record


@pytest.mark.parametrize("scales, sizes", [
    ("channel", (256, 384)), ("block_repeat", (256, 384)), ("block_repeat", (200, 72)), ("block_repeat", (1, 136)),
    ("block_view", (256, 384)),
], ids=["channel", "block_repeat", "block_repeat_odd", "block_repeat_k1", "block_view"])
@pytest.mark.parametrize("shape", [(16,), (1,), (17,), (0,), (2, 5)], ids=["M16", "M1", "M17", "M0", "3D"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_forms_fuse_and_match_eager(scales, sizes, shape, dtype):
    in_features, out_features = sizes
    model = fp8_weight_only(dtype, scales, in_features=in_features, out_features=out_features)
    x = torch.randn(*shape, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        out, report = compile_and_run(model, x, kernel="reference")
        expected = model(x)
        reference = F.linear(x.double(), model.reference_weight, model.bias.double()).to(dtype)
    record = fused_record(report)
    granularity = "per-channel" if scales == "channel" else "block"
    assert record.fused and record.scheme == f"{DTYPE_NAMES[dtype]} x fp8 {granularity} (weight-only)", report.table()
    assert report.ops_after[WEIGHT_ONLY_OP] == 1
    assert_close(out, expected, dtype)
    assert_close(out, reference, dtype)


@pytest.mark.parametrize("scales", ["channel", "block_repeat", "block_view"])
def test_dynamic_m(scales):
    model = fp8_weight_only(BF16, scales)
    compiled = torch.compile(model, backend="qfuse", dynamic=True, options={"kernel": "reference"})
    with torch.no_grad():
        for m in (3, 40, 1):
            x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(BF16)
            assert_close(compiled(x), model(x), BF16)


@pytest.mark.parametrize("scales, dtype, kernel", [
    ("block_repeat", BF16, "onednn"), ("block_view", BF16, "onednn"), ("block_repeat", FP32, None),
    ("channel", BF16, None),
])
def test_the_kernel_this_cpu_picks(scales, dtype, kernel):
    if kernel == "onednn" and not get_kernel("onednn").is_supported(current_platform("cpu"))[0]:
        kernel = None  # its bf16 reorder needs AVX-512: no kernel of this CPU runs fp8 block weights
    model = fp8_weight_only(dtype, scales)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        out, report = compile_and_run(model, x)
        expected = model(x)
    record = fused_record(report)
    if kernel is None:
        assert not record.fused and record.reason.startswith("no kernel can run it"), report.table()
        assert report.ops_after[WEIGHT_ONLY_OP] == 0
    else:
        assert record.fused and record.kernel == kernel, report.table()
    assert_close(out, expected, dtype)


class SkewedBlocks(torch.nn.Module):
    """A block-scaled fp8 weight whose scale does not map each element to its own 128 x 128 block."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        model = fp8_weight_only(FP32, "block_repeat", in_features=256, out_features=256)
        self.register_buffer("weight", model.weight)
        rows = 3 if how == "sliced_from_one" else 2
        self.register_buffer("scale", torch.rand(rows, 4 if how == "blocks_of_64" else 2) + 0.5)

    def forward(self, x):
        if self.how == "blocks_of_64":
            expanded = self.scale.repeat_interleave(128, 0).repeat_interleave(64, 1)
        elif self.how == "rows_only":
            expanded = self.scale.repeat_interleave(128, 0)[:, :1]
        else:
            expanded = self.scale.repeat_interleave(128, 0)[1:257].repeat_interleave(128, 1)
        return F.linear(x, self.weight.to(torch.float32) * expanded)


@pytest.mark.parametrize("how", ["blocks_of_64", "rows_only", "sliced_from_one"])
def test_scales_not_in_128_blocks_are_not_rewritten_as_blocks(how):
    model = SkewedBlocks(how)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, report = compile_and_run(model, x, kernel="reference")
        expected = model(x)
    assert report.ops_after[WEIGHT_ONLY_OP] == 0 or how == "rows_only", report.table()
    if how == "rows_only":  # [N, 1] after the slice: a per-channel scale, fused as one
        assert fused_record(report).scheme == "fp32 x fp8 per-channel (weight-only)"
    else:
        (record,) = report.records
        assert not record.fused and "neither one value, per channel, nor 128x128 blocks" in record.reason, report.table()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("scales", ["channel", "block_repeat"])
def test_a_dequantize_cast_to_fp16_is_not_rewritten_and_says_why(scales):
    """Eager rounds the float32 product to fp16 (inf beyond its range); the fused op would not."""
    model = fp8_weight_only(torch.float16, scales)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    with torch.no_grad():
        out, report = compile_and_run(model, x, kernel="reference")
        expected = model(x)
    (record,) = report.records
    assert not record.fused and "cast to float16" in record.reason, report.table()
    assert report.ops_after[WEIGHT_ONLY_OP] == 0
    torch.testing.assert_close(out, expected)
