"""The `triton` kernel inside Inductor's generated code: the eager kernel's math as an Inductor template.

An opaque custom op costs a Python call on every run (more host time than most GEMMs of a model take on
the GPU) and hides the epilogue from Inductor. As a template the
kernel is launched by Inductor's own wrapper, and what follows the linear joins its store:

    out = template(A [M, K], B [K, N], scales, bias)   float32: (A @ B) * scale_a * scale_b + bias
    y   = out.to(out_dtype), and the next pointwise ops        Inductor's epilogue, fused into the store

The template calls the eager kernel's own pieces (`qfuse.kernels.triton.scaled_mm`: `scaled_dot`,
the main loop with block scales; `scale_and_bias`, the per-row / per-column epilogue), imported by
the generated module, so both share one statement of the math. The scales and the bias are applied
inside the template from [BLOCK_M] / [BLOCK_N] vectors: as Inductor epilogue loads they would be
broadcast [BLOCK_M, BLOCK_N] tiles, more registers a thread, half the occupancy and a slower kernel
(measured: docs/benchmarks.md, "Measurements first quoted in code comments"). For the same reason
the store runs in two [BLOCK_M, BLOCK_N / 2] halves (from `EPILOGUE_SPLIT_MIN_N` columns): a fused
epilogue that loads another [M, N] tile (a residual add) then holds half of it at a time. That made
the int8 down projection of a Llama MLP block with its residual add much faster at prefill
(measured: docs/benchmarks.md, "gpu_linear: qfuse inside Inductor's generated code, as a user sees it")
and changed no single linear's time beyond noise. Tiles:

    default mode   one choice: `pick_config`'s tile for M (a dynamic M guarded on its bucket, `ir.rows_at_most`)
    max-autotune   every tile of `AUTOTUNE_TILES` and `pick_config`'s; Inductor benchmarks them

int8 from `persistent_mm.MIN_M` rows on Hopper runs the persistent TMA kernel instead
(`_PERSISTENT_SOURCE`, `why_not_persistent`): one program per multiprocessor walks the tiles, its K
loop the eager kernel's `descriptor_product` on descriptors made on the device; under max-autotune
Inductor benchmarks it against the tiled tiles.

Up to 128 rows, where the tile's few column blocks stream a deep K (`k_splits`), a second template
(`_SPLIT_K_SOURCE`) splits K: it stores each range's unscaled sums (int32 for int8, exact), and
Inductor's code adds them and applies the scales, bias and cast (`qfuse.lowerings.triton.scaled_mm`).

`why_not_template` says when the kernel stays an extern call of the op instead (K not a multiple of
16: the op pads the weight once, a template would read unaligned rows on every call).
"""

from __future__ import annotations

import functools

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.kernel.mm_common import mm_args, mm_grid
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate, autotune_select_algorithm
from torch._inductor.virtualized import V

from qfuse.kernels.triton import K_ALIGNMENT
from qfuse.kernels.triton.tile import Tile
from qfuse.lowerings.ir import convert, lower, rows_at_most, rows_bucket

aten = torch.ops.aten

#: This program's tile of an [M, N] output: rows offs_m, columns offs_n (INDEX_DTYPE: Inductor's int32
#: where every buffer fits, guarded for a dynamic M, else int64) and their masks.
TILE_OFFSETS = r"""    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(INDEX_DTYPE)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(INDEX_DTYPE)
    mask_m = offs_m < M
    mask_n = offs_n < N"""

