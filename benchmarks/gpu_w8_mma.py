"""The CUDA 8-bit decode kernel (`qfuse.kernels.cuda.w8_mma`) per linear, against the bf16 matmul, cuBLAS and
qfuse's Triton kernels, in one run; and its numerics against the reference math.

    python benchmarks/gpu_w8_mma.py [--ms 1,16] [--shapes] [--quick] [--out FILE.json]

Forms: fp8 and int8 W8A8 (an activation quantized per token, a per-channel weight scale: the GEMM and its
epilogue; the activation's quant runs in its producer's kernel in a compiled model), int8 and fp8 W8A16
(a bf16 activation). Candidates, each called as the op's eager path calls it: the cuda kernel (its launch
rule's pick, and with --shapes the other (row tiles, warps, unroll) it could take), the `triton` kernel as it
dispatches, cuBLAS (row-wise `_scaled_mm` for fp8; `_int_mm`, which takes no M <= 16, on the activation
padded to 17 rows as vLLM's fallback pads it), and the bf16 matmul.

GPU time per linear from one CUDA graph over a stack of weights past the L2 (`graph_ms_per_call`), µs.
Achieved bandwidth: the weight's bytes (values and float32 scales) / GPU time, against the copy bandwidth
measured in the same run (gpu_int4_mma.copy_bandwidth).
"""

from __future__ import annotations

import argparse

import torch

from gpu_int4_mma import SHAPES, STACK_BYTES, copy_bandwidth, stack_size, timed_rows
from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, machine, out_path, progress, write
from qfuse.kernels import get_kernel, reference_math
from qfuse.kernels.cuda import w8_mma
from qfuse.kernels.cuda.int4_mma import why_not_launch
from qfuse.kernels.prepared import PreparedWeight

FP8 = torch.float8_e4m3fn
FORMS = {"fp8 W8A8": (FP8, FP8), "int8 W8A8": (torch.int8, torch.int8), "int8 W8A16": (torch.bfloat16, torch.int8),
         "fp8 W8A16": (torch.bfloat16, FP8)}  # name -> (activation dtype, weight dtype)
SHAPE_VARIANTS = [(1, 8, 4), (2, 8, 4), (2, 4, 4), (2, 16, 2), (1, 16, 2), (2, 8, 2), (2, 4, 8)]  # (row tiles, warps, unroll)
CUBLAS_INT8_ROWS = 17


def random_values(rows: int, cols: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, (rows, cols), device="cuda", generator=generator, dtype=torch.int8)
    if dtype == FP8:
        return (torch.randn(rows, cols, device="cuda", generator=generator) * 64).clamp(-448, 448).to(FP8)
    return torch.randn(rows, cols, device="cuda", generator=generator, dtype=dtype)


class Weight:
    """One random 8-bit weight [N, K] with a float32 per-channel scale, in the cuda and triton kernels' forms."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, generator: torch.Generator):
        self.w = random_values(n, k, dtype, generator)
        self.scale = torch.rand(1, n, device="cuda", generator=generator) / (64 * k**0.5)
        self.cuda = get_kernel("cuda").prepare_weight(self.w.t(), self.scale, None)
        self.triton = PreparedWeight(self.w.t(), self.scale, None, k, n)
        self.bytes = n * k + 4 * n


def candidates(form: str, weight: Weight, x: torch.Tensor, scale_a: torch.Tensor | None, variants) -> dict:
    out = torch.bfloat16
    triton = get_kernel("triton")
    weight_dtype = FORMS[form][1]
    calls = {"cuda (launch rule)": lambda: w8_mma.w8_mma(x, weight.cuda.data, weight_dtype, scale_a, weight.scale,
                                                         None, out)}
    for shape in (shape for shape in variants if not why_not_launch(x.shape[0], shape[1], shape[0])):
        calls[f"cuda {shape}"] = lambda shape=shape: w8_mma.w8_mma(x, weight.cuda.data, weight_dtype, scale_a,
                                                                   weight.scale, None, out, shape)
    if scale_a is None:
        calls["triton"] = lambda: triton.weight_only_apply(x, weight.triton, None, out)
        return calls
    calls["triton"] = lambda: triton.apply(x, weight.triton, scale_a, None, None, out)
    if x.dtype == FP8:
        calls["cuBLAS row-wise"] = lambda: torch._scaled_mm(x, weight.w.t(), scale_a, weight.scale, out_dtype=out)
    else:
        padded = torch.nn.functional.pad(x, (0, 0, 0, max(0, CUBLAS_INT8_ROWS - x.shape[0])))
        calls["cuBLAS _int_mm (17 rows)"] = lambda: torch._int_mm(padded, weight.w.t())
    return calls


def reference(form: str, weight: Weight, x: torch.Tensor, scale_a: torch.Tensor | None) -> torch.Tensor:
    if scale_a is None:
        return reference_math.weight_only_scaled_mm(x, weight.w.t(), weight.scale, None, None, torch.float64)
    return reference_math.scaled_mm(x, weight.w.t(), scale_a, weight.scale, None, None, None, torch.float64)


def run(ms, shapes, forms, variants) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    progress(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for n, k in shapes:
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, STACK_BYTES // (2 * n * k)))]
        for form in forms:
            activation_dtype, weight_dtype = FORMS[form]
            weights = [Weight(n, k, weight_dtype, generator) for _ in range(stack_size(n * k))]
            for m in ms:
                x = random_values(m, k, activation_dtype, generator)
                scale_a = None if activation_dtype == torch.bfloat16 else torch.rand(m, 1, device="cuda") / 100
                expected = reference(form, weights[0], x, scale_a)
                errors = {}
                for name, call in candidates(form, weights[0], x, scale_a, variants).items():
                    if "_int_mm" not in name:
                        errors[name] = ((call().double() - expected).norm() / expected.norm()).item()
                times = {name: graph_ms_per_call([candidates(form, weight, x, scale_a, variants)[name] for weight in weights])
                         * 1e3 for name in candidates(form, weights[0], x, scale_a, variants)}
                xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                times["bf16 mm"] = graph_ms_per_call([lambda w=w: xb @ w.t() for w in dense]) * 1e3
                rows += timed_rows(times, errors, weights[0].bytes, bandwidth, form=form, n=n, k=k, m=m)
                progress(f"{form} N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.1f}" for name, us in times.items()))
            del weights
        del dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--shapes", action="store_true", help="also time the cuda kernel's other launch shapes")
    add_output_arguments(parser, "gpu_w8_mma", quick="one shape, M = 1, fp8 W8A8 and int8 W8A16")
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    shapes, forms = (SHAPES[1:2], ["fp8 W8A8", "int8 W8A16"]) if args.quick else (SHAPES, list(FORMS))
    rows = run([1] if args.quick else ms, shapes, forms, SHAPE_VARIANTS if args.shapes else [])
    header = ["form", "n", "k", "m", "kernel", "gpu_us", "vs_bf16", "hbm_fraction", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_w8_mma"), rows, machine=machine())


if __name__ == "__main__":
    main()
