"""What an LLM user sees: a Llama decoder's decode step, tokens/s, per linear form and compiler, in one run.

    python benchmarks/gpu_llm_decode.py [--layers 8] [--batches 1,8] [--modes default,reduce-overhead] [--quick]
    python benchmarks/gpu_llm_decode.py --prefill 2048 [--layers 8] [--modes default] [--variants ...]

A gpt-fast-style decoder in plain torch at Llama-3-8B layer sizes (hidden 4096, 32 query / 8 key-value heads
of 128, MLP 14336, RMSNorm, rotary embeddings, a static KV cache written by `index_copy_`, SDPA), `--layers`
layers, without the embedding and the LM head (the same bf16 matmul in every variant). Its linears are:

    bf16        nn.Linear in bf16                                          torch.compile (Inductor)
    tinygemm    ATen's `_weight_int4pack_mm` called by the model (gpt-fast's / torchao's int4 path),
                symmetric g128                                              torch.compile (Inductor)
    gptq        GPTQ / compressed-tensors words unpacked in the forward (`gpu_weight_only.GptqLinear`),
                symmetric g128                                              Inductor, and backend="qfuse"
    fp8         fp8 W8A8 as vLLM's torch fallback writes it: dynamic per-token fp8 activation, per-channel
                fp8 weight, row-wise `_scaled_mm`                           Inductor, and backend="qfuse"
    int8        int8 W8A8 the same way: per-token int8, `_int_mm` on rows padded to 17 (cuBLAS takes no
                fewer; vLLM's fallback pads so too), cut back               Inductor, and backend="qfuse"
    int8wo      int8 weight-only as torchao's linear computes it (`gpu_weight_only.Int8WeightOnlyLinear`)
    fp8wo       fp8 weight-only, per channel (`gpu_weight_only.Fp8WeightOnlyLinear`)
    gemlite_*   GemLite's own modules (`gemlite_linear`: A16W4 g128, A16W8 int8, A8W8 fp8 dynamic), its
                Triton kernels as a custom op                                torch.compile (Inductor)
    torchao_*   the bf16 model after torchao's `quantize_` (`TORCHAO_CONFIGS`: int4 tile-packed, which is
                tinygemm; int8 weight-only; fp8 row-wise dynamic; int8 dynamic), `set_inductor_config=False`
                so that every variant compiles with the same Inductor settings      Inductor, and qfuse
    torchao_*_unwrapped   the same after `torchao.utils.unwrap_tensor_subclass` (plain tensors at the compiled
                boundary: none of a subclass's per-call flattening and guards)      Inductor, and qfuse

GemLite and torchao travel to the GPU machine as wheels (docs/benchmarks.md says how); a variant whose
package is missing, or which cannot run a batch (`CANNOT_RUN`), is left out with the reason.

`--profile` instead profiles three decode steps of each variant in each of `--modes` (torch.profiler: every
kernel's GPU time, a CUDA graph's replay split into its kernels; the host's events by their own CPU time) and
prints the largest kernels and their sum, the host's time until a step returns (20 steps timed without the
profiler: above the GPU's sum a step is host-bound) and its largest events, per step. `--variants` picks
variants by name (a comma-separated list of substrings, or of whole names: that variant alone). `--prefill TOKENS`
instead times one prompt of TOKENS tokens through the same decoder (batch 1, its KV cache TOKENS long), per variant and mode. A step decodes one token
for each of `batch` sequences at position 64 + step. Each variant runs 40 steps in turns with the others, five rounds; the median step time gives tokens/s = batch / step time. The ratio to
the bf16 model is from the same run. Under mode="reduce-overhead" a step is one CUDA-graph replay (its time
is the GPU's); in default mode it includes the host's launch time, which moves between runs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_weight_only import GROUP, Fp8WeightOnlyLinear, GptqLinear, Int8WeightOnlyLinear
from qfuse.bench import add_output_arguments, format_table, machine, out_path, progress, write
from qfuse.kernels import int4_tinygemm
from qfuse.passes.families import PATTERN_FAMILIES

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


FP8 = torch.float8_e4m3fn
CUBLAS_INT8_ROWS = 17  # cuBLAS's int8 GEMM takes no fewer rows


class W8A8Linear(nn.Module):
    """fp8 or int8 W8A8 as vLLM's torch fallbacks write it: the activation quantized per token in float32
    (fp8: x / scale, clamped; int8: rounded and clamped), the weight per channel; fp8 by row-wise
    `_scaled_mm`, int8 by `_int_mm` on rows padded to 17 and the float epilogue, cut back to M rows."""

    def __init__(self, n: int, k: int, generator: torch.Generator, dtype: torch.dtype):
        super().__init__()
        if dtype == FP8:
            weight = (torch.randn(n, k, device="cuda", generator=generator) * 64).clamp(-448, 448).to(FP8)
        else:
            weight = torch.randint(-127, 128, (n, k), device="cuda", generator=generator, dtype=torch.int8)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", torch.rand(n, 1, device="cuda", generator=generator) / (64 * k**0.5))
        self.dtype = dtype

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        amax = x2.abs().amax(dim=-1, keepdim=True).to(torch.float32)
        if self.dtype == FP8:
            scale = (amax / 448.0).clamp(min=1e-12)
            q = (x2.to(torch.float32) / scale).clamp(-448.0, 448.0).to(FP8)
            out = torch._scaled_mm(q, self.weight.t(), scale, self.weight_scale.t(), out_dtype=x.dtype)
        else:
            scale = (amax / 127.0).clamp(min=1e-12)
            q = torch.round(x2.to(torch.float32) / scale).clamp(-128, 127).to(torch.int8)
            if rows < CUBLAS_INT8_ROWS:
                q = F.pad(q, (0, 0, 0, CUBLAS_INT8_ROWS - rows))
            out = torch.narrow(torch._int_mm(q, self.weight.t()), 0, 0, rows)
            out = (out.to(torch.float32) * scale * self.weight_scale.t()).to(x.dtype)
        return out.reshape(*x.shape[:-1], -1)


@functools.cache
def _load_gemlite_configs() -> None:
    """GemLite's H100 launch configs on an H200 (it ships none for it), once a run."""
    import gemlite

    if gemlite.core.get_default_cache_config() is None and "H200" in torch.cuda.get_device_name():
        gemlite.load_config(str(Path(gemlite.__file__).with_name("configs") / "h100.json"))


