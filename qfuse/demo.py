"""`python -m qfuse demo`: compile a small W8A8 transformer with qfuse and show what it did.

The model (`qfuse.demo_model.TinyTransformer`, hidden 2048 by default, every linear a plain-torch
`W8A8Linear`) is compiled twice in this process: with `backend="qfuse"` and with plain `torch.compile` (Inductor). The demo
prints, per linear, what qfuse matched (pattern, scheme, kernel) or why it did not (the near miss),
the max abs error of the qfuse output against eager and against the float model with the same
(dequantized) weights, and the median time of each compiled model.

Inductor's caches are disabled while compiling: a warm FX-graph-cache hit skips qfuse's passes and
leaves no report to print.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from qfuse.demo_model import DTYPES, TinyTransformer, dequantize_linears, quantize_linears
from qfuse.passes.manager import graphs_compiled, reports_since
from qfuse.passes.report import LinearRecord


def median_ms(fns: dict[str, Callable[[], object]], device: str, warmup: int = 3, runs: int = 20) -> dict[str, float]:
    """Median wall time in milliseconds of each `fns[name]()`, after `warmup` untimed calls of each.

    The functions are timed in turns (a, b, a, b, ...), so a slow spell of a shared machine
    slows them alike and their ratio stays meaningful.
    """
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def compile_and_report(model: torch.nn.Module, x: torch.Tensor, backend: str) -> tuple[Callable, torch.Tensor, list[LinearRecord]]:
    """Compile `model`, run it once on `x` (that compiles it), and collect the records qfuse made meanwhile."""
    marker = graphs_compiled()
    compiled = torch.compile(model, backend=backend)
    with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        out = compiled(x)
    records = [record for report in reports_since(marker) for record in report.records]
    return compiled, out, records


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def format_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def linear_table(records: list[LinearRecord]) -> str:
    rows = [
        [record.module or record.node, record.pattern, record.scheme, record.kernel] if record.fused
        else [record.module or record.node, "-", "-", f"not fused: {record.reason}"]
        for record in records
    ]
    return format_table(rows, ["linear", "pattern", "scheme", "kernel / near miss"])


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
        times = median_ms({"qfuse": lambda: qfuse_model(x), "inductor": lambda: inductor_model(x)}, device, runs=runs)
    qfuse_ms, inductor_ms = times["qfuse"], times["inductor"]

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
    print(f"\nmedian of {runs} runs, timed in turns: qfuse {qfuse_ms:.3f} ms, inductor {inductor_ms:.3f} ms, "
          f"speedup (inductor / qfuse) {speedup:.2f}x")
    if speedup < 1:
        print("qfuse is slower than Inductor on this model and machine: see docs/benchmarks.md for where "
              "its kernels win and lose")
    return {"records": records, "errors": errors, "qfuse_ms": qfuse_ms, "inductor_ms": inductor_ms}


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
