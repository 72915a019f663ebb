"""Split K in qfuse's W8A8 template at small M: how many programs a multiprocessor to aim for.

Up to `lowerings.triton.template.SPLIT_K_MAX_ROWS` rows the template's few column blocks (N = 4096: 64 to 128
on an H100) each stream the weight down the whole K; `lowerings.triton.template.k_splits` splits K until the
grid holds `SPLIT_K_PROGRAMS_PER_SM` programs a multiprocessor. This script compiles
`gpu_linear.QuantLinear` (the reference-form dynamic per-token linear, int8 and fp8) per M and
shape, with Inductor and with qfuse's `triton` kernel forced (QFUSE_KERNEL: on Hopper fp8 above 16
rows would go to cuBLAS) at several targets (0: K never split, the template as before), and times
each (`gpu_linear.measure`: per call / GPU / host µs). The FX graph cache is off: the target is a
module constant, not part of the cache key. The recorded runs of 2026-11-26 came before fp8's move
to cuBLAS, when the template was the default there too.

    python benchmarks/explorations/gpu_split_k.py [--ms 1,16,32,128] [--targets 0,1,2,4] [--out FILE.json]
    python benchmarks/explorations/gpu_split_k.py --table FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch

from gemm_cases import FP8, SHAPES
from gpu_linear import QuantLinear, measure
from qfuse.bench import add_output_arguments, format_table, out_path, progress, write


def case_rows(dtype, m: int, n: int, k: int, targets: list[float]) -> list[dict]:
    from qfuse.lowerings.triton import template as triton_template

    label = {"dtype": "int8" if dtype == torch.int8 else "fp8", "m": m, "n": n, "k": k}
    model = QuantLinear(n, k, dtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    default = triton_template.SPLIT_K_PROGRAMS_PER_SM
    with torch.no_grad():
        expected = model(x)
        rows = [label | measure(model, x, "inductor", expected)]
        os.environ["QFUSE_KERNEL"] = "triton"
        try:
            for target in targets:
                triton_template.SPLIT_K_PROGRAMS_PER_SM = target
                rows.append(label | measure(model, x, "qfuse", expected) | {"variant": f"qfuse split target {target:g}"})
        finally:
            triton_template.SPLIT_K_PROGRAMS_PER_SM = default
            del os.environ["QFUSE_KERNEL"]
    return rows


def table(rows: list[dict]) -> str:
    cases = defaultdict(dict)
    for row in rows:
        cases[(row["dtype"], row["m"], row["n"], row["k"])][row["variant"]] = row
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    lines = [[f"{dtype} M={m} N={n} K={k}",
              *(f"{mine[v]['per_call_us']:.0f} / {mine[v]['gpu_us']:.1f}" if v in mine else "" for v in variants),
              next((r["lowered"][0] for r in mine.values() if "K split" in str(r.get("lowered"))), "")[:60]]
             for (dtype, m, n, k), mine in cases.items()]
    return format_table(lines, ["case (per call / GPU µs)", *variants, "split lowering"], markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default=None, help="print the markdown table of a result file and stop")
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--ms", default="1,16,32,128")
    parser.add_argument("--targets", default="0,1,2,4")
    add_output_arguments(parser, "gpu_split_k")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(open(args.table).read())["rows"]))
        return
    torch._inductor.config.force_disable_caches = True
    targets = [float(t) for t in args.targets.split(",")]
    rows, out = [], out_path(args, "gpu_split_k")
    for dtype in ({"int8": torch.int8, "fp8": FP8}[name] for name in args.dtypes.split(",")):
        for n, k in SHAPES:
            for m in map(int, args.ms.split(",")):
                progress(f"{dtype} M={m} N={n} K={k}")
                rows += case_rows(dtype, m, n, k, targets)
                write(out, rows)
    print(table(rows))


if __name__ == "__main__":
    main()
