"""`torch`: PyTorch's own quantized GEMMs, on CPU and CUDA.

    int8  acc = torch._int_mm(a, b)  (int32, exact; on CPU with K == 1, where _int_mm returns
          garbage, the int32 outer product a * b); zero points by the expansion
          (a - za)(b - zb) = ab - za colsum(b) - rowsum(a) zb + K za zb; then in float32:
          out = acc * scale_a * scale_b + bias
    fp8   CUDA (capability >= 89): torch._scaled_mm, tensor-wise or row-wise scales fused;
          CPU: a and b upcast and torch.mm: to bf16 for a bf16 output (fp8 values are exact in
          bf16; the bf16 accumulator output adds at most one bf16 rounding), else to fp32: faster than
          CPU torch._scaled_mm (docs/benchmarks.md, "Measurements first quoted in code comments").

What it takes is the capability table `TorchKernel.capabilities`: per-tensor / per-token x
per-tensor / per-channel scales, zero points on both sides (int8), any sizes on CPU and the sizes
cuBLAS takes on CUDA (int8: K and N multiples of 8; fp8: multiples of 16, capability >= 8.9); and
on CPU the int8 weight-only linear (W8A16, a float activation):

    weight-only  out = aten._weight_int8pack_mm(x, b^T [N, K] int8, scale_b [N] in x's dtype) + bias
                 bf16 only (fp32 is slower than Inductor's code at M = 16), K a multiple of 16 (torch
                 2.13's bf16 kernel crashes on others); an all-zero weight zero point is dropped, any
                 other runs in float32, minus rowsum(x) * azp_b * scale_b; above M = 64 rows the
                 weight is dequantized and a bf16 mm runs (faster there, measured; in float32 on a CPU
                 without bf16 dot products, where bf16 is emulated: the same products and sums)
    int4 weight-only  aten._weight_int4pack_mm_for_cpu on the weight repacked once, group sizes 32 /
                 64 / 128 / 256, N a multiple of 16, up to 128 rows; float32 activations and zero points
                 with bf16 / fp16 ones on qfuse's own C++ kernel, which computes each weight value as
                 eager does (`qfuse.kernels.int4_cpu`, which says why; `qfuse.kernels.cpu.int4_zero_points`);
                 on NVIDIA GPUs ATen's tinygemm
                 aten._weight_int4pack_mm, bf16, symmetric weights with bf16 scales, taken at M = 1
                 under CUDA graphs only (`qfuse.kernels.int4_tinygemm`, which says why)

On a CPU without int8 dot instructions (AVX-512 VNNI, AMX) `_int_mm` is emulated: an int8 linear written in
float (PT2E, fake quant) is left to Inductor's float GEMM there, but at M <= 2 of a large weight (measured,
`_why_the_float_gemm_is_faster`).

Not here (the registry moves on to another kernel): block scales. On
ROCm the int8 path is the same torch._int_mm (hipBLASLt); it was not run on ROCm hardware. ROCm
fp8 (e4m3fnuz) is the aiter kernel's.
"""

from __future__ import annotations

import torch

from qfuse.kernels import int4_cpu, int4_tinygemm
from qfuse.kernels.cpu import int4_zero_points
from qfuse.kernels.array_ops import TORCH_OPS, ArrayOps
from qfuse.kernels.base import OK, GemmKey, Kernel, Verdict
from qfuse.kernels.capabilities import Capability
from qfuse.kernels.prepared import Packing, PreparedWeight
from qfuse.platform import CUDA_INT_MM_MIN_ROWS, Platform, current_platform
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, FP8_DTYPE, INT4_DTYPE, Granularity, dtype_name

