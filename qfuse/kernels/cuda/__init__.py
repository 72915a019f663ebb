"""`cuda`: qfuse's own CUDA C++ kernels, compiled at first use by NVRTC (`torch.cuda._compile_kernel`).

One kernel today, W4A16 decode on tensor cores (`int4_mma.cu`, `int4_mma.py`): an int4 weight repacked once
into the layout of mma.m16n8k16's A operand, a 16-byte load a lane, dequantized in registers exactly as
eager rounds it. It runs as the op's extern call, whose Python costs more than its GPU time on every
eager call, so kernel choice takes it under CUDA graphs (mode="reduce-overhead"), whose replays run no
Python, at decode (M <= 16; a dynamic M per bucket). Elsewhere the Triton templates, which enter
Inductor's code, stay faster.

Measured on an H100 (GPU time per linear in one CUDA graph, `benchmarks/gpu_int4_mma.py`, docs/benchmarks.md
"A Llama decoder's tokens/s, and the CUDA W4A16 decode kernel"): M = 1, N x K = 4096 x 4096 / 14336 x 4096 /
4096 x 14336, 6.1 / 15.6 / 15.6 µs, 2.93 / 2.90 / 3.03x the bf16 matmul, where ATen's tinygemm took 7.1 / 19.4 /
19.7 and the nibble-plane Triton template 14.0 / 25.4 / 25.2 (its eager launch); an 8-layer Llama-shaped
decoder at batch 1 under CUDA graphs ran 2.17x the bf16 model's tokens/s (tinygemm 1.96x).
"""

from __future__ import annotations

import torch

from qfuse.kernels.base import DECODE_ROWS, OK, GemmKey, Kernel, Verdict
from qfuse.kernels.capabilities import Capability
from qfuse.kernels.cuda.int4_mma import K_PER_CHUNK, PACKINGS, ROWS_PER_TILE
from qfuse.kernels.prepared import PreparedWeight
from qfuse.platform import Platform
from qfuse.schemes import INT4_DTYPE, Granularity, dtype_name

_HALVES = (torch.bfloat16, torch.float16)


class CudaKernel(Kernel):
    name = "cuda"
    prepares_weight = True
    capabilities = (
        Capability("int4 weight-only mma.m16n8k16, dequantized in registers (W4A16)", ("cuda",), _HALVES,
                   (INT4_DTYPE,), weight_scales=(Granularity.PER_GROUP,), weight_zero_point=True,
                   weight_group_multiple=K_PER_CHUNK, k_multiple=K_PER_CHUNK, n_multiple=ROWS_PER_TILE,
                   out_dtypes=(*_HALVES, torch.float32),
                   min_capability=80, rocm=False, requires=("nvrtc",)),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type != "cuda" or platform.is_rocm:
            return False, f"qfuse's CUDA C++ kernels run on NVIDIA GPUs, not on {platform.describe()}"
        return OK

    def can_implement(self, key: GemmKey, platform: Platform) -> Verdict:
        if key.weight_scale_dtype != key.scheme.activation_dtype:
            scales = "of no recorded dtype" if key.weight_scale_dtype is None else dtype_name(key.weight_scale_dtype)
            return False, (f"it rounds (q - z) * s in the activation's dtype, and the group scales are {scales}, not "
                           f"{dtype_name(key.scheme.activation_dtype)}")
        return OK

    def why_slower_here(self, key: GemmKey, platform: Platform) -> str:
        if not key.cuda_graphs:
            return ("it runs as the op's extern call, whose Python costs more per call than the Triton templates' GPU "
                    "time in Inductor's code; it is faster under CUDA graphs (mode='reduce-overhead') only")
        if key.m is not None and key.m > DECODE_ROWS:
            return f"at M = {key.m}: a decode kernel (M <= {DECODE_ROWS}); the Triton templates take batched decode"
        return super().why_slower_here(key, platform)

    def speed_row_bounds(self, key: GemmKey, platform: Platform) -> tuple[int, ...]:
        return (DECODE_ROWS,) if key.cuda_graphs else ()

    def prepare_int4_weight(self, values, scale, zero_point) -> PreparedWeight:
        """`repack`'s layout: `data` the words, `scale` int32 pairs (s, -(MAGIC + 8 + z)) per group and row
        (the zero points folded into them), `packing` naming the half dtype they were made for."""
        from qfuse.kernels.cuda.int4_mma import repack

        words, pairs = repack(values, scale, zero_point)
        return PreparedWeight(words, pairs, None, *values.shape, packing=PACKINGS[scale.dtype])

    def weight_only_apply(self, x, weight, bias, out_dtype):
        """x @ w + bias, 16 rows a launch (any M is correct; kernel choice sends it M <= 16). The sums, plus a
        bias of x's dtype, are rounded once to the output dtype; another bias is added to the float32 sums."""
        from qfuse.kernels.cuda.int4_mma import MAX_ROWS, int4_mma

        if weight.packing != PACKINGS.get(x.dtype):
            raise ValueError(f"the cuda kernel's weight was prepared for {weight.packing}, and x is {x.dtype}: it "
                             "rounds (q - z) * s in the activation's dtype, which must be the scales'")
        group_size = weight.k // weight.scale.shape[0]
        inner_bias = bias if bias is not None and bias.dtype == x.dtype else None
        exact = out_dtype in (x.dtype, torch.float32) and (bias is None or inner_bias is not None)
        kernel_dtype = out_dtype if exact else torch.float32
        parts = [int4_mma(rows, weight.data, weight.scale, inner_bias, group_size, kernel_dtype)
                 for rows in x.split(MAX_ROWS)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if bias is not None and inner_bias is None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        raise NotImplementedError("the cuda kernel has no W8A8 GEMM (its capability table has int4 weight-only rows only)")
