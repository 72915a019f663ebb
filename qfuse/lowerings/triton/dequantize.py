"""The int4 weight dequantized by a Triton template, in front of Inductor's GEMM: W4A16 prefill on CUDA.

Above the decode templates' rows, x @ w^T is Inductor's own GEMM (cuBLAS, or its templates under
max-autotune) on w dequantized into a buffer of x's dtype. Inductor's pointwise code for that buffer is a
flat loop over N * K values that loads a word per value and computes each value's group by division;
this template instead takes [BLOCK_N, BLOCK_K] tiles, a row of words and one scale a group per row of the
tile, with the decode kernels' own tile function (`qfuse.kernels.triton.int4_mm.int4_weight_tile`):

    W_DQ [N, K] = template(W, S, SHIFTS?, Z?)      (q - z) * s in float32 (exact), rounded once to x's dtype
                                                   by the store: eager's `(q - z) * s` in that dtype

It was faster than Inductor's pointwise code at every Llama-3-8B shape (measured: docs/benchmarks.md,
"W4A16 prefill: the weight dequantized by a template"). Act order (a `g_idx`) is not read here: its
weight stays with the IR of `qfuse.lowerings.triton.int4`.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.select_algorithm import SymbolicGridFn, autotune_select_algorithm

from qfuse.lowerings.triton.template import template_for_inputs

#: A program's tile of the [N, K] weight: rows of N, values of K (halved to fit the group by `fit_block_k`).
BLOCK_N, BLOCK_K, WARPS = 64, 128, 4

_SOURCE = r"""
from qfuse.kernels.triton.int4_mm import int4_weight_tile
{{def_kernel(INPUTS)}}
    N = {{size(None, 0)}}
    K = {{size(None, 1)}}
    k_blocks = tl.cdiv(K, BLOCK_K)
    pid_n = tl.program_id(0) // k_blocks
    k0 = (tl.program_id(0) % k_blocks) * BLOCK_K
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(INDEX_DTYPE)
    mask_n = offs_n < N
    w = int4_weight_tile(
        W, {{"SHIFTS" if HAS_SHIFTS else "W"}}, S, {{"Z" if HAS_ZEROS else "W"}}, k0, K, offs_n, mask_n,
        {{stride("W", 1 if PACKED_ALONG_N else 0)}}, {{stride("W", 0 if PACKED_ALONG_N else 1)}},
        {{stride("S", 0)}}, {{stride("S", 1)}}, {{stride("Z", 0) if HAS_ZEROS else 0}}, {{stride("Z", 1) if HAS_ZEROS else 0}},
        GROUP_SIZE, GROUPS_PER_STEP, HAS_SHIFTS, HAS_ZEROS, ZERO_ADD, ZERO_WRAP, PACKED_ALONG_N, INT8_VALUES, EVEN_K,
        tl.float32, BLOCK_N, BLOCK_K,
    )
    idx_n = offs_n[:, None]
    idx_k = (k0 + tl.arange(0, BLOCK_K)).to(INDEX_DTYPE)[None, :]
    mask = mask_n[:, None] & (idx_k < K)
    {{store_output(("idx_n", "idx_k"), "w", "mask", val_shape=("BLOCK_N", "BLOCK_K"))}}"""


@SymbolicGridFn
def _grid(n, k, meta, *, cdiv):
    """One program a tile of the [N, K] weight, consecutive programs along K."""
    return cdiv(n, meta["BLOCK_N"]) * cdiv(k, meta["BLOCK_K"]), 1, 1


def dequantized_weight(named_inputs: dict, n: int, k: int, group_size: int, dtype: torch.dtype, meta: dict):
    """(the weight [N, K] in `dtype` as a buffer, how it was made). `named_inputs`: W, S, SHIFTS, Z by name
    (None: absent); `meta`: the tile function's constexprs of the stored form (`int4_mm.weight_meta`)."""
    from qfuse.kernels.triton.weight_stream import fit_block_k, step_meta

    inputs = {label: ir.ExternKernel.realize_input(node) for label, node in named_inputs.items() if node is not None}
    template = template_for_inputs(_SOURCE, "qfuse_int4_dequantize", tuple(inputs), grid=_grid)
    device = next(iter(inputs.values())).get_device()
    layout = ir.FixedLayout(device, dtype, [n, k])
    block_k = fit_block_k(BLOCK_K, group_size, k)
    choices = []
    template.maybe_append_choice(choices, input_nodes=tuple(inputs.values()), layout=layout, num_stages=1,
                                 num_warps=WARPS, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                                 **meta, **step_meta(block_k, group_size, k))
    out = autotune_select_algorithm("qfuse_int4_dequantize", choices, list(inputs.values()), layout,
                                    return_multi_template=False)
    return out, f"the weight dequantized by a Triton template ({BLOCK_N}x{block_k} tiles) + Inductor's mm"
