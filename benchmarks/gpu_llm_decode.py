"""What an LLM user sees: a Llama decoder's decode step, tokens/s, per linear form and compiler, in one run.

    python benchmarks/gpu_llm_decode.py [--layers 8] [--batches 1,8] [--modes default,reduce-overhead] [--quick]

A gpt-fast-style decoder in plain torch at Llama-3-8B layer sizes (hidden 4096, 32 query / 8 key-value heads
of 128, MLP 14336, RMSNorm, rotary embeddings, a static KV cache written by `index_copy_`, SDPA), `--layers`
layers, without the embedding and the LM head (the same bf16 matmul in every variant). Its linears are:

    bf16        nn.Linear in bf16                                          torch.compile (Inductor)
    tinygemm    ATen's `_weight_int4pack_mm` called by the model (gpt-fast's / torchao's int4 path),
                symmetric g128                                              torch.compile (Inductor)
    gptq        GPTQ / compressed-tensors words unpacked in the forward (`gpu_weight_only.GptqLinear`),
                symmetric g128                                              Inductor, and backend="qfuse"

A step decodes one token for each of `batch` sequences at position 64 + step. Each variant runs 40 steps in
turns with the others, five rounds; the median step time gives tokens/s = batch / step time. The ratio to
the bf16 model is from the same run. Under mode="reduce-overhead" a step is one CUDA-graph replay (its time
is the GPU's); in default mode it includes the host's launch time, which moves between runs.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from gpu_weight_only import GROUP, GptqLinear
from qfuse.bench import add_output_arguments, format_table, machine, out_path, progress, write
from qfuse.kernels import int4_tinygemm

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4096, 32, 8, 128, 14336
MAX_SEQ = 512
START = 64  # the position of the first timed token: a prompt of 64 tokens already cached


class TinygemmLinear(nn.Module):
    """A symmetric g128 int4 linear that calls ATen's tinygemm itself, as gpt-fast's int4 path does."""

    def __init__(self, n: int, k: int, generator: torch.Generator):
        super().__init__()
        values = torch.randint(-8, 8, (k, n), device="cuda", generator=generator, dtype=torch.int8)
        scale = (torch.rand(k // GROUP, n, device="cuda", generator=generator) / (8 * k**0.5)).to(torch.bfloat16)
        packed = int4_tinygemm.pack(values, scale)
        self.register_buffer("weight", packed.data)
        self.register_buffer("scales_and_zeros", packed.scale)

    def forward(self, x):
        lead = x.shape[:-1]
        out = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.weight, GROUP, self.scales_and_zeros)
        return out.reshape(*lead, -1)


def linear(form: str, n: int, k: int, generator: torch.Generator) -> nn.Module:
    if form == "bf16":
        return nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    return {"tinygemm": TinygemmLinear, "gptq": GptqLinear}[form](n, k, generator)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device="cuda", dtype=torch.bfloat16))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate(x, cos, sin):
    """Rotary embedding of x [B, H, 1, D] by the position's cos / sin [1, 1, 1, D / 2] (pairs of halves)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, form: str, batch: int, generator: torch.Generator):
        super().__init__()
        self.wq, self.wo = linear(form, DIM, DIM, generator), linear(form, DIM, DIM, generator)
        self.wk, self.wv = linear(form, KV_HEADS * HEAD_DIM, DIM, generator), linear(form, KV_HEADS * HEAD_DIM, DIM, generator)
        self.w1, self.w3 = linear(form, HIDDEN, DIM, generator), linear(form, HIDDEN, DIM, generator)
        self.w2 = linear(form, DIM, HIDDEN, generator)
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)
        cache = (batch, KV_HEADS, MAX_SEQ, HEAD_DIM)
        self.register_buffer("k_cache", torch.zeros(cache, device="cuda", dtype=torch.bfloat16))
        self.register_buffer("v_cache", torch.zeros(cache, device="cuda", dtype=torch.bfloat16))

    def forward(self, x, input_pos, cos, sin, mask):
        batch = x.shape[0]
        h = self.attention_norm(x)
        q = self.wq(h).view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.wk(h).view(batch, 1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.wv(h).view(batch, 1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        attention = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(attention.transpose(1, 2).reshape(batch, 1, DIM))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, form: str, layers: int, batch: int):
        super().__init__()
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.layers = nn.ModuleList(Block(form, batch, generator) for _ in range(layers))
        self.norm = RMSNorm(DIM)
        frequencies = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
        angles = torch.outer(torch.arange(MAX_SEQ, device="cuda").float(), frequencies)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("causal", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool, device="cuda")))

    def forward(self, x, input_pos):
        cos, sin = self.cos[input_pos].view(1, 1, 1, -1), self.sin[input_pos].view(1, 1, 1, -1)
        mask = self.causal[input_pos].view(1, 1, 1, MAX_SEQ)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, mask)
        return self.norm(x)


