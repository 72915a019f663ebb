"""A tensor-parallel quantized Llama MLP block on the GPU: qfuse against Inductor on the same shard.

Each rank runs its shard of `tests/distributed/tp_models.TensorParallelMlp` (hidden 4096,
intermediate 14336 / world: gate / up column-parallel, down row-parallel, a functional all-reduce on
NCCL), int8 or fp8 W8A8 in the reference form, bf16 activations, and measures per rank, at each M:

    inductor, qfuse                                  default mode (no CUDA graphs)
    inductor:reduce-overhead, qfuse:reduce-overhead   CUDA graphs

(per call / GPU / host µs, `benchmarks/gpu_linear.measure`, which also checks qfuse's result
against eager). With one process (world 1, the all-reduce a no-op on one GPU) it runs without
torchrun; on a multi-GPU machine: `torchrun --nproc-per-node 2 benchmarks/gpu_tensor_parallel.py`.

    python benchmarks/gpu_tensor_parallel.py [--schemes int8,fp8] [--ms 16,1024,4096] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from gpu_linear import measure
from qfuse.bench import add_output_arguments, format_table, out_path, progress, write
from qfuse.platform import CUDA_INT_MM_MIN_ROWS
from tests.distributed.tp_models import TensorParallelMlp, float_mlp

HIDDEN, INTERMEDIATE = 4096, 14336
VARIANTS = ("inductor", "qfuse", "inductor:reduce-overhead", "qfuse:reduce-overhead")


def init_process_group() -> tuple[int, int]:
    """(rank, world): torchrun's, or a one-process group on a file store."""
    if "RANK" in os.environ:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return rank, world


def case_rows(scheme: str, m: int, rank: int, world: int) -> list[dict]:
    if scheme == "int8":  # the reference form's torch._int_mm needs M > 16 on CUDA (cuBLAS): decode runs at 17
        m = max(m, CUDA_INT_MM_MIN_ROWS)
    floats = float_mlp(HIDDEN, INTERMEDIATE).cuda()
    block = TensorParallelMlp(floats, scheme, rank, world, dist.group.WORLD).cuda()
    del floats
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    label = {"scheme": scheme, "m": m, "world": world, "rank": rank}
    with torch.no_grad():
        expected = block(x)
        return [label | measure(block, x, variant, expected) for variant in VARIANTS]


def table(rows: list[dict]) -> str:
    lines = []
    for scheme, m in dict.fromkeys((row["scheme"], row["m"]) for row in rows):
        by_variant = {row["variant"]: row for row in rows if (row["scheme"], row["m"]) == (scheme, m)}

        def cell(name):
            row = by_variant[name]
            return " / ".join(f"{row[key]:.1f}" if row.get(key) else "-" for key in ("per_call_us", "gpu_us", "host_us"))

        def ratio(baseline, ours):
            return f"{by_variant[baseline]['per_call_us'] / by_variant[ours]['per_call_us']:.2f}x"

        lines.append([scheme, m, *(cell(name) for name in VARIANTS), by_variant["qfuse"].get("fused", ""),
                      ratio("inductor", "qfuse"), ratio("inductor:reduce-overhead", "qfuse:reduce-overhead")])
    return format_table(lines, ["scheme", "M", *(f"{name} (per call / GPU / host µs)" for name in VARIANTS), "fused",
                                "vs inductor", "vs inductor (CUDA graphs)"], markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="int8,fp8")
    parser.add_argument("--ms", default="16,1024,4096")
    add_output_arguments(parser, "gpu_tensor_parallel")
    args = parser.parse_args()
    rank, world = init_process_group()
    rows, out = [], out_path(args, f"gpu_tensor_parallel_rank{rank}")
    try:
        for scheme in args.schemes.split(","):
            for m in (int(m) for m in args.ms.split(",")):
                progress(f"rank {rank}/{world} {scheme} M={m}")
                rows += case_rows(scheme, m, rank, world)
                write(out, rows)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
