"""Quantized linears and a Llama MLP block under torch.compile on the GPU: qfuse against Inductor.

The models are written as model code writes them (vLLM's torch fallbacks): a dynamic per-token
activation quant, `torch._int_mm` (int8; rows padded to 17 below that, as cuBLAS needs) or
`torch._scaled_mm` with unit scales (fp8), the scales multiplied in after, a bf16 output.

    python benchmarks/gpu_linear.py --suite linear [--out benchmarks/results/gpu_linear.json] [--plot FILE.png]
    python benchmarks/gpu_linear.py --suite mlp [--out benchmarks/results/gpu_mlp.json] [--plot FILE.png]
    python benchmarks/gpu_linear.py --quick              (M in {16, 1024}, one shape, to check the set-up)
    python benchmarks/gpu_linear.py --table FILE.json    (the markdown table of a result file)

Each case is compiled with Inductor default, Inductor max-autotune-no-cudagraphs (M >= 1024) and
qfuse default, timed per call (back to back, what a model sees) and for the host time of one call
(`qfuse.bench.time_call`); at M <= 16 also with mode="reduce-overhead" (CUDA graphs). Beside them: the
raw GEMM alone on pre-quantized operands (row-wise `_scaled_mm`, `_int_mm`) and the bf16 linear.
A variant is `backend[:mode]`; the mode `freezing` compiles with `torch._inductor.config.freezing` set
instead (parameters and buffers become constants: what a model's weights cost to prepare moves to compile
time; torch 2.11-2.13 do not freeze for `options={"freezing": True}`, so the config is patched around the compile).
`--variants qfuse-inductor-quant` is qfuse with its activation-quant step off (the quant left to
Inductor's reduction, as before qfuse's quantizer entered the generated code), for a same-run "before".
The weight of one linear is re-read from the L2 on every call (4096 x 4096 int8 fits in an H100's
L2): decode numbers of a single linear are warm-cache numbers for every variant alike.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

import qfuse
from gemm_cases import FP8, SHAPES
from qfuse.bench import add_output_arguments, format_table, gpu_time, out_path, plot, progress, relative_error, time_call, warm, write
from qfuse.passes.families import PATTERN_FAMILIES

TOKEN_PADDING = 17  # cuBLAS int8 GEMMs need more than 16 rows
EPS = {torch.int8: 1e-6, FP8: 1e-12}


def activation_quant(x: torch.Tensor, dtype: torch.dtype):
    """Dynamic per-token quant as vLLM's torch fallbacks write it: (q, float32 scale [M, 1])."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    s = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=EPS[dtype]) / qmax
    scaled = x.float() / s
    q = scaled.round().clamp(-128, 127) if dtype == torch.int8 else scaled.clamp(-448.0, 448.0)
    return q.to(dtype), s


