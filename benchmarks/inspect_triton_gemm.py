"""What the compiled Triton scaled-mm kernel is made of, for fp8 and int8 at M=N=K=4096 (GPU).

    python benchmarks/inspect_triton_gemm.py

Prints, per dtype: the config, registers and spills per thread, and how many wgmma (Hopper
warp-group MMA) and mma.sync instructions the PTX holds. Run under ncu for throughput metrics:
    ncu --kernel-name regex:_scaled_mm_kernel --metrics sm__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed python benchmarks/inspect_triton_gemm.py
"""

import re

import torch

from qfuse.kernels.triton import scaled_mm as triton_mm

for dtype in (torch.float8_e4m3fn, torch.int8):
    a = torch.randn(4096, 4096, device="cuda").to(dtype) if dtype.is_floating_point else \
        torch.randint(-127, 128, (4096, 4096), device="cuda", dtype=dtype)
    w = a.clone()
    triton_mm.triton_scaled_mm(a, w.t(), torch.ones(4096, 1, device="cuda"), torch.ones(1, 4096, device="cuda"),
                               None, torch.bfloat16)
    torch.cuda.synchronize()
    for compiled in triton_mm._scaled_mm_kernel.device_caches[0][0].values():
        if (dtype == torch.int8) == ("i8" in str(compiled.src.signature)):
            ptx = compiled.asm["ptx"]
            print(dtype, triton_mm.pick_config(4096, 4096, dtype != torch.int8, False, triton_mm.multiprocessors(a.device)),
                  f"registers {compiled.n_regs} spills {compiled.n_spills}",
                  f"wgmma {len(re.findall(r'wgmma.mma_async', ptx))} mma.sync {len(re.findall(r'mma.sync', ptx))}")
