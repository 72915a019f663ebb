"""Does the all-reduce overlap the next GEMM on GPUs, with qfuse's fused linears? (issue #17)

On each rank, `tests/distributed/collectives.ReducedThenSide` at Llama-3-8B sizes on 2 GPUs: a
row-parallel quantized down projection (K = 14336 / 2 -> N = 4096) whose output is all-reduced on
NCCL, plus a quantized 4096 -> 4096 linear that does not depend on the all-reduce, bf16, M rows.
Compiled by Inductor and by qfuse, with Inductor's `reorder_for_compute_comm_overlap` off and on,
it records per variant:

    order         the GEMMs (extern calls and Triton template launches), the all-reduce and its
                  wait, as the generated code issues them
    per_call_us   one call, warm (the harness's `time_call`)
    nccl_us       the NCCL kernels' GPU time per call (torch.profiler, 20 calls)
    overlap_us    the part of it during which a compute kernel ran on the GPU too

    torchrun --nproc-per-node 2 benchmarks/explorations/gpu_collective_overlap.py [--schemes int8,fp8] [--ms 1024,4096] [--out FILE.json]
    python benchmarks/explorations/gpu_collective_overlap.py --table FILE.json      (the markdown table)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

import qfuse
from gpu_tensor_parallel import nccl_process_group
from qfuse.bench import add_output_arguments, format_table, out_path, progress, time_call, warm, write

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.distributed
from tests.distributed.collectives import ReducedThenSide, compile_with_order  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 14336
BACKENDS = ("inductor", "qfuse")
PROFILED_CALLS = 20


def covered(interval: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """How much of `interval` lies under the union of `others` (sorted by start)."""
    start, end = interval
    total, reach = 0.0, start
    for other_start, other_end in others:
        if other_end <= reach or other_start >= end:
            continue
        total += min(other_end, end) - max(other_start, reach)
        reach = min(other_end, end)
    return total


def nccl_overlap(fn, *inputs) -> tuple[float, float]:
    """(NCCL µs, µs of it overlapped by compute kernels), per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(PROFILED_CALLS):
            fn(*inputs)
        torch.cuda.synchronize()
    kernels = [event for event in profile.events() if event.device_type == DeviceType.CUDA]
    nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = sorted((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower())
    return (sum(end - start for start, end in nccl) / PROFILED_CALLS,
            sum(covered(interval, compute) for interval in nccl) / PROFILED_CALLS)


def case_rows(scheme: str, m: int, world: int) -> list[dict]:
    model = ReducedThenSide(scheme, dist.group.WORLD, INTERMEDIATE // world, HIDDEN, torch.bfloat16).cuda()
    h = torch.randn(m, INTERMEDIATE // world, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    for reorder in (False, True):
        for backend in BACKENDS:
            with torch._inductor.config.patch(reorder_for_compute_comm_overlap=reorder), torch.no_grad():
                marker = qfuse.graphs_compiled()
                fn, order = compile_with_order(model, backend, h, x)
                warm(fn, h, x)
                nccl_us, overlap_us = nccl_overlap(fn, h, x)
                records = [record for report in qfuse.reports_since(marker) for record in report.records]
                rows.append({"scheme": scheme, "m": m, "reorder": reorder, "backend": backend, "order": order,
                             "fused": f"{sum(r.fused for r in records)}/{len(records)}" if backend == "qfuse" else "",
                             "nccl_us": nccl_us, "overlap_us": overlap_us, **time_call(fn, h, x)})
    return rows


def table(rows: list[dict]) -> str:
    lines = [[row["scheme"], row["m"], "on" if row["reorder"] else "off", row["backend"], row["fused"],
              " ".join(row["order"]), f"{row['per_call_us']:.1f}", f"{row['nccl_us']:.1f}", f"{row['overlap_us']:.1f}"]
             for row in rows]
    header = ["scheme", "M", "comm reordering", "backend", "fused", "order in the generated code", "per call µs",
              "NCCL µs", "overlapped µs"]
    return format_table(lines, header, markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="int8,fp8")
    parser.add_argument("--ms", default="1024,4096")
    parser.add_argument("--table", metavar="FILE.json", help="print the table of a result file and exit")
    add_output_arguments(parser, "gpu_collective_overlap")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["rows"]))
        return
    with nccl_process_group() as (rank, world):
        rows = []
        for scheme in args.schemes.split(","):
            for m in (int(m) for m in args.ms.split(",")):
                progress(f"rank {rank}/{world} {scheme} M={m}")
                rows += case_rows(scheme, m, world)
        if rank == 0:
            print(table(rows))
            print(f"wrote {write(out_path(args, 'gpu_collective_overlap'), rows)}", flush=True)


if __name__ == "__main__":
    main()