class QuantLinear(nn.Module):
    """y = dequant(quant(x) @ w_q.T) in bf16; int8 or fp8, per-token activation, per-channel weight."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        generator = torch.Generator(device="cuda").manual_seed(seed)
        w = torch.randn(n, k, device="cuda", generator=generator) / math.sqrt(k)
        qmax = 127.0 if dtype == torch.int8 else 448.0
        w_scale = w.abs().amax(dim=1) / qmax
        q = (w / w_scale[:, None]).clamp(-qmax, qmax)
        self.weight = nn.Parameter((q.round() if dtype == torch.int8 else q).to(dtype), requires_grad=False)
        self.register_buffer("w_scale", w_scale.float())
        self.register_buffer("one", torch.ones((), device="cuda"))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.dtype == torch.int8 and rows < TOKEN_PADDING:
            x = F.pad(x, (0, 0, 0, TOKEN_PADDING - rows))
        q, s = activation_quant(x, self.dtype)
        if self.dtype == torch.int8:
            y = torch._int_mm(q, self.weight.t()).float()
        else:
            y = torch._scaled_mm(q, self.weight.t(), self.one, self.one, out_dtype=torch.float32)
        return (y * s * self.w_scale).to(torch.bfloat16).narrow(0, 0, rows)


class LlamaMLP(nn.Module):
    """RMSNorm, gate and up projections, SiLU * mul, down projection, residual add."""

    def __init__(self, dtype: torch.dtype, hidden: int = 4096, intermediate: int = 14336):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden, device="cuda", dtype=torch.bfloat16), requires_grad=False)
        self.gate = QuantLinear(intermediate, hidden, dtype, seed=1)
        self.up = QuantLinear(intermediate, hidden, dtype, seed=2)
        self.down = QuantLinear(hidden, intermediate, dtype, seed=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        h = (x.float() * torch.rsqrt(variance + 1e-6)).to(torch.bfloat16) * self.norm
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


# variants that are qfuse with options: its activation quant left to Inductor (the same run's "before")
NAMED_OPTIONS = {"qfuse-inductor-quant": {"patterns": [f for f in PATTERN_FAMILIES if f != "activation_quant"]}}


def compiled(model, variant: str):
    torch._dynamo.reset()
    backend, _, mode = variant.partition(":")
    if backend in NAMED_OPTIONS:
        return torch.compile(model, backend="qfuse", options=NAMED_OPTIONS[backend])
    if mode == "freezing":  # the config patched around the first call, which compiles (`measure`)
        return torch.compile(model, backend=backend)
    return torch.compile(model, backend=backend, mode=mode or None)


def measure(model, x, variant: str, expected) -> dict:
    from torch._dynamo.utils import counters

    marker = qfuse.graphs_compiled()
    counters.clear()
    fn = compiled(model, variant)
    with torch._inductor.config.patch(freezing=variant.endswith(":freezing")):
        out = warm(fn, x)
    row = {"variant": variant, "error": relative_error(out, expected), **time_call(fn, x)}
    if variant.endswith("reduce-overhead"):
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    else:
        row["gpu_us"] = gpu_time(fn, x)
    reports = qfuse.reports_since(marker)
    if variant.startswith("qfuse") and reports:
        report = reports[-1]
        row["fused"] = f"{len(report.fused)}/{len(report.records)}"
        row["lowered"] = sorted({record.lowered or record.kernel for record in report.fused})
    return row


def quantized_operands(m: int, n: int, k: int, dtype: torch.dtype):
    a = torch.randn(m, k, device="cuda").mul(20).clamp(-127, 127)
    w = torch.randn(n, k, device="cuda").mul(20).clamp(-127, 127)
    if dtype == torch.int8:
        return a.round().to(torch.int8), w.round().to(torch.int8)
    return a.to(FP8), w.to(FP8)


def triton_kernel(m: int, n: int, k: int, dtype: torch.dtype):
    """qfuse's Triton kernel alone, eager (its launcher, no Python op around it): scaled, bf16 out."""
    from qfuse.kernels.triton.scaled_mm import triton_scaled_mm

    a, w = quantized_operands(m, n, k, dtype)
    sa, sb = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
    return lambda: triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16)


def raw_gemm(m: int, n: int, k: int, dtype: torch.dtype):
    """The GEMM alone on quantized operands, scales inside where the library takes them."""
    a, w = quantized_operands(m, n, k, dtype)
    if dtype == torch.int8:
        return None if m < TOKEN_PADDING else lambda: torch._int_mm(a, w.t())
    sa, sb = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
    return lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)


def gemm_rows(label: dict, m: int, n: int, k: int, dtype: torch.dtype) -> list[dict]:
    rows = []
    for variant, make in (("raw GEMM (eager)", raw_gemm), ("qfuse triton kernel (eager)", triton_kernel)):
        gemm = make(m, n, k, dtype) if m >= TOKEN_PADDING else None  # the GEMM rows are for prefill shapes
        if gemm is not None:
            warm(gemm)
            rows.append(label | {"variant": variant, "gpu_us": gpu_time(gemm)} | time_call(gemm))
    return rows


