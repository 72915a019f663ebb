"""Persistent TMA scaled matmul for Hopper: the large-M GEMM.

    C[M, N] = (A_q[M, K] @ B_q[N, K]^T) * scale_a * scale_b (+ bias), cast to bf16 / fp16 / fp32
    A_q, B_q int8 or fp8 e4m3 (int8 sums in int32, exact; fp8 in float32)
    scale_a: none, one value or per row [M, 1]; scale_b: none, one value or per column [1, N]
    (block scales stay on `scaled_mm.py`'s kernel, which applies them per K step).

One program per multiprocessor walks the output tiles in grouped order (GROUP_M row blocks share a
column block, for L2 reuse). A and B tiles arrive through the tensor memory accelerator (TMA
descriptors): no address arithmetic in the K loop, loads issued ahead of the tensor cores, and
rows or K columns past the end read as zeros, so M, N and K need no masks there. fp8 promotes
Hopper's reduced-precision wgmma accumulator into the float32 sum every PROMOTE_EVERY K steps
(see `scaled_mm.promote_every`).

`descriptor_product` (one tile's K loop) is shared with the Inductor template of this kernel
(`qfuse.lowerings.triton.template._PERSISTENT_SOURCE`), which makes its descriptors on the device.

Needs (`should_run_persistent`): a CUDA GPU of capability 9.0 or newer, A [M, K] and B stored
[N, K] with K contiguous, K a multiple of 16 (rows 16-byte aligned) and 16-byte aligned bases.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.triton.tile import Tile
from qfuse.kernels.triton.scaled_mm import (
    BLOCK_SCALE, _scale_bias_store, _scale_kind, _strides, multiprocessors, output_and_float32_scales, promote_every,
    tile_in_group_order,
)

#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per dtype, and the smallest M that
#: takes this kernel rather than `scaled_mm.py`'s. fp8: chosen by `benchmarks/explorations/gpu_triton_variants.py`:
#: 128 x 256 tiles were the fastest at M = 1024 and 4096 with every promotion interval; at M = 128 the
#: non-persistent kernel was faster (measured: docs/benchmarks.md, "What the session-3 experiments showed").
#: int8: `benchmarks/explorations/gpu_persistent_int8.py`: faster than `scaled_mm.py`'s tiled kernel at
#: 4096 rows, level at 2048, slower at 1024
#: (measured: docs/benchmarks.md, "The persistent TMA template for int8 prefill, and where #13 stands").
CONFIGS = {"fp8": Tile(128, 256, 128, 8, 8, 3), "int8": Tile(128, 256, 128, 8, 8, 4)}
MIN_M = {"fp8": 129, "int8": 2048}


def dtype_label(dtype: torch.dtype) -> str:
    return "int8" if dtype == torch.int8 else "fp8"


@triton.jit
def descriptor_product(a_desc, b_desc, row0, col0, K, IS_INT8: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A[row0:row0 + BLOCK_M, :] @ B[col0:col0 + BLOCK_N, :]^T through TMA descriptors of A [M, K] and
    B [N, K], as float32: int8's exact int32 sum converted once at the end; fp8's tensor-core sums
    promoted into float32 every PROMOTE_EVERY steps (0: never, the tensor cores keep the whole sum)."""
    if IS_INT8:
        sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in tl.range(0, K, BLOCK_K):
            sums = tl.dot(a_desc.load([row0, k0]), b_desc.load([col0, k0]).T, sums, out_dtype=tl.int32)
        acc = sums.to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        partial = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in tl.range(tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([row0, step * BLOCK_K])
            b = b_desc.load([col0, step * BLOCK_K])
            if PROMOTE_EVERY == 1:
                acc += tl.dot(a, b.T)
            elif PROMOTE_EVERY == 0:
                acc = tl.dot(a, b.T, acc)
            else:
                partial = tl.dot(a, b.T, partial)
                if step % PROMOTE_EVERY == PROMOTE_EVERY - 1:
                    acc += partial
                    partial = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PROMOTE_EVERY > 1:
            acc += partial
    return acc


@triton.jit
def _persistent_scaled_mm_kernel(
    a_desc, b_desc, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K,
    stride_cm, stride_cn, stride_sam, stride_sbn,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
    IS_INT8: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), PROGRAMS):
        pid_m, pid_n = tile_in_group_order(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = descriptor_product(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, IS_INT8, PROMOTE_EVERY,
                                 BLOCK_M, BLOCK_N, BLOCK_K)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        _scale_bias_store(acc, offs_m, offs_n, offs_m < M, offs_n < N, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
                          stride_cm, stride_cn, stride_sam, stride_sbn, SCALE_A, SCALE_B, HAS_BIAS)


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def should_run_persistent(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b) -> bool:
    """Whether these operands (a [M, K], b [K, N], normalised scales) fit this kernel's needs
    (see the module docstring) and are ones it was measured faster on (M >= `MIN_M` of the dtype)."""
    if a.dtype not in (torch.int8, torch.float8_e4m3fn) or a.shape[0] < MIN_M[dtype_label(a.dtype)]:
        return False
    if not a.is_cuda or torch.cuda.get_device_capability(a.device) < (9, 0):
        return False
    n = b.shape[1]
    if BLOCK_SCALE in (_scale_kind(scale_a, (a.shape[0], 1)), _scale_kind(scale_b, (1, n))):
        return False
    return _aligned(a) and _aligned(b.t())


def persistent_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, config=None, promote=None):
    """Launch the persistent kernel (operands as for `scaled_mm.triton_scaled_mm`; check
    `should_run_persistent` first). `config` and `promote` (0: never) override the defaults for benchmarks."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = a.shape, b.shape[1]
    c, sa, sb = output_and_float32_scales(a, b, scale_a, scale_b, out_dtype)
    if c.numel() == 0:
        return c
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or CONFIGS[dtype_label(a.dtype)]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = min(tiles, multiprocessors(a.device))
    dummy = c  # never read when the constexpr kind says so
    _persistent_scaled_mm_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]), TensorDescriptor.from_tensor(b.t(), [block_n, block_k]),
        c, sa if sa is not None else dummy, sb if sb is not None else dummy, bias if bias is not None else dummy,
        m, n, k,
        c.stride(0), c.stride(1), _strides(sa)[0], _strides(sb)[1],
        SCALE_A=_scale_kind(sa, (m, 1)), SCALE_B=_scale_kind(sb, (1, n)), HAS_BIAS=bias is not None,
        IS_INT8=a.dtype == torch.int8,
        PROMOTE_EVERY=promote if promote is not None else promote_every(a.dtype, out_dtype, block_k),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        PROGRAMS=programs,
        num_warps=num_warps, num_stages=num_stages,
    )
    return c
