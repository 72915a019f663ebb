"""Host µs a call of a W4A16 decode linear (4096 x 4096, M = 1), layer by layer, without CUDA graphs (an
exploration: where the `cuda` kernel's time went in default mode).

    python benchmarks/explorations/cuda_launch_host_cost.py [--out FILE.json]

Each figure is the enqueue rate (`qfuse.bench.time_call`'s host_us: 100 calls issued to an idle GPU): the
kernel launched by torch.cuda's ctypes launcher and by the static CUDA launcher (`qfuse.kernels.cuda.launch`),
`int4_mma`'s Python around the launch, the op's parts (`check_operands`, `prepared_int4_weight`,
`int4_product`), the op's eager call, and one compiled linear in default mode: the cuda kernel forced (its
call from Inductor's code, `qfuse.lowerings.cuda`), the triton kernel forced, qfuse's choice, and ATen's
tinygemm under Inductor.
"""

from __future__ import annotations

import argparse

import torch

from gpu_llm_decode import GROUP, GptqLinear, TinygemmLinear
from qfuse.bench import add_output_arguments, machine, out_path, time_call, warm, write
from qfuse.kernels.cuda import int4_mma, launch
from qfuse.kernels.int4_words import pack_int4
from qfuse.ops.int4_weight_only import check_operands, int4_product, prepared_int4_weight


def host_us(fn) -> float:
    warm(fn, times=5)
    return round(time_call(fn, calls=20, repeats=5, host_calls=100)["host_us"], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "gpu_cuda_launch_host_cost")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    n = k = 4096
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    values = torch.randint(-8, 8, (k, n), device="cuda", generator=generator, dtype=torch.int8)
    scale = (torch.rand(k // GROUP, n, device="cuda", generator=generator) / 64).to(torch.bfloat16)
    words, pairs = int4_mma.repack(values, scale, None)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    warps, unroll = int4_mma.launch_shape(1, n, k)
    arguments = (words, x, pairs, pairs, out, 1, n, k, 0)
    options = ["-DM_TILES=1", f"-DWARPS={warps}", f"-DUNROLL={unroll}", f"-DGROUP_SHIFT={int4_mma.group_shift(k, GROUP)}",
               "-DHALF_BF16"]
    through_ctypes = torch.cuda._compile_kernel(launch.COMMON.read_text() + int4_mma.SOURCE.read_text(),
                                                "qfuse_int4_mma", nvcc_options=options)
    static = launch.compiled(int4_mma.SOURCE, "qfuse_int4_mma", tuple(options), int4_mma.ARGUMENT_TYPES, 0)
    words_nk, scales_nk = pack_int4(values.t().contiguous()), scale.t().contiguous()
    kernel, weight = prepared_int4_weight("cuda", words_nk, None, scales_nk, None, GROUP)
    gptq, tinygemm = GptqLinear(n, k, generator), TinygemmLinear(n, k, generator)
    calls = {
        "tinygemm ATen op": lambda: tinygemm(x),
        "launch, torch.cuda's ctypes launcher": lambda: through_ctypes(grid=(n // 16, 1, 1), block=(32 * warps, 1, 1),
                                                                     args=list(arguments)),
        "launch, static CUDA launcher": lambda: static.launch(n // 16, warps, arguments, x.device),
        "int4_mma (its Python and the launch)": lambda: int4_mma.int4_mma(x, words, pairs, None, GROUP, torch.bfloat16),
        "op: check_operands": lambda: check_operands(x, words_nk, None, scales_nk, None, None, GROUP, torch.bfloat16,
                                                     None, "stored", False),
        "op: prepared_int4_weight": lambda: prepared_int4_weight("cuda", words_nk, None, scales_nk, None, GROUP),
        "op: int4_product": lambda: int4_product(kernel, x, weight, None, torch.bfloat16),
        "op, eager call (kernel='cuda')": lambda: torch.ops.qfuse.int4_weight_only_mm(
            x, words_nk, None, scales_nk, None, None, GROUP, torch.bfloat16, "cuda"),
    }
    for name, options in (("cuda forced", {"kernel": "cuda"}), ("triton forced", {"kernel": "triton"}),
                          ("qfuse's choice", {})):
        calls[f"compiled GPTQ linear, default mode, {name}"] = torch.compile(gptq, backend="qfuse", options=options)
    calls["compiled tinygemm linear, Inductor"] = torch.compile(tinygemm)
    rows = []
    with torch.no_grad():
        for name, call in calls.items():
            rows.append(dict(call=name, host_us=host_us(call if name.startswith(("launch", "op", "tinygemm", "int4"))
                                                        else lambda call=call: call(x))))
            print(f"{name}: {rows[-1]['host_us']} µs", flush=True)
    write(out_path(args, "gpu_cuda_launch_host_cost"), rows, machine=machine())


if __name__ == "__main__":
    main()
