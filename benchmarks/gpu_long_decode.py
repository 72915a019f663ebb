"""A serving loop's long run: thousands of decode steps under CUDA graphs, the position growing and the batch
changing, per linear form, plain Inductor beside qfuse (issue #41, item 3).

    python benchmarks/gpu_long_decode.py [--steps 10000] [--layers 2] [--batches 1,4,8] [--variants a,b] [--out F.json]

The model is `gpu_llm_decode.Decoder` (Llama-3-8B layer sizes, static KV cache) compiled with
mode="reduce-overhead". Requests follow each other: a request decodes from position 64 to the cache's end
(448 steps), one token a sequence, and the next request has the next batch size of `--batches`. Per variant
(each compiled after `torch._dynamo.reset()`), in one run:
- GPU memory (`torch.cuda.memory_allocated`) once every batch size has run a request (steady) and at the end:
  the growth between them must be nil; the peak over the run; the model's own weights, and the bytes of the
  weights qfuse's kernels prepared (`qfuse.kernels.prepared.prepared_weights`);
- the graphs Dynamo compiled (`unique_graphs`), against plain Inductor's on the same loop;
- the output against the eager model's on the same input, every `--sample-every` steps: the largest
  relative error (norm of the difference over the norm of eager's output).
"""

from __future__ import annotations

import argparse
import gc

import torch
from torch._dynamo.utils import counters

from gpu_llm_decode import DIM, MAX_SEQ, START, VARIANTS, Decoder, compile_options, picked_variants
from qfuse.bench import add_output_arguments, format_table, machine, out_path, progress, write
from qfuse.kernels.prepared import prepared_weights

MIB = 2**20
REQUEST_STEPS = MAX_SEQ - START
DEFAULT_FORMS = ("gptq int4", "fp8 W8A8", "int8 W8A8", "int8 weight-only")  # each under Inductor and qfuse


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def prepared_bytes() -> int:
    return sum(tensor_bytes(vars(weight).values()) for weight in prepared_weights())


def long_run(name: str, layers: int, steps: int, batches: tuple[int, ...], sample_every: int) -> dict:
    """One variant's run (see the module docstring): its memory, compiles and largest error against eager."""
    form, backend, *qfuse_options = VARIANTS[name]
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    before, prepared_before = torch.cuda.memory_allocated(), prepared_bytes()
    model = Decoder(form, layers, max(batches)).eval()
    weights = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    compiled = torch.compile(model, backend=backend, **compile_options("reduce-overhead", *qfuse_options))
    generator = torch.Generator(device="cuda").manual_seed(1)
    pool = {batch: [torch.randn(batch, 1, DIM, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.1
                    for _ in range(4)] for batch in batches}
    graphs = counters["stats"]["unique_graphs"]
    steady, error = None, 0.0
    with torch.no_grad():
        for step in range(steps):
            request, offset = divmod(step, REQUEST_STEPS)
            batch = batches[request % len(batches)]
            if offset == 0 and request == len(batches):
                torch.cuda.synchronize()
                steady = torch.cuda.memory_allocated()
            x, position = pool[batch][step % 4], torch.tensor([START + offset], device="cuda")
            out = compiled(x, position)
            if step % sample_every == sample_every - 1:
                out = out.float().clone()
                expected = model(x, position).float()
                error = max(error, ((out - expected).norm() / expected.norm()).item())
                del expected
            del out  # the step's output: a serving loop has consumed it before the next step
        torch.cuda.synchronize()
    end = torch.cuda.memory_allocated()
    row = dict(variant=name, layers=layers, steps=steps, batches=",".join(map(str, batches)),
               graphs=counters["stats"]["unique_graphs"] - graphs, weights_mib=round(weights / MIB, 1),
               prepared_mib=round((prepared_bytes() - prepared_before) / MIB, 1),
               steady_mib=round(((steady or end) - before) / MIB, 1), end_mib=round((end - before) / MIB, 1),
               growth_mib=round((end - (steady or end)) / MIB, 3),
               peak_mib=round((torch.cuda.max_memory_allocated() - before) / MIB, 1), max_error=round(error, 5))
    progress(f"{name}: {row}")
    del compiled, model
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--variants", default=",".join(f"{form} ({backend})" for form in DEFAULT_FORMS
                                                       for backend in ("Inductor", "qfuse")),
                        help="the variants to run (gpu_llm_decode's names: a whole name that variant alone, a part "
                             "of names every variant whose name has it)")
    add_output_arguments(parser, "gpu_long_decode", quick="600 steps, batches 1 and 4")
    args = parser.parse_args()
    steps, batches = args.steps, tuple(int(b) for b in args.batches.split(","))
    if args.quick:
        steps, batches = 600, (1, 4)
    wanted = [part for part in args.variants.split(",") if part]
    rows = [long_run(name, args.layers, steps, batches, args.sample_every) for name in picked_variants(wanted)]
    header = list(rows[0])
    print(format_table([[row[column] for column in header] for row in rows], header))
    write(out_path(args, "gpu_long_decode"), rows, machine=machine())


if __name__ == "__main__":
    main()
