"""`cuda`: qfuse's own CUDA C++ kernels, compiled at first use by NVRTC and launched from C++ (`launch`).

Two decode GEMMs on tensor cores, each streaming a weight repacked once so that a lane's 16-byte load is the
A operand of its MMAs (the quantized weight on the MMA's 16-row side, the few activation rows on its 8-column
side):
- `int4_mma` (W4A16): an int4 weight dequantized in registers exactly as eager rounds it;
- `w8_mma` (W8A8 int8 / fp8, and W8A16 with an int8 / fp8 weight): 8-bit MMAs on the quantized activation,
  or the weight converted exactly to the activation's half dtype; scales, bias and cast in its epilogue.
Both launch from C++ (`launch`). The int4 kernel is called from Inductor's generated code
(`qfuse.lowerings.cuda`: no op dispatch); the 8-bit one runs as the op's extern call. Kernel choice takes them
at decode (M <= 16; a dynamic M per bucket) under CUDA graphs (mode="reduce-overhead"), whose replays run no
Python, and without CUDA graphs the int4 linears launched from Inductor's code, whose host time a call is now
below the Triton templates' launches (a decoder step, host-bound in default mode, ran faster on it: docs/
benchmarks.md, "Default mode on the CUDA int4 kernel"). The op's
extern call costs more host time: without CUDA graphs its linears stay on the Triton templates, which enter
Inductor's code.

Per linear at decode faster than ATen's tinygemm and the nibble-plane template, and a Llama-shaped decoder
under CUDA graphs faster than with either (measured: docs/benchmarks.md, "A Llama decoder's tokens/s, and the
CUDA W4A16 decode kernel", and the H200 sections after it).
"""

from __future__ import annotations

import logging

import torch

from qfuse.kernels.base import DECODE_ROWS, OK, GemmKey, Kernel, Verdict
from qfuse.kernels.capabilities import Capability
from qfuse.kernels.cuda import int4_mma, w8_mma
from qfuse.kernels.prepared import PreparedWeight
from qfuse.platform import Platform
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, FP8_DTYPE, INT4_DTYPE, Granularity, dtype_name

log = logging.getLogger("qfuse")
_HALVES = (torch.bfloat16, torch.float16)
#: Up to this many rows the W8A8 GEMM is taken; above, the Triton W8A8 template is as fast or faster
W8A8_ROWS = 8
_DECODE = {"k_multiple": w8_mma.K_PER_CHUNK, "n_multiple": w8_mma.ROWS_PER_TILE, "out_dtypes": FLOAT_ACTIVATION_DTYPES,
           "rocm": False, "requires": ("nvrtc",)}  # the 8-bit rows' common columns


def _why_not_from_inductors_code(key: GemmKey) -> str:
    """Why this linear's call would not be launched from Inductor's generated code (`qfuse.lowerings.cuda`, which
    says so per call: keep the two in step) but run as the op's extern call, or '': the int4 kernel's linears without
    act order, int8 storage or a bias (siblings' biases are joined per call by the op), with an output of x's dtype
    or float32, where Inductor writes Python."""
    if key.scheme.weight_dtype != INT4_DTYPE:
        return "the 8-bit kernel"
    if key.cpp_wrapper:
        return "under Inductor's C++ wrapper (which calls no Python function) the int4 kernel"
    if key.act_order:
        return "GPTQ's act order (the op sorts x's columns each call)"
    if key.weight_zero_point_foldable:
        return "an int4 weight stored as int8 (the op checks its values when it prepares them)"
    if key.bias_dtype is not None:  # (one linear's bias of x's dtype it launches; siblings' biases it does not)
        return "a linear with a bias (as one call with its siblings: their biases joined per call)"
    if key.out_dtype not in (key.scheme.activation_dtype, torch.float32):
        return f"an output of {dtype_name(key.out_dtype)}"
    return ""


