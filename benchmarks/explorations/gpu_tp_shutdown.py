"""Does a tensor-parallel rank exit after CUDA graphs captured its all-reduce? (docs/distributed.md)

Each rank compiles the int8 TP MLP block with backend="qfuse" in default mode and with
mode="reduce-overhead", runs it, then times `dist.destroy_process_group()`, with or without
`torch._dynamo.reset()` first (pytorch/pytorch#115388: the captured graphs hold NCCL work).

    torchrun --nproc-per-node 2 benchmarks/explorations/gpu_tp_shutdown.py [--reset] [--set-device-first]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.distributed
from tests.distributed.tp_models import TensorParallelMlp, float_mlp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reset", action="store_true", help="torch._dynamo.reset() before destroying the group")
    parser.add_argument("--set-device-first", action="store_true",
                        help="torch.cuda.set_device, then init_process_group(device_id=...)")
    args = parser.parse_args()
    start = time.time()
    local = int(os.environ["LOCAL_RANK"])
    if args.set_device_first:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(local)
    rank, world = dist.get_rank(), dist.get_world_size()
    block = TensorParallelMlp(float_mlp(hidden=256, intermediate=512), "int8", rank, world, dist.group.WORLD).cuda()
    x = torch.randn(32, 256, device="cuda")
    with torch.no_grad():
        for mode in (None, "reduce-overhead"):
            compiled = torch.compile(block, backend="qfuse", mode=mode)
            for _ in range(3):
                compiled(x)
    torch.cuda.synchronize()
    print(f"rank {rank}: ran in {time.time() - start:.1f} s", flush=True)
    start = time.time()
    if args.reset:
        torch._dynamo.reset()
    dist.destroy_process_group()
    print(f"rank {rank}: destroy_process_group returned in {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
