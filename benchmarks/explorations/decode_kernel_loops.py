"""The CUDA decode kernels' launch shapes on this GPU, per Llama-3-8B linear and M (an exploration).

    python benchmarks/explorations/decode_kernel_loops.py [--ms 1,16,32,64] [--forms "int8 W8A16,fp8 W8A8"]
                                                          [--out FILE.json]

GPU µs per linear in one CUDA graph over weights past the L2, for every launch shape of `int4_mma` (warps a
block, chunks loaded ahead) and of `w8_mma` (row tiles, warps, chunks ahead) that fits its shared memory, the
launch rules' picks, and beside them in the same run the kernel that runs there otherwise (tinygemm and the
nibble-plane template for int4, the `triton` kernel for 8-bit weights) and the bf16 matmul; each call's
relative error against the float product. The launch rules
(`int4_mma.launch_shape`, `w8_mma.launch_shape`) were set from runs of this sweep.

The recorded result (benchmarks/results/gpu_decode_kernel_loops_h200.json, session 28) also holds rows of the
kernel loops this session tried and did not keep, run with -D switches since removed from the sources: "old"
(the int4 loop dividing by the group's chunks, before this session), "counter" (the loop kept), "prefetch"
(the next chunks loaded into registers first) and "async" (a ring of chunks in shared memory, cp.async);
docs/benchmarks.md, "The int4 decode kernel on an H200", gives what they showed.

Session 29's runs: benchmarks/results/gpu_decode_kernel_loops_m64_h200.json (M = 1 to 64, both W8A8 forms: the
kernels took up to 64 rows from then on) and gpu_decode_kernel_loops_row_tiles_h200.json (int4 at M = 16 to 64 with
a first field in each shape, 16-row tiles a warp, run with a -D switch since removed); docs/benchmarks.md,
"Batched decode on the CUDA kernels".
"""

from __future__ import annotations

import argparse

import torch

from gpu_int4_mma import DECODER_SHAPES, GROUP, STACK_BYTES, Int4Weight, copy_bandwidth, stack_size
from gpu_w8_mma import FORMS, Weight, random_values, reference
from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, machine, out_path, progress, write
from qfuse.kernels import get_kernel, int4_tinygemm
from qfuse.kernels.cuda import w8_mma
from qfuse.kernels.cuda.int4_mma import int4_mma, launch_shape, why_not_launch
from qfuse.kernels.triton.int4_planes import triton_int4_planes_mm
from qfuse.kernels.triton.scaled_mm import multiprocessors

INT4_SHAPES = [(warps, unroll) for warps in (4, 8, 16) for unroll in (1, 2, 4, 8)]
W8_SHAPES = [(1, 4, 2), (1, 4, 4), (1, 8, 2), (1, 8, 4), (1, 16, 2), (2, 4, 4), (2, 8, 4), (2, 8, 2), (1, 8, 8),
             (2, 4, 8)]


def _row(kernel, n, k, m, variant, us, weight_bytes, bandwidth, error=None) -> dict:
    return dict(kernel=kernel, n=n, k=k, m=m, variant=variant, us=round(us, 2),
                hbm=round(weight_bytes / (us * 1e-6) / bandwidth, 3), rel_error=error)


def bf16_row(n: int, k: int, m: int, bandwidth: float) -> dict:
    """The bf16 matmul's row (bandwidth: its own weight's bytes)."""
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, STACK_BYTES // (2 * n * k)))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    us = graph_ms_per_call([lambda w=w: x @ w.t() for w in dense]) * 1e3
    return _row("bf16", n, k, m, "bf16 mm", us, 2 * n * k, bandwidth)


