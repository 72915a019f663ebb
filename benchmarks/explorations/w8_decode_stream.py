"""The CUDA 8-bit decode kernel against an earlier version of itself, per Llama-3-8B linear (an exploration).

    mkdir -p /tmp/before && for f in w8_mma.py w8_mma.cu; do
        git show COMMIT:qfuse/kernels/cuda/$f > /tmp/before/$f; done
    python benchmarks/explorations/w8_decode_stream.py --before /tmp/before [--ms 1,8,16] [--out FILE.json]

GPU µs per linear in one CUDA graph over weights past the L2 (three rounds in turns, the best of each), each call's
relative error against the float64 reference, for fp8 and int8 W8A8 and int8 W8A16: the kernel of `--before` and
the current one at their launch rules' picks; the current one with 8 chunks loaded ahead, and compiled without
`__launch_bounds__`' minimum of blocks a multiprocessor (`MIN_BLOCKS` 1: as many registers as the compiler wants);
the Triton kernel kernel choice takes above 8 rows for W8A8; the bf16 matmul. The weight's repacked layout is the
same in both versions.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_int4_mma import DECODER_SHAPES, stack_size  # noqa: E402
from gpu_w8_mma import FORMS, Weight, random_values, reference  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, graph_us_in_turns, machine, out_path, progress, write  # noqa: E402
from qfuse.kernels import get_kernel  # noqa: E402
from qfuse.kernels.cuda import w8_mma as current  # noqa: E402

STREAM_FORMS = ("fp8 W8A8", "int8 W8A8", "int8 W8A16")


def load_module(python: Path, source: Path, name: str):
    """w8_mma.py of `python` as its own module, compiling `source` (its launch plans cached apart from qfuse's)."""
    spec = importlib.util.spec_from_file_location(name, python)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SOURCE = source
    return module


def kernel_calls(module, x, weights, weight_dtype, scale_a, shape=None) -> list:
    """A call of `module`'s w8_mma a weight of the stack, at `shape` (its launch rule's pick where None)."""
    return [lambda w=w: module.w8_mma(x, w.cuda.data, weight_dtype, scale_a, w.scale, None, torch.bfloat16, shape)
            for w in weights]


def run(ms: list[int], before, unbounded) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    triton = get_kernel("triton")
    rows = []
    for n, k in DECODER_SHAPES:
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(2)]
        for form in STREAM_FORMS:
            activation_dtype, weight_dtype = FORMS[form]
            weights = [Weight(n, k, weight_dtype, generator) for _ in range(stack_size(n * k))]
            for m in ms:
                x = random_values(m, k, activation_dtype, generator)
                scale_a = None if activation_dtype == torch.bfloat16 else torch.rand(m, 1, device="cuda") / 100
                rule = current.launch_shape(m, n)
                eight_ahead = (*rule[:2], 8)
                case = (x, weights, weight_dtype, scale_a)
                calls = {"before (launch rule)": kernel_calls(before, *case),
                         "after (launch rule)": kernel_calls(current, *case),
                         "after, 8 chunks ahead": kernel_calls(current, *case, eight_ahead),
                         "after, no minimum of blocks": kernel_calls(unbounded, *case),
                         "after, 8 ahead, no minimum of blocks": kernel_calls(unbounded, *case, eight_ahead)}
                if scale_a is None:
                    calls["triton"] = [lambda w=w: triton.weight_only_apply(x, w.triton, None, torch.bfloat16)
                                       for w in weights]
                else:
                    calls["triton"] = [lambda w=w: triton.apply(x, w.triton, scale_a, None, None, torch.bfloat16)
                                       for w in weights]
                xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                calls["bf16 mm"] = [lambda w=w: xb @ w.t() for w in dense]
                expected = reference(form, weights[0], x, scale_a)
                errors = {name: ((graph[0]().double() - expected).norm() / expected.norm()).item()
                          for name, graph in calls.items() if name != "bf16 mm"}
                times = graph_us_in_turns(calls)  # best of three rounds in turns
                for name, us in sorted(times.items(), key=lambda item: item[1]):
                    rows.append(dict(form=form, n=n, k=k, m=m, kernel=name, us=round(us, 2),
                                     vs_bf16=round(times["bf16 mm"] / us, 2), rel_error=errors.get(name)))
                progress(f"{form} N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.2f}" for name, us in times.items()))
            del weights
        del dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a folder with the earlier w8_mma.py and .cu")
    parser.add_argument("--ms", default="1,8,16", help="rows of x, comma-separated")
    add_output_arguments(parser, "gpu_w8_decode_stream")
    args = parser.parse_args()
    before = load_module(args.before / "w8_mma.py", args.before / "w8_mma.cu", "w8_mma_before")
    unbounded_source = Path(tempfile.mkdtemp()) / "w8_mma_unbounded.cu"
    unbounded_source.write_text("#define MIN_BLOCKS 1\n" + current.SOURCE.read_text())
    unbounded = load_module(Path(current.__file__), unbounded_source, "w8_mma_unbounded")
    rows = run([int(m) for m in args.ms.split(",")], before, unbounded)
    header = ["form", "n", "k", "m", "kernel", "us", "vs_bf16", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_w8_decode_stream"), rows, machine=machine())


if __name__ == "__main__":
    main()
