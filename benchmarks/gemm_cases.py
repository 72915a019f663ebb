"""The GEMM cases the GPU benchmarks share.

    operands            random quantized A [M, K] and W [N, K] (fp8: randn cast; int8: uniform in
                        [-127, 127]), per-token scales [M, 1] and per-channel scales [1, N] in [0.5, 1.5)
    triton_kernel       the registry's `triton` kernel on a weight stored [N, K], as the compiled op calls it
    reference_fp8_linear the reference-form fp8 W8A8 linear (what model code writes): dynamic
                        per-token fp8 quant, `torch._scaled_mm` with unit scales, the scales
                        multiplied in after, bf16 out
    compiled_ms         `do_bench` ms of a module compiled by each backend, without and with CUDA
                        graphs (Inductor's `triton.cudagraphs`, what mode="reduce-overhead" sets) on
                        an input marked static (`mark_static_address`: the graph reads it in place,
                        as it would the output of the layer before inside a captured model)
"""

from __future__ import annotations

import itertools

import torch

from qfuse.bench import kernel_ms
from qfuse.kernels.prepared import PreparedWeight
from qfuse.kernels.registry import get_kernel

FP8 = torch.float8_e4m3fn
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K)


def quantized(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == FP8:
        return torch.randn(rows, cols, device="cuda").to(FP8)
    return torch.randint(-127, 128, (rows, cols), dtype=dtype, device="cuda")


def scales(m: int, n: int):
    """(per-token scale [M, 1], per-channel scale [1, N]), in [0.5, 1.5)."""
    return torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5


def operands(m: int, n: int, k: int, dtype: torch.dtype):
    """(a [M, K], w [N, K], per-token scale [M, 1], per-channel scale [1, N])."""
    return quantized(m, k, dtype), quantized(n, k, dtype), *scales(m, n)


def triton_kernel(a, w, sa, sb):
    """The registry's `triton` kernel on a weight stored [N, K], as the compiled op calls it."""
    weight = PreparedWeight(w.t(), sb, None, w.shape[1], w.shape[0])
    return get_kernel("triton").apply(a, weight, sa, None, None, torch.bfloat16)


def reference_quant(x):
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 448.0
    return (x / s).clamp(-448, 448).to(FP8), s


def reference_fp8_linear(x, w, w_scale):
    q, s = reference_quant(x.reshape(-1, x.shape[-1]))
    one = torch.ones((), device=x.device)
    y = torch._scaled_mm(q, w.t(), one, one, out_dtype=torch.float32)
    return (y * s * w_scale).to(torch.bfloat16)


class Fp8Linear(torch.nn.Module):
    """`reference_fp8_linear` with its weight as buffers, so that CUDA graphs keep them static (not copied in)."""

    def __init__(self, w, w_scale):
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("w_scale", w_scale)

    def forward(self, x):
        return reference_fp8_linear(x, self.w, self.w_scale)


def random_fp8_linear(n: int, k: int) -> Fp8Linear:
    return Fp8Linear(torch.randn(n, k, device="cuda").to(FP8), torch.rand(n, device="cuda") + 0.5)


def compiled_ms(module, x, compilers: dict[str, tuple[str, dict]]) -> dict[str, float]:
    """{label, label + ' cudagraphs': do_bench ms} of `module(x)` compiled by each `label: (backend, options)`."""
    torch._dynamo.mark_static_address(x)
    times = {}
    for (label, (backend, options)), cudagraphs in itertools.product(compilers.items(), (False, True)):
        torch._dynamo.reset()
        compiled = torch.compile(module, backend=backend, options={**options, "triton.cudagraphs": cudagraphs})
        for _ in range(3):  # CUDA graphs record on the second or third call
            compiled(x)
        times[label + (" cudagraphs" if cudagraphs else "")] = kernel_ms(lambda: compiled(x))
    return times