def store_tile(indent: int = 4) -> str:
    """The store of a float32 tile `acc` at rows offs_m / columns offs_n (masks mask_m / mask_n), with
    Inductor's epilogue fused into it, its code `indent` spaces deep; in two halves from
    EPILOGUE_SPLIT_MIN_N columns (module docstring)."""
    pad, inner = " " * indent, " " * (indent + 4)
    return f"""{{% if BLOCK_N >= EPILOGUE_SPLIT_MIN_N %}}
{pad}halves = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
{pad}for half in tl.static_range(2):
{inner}part = halves[half]
{inner}offs_n_part = pid_n * BLOCK_N + half * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2).to(INDEX_DTYPE)
{inner}idx_m = offs_m[:, None]
{inner}idx_n = offs_n_part[None, :]
{inner}mask = mask_m[:, None] & (offs_n_part < N)[None, :]
{inner}{{{{store_output(("idx_m", "idx_n"), "part", "mask", indent_width={indent + 4}, val_shape=("BLOCK_M", "BLOCK_N // 2"))}}}}
{{% else %}}
{pad}idx_m = offs_m[:, None]
{pad}idx_n = offs_n[None, :]
{pad}mask = mask_m[:, None] & mask_n[None, :]
{pad}{{{{store_output(("idx_m", "idx_n"), "acc", "mask", indent_width={indent}, val_shape=("BLOCK_M", "BLOCK_N"))}}}}
{{% endif %}}
"""


STORE_TILE = store_tile()

# The def_kernel line is filled in per set of inputs (`_template`): A, B, and each of SA, SB, BIAS
# that the call has. `if SCALE_A` is "has a scale": the kernel's NO_SCALE kind is 0.
_SOURCE = r"""
from qfuse.kernels.triton.scaled_mm import grouped_tile, scale_and_bias, scaled_dot
{{def_kernel(INPUTS)}}
    M = {{size("A", 0)}}
    N = {{size("B", 1)}}
    K = {{size("A", 1)}}
{{TILE_OFFSETS}}
    acc = scaled_dot(
        A, B, {{"SA" if SCALE_A else "A"}}, {{"SB" if SCALE_B else "B"}}, offs_m, offs_n, mask_m, mask_n, 0, K,
        {{stride("A", 0)}}, {{stride("A", 1)}}, {{stride("B", 0)}}, {{stride("B", 1)}},
        {{stride("SA", 0) if SCALE_A else 0}}, {{stride("SA", 1) if SCALE_A else 0}},
        {{stride("SB", 0) if SCALE_B else 0}}, {{stride("SB", 1) if SCALE_B else 0}},
        SCALE_A, SCALE_B, BLOCKED, IS_INT8, PROMOTE_EVERY, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    acc = scale_and_bias(
        acc.to(tl.float32), offs_m, offs_n, mask_m, mask_n,
        {{"SA" if SCALE_A else "A"}}, {{"SB" if SCALE_B else "B"}}, {{"BIAS" if HAS_BIAS else "A"}},
        {{stride("SA", 0) if SCALE_A else 0}}, {{stride("SB", 1) if SCALE_B else 0}}, SCALE_A, SCALE_B, HAS_BIAS,
    )
{{STORE_TILE}}"""


# Split K: program (tile, pid_k) stores the unscaled sums of its K range (int32 for int8, exact;
# float32 for fp8) at rows pid_k * M + m of a [SPLIT_K * M, N] output; the splits' sum, the scales,
# the bias and the cast follow in Inductor's code (`qfuse.lowerings.triton.scaled_mm`).
_SPLIT_K_SOURCE = r"""
from qfuse.kernels.triton.scaled_mm import grouped_tile, scaled_dot
from qfuse.kernels.triton.weight_stream import k_range
{{def_kernel(INPUTS)}}
    M = {{size("A", 0)}}
    N = {{size("B", 1)}}
    K = {{size("A", 1)}}
{{TILE_OFFSETS}}
    pid_k = tl.program_id(1)
    k_start, k_end = k_range(K, pid_k, SPLIT_K, BLOCK_K)
    acc = scaled_dot(
        A, B, A, B, offs_m, offs_n, mask_m, mask_n, k_start, k_end,
        {{stride("A", 0)}}, {{stride("A", 1)}}, {{stride("B", 0)}}, {{stride("B", 1)}}, 0, 0, 0, 0,
        0, 0, False, IS_INT8, PROMOTE_EVERY, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    offs_m = offs_m + pid_k * M
{{STORE_TILE}}"""