def int4_rows(n: int, k: int, ms, generator, bandwidth: float) -> list[dict]:
    weights = [Int4Weight(n, k, False, generator) for _ in range(stack_size(n * k // 2))]
    sms = multiprocessors(torch.device("cuda"))
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        expected = x.float() @ weights[0].dequantized().float()
        shapes = [shape for shape in INT4_SHAPES if not why_not_launch(m, shape[0])]
        for shape in [launch_shape(m, n, k), *shapes]:
            def call(weight, shape=shape):
                return int4_mma(x, *weight.mma, None, GROUP, torch.bfloat16, shape)
            error = ((call(weights[0]).float() - expected).norm() / expected.norm()).item()
            us = graph_ms_per_call([lambda weight=weight: call(weight) for weight in weights]) * 1e3
            rule = " (launch rule)" if shape == launch_shape(m, n, k) else ""
            rows.append(_row("int4", n, k, m, f"w{shape[0]} u{shape[1]}{rule}", us, weights[0].bytes, bandwidth, error))
        others = {"tinygemm": lambda weight: int4_tinygemm.int4pack_mm(x, weight.tinygemm, None, torch.bfloat16),
                  "triton planes": lambda weight: triton_int4_planes_mm(x, weight.words, None, weight.scales_nk, None,
                                                                        None, GROUP, torch.bfloat16, sms)}
        for name, call in others.items():
            us = graph_ms_per_call([lambda weight=weight, call=call: call(weight) for weight in weights]) * 1e3
            rows.append(_row("int4", n, k, m, name, us, weights[0].bytes, bandwidth))
        rows.append(bf16_row(n, k, m, bandwidth))
        progress(f"int4 {n}x{k} M={m}: " + ", ".join(f"{row['variant']} {row['us']}" for row in rows[-len(shapes) - 4:]))
    return rows


def w8_rows(form: str, n: int, k: int, ms, generator, bandwidth: float) -> list[dict]:
    activation_dtype, weight_dtype = FORMS[form]
    weights = [Weight(n, k, weight_dtype, generator) for _ in range(stack_size(n * k))]
    triton = get_kernel("triton")
    rows = []
    for m in ms:
        x = random_values(m, k, activation_dtype, generator)
        scale_a = None if activation_dtype == torch.bfloat16 else torch.rand(m, 1, device="cuda") / 100
        expected = reference(form, weights[0], x, scale_a)
        shapes = [shape for shape in W8_SHAPES if not why_not_launch(m, shape[1], shape[0])]
        for shape in [w8_mma.launch_shape(m, n), *shapes]:
            def call(weight, shape=shape):
                return w8_mma.w8_mma(x, weight.cuda.data, weight_dtype, scale_a, weight.scale, None, torch.bfloat16, shape)
            error = ((call(weights[0]).double() - expected).norm() / expected.norm()).item()
            us = graph_ms_per_call([lambda weight=weight: call(weight) for weight in weights]) * 1e3
            rule = " (launch rule)" if shape == w8_mma.launch_shape(m, n) else ""
            rows.append(_row(form, n, k, m, f"{shape}{rule}", us, weights[0].bytes, bandwidth, error))
        def other(weight):
            if scale_a is None:
                return triton.weight_only_apply(x, weight.triton, None, torch.bfloat16)
            return triton.apply(x, weight.triton, scale_a, None, None, torch.bfloat16)
        us = graph_ms_per_call([lambda weight=weight: other(weight) for weight in weights]) * 1e3
        rows.append(_row(form, n, k, m, "triton", us, weights[0].bytes, bandwidth))
        rows.append(bf16_row(n, k, m, bandwidth))
        progress(f"{form} {n}x{k} M={m}: " + ", ".join(f"{row['variant']} {row['us']}" for row in rows[-len(shapes) - 3:]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--forms", default="int8 W8A16,fp8 W8A8", help=f"8-bit forms, of {', '.join(FORMS)}")
    add_output_arguments(parser, "gpu_decode_kernel_loops", quick="the gate / up shape only")
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    generator = torch.Generator(device="cuda").manual_seed(0)
    copy_bandwidth()  # once to bring the clocks up
    bandwidth = copy_bandwidth()
    rows = []
    for n, k in DECODER_SHAPES[2:3] if args.quick else DECODER_SHAPES:
        rows += int4_rows(n, k, ms, generator, bandwidth)
        for form in filter(None, args.forms.split(",")):
            rows += w8_rows(form, n, k, ms, generator, bandwidth)
    header = ["kernel", "n", "k", "m", "variant", "us", "hbm", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_decode_kernel_loops"), rows, machine=machine(), copy_bandwidth=bandwidth)


if __name__ == "__main__":
    main()
