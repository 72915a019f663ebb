"""Weight-only linears on the GPU: qfuse's Triton templates against Inductor on the same form, and bf16.

The model is a stack of `layers` weight-only linears of one form, each with its own weight, all
applied to one bf16 activation (the outputs returned as a tuple, so nothing but the linears runs):

    gptq         int32 words [N, K / 8] unpacked by shifts and `& 0xF`, minus 8, times bf16 scales of
                 groups of 128, `F.linear` (W4A16)
    autogptq     AutoGPTQ's [K / 8, N] words with act order and zero points stored minus one
    awq          AutoAWQ's [K, N / 8] words packed along N
    fp8-block    an fp8 e4m3fn weight [N, K] with 128 x 128 block scales, dequantized in float32 the
                 way vLLM's `block_quant_dequant` writes it (repeat_interleave), cast to bf16 (W8A16)
    fp8-channel  an fp8 weight with one float32 scale per output channel (Marlin fp8's checkpoints)
    intx         torchao's int4 "intx" weight: int4 values one per int8 [N, K], int8 zero points (all
                 zero) and bf16 scales of groups of 32, dequantized as `IntxUnpackedToInt8Tensor` does
    int8-channel torchao's int8 weight-only linear: `x @ w.t().to(x.dtype) * scale`, a bf16 scale per
                 output channel (W8A16)

The stack holds at least 128 MiB of weights: every linear reads its weight from HBM, as a
decoder's layers do (one linear alone would be served from an H100's 50 MiB L2). Rows are per linear
(the stack's time / layers):

    inductor, inductor:max-autotune-no-cudagraphs (M >= 1024), qfuse     the GPTQ form compiled
    bf16 (inductor)                      a stack of bf16 nn.Linear of the same sizes, compiled
    ...:reduce-overhead (M <= 256)       the same with CUDA graphs
    ...:freezing (autogptq)              the same with Inductor's freezing: qfuse sorts the act-order weight
                                         at compile time; Inductor folds the whole dequantize into a
                                         constant bf16 weight (4x the int4 weight's memory)
    triton kernel (eager)                qfuse's kernel alone (`triton_int4_mm` at decode, `triton_w8a16_mm`
                                         at every M), GPU time only
    HBM floor                            weight bytes / the bandwidth of a device-to-device copy

    python benchmarks/gpu_weight_only.py [--quick] [--form FORM] [--out FILE.json] [--plot FILE.png]
    python benchmarks/gpu_weight_only.py --tune --ms 1,16   (the kernel's GPU time at each decode tile and split)
    python benchmarks/gpu_weight_only.py --tune --form fp8-block --ms 1024   (8-bit forms: each prefill tile)
    python benchmarks/gpu_weight_only.py --tune --form int8-channel --ms 32,64,128,256   (batched decode tiles)
    python benchmarks/gpu_weight_only.py --table FILE.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
from torch import nn

from gemm_cases import SHAPES
from gpu_linear import measure
from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, out_path, plot, progress, write

GROUP = 128
STACK_BYTES = 128 * 2**20


class GptqLinear(nn.Module):
    """A GPTQ / compressed-tensors W4A16 linear as model code writes it (symmetric, uint4 offset 8)."""

    BITS = 4

    def __init__(self, n: int, k: int, generator: torch.Generator):
        super().__init__()
        q = torch.randint(0, 16, (n, k), device="cuda", generator=generator, dtype=torch.int32)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device="cuda")
        words = (q.view(n, k // 8, 8).long() << shifts.long()).sum(-1)
        self.register_buffer("qweight", torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
        scales = torch.rand(n, k // GROUP, device="cuda", generator=generator) / (8 * math.sqrt(k))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("shifts", shifts)

    def forward(self, x):
        n = self.qweight.shape[0]
        q = (self.qweight.unsqueeze(-1) >> self.shifts) & 0xF
        w = (q.reshape(n, -1, GROUP) - 8).to(x.dtype) * self.scales.unsqueeze(-1)
        return F.linear(x, w.reshape(n, -1))

    def kernel_call(self, x, config=None, splits=None):
        from qfuse.kernels.triton.int4_mm import triton_int4_mm

        return triton_int4_mm(x, self.qweight, None, self.scales, None, None, GROUP, torch.bfloat16, config=config,
                              splits=splits)


class AutoGptqLinear(nn.Module):
    """The classic AutoGPTQ W4A16 linear as its torch path writes it: words [K / 8, N], zero points
    [K / g, N / 8] stored minus one (plus one before the mask), act order (a permuted `g_idx`)."""

    BITS = 4

    def __init__(self, n: int, k: int, generator: torch.Generator):
        super().__init__()
        def words(values):  # int32 [R, C] of 0..15 -> [R / 8, C], packed down the rows
            shifts = torch.arange(0, 32, 4, device="cuda").view(1, 8, 1)
            packed = (values.view(values.shape[0] // 8, 8, -1).long() << shifts).sum(1)
            return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        q = torch.randint(0, 16, (k, n), device="cuda", generator=generator, dtype=torch.int32)
        zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda", generator=generator, dtype=torch.int32)
        self.register_buffer("qweight", words(q))
        self.register_buffer("qzeros", words((zeros - 1).t().contiguous() & 0xF).t().contiguous())
        scales = torch.rand(k // GROUP, n, device="cuda", generator=generator) / (8 * math.sqrt(k))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        order = torch.randperm(k, device="cuda", generator=generator)
        self.register_buffer("g_idx", (torch.arange(k, device="cuda") // GROUP)[order].to(torch.int32))
        self.register_buffer("wf", torch.arange(0, 32, 4, dtype=torch.int32, device="cuda").unsqueeze(0))

    def forward(self, x):
        zeros = torch.bitwise_right_shift(self.qzeros.unsqueeze(2).expand(-1, -1, 8), self.wf.unsqueeze(0))
        zeros = torch.bitwise_and(zeros.to(torch.int8) + 1, 0xF).reshape(self.scales.shape)
        weight = torch.bitwise_right_shift(self.qweight.unsqueeze(1).expand(-1, 8, -1), self.wf.unsqueeze(-1))
        weight = torch.bitwise_and(weight.to(torch.int8), 0xF).reshape(-1, self.qweight.shape[1])
        group = self.g_idx.long()
        return torch.matmul(x, self.scales[group] * (weight - zeros[group]))

    def kernel_call(self, x):
        """The op eagerly: the rows sorted by group once, the activation gathered, qfuse's kernel."""
        import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)

        return torch.ops.qfuse.int4_weight_only_mm(x, self.qweight.t(), self.wf.reshape(8), self.scales.t(),
                                                   self.qzeros.t(), None, GROUP, torch.bfloat16, "triton", self.g_idx,
                                                   "plus_one_mod_16")