# The persistent TMA kernel (`qfuse.kernels.triton.persistent_mm`): one program per multiprocessor
# walks the output tiles; the K loop is the eager kernel's (`descriptor_product`) on descriptors made
# on the device (B [K, N] with K contiguous is read as the [N, K] matrix it is in memory).
_PERSISTENT_SOURCE = r"""
from qfuse.kernels.triton.persistent_mm import descriptor_product
from qfuse.kernels.triton.scaled_mm import scale_and_bias, tile_in_group_order
{{def_kernel(INPUTS)}}
    M = {{size("A", 0)}}
    N = {{size("B", 1)}}
    K = {{size("A", 1)}}
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[{{stride("A", 0)}}, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[{{stride("B", 1)}}, 1], block_shape=[BLOCK_N, BLOCK_K])
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), NUM_SMS):
        pid_m, pid_n = tile_in_group_order(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = descriptor_product(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, IS_INT8, PROMOTE_EVERY,
                                 BLOCK_M, BLOCK_N, BLOCK_K)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(INDEX_DTYPE)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(INDEX_DTYPE)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = scale_and_bias(
            acc, offs_m, offs_n, mask_m, mask_n,
            {{"SA" if SCALE_A else "A"}}, {{"SB" if SCALE_B else "B"}}, {{"BIAS" if HAS_BIAS else "A"}},
            {{stride("SA", 0) if SCALE_A else 0}}, {{stride("SB", 1) if SCALE_B else 0}}, SCALE_A, SCALE_B, HAS_BIAS,
        )
""" + store_tile(indent=8)


@SymbolicGridFn
def _persistent_grid(m, n, meta, *, cdiv, min):
    """One program per multiprocessor, or per tile where there are fewer tiles."""
    return min(meta["NUM_SMS"], cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])), 1, 1


TMA_ALIGNMENT_BYTES = 16


def _tma_ready(node, outer_stride) -> bool:
    """Whether an int8 operand can be a TMA descriptor's base as the template builds it: its row
    stride (`outer_stride`, elements = bytes) and its offset static multiples of 16 bytes (a
    dynamic one could be aligned at its hint and not later, and the template bakes it in)."""
    offset = node.get_layout().offset if hasattr(node, "get_layout") else 0
    return all(sympy.sympify(value).is_number and int(value) % TMA_ALIGNMENT_BYTES == 0 for value in (outer_stride, offset))


def why_not_persistent(a2d, b, rows) -> str:
    """'' if the persistent TMA template can run this int8 [M, K] x [K, N] call (per-tensor / row /
    column scales) and was measured faster than the tiled one here, else why not. Asked last, a
    dynamic M is guarded on `MIN_M` (`ir.rows_at_most`).

    The template's descriptors are made on the device, in Triton's scratch memory: Inductor's
    runtime gives Triton its allocator on a kernel's first launch (per thread), as for its own TMA
    templates."""
    from torch._inductor.utils import can_use_tma
    from torch.utils._triton import has_triton_tma_device

    from qfuse.kernels.triton.persistent_mm import MIN_M

    if not (_known(sympy.Eq(a2d.get_stride()[1], 1)) and _known(sympy.Eq(b.get_stride()[0], 1))):
        return "A or B is not K-contiguous"
    if not (_tma_ready(a2d, a2d.get_stride()[0]) and _tma_ready(b, b.get_stride()[1])):
        return "a row stride or an offset of A or B is not a static multiple of 16 bytes"
    device = a2d.get_device()
    if (device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (9, 0)
            or not has_triton_tma_device()):
        return "this GPU or Triton has no device-side TMA descriptors"
    if not can_use_tma(a2d, b):
        return "A or B does not meet the TMA's alignment"
    if rows_at_most(rows, MIN_M["int8"] - 1):
        return f"M below {MIN_M['int8']}: the tiled kernel was as fast"
    return ""