class CudaKernel(Kernel):
    name = "cuda"
    prepares_weight = True
    reads_weight_scale_per_call = True  # the 8-bit epilogue reads it in its dtype (int4 scales are in the pairs)
    runs_siblings_of = ("scaled_mm", "weight_only_scaled_mm", "int4_weight_only_mm")
    capabilities = (
        Capability("int4 weight-only mma.m16n8k16, dequantized in registers (W4A16)", ("cuda",), _HALVES,
                   (INT4_DTYPE,), weight_scales=(Granularity.PER_GROUP,), weight_zero_point=True,
                   weight_group_multiple=int4_mma.K_PER_CHUNK, k_multiple=int4_mma.K_PER_CHUNK,
                   n_multiple=int4_mma.ROWS_PER_TILE, out_dtypes=(*_HALVES, torch.float32),
                   min_capability=80, rocm=False, requires=("nvrtc",)),
        Capability("int8 W8A8 mma.m16n8k32", ("cuda",), (torch.int8,), (torch.int8,), min_capability=80, **_DECODE),
        Capability("fp8 e4m3fn W8A8 mma.m16n8k32", ("cuda",), (FP8_DTYPE,), (FP8_DTYPE,), min_capability=89,
                   sums_below_float32=True, **_DECODE),
        Capability("int8 weight-only mma.m16n8k16, converted in registers (W8A16)", ("cuda",), _HALVES, (torch.int8,),
                   min_capability=80, **_DECODE),
        Capability("fp8 e4m3fn weight-only mma.m16n8k16, converted in registers (W8A16)", ("cuda",), _HALVES,
                   (FP8_DTYPE,), min_capability=89, **_DECODE),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type != "cuda" or platform.is_rocm:
            return False, f"qfuse's CUDA C++ kernels run on NVIDIA GPUs, not on {platform.describe()}"
        return OK

    def can_implement(self, key: GemmKey, platform: Platform) -> Verdict:
        if key.scheme.weight_dtype == INT4_DTYPE and key.weight_scale_dtype != key.scheme.activation_dtype:
            scales = "of no recorded dtype" if key.weight_scale_dtype is None else dtype_name(key.weight_scale_dtype)
            return False, (f"it rounds (q - z) * s in the activation's dtype, and the group scales are {scales}, not "
                           f"{dtype_name(key.scheme.activation_dtype)}")
        group = key.scheme.weight_group_size
        if key.scheme.weight_dtype == INT4_DTYPE and group and key.n and key.k and (
                reason := int4_mma.why_not_shape(key.n, key.k, group)):
            return False, reason
        return OK

    def why_slower_here(self, key: GemmKey, platform: Platform) -> str:
        if not key.cuda_graphs and (reason := _why_not_from_inductors_code(key)):
            return (f"without CUDA graphs a decode step is host-bound, and {reason} runs as the op's extern call, "
                    "whose host time costs more than the Triton templates' launches (docs/benchmarks.md, \"Default mode "
                    "on the CUDA int4 kernel\"); it is faster under CUDA graphs (mode='reduce-overhead')")
        if key.m is not None and key.m > DECODE_ROWS:
            return (f"at M = {key.m}: a decode kernel (M <= {DECODE_ROWS}); the Triton templates take batched decode "
                    "(at 32 rows, where its loads of x bound it, it won on some shapes and lost on others, and a decoder "
                    "ran no faster: docs/benchmarks.md, \"Batched decode on the CUDA kernels\")")
        if key.m is not None and key.m > W8A8_ROWS and not key.scheme.is_weight_only:
            return (f"at M = {key.m} (> {W8A8_ROWS}) the Triton W8A8 template streams the weight as fast or faster "
                    "(measured on an H100: docs/benchmarks.md, \"The CUDA 8-bit decode kernel\")")
        return super().why_slower_here(key, platform)

    def speed_row_bounds(self, key: GemmKey, platform: Platform) -> tuple[int, ...]:
        if not key.cuda_graphs and _why_not_from_inductors_code(key):
            return ()
        return (DECODE_ROWS,) if key.scheme.is_weight_only else (W8A8_ROWS, DECODE_ROWS)

    def prepare_int4_weight(self, values, scale, zero_point) -> PreparedWeight:
        """`repack`'s layout: `data` the words, `scale` int32 pairs (s, -(MAGIC + 8 + z)) per group and row
        (the zero points folded into them), `packing` naming the half dtype they were made for."""
        words, pairs = int4_mma.repack(values, scale, zero_point)
        return PreparedWeight(words, pairs, None, *values.shape, packing=int4_mma.PACKINGS[scale.dtype])

    def int4_checkpoint_weight(self, members, group_size, zero_convention) -> PreparedWeight | None:
        """`int4_mma.checkpoint_weight`: the words, scales and zero points read where they lie (compressed-tensors,
        GPTQ v2 and AutoGPTQ layouts), where `int4_mma.why_not_checkpoint` finds nothing against it."""
        if reason := int4_mma.why_not_checkpoint(members, group_size):
            log.info("qfuse: the cuda int4 kernel cannot read a weight [N, K] = [%d, %d] in place (it prepares its "
                     "own layout): %s",
                     sum(member[0].shape[0] for member in members), members[0][0].shape[1] * 8, reason)
            return None
        return int4_mma.checkpoint_weight(members, group_size, zero_convention)

    def prepare_weight(self, b, scale_b, azp_b) -> PreparedWeight:
        """`w8_mma.repack`'s layout of the int8 / fp8 [K, N] weight, `packing` naming its dtype, and the scale as
        given: the epilogue reads it as it is, so `prepare_once` prepares the weight alone and attaches each call's
        scale (`reads_weight_scale_per_call`)."""
        if azp_b is not None:
            raise ValueError("the cuda kernel's 8-bit GEMM takes symmetric weights; use kernel='torch' for a weight "
                             "zero point")
        k, n = b.shape
        return PreparedWeight(w8_mma.repack(b), scale_b, None, k, n, packing=w8_mma.PACKINGS[b.dtype])

    def weight_only_apply(self, x, weight, bias, out_dtype):
        """x @ w + bias, 64 rows a launch (any M is correct; kernel choice sends it M <= 16). An int4 weight's
        sums, plus a bias of x's dtype, are rounded once to the output dtype; another bias is added to the
        float32 sums. An 8-bit weight's epilogue takes any bias and output dtype."""
        if weight.packing in w8_mma.PACKINGS.values():
            if x.dtype not in _HALVES:
                raise ValueError(f"the cuda kernel's W8A16 GEMM takes a bf16 or fp16 activation, not {dtype_name(x.dtype)}")
            return self._w8_mma(x, weight, None, bias, out_dtype)
        if not int4_mma.takes(weight, x.dtype):
            raise ValueError(f"the cuda kernel's weight was prepared for {weight.packing}, and x is {x.dtype}: it "
                             "rounds (q - z) * s in the activation's dtype, which must be the scales'")
        inner_bias = bias if bias is not None and bias.dtype == x.dtype else None
        exact = out_dtype in (x.dtype, torch.float32) and (bias is None or inner_bias is not None)
        kernel_dtype = out_dtype if exact else torch.float32
        out = int4_mma.multiply(x, weight, inner_bias, kernel_dtype)
        if bias is not None and inner_bias is None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        """((a * scale_a) @ w) * scale_b + bias, 64 rows a launch (any M is correct; kernel choice sends it M <= 8)."""
        if azp_a is not None:
            raise ValueError("the cuda kernel's W8A8 GEMM takes symmetric activations; use kernel='torch' for an "
                             "activation zero point")
        if scale_a is not None and scale_a.numel() not in (1, a.shape[0]):
            raise ValueError("the cuda kernel's W8A8 GEMM takes one activation scale or one a row, not a scale per "
                             "128-group of K")
        return self._w8_mma(a, weight, scale_a, bias, out_dtype)

    @staticmethod
    def _w8_mma(x, weight: PreparedWeight, scale_a, bias, out_dtype):
        weight_dtype = w8_mma.WEIGHT_DTYPE_OF_PACKING[weight.packing]
        if x.dtype not in (weight_dtype, *_HALVES):
            raise ValueError(f"the cuda kernel's 8-bit GEMM takes an activation of {dtype_name(weight_dtype)} (its "
                             f"weight's dtype), bf16 or fp16, not {dtype_name(x.dtype)}")
        scale_b = weight.scale
        if scale_b is not None and (scale_b.numel() not in (1, weight.n) or scale_b.dim() > 1 and scale_b.shape[0] != 1):
            raise ValueError("the cuda kernel's 8-bit GEMM takes one weight scale or one a column, not 128 x 128 "
                             "block scales")
        if scale_b is not None and scale_b.dtype not in w8_mma.DTYPE_CODES:
            scale_b = scale_b.to(torch.float32)  # (float64, say: the epilogue is float32)
        return w8_mma.w8_mma(x, weight.data, weight_dtype, scale_a, scale_b, bias, out_dtype)
