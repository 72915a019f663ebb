"""W4A16 batched decode on wgmma, 8-64 rows of x (an exploration, issue #38; `int4_wgmma_decode.cu`).

    python benchmarks/explorations/int4_wgmma_decode.py [--ms 8,16,32,64] [--shapes 28672x4096,...] [--out FILE.json]
    python benchmarks/explorations/int4_wgmma_decode.py --source  # the kernel's full source, for nvcc -cubin

At 16 rows and more the CUDA int4 kernel is bound by every warp loading x's rows from L1 (docs/benchmarks.md,
"Why the int4 kernel stops at 2.2x bf16 at 16 rows"). This kernel lets the tensor cores read x from shared memory,
once a warpgroup of 64 weight rows, with K split across blocks where the row blocks alone do not fill the GPU.
First its numerics against eager's (bf16 / fp16, odd M, bias, zero points, groups, splits), then GPU µs per linear
in one CUDA graph over weights past the L2 (best of three rounds in turns) against the launch rule of
`qfuse_int4_mma`, the nibble-plane template and bf16's matmul, at each (warpgroups, unroll, splits) tried.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from gpu_int4_mma import DECODER_SHAPES, GROUP, Int4Weight, stack_size  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, graph_us_in_turns, machine, out_path, progress, write  # noqa: E402
from qfuse.kernels.cuda import int4_mma, launch  # noqa: E402
from qfuse.kernels.triton.int4_planes import triton_int4_planes_mm  # noqa: E402
from qfuse.kernels.triton.scaled_mm import multiprocessors  # noqa: E402

HERE = Path(__file__).parent
ARGUMENT_TYPES = "OOOOOOOiiiii"  # words, x, pairs, bias, out, partial, counters; M, N, K, split_chunks, has_bias
MOST_SHARED = 200 * 2**10


def wgmma_wrapper(tokens: int) -> str:
    """`wgmma(d, a, desc)`: one accumulating wgmma.m64n{tokens}k16 with a register A operand."""
    regs = tokens // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    binds = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (f"__device__ __forceinline__ void wgmma(float* d, const unsigned* a, unsigned long long desc) {{\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{tokens}k16.f32." HALF "." HALF " {{{d}}}, '
            f'{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p, 1, 1, 0;\\n}}\\n"\n'
            f"                 : {binds}\n"
            f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));\n}}\n')


def full_source(tokens: int) -> str:
    helpers = int4_mma.SOURCE.read_text().split("// The kernel (above")[0]  # its defines and `pair_value`
    kernel = (HERE / "int4_wgmma_decode.cu").read_text()
    return helpers + kernel.replace("// WGMMA_WRAPPER (the harness puts `wgmma(d, a, desc)` for TOKENS here)",
                                    wgmma_wrapper(tokens))


@functools.cache
def source_path(tokens: int) -> Path:
    path = Path(tempfile.mkdtemp()) / f"int4_wgmma_decode_{tokens}.cu"
    path.write_text(full_source(tokens))
    return path


def tokens_for(m: int) -> int:
    return max(8, -(-m // 8) * 8)


def shared_bytes(tokens: int, split_chunks: int, wg: int = 1, ring: int = 0) -> int:
    """The slice of x, and the weight's ring where there is one (512 bytes of words and 256 of pairs a slot a warp)."""
    return tokens * split_chunks * 128 + 4 * wg * ring * (512 + 256)


@functools.cache
def counters(device_index: int) -> torch.Tensor:
    """64 Ki zeroed counters, reused by every launch (each launch's last blocks reset theirs)."""
    return torch.zeros(2**16, device=f"cuda:{device_index}", dtype=torch.int32)