#: Up to this M, where the tile's column blocks leave multiprocessors idle, K is split (`k_splits`)
#: until the grid holds SPLIT_K_PROGRAMS_PER_SM programs a multiprocessor, each range at least
#: SPLIT_K_MIN_STEPS K steps deep. Split, the 64 x 64 x 256 tile at N = 4096, K = 14336 (few column
#: blocks, a deep K) is faster; at N = K = 4096 a split gained in some cases and lost in others, and the
#: decode tiles, whose column blocks already fill the GPU, and every N = 14336 tile lost
#: (`benchmarks/explorations/gpu_split_k.py`; measured: docs/benchmarks.md, "Small M and the activation quant").
SPLIT_K_MAX_ROWS = 128
SPLIT_K_PROGRAMS_PER_SM = 1
SPLIT_K_MIN_STEPS = 16

#: Tiles at least this wide store in two halves (narrower decode tiles keep one store).
EPILOGUE_SPLIT_MIN_N = 64


def _template(inputs: tuple[str, ...]) -> TritonTemplate:
    """The template for a call with these inputs."""
    return template_for_inputs(_SOURCE, "qfuse_scaled_linear", inputs)


@functools.cache
def template_for_inputs(source: str, name: str, inputs: tuple[str, ...], grid=mm_grid) -> TritonTemplate:
    """A template of `source` whose def_kernel line takes `inputs` (the ones a call has), with the
    shared tile and store blocks filled in; made once (Inductor keeps one template per name: the name says the inputs)."""
    source = source.replace("{{def_kernel(INPUTS)}}", "{{def_kernel(%s)}}" % ", ".join(map(repr, inputs)))
    return TritonTemplate(name=name + "_" + "_".join(inputs).lower(), grid=grid,
                          source=source.replace("{{TILE_OFFSETS}}", TILE_OFFSETS).replace("{{STORE_TILE}}", STORE_TILE))


def _known(condition) -> bool:
    return V.graph.sizevars.statically_known_true(condition)


def why_not_template(device: torch.device, rows, k, n) -> str:
    """'' if the template can run an [M = rows, K] x [K, N] call on `device`, else why not."""
    if device.type != "cuda":
        return "the Triton template runs on CUDA"
    if not _known(sympy.Eq(sympy.Mod(k, K_ALIGNMENT), 0)):
        return f"K is not a multiple of {K_ALIGNMENT}: the op pads the weight once (a template would read unaligned rows)"
    if _known(sympy.Eq(rows, 0)):
        return "M is 0"
    return why_not_one_element(rows, n)


def why_not_one_element(rows, n) -> str:
    """Why an output of one element (static M = N = 1) is no template's: Inductor's store of a template tile
    at a constant index drops the tile's mask, and every lane of the tile stores into that one element."""
    if _known(sympy.Eq(rows * n, 1)):
        return "one output element (M = N = 1): Inductor's template store would drop the tile's mask"
    return ""


def max_autotune() -> bool:
    return bool(inductor_config.max_autotune or inductor_config.max_autotune_gemm)


def _bucket(rows, is_fp8: bool) -> int:
    """The M the tile is chosen for: the bound of M's bucket (a dynamic M guarded on it), or M's hint above them."""
    from qfuse.kernels.triton.scaled_mm import tile_buckets

    hint = V.graph.sizevars.optimization_hint(rows, fallback=4096)
    return rows_bucket(rows, tile_buckets(is_fp8)) or hint


