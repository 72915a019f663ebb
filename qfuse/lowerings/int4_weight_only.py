"""Inductor lowering of `qfuse::int4_weight_only_mm` for the `triton` kernel: a template on the stored words.

    out = template(X [M, K], W int32 [N, K / 8], SHIFTS [8]?, S [N, K / g], Z int32 [N / 8, K / g]?, BIAS?)
        = float32(x @ w^T + bias), w dequantized in registers (`qfuse.kernels.triton.int4_mm.int4_dot`)
    y   = out.to(out_dtype), and the next pointwise ops      Inductor's epilogue, fused into the store

The template reads the model's own tensors: the words as the checkpoint packs them, the shifts it
stores (or 0, 4, ..., 28 where the model computes them), its scales and packed zero points, so no
weight is unpacked, repacked or cached, and a call is one kernel that Inductor launches itself.
Tiles: `int4_mm.pick_int4_config` for M (static M exact; a dynamic M by its size hint), the K step
narrowed to the group size (`fit_block_k`); under max-autotune also `int4_mm.AUTOTUNE_TILES`.

Other kernels (the CPU `torch` kernel: ATen's int4pack on a weight repacked once) stay an extern call.
"""

from __future__ import annotations

import logging

import sympy
import torch
from torch._inductor import ir
from torch._inductor import lowering as inductor_lowering
from torch._inductor.virtualized import V

from qfuse.lowerings.ir import convert, extern_call, falls_back_to_extern_call, lower, record_lowering
from qfuse.lowerings.triton_template import max_autotune, select_tile, template_for_inputs
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs

aten = torch.ops.aten
log = logging.getLogger("qfuse")

# INPUTS: X, W, S, and each of SHIFTS, Z, BIAS that the call has (`template_for_inputs`).
_SOURCE = r"""
from qfuse.kernels.triton.int4_mm import int4_dot
from qfuse.kernels.triton.scaled_mm import grouped_tile
{{def_kernel(INPUTS)}}
    M = {{size("X", 0)}}
    N = {{size("W", 0)}}
    K = {{size("X", 1)}}
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(INDEX_DTYPE)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(INDEX_DTYPE)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = int4_dot(
        X, W, {{"SHIFTS" if HAS_SHIFTS else "W"}}, S, {{"Z" if HAS_ZEROS else "W"}}, offs_m, offs_n, mask_m, mask_n, K,
        {{stride("X", 0)}}, {{stride("X", 1)}}, {{stride("W", 0)}}, {{stride("W", 1)}}, {{stride("S", 0)}}, {{stride("S", 1)}},
        {{stride("Z", 0) if HAS_ZEROS else 0}}, {{stride("Z", 1) if HAS_ZEROS else 0}},
        GROUP_SIZE, ONE_GROUP_PER_STEP, HAS_SHIFTS, HAS_ZEROS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )
{% if HAS_BIAS %}
    acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
{% endif %}
{{STORE_TILE}}"""


def why_not_lowered(call: Int4WeightOnlyMmArgs) -> str:
    """'' if the call becomes the template, else why it stays an extern call of the op."""
    if call.kernel != "triton":
        return f"kernel {call.kernel!r} runs as an extern call"
    if call.x.get_device().type != "cuda":
        return "the Triton template runs on CUDA"
    rows = sympy.Mul(*call.x.get_size()[:-1])
    if V.graph.sizevars.statically_known_true(sympy.Eq(rows, 0)):
        return "M is 0"
    return ""


def _tiles(rows, n: int, k: int, group_size: int, device) -> list[tuple[int, int, int, int, int, int]]:
    from qfuse.kernels.triton.int4_mm import AUTOTUNE_TILES, fit_block_k, pick_int4_config
    from qfuse.kernels.triton.scaled_mm import multiprocessors

    hint = V.graph.sizevars.optimization_hint(rows, fallback=4096)
    tiles = [pick_int4_config(hint, n, multiprocessors(device))]
    if max_autotune():
        tiles += [tile for tile in AUTOTUNE_TILES if tile not in tiles]
    fitted = []
    for block_m, block_n, block_k, *rest in tiles:
        tile = (block_m, block_n, fit_block_k(block_k, group_size, k), *rest)
        if tile not in fitted:
            fitted.append(tile)
    return fitted


@falls_back_to_extern_call(Int4WeightOnlyMmArgs)
def lower_int4_weight_only_mm(*args, **kwargs):
    from qfuse.kernels.triton.int4_mm import step_meta

    call = Int4WeightOnlyMmArgs(*args, **kwargs)
    reason = why_not_lowered(call)
    if reason:
        log.debug("qfuse: int4_weight_only_mm stays an extern call: %s", reason)
        record_lowering(f"extern call of qfuse::int4_weight_only_mm ({reason})")
        return extern_call(call)
    *lead, k = call.x.get_size()
    n = int(call.packed.get_size()[0])
    rows = sympy.Mul(*lead)
    x2d = lower(aten.reshape.default, call.x, [rows, k])
    named = {"X": x2d, "W": call.packed, "S": call.scales, "SHIFTS": call.shifts, "Z": call.packed_zeros,
             "BIAS": call.bias}
    inputs = {name: ir.ExternKernel.realize_input(node) for name, node in named.items() if node is not None}
    template = template_for_inputs(_SOURCE, "qfuse_int4_linear", tuple(inputs))
    layout = ir.FixedLayout(x2d.get_device(), torch.float32, [rows, n])
    meta = dict(HAS_SHIFTS=call.shifts is not None, HAS_ZEROS=call.packed_zeros is not None,
                HAS_BIAS=call.bias is not None)
    tiles = _tiles(rows, n, int(k), call.group_size, x2d.get_device())
    out, how = select_tile(template, "qfuse_int4_linear", tuple(inputs.values()), layout, tiles,
                           lambda tile: meta | step_meta(tile[2], call.group_size, int(k)))
    record_lowering(how + "; the int4 words dequantized in registers, bias inside, the output cast and what "
                    "follows fused into its store")
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, n])


def register() -> None:
    inductor_lowering.register_lowering(Int4WeightOnlyMmArgs.op, type_promotion_kind=None)(lower_int4_weight_only_mm)
