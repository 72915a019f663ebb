"""The CUDA W4A16 decode kernel (`qfuse.kernels.cuda.int4_mma`) per linear, against the bf16 matmul, ATen's
tinygemm and qfuse's nibble-plane Triton template, in one run; and its numerics against eager.

    python benchmarks/gpu_int4_mma.py [--ms 1,4,8,16] [--quick] [--out FILE.json]

GPU time per linear from one CUDA graph over a stack of weights past the L2 (`graph_ms_per_call`), µs;
each kernel called as the op's eager path calls it (tinygemm and the planes also with their own launch
and, for the planes, the activation's plane copy). Achieved bandwidth: the int4 weight's bytes (words,
bf16 scales and zero points) / GPU time, against the copy bandwidth measured in the same run (a 1 GiB
device-to-device copy: bytes read + written / time).
"""

from __future__ import annotations

import argparse

import torch

from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, machine, out_path, progress, write
from qfuse.kernels import int4_tinygemm
from qfuse.kernels.cuda.int4_mma import int4_mma, repack, why_not_launch
from qfuse.kernels.int4_words import pack_int4
from qfuse.kernels.triton.int4_planes import triton_int4_planes_mm
from qfuse.kernels.triton.scaled_mm import multiprocessors

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # N x K: Llama-3-8B's q / o, gate / up, down
GROUP = 128
STACK_BYTES = 192 * 2**20  # the weights of one graph: several times the 50 MB L2
DECODER_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # q/k/v joined, o, gate/up joined, down
VARIANTS = [(4, 4), (8, 4), (16, 4), (4, 8), (8, 8), (16, 2)]  # (warps a block, chunks a warp loads ahead)


def stack_size(weight_bytes: int) -> int:
    """How many weights of `weight_bytes` one graph cycles through: past the L2, 2 to 16 of them."""
    return max(2, min(16, STACK_BYTES // weight_bytes))


def copy_bandwidth() -> float:
    """Bytes a second of a 1 GiB device-to-device copy, read and written counted."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = graph_ms_per_call([lambda: dst.copy_(src)]) / 1e3
    return 2 * src.numel() / seconds


class Int4Weight:
    """One random W4A16 weight (g128, bf16 scales, zero points or the offset 8) in each kernel's layout."""

    def __init__(self, n: int, k: int, zero_points: bool, generator: torch.Generator):
        self.values = torch.randint(-8, 8, (k, n), device="cuda", generator=generator, dtype=torch.int8)
        self.scale = (torch.rand(k // GROUP, n, device="cuda", generator=generator) / (4 * k**0.5)).to(torch.bfloat16)
        self.zero = (torch.randint(-8, 8, (k // GROUP, n), device="cuda", generator=generator, dtype=torch.int8)
                     if zero_points else None)
        self.mma = repack(self.values, self.scale, self.zero)
        self.tinygemm = None if zero_points else int4_tinygemm.pack(self.values, self.scale)
        # the planes' layout: GPTQ's words [N, K / 8] (nibble i at bits 4 i), scales [N, K / g], zero points
        # packed along N [N / 8, K / g] (stored as z + 8: GPTQ's "stored" convention)
        self.words = pack_int4(self.values.t().contiguous())
        self.scales_nk = self.scale.t().contiguous()
        self.zeros_packed = None if self.zero is None else pack_int4(self.zero.contiguous()).t().contiguous()
        self.bytes = n * k // 2 + self.scale.numel() * 2 + (0 if self.zero is None else self.zero.numel() // 2)

    def dequantized(self) -> torch.Tensor:
        group = torch.arange(self.values.shape[0], device="cuda") // GROUP
        zero = 0 if self.zero is None else self.zero.to(torch.int32)[group]
        return (self.values.to(torch.int32) - zero).to(torch.bfloat16) * self.scale[group]  # [K, N]


def candidates(weight: Int4Weight, x: torch.Tensor, sms: int) -> dict:
    calls = {"cuda mma (launch rule)": lambda: int4_mma(x, *weight.mma, None, GROUP, torch.bfloat16)}
    calls.update({f"cuda mma ({warps} warps, unroll {unroll})":
                  lambda shape=(warps, unroll): int4_mma(x, *weight.mma, None, GROUP, torch.bfloat16, shape)
                  for warps, unroll in VARIANTS if not why_not_launch(x.shape[0], warps)})
    calls["triton planes"] = lambda: triton_int4_planes_mm(x, weight.words, None, weight.scales_nk, weight.zeros_packed,
                                                           None, GROUP, torch.bfloat16, sms)
    if weight.tinygemm is not None:
        calls["tinygemm"] = lambda: int4_tinygemm.int4pack_mm(x, weight.tinygemm, None, torch.bfloat16)
    return calls


def timed_rows(times: dict, errors: dict, weight_bytes: int, bandwidth: float, **case) -> list[dict]:
    """A row a kernel of `times` (µs, "bf16 mm" among them): the case's fields, its time, its ratio to the bf16
    matmul, its error, and (not for bf16) the weight's bytes over its time as a share of `bandwidth`."""
    rows = []
    for name, us in times.items():
        row = dict(**case, kernel=name, gpu_us=round(us, 2), vs_bf16=round(times["bf16 mm"] / us, 2),
                   rel_error=errors.get(name))
        if name != "bf16 mm":
            row["hbm_fraction"] = round(weight_bytes / (us * 1e-6) / bandwidth, 3)
        rows.append(row)
    return rows


def run(ms, shapes, zero_points_options) -> list[dict]:
    torch.manual_seed(0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    sms = multiprocessors(torch.device("cuda"))
    bandwidth = copy_bandwidth()
    progress(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for zero_points in zero_points_options:
        for n, k in shapes:
            layers = stack_size(n * k // 2)
            weights = [Int4Weight(n, k, zero_points, generator) for _ in range(layers)]
            dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, layers // 4))]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                reference = (x.float() @ weights[0].dequantized().float())
                errors = {name: ((call().float() - reference).norm() / reference.norm()).item()
                          for name, call in candidates(weights[0], x, sms).items()}
                times = {name: graph_ms_per_call([candidates(weight, x, sms)[name] for weight in weights]) * 1e3
                         for name in errors}
                times["bf16 mm"] = graph_ms_per_call([lambda w=w: x @ w.t() for w in dense]) * 1e3
                rows += timed_rows(times, errors, weights[0].bytes, bandwidth, n=n, k=k, m=m, zero_points=zero_points)
                progress(f"N={n} K={k} M={m} zp={zero_points}: " + ", ".join(f"{name} {us:.1f}" for name, us in times.items()))
            del weights, dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,4,8,16")
    add_output_arguments(parser, "gpu_int4_mma", quick="one shape, M = 1 and 16, symmetric")
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    shapes, zero_points = (SHAPES[1:2], (False,)) if args.quick else (SHAPES, (False, True))
    rows = run([1, 16] if args.quick else ms, shapes, zero_points)
    header = ["n", "k", "m", "zero_points", "kernel", "gpu_us", "vs_bf16", "hbm_fraction", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_mma"), rows, machine=machine())


if __name__ == "__main__":
    main()
