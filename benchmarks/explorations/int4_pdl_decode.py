"""The CUDA W4A16 decode kernel launched with programmatic dependent launch (an exploration, issue #38).

    python benchmarks/explorations/int4_pdl_decode.py [--ms 1,16] [--shapes 28672x4096,...] [--out F.json]

In a decode step every quantized linear follows a small kernel of Inductor's (the RMSNorm before q / k / v and
gate / up, the SiLU-mul before down, the attention before o), and a 10-60 MB weight read pays a launch, a ramp and a
tail that a long read amortizes (docs/benchmarks.md, "The int4 decode kernel's stream"). Launched with Hopper's
programmatic stream serialization, the kernel's blocks may start once the kernel before has ended its blocks (or
called `griddepcontrol.launch_dependents`: Inductor's Triton kernels do with `triton.enable_pdl`), and wait with
`griddepcontrol.wait` first thing (`launch.launch_programmatic`, which the kernel takes while a CUDA graph is
captured). A variant that issued its first chunks' weight loads before the wait measured within 1-4% of waiting
first, either way (session 40), and is not kept: a kernel just before may have written the weight.

GPU µs per pair (Inductor's compiled RMSNorm of a residual row, then the linear on it) in one CUDA graph over
weights past the L2, best of three rounds in turns; the norm alone and the linear alone beside them; every
variant's output compared with the plain launch's (bit for bit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from gpu_int4_mma import DECODER_SHAPES, GROUP, Int4Weight, stack_size  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, graph_us_in_turns, machine, out_path, progress, write  # noqa: E402
from qfuse.kernels.cuda import int4_mma, launch  # noqa: E402


def rmsnorm(residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = residual.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(residual.dtype) * weight


def linear_call(m: int, n: int, k: int, programmatic: bool):
    """A function (x, weight) -> out of the launch rule's kernel, launched plainly or programmatically."""
    warps, unroll = int4_mma.launch_shape(m, n, k)
    kernel = int4_mma._compiled(torch.bfloat16, int4_mma.column_tiles(m), warps, unroll, int4_mma.group_shift(k, GROUP),
                                False, 0)

    def call(x, weight: Int4Weight):
        words, pairs = weight.mma
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        arguments = (words, x, pairs, pairs, out, m, n, k, 0)
        if programmatic:
            launch.launch_programmatic(kernel, n // 16, warps, arguments, torch.cuda.current_stream().cuda_stream)
        else:
            torch._C._StaticCudaLauncher._launch_kernel(kernel.function, n // 16, 1, 1, warps, 0, kernel.argument_types,
                                                         arguments, torch.cuda.current_stream().cuda_stream)
        return out
    return call


def run(ms: list[int], shapes) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    norms = {"inductor": torch.compile(rmsnorm), "inductor pdl": torch.compile(rmsnorm, options={"triton.enable_pdl": True})}
    rows = []
    for n, k in shapes:
        weights = [Int4Weight(n, k, False, generator) for _ in range(stack_size(n * k // 2))]
        norm_weight = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            residuals = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in weights]
            xs = [norms["inductor"](r, norm_weight) for r in residuals]
            variants = {  # name: (norm, programmatic launch)
                "plain": ("inductor", False),
                "pdl linear": ("inductor", True),
                "inductor pdl norm, plain linear": ("inductor pdl", False),
                "inductor pdl norm, pdl linear": ("inductor pdl", True),
            }
            plain = linear_call(m, n, k, False)
            calls, references = {}, {}
            for name, (norm, programmatic) in variants.items():
                linear = linear_call(m, n, k, programmatic)
                x = norms[norm](residuals[0], norm_weight)
                out = linear(x, weights[0])
                torch.cuda.synchronize()
                references.setdefault(norm, (x, plain(x, weights[0])))
                if not torch.equal(out, references[norm][1]):  # (each norm's own x: the two compiles may round apart)
                    raise AssertionError(f"{name}: output differs from the plain launch's at N={n} K={k} M={m}")
                calls[name] = [lambda r=r, w=w, linear=linear, norm=norms[norm]: linear(norm(r, norm_weight), w)
                               for r, w in zip(residuals, weights)]
            apart = (references["inductor"][0].float() - references["inductor pdl"][0].float()).abs().max().item()
            progress(f"N={n} K={k} M={m}: the two norms' x differ by {apart:.3g} at most")
            calls["linear alone"] = [lambda x=x, w=w: plain(x, w) for x, w in zip(xs, weights)]
            calls["norm alone"] = [lambda r=r: norms["inductor"](r, norm_weight) for r in residuals]
            calls["inductor pdl norm alone"] = [lambda r=r: norms["inductor pdl"](r, norm_weight) for r in residuals]
            times = graph_us_in_turns(calls)
            for name, us in times.items():
                rows.append(dict(n=n, k=k, m=m, variant=name, us=round(us, 2), vs_plain=round(times["plain"] / us, 3)))
            progress(f"N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.2f}" for name, us in times.items()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,16", help="rows of x, comma-separated")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in DECODER_SHAPES), help="N x K, comma-separated")
    add_output_arguments(parser, "gpu_int4_pdl_decode")
    args = parser.parse_args()
    shapes = [tuple(int(size) for size in shape.split("x")) for shape in args.shapes.split(",")]
    rows = run([int(m) for m in args.ms.split(",")], shapes)
    header = ["n", "k", "m", "variant", "us", "vs_plain"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_pdl_decode"), rows, machine=machine())


if __name__ == "__main__":
    main()