class AwqLinear(nn.Module):
    """AutoAWQ's W4A16 GEMM linear as its torch dequantize writes it: words [K, N / 8] packed along N
    in AWQ's interleaved order, undone by a gather over N, zero points [K / g, N / 8] the same way."""

    BITS = 4
    REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]

    def __init__(self, n: int, k: int, generator: torch.Generator):
        super().__init__()
        def words(values):  # int32 [R, C] of 0..15 -> [R, C / 8], packed along the columns
            shifts = torch.arange(0, 32, 4, device="cuda")
            packed = (values.view(values.shape[0], -1, 8).long() << shifts).sum(-1)
            return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        self.register_buffer("qweight", words(torch.randint(0, 16, (k, n), device="cuda", generator=generator)))
        self.register_buffer("qzeros", words(torch.randint(0, 16, (k // GROUP, n), device="cuda", generator=generator)))
        scales = torch.rand(k // GROUP, n, device="cuda", generator=generator) / (8 * math.sqrt(k))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("shifts", torch.tensor([4 * i for i in self.REVERSE_ORDER], dtype=torch.int32,
                                                    device="cuda"))  # the order folded in (for the kernel alone)

    def unpack(self, packed):
        shifts = torch.arange(0, 32, 4, device=packed.device)
        values = torch.bitwise_right_shift(packed[:, :, None], shifts[None, None, :]).to(torch.int8)
        values = values.view(values.shape[0], -1)
        order = torch.arange(values.shape[-1], dtype=torch.int32, device=packed.device)
        return torch.bitwise_and(values[:, order.view(-1, 8)[:, self.REVERSE_ORDER].view(-1)], 0xF)

    def forward(self, x):
        zeros = self.unpack(self.qzeros).repeat_interleave(GROUP, 0)
        weight = (self.unpack(self.qweight) - zeros) * self.scales.repeat_interleave(GROUP, 0)
        return torch.matmul(x, weight)

    def kernel_call(self, x, config=None, splits=None):
        from qfuse.kernels.triton.int4_mm import triton_int4_mm

        return triton_int4_mm(x, self.qweight, self.shifts, self.scales.t(), self.qzeros.t(), None, GROUP, torch.bfloat16,
                              config=config, splits=splits, packed_along_n=True)


class Fp8WeightOnlyLinear(nn.Module):
    """An fp8 e4m3fn weight dequantized in float32 and cast to bf16 in the forward (W8A16): 128 x 128
    block scales expanded by repeat_interleave (vLLM's `block_quant_dequant`), or one per channel."""

    BITS = 8

    def __init__(self, n: int, k: int, generator: torch.Generator, blocks: bool = True):
        super().__init__()
        weight = (torch.randn(n, k, device="cuda", generator=generator) * 64).clamp(-448, 448)
        self.register_buffer("weight", weight.to(torch.float8_e4m3fn))
        shape = (-(-n // GROUP), -(-k // GROUP)) if blocks else (n, 1)
        self.register_buffer("weight_scale", torch.rand(*shape, device="cuda", generator=generator) / (64 * math.sqrt(k)))
        self.blocks = blocks

    def forward(self, x):
        n, k = self.weight.shape
        scale = self.weight_scale
        if self.blocks:
            scale = scale.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)[:n, :k]
        return F.linear(x, (self.weight.to(torch.float32) * scale).to(x.dtype))

    def kernel_call(self, x, config=None, splits=None):
        from qfuse.kernels.triton.w8a16_mm import triton_w8a16_mm

        return triton_w8a16_mm(x, self.weight.t(), self.weight_scale.t(), None, torch.bfloat16, config=config,
                               splits=splits)


class IntxLinear(nn.Module):
    """torchao's int4 "intx" linear (IntxWeightOnlyConfig(weight_dtype=torch.int4, PerGroup(32)), symmetric)."""

    GROUP = 32

    def __init__(self, n: int, k: int, generator: torch.Generator):
        super().__init__()
        values = torch.randint(-8, 8, (n, k), device="cuda", generator=generator, dtype=torch.int32)
        self.register_buffer("qdata", values.to(torch.int8))
        scales = torch.rand(n, k // self.GROUP, device="cuda", generator=generator) / (8 * math.sqrt(k))
        self.register_buffer("scale", scales.to(torch.bfloat16))
        self.register_buffer("zero_point", torch.zeros(n, k // self.GROUP, device="cuda", dtype=torch.int8))

    def forward(self, x):
        n, k = self.qdata.shape
        groups = k // self.GROUP
        values = self.qdata.view(n, groups, self.GROUP).to(x.dtype) - self.zero_point.view(n, groups, 1).to(x.dtype)
        return F.linear(x, (values * self.scale.view(n, groups, 1)).view(n, k))

    def kernel_call(self, x, config=None, splits=None):
        from qfuse.kernels.triton.int4_mm import triton_int4_mm

        return triton_int4_mm(x, self.qdata, None, self.scale, self.zero_point, None, self.GROUP, torch.bfloat16,
                              config=config, splits=splits)


class Int8WeightOnlyLinear(nn.Module):
    """torchao's int8 weight-only linear (Int8WeightOnlyConfig) as its linear computes it: the int8 weight
    [N, K] converted to x's dtype, the matmul, then the per-channel scale."""

    BITS = 8

    def __init__(self, n: int, k: int, generator: torch.Generator):
        super().__init__()
        weight = torch.randint(-128, 128, (n, k), device="cuda", generator=generator, dtype=torch.int32)
        self.register_buffer("weight", weight.to(torch.int8))
        scale = torch.rand(n, device="cuda", generator=generator) / (64 * math.sqrt(k))
        self.register_buffer("scale", scale.to(torch.bfloat16))

    def forward(self, x):
        out = torch.mm(x.reshape(-1, x.shape[-1]), self.weight.t().to(x.dtype)) * self.scale
        return out.reshape(*x.shape[:-1], -1)

    def kernel_call(self, x, config=None, splits=None):
        from qfuse.kernels.triton.w8a16_mm import triton_w8a16_mm

        return triton_w8a16_mm(x, self.weight.t(), self.scale.float().view(1, -1), None, torch.bfloat16, config=config,
                               splits=splits)


FORMS = {
    "gptq": GptqLinear, "autogptq": AutoGptqLinear, "awq": AwqLinear, "fp8-block": Fp8WeightOnlyLinear,
    "fp8-channel": lambda n, k, generator: Fp8WeightOnlyLinear(n, k, generator, blocks=False), "intx": IntxLinear,
    "int8-channel": Int8WeightOnlyLinear,
}
BITS = {"gptq": 4, "autogptq": 4, "awq": 4, "fp8-block": 8, "fp8-channel": 8, "intx": 8, "int8-channel": 8}  # bits a weight value is stored in


class Stack(nn.Module):
    def __init__(self, linears):
        super().__init__()
        self.linears = nn.ModuleList(linears)

    def forward(self, x):
        return tuple(linear(x) for linear in self.linears)


def weight_bytes(n: int, k: int, form: str) -> int:
    return n * k * BITS[form] // 8


def layers_for(n: int, k: int, form: str = "gptq") -> int:
    return max(2, min(16, math.ceil(STACK_BYTES / weight_bytes(n, k, form))))


def quantized_stack(n: int, k: int, form: str = "gptq") -> Stack:
    generator = torch.Generator(device="cuda").manual_seed(0)
    return Stack([FORMS[form](n, k, generator) for _ in range(layers_for(n, k, form))]).eval()


def bf16_stack(n: int, k: int, layers: int) -> Stack:
    return Stack([nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]).eval()


def hbm_floor_us(n: int, k: int, form: str) -> float:
    """Weight bytes / copy bandwidth (a device-to-device copy of 1 GiB reads and writes it)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = graph_ms_per_call([lambda: dst.copy_(src)]) / 1e3
    return weight_bytes(n, k, form) / (2 * src.numel() / seconds) * 1e6


def variants_for(m: int, form: str = "gptq") -> list[str]:
    names = ["inductor", "qfuse"]
    if form == "autogptq":  # act order: the weight sorted at compile time (qfuse) or dequantized once (Inductor)
        names += ["inductor:freezing", "qfuse:freezing"]
    if m >= 1024:
        names.append("inductor:max-autotune-no-cudagraphs")
    if m <= 256:  # decode and batched decode: where CUDA graphs pay
        names += ["inductor:reduce-overhead", "qfuse:reduce-overhead"]
    return names


def case_rows(m: int, n: int, k: int, form: str = "gptq") -> list[dict]:
    layers = layers_for(n, k, form)
    label = {"m": m, "n": n, "k": k, "layers": layers, "form": form}
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    per_layer = ("per_call_us", "host_us", "gpu_us")
    rows = []
    with torch.no_grad():
        stack = quantized_stack(n, k, form)
        expected = stack(x)
        for variant in variants_for(m, form):
            rows.append(label | measure(stack, x, variant, expected))
        floats = bf16_stack(n, k, layers)
        for variant in ["inductor"] + (["inductor:reduce-overhead"] if m <= 256 else []):
            row = measure(floats, x, variant, floats(x))
            rows.append(label | row | {"variant": "bf16 " + variant})
        if m <= 256 or BITS[form] == 8:  # int4 above 256 rows: the op runs Inductor's dequantize + mm
            kernel = graph_ms_per_call(kernel_calls(stack, x)) * 1e3
            rows.append(label | {"variant": "triton kernel (eager)", "gpu_us": kernel * layers})
        rows.append(label | {"variant": "HBM floor", "gpu_us": hbm_floor_us(n, k, form) * layers})
    for row in rows:
        for key in per_layer:
            if row.get(key):
                row[key] /= layers
    return rows


# Decode: (tile, K splits); the tile's BLOCK_M is 16 (`int4_mm.DECODE_ROWS`). num_stages sets how far
# ahead the weight's loads run: Triton keeps num_stages - 1 buffers of the weight tile in shared memory.
TUNE_DECODE = {
    "gptq": [((16, bn, bk, 1, 4, stages), splits) for bn in (32, 64, 128) for bk in (256, 512) for stages in (3, 4, 6)
             for splits in (1, 2, 4, 8)],
    "intx": [((16, bn, bk, 1, 4, stages), splits) for bn in (32, 64) for bk in (128, 256, 512) for stages in (3, 4, 5, 6)
             for splits in (1, 2, 4)],
    "awq": [((16, bn, bk, 1, warps, 3), splits) for bn in (64, 128, 256) for bk in (64, 128, 256) for warps in (4, 8)
            for splits in (1, 2, 4)],
    "fp8-block": [((16, bn, bk, 1, warps, stages), splits) for bn in (32, 64, 128) for bk in (128, 256, 512)
                  for warps in (4, 8) for stages in (3, 5) for splits in (1, 2, 4)],
}


def kernel_calls(stack: Stack, x: torch.Tensor, **tile):
    return [lambda linear=linear: linear.kernel_call(x, **tile) for linear in stack.linears]


# Batched decode (16 < M <= 256): BLOCK_M covering M (up to 128) with the decode tiles' shapes, and splits.
def tune_batched(m: int) -> list[tuple[tuple, int]]:
    block_m = min(128, max(32, 1 << (m - 1).bit_length()))
    return [((block_m, bn, bk, 1, 8 if bn * bk >= 128 * 256 else 4, 3), splits) for bn in (32, 64, 128) for bk in (128, 256, 512)
            for splits in (1, 2, 4) if bn * bk <= 128 * 256]


# Prefill (M > 16), the 8-bit kernel only: (tile, 1 split) over the tensor-core tiles.
TUNE_PREFILL = [((bm, bn, bk, 8, warps, stages), 1) for bm in (64, 128) for bn in (128, 256) for bk in (64, 128)
                for warps in (4, 8) for stages in (3, 4) if not (bm == 128 and bn == 256 and warps == 4)]


def tune_rows(m: int, n: int, k: int, form: str = "gptq") -> list[dict]:
    """GPU µs per linear of the kernel at each tile and split (decode) or tile (prefill, 8-bit forms),
    on the stack (cold weights)."""
    stack = quantized_stack(n, k, form)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rows = []
    decode = TUNE_DECODE.get(form, TUNE_DECODE["fp8-block" if BITS[form] == 8 else "gptq"])
    for tile, splits in decode if m <= 16 else tune_batched(m) if m <= 256 else TUNE_PREFILL:
        row = {"m": m, "n": n, "k": k, "form": form, "tile": list(tile), "splits": splits}
        try:
            row["gpu_us"] = graph_ms_per_call(kernel_calls(stack, x, config=tile, splits=splits)) * 1e3
        except triton.runtime.errors.OutOfResources as error:  # a tile that needs more shared memory: recorded
            row["gpu_us"], row["failed"] = math.inf, str(error)
        rows.append(row)
    rows.sort(key=lambda row: row["gpu_us"])
    progress(f"  best {rows[0]['tile']} x{rows[0]['splits']} {rows[0]['gpu_us']:.1f} us; worst {rows[-1]['gpu_us']:.1f}")
    return rows


def table(path: str) -> str:
    cases = defaultdict(dict)
    for row in json.loads(open(path).read())["rows"]:
        cases[(row["m"], row["n"], row["k"])][row["variant"]] = row
    names = sorted({variant for rows in cases.values() for variant in rows})

    def cell(row):
        if not row:
            return ""
        parts = [f"{row[key]:.1f}" if row.get(key) else "-" for key in ("per_call_us", "gpu_us", "host_us")]
        return " / ".join(parts) if "per_call_us" in row else f"{row['gpu_us']:.1f} (GPU)"

    def ratio(rows, numerator, denominator="qfuse", key="per_call_us"):
        a, b = rows.get(numerator), rows.get(denominator)
        return f"{a[key] / b[key]:.2f}x" if a and b and a.get(key) and b.get(key) else ""

    lines = []
    for (m, n, k), rows in cases.items():
        lines.append([f"M={m} N={n} K={k}", *(cell(rows.get(name)) for name in names),
                      ratio(rows, "inductor"), ratio(rows, "inductor", key="gpu_us"),
                      ratio(rows, "inductor:max-autotune-no-cudagraphs"),
                      ratio(rows, "inductor:reduce-overhead", "qfuse:reduce-overhead"),
                      ratio(rows, "bf16 inductor", key="gpu_us"),
                      ratio(rows, "bf16 inductor:reduce-overhead", "qfuse:reduce-overhead")])
    return format_table(lines, ["case (µs per linear: per call / GPU / host)", *names, "vs inductor (per call)",
                                "vs inductor (GPU)", "vs max-autotune (per call)", "vs inductor (CUDA graphs)", "vs bf16 (GPU)",
                                "vs bf16 (CUDA graphs)"], markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default=None)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--ms", default=None, help="comma-separated M values (default 1, 16, 1024, 4096)")
    parser.add_argument("--form", default="gptq", choices=list(FORMS),
                        help="the weight-only form (module docstring)")
    add_output_arguments(parser, "gpu_weight_only", plot=True, quick="M in {1, 1024}, N = K = 4096")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    ms = [int(m) for m in args.ms.split(",")] if args.ms else ([1, 1024] if args.quick else [1, 16, 1024, 4096])
    shapes = SHAPES[:1] if args.quick else SHAPES
    out, rows = out_path(args, "gpu_weight_only_tune" if args.tune else "gpu_weight_only"), []
    for n, k in shapes:
        for m in ms:
            progress(f"{'tune' if args.tune else args.form} M={m} N={n} K={k}")
            rows += tune_rows(m, n, k, args.form) if args.tune else case_rows(m, n, k, args.form)
            write(out, rows)
    if not args.tune:
        print(table(str(out)))
        if args.plot:
            plot(args.plot, rows, x="m", y="per_call_us", series="variant", panels=("n", "k"),
                 title=f"gpu_weight_only ({args.form}): µs per linear per call, back to back")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
