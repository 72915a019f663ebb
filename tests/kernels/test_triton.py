"""The Triton kernels against the reference kernel: every scale granularity, int8 and fp8, odd
sizes, bias, out dtypes, weight layouts. Without a GPU they run in Triton's interpreter."""

import pytest
import torch

pytest.importorskip("triton")

from qfuse.kernels import reference_math  # noqa: E402
from qfuse.schemes import Granularity  # noqa: E402

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ops = torch.ops.qfuse


def quantized(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, dtype=dtype, generator=generator).to(DEVICE)
    return (torch.randn(shape, generator=generator) * 40).clamp(-448, 448).to(dtype).to(DEVICE)


def scales(kind, m, k, n):
    rows, groups_k, groups_n = m, -(-k // 128), -(-n // 128)
    shapes = {
        "tensor": ((), ()),
        "token_channel": ((rows, 1), (n,)),
        "block": ((rows, groups_k), (groups_k, groups_n)),
    }[kind]
    generator = torch.Generator().manual_seed(1)
    return [torch.rand(shape, generator=generator).add(0.5).to(DEVICE) for shape in shapes]


def assert_matches_reference(out, a, b, scale_a, scale_b, bias, out_dtype):
    from qfuse.ops.scaled_mm import _flatten_operands

    a2d, sa, sb, _, _ = _flatten_operands(a, b, scale_a, scale_b, bias, None, None, "test")
    expected = reference_math.scaled_mm(a2d, b, sa, sb, bias, None, None, torch.float64).reshape(out.shape)
    tolerance = 1e-5 if out_dtype == torch.float32 else 1e-2
    if a.dtype == FP8 and out_dtype == torch.float32 and a.is_cuda:
        tolerance = 1e-3  # Hopper fp8 tensor cores accumulate in reduced precision (see scaled_mm.py)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["tensor", "token_channel", "block"])
@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("m, k, n", [(1, 256, 128), (17, 200, 33), (40, 384, 300)])
def test_scaled_mm_matches_reference(m, k, n, dtype, kind, out_dtype):
    a, weight = quantized((m, k), dtype, 2), quantized((n, k), dtype, 3)
    scale_a, scale_b = scales(kind, m, k, n)
    bias = torch.randn(n).to(DEVICE) if kind != "tensor" else None
    out = ops.scaled_mm(a, weight.t(), scale_a, scale_b, bias, None, None, out_dtype, "triton")
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_matches_reference(out, a, weight.t(), scale_a, scale_b, bias, out_dtype)


def test_decode_tiles_fill_the_gpu_with_column_blocks():
    from qfuse.kernels.triton.scaled_mm import DECODE_M, pick_config

    sms = 132
    assert pick_config(1, 4096, True, False, sms)[:2] == (DECODE_M, 32)  # 128 blocks, not 64
    assert pick_config(16, 14336, False, False, sms)[:2] == (DECODE_M, 128)  # 112 blocks
    assert pick_config(1, 256, True, False, sms)[1] == 16  # nothing fills it: the narrowest
    assert pick_config(1, 4096, True, True, sms)[2] == 128  # a K step never straddles two scale groups
    assert pick_config(17, 14336, True, False, sms)[:2] == (64, 128)  # above decode sizes: the M-bucket table
    assert pick_config(4096, 4096, False, False, sms)[:2] == (128, 128)


def test_skinny_m_takes_a_narrower_tile_where_the_table_leaves_the_gpu_idle():
    from qfuse.kernels.triton.scaled_mm import SKINNY_TILE, pick_config

    sms = 132
    assert pick_config(17, 4096, False, False, sms) == SKINNY_TILE  # 32 column blocks of 128 on 132 multiprocessors
    assert pick_config(128, 14336, False, False, sms)[:2] == (64, 128)  # 112 column blocks: the table's tile
    for n in (4096, 7168, 14336):  # the eager kernel (real M) and the template (the bucket's bound) agree
        for fp8 in (False, True):
            assert len({pick_config(m, n, fp8, False, sms) for m in (17, 64, 128)}) == 1
    assert pick_config(129, 4096, False, False, sms)[:2] == (128, 128)  # prefill buckets are not narrowed
    assert pick_config(17, 4096, True, True, sms)[2] == 128  # block scales: a K step within one scale group


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
def test_every_decode_tile_matches_reference(block_n, dtype):
    from qfuse.kernels.triton.scaled_mm import DECODE_M, DECODE_TILES, triton_scaled_mm

    block_k, num_warps, num_stages = DECODE_TILES[block_n]["fp8" if dtype == FP8 else "int8"]
    m, k, n = 3, block_k + 48, 2 * block_n + 5  # a partial K step and a partial column block
    a, weight = quantized((m, k), dtype, 20), quantized((n, k), dtype, 21)
    scale_a, scale_b = scales("token_channel", m, k, n)
    bias = torch.randn(n).to(DEVICE)
    from qfuse.ops.scaled_mm import _flatten_operands

    a2d, sa, sb, _, _ = _flatten_operands(a, weight.t(), scale_a, scale_b, bias, None, None, "test")
    out = triton_scaled_mm(a2d, weight.t(), sa, sb, bias, torch.float32, (DECODE_M, block_n, block_k, 8, num_warps, num_stages))
    assert_matches_reference(out, a, weight.t(), scale_a, scale_b, bias, torch.float32)


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_scaled_mm_3d_activation_and_kn_weight(dtype):
    a, weight = quantized((2, 9, 96), dtype, 4), quantized((96, 40), dtype, 5)  # weight stored [K, N]
    scale_a, scale_b = torch.rand(2, 9, 1).to(DEVICE), torch.rand(1, 40).to(DEVICE)
    out = ops.scaled_mm(a, weight, scale_a, scale_b, None, None, None, torch.float32, "triton")
    assert out.shape == (2, 9, 40)
    assert_matches_reference(out, a, weight, scale_a, scale_b, None, torch.float32)


def test_zero_points_are_refused():
    a, weight = quantized((4, 64), torch.int8, 6), quantized((16, 64), torch.int8, 7)
    with pytest.raises(ValueError, match="the triton kernel has no zero points"):
        ops.scaled_mm(a, weight.t(), None, None, None, torch.tensor(1).to(DEVICE), None, torch.float32, "triton")


def eager_on_cuda(x, dtype, granularity, eps):
    """(q, scale) of `reference_math.dynamic_quant` as eager computes it on CUDA, on any device: there
    amax / qmax, a division by a Python number, is a multiplication by its float32 reciprocal."""
    group = x.shape[-1] if granularity == "per_token" else 128
    scale = x.unflatten(-1, (-1, group)).abs().amax(-1).clamp(min=eps) * (1 / (127.0 if dtype == torch.int8 else 448.0))
    scaled = x / scale.repeat_interleave(group, dim=-1)
    return (scaled.round().clamp(-128, 127) if dtype == torch.int8 else scaled.clamp(-448, 448)).to(dtype), scale


@pytest.mark.parametrize("granularity", ["per_token", "per_group"])
@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", [(1, 256), (3, 7, 384)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_dynamic_quant_matches_reference(shape, dtype, granularity, x_dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(8)) * 3).to(x_dtype).to(DEVICE)
    q, scale = ops.dynamic_quant(x, dtype, granularity, 1e-5, "triton")
    if x_dtype == torch.float32:  # the arithmetic of eager on CUDA: bit-exact
        expected_q, expected_scale = eager_on_cuda(x, dtype, granularity, 1e-5)
        assert torch.equal(scale, expected_scale) and torch.equal(q.float(), expected_q.float())
        return
    expected_scale = ops.dynamic_quant(x, dtype, granularity, 1e-5, "reference")[1]
    # bf16: torch rounds amax / qmax in bf16 its own way; the scale may differ by one bf16 step,
    # and then q follows its own scale. Check that q is x quantized with the returned scale.
    torch.testing.assert_close(scale, expected_scale, rtol=1e-2, atol=0)
    group = shape[-1] if granularity == "per_token" else 128
    expanded = scale.float().repeat_interleave(group, dim=-1)
    error = (q.float() * expanded - x.float()).abs()
    # int8: half a step; fp8: half a step of e4m3 (2**-4 relative; 2**-10 of the scale in subnormals)
    bound = 0.5 * expanded * 1.01 if dtype == torch.int8 else (x.float().abs() * 2.0**-4 + expanded * 2.0**-9) * 1.01
    assert torch.all(error <= bound)


def test_dynamic_quant_all_zero_rows_use_eps():
    x = torch.zeros(2, 128).to(DEVICE)
    q, scale = ops.dynamic_quant(x, torch.int8, "per_token", 1e-5, "triton")
    assert torch.all(q == 0) and torch.allclose(scale.cpu(), torch.full((2, 1), 1e-5 / 127))


#: Triton's interpreter computes with numpy, which warns where these tests feed it inf and nan on purpose
_NUMPY_ON_INF_AND_NAN = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


@_NUMPY_ON_INF_AND_NAN
@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_dynamic_quant_scale_of_a_row_holding_nan_is_nan(dtype):
    """As eager's amax: a nan row scale, which makes the row's linear output nan; other rows as eager."""
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(3))
    x[1, 17] = float("nan")
    x[2, 5] = float("inf")
    q, scale = ops.dynamic_quant(x.to(DEVICE), dtype, "per_token", 1e-5, "triton")
    expected_q, expected_scale = eager_on_cuda(x, dtype, "per_token", 1e-5)
    torch.testing.assert_close(scale.cpu(), expected_scale, rtol=0, atol=0, equal_nan=True)
    assert scale[1].isnan().all() and scale[2].isinf().all()
    rows = [0, 3]
    assert torch.equal(q.cpu()[rows].float(), expected_q[rows].float())


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["bf16_gate", "fp32_gate"])
@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", [(1, 256), (3, 7, 300), (0, 64)], ids=["M1", "3D", "M0"])
def test_silu_mul_quant_matches_eager(shape, dtype, gate_dtype):
    """q and the scale of silu(gate) * up with eager's bf16 roundings; the SiLU's exp and division are the
    device's fast ones, so a value may sit one step from eager's where the product lies within float32
    error of a bf16 rounding boundary: a few such values here, and a row's amax (so its scale) one bf16
    step apart at most."""
    generator = torch.Generator().manual_seed(4)
    gate, up = ((torch.randn(shape, generator=generator) * 3).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    gate = gate.to(gate_dtype) * (1 + 2**-10 if gate_dtype == torch.float32 else 1)  # float32: off the bf16 grid
    q, scale = ops.silu_mul_quant(gate, up, dtype, 1e-6, "triton", torch.float32)
    g = gate.float()  # the post-grad graph's SiLU: g / (1 + exp(-g)) in float32, rounded to bf16
    product = (g / (1 + torch.exp(-g))).to(torch.bfloat16) * up
    expected_q, expected_scale = eager_on_cuda(product.float(), dtype, "per_token", 1e-6)
    assert q.shape == gate.shape and scale.shape == (*shape[:-1], 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, expected_scale.reshape(scale.shape), rtol=2**-7, atol=0)
    apart = (q.float() != expected_q.float()).sum().item()
    assert apart <= max(2, q.numel() // 500), apart


@_NUMPY_ON_INF_AND_NAN
@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_quant_of_infinities_and_overflow_saturates_as_eager(dtype):
    """x / s is inf for an infinite x (or one whose quotient overflows): clamped to the range, as eager's."""
    x = torch.tensor([[float("inf"), -float("inf"), 3.0e38, -0.0, 1.0, float("nan")]]).to(DEVICE)
    scale = torch.tensor(1e-3).to(DEVICE)
    q = ops.static_quant(x, scale, None, dtype, "triton")
    expected = ops.static_quant(x.cpu(), scale.cpu(), None, dtype, "reference")
    assert torch.equal(q.cpu()[:, :5].float(), expected[:, :5].float()), (q, expected)


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_static_quant_matches_reference(dtype):
    x = torch.randn(5, 77).to(DEVICE) * 3
    scale = torch.tensor(0.02).to(DEVICE)
    q = ops.static_quant(x, scale, None, dtype, "triton")
    torch.testing.assert_close(q.float(), ops.static_quant(x, scale, None, dtype, "reference").float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_quant_scaled_mm_dynamic_and_static(dtype):
    x, weight = torch.randn(2, 5, 128).to(DEVICE), quantized((48, 128), dtype, 9)
    scale_b, bias = torch.rand(48).to(DEVICE), torch.randn(48).to(DEVICE)
    for scale_a in (None, torch.tensor(0.01).to(DEVICE)):
        out = ops.quant_scaled_mm(x, weight.t(), scale_a, scale_b, bias, dtype, 1e-6, torch.float32, "triton")
        expected = ops.quant_scaled_mm(x, weight.t(), scale_a, scale_b, bias, dtype, 1e-6, torch.float32, "reference")
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_per_tensor_dynamic_quant_falls_back_to_plain_torch():
    x = torch.randn(4, 64).to(DEVICE)
    q, scale = ops.dynamic_quant(x, torch.int8, Granularity.PER_TENSOR.value, 0.0, "triton")
    expected_q, expected_scale = ops.dynamic_quant(x, torch.int8, "per_tensor", 0.0, "reference")
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["tensor", "token_channel"])
@pytest.mark.parametrize("m, k, n", [(1, 64, 16), (130, 208, 200), (300, 1024, 520)])
def test_persistent_scaled_mm_matches_reference(m, k, n, kind, out_dtype, dtype):
    from qfuse.kernels.triton.persistent_mm import persistent_scaled_mm

    if DEVICE == "cpu" and m * k * n > 10**7:
        pytest.skip("too slow for Triton's interpreter")
    a, weight = quantized((m, k), dtype, 12), quantized((n, k), dtype, 13)
    scale_a, scale_b = scales(kind, m, k, n)
    bias = torch.randn(n).to(DEVICE) if kind != "tensor" else None
    from qfuse.ops.scaled_mm import _flatten_operands

    a2d, sa, sb, _, _ = _flatten_operands(a, weight.t(), scale_a, scale_b, bias, None, None, "test")
    # In the interpreter, small tiles so that one program walks several output tiles.
    config = (64, 64, 32, 2, 4, 2) if DEVICE == "cpu" else None
    out = persistent_scaled_mm(a2d, weight.t(), sa, sb, bias, out_dtype, config)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_matches_reference(out, a, weight.t(), scale_a, scale_b, bias, out_dtype)


def test_persistent_kernel_runs_only_where_it_can_and_was_measured_faster():
    from qfuse.kernels.triton.persistent_mm import MIN_M, should_run_persistent

    def case(m=None, k=256, n=512, dtype=FP8, weight_kn=False, block=False):
        m = MIN_M["int8" if dtype == torch.int8 else "fp8"] if m is None else m
        a = quantized((m, k), dtype, 14)
        b = quantized((k, n), dtype, 15) if weight_kn else quantized((n, k), dtype, 15).t()
        scale_a, scale_b = (torch.rand(m, 2), torch.rand(2, 4)) if block else (torch.rand(m, 1), torch.rand(1, n))
        return should_run_persistent(a, b, scale_a.to(DEVICE), scale_b.to(DEVICE))

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    assert case() == hopper  # CPU tensors (Triton's interpreter) never take it
    assert not case(m=MIN_M["fp8"] - 1)  # small M: `scaled_mm.py`'s kernel was faster
    assert not case(k=200)  # K not a multiple of 16: rows are not 16-byte aligned for the TMA
    assert not case(weight_kn=True)  # a [K, N] weight with N contiguous: the TMA wants K contiguous
    assert not case(block=True)  # block scales apply per K step in `scaled_mm.py`
    assert case(dtype=torch.int8) == hopper  # int8 from its own MIN_M
    assert not case(m=MIN_M["int8"] - 1, dtype=torch.int8)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, inside Triton's interpreter: inf - inf
@pytest.mark.parametrize("kind", ["tensor", "token_channel"])
def test_a_non_finite_activation_scale_makes_its_rows_nan(kind):
    """As in eager (tests/ops/test_non_finite.py): inf x an accumulator eager would have had 0 is nan."""
    m, k, n = 5, 64, 16
    a, weight = quantized((m, k), torch.int8, 2), quantized((n, k), torch.int8, 3)
    scale_a, scale_b = scales(kind, m, k, n)
    scale_a = scale_a.clone()
    scale_a.view(-1)[-1] = float("inf")
    out = ops.scaled_mm(a, weight.t(), scale_a, scale_b, None, None, None, torch.float32, "triton")
    nan_rows = out.isnan().all(dim=1)
    assert nan_rows.tolist() == ([True] * m if kind == "tensor" else [False] * (m - 1) + [True])
    assert out[~nan_rows].isfinite().all()
