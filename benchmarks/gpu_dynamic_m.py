"""One compiled model, every M: qfuse and Inductor with a dynamic M, as a serving loop runs them.

A server compiles its model once with the batch (M) dynamic and calls it at decode sizes and at
prefill sizes. qfuse picks a kernel and a tile per M bucket, the bucket guarded
(`qfuse.lowerings.ir.rows_at_most`), so the first M a compile sees no longer decides the kernel of
every later M. Here each model is compiled with M marked dynamic at a first M (16: decode first, or
4096: prefill first), then called at every M of `--ms`; each call is timed per call and for its
host time (`qfuse.bench.time_call`) and its GPU time (`gpu_time`, one CUDA graph of calls), beside
the same model compiled by qfuse for that M alone (static). `graphs` counts the compiles so far.

    python benchmarks/gpu_dynamic_m.py [--models int8-mlp,fp8-mlp,gptq] [--ms 16,1024,4096] [--quick] [--out FILE.json]
    python benchmarks/gpu_dynamic_m.py --table FILE.json

Models: the Llama MLP block of `gpu_linear` (int8 and fp8 W8A8, hidden 4096, intermediate 14336)
and a GPTQ W4A16 linear of `gpu_weight_only` (N = 14336, K = 4096, groups of 128).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch._dynamo.utils import counters

from gemm_cases import FP8
from gpu_linear import LlamaMLP
from gpu_weight_only import GptqLinear
from qfuse.bench import add_output_arguments, format_table, gpu_time, out_path, progress, relative_error, time_call, warm, write

FIRST_MS = (16, 4096)


def make_model(name: str):
    if name == "gptq":
        return GptqLinear(14336, 4096, torch.Generator(device="cuda").manual_seed(0)).eval(), 4096
    dtype = {"int8-mlp": torch.int8, "fp8-mlp": FP8}[name]
    return LlamaMLP(dtype).eval(), 4096


def timed(fn, x, expected) -> dict:
    out = warm(fn, x)
    return {"error": relative_error(out, expected), **time_call(fn, x), "gpu_us": gpu_time(fn, x)}


def dynamic_rows(model, k: int, backend: str, first_m: int, ms: list[int]) -> list[dict]:
    """Compile once with M dynamic from `first_m`, then time every M."""
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(model, backend=backend)
    first = torch.randn(first_m, k, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(first, 0)
    warm(fn, first, times=1)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = timed(fn, x, model(x))
        rows.append({"m": m, "variant": f"{backend} dynamic, first M {first_m}", **row,
                     "graphs": counters["stats"]["unique_graphs"]})
    return rows


def static_row(model, k: int, m: int) -> dict:
    torch._dynamo.reset()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return {"m": m, "variant": "qfuse static", **timed(torch.compile(model, backend="qfuse"), x, model(x))}


def model_rows(name: str, ms: list[int]) -> list[dict]:
    model, k = make_model(name)
    rows = []
    with torch.no_grad():
        for backend in ("inductor", "qfuse"):
            for first_m in FIRST_MS:
                progress(f"{name} {backend} dynamic, first M {first_m}")
                rows += dynamic_rows(model, k, backend, first_m, ms)
        for m in ms:
            progress(f"{name} qfuse static M={m}")
            rows.append(static_row(model, k, m))
    return [{"model": name, **row} for row in rows]


def table(path: str) -> str:
    """Per model and M: each variant's per call / GPU / host µs, and qfuse dynamic against Inductor
    dynamic (same first M) and against qfuse static, per call."""
    rows = json.loads(open(path).read())["rows"]
    cases = defaultdict(dict)
    for row in rows:
        cases[(row["model"], row["m"])][row["variant"]] = row
    names = sorted({row["variant"] for row in rows})

    def cell(row):
        if row is None:
            return ""
        return f"{row['per_call_us']:.0f} / {row['gpu_us']:.0f} / {row['host_us']:.0f}" if row.get("gpu_us") else \
            f"{row['per_call_us']:.0f} / - / {row['host_us']:.0f}"

    def ratio(case, numerator, denominator):
        if numerator in case and denominator in case:
            return f"{case[numerator]['per_call_us'] / case[denominator]['per_call_us']:.2f}x"
        return ""

    lines = []
    for (model, m), case in cases.items():
        versus = [ratio(case, f"inductor dynamic, first M {first}", f"qfuse dynamic, first M {first}") for first in FIRST_MS]
        static = [ratio(case, "qfuse static", f"qfuse dynamic, first M {first}") for first in FIRST_MS]
        lines.append([f"{model} M={m}", *(cell(case.get(name)) for name in names), " / ".join(versus), " / ".join(static)])
    header = ["case", *names, "vs inductor dynamic (first M 16 / 4096)", "static / dynamic (first M 16 / 4096)"]
    return format_table(lines, header, markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="int8-mlp,fp8-mlp,gptq")
    parser.add_argument("--ms", default="16,1024,4096")
    parser.add_argument("--table", default=None, help="print the markdown table of a result file and stop")
    add_output_arguments(parser, "gpu_dynamic_m", quick="the GPTQ linear at M in {16, 1024}")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    models, ms = ("gptq", "16,1024") if args.quick else (args.models, args.ms)
    ms = [int(m) for m in ms.split(",")]
    rows = []
    for name in models.split(","):
        rows += model_rows(name, ms)
        write(out_path(args, "gpu_dynamic_m"), rows)
    print(table(str(out_path(args, "gpu_dynamic_m"))))


if __name__ == "__main__":
    main()
