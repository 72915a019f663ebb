"""The int8 GEMM at prefill: the tiled Triton kernel against the persistent TMA kernel, by M (GPU).

    python benchmarks/explorations/gpu_persistent_int8.py [--ms 1024,2048,4096] [--quick] [--out FILE.json]

Eager launches of `scaled_mm.triton_scaled_mm` (its table's tile) and of
`persistent_mm.persistent_scaled_mm` at a few tiles, per-token x per-channel scales, bf16 out, on
(N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}; cuBLAS's `_int_mm` (no scales) beside them.
GPU µs per call (`qfuse.bench.kernel_ms`: do_bench's median, the L2 emptied before each call).
What it decides: `persistent_mm.CONFIGS["int8"]` and `MIN_M["int8"]`, the M from which the template
(`qfuse.lowerings.triton.template`) runs the persistent kernel. --quick: M = 4096, one shape.
"""

from __future__ import annotations

import argparse

import torch

from qfuse.bench import add_output_arguments, kernel_ms, machine, out_path, progress, write
from qfuse.kernels.triton.persistent_mm import persistent_scaled_mm
from qfuse.kernels.triton.scaled_mm import triton_scaled_mm

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
PERSISTENT_TILES = ((128, 256, 128, 8, 8, 3), (128, 256, 128, 8, 8, 4), (256, 128, 128, 8, 8, 3),
                    (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 8, 3))


def case_rows(m: int, n: int, k: int) -> list[dict]:
    a = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8).t()
    scale_a, scale_b = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
    reference = triton_scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16)
    candidates = {"cublas _int_mm (no scales)": lambda: torch._int_mm(a, b),
                  "tiled (its table's tile)": lambda: triton_scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16)}
    for tile in PERSISTENT_TILES:
        candidates[f"persistent {tile}"] = (
            lambda tile=tile: persistent_scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, config=tile))
    rows = []
    for name, fn in candidates.items():
        if name.startswith("persistent") and not torch.equal(fn(), reference):
            raise AssertionError(f"{name} differs from the tiled kernel at M={m} N={n} K={k}")
        rows.append({"m": m, "n": n, "k": k, "kernel": name, "gpu_us": kernel_ms(fn) * 1e3})
        progress(f"M={m} N={n} K={k} {name}: {rows[-1]['gpu_us']:.1f} us")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1024,2048,4096")
    add_output_arguments(parser, "gpu_persistent_int8", quick="M = 4096 at 4096 x 14336 only")
    args = parser.parse_args()
    print(machine())
    cases = [(4096, 4096, 14336)] if args.quick else [(m, n, k) for m in map(int, args.ms.split(",")) for n, k in SHAPES]
    rows = [row for m, n, k in cases for row in case_rows(m, n, k)]
    print(f"wrote {write(out_path(args, 'gpu_persistent_int8'), rows)}")


if __name__ == "__main__":
    main()
