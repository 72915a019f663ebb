"""Tensor-parallel quantized Llama models on the GPU: qfuse against Inductor on the same shard.

Each rank runs its shard, int8 or fp8 W8A8 in the reference form, bf16 activations, of
- "mlp": `tests/distributed/tp_models.TensorParallelMlp` (hidden 4096, intermediate 14336 / world:
  gate / up column-parallel, down row-parallel, a functional all-reduce on NCCL) on [M, 4096];
- "llama": `tests/distributed/tp_models.tensor_parallel_llama`, the two-layer HF Llama at Llama-3-8B
  layer sizes (hidden 4096, intermediate 14336, 32 heads, 8 KV heads; vocab 32000), whole heads per
  rank, an all-reduce after o_proj and down_proj, on input_ids [1, M], its logits;
each sharded by hand on functional collectives ("funcol") or by `parallelize_module` on DTensors
("dtensor": int8 only, docs/distributed.md says why not fp8), and measures per rank, at each M:

    inductor, qfuse                                  default mode (no CUDA graphs)
    inductor:reduce-overhead, qfuse:reduce-overhead   CUDA graphs

(per call / GPU / host µs, `benchmarks/gpu_linear.measure`, which also checks qfuse's result
against eager). With one process (world 1, the all-reduce a no-op on one GPU) it runs without
torchrun; on a multi-GPU machine: `torchrun --nproc-per-node 2 benchmarks/gpu_tensor_parallel.py`
(each rank writes FILE_world2_rank<r>.json).

    python benchmarks/gpu_tensor_parallel.py [--models mlp,llama] [--schemes int8,fp8] [--shardings funcol,dtensor]
                                             [--ms 16,1024,4096] [--out FILE.json]
    python benchmarks/gpu_tensor_parallel.py --table FILE.json [FILE.json ...]   (the markdown table)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from gpu_linear import measure
from qfuse.bench import add_output_arguments, format_table, out_path, progress, write
from qfuse.platform import CUDA_INT_MM_MIN_ROWS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.distributed
from tests.distributed.tp_models import (SHARDINGS, TensorParallelMlp, dtensor_llama, dtensor_mlp,  # noqa: E402
                                        float_mlp, tensor_parallel_llama)

HIDDEN, INTERMEDIATE = 4096, 14336
LLAMA_SIZES = {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 32000}
VARIANTS = ("inductor", "qfuse", "inductor:reduce-overhead", "qfuse:reduce-overhead")


@contextlib.contextmanager
def nccl_process_group():
    """(rank, world) on NCCL: torchrun's group, or a one-process group on a file store; each rank on
    its own GPU. Torn down on exit: the CUDA graphs of mode="reduce-overhead" hold NCCL work, and
    destroying the process group while they live hangs (pytorch/pytorch#115388, docs/distributed.md),
    so the compiled code is freed first."""
    if "RANK" in os.environ:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        yield rank, world
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


class Logits(nn.Module):
    """The HF model's logits, so that a call returns a tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits


def sharded_model(model: str, scheme: str, sharding: str, m: int, rank: int,
                  world: int) -> tuple[nn.Module, torch.Tensor]:
    """(this rank's shard on the GPU, its input of M tokens)."""
    mesh = init_device_mesh("cuda", (world,)) if sharding == "dtensor" else None
    if model == "llama":
        if mesh is not None:
            llama, input_ids = dtensor_llama(scheme, mesh, seq=m, dtype=torch.bfloat16, **LLAMA_SIZES)
        else:
            llama, input_ids = tensor_parallel_llama(scheme, rank, world, dist.group.WORLD, seq=m,
                                                     dtype=torch.bfloat16, **LLAMA_SIZES)
        return Logits(llama).cuda(), input_ids.cuda()
    floats = float_mlp(HIDDEN, INTERMEDIATE).cuda()
    block = (dtensor_mlp(floats, scheme, mesh) if mesh is not None
             else TensorParallelMlp(floats, scheme, rank, world, dist.group.WORLD).cuda())
    return block, torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)


