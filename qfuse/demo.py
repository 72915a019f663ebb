"""`python -m qfuse demo`: compile a small W8A8 transformer with qfuse and show what it did.

The model (`qfuse.demo_model.TinyTransformer`, every linear a plain-torch `W8A8Linear`) is compiled
twice in this process: with `backend="qfuse"` and with plain `torch.compile` (Inductor). The demo
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
from collections.abc import Callable

import torch

from qfuse.demo_model import DTYPES, TinyTransformer, dequantize_linears, quantize_linears
from qfuse.passes.manager import recent_reports
from qfuse.passes.report import LinearRecord


def median_ms(fn: Callable[[], object], device: str, warmup: int = 3, runs: int = 20) -> float:
    """Median wall time of `fn()` in milliseconds, after `warmup` untimed calls."""
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def compile_and_report(model: torch.nn.Module, x: torch.Tensor, backend: str) -> tuple[Callable, torch.Tensor, list[LinearRecord]]:
    """Compile `model`, run it once on `x` (that compiles), and collect the records of new qfuse reports."""
    seen = {id(report) for report in recent_reports()}
    compiled = torch.compile(model, backend=backend)
    with torch._inductor.config.patch(force_disable_caches=True):
        out = compiled(x)
    records = [record for report in recent_reports() if id(report) not in seen for record in report.records]
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
        [record.node, record.pattern, record.scheme, record.kernel] if record.fused
        else [record.node, "-", "-", f"not fused: {record.reason}"]
        for record in records
    ]
    return format_table(rows, ["node", "pattern", "scheme", "kernel / near miss"])


def run_demo(device: str = "cpu", dtype: str = "int8", tokens: int = 64, hidden: int = 256,
             layers: int = 2, runs: int = 20) -> dict:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    torch.manual_seed(0)
    activation_dtype = torch.bfloat16 if device == "cuda" else torch.float32
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
        qfuse_ms = median_ms(lambda: qfuse_model(x), device, runs=runs)
        inductor_ms = median_ms(lambda: inductor_model(x), device, runs=runs)

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
    print(f"\nmedian of {runs} runs: qfuse {qfuse_ms:.3f} ms, inductor {inductor_ms:.3f} ms, "
          f"qfuse/inductor {qfuse_ms / inductor_ms:.2f}x")
    return {"records": records, "errors": errors, "qfuse_ms": qfuse_ms, "inductor_ms": inductor_ms}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="int8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=20, help="timed runs (the median is shown)")


def main(args: argparse.Namespace) -> None:
    run_demo(args.device, args.dtype, args.tokens, args.hidden, args.layers, args.runs)
