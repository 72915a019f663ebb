"""W4A16 prefill on an H200, tried for issue #39: one Triton kernel that dequantizes the int4 weight in registers
and multiplies (the weight's bytes [N, K / 2], k even in the low nibble, unpacked with `tl.join`; the weight as
the dot's left operand, `swap`, or x @ w^T, `xw`), against cuBLAS's bf16 matmul, Inductor's own dequantize + mm
on the compressed-tensors form, and a dequantize kernel in [64, 128] tiles followed by cuBLAS.

    python benchmarks/explorations/gpu_int4_prefill_fused.py [OUT.json]
    # benchmarks/results/gpu_int4_prefill_fused_h200.json; docs/benchmarks.md, "W4A16 prefill"

Times from `triton.testing.do_bench` (one weight, warm L2), ratios to the bf16 matmul of the same run.
"""

import json, sys
import torch, triton, triton.language as tl
from triton.testing import do_bench

OUT_FILE = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/gpu_int4_prefill_fused.json"

@triton.jit
def w4_prefill(x_ptr, wb_ptr, s_ptr, out_ptr, M, N, K, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_kb = tl.arange(0, BK // 2)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    m_mask = offs_m < M
    half_k = K // 2
    groups = K // GROUP
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        b = tl.load(wb_ptr + offs_n[:, None] * half_k + (k0 // 2 + offs_kb)[None, :], mask=n_mask[:, None], other=0)
        lo = (b & 0xF).to(tl.int16)
        hi = (b >> 4).to(tl.int16)
        q = tl.join(lo, hi).reshape(BN, BK)
        s = tl.load(s_ptr + offs_n * groups + k0 // GROUP, mask=n_mask, other=0)
        w = (q - 8).to(tl.bfloat16) * s[:, None]
        if SWAP:
            xt = tl.load(x_ptr + offs_m[None, :] * K + (k0 + offs_k)[:, None], mask=m_mask[None, :], other=0)
            acc = tl.dot(w, xt, acc)
        else:
            xv = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0)
            acc = tl.dot(xv, tl.trans(w), acc)
    if SWAP:
        tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(tl.bfloat16), mask=m_mask[None, :] & n_mask[:, None])
    else:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def w4_dequant(wb_ptr, s_ptr, w_ptr, N, K, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_kb = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    b = tl.load(wb_ptr + offs_n[:, None] * (K // 2) + offs_kb[None, :])
    q = tl.join((b & 0xF).to(tl.int16), (b >> 4).to(tl.int16)).reshape(BN, BK)
    s = tl.load(s_ptr + offs_n * (K // GROUP) + (pid_k * BK) // GROUP)
    w = (q - 8).to(tl.bfloat16) * s[:, None]
    tl.store(w_ptr + offs_n[:, None] * K + pid_k * BK + tl.arange(0, BK)[None, :], w)


def fused(x, wb, s, cfg):
    BM, BN, BK, warps, stages, swap = cfg
    M, K = x.shape
    N = wb.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    return w4_prefill[grid](x, wb, s, out, M, N, K, 128, BM, BN, BK, 8, swap, num_warps=warps, num_stages=stages), out


def dequant_then_mm(x, wb, s):
    N = wb.shape[0]; K = wb.shape[1] * 2
    w = torch.empty(N, K, device=x.device, dtype=torch.bfloat16)
    w4_dequant[(N // 64, K // 128)](wb, s, w, N, K, 128, 64, 128, num_warps=4)
    return x @ w.t()


def eager_dequant(words, s):  # compressed-tensors: int32 [N, K/8], nibble i at bits 4i, value - 8
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    q = ((words.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)
    w = (q - 8).to(torch.bfloat16)
    return (w.view(w.shape[0], -1, 128) * s.unsqueeze(-1)).flatten(-2)


def inductor_fn(x, words, s):
    return x @ eager_dequant(words, s).t()

def main():
    compiled = torch.compile(inductor_fn)

    CONFIGS = [(128, 128, 64, 8, 3, True), (128, 128, 64, 4, 4, True), (64, 128, 64, 4, 4, True), (128, 256, 64, 8, 3, True),
               (256, 128, 64, 8, 3, True), (128, 128, 128, 8, 3, True), (128, 128, 64, 8, 3, False), (128, 256, 64, 8, 3, False),
               (256, 128, 64, 8, 3, False)]
    rows = []
    torch.manual_seed(0)
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
        words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
        wb = words.view(torch.uint8)  # [N, K/2]: byte j = nibbles k = 2j (low), 2j + 1 (high)
        s = (torch.rand(n, k // 128, device="cuda") / 30).to(torch.bfloat16)
        wdq = eager_dequant(words, s)
        for m in (256, 1024, 2048, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x @ wdq.t()
            refn = ref.float().norm()
            t = {"bf16": do_bench(lambda: x @ wdq.t(), rep=200)}
            err = {}
            got = compiled(x, words, s); err["inductor"] = ((got.float() - ref.float()).norm() / refn).item()
            t["inductor"] = do_bench(lambda: compiled(x, words, s), rep=200)
            got = dequant_then_mm(x, wb, s); err["dequant+cublas"] = ((got.float() - ref.float()).norm() / refn).item()
            t["dequant+cublas"] = do_bench(lambda: dequant_then_mm(x, wb, s), rep=200)
            for cfg in CONFIGS:
                name = "fused " + "x".join(map(str, cfg[:3])) + f" w{cfg[3]} s{cfg[4]} {'swap' if cfg[5] else 'xw'}"
                try:
                    kern, got = fused(x, wb, s, cfg)
                    err[name] = ((got.float() - ref.float()).norm() / refn).item()
                    t[name] = do_bench(lambda: fused(x, wb, s, cfg), rep=200)
                    if m == 1024 and n == 4096 and k == 4096:
                        ptx = kern.asm.get("ptx", "")
                        print(name, "wgmma" in ptx, "regs", kern.n_regs, "spills", kern.n_spills, "st.shared", ptx.count("st.shared"), flush=True)
                except Exception as e:
                    print(name, "failed", type(e).__name__, str(e)[:200], flush=True)
            flops = 2 * m * n * k
            for name, ms in t.items():
                rows.append(dict(n=n, k=k, m=m, variant=name, ms=ms, tflops=flops / ms / 1e9, vs_bf16=t["bf16"] / ms, rel_err=err.get(name)))
            best = sorted(((a, b) for a, b in t.items() if a.startswith("fused")), key=lambda p: p[1])[:3]
            print(f"N={n} K={k} M={m}: bf16 {t['bf16']*1e3:.0f} us ({flops/t['bf16']/1e9:.0f} TF) inductor {t['bf16']/t['inductor']:.2f}x "
                  f"dq+cublas {t['bf16']/t['dequant+cublas']:.2f}x | " + ", ".join(f"{a} {t['bf16']/b:.2f}x" for a, b in best), flush=True)
    json.dump(rows, open(OUT_FILE, "w"), indent=1)


if __name__ == "__main__":
    main()