#: torch 2.13's CPU _weight_int8pack_mm crashes (segmentation fault) with bf16 and K not a multiple of this.
BF16_INT8PACK_K_MULTIPLE = 16
#: Above this many rows the weight-only GEMM dequantizes the weight and runs a bf16 mm instead: there
#: _weight_int8pack_mm is slower than Inductor's own code (measured: docs/benchmarks.md, "Measurements first
#: quoted in code comments").
INT8PACK_MAX_ROWS = 64
#: M from which a CPU without int8 dot instructions runs an int8 GEMM as float32 GEMMs (`int8_matmul_in_float32`):
#: its torch._int_mm is emulated. Measured on a 2-core AVX2 EPYC (torch 2.13), _int_mm's time / the float32
#: GEMMs': 1.1-3.0x at M = 8, 2.6-5.6x at 16, 6.9-22x from 64 rows, over K x N of 1024 x 1024 to 14336 x 4096;
#: below, the weight converted on every call costs more (0.19-0.77x at M = 1) (docs/benchmarks.md)
FLOAT32_INT8_MIN_ROWS = 8
#: the K of one exact float32 GEMM of int8 values: 1024 x 2^14 = 2^24
FLOAT32_EXACT_K = 1024
#: Where the CPU has no int8 dot instructions (AVX-512 VNNI, AMX), an int8 linear written in float (PT2E, fake
#: quant) runs `_int_mm` only up to this many rows of a weight of at least this many elements; elsewhere Inductor's
#: float GEMM of the linear as written is faster (`_why_the_float_gemm_is_faster`).
EMULATED_INT8_MAX_ROWS = 2
EMULATED_INT8_MIN_WEIGHT = 4096 * 4096
_INT8_ACTIVATIONS = (torch.int8, torch.uint8)  # uint8 arrives shifted to int8 (the passes do it)
_INT8_ROW = dict(activation_dtypes=_INT8_ACTIVATIONS, weight_dtypes=(torch.int8,), activation_zero_point=True,
                 weight_zero_point=True)
_FP8_ROW = dict(activation_dtypes=(FP8_DTYPE,), weight_dtypes=(FP8_DTYPE,))


def _int4_cpu_max_rows(key: GemmKey, platform: Platform) -> int:
    """`int4_cpu.max_rows` of this CPU linear (`weight_zero_point_foldable`: the int4 values stored as int8)."""
    return int4_cpu.max_rows(key.scheme.activation_dtype, key.weight_zero_point_foldable, platform.cpu_has_amx)


def _tinygemm_can_implement(key: GemmKey) -> Verdict:
    """What the CUDA int4 row's table cannot say (`qfuse.kernels.int4_tinygemm`)."""
    if key.scheme.weight_group_size not in int4_tinygemm.GROUP_SIZES:
        return False, f"_weight_int4pack_mm takes groups of {int4_tinygemm.GROUP_SIZES}, not {key.scheme.weight_group_size}"
    if key.weight_scale_dtype != int4_tinygemm.SCALE_DTYPE:
        return False, (f"_weight_int4pack_mm holds the group scales in bf16, and these are "
                       f"{'of no recorded dtype' if key.weight_scale_dtype is None else dtype_name(key.weight_scale_dtype)}")
    return OK