def gemlite_linear(form: str, n: int, k: int, generator: torch.Generator) -> nn.Module:
    """GemLite's own module (its Triton kernels; for A8W8 its own activation quant) on the same random weights as
    qfuse's forms: A16W4 g128 (values + 8 with zero points 8, as HQQ stores them), A16W8 int8 weight-only,
    A8W8 fp8 dynamic per token, per-channel scales. GemLite ships tuned launch configs per GPU; one made for the
    H100 is loaded on an H200, the same Hopper chip, where it has none (else it would autotune)."""
    from gemlite.helper import A8W8_fp8_dynamic, A16W8_INT8, A16Wn

    _load_gemlite_configs()
    if form == "gemlite_int4":
        values = torch.randint(0, 16, (n, k), device="cuda", generator=generator, dtype=torch.uint8)
        scale = (torch.rand(n, k // GROUP, device="cuda", generator=generator) / (8 * k**0.5)).to(torch.bfloat16)
        zeros = torch.full_like(scale, 8)
        return A16Wn(device="cuda", dtype=torch.bfloat16).from_weights(values, scale, zeros, W_nbits=4, group_size=GROUP)
    scale = torch.rand(n, 1, device="cuda", generator=generator) / (64 * k**0.5)
    if form == "gemlite_int8wo":
        weight = torch.randint(-127, 128, (n, k), device="cuda", generator=generator, dtype=torch.int8)
        return A16W8_INT8(device="cuda", dtype=torch.bfloat16).from_weights(weight, scales=scale.to(torch.bfloat16))
    weight = (torch.randn(n, k, device="cuda", generator=generator) * 64).clamp(-448, 448).to(FP8)
    return A8W8_fp8_dynamic(device="cuda", dtype=torch.bfloat16).from_weights(weight, scales=scale)


def linear(form: str, n: int, k: int, generator: torch.Generator) -> nn.Module:
    if form.startswith("gemlite"):
        return gemlite_linear(form, n, k, generator)
    if form == "bf16" or form.startswith("torchao"):  # torchao's configs quantize the bf16 model (`build`)
        return nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    if form in ("fp8", "int8"):
        return W8A8Linear(n, k, generator, FP8 if form == "fp8" else torch.int8)
    if form == "fp8wo":
        return Fp8WeightOnlyLinear(n, k, generator, blocks=False)
    return {"tinygemm": TinygemmLinear, "gptq": GptqLinear, "int8wo": Int8WeightOnlyLinear}[form](n, k, generator)


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
    def __init__(self, form: str, batch: int, generator: torch.Generator, max_seq: int = MAX_SEQ):
        super().__init__()
        self.wq, self.wo = linear(form, DIM, DIM, generator), linear(form, DIM, DIM, generator)
        self.wk, self.wv = linear(form, KV_HEADS * HEAD_DIM, DIM, generator), linear(form, KV_HEADS * HEAD_DIM, DIM, generator)
        self.w1, self.w3 = linear(form, HIDDEN, DIM, generator), linear(form, HIDDEN, DIM, generator)
        self.w2 = linear(form, DIM, HIDDEN, generator)
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)
        cache = (batch, KV_HEADS, max_seq, HEAD_DIM)
        self.register_buffer("k_cache", torch.zeros(cache, device="cuda", dtype=torch.bfloat16))
        self.register_buffer("v_cache", torch.zeros(cache, device="cuda", dtype=torch.bfloat16))

    def forward(self, x, input_pos, cos, sin, mask):
        batch, tokens = x.shape[0], x.shape[1]  # (one token a sequence at decode, the prompt at prefill)
        h = self.attention_norm(x)
        q = self.wq(h).view(batch, tokens, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.wk(h).view(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.wv(h).view(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache, v_cache = self.k_cache[:batch], self.v_cache[:batch]  # the first `batch` sequences' slots
        k_cache.index_copy_(2, input_pos, k)
        v_cache.index_copy_(2, input_pos, v)
        attention = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(attention.transpose(1, 2).reshape(batch, tokens, DIM))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


TORCHAO_CONFIGS = {  # form -> torchao config (class name, keywords); each keeps Inductor's global settings
    "torchao_int4": ("Int4WeightOnlyConfig", dict(group_size=GROUP, int4_packing_format="tile_packed_to_4d")),
    "torchao_int8wo": ("Int8WeightOnlyConfig", {}),
    "torchao_fp8": ("Float8DynamicActivationFloat8WeightConfig", "rows"),
    "torchao_int8": ("Int8DynamicActivationInt8WeightConfig", {}),
}


#: (form, backend) -> (the most rows it cannot run, why): left out of those batches, said in the output
CANNOT_RUN = {("torchao_int8", "inductor"): (16, "torchao's int8 dynamic linear calls torch._int_mm, which takes "
                                                  "more than 16 rows")}


#: a torchao form with this suffix is unwrapped after quantizing (`torchao.utils.unwrap_tensor_subclass`): the
#: compiled model's parameters are plain tensors and the subclass is rebuilt inside the graph
UNWRAPPED = "_unwrapped"


def build(form: str, layers: int, batch: int, max_seq: int = MAX_SEQ) -> nn.Module:
    """The decoder with its linears in `form`; a torchao form is the bf16 model after torchao's `quantize_`."""
    model = Decoder(form, layers, batch, max_seq).eval()
    config = form.removesuffix(UNWRAPPED)
    if config in TORCHAO_CONFIGS:
        import torchao.quantization as quantization
        from torchao.utils import unwrap_tensor_subclass

        name, keywords = TORCHAO_CONFIGS[config]
        if keywords == "rows":
            keywords = dict(granularity=quantization.PerRow())
        quantization.quantize_(model, getattr(quantization, name)(**keywords, set_inductor_config=False))
        if form.endswith(UNWRAPPED):
            unwrap_tensor_subclass(model)
    return model


class Decoder(nn.Module):
    """`layers` blocks with KV caches of `max_seq` positions for up to `batch` sequences (a step may run fewer)."""

    def __init__(self, form: str, layers: int, batch: int, max_seq: int = MAX_SEQ):
        super().__init__()
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.layers = nn.ModuleList(Block(form, batch, generator, max_seq) for _ in range(layers))
        self.norm = RMSNorm(DIM)
        frequencies = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
        angles = torch.outer(torch.arange(max_seq, device="cuda").float(), frequencies)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("causal", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool, device="cuda")))

    def forward(self, x, input_pos):  # input_pos: the positions of x's tokens
        tokens = input_pos.shape[0]
        cos, sin = self.cos[input_pos].view(1, 1, tokens, -1), self.sin[input_pos].view(1, 1, tokens, -1)
        mask = self.causal[input_pos].view(1, 1, tokens, -1)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, mask)
        return self.norm(x)


#: qfuse's families without `sibling_linears`: q / k / v and gate / up each a launch of their own
SIBLINGS_APART = {"patterns": [family for family in PATTERN_FAMILIES if family != "sibling_linears"]}

#: Inductor's programmatic dependent launch (off by default): its Triton kernels let the next kernel start before
#: their stores, and qfuse's CUDA kernels, launched programmatically under CUDA graphs, start before they end
PDL = {"triton.enable_pdl": True}

VARIANTS = {  # name -> (linear form, backend[, options: qfuse's and Inductor's])
    "bf16 (Inductor)": ("bf16", "inductor"),
    "bf16 (Inductor) + PDL": ("bf16", "inductor", PDL),
    "tinygemm int4 (Inductor)": ("tinygemm", "inductor"),
    "tinygemm int4 (Inductor) + PDL": ("tinygemm", "inductor", PDL),
    "gptq int4 (Inductor)": ("gptq", "inductor"),
    "gptq int4 (qfuse)": ("gptq", "qfuse"),
    "gptq int4 (qfuse) + PDL": ("gptq", "qfuse", PDL),
    "gptq int4 (qfuse, siblings apart)": ("gptq", "qfuse", SIBLINGS_APART),
    "gptq int4 (qfuse, no cuda kernel)": ("gptq", "qfuse", {"disabled_kernels": ["cuda"]}),
    "gptq int4 (qfuse, cuda kernel forced)": ("gptq", "qfuse", {"kernel": "cuda"}),
    "gptq int4 (qfuse, int4 in place)": ("gptq", "qfuse", {"int4_in_place": True}),
    "fp8 W8A8 (Inductor)": ("fp8", "inductor"),
    "fp8 W8A8 (qfuse)": ("fp8", "qfuse"),
    "fp8 W8A8 (qfuse) + PDL": ("fp8", "qfuse", PDL),
    "fp8 W8A8 (qfuse, siblings apart)": ("fp8", "qfuse", SIBLINGS_APART),
    "int8 W8A8 (Inductor)": ("int8", "inductor"),
    "int8 W8A8 (qfuse)": ("int8", "qfuse"),
    "int8 W8A8 (qfuse) + PDL": ("int8", "qfuse", PDL),
    "int8 W8A8 (qfuse, siblings apart)": ("int8", "qfuse", SIBLINGS_APART),
    "int8 weight-only (Inductor)": ("int8wo", "inductor"),
    "int8 weight-only (qfuse)": ("int8wo", "qfuse"),
    "int8 weight-only (qfuse) + PDL": ("int8wo", "qfuse", PDL),
    "int8 weight-only (qfuse, siblings apart)": ("int8wo", "qfuse", SIBLINGS_APART),
    "fp8 weight-only (Inductor)": ("fp8wo", "inductor"),
    "fp8 weight-only (qfuse)": ("fp8wo", "qfuse"),
    "fp8 weight-only (qfuse) + PDL": ("fp8wo", "qfuse", PDL),
    "fp8 weight-only (qfuse, siblings apart)": ("fp8wo", "qfuse", SIBLINGS_APART),
    "GemLite A16W4 (Inductor)": ("gemlite_int4", "inductor"),
    "GemLite A16W8 int8 (Inductor)": ("gemlite_int8wo", "inductor"),
    "GemLite A8W8 fp8 (Inductor)": ("gemlite_fp8", "inductor"),
    "torchao int4 tinygemm (Inductor)": ("torchao_int4", "inductor"),
    "torchao int8 weight-only (Inductor)": ("torchao_int8wo", "inductor"),
    "torchao int8 weight-only (qfuse)": ("torchao_int8wo", "qfuse"),
    "torchao int8 weight-only unwrapped (Inductor)": ("torchao_int8wo_unwrapped", "inductor"),
    "torchao int8 weight-only unwrapped (qfuse)": ("torchao_int8wo_unwrapped", "qfuse"),
    "torchao fp8 row-wise (Inductor)": ("torchao_fp8", "inductor"),
    "torchao fp8 row-wise (qfuse)": ("torchao_fp8", "qfuse"),
    "torchao int8 dynamic (Inductor)": ("torchao_int8", "inductor"),
    "torchao int8 dynamic (qfuse)": ("torchao_int8", "qfuse"),
    "torchao int8 dynamic unwrapped (qfuse)": ("torchao_int8_unwrapped", "qfuse"),
}


def picked_variants(wanted: list[str]) -> dict:
    """The variants `wanted` names: a whole name that variant alone, a part of names every variant whose name has it."""
    return {name: value for name, value in VARIANTS.items()
            if any(part == name or part in name and part not in VARIANTS for part in wanted)}


def compile_options(mode: str, qfuse_options: dict | None = None) -> dict:
    """torch.compile's keywords for `mode` (and qfuse's options: torch.compile takes a mode or options, so the
    mode goes in as its Inductor settings)."""
    if qfuse_options is None:
        return {} if mode == "default" else {"mode": mode}
    return {"options": {**qfuse_options, **({} if mode == "default" else torch._inductor.list_mode_options(mode))}}


def step_ms(step, inputs, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(steps):
        step(*inputs[i])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def compile_variants(variants: dict, mode: str, layers: int, batch: int, warm_inputs, what: str,
                     max_seq: int = MAX_SEQ, rows: int | None = None) -> dict:
    """name -> (model, compiled step) of each variant that runs here, built for `batch` sequences and run once on
    each of `warm_inputs` (`rows` rows a linear: `batch` unless given); a variant that cannot run so few rows
    (`CANNOT_RUN`) or whose anchor cannot run here is left out with the reason (a qfuse or bf16 model that fails is
    an error)."""
    compiled = {}
    rows = batch if rows is None else rows
    for name, (form, backend, *qfuse_options) in variants.items():
        rows_it_cannot_run, why = CANNOT_RUN.get((form.removesuffix(UNWRAPPED), backend), (0, ""))
        if rows <= rows_it_cannot_run:
            progress(f"  {name} left out at {rows} rows: {why}")
            continue
        progress(f"{what}: compiling {name}")
        try:
            model = build(form, layers, batch, max_seq)
            step = torch.compile(model, backend=backend, **compile_options(mode, *qfuse_options))
            with torch.no_grad():
                for inputs in warm_inputs:
                    step(*inputs)
        except Exception as error:  # an anchor that cannot run here (a missing package, say) is left out,
            # and so is a model Dynamo cannot trace (an error before any backend sees a graph)
            in_dynamo = (isinstance(error, torch._dynamo.exc.TorchDynamoException)
                         and not isinstance(error, torch._dynamo.exc.BackendCompilerFailed))
            if (backend == "qfuse" or form == "bf16") and not in_dynamo:
                raise
            progress(f"  {name} left out: {type(error).__name__}: {str(error)[:300]}")
            continue
        compiled[name] = (model, step)
    return compiled


def run(layers: int, batches, modes, steps: int, rounds: int, variants: dict) -> list[dict]:
    torch._dynamo.config.recompile_limit = 64  # one Block class compiled at several batch sizes and modes
    rows = []
    for batch in batches:
        inputs = [(torch.randn(batch, 1, DIM, device="cuda", dtype=torch.bfloat16) * 0.1,
                   torch.tensor([START + i], device="cuda")) for i in range(steps)]
        for mode in modes:
            torch._dynamo.reset()  # once: a reset between variants would make the earlier ones compile again
            compiled = compile_variants(variants, mode, layers, batch, inputs[:3], f"batch {batch}, {mode}")
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


def prefill_rows(layers: int, tokens: int, modes, rounds: int, variants: dict) -> list[dict]:
    """The prefill of one `tokens`-token prompt (batch 1, positions 0 .. tokens - 1) per variant and mode: the
    median of `rounds` timed prefills (each variant compiled for that length, timed in turns with the others)."""
    torch._dynamo.config.recompile_limit = 64  # as in `run`: one Block class compiled for every variant
    rows = []
    prompt = torch.randn(1, tokens, DIM, device="cuda", dtype=torch.bfloat16) * 0.1
    inputs = [(prompt, torch.arange(tokens, device="cuda"))]
    for mode in modes:
        torch._dynamo.reset()
        compiled = compile_variants(variants, mode, layers, 1, inputs * 3, f"prefill of {tokens} tokens, {mode}",
                                    max_seq=tokens, rows=tokens)
        times = {name: [] for name in compiled}
        with torch.no_grad():
            for _ in range(rounds):
                for name, (_, step) in compiled.items():
                    times[name].append(step_ms(step, inputs * 3, 3))
        base = statistics.median(times["bf16 (Inductor)"])
        for name, samples in times.items():
            ms = statistics.median(samples)
            rows.append(dict(tokens=tokens, mode=mode, variant=name, layers=layers, prefill_ms=round(ms, 3),
                             tokens_per_s=round(tokens / ms * 1e3), vs_bf16=round(base / ms, 3),
                             spread=round((max(samples) - min(samples)) / ms, 3)))
            progress(f"  {name}: {ms:.2f} ms a prefill, {base / ms:.2f}x bf16")
        del compiled
        torch.cuda.empty_cache()
    return rows


_NOT_THE_STEPS = ("cudaDeviceSynchronize", "Activity Buffer Request")  # host events of the profile, not of a step


def profile_rows(layers: int, batches, variants: dict, mode: str, top: int = 12) -> list[dict]:
    """Per variant compiled in `mode`: the `top` kernels of a decode step by GPU time (µs a step, launches a step)
    and their sum (the profiler sees the kernels of a CUDA graph's replay too); the host's time a step until the
    call returns (timed without the profiler), and the `top` host events by their own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.config.recompile_limit = 64
    torch._inductor.config.use_static_cuda_launcher = False  # name the Triton kernels in the profile
    rows = []
    for batch in batches:
        inputs = [(torch.randn(batch, 1, DIM, device="cuda", dtype=torch.bfloat16) * 0.1,
                   torch.tensor([START + i], device="cuda")) for i in range(26)]
        for name, (form, backend, *qfuse_options) in variants.items():
            progress(f"batch {batch}: profiling {name}")
            step = torch.compile(build(form, layers, batch), backend=backend,
                                 **compile_options(mode, *qfuse_options))
            row = dict(batch=batch, mode=mode, variant=name)
            with torch.no_grad():
                for i in range(3):
                    step(*inputs[i])
                torch.cuda.synchronize()
                start = time.perf_counter()
                for i in range(3, 23):
                    step(*inputs[i])
                host_us = (time.perf_counter() - start) / 20 * 1e6
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for i in range(23, 26):
                        step(*inputs[i])
                    torch.cuda.synchronize()
            events = prof.key_averages()
            on_gpu = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
            kernels = sorted(on_gpu, key=lambda event: -event.device_time_total)
            rows.append(dict(row, kernel="(all kernels)", us_per_step=round(sum(e.device_time_total for e in kernels) / 3, 1),
                             launches_per_step=sum(event.count for event in kernels) // 3))
            rows += [dict(row, kernel=event.key[:100], us_per_step=round(event.device_time_total / 3, 1),
                          launches_per_step=event.count // 3) for event in kernels[:top]]
            rows.append(dict(row, kernel="(host, until a step returns)", us_per_step=round(host_us, 1), launches_per_step=""))
            host = sorted((event for event in events if event.device_type == torch.autograd.DeviceType.CPU
                           and event.self_cpu_time_total > 0 and event.key not in _NOT_THE_STEPS),
                          key=lambda event: -event.self_cpu_time_total)
            rows += [dict(row, kernel=f"host: {event.key[:94]}", us_per_step=round(event.self_cpu_time_total / 3, 1),
                          launches_per_step=event.count // 3) for event in host[:top]]
            torch._dynamo.reset()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="default,reduce-overhead")
    parser.add_argument("--variants", default="", help="substrings of the variants to run, or whole names of one each "
                                                       "(the bf16 model always runs)")
    parser.add_argument("--profile", action="store_true",
                        help="the largest kernels of a step and the host's time a step, per variant")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="instead time the prefill of one prompt of TOKENS tokens (batch 1) per variant and mode")
    add_output_arguments(parser, "gpu_llm_decode", quick="2 layers, batch 1, reduce-overhead only")
    args = parser.parse_args()
    layers, batches, modes = args.layers, [int(b) for b in args.batches.split(",")], args.modes.split(",")
    if args.quick:
        layers, batches, modes = 2, [1], ["reduce-overhead"]
    wanted = [part for part in args.variants.split(",") if part]
    variants = {name: value for name, value in VARIANTS.items()
                if name.startswith("bf16") or not wanted or name in picked_variants(wanted)}
    if args.profile:
        rows = [row for mode in modes for row in profile_rows(layers, batches, variants, mode)]
        header = ["batch", "mode", "variant", "kernel", "us_per_step", "launches_per_step"]
        print(format_table([[row[column] for column in header] for row in rows], header))
        write(out_path(args, "gpu_llm_decode_profile"), rows, machine=machine())
        return
    if args.prefill:
        rows = prefill_rows(layers, args.prefill, modes, rounds=5, variants=variants)
        header = ["tokens", "mode", "variant", "prefill_ms", "tokens_per_s", "vs_bf16", "spread"]
        print(format_table([[row[column] for column in header] for row in rows], header))
        write(out_path(args, "gpu_llm_prefill"), rows, machine=machine())
        return
    rows = run(layers, batches, modes, steps=40, rounds=5, variants=variants)
    header = ["batch", "mode", "variant", "step_ms", "tokens_per_s", "vs_bf16", "spread"]
    print(format_table([[row[column] for column in header] for row in rows], header))
    write(out_path(args, "gpu_llm_decode"), rows, machine=machine())


if __name__ == "__main__":
    main()
