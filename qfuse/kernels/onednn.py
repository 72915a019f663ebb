"""`onednn`: oneDNN's int8 GEMM on x86 CPUs (AMX tiles or AVX-512 VNNI), and fp8 block W8A16.

    W8A8 int8   ((a - azp_a) * scale_a) @ (b * scale_b) + bias   torch.ops.onednn.qlinear_pointwise
    W8A16 fp8   x @ (b * scale_b) + bias, x bf16 (not quantized)  vLLM's fp8_scaled_mm_cpu, else oneDNN bf16

Constraints (`is_supported` for the machine, the capability table `OneDnnKernel.capabilities` for
the rest, each tested):

    machine      x86 CPU with AMX or AVX-512 VNNI; torch built with oneDNN (mkldnn)
    int8 W8A8    activation int8 (uint8 arrives shifted to int8), per-tensor or per-token scale,
                 static or dynamic, zero point one value or one per row; weight int8, per-tensor or
                 per-channel scale; a weight zero point of all zeros (what PT2E's quantizers store
                 for symmetric weights, as a tensor the compiler cannot see into) is dropped when
                 the weight is prepared; any other runs the torch kernel's exact zero-point math
                 (qlinear ignores w_zero_point: wrong results);
                 no per-group / 128x128 block scales; out fp32 / bf16 / fp16; any M, K, N
    fp8 W8A8     rejected: torch's fp8 qlinear has no oneDNN brgemm behind it (no primitive in
                 ONEDNN_VERBOSE) and is slower than the torch kernel's bf16 upcast on AVX-512 VNNI and
                 AMX (measured: docs/benchmarks.md, "Measurements first quoted in code comments"): the
                 torch kernel runs it
    fp8 W8A16    weight fp8 e4m3fn with 128x128 block scales (vLLM's CPU kernel: K blocks of 128,
                 N blocks a multiple of 32); activation bf16 only (the weight is prepared once as
                 bf16; fp16 / fp32 would need another copy or a lossy cast); out bf16 or fp32

What runs where:
    prepare_weight, once per weight (`prepared.prepare_once`):
        int8   onednn.qlinear_prepack(b^T): oneDNN's blocked layout for this CPU (AMX or VNNI);
               weight scale as float32 [N] or [1]; column sums of b times its scale (for per-row
               zero points)
        fp8    vLLM importable and AMX (vLLM's own gate), N a multiple of 16, K even (its packing):
               convert_weight_packed(b^T) and the block scale as [N/128, K/128]; otherwise
               b * scale_b dequantized to bf16 [N, K] and reordered by oneDNN
               (mkldnn._reorder_linear_weight, the bf16 layout Inductor's CPU freezing uses)
    apply, per call:
        a + 128 as uint8 (one xor): oneDNN's brgemm takes uint8 activations on AVX-512 VNNI; int8
        ones fall to its reference kernel (`ref_int8`), orders of magnitude slower (docs/benchmarks.md,
        "Measurements first quoted in code comments"); AMX runs both at one speed.
        One value of scale_a and azp_a: one qlinear call does it all (zero point azp_a + 128,
        scales, fp32 bias, out dtype). qlinear takes one activation scale and zero point, so with a
        per-token scale or per-row zero point it runs with scale 1, zero point 128, no bias, fp32
        out, and a torch epilogue does (acc - azp_a * column_sums) * scale_a + bias, cast.
    weight_only_apply, per call: vLLM's fp8_scaled_mm_cpu (bf16 out; cast to fp32 when asked), or
        mkldnn._linear_pointwise(x, packed bf16 weight, fp32 bias); an fp32 output is the bf16 GEMM
        result widened, plus the bias in fp32.

Where it is taken (`why_slower_here`): per int8 engine, `CROSSOVERS` says from which weight, N and M the op was
measured faster than Inductor's own `_int_mm` code (the `torch` kernel's lowering); elsewhere the registry passes it
over. On AMX `_int_mm` is itself oneDNN's AMX GEMM, called by Inductor's code with no Python between, so the op
wins only where its GEMM has many rows to amortize its per-call cost.

What each way costs, on a Zen 4 (AVX-512 VNNI) and an AMX Xeon: docs/benchmarks.md, "The oneDNN tables".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qfuse.kernels.base import OK, GemmKey, Kernel, Verdict
from qfuse.kernels.capabilities import STATIC, Capability
from qfuse.kernels.prepared import PreparedWeight
from qfuse.kernels.torch_native import int8_scaled_mm, nan_where_not_finite, times_activation_scale
from qfuse.platform import Platform, current_platform
from qfuse.schemes import FP8_DTYPE, GROUP_SIZE, Granularity

INT8_ACTIVATION_GRANULARITIES = (Granularity.PER_TENSOR, Granularity.PER_TOKEN)
INT8_WEIGHT_GRANULARITIES = (Granularity.PER_TENSOR, Granularity.PER_CHANNEL)
INT8_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: int8 activations are shifted by this into uint8, the activation type of oneDNN's VNNI brgemm.
ACTIVATION_SHIFT = 128

W8A16_ACTIVATION_DTYPES = (torch.bfloat16,)
W8A16_OUT_DTYPES = (torch.bfloat16, torch.float32)
#: vLLM's convert_weight_packed (from sgl-kernel) packs N in tiles of 16 and K in VNNI pairs.
VLLM_PACK_N_MULTIPLE = 16
VLLM_PACK_K_MULTIPLE = 2

FP8_W8A8_REASON = (
    "fp8 W8A8 is not onednn's: torch's fp8 qlinear has no oneDNN brgemm behind it and is slower than the "
    "torch kernel's bf16 upcast (measured on AVX-512 VNNI and on AMX: docs/benchmarks.md, \"Measurements first "
    "quoted in code comments\")"
)


def int8_engine(platform: Platform) -> str:
    """Which oneDNN int8 GEMM this CPU gets: AMX tiles when it has them, else AVX-512 VNNI."""
    return "AMX" if platform.cpu_has_amx else "AVX-512 VNNI"


@dataclass(frozen=True)
class Crossover:
    """Where qfuse's oneDNN op was measured faster than Inductor's own `_int_mm` code on one int8 engine: a weight
    of at least `min_weight_elements` (K x N) and `min_n` columns, at more than `rows_above` rows; `measured` says
    what the measurement found and where."""

    min_weight_elements: int
    min_n: int
    rows_above: int
    measured: str


#: Per int8 engine (`int8_engine`): one W8A8 linear, the op forced against plain Inductor (docs/benchmarks.md,
#: "The oneDNN tables" and "cpu_peers on an AMX Xeon").
CROSSOVERS = {
    "AVX-512 VNNI": Crossover(1 << 23, 0, 0, "a Zen 4, 2 threads: 1.2-2.5x Inductor at 4096 x 4096, a tie at "
                                             "1024 x 4096, slower at 1024 x 1024"),
    "AMX": Crossover(1 << 23, 4096, 64, "a 2-core AMX Xeon: 0.4-0.9x Inductor up to 64 rows from 1024 x 1024 to "
                                        "4096 x 4096; at 256 rows 1.10-1.27x with N >= 4096, 0.92-1.02x with N <= 2048"),
}


@dataclass(frozen=True)
class OneDnnWeight(PreparedWeight):
    """A weight prepacked by oneDNN: `packed` is the opaque MKLDNN tensor its op takes.

    An MKLDNN tensor has no storage, and `prepare_once` compares the storage of `data` with the
    weight's, so `data` holds a plain tensor: for int8, the weight's column sums times its scale,
    float32 [1, N] (what a per-row activation zero point subtracts); for bf16 W8A16, nothing (an
    empty tensor). int8: `scale` float32 [N] or [1], `zero_point` the all-zero int32 weight zero
    point that qlinear wants.
    """

    packed: torch.Tensor | None = None

    @property
    def scaled_column_sums(self) -> torch.Tensor:
        return self.data


def _packed_as(weight: PreparedWeight, dtype: torch.dtype) -> bool:
    return isinstance(weight, OneDnnWeight) and weight.packed is not None and weight.packed.dtype == dtype


def _too_small(key: GemmKey, crossover: Crossover) -> bool:
    """Whether the weight is below the crossover's size or columns, at any M."""
    small = key.k is not None and key.n is not None and key.k * key.n < crossover.min_weight_elements
    return small or key.n is not None and key.n < crossover.min_n


