"""What a compiled tensor-parallel shard does with its collective, shared by the CPU test
(tests/distributed/test_collective_order.py) and the GPU benchmark (benchmarks/explorations/gpu_collective_overlap.py):

- `ReducedThenSide`: all_reduce(down(h)) + side(x), a row-parallel quantized linear whose output is
  all-reduced, then a quantized linear that does not depend on the collective (the GEMM a
  scheduler can run while the all-reduce is in flight);
- `compile_with_order`: the compiled model, and the GEMMs, the all-reduce and its wait in the
  order its generated code issues them.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from tests.distributed.tp_models import AllReduced, quantized

_CALL = re.compile(r"^\s*(?:\w+ = )?([\w.]+)\(", re.M)  # the callee of each statement of the generated `call`
_GEMMS = ("_int_mm", "_scaled_mm", "mm", "addmm", "bmm")


def _event(callee: str) -> str | None:
    """What a call of the generated code is: a GEMM (an extern GEMM, a qfuse op, or the launch of a
    Triton template, `triton_tem_*.run`), the collective, its wait, or None."""
    if callee.startswith("triton_tem_"):
        return "gemm"
    name = callee.split(".")[-2 if callee.endswith(".default") else -1]
    if name == "all_reduce_":
        return "all_reduce"
    if name == "wait_tensor":
        return "wait"
    return "gemm" if name in _GEMMS or callee.startswith("torch.ops.qfuse") else None


class ReducedThenSide(nn.Module):
    """all_reduce(down(h)) + side(x): `side` does not depend on the collective. Sizes: down K -> N,
    side N -> N."""

    def __init__(self, scheme: str, group, k: int = 128, n: int = 64, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.down = AllReduced(quantized(nn.Linear(k, n, bias=False, dtype=dtype), scheme), group)
        self.side = quantized(nn.Linear(n, n, bias=False, dtype=dtype), scheme)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.down(h) + self.side(x)


def compile_with_order(model, backend: str, *inputs):
    """(compiled model, its events): compiled with `backend` (fullgraph) and run once on `inputs`."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, *inputs)
    code = codes[-1]
    body = code[code.index("def call"):code.index("return (", code.index("def call"))]
    return compiled, [event for event in map(_event, _CALL.findall(body)) if event is not None]
