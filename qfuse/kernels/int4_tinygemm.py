"""int4 weight-only GEMM on NVIDIA GPUs with ATen's tinygemm `_weight_int4pack_mm` (the `torch` kernel's W4A16 on CUDA).

    w[k, n] = v[k, n] * s[k // g, n]         qfuse's int4 convention, symmetric: v in [-8, 7]
            = (u[k, n] - 8) * s + 0          ATen's: u = v + 8 in [0, 15], a float zero of 0

ATen wants the [N, K] values 0..15 as byte pairs [N, K / 2] (the even k in the high nibble), repacked
by `_convert_weight_to_int4pack(pairs, inner_k_tiles)` into its tensor-core layout, and
`scales_and_zeros` [K / g, N, 2] in bf16, g in {32, 64, 128, 256}, bf16 activations. With a zero of 0
and bf16 scales, w = v * s is one bf16 rounding of an exact product, as eager's; a zero point would
be a bf16 float zero (a new rounding), so the kernel takes symmetric weights with bf16 scales only
(`TorchKernel.can_implement`).

At M = 1 it is faster than the bf16 matmul and than qfuse's Triton templates, the nibble-plane one
included; at M = 16 it is slower than bf16
(measured: docs/benchmarks.md, "gpu_weight_only: W4A16 on the GPU" and
"Batched decode: the plane template up to 256 rows"). It runs as the op's extern call on the weight
the op packs once, and that call's Python costs more than the template's GPU time, except under CUDA
graphs, whose replays run no Python: kernel choice takes it there, at M = 1
(`TorchKernel.why_slower_here`). Like every weight prepared once, a replay keeps reading the packed
copy: a weight changed in place after capture is not seen (docs/kernels.md).
"""

from __future__ import annotations

import dataclasses

import torch

from qfuse.kernels.prepared import Packing, PreparedWeight
from qfuse.schemes import INT4_OFFSET

GROUP_SIZES = (32, 64, 128, 256)
K_MULTIPLE = 32  # 16 * inner_k_tiles, inner_k_tiles >= 2
N_MULTIPLE = 8
MIN_CAPABILITY = 80
SCALE_DTYPE = torch.bfloat16


def wins_here(key, platform) -> bool:
    """Whether kernel choice should take tinygemm over the Triton template for `key` (a `GemmKey`):
    M = 1 under CUDA graphs, on an NVIDIA GPU it runs on, for a linear it computes exactly."""
    return (key.m == 1 and key.cuda_graphs and key.device_type == "cuda" and not platform.is_rocm
            and platform.capability >= MIN_CAPABILITY and key.scheme.activation_dtype == torch.bfloat16
            and not key.weight_zero_point and key.weight_scale_dtype == SCALE_DTYPE
            and key.scheme.weight_group_size in GROUP_SIZES)


def row_bounds(key, platform) -> tuple[int, ...]:
    """Where `wins_here`'s verdict on `key` changes with M: (1,) where it takes M = 1, else ()."""
    return (1,) if wins_here(dataclasses.replace(key, m=1), platform) else ()


def _inner_k_tiles(k: int) -> int:
    """The most K tiles of 16 (8, 4 or 2) that divide K: 8 was the fastest at every measured shape."""
    return next(tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0)


def pack(values: torch.Tensor, scale: torch.Tensor, inner_k_tiles: int | None = None) -> PreparedWeight:
    """The symmetric int4 weight (int8 [K, N] values in [-8, 7], bf16 scale [K / g, N]) in ATen's CUDA
    layout (`inner_k_tiles`: by default the most that divide K)."""
    unsigned = (values.to(torch.int32) + INT4_OFFSET).t().to(torch.uint8)  # [N, K], 0..15
    pairs = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles or _inner_k_tiles(values.shape[0]))
    scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).to(SCALE_DTYPE).contiguous()
    return PreparedWeight(packed, scales_and_zeros, None, *values.shape, packing=Packing.INT4PACK_CUDA)


def int4pack_mm(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (bf16) @ w + bias, cast to `out_dtype` (the bias added in x's dtype, as a float linear would)."""
    group_size = weight.k // weight.scale.shape[0]
    out = torch.ops.aten._weight_int4pack_mm(x.contiguous(), weight.data, group_size, weight.scale)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)