class OneDnnKernel(Kernel):
    name = "onednn"
    prepares_weight = True
    capabilities = (
        # A weight zero point of all zeros (PT2E's symmetric weights) is dropped; others run torch's math.
        Capability("int8 W8A8 qlinear", ("cpu",), (torch.int8, torch.uint8), (torch.int8,),
                   INT8_ACTIVATION_GRANULARITIES, INT8_WEIGHT_GRANULARITIES, activation_zero_point=True,
                   weight_zero_point=True, out_dtypes=INT8_OUT_DTYPES),
        Capability("fp8 W8A8", ("cpu",), (FP8_DTYPE,), (FP8_DTYPE,), declined=FP8_W8A8_REASON),
        # vLLM's CPU fp8 kernel wants K blocks of 128 and N blocks a multiple of 32: qfuse's 128 x 128 fit.
        Capability("fp8 W8A16", ("cpu",), W8A16_ACTIVATION_DTYPES, (FP8_DTYPE,), (Granularity.PER_TENSOR,),
                   (Granularity.BLOCK,), activation_scale_kinds=(STATIC,), out_dtypes=W8A16_OUT_DTYPES),
    )

    def describe(self, platform: Platform) -> str:
        return f"oneDNN int8 GEMM on {int8_engine(platform)}"

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type != "cpu":
            return False, f"onednn runs on x86 CPUs, not on {platform.describe()}"
        if not torch.backends.mkldnn.is_available():
            return False, "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
        if not platform.cpu_has_int8_dot_products:
            return False, f"oneDNN's int8 GEMM needs AMX or AVX-512 VNNI; this {platform.describe()} has neither"
        return OK

    def why_slower_here(self, key: GemmKey, platform: Platform) -> str:
        """Outside this engine's `CROSSOVERS` entry Inductor's own GEMM is faster (an unknown size or M: taken, and a
        dynamic M is chosen for again per bucket, `speed_row_bounds`)."""
        engine = int8_engine(platform)
        crossover = CROSSOVERS[engine]
        few_rows = key.m is not None and key.m <= crossover.rows_above
        if not (_too_small(key, crossover) or few_rows):
            return ""
        where = [f"K x N >= {crossover.min_weight_elements:,}"] + [f"N >= {crossover.min_n}"] * bool(crossover.min_n)
        where += [f"M > {crossover.rows_above}"] * bool(crossover.rows_above)
        at = f"{'a dynamic M' if key.m is None else f'M = {key.m}'}, K x N = {key.k} x {key.n}"
        return (f"on {engine} its per-call cost outweighs its faster GEMM except at {', '.join(where)} ({crossover.measured}; "
                f"docs/benchmarks.md): Inductor's own GEMM is faster at {at}")

    def speed_row_bounds(self, key: GemmKey, platform: Platform) -> tuple[int, ...]:
        """The crossover's rows, where the weight's size leaves M to decide (a weight too small for the op at every
        M needs no compile of its own per bucket)."""
        crossover = CROSSOVERS[int8_engine(platform)]
        return (crossover.rows_above,) if crossover.rows_above and not _too_small(key, crossover) else ()

    def prepare_weight(self, b, scale_b, azp_b) -> PreparedWeight:
        if azp_b is not None and bool(azp_b.any()):
            return PreparedWeight(b, scale_b, azp_b, *b.shape)  # qlinear ignores it: the torch kernel's math runs
        if b.dtype == torch.int8:
            return _prepare_int8(b, scale_b)
        if b.dtype == FP8_DTYPE:
            return _prepare_fp8_weight_only(b, scale_b)
        raise ValueError(f"onednn takes int8 (W8A8) or fp8 (W8A16) weights, got {b.dtype}")

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        if weight.zero_point is not None and not isinstance(weight, OneDnnWeight):
            return int8_scaled_mm(a, weight.data, scale_a, weight.scale, bias, azp_a, weight.zero_point, out_dtype)
        if a.dtype != torch.int8 or not _packed_as(weight, torch.int8):
            raise ValueError(f"onednn's W8A8 GEMM takes int8 activations and weights, got {a.dtype} x "
                             f"{weight.data.dtype} ({FP8_W8A8_REASON})")
        if a.shape[0] == 0:  # (a per-token scale of no rows is no one-value scale either)
            return torch.empty(0, weight.n, dtype=out_dtype)
        shifted = a.view(torch.uint8) ^ ACTIVATION_SHIFT
        zero_point = torch.tensor(ACTIVATION_SHIFT, dtype=torch.int32)
        if azp_a is not None and azp_a.numel() == 1:
            zero_point = zero_point + azp_a.reshape(()).to(torch.int32)
        per_row = (scale_a is not None and scale_a.numel() > 1) or (azp_a is not None and azp_a.numel() > 1)
        if not per_row:
            out = _qlinear(shifted, scale_a, zero_point, weight, bias, out_dtype)
            return out if scale_a is None else out + nan_where_not_finite(scale_a.reshape(())).to(out_dtype)
        out = _qlinear(shifted, None, zero_point, weight, None, torch.float32)
        if azp_a is not None and azp_a.numel() > 1:
            out = out - azp_a.to(torch.float32) * weight.scaled_column_sums
        if scale_a is not None:
            out = times_activation_scale(out, scale_a)
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)

    def weight_only_apply(self, x, weight, bias, out_dtype):
        if x.dtype not in W8A16_ACTIVATION_DTYPES:
            raise ValueError(f"onednn's W8A16 takes {W8A16_ACTIVATION_DTYPES} activations, got {x.dtype}")
        if weight.data.dtype == FP8_DTYPE:
            return _vllm_fp8_scaled_mm(x, weight, bias, out_dtype)
        if not _packed_as(weight, torch.bfloat16):
            raise ValueError("onednn's W8A16 takes an fp8 weight; this one was prepared for int8 W8A8")
        if out_dtype == torch.bfloat16:
            return _bf16_linear(x, weight.packed, bias)
        out = _bf16_linear(x, weight.packed, None).to(out_dtype)
        return out if bias is None else out + bias.to(out_dtype)


