"""Where a W4A16 decode step's time goes on the GPU: the int4 words' loads, their unpack, and the kernels.

    python benchmarks/explorations/gpu_int4_unpack.py [--ms 1,16] [--quick] [--out FILE.json]
    python benchmarks/explorations/gpu_int4_unpack.py --table FILE.json

On a stack of GPTQ-form weights past the L2 (`gpu_weight_only.GptqLinear`: int32 words [N, K / 8],
groups of 128), one CUDA graph of calls (`graph_ms_per_call`), µs per linear:

    load            a kernel that only loads the words in qfuse's [BLOCK_N, BLOCK_K / 8] tiles (K split
                    as the decode kernel splits it) and sums them: the access pattern's own speed
    unpack (broadcast)  the same, plus the unpack qfuse's kernel does: words[:, :, None] >> shifts
    unpack (join)   the unpack as eight 2D shifts joined in-thread (`tl.join`), q - 8 in float32 by
                    the 2**23 exponent trick; "+ scale": also times the group scale and rounds to bf16
    qfuse kernel    `triton_int4_mm` called eagerly (its split-K sum is a second kernel)
    tinygemm        ATen's `_weight_int4pack_mm` on the weight repacked once (`_convert_weight_to_int4pack`,
                    inner_k_tiles 2 / 4 / 8; symmetric weights: a zero of 0 in its float-zero form)
    bf16 cublas     `nn.Linear` of the same size

Each synthetic kernel reports its best tile (BLOCK_N x BLOCK_K, warps, K splits) of a small sweep.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import triton
import triton.language as tl

from gpu_weight_only import GROUP, GptqLinear, hbm_floor_us, layers_for
from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, out_path, progress, relative_error, write
from qfuse.kernels import int4_tinygemm

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
# (BLOCK_N, BLOCK_K / 8 words, warps, K splits) swept for each synthetic kernel
SWEEP = [(block_n, words, warps, splits) for block_n in (32, 64) for words in (32, 64) for warps in (4, 8)
         for splits in (2, 4, 8)]
QUICK_SWEEP = [(32, 32, 8, 4), (32, 64, 8, 4)]
LOAD, BROADCAST, JOIN, JOIN_SCALED = 0, 1, 2, 3
SYNTHETIC = {"load": LOAD, "unpack (broadcast)": BROADCAST, "unpack (join)": JOIN, "unpack (join) + scale": JOIN_SCALED}


@triton.jit
def _minus_eight(words, i: tl.constexpr):
    """q_i - 8 as float32 for nibble i of every word: 2**23 + q_i through the exponent bits, exact."""
    return (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _words_kernel(W, S, OUT, N, KW, stride_wn, stride_sn, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_KW: tl.constexpr, HOW: tl.constexpr):
    """Reads the [N, KW] words of this program's K range in [BLOCK_N, BLOCK_KW] tiles; sums what HOW makes of them."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.cdiv(tl.cdiv(KW, BLOCK_KW), SPLIT_K)
    start = pid_k * steps * BLOCK_KW
    end = tl.minimum(KW, start + steps * BLOCK_KW)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kw0 in range(start, end, BLOCK_KW):
        offs = kw0 + tl.arange(0, BLOCK_KW)
        words = tl.load(W + offs_n[:, None] * stride_wn + offs[None, :], mask=(offs_n < N)[:, None], other=0)
        if HOW == 0:
            acc += tl.sum(words, 1).to(tl.float32)
        elif HOW == 1:
            shift = tl.arange(0, 8) * 4
            acc += tl.sum(tl.sum((((words[:, :, None] >> shift[None, None, :]) & 0xF) - 8).to(tl.float32), 2), 1)
        else:
            even = tl.join(tl.join(_minus_eight(words, 0), _minus_eight(words, 4)),
                           tl.join(_minus_eight(words, 2), _minus_eight(words, 6)))
            odd = tl.join(tl.join(_minus_eight(words, 1), _minus_eight(words, 5)),
                          tl.join(_minus_eight(words, 3), _minus_eight(words, 7)))
            q = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_KW * 8))
            if HOW == 3:
                groups: tl.constexpr = BLOCK_KW // 16  # 16 words: one group of 128
                scale = tl.load(S + offs_n[:, None] * stride_sn + (kw0 // 16 + tl.arange(0, groups))[None, :],
                                mask=(offs_n < N)[:, None], other=0.0).to(tl.float32)
                q = tl.reshape((tl.reshape(q, (BLOCK_N, groups, 128)) * scale[:, :, None]).to(tl.bfloat16),
                               (BLOCK_N, BLOCK_KW * 8)).to(tl.float32)
            acc += tl.sum(q, 1)
    tl.store(OUT + pid_k * N + offs_n, acc, mask=offs_n < N)


def synthetic_calls(stack, how: int, tile):
    block_n, words_per_step, warps, splits = tile
    calls = []
    for linear in stack:
        words, scales = linear.qweight, linear.scales
        n, kw = words.shape
        out = torch.empty(splits, n, device="cuda")
        grid = (triton.cdiv(n, block_n), splits)
        calls.append(lambda words=words, scales=scales, out=out, grid=grid, n=n, kw=kw: _words_kernel[grid](
            words, scales, out, n, kw, words.stride(0), scales.stride(0), SPLIT_K=splits, BLOCK_N=block_n,
            BLOCK_KW=words_per_step, HOW=how, num_warps=warps, num_stages=3))
    return calls


def tinygemm_weight(linear: GptqLinear, inner_k_tiles: int):
    """(ATen's packed weight, scales_and_zeros [K / g, N, 2]) of a symmetric GPTQ linear (`int4_tinygemm.pack`)."""
    n, words = linear.qweight.shape
    values = ((linear.qweight.unsqueeze(-1) >> linear.shifts) & 0xF).reshape(n, words * 8) - 8  # [N, K], -8..7
    prepared = int4_tinygemm.pack(values.t().to(torch.int8), linear.scales.t().contiguous(), inner_k_tiles)
    return prepared.data, prepared.scale


def kernel_rows(stack, base: dict, m: int) -> list[dict]:
    k = stack[0].qweight.shape[1] * 8
    n = stack[0].qweight.shape[0]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected = stack[0](x)
    rows = [base | {"m": m, "variant": "qfuse kernel",
                    "us": graph_ms_per_call([lambda linear=linear: linear.kernel_call(x) for linear in stack]) * 1e3}]
    floats = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for _ in stack]
    rows.append(base | {"m": m, "variant": "bf16 cublas", "us": graph_ms_per_call([lambda f=f: f(x) for f in floats]) * 1e3})
    del floats
    for tiles in (2, 4, 8):
        weights = [tinygemm_weight(linear, tiles) for linear in stack]
        out = torch._weight_int4pack_mm(x, weights[0][0], GROUP, weights[0][1])
        us = graph_ms_per_call([lambda w=w: torch._weight_int4pack_mm(x, w[0], GROUP, w[1]) for w in weights]) * 1e3
        rows.append(base | {"m": m, "variant": f"tinygemm inner_k_tiles={tiles}", "us": us,
                            "error": relative_error(out, expected)})
    return rows