def slice_chunks(k: int, unroll: int, splits: int) -> int:
    """Chunks of 64 of K a block takes when K is cut into about `splits` slices of whole steps of `unroll`."""
    return -(-(-(-(k // 64) // splits)) // unroll) * unroll


def fits(m: int, k: int, unroll: int, splits: int, wg: int = 1, ring: int = 0) -> bool:
    return shared_bytes(tokens_for(m), slice_chunks(k, unroll, splits), wg, ring) <= MOST_SHARED


def call(x, words, pairs, bias, out, group, wg: int, unroll: int, splits: int, min_blocks: int = 1, ring: int = 0):
    """A closure launching the kernel on these tensors: K in `splits` slices (a multiple of `unroll` chunks each), the
    weight through a ring of `ring` slots a warp (0: straight into registers, `unroll` chunks ahead)."""
    m, k = x.shape
    n = pairs.shape[1]
    chunks = k // 64
    split_chunks = slice_chunks(k, unroll, splits)
    tokens = tokens_for(m)
    options = [f"-DTOKENS={tokens}", f"-DWG={wg}", f"-DUNROLL={unroll}", f"-DMIN_BLOCKS={min_blocks}",
               f"-DGROUP_SHIFT={int4_mma.group_shift(k, group)}"]
    options += ["-DHALF_BF16"] if x.dtype == torch.bfloat16 else []
    options += [f"-DRING={ring}"] if ring else []
    options += list(ABLATIONS)
    kernel = launch.compiled(source_path(tokens), "qfuse_int4_wgmma_decode", tuple(options), ARGUMENT_TYPES,
                             x.device.index or 0, shared_bytes(tokens, split_chunks, wg, ring), "90a")
    real_splits = -(-chunks // split_chunks)
    partial = torch.empty(real_splits if real_splits > 1 else 0, m, n, device=x.device)
    blocks = n // (64 * wg) * real_splits
    arguments = (words, x, pairs, pairs if bias is None else bias, out, partial, counters(x.device.index or 0), m, n, k,
                 split_chunks,
                 int(bias is not None))
    return lambda: kernel.launch(blocks, 4 * wg, arguments, x.device)


MIN_BLOCKS = (1,)  # __launch_bounds__' blocks a multiprocessor tried (--min-blocks)
RINGS = (0,)  # the weight's ring slots tried, 0 for none (--rings)
ONLY = []  # --variant
ABLATIONS = ()  # -D switches for every timed kernel (--ablate SKIP_STAGE,...): the numerics are checked without them


def variants(m: int, n: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """(warpgroups a block, chunks ahead, splits of K, launch bounds' blocks, ring slots) that fit: a whole number
    of row blocks, slices of whole steps (pairs of chunks with a ring)."""
    chunks = k // 64
    tried, slices = [], set()
    for wg, unroll, splits, ring in itertools.product((1, 2), (4, 8), (1, 2, 4, 8, 16, 32), RINGS):
        unroll = 2 if ring else unroll
        split_chunks = slice_chunks(k, unroll, splits)
        key = (wg, unroll, split_chunks, ring)
        if n % (64 * wg) or chunks % unroll or key in slices or not fits(m, k, unroll, splits, wg, ring):
            continue
        slices.add(key)
        tried += [(wg, unroll, splits, blocks, ring) for blocks in MIN_BLOCKS]
    return tried


def check_numerics() -> list[dict]:
    """Each output's largest error against exact math next to eager's own (bf16 / fp16, odd M, bias, groups)."""
    rows = []
    cases = [(9, 256, 1024, 128), (16, 512, 2048, 64), (27, 128, 4096, 4096), (64, 384, 1536, 128), (1, 128, 512, 128)]
    for dtype, (m, n, k, group), zero_points, with_bias in itertools.product(
            (torch.bfloat16, torch.float16), cases, (False, True), (False, True)):
        torch.manual_seed(m + n + k)
        values = torch.randint(-8, 8, (k, n), dtype=torch.int8, device="cuda")
        scale = (torch.rand(k // group, n, device="cuda") * 0.02 + 0.001).to(dtype)
        zero = torch.randint(-2, 3, (k // group, n), dtype=torch.int8, device="cuda") if zero_points else None
        z = 0 if zero is None else zero.float().repeat_interleave(group, 0)
        dense = ((values.float() - z) * scale.float().repeat_interleave(group, 0)).to(dtype)  # eager's weight
        words, pairs = int4_mma.repack(values, scale, zero)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
        exact = x.double() @ dense.double() + (0 if bias is None else bias.double())
        eager = torch.nn.functional.linear(x, dense.t(), bias).double()
        for wg, unroll, splits, ring in [(1, 4, 1, 0), (2, 4, 2, 0), (1, 8, 4, 0), (1, 2, 3, 0), (1, 2, 2, 8),
                                         (2, 2, 3, 4), (1, 2, 1, 16)]:
            if n % (64 * wg) or (k // 64) % unroll or not fits(m, k, unroll, splits, wg, ring):
                continue
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            try:
                for _ in range(2):  # twice: the counters must be reset by the first launch
                    out.fill_(float("nan"))
                    call(x, words, pairs, bias, out, group, wg, unroll, splits, 1, ring)()
            except RuntimeError as error:
                progress(f"failed: m={m} n={n} k={k} wg={wg} unroll={unroll} splits={splits} ring={ring}: {error}")
                raise
            rows.append(dict(dtype=str(dtype).split(".")[-1], m=m, n=n, k=k, group=group, zero_points=zero_points,
                             bias=with_bias, wg=wg, unroll=unroll, splits=splits, ring=ring,
                             error=(out.double() - exact).abs().max().item(),
                             eager_error=(eager - exact).abs().max().item()))
    return rows


def run(ms: list[int], shapes) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    sms = multiprocessors(torch.device("cuda"))
    rows = []
    for n, k in shapes:
        weights = [Int4Weight(n, k, False, generator) for _ in range(stack_size(n * k // 2))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, len(weights) // 4))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
            calls = {
                "cuda (launch rule)": [lambda w=w: int4_mma.int4_mma(x, *w.mma, None, GROUP, torch.bfloat16)
                                       for w in weights],
                "triton planes": [lambda w=w: triton_int4_planes_mm(x, w.words, None, w.scales_nk, w.zeros_packed, None,
                                                                    GROUP, torch.bfloat16, sms) for w in weights],
                "bf16 mm": [lambda w=w: x @ w.t() for w in dense],
            }
            for wg, unroll, splits, blocks, ring in ONLY or variants(m, n, k):
                name = f"wgmma {wg} wg, " + (f"ring {ring}" if ring else f"unroll {unroll}") + f", {splits} splits"
                calls[name + (f", {blocks} blocks" if blocks > 1 else "")] = [
                    call(x, *w.mma, None, out, GROUP, wg, unroll, splits, blocks, ring) for w, out in zip(weights, outs)]
            expected = x.double() @ weights[0].dequantized().double()
            errors = {}
            for name, graph in calls.items():
                if name != "bf16 mm":
                    result = graph[0]()
                    result = outs[0] if result is None else result
                    errors[name] = ((result.double() - expected).norm() / expected.norm()).item()
            times = graph_us_in_turns(calls)
            for name, us in sorted(times.items(), key=lambda item: item[1]):
                rows.append(dict(n=n, k=k, m=m, kernel=name, us=round(us, 2), vs_bf16=round(times["bf16 mm"] / us, 2),
                                 tb_per_s=round(weights[0].bytes / us / 1e6, 2), rel_error=errors.get(name)))
            ranked = sorted(times.items(), key=lambda item: item[1])
            progress(f"N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.2f}" for name, us in ranked[:4])
                     + f"; rule {times['cuda (launch rule)']:.2f}, planes {times['triton planes']:.2f},"
                       f" bf16 {times['bf16 mm']:.2f}")
        del weights, dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="8,16,32,64", help="rows of x, comma-separated")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in DECODER_SHAPES), help="N x K, comma-separated")
    parser.add_argument("--min-blocks", default="1", help="launch bounds' blocks a multiprocessor, comma-separated")
    parser.add_argument("--rings", default="0", help="the weight's ring slots a warp (0: none), comma-separated")
    parser.add_argument("--ablate", default="", help="SKIP_STAGE and / or SKIP_WGMMA, comma-separated")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--variant", help="only this wgmma variant: wg,unroll,splits,blocks,ring")
    parser.add_argument("--source", type=int, nargs="?", const=16, help="print the full source for TOKENS and stop")
    add_output_arguments(parser, "gpu_int4_wgmma_decode")
    args = parser.parse_args()
    if args.source:
        print(full_source(args.source))
        return
    global MIN_BLOCKS, RINGS
    MIN_BLOCKS = tuple(int(blocks) for blocks in args.min_blocks.split(","))
    RINGS = tuple(int(ring) for ring in args.rings.split(","))
    checks = check_numerics() if not args.skip_checks else []
    if checks:
        worst = max(checks, key=lambda row: row["error"] / max(row["eager_error"], 1e-30))
        progress(f"{len(checks)} checks; worst error / eager's: {worst}")
    global ABLATIONS, ONLY
    ONLY = [tuple(int(v) for v in args.variant.split(","))] if args.variant else []
    ABLATIONS = tuple(f"-D{name}" for name in args.ablate.split(",") if name)
    shapes = [tuple(int(size) for size in shape.split("x")) for shape in args.shapes.split(",")]
    rows = run([int(m) for m in args.ms.split(",")], shapes)
    header = ["n", "k", "m", "kernel", "us", "vs_bf16", "tb_per_s", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_wgmma_decode"), rows, machine=machine(), checks=checks)


if __name__ == "__main__":
    main()