def case_rows(model: str, scheme: str, sharding: str, m: int, rank: int, world: int) -> list[dict]:
    if scheme == "int8":  # the reference form's torch._int_mm needs M > 16 on CUDA (cuBLAS): decode runs at 17
        m = max(m, CUDA_INT_MM_MIN_ROWS)
    shard, x = sharded_model(model, scheme, sharding, m, rank, world)
    label = {"model": model, "scheme": scheme, "sharding": sharding, "m": m, "world": world, "rank": rank}
    with torch.no_grad():
        expected = shard(x)
        return [label | measure(shard, x, variant, expected) for variant in VARIANTS]


def case_of(row: dict) -> tuple:
    return row["world"], row["rank"], row.get("model", "mlp"), row.get("sharding", "funcol"), row["scheme"], row["m"]


def table(rows: list[dict]) -> str:
    lines = []
    for case in sorted(dict.fromkeys(case_of(row) for row in rows)):
        by_variant = {row["variant"]: row for row in rows if case_of(row) == case}

        def cell(name):
            row = by_variant[name]
            return " / ".join(f"{row[key]:.1f}" if row.get(key) else "-" for key in ("per_call_us", "gpu_us", "host_us"))

        def ratio(baseline, ours):
            return f"{by_variant[baseline]['per_call_us'] / by_variant[ours]['per_call_us']:.2f}x"

        lines.append([*case, *(cell(name) for name in VARIANTS), by_variant["qfuse"].get("fused", ""),
                      ratio("inductor", "qfuse"), ratio("inductor:reduce-overhead", "qfuse:reduce-overhead")])
    header = ["world", "rank", "model", "sharding", "scheme", "M", *(f"{name} (per call / GPU / host µs)" for name in VARIANTS),
              "fused", "vs inductor", "vs inductor (CUDA graphs)"]
    return format_table(lines, header, markdown=True)


def rank_path(path: Path, rank: int, world: int) -> Path:
    """Each rank's own result file: FILE_world2_rank1.json beside FILE.json (FILE.json itself at world 1)."""
    path = Path(path)
    return path if world == 1 else path.with_name(f"{path.stem}_world{world}_rank{rank}{path.suffix}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,llama")
    parser.add_argument("--schemes", default="int8,fp8")
    parser.add_argument("--shardings", default="funcol")
    parser.add_argument("--table", nargs="+", metavar="FILE.json", help="print the table of result files and exit")
    parser.add_argument("--ms", default="16,1024,4096")
    add_output_arguments(parser, "gpu_tensor_parallel")
    args = parser.parse_args()
    if args.table:
        print(table([row for name in args.table for row in json.loads(Path(name).read_text())["rows"]]))
        return
    if unknown := set(args.shardings.split(",")) - set(SHARDINGS):
        parser.error(f"unknown sharding {sorted(unknown)}; choose from {SHARDINGS}")
    if "dtensor" in args.shardings.split(",") and "fp8" in args.schemes.split(","):
        parser.error("fp8 does not run sharded on DTensors (DTensor's _scaled_mm rule, docs/distributed.md): "
                     "--shardings dtensor takes --schemes int8")
    with nccl_process_group() as (rank, world):
        rows, out = [], rank_path(out_path(args, "gpu_tensor_parallel"), rank, world)
        for model in args.models.split(","):
            for sharding in args.shardings.split(","):
                for scheme in args.schemes.split(","):
                    for m in (int(m) for m in args.ms.split(",")):
                        progress(f"rank {rank}/{world} {model} {sharding} {scheme} M={m}")
                        rows += case_rows(model, scheme, sharding, m, rank, world)
                        write(out, rows)
        if rank == 0:
            print(table(rows))
        print(f"wrote {out}", flush=True)

if __name__ == "__main__":
    main()