class TorchKernel(Kernel):
    name = "torch"
    output_fuses_into_consumers = True  # its lowering: an ATen GEMM, then the scales in Inductor's pointwise code
    #: an int4 weight is packed once into ATen's int4pack layout (a copy) and runs as the op's extern call
    #: (its lowering takes only frozen weights, where the sibling pass does not run)
    runs_siblings_of = ("int4_weight_only_mm",)
    capabilities = (
        Capability("int8 torch._int_mm", ("cpu",), **_INT8_ROW),
        Capability("int8 torch._int_mm (cuBLASLt)", ("cuda",), **_INT8_ROW, k_multiple=8, n_multiple=8),
        Capability("fp8 upcast + torch.mm", ("cpu",), **_FP8_ROW),
        Capability("fp8 torch._scaled_mm (cuBLASLt)", ("cuda",), **_FP8_ROW, k_multiple=16, n_multiple=16,
                   min_capability=89, rocm=False, sums_below_float32=True),
        # bf16 only: fp32 is several times slower than Inductor's own code (docs/benchmarks.md, "qfuse on the
        # hand-written int8 form");
        # K a multiple of 16: torch 2.13's bf16 kernel crashes on other K.
        Capability("int8 weight-only torch._weight_int8pack_mm", ("cpu",), (torch.bfloat16,), (torch.int8,),
                   weight_zero_point=True, k_multiple=BF16_INT8PACK_K_MULTIPLE),
        Capability("int4 weight-only torch._weight_int4pack_mm_for_cpu; float32, zero points in bf16 / fp16: qfuse C++",
                   ("cpu",), FLOAT_ACTIVATION_DTYPES, (INT4_DTYPE,),
                   weight_scales=(Granularity.PER_GROUP,), weight_zero_point=True,
                   weight_group_multiple=min(int4_cpu.GROUP_SIZES), n_multiple=int4_cpu.N_MULTIPLE),
        Capability("int4 weight-only torch._weight_int4pack_mm (tinygemm)", ("cuda",), (torch.bfloat16,), (INT4_DTYPE,),
                   weight_scales=(Granularity.PER_GROUP,), weight_group_multiple=min(int4_tinygemm.GROUP_SIZES),
                   k_multiple=int4_tinygemm.K_MULTIPLE, n_multiple=int4_tinygemm.N_MULTIPLE,
                   min_capability=int4_tinygemm.MIN_CAPABILITY, rocm=False),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type in ("cpu", "cuda"):
            return OK
        return False, f"torch kernel runs on CPU and CUDA / ROCm GPUs only, not on {platform.describe()}"

    def can_implement(self, key: GemmKey, platform: Platform) -> Verdict:
        scheme = key.scheme
        if scheme.weight_dtype != INT4_DTYPE:
            return OK
        if key.device_type == "cuda":
            return _tinygemm_can_implement(key)
        if scheme.weight_group_size not in int4_cpu.GROUP_SIZES:
            return False, (f"_weight_int4pack_mm_for_cpu takes groups of {int4_cpu.GROUP_SIZES}, "
                           f"not {scheme.weight_group_size}")
        return OK

    def why_inductor_is_faster(self, key: GemmKey, platform: Platform) -> str:
        if key.device_type != "cpu":
            return ""
        if key.scheme.activation_dtype in _INT8_ACTIVATIONS:
            return _why_the_float_gemm_is_faster(key, platform)
        if key.scheme.weight_dtype != INT4_DTYPE:
            return ""
        scheme = key.scheme
        if scheme.activation_dtype == torch.float32 and key.m != 1 and (
                reason := int4_zero_points.why_not_built(torch.float32)):  # ATen's float32 kernel alone
            return ("in float32 _weight_int4pack_mm_for_cpu's time grows by its one-row time with every row, slower "
                    "than Inductor's own dequantize + mm from a few rows on (docs/benchmarks.md, \"torchao's int4 "
                    f"'intx' form\"), and qfuse's C++ kernel for float32: {reason}: taken at a static M = 1 only, not "
                    f"at {'a dynamic M' if key.m is None else f'M = {key.m}'}")
        rows = _int4_cpu_max_rows(key, platform)
        if key.m is not None and key.m > rows:
            where = (f", on AMX with the int4 values stored a byte each, in {dtype_name(scheme.activation_dtype)}"
                     if rows != int4_cpu.MAX_ROWS else "")
            return (f"at M = {key.m} the CPU int4 kernels are slower than Inductor's own dequantize + mm (above "
                    f"{rows} rows{where}; docs/benchmarks.md, \"qfuse's int4 weight-only linear\", \"int4 with "
                    "float32 activations on the CPU\", \"cpu_grid on an AMX Xeon\")")
        return ""

    def why_slower_here(self, key: GemmKey, platform: Platform) -> str:
        if key.scheme.weight_dtype == INT4_DTYPE and key.device_type == "cuda" and not int4_tinygemm.wins_here(key, platform):
            return ("ATen's tinygemm runs as the op's extern call, whose Python costs more per call than the Triton "
                    "decode template's GPU time; it is faster only at M = 1 under CUDA graphs (kernels/int4_tinygemm.py)")
        return super().why_slower_here(key, platform)

    def speed_row_bounds(self, key: GemmKey, platform: Platform) -> tuple[int, ...]:
        if key.scheme.weight_dtype != INT4_DTYPE:
            return ()
        if key.device_type == "cpu":  # `why_inductor_is_faster`'s step: above it a dynamic M runs Inductor's code
            return (_int4_cpu_max_rows(key, platform),)
        return int4_tinygemm.row_bounds(key, platform)

    def prepare_int4_weight(self, values, scale, zero_point) -> PreparedWeight:
        if values.device.type == "cuda":
            if zero_point is not None:
                raise ValueError("the torch kernel's CUDA int4 GEMM (tinygemm) takes symmetric weights only")
            return int4_tinygemm.pack(values, scale)
        return int4_cpu.pack(values, scale, zero_point)

    def weight_only_apply(self, x, weight, bias, out_dtype):
        """x @ ((b - azp_b) * scale_b) + bias for a float x and an int8 [K, N] weight (see
        `weight_only_int8_mm`), or an int4 weight packed by `prepare_int4_weight` (`int4_cpu.int4pack_mm`
        on CPU, `int4_tinygemm.int4pack_mm` on CUDA)."""
        if weight.packing in int4_cpu.PACKINGS:
            return int4_cpu.int4pack_mm(x, weight, bias, out_dtype)
        if weight.packing == Packing.INT4PACK_CUDA:
            return int4_tinygemm.int4pack_mm(x, weight, bias, out_dtype)
        b, scale, n = weight.data, weight.scale, weight.n
        if b.dtype != torch.int8 or (scale is not None and scale.numel() not in (1, n)):
            raise ValueError(f"the torch kernel's weight-only GEMM takes an int8 weight with one scale or one per "
                             f"output channel, got {b.dtype} with scale shape {None if scale is None else tuple(scale.shape)}")
        return weight_only_int8_mm(x, b, scale, weight.zero_point, bias, out_dtype)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        b, scale_b, azp_b = weight.data, weight.scale, weight.zero_point
        for name, scale, shape in (("scale_a", scale_a, (a.shape[0], 1)), ("scale_b", scale_b, (1, b.shape[1]))):
            if scale is not None and scale.numel() != 1 and tuple(scale.shape) != shape:
                raise ValueError(f"the torch kernel takes per-tensor, per-row or per-column scales; {name} has "
                                 f"shape {tuple(scale.shape)} (block scales need another kernel)")
        if a.dtype.is_floating_point:
            return _fp8_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)
        return int8_scaled_mm(a, b, scale_a, scale_b, bias, azp_a, azp_b, out_dtype)


