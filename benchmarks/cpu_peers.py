"""CPU benchmark: qfuse against the recipes torchao users run today, on this CPU.

    .venv/bin/python benchmarks/cpu_peers.py [--quick] [--runs 30] [--repeats 3] [--threads N] [--only pt2e|torchao|demo] [--out PATH]
        [--linear-shapes 1024x1024,... (K x N)] [--linear-ms 16,64,256]
    .venv/bin/python benchmarks/cpu_peers.py --quick     # small sizes, one repeat of 10 rounds, writes $TMPDIR/cpu_peers_quick.json

Groups (one model each; every variant compiled on its own deep copy with its own backend callable):

    pt2e      PT2E + X86InductorQuantizer MLP 1024-2048-1024, M in (256, 32), static and dynamic
              (`tests.peers.torchao_models.pt2e_x86_mlp`): eager, inductor, inductor+freezing
              (the documented recipe), qfuse, qfuse+freezing
    torchao   `Int8DynamicActivationInt8WeightConfig` MLP, same sizes, fp32 and bf16
              (`torchao_int8_dynamic_mlp`): eager, inductor, qfuse
    linear    one `qfuse.demo_model.W8A8Linear` (dynamic per-token int8), K x N in (1024 x 1024,
              1024 x 4096, 4096 x 4096; --linear-shapes), M in (16, 64, 256; --linear-ms): inductor,
              qfuse, each CPU kernel forced
              (and qfuse without zentorch, what the README's demo install runs): the crossovers
              behind `Kernel.min_weight_elements` and oneDNN's `CROSSOVERS`
    demo      `TinyTransformer(hidden, layers=2)` quantized with `quantize_linears(model, torch.int8)`,
              fp32 and bf16 activations, hidden in (256, 2048), 64 tokens: eager, inductor, qfuse,
              each CPU kernel forced

Two `torch.compile`s of one forward share Dynamo's cache entries when their backends compare
equal (then "inductor+freezing" would silently run plain Inductor's code), so each variant gets a
deep copy of the model and a backend closure of its own, and `torch._dynamo.reset()` runs between
groups. The script checks that each compile made a new graph and that nothing recompiles while
timing. Freezing is `torch._inductor.config.patch(freezing=True)` around the compile and the first
call (`options={"freezing": True}` fails on PT2E models in torch 2.13). Inductor's caches are off.

Timing: `qfuse.bench.time_in_turns` (all variants of a group in turns), `--repeats` times; a ratio
is computed within each repeat and the median over repeats is reported:
speedup = baseline median / variant median (above 1: the variant is faster), against `inductor`
and, for PT2E, against `inductor+freezing`. Per variant: fused / seen linears from qfuse's reports
of that variant's compile, the kernels used, and the max abs error against eager. `qfuse.explain`
runs once per model (default options) for the per-model table of linears.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo import lookup_backend
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.peers
import qfuse  # noqa: E402
from qfuse.bench import add_output_arguments, format_table, machine, out_path, progress, time_in_turns, write  # noqa: E402
from qfuse.demo import max_error  # noqa: E402
from qfuse.demo_model import TinyTransformer, W8A8Linear, quantize_linears  # noqa: E402
from qfuse.kernels import get_kernel  # noqa: E402
from qfuse.platform import current_platform  # noqa: E402
from tests.peers import torchao_models  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def variant(backend: str | None, freezing: bool = False, **options) -> dict:
    return {"backend": backend, "freezing": freezing, "options": options}


def compile_variant(model: torch.nn.Module, x: torch.Tensor, spec: dict):
    """(callable, first output, qfuse records) of `spec` on a deep copy of `model`."""
    model = copy.deepcopy(model)
    if spec["backend"] is None:
        return model, model(x), []
    real, options = lookup_backend(spec["backend"]), spec["options"]

    def backend(gm, example_inputs):  # a closure per variant: Dynamo never shares its cache entries
        return real(gm, example_inputs, options=options) if options else real(gm, example_inputs)

    marker, graphs = qfuse.graphs_compiled(), counters["stats"]["unique_graphs"]
    compiled = torch.compile(model, backend=backend)
    with torch._inductor.config.patch(force_disable_caches=True, freezing=spec["freezing"]):
        out = compiled(x)
    assert counters["stats"]["unique_graphs"] > graphs, "no new graph compiled: a shared Dynamo cache entry?"
    return compiled, out, [r for report in qfuse.reports_since(marker) for r in report.records]


def run_group(section: str, params: dict, model, x, specs: dict, args) -> dict:
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        explained = qfuse.explain(copy.deepcopy(model), x)
        torch._dynamo.reset()
        fns, variants = {}, {}
        for label, spec in specs.items():
            fn, out, records = compile_variant(model, x, spec)
            fns[label] = lambda fn=fn: fn(x)
            variants[label] = {
                **spec, "fused": sum(r.fused for r in records), "seen": len(records),
                "kernels": sorted({r.kernel for r in records if r.fused}),
                "max_error_vs_eager": max_error(out, eager),
            }
        graphs = counters["stats"]["unique_graphs"]
        repeats = [{label: timing.median_ms for label, timing in time_in_turns(fns, "cpu", args.runs, args.warmup).items()}
                   for _ in range(args.repeats)]
        assert counters["stats"]["unique_graphs"] == graphs, "a variant recompiled while being timed"
    baselines = [b for b in ("inductor", "inductor+freezing") if b in specs]
    for label, row in variants.items():
        row["median_ms"] = statistics.median(r[label] for r in repeats)
        row["ms_per_repeat"] = [r[label] for r in repeats]
        for base in baselines:
            row[f"speedup_vs_{base}"] = statistics.median(r[base] / r[label] for r in repeats)
    return {"section": section, **params, "explain": [r.summary() for r in explained.records],
            "explain_fused": f"{len(explained.fused)}/{len(explained.records)}", "variants": variants}


def groups(args):
    """(section, params, builder of (model, x), variant specs) for every group to run."""
    mlp = dict(in_features=1024, hidden=2048, out=1024)
    tokens_list = (256, 32)
    if args.quick:
        mlp, tokens_list = dict(in_features=256, hidden=512, out=256), (64,)
    pt2e = {"eager": variant(None), "inductor": variant("inductor"), "inductor+freezing": variant("inductor", True),
            "qfuse": variant("qfuse"), "qfuse+freezing": variant("qfuse", True)}
    for tokens in tokens_list:
        for dynamic in (False, True):
            yield ("pt2e", {"mode": "dynamic" if dynamic else "static", "M": tokens, **mlp},
                   lambda dynamic=dynamic, tokens=tokens: torchao_models.pt2e_x86_mlp(dynamic, tokens=tokens, **mlp), pt2e)
    ao = {"eager": variant(None), "inductor": variant("inductor"), "qfuse": variant("qfuse")}
    for tokens in tokens_list:
        for dtype in ("fp32",) if args.quick else ("fp32", "bf16"):
            yield ("torchao_int8_dynamic", {"dtype": dtype, "M": tokens, **mlp},
                   lambda dtype=dtype, tokens=tokens: torchao_models.torchao_int8_dynamic_mlp(
                       DTYPES[dtype], tokens=tokens, **mlp), ao)
    kernels = {"qfuse kernel=torch": variant("qfuse", kernel="torch")}
    if get_kernel("onednn").is_supported(current_platform("cpu"))[0]:  # AMX or AVX-512 VNNI
        kernels["qfuse kernel=onednn"] = variant("qfuse", kernel="onednn")
    if get_kernel("zentorch").is_supported(current_platform("cpu"))[0]:  # installed, and a Zen CPU
        kernels["qfuse kernel=zentorch"] = variant("qfuse", kernel="zentorch")
        kernels["qfuse without zentorch"] = variant("qfuse", disabled_kernels=["zentorch"])  # README's demo install
    linear = {"inductor": variant("inductor"), "qfuse": variant("qfuse"), **kernels}
    shapes = [(256, 256)] if args.quick else [tuple(int(size) for size in shape.split("x"))
                                               for shape in args.linear_shapes.split(",")]
    for k, n in shapes:
        for tokens in (16,) if args.quick else [int(m) for m in args.linear_ms.split(",")]:
            def build_linear(k=k, n=n, tokens=tokens):
                torch.manual_seed(0)
                return W8A8Linear(torch.randn(n, k) / k**0.5, None, torch.int8), torch.randn(tokens, k)
            yield "linear", {"M": tokens, "K": k, "N": n}, build_linear, linear
    demo = {"eager": variant(None), "inductor": variant("inductor"), "qfuse": variant("qfuse"), **kernels}
    sizes = [(256, 64)] if args.quick else [(256, 64), (2048, 64)]
    for hidden, tokens in sizes:
        for dtype in ("fp32",) if args.quick else ("fp32", "bf16"):
            def build(hidden=hidden, tokens=tokens, dtype=dtype):
                torch.manual_seed(0)
                model = quantize_linears(TinyTransformer(hidden, layers=2).eval(), torch.int8)
                return model, torch.randn(1, tokens, hidden, dtype=DTYPES[dtype])
            yield "demo", {"dtype": dtype, "hidden": hidden, "tokens": tokens}, build, demo


def print_group(group: dict) -> None:
    params = {k: v for k, v in group.items() if k not in ("section", "variants", "explain", "explain_fused")}
    print(f"\n== {group['section']} {params}  (qfuse.explain: {group['explain_fused']} fused)")
    bases = [k.removeprefix("speedup_vs_") for k in next(iter(group["variants"].values())) if k.startswith("speedup_vs_")]
    rows = [[label, f"{v['median_ms']:.3f}", *(f"{v['speedup_vs_' + b]:.2f}x" for b in bases),
             f"{v['fused']}/{v['seen']}" if v["backend"] == "qfuse" else "", ",".join(v["kernels"]),
             f"{v['max_error_vs_eager']:.1e}"] for label, v in group["variants"].items()]
    print(format_table(rows, ["variant", "median ms", *(f"vs {b}" for b in bases), "fused", "kernel", "max err"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="timed rounds per repeat (default 30, quick 10)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing repeats (default 3, quick 1)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--linear-shapes", default="1024x1024,1024x4096,4096x4096", help="linear: K x N, comma-separated")
    parser.add_argument("--linear-ms", default="16,64,256", help="linear: M values, comma-separated")
    parser.add_argument("--only", default=None, help="run only sections containing this string (pt2e, torchao, linear, demo)")
    add_output_arguments(parser, "cpu_peers", quick="small sizes, few runs (about 2 minutes)")
    args = parser.parse_args()
    args.runs = args.runs or (10 if args.quick else 30)
    args.repeats = args.repeats or (1 if args.quick else 3)
    ok, why = torchao_models.available()
    if not ok:
        raise SystemExit(why)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    start, results = time.time(), []
    print(f"cpu_peers: {machine()}")
    for section, params, build, specs in groups(args):
        if args.only and args.only not in section:
            continue
        progress(f"{section} {params}")
        model, x = build()
        results.append(run_group(section, params, model, x, specs, args))
        print_group(results[-1])
    seconds = round(time.time() - start, 1)
    out = write(out_path(args, "cpu_peers"), results, runs=args.runs, repeats=args.repeats, seconds=seconds)
    print(f"\n{seconds} s; wrote {out}")


if __name__ == "__main__":
    main()