def synthetic_rows(stack, base: dict, sweep) -> list[dict]:
    rows = []
    for name, how in SYNTHETIC.items():
        timed = [(graph_ms_per_call(synthetic_calls(stack, how, tile)) * 1e3, tile) for tile in sweep]
        us, tile = min(timed)
        rows.append(base | {"m": "-", "variant": name, "us": us, "tile": [tile[0], tile[1] * 8, tile[2], tile[3]]})
    return rows


def table(path: str) -> str:
    cases = defaultdict(dict)
    for row in json.loads(open(path).read())["rows"]:
        cases[(row["n"], row["k"], row["floor_us"])][(row["variant"], row["m"])] = row["us"]
    columns = sorted({key for case in cases.values() for key in case}, key=lambda key: (str(key[1]), key[0]))
    lines = [[f"N={n} K={k}", f"{floor:.1f}", *(f"{case[key]:.1f}" if key in case else "" for key in columns)]
             for (n, k, floor), case in cases.items()]
    header = ["shape", "HBM floor", *(f"{variant}" + ("" if m == "-" else f" M={m}") for variant, m in columns)]
    return format_table(lines, header, markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default=None, help="print the markdown table of a result file and stop")
    parser.add_argument("--ms", default="1,16", help="comma-separated M values of the kernel rows")
    add_output_arguments(parser, "gpu_int4_unpack", quick="the first shape, two tiles")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    rows = []
    for n, k in SHAPES[:1] if args.quick else SHAPES:
        generator = torch.Generator(device="cuda").manual_seed(0)
        stack = [GptqLinear(n, k, generator) for _ in range(layers_for(n, k))]
        base = {"n": n, "k": k, "floor_us": hbm_floor_us(n, k, "gptq")}
        for m in (int(m) for m in args.ms.split(",")):
            rows += kernel_rows(stack, base, m)
        rows += synthetic_rows(stack, base, QUICK_SWEEP if args.quick else SWEEP)
        progress(f"{n}x{k}: " + ", ".join(f"{row['variant']} M={row['m']} {row['us']:.1f}" for row in rows if (row["n"], row["k"]) == (n, k)))
        write(out_path(args, "gpu_int4_unpack"), rows)
    print(table(str(out_path(args, "gpu_int4_unpack"))))


if __name__ == "__main__":
    main()
