"""What the compiled Triton scaled-mm kernel is made of, for fp8 and int8 at N = K = 4096 (GPU).

    python benchmarks/explorations/inspect_triton_gemm.py [--m M] [--out FILE.json]   (default M = 4096; M <= 16: decode tiles)

Prints, per dtype: the config, registers and spills per thread, how many wgmma (Hopper warp-group
MMA) and mma.sync instructions the PTX holds and of which kinds, and its conversions (cvt). One
compile per dtype (seconds: no quick mode needed). Run under ncu for throughput metrics:
    ncu --kernel-name regex:_scaled_mm_kernel --metrics sm__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed python benchmarks/explorations/inspect_triton_gemm.py
"""

from __future__ import annotations

import argparse
import collections
import re

import torch

from gemm_cases import quantized
from qfuse.bench import add_output_arguments, machine, out_path, write
from qfuse.kernels.triton import scaled_mm as triton_mm


def inspect(m: int, dtype: torch.dtype) -> list[dict]:
    """One row per compiled variant of the kernel that a (M, 4096) x (4096, 4096) call compiles."""
    a, w = quantized(m, 4096, dtype), quantized(4096, 4096, dtype)
    triton_mm._scaled_mm_kernel.device_caches[0][0].clear()
    triton_mm.triton_scaled_mm(a, w.t(), torch.ones(m, 1, device="cuda"), torch.ones(1, 4096, device="cuda"),
                               None, torch.bfloat16)
    torch.cuda.synchronize()
    config = triton_mm.pick_config(m, 4096, dtype != torch.int8, False, triton_mm.multiprocessors(a.device))
    rows = []
    for compiled in triton_mm._scaled_mm_kernel.device_caches[0][0].values():
        ptx = compiled.asm["ptx"]
        rows.append({"dtype": str(dtype), "m": m, "config": config, "registers": compiled.n_regs,
                     "spills": compiled.n_spills,
                     "mma": dict(collections.Counter(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", ptx))),
                     "cvt": dict(collections.Counter(re.findall(r"(cvt\.\S+)", ptx)).most_common(6))})
        print(dtype, config, f"registers {compiled.n_regs} spills {compiled.n_spills}")
        print("   mma:", rows[-1]["mma"])
        print("   cvt:", rows[-1]["cvt"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=4096)
    add_output_arguments(parser, "inspect_triton_gemm")
    args = parser.parse_args()
    print(machine())
    rows = [row for dtype in (torch.float8_e4m3fn, torch.int8) for row in inspect(args.m, dtype)]
    print(f"wrote {write(out_path(args, 'inspect_triton_gemm'), rows)}")


if __name__ == "__main__":
    main()
