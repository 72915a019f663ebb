"""The CUDA W4A16 decode kernel on a checkpoint's own words against its repacked layout (an exploration, issue #41).

    python benchmarks/explorations/int4_checkpoint_decode.py [--ms 1,16] [--out FILE.json]

GPU µs per linear in one CUDA graph over weights past the L2 (three rounds in turns, the best of each), each
call's relative error against the float product, on the four Llama-3-8B shapes, for:
- the repacked weight (`int4_mma.repack`, the launch rule's pick);
- the same weight read in place (`int4_mma.checkpoint_weight`) as compressed-tensors stores it ([N, K / 8]
  words along K) and as AutoGPTQ does ([K / 8, N]), at the launch rule's pick and at 4 chunks ahead;
- the bf16 matmul.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from gpu_int4_mma import DECODER_SHAPES, GROUP, Int4Weight, stack_size  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, graph_us_in_turns, machine, out_path, progress, write  # noqa: E402
from qfuse.kernels.cuda import int4_mma  # noqa: E402

LAYOUTS = {"compressed-tensors": int4_mma.WORDS_ALONG_K, "autogptq": int4_mma.WORDS_ALONG_N}


def checkpoint_views(weight: Int4Weight, layout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [N, K / 8], scales [N, K / G]) of the weight's values, stored in `layout` (no zero points)."""
    k, n = weight.values.shape
    nibbles = (weight.values.t().to(torch.int32) + 8).reshape(n, k // 8, 8)
    packed = (nibbles << torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)).sum(-1, dtype=torch.int32)
    scales = weight.scale.t()
    if layout == int4_mma.WORDS_ALONG_K:
        return packed.contiguous(), scales.contiguous()
    return packed.t().contiguous().t(), scales.t().contiguous().t()


def run(ms: list[int]) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n, k in DECODER_SHAPES:
        weights = [Int4Weight(n, k, False, generator) for _ in range(stack_size(n * k // 2))]
        in_place = {name: [] for name in LAYOUTS}
        for name, layout in LAYOUTS.items():
            for weight in weights:
                packed, scales = checkpoint_views(weight, layout)
                table = int4_mma.checkpoint_weight([(packed, None, scales, None)], GROUP, "stored")
                in_place[name].append((table, packed, scales))  # (the views keep their storage alive)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, len(weights) // 4))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            warps, unroll = int4_mma.launch_shape(m, n, k)
            calls = {"repacked (launch rule)": [lambda w=w: int4_mma.int4_mma(x, *w.mma, None, GROUP, torch.bfloat16)
                                                for w in weights]}
            for name in LAYOUTS:
                for shape in ((warps, unroll), (warps, 4)) if unroll != 4 else ((warps, unroll),):
                    calls[f"{name} ({shape[0]} warps, {shape[1]} ahead)"] = [
                        lambda t=t, shape=shape: int4_mma.int4_mma_checkpoint(x, t[0], None, torch.bfloat16, shape)
                        for t in in_place[name]]
            calls["bf16 mm"] = [lambda w=w: x @ w.t() for w in dense]
            expected = x.float() @ weights[0].dequantized().float()
            errors = {name: ((graph[0]().float() - expected).norm() / expected.norm()).item()
                      for name, graph in calls.items() if name != "bf16 mm"}
            times = graph_us_in_turns(calls)
            for name, us in sorted(times.items(), key=lambda item: item[1]):
                rows.append(dict(n=n, k=k, m=m, kernel=name, us=round(us, 2), vs_bf16=round(times["bf16 mm"] / us, 2),
                                 vs_repacked=round(times["repacked (launch rule)"] / us, 3), rel_error=errors.get(name)))
            progress(f"N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.2f}" for name, us in times.items()))
        del weights, in_place, dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,16", help="rows of x, comma-separated")
    add_output_arguments(parser, "gpu_int4_checkpoint_decode")
    args = parser.parse_args()
    rows = run([int(m) for m in args.ms.split(",")])
    header = ["n", "k", "m", "kernel", "us", "vs_bf16", "vs_repacked", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_checkpoint_decode"), rows, machine=machine())


if __name__ == "__main__":
    main()