def linear_case(m: int, n: int, k: int, dtype: torch.dtype, variants: list[str]) -> list[dict]:
    label = {"dtype": "int8" if dtype == torch.int8 else "fp8", "m": m, "n": n, "k": k}
    model = QuantLinear(n, k, dtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        rows = [label | measure(model, x, variant, expected) for variant in variants if variant != "bf16"]
        if "bf16" in variants:  # the float linear of the same size, beside the compiled quantized ones
            bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            rows.append(label | measure(bf16, x, "inductor", bf16(x)) | {"variant": "bf16 (inductor)"})
    return rows + gemm_rows(label, m, n, k, dtype)


def variants_for(m: int, max_autotune: bool = True) -> list[str]:
    names = ["inductor", "qfuse", "bf16"]
    if max_autotune and m >= 1024:
        names.append("inductor:max-autotune-no-cudagraphs")
    if m <= 16:
        names += ["inductor:reduce-overhead", "qfuse:reduce-overhead"]
    return names


def mlp_case(m: int, dtype: torch.dtype, variants: list[str] | None = None) -> list[dict]:
    label = {"dtype": "int8" if dtype == torch.int8 else "fp8", "m": m, "block": "llama_mlp"}
    model = LlamaMLP(dtype)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        variants = variants or [variant for variant in variants_for(m, max_autotune=False) if variant != "bf16"]
        return [label | measure(model, x, variant, expected) for variant in variants]


def cell(row: dict | None) -> str:
    """'per call / GPU / host' µs of a row ('' where there is none, '-' for a GPU time not taken)."""
    if not row:
        return ""
    gpu = f"{row['gpu_us']:.0f}" if row.get("gpu_us") else "-"
    return f"{row['per_call_us']:.0f} / {gpu} / {row['host_us']:.0f}"


def ratios(rows: dict[str, dict]) -> tuple[str, str]:
    """qfuse's ratios against Inductor default (per call, GPU; CUDA graphs) and the raw GEMM / qfuse GPU time."""
    qfuse_row, inductor_row, raw = rows.get("qfuse"), rows.get("inductor"), rows.get("raw GEMM (eager)")
    ratio = (f"{inductor_row['per_call_us'] / qfuse_row['per_call_us']:.2f}x, "
             f"{inductor_row['gpu_us'] / qfuse_row['gpu_us']:.2f}x") if qfuse_row and inductor_row else ""
    graphs = rows.get("qfuse:reduce-overhead"), rows.get("inductor:reduce-overhead")
    if all(graphs):
        ratio += f"; CUDA graphs {graphs[1]['per_call_us'] / graphs[0]['per_call_us']:.2f}x"
    return ratio, f"{raw['gpu_us'] / qfuse_row['gpu_us']:.2f}" if raw and qfuse_row else ""


def table(path: str) -> str:
    """A markdown table of a result file: per case, each variant's per-call / GPU / host us, and qfuse's
    ratios against Inductor default (per call and GPU time) and against the raw GEMM (GPU time)."""
    cases = defaultdict(dict)
    for row in json.loads(open(path).read())["rows"]:
        key = (row["dtype"], row.get("block", "linear"), row["m"], row.get("n", ""), row.get("k", ""))
        cases[key][row["variant"]] = row
    names = sorted({variant for rows in cases.values() for variant in rows})
    lines = [[f"{dtype} {block} M={m}" + (f" N={n} K={k}" if n else ""), *(cell(rows.get(name)) for name in names),
              *ratios(rows)] for (dtype, block, m, n, k), rows in cases.items()]
    return format_table(lines, ["case", *names, "qfuse vs inductor (per call, GPU)", "raw GEMM / qfuse (GPU)"],
                        markdown=True)


def run_suite(args) -> list[dict]:
    """The rows of --suite, written to --out after every case (a long run keeps what it measured)."""
    dtypes = [{"int8": torch.int8, "fp8": FP8}[name] for name in args.dtypes.split(",")]
    chosen_ms = [int(m) for m in args.ms.split(",")] if args.ms else None
    out, rows = out_path(args, f"gpu_{args.suite}"), []
    if args.suite == "mlp":
        for dtype in dtypes:
            for m in chosen_ms or ((16,) if args.quick else (16, 1024, 4096)):
                progress(f"mlp {dtype} M={m}")
                rows += mlp_case(m, dtype, args.variants.split(",") if args.variants else None)
                write(out, rows, suite=args.suite)
        return rows
    ms, shapes = ((16, 1024), SHAPES[:1]) if args.quick else ((1, 16, 1024, 4096), SHAPES)
    for dtype in dtypes:
        for n, k in shapes:
            for m in chosen_ms or ms:
                progress(f"linear {dtype} M={m} N={n} K={k}")
                variants = args.variants.split(",") if args.variants else variants_for(m, max_autotune=not args.quick)
                rows += linear_case(m, n, k, dtype, variants)
                write(out, rows, suite=args.suite)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("linear", "mlp"), default="linear")
    parser.add_argument("--table", default=None, help="print the markdown table of a result file and stop")
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--ms", default=None, help="comma-separated M values (default: the suite's)")
    parser.add_argument("--variants", default=None, help="comma-separated compiled variants (default: per M)")
    add_output_arguments(parser, "gpu_<suite>", plot=True,
                         quick="M in {16, 1024}, one shape, no max-autotune (mlp: M = 16)")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    rows = run_suite(args)
    for row in rows:
        print({key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()})
    print(f"wrote {out_path(args, f'gpu_{args.suite}')}")
    if args.plot:
        panels = ("dtype",) if args.suite == "mlp" else ("dtype", "n", "k")
        plot(args.plot, rows, x="m", y="per_call_us", series="variant", panels=panels,
             title=f"gpu_linear --suite {args.suite}: wall clock per call (µs), back to back")


if __name__ == "__main__":
    main()
