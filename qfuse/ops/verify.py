"""`qfuse::check_close`: verify mode's comparison of a fused op with the subgraph it replaced.

With `options={"verify": True}` every rewrite keeps the original subgraph alive and routes both
results through `check_close(fused, original, label, tolerance)`, which returns a copy of the
fused result. On the first call per label it measures

    max_abs_error   = max |fused - original|
    relative_error  = ||fused - original|| / ||original||

records both (`verify_results()`), and raises `QfuseVerificationError` when relative_error exceeds
the tolerance set for the scheme (`tolerance_for`). The original keeps running on every call, so
verify mode costs the original's time: it is a debugging switch, not a way to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qfuse.ops.arguments import op_arguments
from qfuse.schemes import QuantScheme


class QfuseVerificationError(RuntimeError):
    """A fused op disagreed with the subgraph it replaced by more than its scheme allows."""


@dataclass(frozen=True)
class VerifyResult:
    max_abs_error: float
    relative_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.relative_error <= self.tolerance


_results: dict[str, VerifyResult] = {}


def verify_results() -> dict[str, VerifyResult]:
    """label ('graph_3/_int_mm_2') -> result, for every rewrite checked in this process."""
    return dict(_results)


def tolerance_for(scheme: QuantScheme, out_dtype: torch.dtype) -> float:
    """Relative-norm tolerance of a fused linear against its original subgraph.

    The fused op computes the same products; it differs in summation order and, for int8, in
    being exact where a float matmul of upcast integers rounds. Half-precision outputs add their
    rounding; fp8 activations rounded by different code may land on neighbouring fp8 values.
    """
    tolerance = 1e-3 if out_dtype == torch.float32 else 1e-2
    return tolerance * 2 if scheme.is_fp8 else tolerance


@torch.library.custom_op("qfuse::check_close", mutates_args=())
def check_close(fused: torch.Tensor, original: torch.Tensor, label: str, tolerance: float) -> torch.Tensor:
    if label not in _results:
        difference = (fused.double() - original.double())
        reference = original.double().norm().item()
        result = VerifyResult(
            max_abs_error=difference.abs().max().item() if difference.numel() else 0.0,
            relative_error=difference.norm().item() / reference if reference > 0 else difference.norm().item(),
            tolerance=tolerance,
        )
        _results[label] = result
        if not result.passed:
            raise QfuseVerificationError(
                f"qfuse verify: {label} differs from the subgraph it replaced: relative error "
                f"{result.relative_error:.3e} > tolerance {tolerance:.1e} (max abs error {result.max_abs_error:.3e})"
            )
    return fused.clone()


@check_close.register_fake
def _(fused, original, label, tolerance):
    return torch.empty_like(fused)


class CheckCloseArgs(op_arguments(torch.ops.qfuse.check_close.default)):
    """`qfuse::check_close`'s arguments by name; its fields are the parameters of `check_close` above."""