def _why_the_float_gemm_is_faster(key: GemmKey, platform: Platform) -> str:
    """Why Inductor's float GEMM of an int8 linear written in float (PT2E, fake quant) is faster than this kernel on
    this CPU, or '': without int8 dot instructions (AVX-512 VNNI, AMX) `_int_mm` is emulated, and it wins only at
    a row or two of a large weight (docs/benchmarks.md, "PT2E static on a CPU without int8 dot instructions"); from
    FLOAT32_INT8_MIN_ROWS rows the kernel's float32 GEMMs (`int8_matmul_in_float32`) do what Inductor's float
    GEMM does, with no gain to take the linear for."""
    if not key.float_gemm_as_written or platform.cpu_has_int8_dot_products:
        return ""
    if key.m is not None and key.m <= EMULATED_INT8_MAX_ROWS and key.k * key.n >= EMULATED_INT8_MIN_WEIGHT:
        return ""
    at = "a dynamic M" if key.m is None else f"M = {key.m}, K x N = {key.k} x {key.n}"
    return (f"this CPU has no int8 dot instructions (AVX-512 VNNI, AMX): its torch._int_mm is emulated, slower than "
            f"Inductor's float GEMM of the linear as written except at M <= {EMULATED_INT8_MAX_ROWS} with K x N >= "
            f"{EMULATED_INT8_MIN_WEIGHT:,} (measured, docs/benchmarks.md), not at {at}")


