"""inf and nan reach the output as eager's quantized linears put them there, on every CPU kernel.

Eager's per-token quantizer gives a row holding an inf the scale inf; x / inf is 0, or nan for the
inf itself, which eager casts to int8 0: the row's accumulator is 0 and 0 x inf makes the whole
output row nan. A nan gives the scale nan: a nan row. Inductor's code casts nan to -128 instead,
so the kernels cannot count on the accumulator: a non-finite activation scale makes its row nan
(`torch_native.nan_where_not_finite`); zentorch, which quantizes the activation itself, does the
same from the row's absmax.
"""

import pytest
import torch

from qfuse.kernels import get_kernel
from qfuse.platform import current_platform

ops = torch.ops.qfuse
M, K, N = 5, 32, 8
CPU_KERNELS = [name for name in ("torch", "onednn", "zentorch", "reference")
               if get_kernel(name).is_supported(current_platform("cpu"))[0]]


def operands():
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=generator)
    a[2] = -128  # what Inductor's code makes of a row quantized with a non-finite scale
    b = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator).t()
    scale_a = torch.rand(M, 1, generator=generator) + 0.5
    return a, b, scale_a, torch.rand(N, generator=generator) * 0.01


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("special", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_per_token_scale_makes_its_row_nan(kernel, special):
    a, b, scale_a, scale_b = operands()
    scale_a[2] = special
    out = ops.scaled_mm(a, b, scale_a, scale_b, None, None, None, torch.float32, kernel)
    assert out[2].isnan().all()
    assert out[[0, 1, 3, 4]].isfinite().all()


@pytest.mark.parametrize("kernel", [name for name in CPU_KERNELS if get_kernel(name).fuses_activation_quant])
@pytest.mark.parametrize("special", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_activation_quantized_by_the_kernel_makes_its_row_nan(kernel, special):
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    x[2, 7] = special
    _, b, _, scale_b = operands()
    out = ops.quant_scaled_mm(x, b, None, scale_b, None, torch.int8, 1e-5, torch.float32, kernel)
    assert out[2].isnan().all()
    assert out[[0, 1, 3, 4]].isfinite().all()


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_a_non_finite_per_tensor_scale_makes_every_row_nan(kernel):
    if kernel == "zentorch":
        pytest.skip("zentorch takes per-token activation scales only")
    a, b, _, scale_b = operands()
    out = ops.scaled_mm(a, b, torch.tensor(float("inf")), scale_b, None, None, None, torch.bfloat16, kernel)
    assert out.isnan().all()
