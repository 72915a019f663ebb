"""W4A16 prefill in Triton with TMA descriptors and warp specialization (an exploration for issue #39).

    python benchmarks/explorations/gpu_int4_prefill_tma.py [OUT.json]

Session 32's fused Triton kernel (`gpu_int4_prefill_fused.py`: the weight dequantized in registers as the dot's
left operand, x and the weight by `tl.load`) reached 0.45-0.58x the bf16 matmul; session 33's CUDA wgmma kernel
found its loop near cuBLAS once x's tiles stopped costing (docs/benchmarks.md, "W4A16 prefill on wgmma"). Here both
operands come by TMA (`TensorDescriptor`: x [BM, BK] tiles, the weight's bytes [BN, BK / 2]), and the K loop asks
Triton for warp specialization (`tl.range(..., warp_specialize=True)`: producer warps issue the copies, consumers
dequantize and multiply) or for its software pipeline alone. Times from `triton.testing.do_bench` (one weight, warm
L2), ratios to the bf16 matmul and to the dequantize + cuBLAS of the same run.

Written in session 40 after its device time was spent: not yet run on a GPU (its first run is the next step of #39).
"""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).parent))
from gpu_int4_prefill_fused import dequant_then_mm, eager_dequant  # noqa: E402

OUT_FILE = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/gpu_int4_prefill_tma.json"


@triton.jit
def w4_prefill_tma(x_desc, w_desc, s_ptr, out_ptr, M, N, K, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    groups = K // GROUP
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=WS):
        b = w_desc.load([pid_n * BN, k0 // 2])  # [BN, BK / 2] bytes: k even in the low nibble
        q = tl.join((b & 0xF).to(tl.int16), (b >> 4).to(tl.int16)).reshape(BN, BK)
        s = tl.load(s_ptr + offs_n * groups + k0 // GROUP, mask=offs_n < N, other=0)
        w = (q - 8).to(tl.bfloat16) * s[:, None]
        xt = x_desc.load([pid_m * BM, k0])  # [BM, BK]
        acc = tl.dot(w, tl.trans(xt), acc)
    mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(tl.bfloat16), mask=mask)


def fused(x, wb, s, cfg):
    bm, bn, bk, warps, stages, ws = cfg
    m, k = x.shape
    n = wb.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(wb, [bn, bk // 2])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    w4_prefill_tma[grid](x_desc, w_desc, s, out, m, n, k, 128, bm, bn, bk, 8, stages, ws, num_warps=warps)
    return out


CONFIGS = [(128, 128, 64, 4, 3, True), (128, 128, 64, 8, 3, True), (256, 128, 64, 8, 3, True),
           (128, 256, 64, 8, 3, True), (128, 128, 64, 8, 4, False), (256, 128, 64, 8, 3, False)]


def main():
    rows = []
    torch.manual_seed(0)
    for n, k in ((4096, 4096), (14336, 4096)):
        words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
        wb = words.view(torch.uint8)  # [N, K / 2]
        s = (torch.rand(n, k // 128, device="cuda") / 30).to(torch.bfloat16)
        wdq = eager_dequant(words, s)
        for m in (1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x @ wdq.t()
            t = {"bf16": do_bench(lambda: x @ wdq.t(), rep=100),
                 "dequant+cublas": do_bench(lambda: dequant_then_mm(x, wb, s), rep=100)}
            err = {}
            for cfg in CONFIGS:
                name = "tma " + "x".join(map(str, cfg[:3])) + f" w{cfg[3]} s{cfg[4]} {'ws' if cfg[5] else 'pipelined'}"
                try:
                    got = fused(x, wb, s, cfg)
                    err[name] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    t[name] = do_bench(lambda cfg=cfg: fused(x, wb, s, cfg), rep=100)
                except Exception as error:  # noqa: BLE001 - a config Triton cannot compile here is reported and skipped
                    print(name, "failed:", type(error).__name__, str(error).splitlines()[0][:200], flush=True)
            flops = 2 * m * n * k
            for name, ms in t.items():
                rows.append(dict(n=n, k=k, m=m, variant=name, ms=ms, tflops=flops / ms / 1e9, vs_bf16=t["bf16"] / ms,
                                 rel_err=err.get(name)))
            print(f"N={n} K={k} M={m}: bf16 {t['bf16'] * 1e3:.0f} us, dequant+cublas {t['bf16'] / t['dequant+cublas']:.2f}x | "
                  + ", ".join(f"{a} {t['bf16'] / b:.2f}x (err {err.get(a, 0):.1e})" for a, b in t.items()
                              if a.startswith("tma")), flush=True)
    Path(OUT_FILE).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
