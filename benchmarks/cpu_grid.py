"""CPU grid (issue #42 item 3): every CPU form, per shape and M, qfuse against Inductor in one run.

    .venv/bin/python benchmarks/cpu_grid.py [--forms gptq-int4,...] [--shapes 1024x1024,...] [--ms 1,16,64,256,1024]
        [--dtypes fp32,bf16] [--runs 10] [--repeats 3] [--out F.json] [--plot F.png]
    .venv/bin/python benchmarks/cpu_grid.py --quick     # two forms, K = N = 1024, M 1 and 64, fp32 and bf16

A cell is one form at one N x K, M and activation dtype: the form's module (as its tool writes it: the peer
builders of tests/peers) compiled with plain Inductor and with `backend="qfuse"` (each on a deep copy, a
backend closure of its own: `cpu_peers.compile_variant`), timed in turns (`qfuse.bench.time_in_turns`)
`--repeats` times; speedup = Inductor's median / qfuse's, the median over repeats (above 1: qfuse is faster).
Per cell also: whether qfuse fused the linear, its kernel, and the largest difference from eager next to
Inductor's. The PT2E form is an MLP K -> N -> K (the recipe quantizes whole models); the others one linear.

The table prints one row a form, shape and dtype with a column a M, then each form's geomean and lowest cell,
against #42's targets (no cell below 0.97x; geomean >= 1.3x for W8A8 forms, >= 2x for weight-only at M <= 16).
`--plot` draws a heat map of the speedups a form (`qfuse.bench.heatmap`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.peers
from cpu_peers import compile_variant, variant  # noqa: E402
from qfuse.bench import (add_output_arguments, format_table, geomean, heatmap, machine, out_path,  # noqa: E402
                         progress, time_in_turns, write)
from qfuse.demo import max_error  # noqa: E402
from qfuse.demo_model import W8A8Linear  # noqa: E402
from tests.peers import torchao_models  # noqa: E402
from tests.peers import weight_only_models as wo  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
W8A8_FORMS = ("w8a8-hand-written", "torchao-int8-dynamic", "pt2e-static")


def _linear(k: int, n: int, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n).to(dtype).eval()


def _torchao(config: str, k: int, n: int, dtype: torch.dtype) -> nn.Module:
    from torchao.quantization import quantize_

    model = nn.Sequential(_linear(k, n, dtype))
    quantize_(model, torchao_models._config(config, set_inductor_config=False))
    return model


#: form -> (builder of its module for K, N, dtype, M; the activation dtypes it takes)
FORMS = {
    "w8a8-hand-written": (lambda k, n, dtype, m: W8A8Linear.from_linear(_linear(k, n, dtype), torch.int8), ("fp32", "bf16")),
    "torchao-int8-dynamic": (lambda k, n, dtype, m: _torchao("int8_dynamic", k, n, dtype), ("fp32", "bf16")),
    "pt2e-static": (lambda k, n, dtype, m: torchao_models.pt2e_x86_mlp(False, k, n, k, tokens=m)[0], ("fp32",)),
    "torchao-int8-weight-only": (lambda k, n, dtype, m: wo.torchao_int8_weight_only(dtype, in_features=k, out_features=n),
                                 ("fp32", "bf16")),
    "gptq-int4": (lambda k, n, dtype, m: wo.gptq_packed_int4(dtype, 128, in_features=k, out_features=n), ("fp32", "bf16")),
    "awq-int4": (lambda k, n, dtype, m: wo.awq_int4(dtype, 128, in_features=k, out_features=n), ("fp32", "bf16")),
    "compressed-tensors-w4a16": (lambda k, n, dtype, m: wo.compressed_tensors_w4a16(dtype, group_size=128, in_features=k,
                                                                                   out_features=n), ("fp32", "bf16")),
    "intx-int4": (lambda k, n, dtype, m: wo.torchao_intx_int4(dtype, in_features=k, out_features=n), ("fp32", "bf16")),
    "fp8-weight-only": (lambda k, n, dtype, m: wo.fp8_weight_only(dtype, in_features=k, out_features=n), ("fp32", "bf16")),
}


def cell(form: str, n: int, k: int, m: int, dtype: str, runs: int, repeats: int) -> dict:
    """One form at one size: Inductor's and qfuse's medians, the speedup, what qfuse fused, the errors."""
    model = FORMS[form][0](k, n, DTYPES[dtype], m)  # (the builders return eval-mode models; PT2E's refuses .eval())
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DTYPES[dtype])
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        fns, row = {}, dict(form=form, n=n, k=k, shape=f"{n}x{k}", m=m, dtype=dtype)
        for label in ("inductor", "qfuse"):
            fn, out, records = compile_variant(model, x, variant(label))
            fns[label] = lambda fn=fn: fn(x)
            row[f"{label}_error"] = max_error(out, eager)
            if label == "qfuse":
                row["fused"] = f"{sum(r.fused for r in records)}/{len(records)}"
                row["kernel"] = ",".join(sorted({r.kernel for r in records if r.fused})) or "-"
        timings = [time_in_turns(fns, "cpu", runs) for _ in range(repeats)]
    row["inductor_ms"] = statistics.median(t["inductor"].median_ms for t in timings)
    row["qfuse_ms"] = statistics.median(t["qfuse"].median_ms for t in timings)
    row["speedup"] = round(statistics.median(t["inductor"].median_ms / t["qfuse"].median_ms for t in timings), 3)
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Each form and dtype: geomean speedup (all cells, and M <= 16 for weight-only forms), the lowest cell."""
    out = []
    for (form, dtype), group in itertools.groupby(sorted(rows, key=lambda r: (r["form"], r["dtype"])),
                                                  key=lambda r: (r["form"], r["dtype"])):
        group = list(group)
        lowest = min(group, key=lambda r: r["speedup"])
        small = [r["speedup"] for r in group if r["m"] <= 16]
        target = "geomean >= 1.3" if form in W8A8_FORMS else "geomean at M <= 16 >= 2"
        out.append(dict(form=form, dtype=dtype, cells=len(group), geomean=round(geomean(r["speedup"] for r in group), 2),
                        geomean_m16=round(geomean(small), 2) if small else None,
                        lowest=f"{lowest['speedup']:.2f} ({lowest['n']}x{lowest['k']}, M={lowest['m']})",
                        target=target))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--shapes", default="1024x1024,4096x4096,14336x4096,4096x14336,8192x2048",
                        help="N x K, comma-separated")
    parser.add_argument("--ms", default="1,16,64,256,1024")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    add_output_arguments(parser, "cpu_grid", plot=True, quick="gptq-int4 and torchao-int8-dynamic, 1024 x 1024, M 1 and 64")
    args = parser.parse_args()
    forms, shapes, ms = args.forms.split(","), args.shapes.split(","), [int(m) for m in args.ms.split(",")]
    if args.quick:
        forms, shapes, ms, args.runs, args.repeats = ["gptq-int4", "torchao-int8-dynamic"], ["1024x1024"], [1, 64], 5, 1
    rows = []
    for form, shape, dtype in itertools.product(forms, shapes, args.dtypes.split(",")):
        if dtype not in FORMS[form][1]:
            continue
        n, k = (int(size) for size in shape.split("x"))
        for m in ms:
            rows.append(cell(form, n, k, m, dtype, args.runs, args.repeats))
            progress(" ".join(f"{key}={value}" for key, value in rows[-1].items()))
            write(out_path(args, "cpu_grid"), rows, machine=machine())  # so far: a long grid keeps what it measured
    header = ["form", "dtype", "n", "k", *[f"M={m}" for m in ms], "kernel"]
    table = []
    for (form, dtype, n, k), group in itertools.groupby(rows, key=lambda r: (r["form"], r["dtype"], r["n"], r["k"])):
        by_m = {r["m"]: r for r in group}
        table.append([form, dtype, n, k, *[f"{by_m[m]['speedup']:.2f}" if m in by_m else "" for m in ms],
                      next(iter(by_m.values()))["kernel"]])
    print(format_table(table, header))
    totals = summary(rows)
    print(format_table([list(row.values()) for row in totals], list(totals[0])))
    write(out_path(args, "cpu_grid"), rows, machine=machine(), summary=totals)
    if args.plot:
        heatmap(args.plot, rows, x="m", y="shape", value="speedup", panels=("form", "dtype"),
                title="qfuse / Inductor speedup on this CPU (above 1: qfuse faster)")


if __name__ == "__main__":
    main()
