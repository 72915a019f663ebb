"""How often to promote Hopper's reduced-precision fp8 accumulator: speed against error (GPU).

    python benchmarks/fp8_promotion.py

For three shapes, the Triton fp8 row-wise scaled mm (bf16 out, 128x128x128 tiles) with the
promotion interval at 1, 2, 4, 8 K steps and never, each against cuBLAS `torch._scaled_mm`
row-wise in the same run: speed as a share of cuBLAS, error as ||out - cuBLAS|| / ||cuBLAS||.
"""

import torch
from triton.testing import do_bench

from qfuse.kernels.triton.scaled_mm import triton_scaled_mm

NEVER = 1 << 30
for m, n, k in ((4096, 4096, 4096), (4096, 14336, 4096), (1024, 4096, 14336)):
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
    cublas = torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16).float()
    cublas_ms = do_bench(lambda: torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16),
                         return_mode="median")
    for promote in (1, 2, 4, 8, NEVER):
        def run():
            return triton_scaled_mm(a, w.t(), scale_a, scale_b, None, torch.bfloat16,
                                    (128, 128, 128, 8, 8, 4), promote)
        error = ((run().float() - cublas).norm() / cublas.norm()).item()
        speed = cublas_ms / do_bench(run, return_mode="median")
        label = "never" if promote == NEVER else promote
        print(f"{m}x{n}x{k} promote every {label}: {speed:.3f}x of cuBLAS rowwise, relative error {error:.2e}")
