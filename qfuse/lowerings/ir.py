"""Small helpers every qfuse lowering uses to build Inductor IR, so each lowering reads as its math.

    lower(op, *args)        Inductor's own lowering of an ATen op (IR in, IR out)
    convert(value, dtype)   a dtype cast in IR (none when the dtype already matches)
    tensor_constant(value)  a constant of the compiled graph (no kernel per call)
    numel / known_equal     sizes, compared only when Inductor can prove the answer
    rows_and_k / as_matrix  a linear's activation of any rank: its M and K / as [rows, K]
    rows_at_most(rows, b)   M <= b, for choosing a path or a tile by M: a dynamic M by a guard, so
                            that each M bucket gets its own compiled code
    rows_bucket(rows, bs)   the bound of M's bucket among ascending bounds (0 above), by `rows_at_most`
    record_lowering(how)    how the op entered the generated code, into its LinearRecord (`current_record`)
    extern_call(call, why)  the op itself as an extern call (the fallback that is always correct),
                            and why, into the debug log and the record
    falls_back_to_extern_call(Args)   a lowering whose failure becomes that extern call (qfuse.errors)
    launch_user_triton_kernel(...)    a @triton.jit kernel launched from the generated code, as
                            `torch.library.wrap_triton` would launch it (no Python op per call)
    IR_OPS                  `qfuse.kernels.array_ops.ArrayOps` on IR: a kernel's integer math, stated
                            once, builds the lowering's IR
"""

from __future__ import annotations

import functools
import logging

import sympy
import torch
from torch._inductor import lowering as inductor_lowering
from torch._inductor.virtualized import V

from qfuse.errors import contain_internal_error
from qfuse.kernels.array_ops import ArrayOps
from qfuse.ops import RECORD_KEY

aten, prims = torch.ops.aten, torch.ops.prims
log = logging.getLogger("qfuse")


def lower(op, *args, **kwargs):
    return inductor_lowering.lowerings[op](*args, **kwargs)


def convert(value, dtype: torch.dtype):
    """`value` as `dtype`. Inductor's own lowering of the cast copies even when the dtype matches,
    and a copy that reaches a template or extern input becomes a kernel launch on every call (a
    float32 weight scale used to cost one per linear)."""
    if value.get_dtype() == dtype:
        return value
    return lower(prims.convert_element_type.default, value, dtype)


def tensor_constant(value: torch.Tensor, name: str | None = None):
    """`value` as a constant of the compiled graph (named after `name` where given): made once when the
    module loads, where a `full` in IR that an extern call reads is a kernel launch on every call."""
    return V.graph.add_tensor_constant(value, name)


IR_OPS = ArrayOps(
    add=lambda left, right: lower(aten.add.Tensor, left, right),
    sub=lambda left, right: lower(aten.sub.Tensor, left, right),
    mul=lambda left, right: lower(aten.mul.Tensor, left, right),
    bitwise_and=lambda value, mask: lower(aten.bitwise_and.Scalar, value, mask),
    int32_sum=lambda value, dim: lower(aten.sum.dim_IntList, convert(value, torch.int32), [dim], True),
    narrow=lambda value, dim, start, length: lower(aten.slice.Tensor, value, dim, start, start + length),
    float32_mm_as_int32=lambda left, right: convert(
        lower(aten.mm.default, convert(left, torch.float32), convert(right, torch.float32)), torch.int32),
)


def numel(node) -> sympy.Expr:
    return sympy.Mul(*node.get_size()) if node.get_size() else sympy.Integer(1)


def known_equal(left, right) -> bool:
    return V.graph.sizevars.statically_known_equals(left, right)


def rows_and_k(x):
    """(M, K) of a linear's activation of any rank: M is the product of its leading sizes."""
    *lead, k = x.get_size()
    return (sympy.Mul(*lead) if lead else sympy.Integer(1)), k


def as_matrix(x):
    """(x as [rows, K], x's leading sizes, rows, K): a linear's activation of any rank as a matrix;
    the linear's [rows, N] result goes back to [*leading, N]."""
    rows, k = rows_and_k(x)
    return lower(aten.reshape.default, x, [rows, k]), list(x.get_size()[:-1]), rows, k