def _prepare_int8(b: torch.Tensor, scale_b: torch.Tensor | None) -> OneDnnWeight:
    k, n = b.shape
    if scale_b is not None and scale_b.numel() not in (1, n):
        raise ValueError(f"onednn's qlinear takes one weight scale or one per channel ({n}), got {tuple(scale_b.shape)}")
    packed = torch.ops.onednn.qlinear_prepack(b.t().contiguous(), None)  # takes [N, K]; M unknown
    scale = torch.ones(1) if scale_b is None else scale_b.reshape(-1).to(torch.float32)
    column_sums = b.sum(dim=0, dtype=torch.int32).to(torch.float32).reshape(1, n) * scale
    zero_point = torch.zeros(scale.shape, dtype=torch.int32)
    return OneDnnWeight(column_sums, scale, zero_point, k, n, packed=packed)


def _qlinear(shifted, scale_a, zero_point, weight: OneDnnWeight, bias, out_dtype) -> torch.Tensor:
    """onednn.qlinear_pointwise on the uint8-shifted activation: one activation scale and zero point."""
    scale = torch.ones(()) if scale_a is None else scale_a.reshape(()).to(torch.float32)
    return torch.ops.onednn.qlinear_pointwise.tensor(
        shifted, scale, zero_point, weight.packed, weight.scale, weight.zero_point,
        None if bias is None else bias.to(torch.float32),
        1.0, 0, out_dtype, "none", [], "",  # output scale 1, zero point 0: a float output
    )


