"""W4A16 prefill on an H200's wgmma, tried for issue #39 (not kept): the int4 weight in the decode kernel's layout
(`qfuse.kernels.cuda.int4_mma.repack`), dequantized in registers exactly as eager rounds it and used as the
register-sourced A operand of `wgmma.m64nNk16` (out^T = w @ x^T: 64 weight rows a warpgroup, TOKENS rows of x the
B operand in shared memory; `int4_wgmma.cu`, after the decode kernel's own dequantize). Two stagings of x:
through registers, permuted to the A operands' order of k as it is stored, or by cp.async from an x permuted
beforehand. Checked against eager's math (bf16 /
fp16, odd M, bias), then timed against cuBLAS's bf16 matmul of the same run.

    python benchmarks/explorations/gpu_int4_prefill_wgmma.py register_staged|cp_async_staged [OUT.json] [-D... ...]
    # benchmarks/results/gpu_int4_prefill_wgmma_*_h200.json; docs/benchmarks.md, "W4A16 prefill on wgmma"

Times from `triton.testing.do_bench` (its L2 flush between calls), ms.
"""

import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton
from torch.cuda._utils import _nvrtc_compile

from qfuse.kernels.cuda import int4_mma
from qfuse.kernels.cuda.launch import COMMON

HERE = Path(__file__).parent

STAGING = sys.argv[1] if len(sys.argv) > 1 else "register_staged"
OUT_FILE = sys.argv[2] if len(sys.argv) > 2 else f"gpu_int4_prefill_wgmma_{STAGING}.json"
EXTRA = tuple(sys.argv[3:])  # -D switches for every kernel (the ablations: -DNO_CONVERT, -DNO_STAGE)
PERMUTED = STAGING == "cp_async_staged"
STAGES = 4 if PERMUTED else 3
VARIANTS = [(256, 2), (128, 2), (256, 1), (128, 1)]  # (x rows a block: wgmma's N, warpgroups a block)


def wgmma_wrappers() -> str:
    """`wgmma_n128` / `wgmma_n256`: one register-A wgmma.m64nNk16 on the accumulators `d` (N / 2 floats a thread)."""
    wrappers = []
    for n in (128, 256):
        regs = n // 2
        d = ", ".join(f"%{i}" for i in range(regs))
        a = ", ".join(f"%{regs + i}" for i in range(4))
        binds = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
        wrappers.append(
            f"__device__ __forceinline__ void wgmma_n{n}(float* d, const unsigned* a, unsigned long long desc, "
            f"int accumulate) {{\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32." HALF "." HALF " {{{d}}}, {{{a}}}, '
            f'%{regs + 4}, p, 1, 1, 0;\\n}}\\n"\n'
            f"                 : {binds}\n"
            f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));\n}}')
    return "\n\n".join(wrappers)


DECODE_HELPERS = int4_mma.SOURCE.read_text().split("// The kernel (above")[0]  # its defines and `pair_value`, not its kernel
SOURCE = COMMON.read_text() + DECODE_HELPERS + (HERE / "int4_wgmma.cu").read_text().replace(
    "// WGMMA_WRAPPERS (the harness puts wgmma_n128 / wgmma_n256 here)", wgmma_wrappers())


def shared_bytes(tokens: int) -> int:
    return STAGES * 8 * (tokens * 16 + 16) if PERMUTED else STAGES * tokens * 128


_KERNELS = {}


def kernel(dtype, tokens, wg):
    key = (dtype, tokens, wg)
    if key not in _KERNELS:
        options = [f"-DTOKENS={tokens}", f"-DWG={wg}", *(["-DCP_ASYNC", f"-DSTAGES={STAGES}"] if PERMUTED else []), *EXTRA]
        options += ["-DHALF_BF16"] if dtype == torch.bfloat16 else []
        cubin, name = _nvrtc_compile(SOURCE, "qfuse_int4_wgmma", compute_capability="90a", nvcc_options=options)
        descriptor, path = tempfile.mkstemp(suffix=".cubin")
        os.write(descriptor, cubin)
        os.close(descriptor)
        loaded = torch._C._StaticCudaLauncher._load_kernel(path, name or "qfuse_int4_wgmma", shared_bytes(tokens), 0)
        os.unlink(path)
        _KERNELS[key] = int(loaded[-3])
    return _KERNELS[key]


def permute_k(x):
    """x with k in the A operands' order within each chunk of 64 (the decode layout's order: `int4_mma.cu`)."""
    m, k = x.shape
    return x.view(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)


def launch(x, words, pairs, bias, out, group, tokens, wg):
    m, k = x.shape
    n = pairs.shape[1]
    torch._C._StaticCudaLauncher._launch_kernel(
        kernel(x.dtype, tokens, wg), n // (64 * wg), triton.cdiv(m, tokens), 1, 4 * wg, shared_bytes(tokens),
        "OOOOOiiiii", (words, x, pairs, pairs if bias is None else bias, out, m, n, k, group // 64,
                       int(bias is not None)), torch._C._cuda_getCurrentRawStream(0))
    return out


def weight(n, k, group, dtype):
    """(eager's dequantized weight [K, N], the decode layout's words and pairs) of a random g-group int4 weight."""
    values = torch.randint(-8, 8, (k, n), dtype=torch.int8, device="cuda")
    scale = (torch.rand(k // group, n, device="cuda") * 0.02 + 0.001).to(dtype)
    zero = torch.randint(-2, 3, (k // group, n), dtype=torch.int8, device="cuda")
    dense = ((values.float() - zero.float().repeat_interleave(group, 0)) * scale.float().repeat_interleave(group, 0))
    return (dense.to(dtype), *int4_mma.repack(values, scale, zero))


def main():
    results = {"staging": STAGING, "extra": EXTRA, "checks": [], "times": []}
    checked = [(1, 128, 64, 64), (300, 256, 320, 64), (1024, 4096, 4096, 128), (77, 384, 1024, 128)]
    for dtype, (m, n, k, group), (tokens, wg), with_bias in itertools.product(
            (torch.bfloat16, torch.float16), checked, VARIANTS, (False, True)):
        torch.manual_seed(0)
        dense, words, pairs = weight(n, k, group, dtype)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        launch(permute_k(x) if PERMUTED else x, words, pairs, bias, out, group, tokens, wg)
        exact = x.float() @ dense.float() + (0 if bias is None else bias.float())
        eager = torch.nn.functional.linear(x, dense.t(), bias).float()
        results["checks"].append(dict(dtype=str(dtype), m=m, n=n, k=k, tokens=tokens, wg=wg, bias=with_bias,
                                      error=(out.float() - exact).abs().max().item(),
                                      eager_error=(eager - exact).abs().max().item()))
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]:
        dense, words, pairs = weight(n, k, 128, torch.bfloat16)
        linear_weight = dense.t().contiguous()
        for m in (256, 1024, 2048, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            row = dict(m=m, n=n, k=k, bf16=triton.testing.do_bench(lambda: torch.nn.functional.linear(x, linear_weight)))
            x_in = permute_k(x).contiguous() if PERMUTED else x
            for tokens, wg in VARIANTS:
                row[f"tokens{tokens}_wg{wg}"] = triton.testing.do_bench(
                    lambda: launch(x_in, words, pairs, None, out, 128, tokens, wg))
            if PERMUTED:
                row["permute_x"] = triton.testing.do_bench(lambda: permute_k(x).contiguous())
            results["times"].append(row)
            print(row, flush=True)
    Path(OUT_FILE).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