VARIANTS = {  # name -> (linear form, backend)
    "bf16 (Inductor)": ("bf16", "inductor"),
    "tinygemm int4 (Inductor)": ("tinygemm", "inductor"),
    "gptq int4 (Inductor)": ("gptq", "inductor"),
    "gptq int4 (qfuse)": ("gptq", "qfuse"),
}


def step_ms(step, inputs, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(steps):
        step(*inputs[i])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def run(layers: int, batches, modes, steps: int, rounds: int) -> list[dict]:
    torch._dynamo.config.recompile_limit = 64  # one Block class compiled at several batch sizes and modes
    rows = []
    for batch in batches:
        inputs = [(torch.randn(batch, 1, DIM, device="cuda", dtype=torch.bfloat16) * 0.1,
                   torch.tensor([START + i], device="cuda")) for i in range(steps)]
        for mode in modes:
            torch._dynamo.reset()  # once: a reset between variants would make the earlier ones compile again
            compiled = {}
            for name, (form, backend) in VARIANTS.items():
                progress(f"batch {batch}, {mode}: compiling {name}")
                model = Decoder(form, layers, batch).eval()
                options = {} if mode == "default" else {"mode": mode}
                step = torch.compile(model, backend=backend, **options)
                with torch.no_grad():
                    for i in range(3):
                        step(*inputs[i])
                compiled[name] = (model, step)
            times = {name: [] for name in compiled}
            with torch.no_grad():
                for name, (_, step) in compiled.items():  # each warm again after all compiled
                    step_ms(step, inputs, 3)
                for _ in range(rounds):
                    for name, (_, step) in compiled.items():
                        times[name].append(step_ms(step, inputs, steps))
            base = statistics.median(times["bf16 (Inductor)"])
            for name, samples in times.items():
                ms = statistics.median(samples)
                rows.append(dict(batch=batch, mode=mode, variant=name, layers=layers, step_ms=round(ms, 4),
                                 tokens_per_s=round(batch / ms * 1e3, 1), vs_bf16=round(base / ms, 3),
                                 spread=round((max(samples) - min(samples)) / ms, 3)))
                progress(f"  {name}: {ms:.3f} ms a step, {base / ms:.2f}x bf16")
            del compiled
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="default,reduce-overhead")
    add_output_arguments(parser, "gpu_llm_decode", quick="2 layers, batch 1, reduce-overhead only")
    args = parser.parse_args()
    layers, batches, modes = args.layers, [int(b) for b in args.batches.split(",")], args.modes.split(",")
    if args.quick:
        layers, batches, modes = 2, [1], ["reduce-overhead"]
    rows = run(layers, batches, modes, steps=40, rounds=5)
    header = ["batch", "mode", "variant", "step_ms", "tokens_per_s", "vs_bf16", "spread"]
    print(format_table([[row[column] for column in header] for row in rows], header))
    write(out_path(args, "gpu_llm_decode"), rows, machine=machine())


if __name__ == "__main__":
    main()
