"""The Triton template qfuse puts in Inductor's code, beside the eager kernel it shares its main loop with (GPU).

    python benchmarks/explorations/template_code.py [--quick] [--out FILE.json]

Compiles the int8 reference-form linear (M = 4096, N = 14336, K = 4096; --quick: M = N = K = 1024)
with backend="qfuse", writes the generated code beside the JSON (<out stem>_generated_code.txt), and
prints for every Triton kernel Inductor compiled and for the eager kernel: registers, spills, and the
count of wgmma (Hopper warp-group MMA) / mma.sync instructions in the PTX. Writes template_code.json.
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
from torch._inductor.codecache import PyCodeCache
from torch._inductor.utils import run_and_get_code

from gpu_linear import QuantLinear
from qfuse.bench import add_output_arguments, machine, out_path, write
from qfuse.kernels.triton import scaled_mm as triton_mm


def describe(name: str, binary) -> dict:
    ptx = getattr(binary, "asm", {}).get("ptx", "")
    ops = dict(collections.Counter(re.findall(r"\b(wgmma\.mma_async\S*|mma\.sync\S*)", ptx)))
    print(f"{name}: regs {binary.n_regs}, spills {binary.n_spills}, {ops}")
    return {"kernel": name, "registers": binary.n_regs, "spills": binary.n_spills, "mma": ops}


def inductor_kernels() -> list[dict]:
    """Every Triton kernel in the modules Inductor generated in this process."""
    return [describe(f"inductor {name}", result.kernel)
            for module in list(PyCodeCache.modules) for name, value in vars(module).items()
            for result in getattr(value, "compile_results", []) or []]


def eager_kernels(m: int, n: int, k: int) -> list[dict]:
    a = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    triton_mm.triton_scaled_mm(a, w.t(), torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda"), None, torch.bfloat16)
    return [describe("eager _scaled_mm_kernel", kernel) for kernel in triton_mm._scaled_mm_kernel.device_caches[0][0].values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "template_code", quick="M = N = K = 1024")
    args = parser.parse_args()
    out = out_path(args, "template_code")
    m, n, k = (1024, 1024, 1024) if args.quick else (4096, 14336, 4096)
    torch._inductor.config.use_static_cuda_launcher = False  # keep the compiled kernels' PTX
    print(machine())
    model = QuantLinear(n, k, torch.int8)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(model, backend="qfuse"), x)
    rows = inductor_kernels() + eager_kernels(m, n, k)
    write(out, rows, m=m, n=n, k=k)
    code_path = out.with_name(f"{out.stem}_generated_code.txt")
    code_path.write_text("\n".join(code))
    print(f"wrote {out} and {code_path}")


if __name__ == "__main__":
    main()
