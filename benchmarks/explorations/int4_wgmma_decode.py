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
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from gpu_int4_mma import DECODER_SHAPES, GROUP  # noqa: E402
from int4_batched_decode import timed_against_the_rule  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, machine, out_path, progress, write  # noqa: E402
from qfuse.kernels.cuda import int4_mma, launch  # noqa: E402

HERE = Path(__file__).parent
# words, x, pairs, bias, out, partial, counters; M, N, K, split_chunks, row_blocks, has_bias
ARGUMENT_TYPES = "OOOOOOOiiiiii"
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


@dataclass(frozen=True)
class Variant:
    """One compiled kernel and launch: `wg` warpgroups a block, the weight's stream (`STREAM`: "steps" two steps of
    `depth` chunks in registers, "loaded" one, "ring" a cp.async ring of `depth` slots a warp), K in about `splits`
    slices, `row_blocks` row blocks a block through one staging of x, one set of A registers (`single_a`), the launch
    bounds' blocks a multiprocessor."""

    wg: int = 1
    stream: str = "steps"
    depth: int = 4
    splits: int = 1
    row_blocks: int = 1
    single_a: bool = False
    min_blocks: int = 1

    @property
    def unroll(self) -> int:  # slices are whole steps (whole pairs of chunks with a ring)
        return 2 if self.stream == "ring" else self.depth

    def slice_chunks(self, k: int) -> int:
        """Chunks of 64 of K a block takes."""
        return -(-(-(-(k // 64) // self.splits)) // self.unroll) * self.unroll

    def shared_bytes(self, m: int, k: int) -> int:
        """The slice of x, and the weight's ring where there is one (512 bytes of words and 256 of pairs a slot a
        warp)."""
        ring = self.depth if self.stream == "ring" else 0
        return tokens_for(m) * self.slice_chunks(k) * 128 + 4 * self.wg * ring * (512 + 256)

    def why_not(self, m: int, n: int, k: int) -> str:
        if n % (64 * self.wg) or (k // 64) % self.unroll:
            return "N or K not whole row blocks or steps"
        return "shared memory" if self.shared_bytes(m, k) > MOST_SHARED else ""

    def name(self) -> str:
        text = f"wgmma {self.wg} wg, {self.stream} {self.depth}, {self.splits} splits, {self.row_blocks} rb"
        return text + (", single A" if self.single_a else "") + (f", {self.min_blocks} a SM" if self.min_blocks > 1 else "")

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """From "wg,stream,depth,splits,row_blocks,single_a,min_blocks"."""
        wg, stream, depth, splits, row_blocks, single_a, min_blocks = text.split(",")
        return cls(int(wg), stream, int(depth), int(splits), int(row_blocks), bool(int(single_a)), int(min_blocks))


STREAMS = {"steps": 0, "loaded": 1, "ring": 2}


@functools.cache
def counters(device_index: int) -> torch.Tensor:
    """64 Ki zeroed counters, reused by every launch (each launch's last blocks reset theirs)."""
    return torch.zeros(2**16, device=f"cuda:{device_index}", dtype=torch.int32)


def call(x, words, pairs, bias, out, group, variant: Variant):
    """A closure launching the kernel on these tensors."""
    m, k = x.shape
    n = pairs.shape[1]
    chunks = k // 64
    split_chunks = variant.slice_chunks(k)
    options = [f"-DTOKENS={tokens_for(m)}", f"-DWG={variant.wg}", f"-DUNROLL={variant.unroll}",
               f"-DMIN_BLOCKS={variant.min_blocks}", f"-DGROUP_SHIFT={int4_mma.group_shift(k, group)}",
               f"-DSTREAM={STREAMS[variant.stream]}", f"-DRING={variant.depth}"]
    options += ["-DHALF_BF16"] if x.dtype == torch.bfloat16 else []
    options += ["-DSINGLE_A"] if variant.single_a else []
    options += list(ABLATIONS)
    kernel = launch.compiled(source_path(tokens_for(m)), "qfuse_int4_wgmma_decode", tuple(options), ARGUMENT_TYPES,
                             x.device.index or 0, variant.shared_bytes(m, k), "90a")
    splits = -(-chunks // split_chunks)
    partial = torch.empty(splits if splits > 1 else 0, m, n, device=x.device)
    blocks = -(-(n // (64 * variant.wg)) // variant.row_blocks) * splits
    arguments = (words, x, pairs, pairs if bias is None else bias, out, partial, counters(x.device.index or 0), m, n, k,
                 split_chunks, variant.row_blocks, int(bias is not None))
    return lambda: kernel.launch(blocks, 4 * variant.wg, arguments, x.device)


SWEEP = dict(wg=(1, 2), stream=("steps",), depth=(4, 8), splits=(1, 2, 4, 8, 16, 32), row_blocks=(1,),
             single_a=(False,), min_blocks=(1,))  # --sweep field=values;field=values overrides
ONLY = []  # --variant
ABLATIONS = ()  # -D switches for every timed kernel (--ablate SKIP_STAGE,...): the numerics are checked without them


def variants(m: int, n: int, k: int) -> list[Variant]:
    """The sweep's variants that fit, one a distinct slice of K."""
    tried, seen = [], set()
    for values in itertools.product(*SWEEP.values()):
        variant = Variant(**dict(zip(SWEEP, values)))
        key = (variant.wg, variant.stream, variant.depth, variant.slice_chunks(k), variant.row_blocks, variant.single_a,
               variant.min_blocks)
        if key in seen or variant.why_not(m, n, k):
            continue
        seen.add(key)
        tried.append(variant)
    return tried


CHECKED = [Variant(1, "steps", 4, 1), Variant(2, "steps", 4, 2), Variant(1, "steps", 8, 4), Variant(1, "steps", 2, 3),
           Variant(1, "ring", 8, 2), Variant(2, "ring", 4, 3), Variant(1, "ring", 16, 1), Variant(1, "loaded", 4, 2, 3),
           Variant(1, "loaded", 8, 1, 2, True), Variant(2, "steps", 4, 3, 2, True), Variant(1, "ring", 4, 2, 4, True)]


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
        for variant in CHECKED:
            if variant.why_not(m, n, k):
                continue
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            try:
                for _ in range(2):  # twice: the counters must be reset by the first launch
                    out.fill_(float("nan"))
                    call(x, words, pairs, bias, out, group, variant)()
            except RuntimeError as error:
                progress(f"failed: m={m} n={n} k={k} {variant.name()}: {error}")
                raise
            rows.append(dict(dtype=str(dtype).split(".")[-1], m=m, n=n, k=k, group=group, zero_points=zero_points,
                             bias=with_bias, variant=variant.name(),
                             error=(out.double() - exact).abs().max().item(),
                             eager_error=(eager - exact).abs().max().item()))
    return rows


def run(ms: list[int], shapes) -> list[dict]:
    def wgmma(x, weights, outs):
        m, k = x.shape
        n = weights[0].mma[1].shape[1]
        return {variant.name(): [call(x, *w.mma, None, out, GROUP, variant) for w, out in zip(weights, outs)]
                for variant in ONLY or variants(m, n, k)}
    return timed_against_the_rule(ms, shapes, wgmma, tinygemm=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="8,16,32,64", help="rows of x, comma-separated")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in DECODER_SHAPES), help="N x K, comma-separated")
    parser.add_argument("--sweep", default="", help='the sweep\'s fields overridden: "stream=loaded,ring;depth=4,8"')
    parser.add_argument("--ablate", default="", help="SKIP_STAGE and / or SKIP_WGMMA, comma-separated")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--variant", help="only these variants: wg,stream,depth,splits,row_blocks,single_a,min_blocks;...")
    parser.add_argument("--source", type=int, nargs="?", const=16, help="print the full source for TOKENS and stop")
    add_output_arguments(parser, "gpu_int4_wgmma_decode")
    args = parser.parse_args()
    if args.source:
        print(full_source(args.source))
        return
    for field in filter(None, args.sweep.split(";")):
        name, values = field.split("=")
        kind = type(SWEEP[name][0])
        SWEEP[name] = tuple(value if kind is str else kind(int(value)) for value in values.split(","))
    checks = check_numerics() if not args.skip_checks else []
    if checks:
        worst = max(checks, key=lambda row: row["error"] / max(row["eager_error"], 1e-30))
        progress(f"{len(checks)} checks; worst error / eager's: {worst}")
    global ABLATIONS, ONLY
    ONLY = [Variant.parse(text) for text in args.variant.split(";")] if args.variant else []
    ABLATIONS = tuple(f"-D{name}" for name in args.ablate.split(",") if name)
    shapes = [tuple(int(size) for size in shape.split("x")) for shape in args.shapes.split(",")]
    rows = run([int(m) for m in args.ms.split(",")], shapes)
    header = ["n", "k", "m", "kernel", "us", "vs_bf16", "tb_per_s", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_wgmma_decode"), rows, machine=machine(), checks=checks)


if __name__ == "__main__":
    main()