def weight_only_int8_mm(x, b, scale_b, azp_b, bias, out_dtype):
    """aten._weight_int8pack_mm(x, b^T, scale_b): the [N, K] weight contiguous (a `w.t()` view of a stored
    weight is: no copy), the scales one per column in x's dtype, the result in x's dtype.

    A weight zero point of all zeros (what PT2E stores for a symmetric weight) is dropped; any other
    is exact by x @ ((b - z) s) = (x @ b) s - rowsum(x) (z s), in float32 (in bf16 the two terms could
    cancel into a result with few correct bits)."""
    k, n = b.shape
    if x.dtype == torch.bfloat16 and k % BF16_INT8PACK_K_MULTIPLE:
        raise ValueError(f"the torch kernel's weight-only GEMM takes a bf16 activation only with K a multiple of "
                         f"{BF16_INT8PACK_K_MULTIPLE} (torch 2.13's _weight_int8pack_mm crashes otherwise), got K={k}")
    if azp_b is not None and not bool(azp_b.any()):
        azp_b = None
    if x.shape[0] > INT8PACK_MAX_ROWS:  # prefill: a GEMM of the weight dequantized here is faster
        weight = b.to(torch.float32) if azp_b is None else b.to(torch.float32) - azp_b.to(torch.float32).reshape(1, -1)
        weight = (weight if scale_b is None else weight * scale_b.to(torch.float32).reshape(1, -1)).to(x.dtype)
        out = torch.mm(*_operands_of_a_fast_gemm(x, weight))
        return out.to(out_dtype) if bias is None else (out.to(torch.float32) + bias.to(torch.float32)).to(out_dtype)
    compute = x.dtype if azp_b is None else torch.float32
    scale = (torch.ones((), dtype=compute) if scale_b is None else scale_b.to(compute)).reshape(-1).expand(n)
    out = torch.ops.aten._weight_int8pack_mm(x.to(compute).contiguous(), b.t().contiguous(), scale.contiguous())
    if azp_b is None and bias is None:
        return out.to(out_dtype)
    out = out.to(torch.float32)
    if azp_b is not None:
        out = out - x.sum(dim=-1, keepdim=True, dtype=torch.float32) * (azp_b.to(torch.float32).reshape(1, -1) * scale)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _operands_of_a_fast_gemm(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and w as they are, or, for bf16 on a CPU without bf16 dot products, upcast to float32: the same products
    (exact in float32) and the same float32 sums."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or current_platform("cpu").cpu_has_bf16_dot_products:
        return x, w
    return x.to(torch.float32), w.to(torch.float32)


def nan_where_not_finite(scale_a: torch.Tensor) -> torch.Tensor:
    """0 where the activation scale is finite, nan where it is inf or nan. Added to the output it
    makes those rows nan, as eager's are: a row with an inf has scale inf, eager casts the nan of
    inf / inf to int8 0 and the rest rounds to 0, so its accumulator is 0 and 0 x inf is nan
    (Inductor's code casts nan to -128, which would give +-inf)."""
    return scale_a - scale_a


def times_activation_scale(out: torch.Tensor, scale_a: torch.Tensor) -> torch.Tensor:
    """float32 `out` x `scale_a` (one value or one per row), the rows of a non-finite scale nan."""
    scale = scale_a.to(torch.float32)
    return out * scale + nan_where_not_finite(scale)


def _apply_epilogue(acc, scale_a, scale_b, bias, out_dtype):
    out = acc.to(torch.float32)
    if scale_a is not None:
        out = times_activation_scale(out, scale_a)
    if scale_b is not None:
        out = out * scale_b.to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def dense_unit_strides(x: torch.Tensor) -> torch.Tensor:
    """The same 2D view with each size-1 dim given the stride a dense tensor has there. Its stride
    is insignificant, and Inductor often makes it 0, but CPU `_int_mm` (torch 2.13) reads a [1, K]
    activation whose row stride is not K, or a [K, 1] weight whose column stride is not K, wrongly."""
    rows, columns = x.shape
    if rows == 1 and x.stride(0) != columns * x.stride(1):
        return x.as_strided(x.shape, (columns * x.stride(1), x.stride(1)))
    if columns == 1 and x.stride(1) != rows * x.stride(0):
        return x.as_strided(x.shape, (x.stride(0), rows * x.stride(0)))
    return x


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm, except where it is wrong (torch 2.13, CPU): with K == 1 it returns garbage, so
    there the int32 outer product, which is exact, stands in; a size-1 dim gets its dense stride. On a CPU
    without int8 dot products, from FLOAT32_INT8_MIN_ROWS rows, exact float32 GEMMs (`int8_matmul_in_float32`;
    the lowering takes them for a static K only: both are exact, only their speed differs)."""
    if a.is_cuda:
        return torch._int_mm(a, b)
    if a.shape[1] == 1:
        return a.to(torch.int32) * b.to(torch.int32)
    if a.shape[0] >= FLOAT32_INT8_MIN_ROWS and not current_platform("cpu").cpu_has_int8_dot_products:
        return int8_matmul_in_float32(a, b, a.shape[1], TORCH_OPS)
    return torch._int_mm(dense_unit_strides(a), dense_unit_strides(b))


def int8_matmul_in_float32(a, b, k: int, ops: ArrayOps):
    """a @ b of int8 [M, K] and [K, N] matrices as float32 GEMMs, exactly: each product is at most 128 x 128 =
    2^14 in size, so over FLOAT32_EXACT_K = 1024 terms every partial sum is an integer below 2^24, exact in
    float32 in any order; a longer K is summed in such chunks, each converted to int32 and added in int32 (the
    sum eager's int32 accumulator holds). Written once for the eager kernel and its lowering (`ops`)."""
    acc = None
    for start in range(0, k, FLOAT32_EXACT_K):
        length = min(FLOAT32_EXACT_K, k - start)
        part = ops.float32_mm_as_int32(ops.narrow(a, 1, start, length), ops.narrow(b, 0, start, length))
        acc = part if acc is None else ops.add(acc, part)
    return acc


def int8_scaled_mm(a, b, scale_a, scale_b, bias, azp_a, azp_b, out_dtype):
    rows = a.shape[0]
    padded = a
    if a.is_cuda and rows < CUDA_INT_MM_MIN_ROWS:
        padded = torch.nn.functional.pad(a, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - rows))
    acc = int8_matmul(padded, b)[:rows]
    zero_a, zero_b = (None if zero is None else zero.to(torch.int32) for zero in (azp_a, azp_b))
    acc = zero_point_correction(acc, a, b, zero_a, zero_b, a.shape[1], TORCH_OPS)
    return _apply_epilogue(acc, scale_a, scale_b, bias, out_dtype)


def zero_point_correction(acc, a, b, zero_a, zero_b, k, ops: ArrayOps):
    """The int32 accumulator of (a - zero_a) @ (b - zero_b) from acc = a @ b: acc - zero_a colsum(b)
    - rowsum(a) zero_b + K zero_a zero_b. zero_a [M, 1] or one value, zero_b [1, N] or one value (int32
    or None); written once, for the eager kernel (`TORCH_OPS`) and its lowering (`lowerings.ir.IR_OPS`)."""
    if zero_a is not None:
        acc = ops.sub(acc, ops.mul(zero_a, ops.int32_sum(b, 0)))
    if zero_b is not None:
        acc = ops.sub(acc, ops.mul(ops.int32_sum(a, 1), zero_b))
        if zero_a is not None:
            acc = ops.add(acc, ops.mul(ops.mul(zero_a, zero_b), k))
    return acc


def _fp8_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype):
    if not a.is_cuda:
        compute_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
        acc = torch.mm(a.to(compute_dtype), b.to(compute_dtype))
        return _apply_epilogue(acc, scale_a, scale_b, bias, out_dtype)
    b = b.t().contiguous().t()  # cuBLAS wants the weight column-major
    unit = torch.ones((), device=a.device, dtype=torch.float32)
    sa = unit if scale_a is None else scale_a.to(torch.float32)
    sb = unit if scale_b is None else scale_b.to(torch.float32)
    if sa.numel() == 1 and sb.numel() == 1:
        return torch._scaled_mm(a, b, sa.reshape(()), sb.reshape(()), bias=bias, out_dtype=out_dtype)
    if out_dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16):
        rows, cols = a.shape[0], b.shape[1]
        return torch._scaled_mm(
            a, b, sa.expand(rows, 1).contiguous(), sb.reshape(1, -1).expand(1, cols).contiguous(),
            bias=bias, out_dtype=out_dtype,
        )
    acc = torch._scaled_mm(a, b, unit, unit, out_dtype=torch.float32)
    return _apply_epilogue(acc, sa, sb, bias, out_dtype)