def _tiles(rows, n: int, is_fp8: bool, blocked: bool, device) -> list[Tile]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) choices for this call."""
    from qfuse.kernels.triton.scaled_mm import AUTOTUNE_TILES, SCALE_GROUP, multiprocessors, pick_config

    tiles = [pick_config(_bucket(rows, is_fp8), n, is_fp8, blocked, multiprocessors(device))]
    if max_autotune():
        tiles += [tile for tile in AUTOTUNE_TILES if tile not in tiles and not (blocked and SCALE_GROUP % tile.block_k)]
    return tiles


def k_splits(a2d, b, blocked: bool) -> int:
    """Into how many K ranges the template splits an [M, K] x [K, N] call (1: none). Up to
    SPLIT_K_MAX_ROWS rows, where the tile's column blocks cover fewer than GRID_FILL of the
    multiprocessors (the 64 x 64 skinny tile at N = 4096: 64 blocks on an H100's 132), each block
    streams the weight down the whole K; split, they reach every multiprocessor. Each range keeps at
    least SPLIT_K_MIN_STEPS K steps. Block scales are applied per K step inside the main loop: those
    calls are not split."""
    from qfuse.kernels.triton.scaled_mm import GRID_FILL, multiprocessors
    from qfuse.kernels.triton.weight_stream import split_k

    rows, (k, n) = a2d.get_size()[0], b.get_size()
    is_fp8 = a2d.get_dtype() != torch.int8
    if blocked or not all(sympy.sympify(size).is_number for size in (k, n)):
        return 1
    block_n, block_k = _tiles(rows, int(n), is_fp8, blocked, a2d.get_device())[0][1:3]
    processors = multiprocessors(a2d.get_device())
    if -(-int(n) // block_n) >= GRID_FILL * processors:
        return 1
    return split_k(_bucket(rows, is_fp8), int(n), int(k), block_n, block_k, processors, SPLIT_K_PROGRAMS_PER_SM,
                   max_rows=SPLIT_K_MAX_ROWS, min_steps_per_split=SPLIT_K_MIN_STEPS)


def scaled_linear(a2d, b, scale_a, kind_a: int, scale_b, kind_b: int, bias, out_dtype: torch.dtype):
    """(A @ B with its scales and bias as a float32 [M, N] buffer, how it was chosen): the template
    at the tile(s) for this call. Scales come as the kernel takes them (kind: none, one value, per row
    [M, 1] / column [1, N], block); Inductor fuses the cast to `out_dtype` and what follows into the
    template's store (the dtype also sets each tile's fp8 promotion interval)."""
    from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE, promote_every

    is_int8 = a2d.get_dtype() == torch.int8
    blocked = BLOCK_SCALE in (kind_a, kind_b)
    m, n, _, layout, a2d, b = mm_args(a2d, b, out_dtype=torch.float32)
    named = {"SA": scale_a, "SB": scale_b, "BIAS": bias}
    extra = {name: ir.ExternKernel.realize_input(node) for name, node in named.items() if node is not None}
    template = _template(("A", "B", *extra))
    meta = dict(SCALE_A=kind_a, SCALE_B=kind_b, BLOCKED=blocked, HAS_BIAS=bias is not None, IS_INT8=is_int8)
    tiles = _tiles(m, int(n), not is_int8, blocked, a2d.get_device())

    def meta_for(tile):
        return meta | {"PROMOTE_EVERY": 1 if blocked else promote_every(a2d.get_dtype(), out_dtype, tile.block_k)}

    candidates, note = [(template, tile, meta_for(tile)) for tile in tiles], ""
    if is_int8 and not blocked:  # the persistent kernel's calls (fp8 at its M runs cuBLAS)
        if why_not := why_not_persistent(a2d, b, m):
            note = f" (not the persistent template: {why_not})"
        else:
            from qfuse.kernels.triton.persistent_mm import CONFIGS
            from qfuse.kernels.triton.scaled_mm import multiprocessors

            persistent = template_for_inputs(_PERSISTENT_SOURCE, "qfuse_persistent_scaled_linear",
                                             ("A", "B", *extra), grid=_persistent_grid)
            tile = CONFIGS["int8"]
            persistent_meta = meta_for(tile) | {"NUM_SMS": multiprocessors(a2d.get_device())}
            candidates = [(persistent, tile, persistent_meta)] + (candidates if max_autotune() else [])
            note = " (the persistent TMA template among them)" if len(candidates) > 1 else ""
    selected, how = select_choices("qfuse_scaled_linear", candidates, (a2d, b, *extra.values()), layout)
    return selected, how + note


def split_k_product(a2d, b, splits: int, out_dtype: torch.dtype):
    """(A @ B unscaled as an [M, N] buffer, int32 for int8 and float32 for fp8, how it was made): the
    template with K split in `splits` ranges, and the splits' sum in Inductor's code."""
    from qfuse.kernels.triton.scaled_mm import promote_every

    is_int8 = a2d.get_dtype() == torch.int8
    rows, n = a2d.get_size()[0], b.get_size()[1]
    tiles = _tiles(rows, int(n), not is_int8, False, a2d.get_device())

    def meta_for(tile):
        return dict(SPLIT_K=splits, IS_INT8=is_int8, PROMOTE_EVERY=promote_every(a2d.get_dtype(), out_dtype, tile.block_k))

    return split_k_linear(_SPLIT_K_SOURCE, "qfuse_scaled_product_split_k", {"A": a2d, "B": b}, rows, n, splits, None,
                          tiles, meta_for, dtype=torch.int32 if is_int8 else torch.float32)


def select_tile(template: TritonTemplate, name: str, inputs: tuple, layout, tiles, meta_for):
    """(the template's buffer at the fastest of `tiles`, how it was chosen): one tile is taken as it is,
    several are benchmarked by Inductor (max-autotune). `meta_for(tile)`: the template's other constexprs."""
    return select_choices(name, [(template, tile, meta_for(tile)) for tile in tiles], inputs, layout)


def select_choices(name: str, candidates: list, inputs: tuple, layout):
    """(the buffer of the fastest of `candidates`, how it was chosen): (template, tile, constexprs)
    triples; one is taken as it is, several are benchmarked by Inductor (max-autotune)."""
    choices = []
    for template, tile, meta in candidates:
        template.maybe_append_choice(
            choices, input_nodes=inputs, layout=layout, num_stages=tile.num_stages, num_warps=tile.num_warps,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
            EPILOGUE_SPLIT_MIN_N=EPILOGUE_SPLIT_MIN_N, **meta,
        )
    if len(choices) == 1 and len(candidates) == 1:
        _, tile, meta = candidates[0]
        kind = "persistent TMA template" if "NUM_SMS" in meta else "template"
        how = (f"Triton {kind}, tile {tile.block_m}x{tile.block_n}x{tile.block_k}, {tile.num_warps} warps, "
               f"{tile.num_stages} stages")
    else:
        how = f"Triton template, autotuned by Inductor among {len(choices)} choices"
    # return_multi_template=False: Inductor picks the fastest tile now; a multi-template buffer (epilogue
    # benchmarking) would need an extern choice of the same function to fall back to, and there is none.
    selected = autotune_select_algorithm(name, choices, list(inputs), layout, return_multi_template=False)
    return selected, how


@SymbolicGridFn
def _split_k_grid(rows, n, meta, *, cdiv):
    """One program per tile and K range; `rows` is SPLIT_K * M."""
    return cdiv(rows, meta["SPLIT_K"] * meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], 1


def split_k_linear(source: str, name: str, named_inputs: dict, rows, n: int, splits: int, bias, tiles, meta_for,
                   dtype: torch.dtype = torch.float32):
    """(x @ w + bias as a `dtype` [M, N] buffer, how it was made) from a template whose program (tile,
    pid_k) stores its partial sums at rows pid_k * M + m of a [SPLIT_K * M, N] output (the
    weight-streaming kernels of `qfuse.kernels.triton.weight_stream`, and `_SPLIT_K_SOURCE`).
    `named_inputs`: the template's inputs by name (None: absent; the bias is among them only with one
    split). With one split the output cast and what follows fuse into the template's store; with
    several, Inductor's code adds the splits (in `dtype`: int32 sums are exact) and the bias."""
    inputs = {label: ir.ExternKernel.realize_input(node) for label, node in named_inputs.items() if node is not None}
    template = template_for_inputs(source, name, tuple(inputs), grid=_split_k_grid)
    device = next(iter(inputs.values())).get_device()
    layout = ir.FixedLayout(device, dtype, [splits * rows, n])
    out, how = select_tile(template, name, tuple(inputs.values()), layout, tiles, meta_for)
    if splits == 1:
        return out, how + "; bias inside, the output cast and what follows fused into its store"
    out = lower(aten.sum.dim_IntList, lower(aten.reshape.default, out, [splits, rows, n]), [0], dtype=dtype)
    if bias is not None:
        out = lower(aten.add.Tensor, out, convert(bias, torch.float32))
    return out, how + f"; K split in {splits}: the sum of the splits and what follows in Inductor's fused code"
