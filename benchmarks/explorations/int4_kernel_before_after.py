"""The CUDA W4A16 decode kernel against an earlier version of itself, per Llama-3-8B linear, in one run (an
exploration).

    mkdir -p /tmp/before && for f in int4_mma.py int4_mma.cu; do
        git show COMMIT:qfuse/kernels/cuda/$f > /tmp/before/$f; done
    python benchmarks/explorations/int4_kernel_before_after.py --before /tmp/before [--out FILE.json]

The earlier kernel's module is loaded from `--before` (its Python launcher and .cu source, each weight repacked by
its own `repack`), the current one from qfuse; each at its own launch rule's pick, M = 1, 8, 16 (and 32, the
current kernel only), timed in turns (three rounds, the best of each) in one CUDA graph over weights past the L2,
with each one's relative error against the float product.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from gpu_int4_mma import DECODER_SHAPES, GROUP, Int4Weight, stack_size
from qfuse.bench import add_output_arguments, format_table, graph_us_in_turns, machine, out_path, progress, write
from qfuse.kernels.cuda import int4_mma as current
from qfuse.kernels.cuda import launch



def load_before(folder: Path):
    spec = importlib.util.spec_from_file_location("int4_mma_before", folder / "int4_mma.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SOURCE, module.COMMON = folder / "int4_mma.cu", launch.COMMON  # (COMMON: a version before `launch`)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a folder with the earlier int4_mma.py and .cu")
    add_output_arguments(parser, "gpu_int4_loop_order", quick="the gate / up shape only")
    args = parser.parse_args()
    before = load_before(args.before)
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n, k in DECODER_SHAPES[2:3] if args.quick else DECODER_SHAPES:
        weights = [Int4Weight(n, k, False, generator) for _ in range(stack_size(n * k // 2))]
        earlier = [before.repack(weight.values, weight.scale, weight.zero) for weight in weights]
        for m in (1, 8, 16, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = x.float() @ weights[0].dequantized().float()
            calls = {"after": [lambda w=w: current.int4_mma(x, *w.mma, None, GROUP, torch.bfloat16) for w in weights]}
            if m <= before.MAX_ROWS:
                calls["before"] = [lambda w=w: before.int4_mma(x, *w, None, GROUP, torch.bfloat16) for w in earlier]
            times = graph_us_in_turns(calls)  # best of three rounds in turns
            errors = {name: ((calls[name][0]().float() - expected).norm() / expected.norm()).item() for name in calls}
            row = dict(n=n, k=k, m=m, after_us=round(times["after"], 2), after_error=errors["after"])
            if "before" in times:
                row.update(before_us=round(times["before"], 2), before_error=errors["before"],
                           speedup=round(times["before"] / times["after"], 3))
            rows.append(row)
            progress(str(row))
    header = ["n", "k", "m", "before_us", "after_us", "speedup", "before_error", "after_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_loop_order"), rows, machine=machine())


if __name__ == "__main__":
    main()
