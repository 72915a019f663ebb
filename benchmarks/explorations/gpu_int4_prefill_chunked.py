"""W4A16 prefill on an H200, tried for issue #39: the weight dequantized and multiplied in chunks of N rows, each
chunk's bf16 buffer small enough to stay in the L2 between its write and cuBLAS's read, one buffer for all chunks.
Against the whole weight dequantized at once (qfuse's prefill today: a [64, 128]-tile dequantize, then cuBLAS)
and the bf16 matmul, in one run. Each chunk's product goes into its columns of the output (`out[:, n0:n1]`, a
row stride of N), or into its rows of the transposed output (`out_t[n0:n1] = w @ x^T`).

    python benchmarks/explorations/gpu_int4_prefill_chunked.py [OUT.json]
    # benchmarks/results/gpu_int4_prefill_chunked_h200.json; docs/benchmarks.md, "W4A16 prefill"

Times from `triton.testing.do_bench` (its L2 flush between calls: the weight comes from memory), ms.
"""

import json
import sys

import torch
from gpu_int4_prefill_fused import eager_dequant, w4_dequant
from triton.testing import do_bench

OUT_FILE = sys.argv[1] if len(sys.argv) > 1 else "gpu_int4_prefill_chunked.json"
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 4096)]  # (N, K)
ROWS = (1024, 2048, 4096)
CHUNKS = (1, 2, 4, 8)  # the weight's N rows in this many chunks


def dequantize(wb, s, buffer, n0, rows):
    k = wb.shape[1] * 2
    w4_dequant[(rows // 64, k // 128)](wb[n0:], s[n0:], buffer, rows, k, 128, 64, 128, num_warps=4)


def chunked_columns(x, wb, s, chunks, buffer, out):
    """out[:, n0:n1] = x @ w[n0:n1]^T, chunk by chunk through one buffer."""
    rows = wb.shape[0] // chunks
    for n0 in range(0, wb.shape[0], rows):
        dequantize(wb, s, buffer, n0, rows)
        torch.mm(x, buffer[:rows].t(), out=out[:, n0:n0 + rows])
    return out


def chunked_rows(x, wb, s, chunks, buffer, out_t):
    """out_t[n0:n1] = w[n0:n1] @ x^T (the output transposed), chunk by chunk through one buffer."""
    rows = wb.shape[0] // chunks
    for n0 in range(0, wb.shape[0], rows):
        dequantize(wb, s, buffer, n0, rows)
        torch.mm(buffer[:rows], x.t(), out=out_t[n0:n0 + rows])
    return out_t


def main():
    torch.manual_seed(0)
    results = []
    for n, k in SHAPES:
        words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
        wb = words.view(torch.uint8)  # [N, K / 2]: byte j holds k = 2j (low nibble) and 2j + 1
        s = (torch.rand(n, k // 128, device="cuda") / 30).to(torch.bfloat16)
        dense = eager_dequant(words, s)
        buffer = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = (x @ dense.t()).float()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            out_t = torch.empty(n, m, device="cuda", dtype=torch.bfloat16)
            row = dict(n=n, k=k, m=m, bf16=do_bench(lambda: x @ dense.t()))
            for chunks in CHUNKS:
                for name, run, result in (("columns", chunked_columns, out), ("rows", chunked_rows, out_t)):
                    got = run(x, wb, s, chunks, buffer, result)
                    got = got if name == "columns" else got.t()
                    row[f"{name}_error_{chunks}"] = ((got.float() - expected).norm() / expected.norm()).item()
                    row[f"{name}_{chunks}"] = do_bench(lambda: run(x, wb, s, chunks, buffer, result))
            row["transpose_out"] = do_bench(lambda: out_t.t().contiguous())
            results.append(row)
            print(f"N={n} K={k} M={m}: bf16 {row['bf16'] * 1e3:.1f} us | " + " ".join(
                f"{name}/{c} {row['bf16'] / row[f'{name}_{c}']:.2f}x" for name in ("columns", "rows") for c in CHUNKS),
                flush=True)
    with open(OUT_FILE, "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