def dequantize_weight(b: torch.Tensor, scale_b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """b [K, N] times its scale (one value, [1, N], or 128x128 blocks), as `dtype`."""
    (k, n), weight = b.shape, b.to(torch.float32)
    if scale_b is not None:
        scale = scale_b.to(torch.float32)
        if scale.dim() == 2 and tuple(scale.shape) != (1, n):  # one per 128x128 block
            scale = scale.repeat_interleave(GROUP_SIZE, 0)[:k].repeat_interleave(GROUP_SIZE, 1)[:, :n]
        weight = weight * scale
    return weight.to(dtype)


def vllm_cpu_ops():
    """vLLM's CPU custom ops (`torch.ops._C`), registered by importing vllm's extension."""
    import vllm._custom_ops  # noqa: F401  (loads vllm._C)

    return torch.ops._C


def _vllm_w8a16_usable(platform: Platform, k: int, n: int, scale_b: torch.Tensor | None) -> bool:
    block_scale = scale_b is not None and tuple(scale_b.shape) == (math.ceil(k / GROUP_SIZE), math.ceil(n / GROUP_SIZE))
    return (platform.has("vllm") and platform.cpu_has_amx and block_scale
            and n % VLLM_PACK_N_MULTIPLE == 0 and k % VLLM_PACK_K_MULTIPLE == 0
            and hasattr(vllm_cpu_ops(), "fp8_scaled_mm_cpu"))


def _prepare_fp8_weight_only(b: torch.Tensor, scale_b: torch.Tensor | None) -> PreparedWeight:
    k, n = b.shape
    if _vllm_w8a16_usable(current_platform("cpu"), k, n, scale_b):
        packed = vllm_cpu_ops().convert_weight_packed(b.t().contiguous())  # [N, K] -> AMX VNNI layout
        return PreparedWeight(packed, scale_b.t().contiguous().to(torch.float32), None, k, n)
    weight = dequantize_weight(b, scale_b, torch.bfloat16).t().contiguous()  # [N, K]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # oneDNN's bf16 layout; M unknown
    return OneDnnWeight(torch.empty(0, dtype=torch.bfloat16), None, None, k, n, packed=packed)


def _bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 @ the packed bf16 weight (+ bias, added in float32 by oneDNN), bf16 [M, N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None if bias is None else bias.to(torch.float32),
                                              "none", [], "")


def _vllm_fp8_scaled_mm(x, weight: PreparedWeight, bias, out_dtype) -> torch.Tensor:
    """vLLM's kernel writes the activation's dtype (bf16) and adds a float32 bias."""
    out = vllm_cpu_ops().fp8_scaled_mm_cpu(
        x.contiguous(), weight.data, weight.scale, [GROUP_SIZE, GROUP_SIZE],  # block [N, K]
        None if bias is None else bias.to(torch.float32), x.dtype, True,  # is_vnni: packed once
    )
    return out.to(out_dtype)