def rows_at_most(rows, bound: int) -> bool:
    """Whether the call's M (`rows`, all leading dims) is at most `bound`, for choosing a path or a tile by M.

    A static M is compared. A dynamic M is compared at its size hint and the answer becomes a guard
    (Dynamo checks it before each call): an M on the other side of `bound` makes Dynamo compile the
    graph again, with that side's code. Each M bucket (decode, prefill) so runs code made for it, and
    the choice costs no Python in the generated code; a model that only ever sees one bucket compiles
    once. An M with no hint (unbacked: nothing to guard on) counts as large.

    For speed only: both sides must be correct at any M, since a caller that drops Dynamo's guards
    (vLLM) runs the first bucket's code at every M. A limit of correctness (cuBLAS's int8 GEMM needs
    17 rows) takes a static M instead."""
    return bool(V.graph.sizevars.guard_or_false(sympy.Le(rows, bound)))


def rows_bucket(rows, bounds) -> int:
    """The first of the ascending `bounds` that M (`rows`) is at most, 0 above them all: each bound asked in
    turn with `rows_at_most`, so a dynamic M is guarded on its own bucket only."""
    return next((bound for bound in bounds if rows_at_most(rows, bound)), 0)


def current_record():
    """The LinearRecord of the op being lowered (None for an op the passes did not emit)."""
    node = V.graph.current_node
    return node.meta.get(RECORD_KEY) if node is not None else None


def record_lowering(how: str) -> None:
    """Write how this op entered the generated code into its LinearRecord (debug mode shows it)."""
    if (record := current_record()) is not None:
        record.lowered = how


def append_to_lowering(text: str) -> None:
    """Add `text` to what `record_lowering` wrote for this op."""
    if (record := current_record()) is not None:
        record.lowered = (record.lowered or "") + text


def extern_call(call, reason: str = ""):
    """`call` (an op's named arguments, `qfuse.ops.arguments`) as an extern call of the op; a `reason`
    (why it is not lowered) goes to the debug log and the op's record."""
    if reason:
        name = str(call.op).removesuffix(".default").replace(".", "::", 1)
        log.debug("qfuse: %s stays an extern call: %s", name, reason)
        record_lowering(f"extern call of {name} ({reason})")
    return inductor_lowering.fallback_handler(call.op, add_to_fallback_set=False)(*call.as_args())


@functools.cache
def _with_warps(kernel, num_warps: int):
    """`kernel` with its launch's warps as a one-config autotuner: how Inductor takes a user kernel's
    launch options (Dynamo wraps `kernel[grid](..., num_warps=w)` the same way)."""
    import triton

    return triton.autotune(configs=[triton.Config({}, num_warps=num_warps)], key=[])(kernel)


def launch_user_triton_kernel(kernel, grid: tuple, num_warps: int, tensors: dict, scalars: dict) -> None:
    """Launch the @triton.jit `kernel` on `grid` from Inductor's generated code, through Inductor's own
    lowering of `torch.library.wrap_triton`'s kernel call: `tensors` (IR) are its pointer arguments, and
    the ones it stores to (Inductor reads that from the kernel) become the buffers' writes; `scalars`
    are the rest by name, a size that is a symbol included."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_mutation

    symbolic = {name: value for name, value in scalars.items() if isinstance(value, sympy.Basic) and not value.is_number}
    constants = {name: (int(value) if isinstance(value, sympy.Integer) else value)
                 for name, value in scalars.items() if name not in symbolic}
    lower(triton_kernel_wrapper_mutation,
          kernel_idx=kernel_side_table.add_kernel(_with_warps(kernel, num_warps)),
          constant_args_idx=kernel_side_table.add_constant_args(constants),
          grid=[tuple(grid)], tma_descriptor_metadata={}, kwargs={**tensors, **symbolic})


def falls_back_to_extern_call(arguments_type):
    """Decorate the lowering of the op whose named arguments are `arguments_type`: if it raises,
    the op enters the generated code as an extern call instead, and qfuse warns once."""
    def decorate(lowering):
        @functools.wraps(lowering)
        def guarded(*args, **kwargs):
            try:
                return lowering(*args, **kwargs)
            except Exception as error:  # a bug in qfuse's lowering must not fail the user's compile
                reason = contain_internal_error(f"lowering {arguments_type.op}", error, "the op runs as an extern call")
                record_lowering(f"extern call ({reason})")
                return extern_call(arguments_type(*args, **kwargs))
        return guarded
    return decorate
