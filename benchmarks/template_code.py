"""The Triton template qfuse puts in Inductor's code, beside the eager kernel it shares its main loop with (GPU).

    python benchmarks/template_code.py [--out DIR]

Compiles the int8 reference-form linear (M = 4096, N = 14336, K = 4096) with backend="qfuse", writes
the generated code, and prints for every Triton kernel Inductor compiled and for the eager kernel:
registers, spills, and the count of wgmma (Hopper warp-group MMA) / mma.sync instructions in the PTX.
"""

import argparse
import collections
import os
import re
from pathlib import Path

import torch
from torch._inductor.codecache import PyCodeCache
from torch._inductor.utils import run_and_get_code

from gpu_linear import QuantLinear
from qfuse.kernels.triton import scaled_mm as triton_mm


def describe(name, binary):
    ptx = getattr(binary, "asm", {}).get("ptx", "")
    ops = collections.Counter(re.findall(r"\b(wgmma\.mma_async\S*|mma\.sync\S*)", ptx))
    print(f"{name}: regs {binary.n_regs}, spills {binary.n_spills}, {dict(ops)}")


torch._inductor.config.use_static_cuda_launcher = False  # keep the compiled kernels' PTX
parser = argparse.ArgumentParser()
parser.add_argument("--out", default=os.environ.get("OUT", "."))
out = Path(parser.parse_args().out)
model = QuantLinear(14336, 4096, torch.int8)
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    _, code = run_and_get_code(torch.compile(model, backend="qfuse"), x)
(out / "qfuse_int8_linear.py").write_text("\n".join(code))
for module in list(PyCodeCache.modules):
    for name, value in vars(module).items():
        for result in getattr(value, "compile_results", []) or []:
            describe(f"inductor {name}", result.kernel)
a = torch.randint(-127, 128, (4096, 4096), device="cuda", dtype=torch.int8)
w = torch.randint(-127, 128, (14336, 4096), device="cuda", dtype=torch.int8)
triton_mm.triton_scaled_mm(a, w.t(), torch.ones(4096, 1, device="cuda"), torch.ones(1, 14336, device="cuda"), None, torch.bfloat16)
for kernel in triton_mm._scaled_mm_kernel.device_caches[0][0].values():
    describe("eager _scaled_mm_kernel", kernel)
