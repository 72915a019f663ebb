"""CPU benchmark for issue #42 item 4: int4 weights with zero points (AWQ) and bf16 / fp16 / float32 activations.

    python benchmarks/cpu_int4_zero_points.py [--m 1 16 64] [--shape 4096x4096] [--runs 10] [--dtypes bf16,fp16,fp32]
        [--kernel torch] [--out FILE.json]

The linear is AutoAWQ's GEMM checkpoint form dequantized in torch (`tests.peers.weight_only_models.awq_int4`:
qweight / qzeros int32 packed along N in AWQ's order, w = (q - z) * s rounded to the activation's dtype, then
a matmul), group 128, with a bias. Timed in turns, wall clock, in one process (`qfuse.bench.time_in_turns`):
eager; `torch.compile` (Inductor: the weight dequantized on every call, then a GEMM in x's dtype); the same with
backend="qfuse" (`qfuse::int4_weight_only_mm` on the `torch` kernel: qfuse's own C++ kernel with zero points,
`qfuse.kernels.cpu.int4_zero_points`). Each row: the median ms, the ratio to Inductor's time, and the largest
difference from eager's output relative to its largest value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.peers
from tests.peers.weight_only_models import awq_int4  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, machine, out_path, progress, time_in_turns, write  # noqa: E402

GROUP = 128


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def run(ms: list[int], k: int, n: int, runs: int, dtypes: list[torch.dtype], kernel: str | None = None) -> list[dict]:
    rows = []
    for dtype in dtypes:
        model = awq_int4(dtype, group_size=GROUP, in_features=k, out_features=n)
        for m in ms:
            torch._dynamo.reset()
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            candidates = {"eager": model, "inductor": torch.compile(model),
                          "qfuse": torch.compile(model, backend="qfuse", options={"kernel": kernel} if kernel else {})}
            with torch.no_grad():
                expected = model(x).float()
                errors = {name: ((fn(x).float() - expected).abs().max() / expected.abs().max()).item()
                          for name, fn in candidates.items()}
                progress(f"{dtype} M={m}: timing")
                times = time_in_turns({name: (lambda fn=fn: fn(x)) for name, fn in candidates.items()}, runs=runs,
                                      warmup=2)
            for name, timing in times.items():
                rows.append(dict(dtype=str(dtype).removeprefix("torch."), k=k, n=n, group=GROUP, m=m, candidate=name,
                                 median_ms=round(timing.median_ms, 3),
                                 speedup_vs_inductor=round(times["inductor"].median_ms / timing.median_ms, 2),
                                 max_rel_diff_vs_eager=errors[name]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--shape", default="4096x4096", help="K x N")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--dtypes", default="bf16,fp16", help="activation dtypes, of " + ", ".join(DTYPES))
    parser.add_argument("--kernel", default=None, help="force qfuse's kernel (`torch`: its C++ kernel past the rows "
                                                       "where kernel choice leaves the linear to Inductor)")
    add_output_arguments(parser, "cpu_int4_zero_points")
    args = parser.parse_args()
    k, n = (int(value) for value in args.shape.lower().split("x"))
    rows = run(args.m, k, n, args.runs, [DTYPES[name] for name in args.dtypes.split(",")], args.kernel)
    header = ["dtype", "m", "candidate", "median_ms", "speedup_vs_inductor", "max_rel_diff_vs_eager"]
    print(format_table([[row[column] for column in header] for row in rows], header))
    write(out_path(args, "cpu_int4_zero_points"), rows, machine=machine())


if __name__ == "__main__":
    main()
