"""What the compiled Triton scaled-mm kernel is made of, for fp8 and int8 at N = K = 4096 (GPU).

    python benchmarks/inspect_triton_gemm.py [--m M]     (default M = 4096; M <= 16: decode tiles)

Prints, per dtype: the config, registers and spills per thread, how many wgmma (Hopper warp-group
MMA) and mma.sync instructions the PTX holds and of which kinds, and its conversions (cvt). Run
under ncu for throughput metrics:
    ncu --kernel-name regex:_scaled_mm_kernel --metrics sm__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed python benchmarks/inspect_triton_gemm.py
"""

import argparse
import collections
import re

import torch

from qfuse.kernels.triton import scaled_mm as triton_mm

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--m", type=int, default=4096)
m = parser.parse_args().m
for dtype in (torch.float8_e4m3fn, torch.int8):
    def quantized(*shape):
        if dtype.is_floating_point:
            return torch.randn(*shape, device="cuda").to(dtype)
        return torch.randint(-127, 128, shape, device="cuda", dtype=dtype)
    a, w = quantized(m, 4096), quantized(4096, 4096)
    triton_mm._scaled_mm_kernel.device_caches[0][0].clear()
    triton_mm.triton_scaled_mm(a, w.t(), torch.ones(m, 1, device="cuda"), torch.ones(1, 4096, device="cuda"),
                               None, torch.bfloat16)
    torch.cuda.synchronize()
    for compiled in triton_mm._scaled_mm_kernel.device_caches[0][0].values():
        ptx = compiled.asm["ptx"]
        mma_kinds = collections.Counter(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", ptx))
        conversions = collections.Counter(re.findall(r"(cvt\.\S+)", ptx))
        print(dtype, triton_mm.pick_config(m, 4096, dtype != torch.int8, False, triton_mm.multiprocessors(a.device)),
              f"registers {compiled.n_regs} spills {compiled.n_spills}")
        print("   mma:", dict(mma_kinds))
        print("   cvt:", dict(conversions.most_common(6)))
