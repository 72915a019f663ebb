"""How often to promote Hopper's reduced-precision fp8 accumulator: speed against error (GPU).

    python benchmarks/explorations/fp8_promotion.py [--quick] [--out FILE.json]

For three shapes, the Triton fp8 row-wise scaled mm (bf16 out, 128x128x128 tiles) with the
promotion interval at 1, 2, 4, 8 K steps and never, each against cuBLAS `torch._scaled_mm`
row-wise in the same run: speed as a share of cuBLAS (do_bench medians), error as
||out - cuBLAS|| / ||cuBLAS||. --quick: the first shape, promotion every 4 and never.
Writes fp8_promotion.json.
"""

from __future__ import annotations

import argparse

import torch

from gemm_cases import FP8
from qfuse.bench import add_output_arguments, kernel_ms, machine, out_path, relative_error, write
from qfuse.kernels.triton.scaled_mm import triton_scaled_mm

NEVER = 1 << 30
SHAPES = ((4096, 4096, 4096), (4096, 14336, 4096), (1024, 4096, 14336))  # (M, N, K)
TILE = (128, 128, 128, 8, 8, 4)


def promotion_rows(m: int, n: int, k: int, promotions) -> list[dict]:
    a, w = torch.randn(m, k, device="cuda").to(FP8), torch.randn(n, k, device="cuda").to(FP8)
    scale_a, scale_b = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
    cublas = torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16)
    cublas_ms = kernel_ms(lambda: torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16))
    rows = []
    for promote in promotions:
        def run():
            return triton_scaled_mm(a, w.t(), scale_a, scale_b, None, torch.bfloat16, TILE, promote)

        triton_ms = kernel_ms(run)
        rows.append({"m": m, "n": n, "k": k, "promote": "never" if promote == NEVER else promote,
                     "cublas_ms": cublas_ms, "triton_ms": triton_ms, "speed_vs_cublas": cublas_ms / triton_ms,
                     "relative_error": relative_error(run(), cublas)})
        print(f"{m}x{n}x{k} promote every {rows[-1]['promote']}: {rows[-1]['speed_vs_cublas']:.3f}x of cuBLAS rowwise, "
              f"relative error {rows[-1]['relative_error']:.2e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "fp8_promotion", quick="the first shape, promotion every 4 and never")
    args = parser.parse_args()
    print(machine(), flush=True)
    shapes, promotions = (SHAPES[:1], (4, NEVER)) if args.quick else (SHAPES, (1, 2, 4, 8, NEVER))
    rows = [row for m, n, k in shapes for row in promotion_rows(m, n, k, promotions)]
    print(f"wrote {write(out_path(args, 'fp8_promotion'), rows)}")


if __name__ == "__main__":
    main()
