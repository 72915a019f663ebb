"""Dynamic per-token activation quant on the GPU: Inductor's generated code against qfuse's Triton kernel.

Issue #13 item 2: the activation quant stays in Inductor IR, where it fuses with the op that
produces it, unless a qfuse quant kernel measurably beats it. This script times, per dtype (int8,
fp8), M and K, a bf16 activation quantized per token as `gpu_linear.QuantLinear` writes it (scale
in float32 from the bf16 amax, clamped to eps, / qmax):

    inductor            the quant form compiled by Inductor (one reduction kernel: amax, then quantize)
    qfuse triton wN     `qfuse.kernels.triton.quant._dynamic_quant_kernel` at N warps, one row per
                        program, the row held in registers (x read once)
    inductor silu*mul   the down projection's input: quant(silu(gate) * up), compiled (Inductor fuses
                        the SiLU * mul into the quant's loops), against
    silu*mul, then qfuse  the SiLU * mul compiled alone, then qfuse's kernel (what a separate kernel costs
                        where the producer could have fused)

GPU µs per call of 20 calls in one CUDA graph (`qfuse.bench.gpu_time`; the activation of M = 4096,
K = 14336 is 117 MB, above the L2), beside the time of moving the bytes at the HBM bandwidth of a
1 GiB copy (`hbm.hbm_bandwidth`): 2 bytes read + 1 written per element, 4 more per row.

    python benchmarks/gpu_quant.py [--ms 16,1024,4096] [--ks 4096,14336] [--out FILE.json]
    python benchmarks/gpu_quant.py --table FILE.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from gemm_cases import FP8
from gpu_linear import EPS, activation_quant
from hbm import hbm_bandwidth
from qfuse.bench import add_output_arguments, format_table, gpu_time, out_path, progress, write
from qfuse.schemes import Granularity

WARPS = (4, 8, 16, 32)


def reference_quant(x: torch.Tensor, dtype: torch.dtype):
    """gpu_linear.QuantLinear's activation quant: (q, float32 scale [M, 1])."""
    return activation_quant(x, dtype)


def silu_mul_quant(gate, up, dtype):
    return reference_quant(F.silu(gate) * up, dtype)


def triton_quant(x: torch.Tensor, dtype: torch.dtype, num_warps: int):
    """qfuse's one-pass kernel on bf16 x with a float32 scale, at `num_warps`."""
    from qfuse.kernels.triton.quant import triton_dynamic_quant

    return triton_dynamic_quant(x, dtype, Granularity.PER_TOKEN, EPS[dtype], torch.float32, num_warps)


def case_rows(dtype: torch.dtype, m: int, k: int, bandwidth: float) -> list[dict]:
    label = {"dtype": "int8" if dtype == torch.int8 else "fp8", "m": m, "k": k,
             "hbm_floor_us": (3 * m * k + 4 * m) / bandwidth * 1e6}
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected_q, expected_s = reference_quant(x, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(reference_quant)
    rows = [label | {"variant": "inductor", "us": gpu_time(compiled, x, dtype)}]
    for warps in WARPS:
        q, s = triton_quant(x, dtype, warps)
        torch.testing.assert_close(s, expected_s, rtol=0, atol=0)
        torch.testing.assert_close(q.float(), expected_q.float(), rtol=0, atol=0)
        rows.append(label | {"variant": f"qfuse triton w{warps}", "us": gpu_time(triton_quant, x, dtype, warps)})
    gate, up = torch.randn_like(x), torch.randn_like(x)
    fused = torch.compile(silu_mul_quant)
    product = torch.compile(lambda g, u: F.silu(g) * u)
    best = min(WARPS, key=lambda w: next(r["us"] for r in rows if r["variant"] == f"qfuse triton w{w}"))
    rows.append(label | {"variant": "inductor silu*mul", "us": gpu_time(fused, gate, up, dtype)})
    rows.append(label | {"variant": "silu*mul, then qfuse",
                         "us": gpu_time(lambda: triton_quant(product(gate, up), dtype, best))})
    return rows


def table(rows: list[dict]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = []
    for case in dict.fromkeys((r["dtype"], r["m"], r["k"]) for r in rows):
        mine = {r["variant"]: r for r in rows if (r["dtype"], r["m"], r["k"]) == case}
        floor = next(iter(mine.values()))["hbm_floor_us"]
        lines.append([f"{case[0]} M={case[1]} K={case[2]}", f"{floor:.1f}",
                      *(f"{mine[v]['us']:.1f}" if v in mine else "" for v in variants)])
    return format_table(lines, ["case", "HBM floor", *variants], markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default=None, help="print the markdown table of a result file and stop")
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--ms", default="16,1024,4096")
    parser.add_argument("--ks", default="4096,14336")
    add_output_arguments(parser, "gpu_quant")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(open(args.table).read())["rows"]))
        return
    bandwidth, rows, out = hbm_bandwidth(), [], out_path(args, "gpu_quant")
    for dtype in ({"int8": torch.int8, "fp8": FP8}[name] for name in args.dtypes.split(",")):
        for m in map(int, args.ms.split(",")):
            for k in map(int, args.ks.split(",")):
                progress(f"quant {dtype} M={m} K={k}")
                rows += case_rows(dtype, m, k, bandwidth)
                write(out, rows, hbm_bytes_per_s=bandwidth)
    print(table(rows))


if __name__ == "__main__":
    main()
