"""`python -m qfuse demo`: compile a small W8A8 transformer with qfuse and show what it did.

The model (`qfuse.demo_model.TinyTransformer`, hidden 2048 by default, every linear a plain-torch
`W8A8Linear`) is compiled twice in this process: with `backend="qfuse"` and with plain `torch.compile` (Inductor). The demo
prints, per linear, what qfuse matched (pattern, scheme, kernel) or why it did not (the near miss),
the max abs error of the qfuse output against eager and against the float model with the same
(dequantized) weights, and the median time of each compiled model (`qfuse.bench.time_in_turns`:
the two models timed in turns, so a slow spell of a shared machine slows both alike).

Inductor's caches are disabled while compiling: a warm FX-graph-cache hit skips qfuse's passes and
leaves no report to print.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from qfuse.bench import Timing, time_in_turns
from qfuse.config import pass_skipping_caches_off
from qfuse.demo_model import DTYPES, TinyTransformer, dequantize_linears, quantize_linears
from qfuse.passes.core.manager import graphs_compiled, reports_since
from qfuse.passes.core.report import LinearRecord
from qfuse.tables import format_table


def compile_and_report(model: torch.nn.Module, x: torch.Tensor, backend: str) -> tuple[Callable, torch.Tensor, list[LinearRecord]]:
    """Compile `model`, run it once on `x` (that compiles it), and collect the records qfuse made meanwhile."""
    marker = graphs_compiled()
    compiled = torch.compile(model, backend=backend)
    with pass_skipping_caches_off():
        out = compiled(x)
    records = [record for report in reports_since(marker) for record in report.records]
    return compiled, out, records


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def linear_table(records: list[LinearRecord]) -> str:
    rows = [
        [record.module or record.node, record.pattern, record.scheme, record.kernel] if record.fused
        else [record.module or record.node, "-", "-", f"not fused: {record.reason}"]
        for record in records
    ]
    return format_table(rows, ["linear", "pattern", "scheme", "kernel / near miss"])


def spread(timing: Timing) -> str:
    return f"{timing.median_ms:.3f} ms ({timing.q1_ms:.3f}-{timing.q3_ms:.3f})"


ACTIVATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_demo(device: str = "cpu", dtype: str = "int8", tokens: int = 64, hidden: int = 2048,
             layers: int = 2, runs: int = 20, activations: str | None = None) -> dict:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    torch.manual_seed(0)
    activation_dtype = ACTIVATION_DTYPES[activations or ("bfloat16" if device == "cuda" else "float32")]
    float_model = TinyTransformer(hidden, layers).to(device).eval()
    model = quantize_linears(float_model, DTYPES[dtype])
    reference_model = dequantize_linears(model).to(activation_dtype)
    x = torch.randn(1, tokens, hidden, device=device, dtype=activation_dtype)

    print(f"qfuse demo: {layers}-layer transformer, hidden {hidden}, {tokens} tokens, W8A8 {dtype}, "
          f"{activation_dtype} activations on {device} (torch {torch.__version__})")
    with torch.no_grad():
        eager_out, float_out = model(x), reference_model(x)
        qfuse_model, qfuse_out, records = compile_and_report(model, x, "qfuse")
        inductor_model, inductor_out, _ = compile_and_report(model, x, "inductor")
        times = time_in_turns({"qfuse": lambda: qfuse_model(x), "inductor": lambda: inductor_model(x)}, device, runs=runs)
    qfuse_ms, inductor_ms = times["qfuse"].median_ms, times["inductor"].median_ms

    fused = sum(record.fused for record in records)
    print(f"\nlinears seen by qfuse: {len(records)}, fused: {fused}\n")
    print(linear_table(records) if records else "(no reports: were the passes skipped?)")
    errors = {
        "qfuse vs eager": max_error(qfuse_out, eager_out),
        "inductor vs eager": max_error(inductor_out, eager_out),
        "qfuse vs float model": max_error(qfuse_out, float_out),
        "eager vs float model": max_error(eager_out, float_out),
    }
    print("\nmax abs error")
    for name, value in errors.items():
        print(f"  {name:<22} {value:.3e}")
    speedup = inductor_ms / qfuse_ms
    print(f"\nmedian of {runs} runs (quartiles), timed in turns: qfuse {spread(times['qfuse'])}, "
          f"inductor {spread(times['inductor'])}, speedup (inductor / qfuse) {speedup:.2f}x")
    if speedup < 1:
        print("qfuse is slower than Inductor on this model and machine: see docs/benchmarks.md for where "
              "its kernels win and lose")
    return {"records": records, "errors": errors, "qfuse_ms": qfuse_ms, "inductor_ms": inductor_ms, "timings": times}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="int8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048,
                        help="model width (default 2048: the MLP weights are 2048 x 8192, where quantized GEMMs pay off)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=20, help="timed runs (the median is shown)")
    parser.add_argument("--activations", choices=tuple(ACTIVATION_DTYPES), default=None,
                        help="activation dtype (default: float32 on CPU, bfloat16 on CUDA)")


def main(args: argparse.Namespace) -> None:
    run_demo(args.device, args.dtype, args.tokens, args.hidden, args.layers, args.runs, args.activations)
