"""reference_linear: a hand-written quantized matmul and its dequantize epilogue -> qfuse::scaled_mm.

The matmul (the anchor), in the three forms people write:

    torch._int_mm(a_int8, b_int8)                       int32 accumulator
    torch._int_mm(a_uint8, b_int8) - colsum(b) * zp     a uint8 activation with zero point zp (torchao's
                                                        u8s8 path: a_uint8 = a_int8 + 128, zp = 128)
    torch._scaled_mm(a, b, scale_a, scale_b, ...)       fp8 (its own scales, unit or not)
    F.scaled_mm(a, b, scale_a, recipe, scale_b, ...)    aten._scaled_mm_v2, tensor-wise / row-wise recipes
    torch.mm(a_q.float(), w_q.float().t())              a float matmul of upcast int8 / fp8

where b is the weight as [K, N]: a `w.t()` of a stored [N, K] weight, or a stored [K, N] one.

The dequantize epilogue, walked from the matmul along nodes with a single user, in any order
that keeps the math (out = acc * scale factors + bias):

    convert(acc, float)          the int32 accumulator to float
    mul(y, s), mul(s, y),        any number of scale factors, each one value (a tensor or a Python
    div(y, s)                    number), per-row [M, 1] or per-column [N] / [1, N] / [N, 1].t(),
                                 alone or multiplied together, or expanded to the output's shape
                                 (torchao's int8 GEMM on CUDA); `qfuse.passes.forms.scale_algebra` sorts
                                 them into the activation's and the weight's scale
    slice(y, 0, 0, M)            a narrow of the rows after padding the tokens (vLLM, for cuBLAS's
                                 int8 minimum of 17 rows), also after the output cast: moved onto
                                 the activation and its per-row scales, so the GEMM runs M rows
    add(y, bias)                 bias [N], once, after the scales
    view / reshape(y)            2D <-> 3D, keeping the last dim
    convert(y, dtype)            the output cast; ends the epilogue

The linear ends where a consumer is not part of the dequantize (in any dtype): a factor of the
output's own shape (`silu(gate) * up`), an add of a full-shaped tensor, any other op.

Safety (`can_fuse_*`): quantized dtypes on both sides, every factor one value / per-row /
per-column of the output (never growing it), a float output. A matmul with no scale after it, or
with a factor that fits no role, is left alone (fusing half a dequantize would mislead), with the
factor named. The activation quantization itself stays where it is (see `activation_quant`).
The walk only reads the graph: an operand that needs a new node (the uint8 shift, a transpose, the
moved row slice, the bias as a vector) is a pending call, inserted when the linear is fused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.fx import Graph, Node

from qfuse.ops.scaled_mm import OUT_DTYPES
from qfuse.passes.core.fused_linear import FusedLinear, GraphValue, NotFusable, PassContext, fuse_anchored_linears
from qfuse.passes.core.graph_utils import (
    VIEW_OPS,
    PendingCall,
    aten,
    converted_dtype,
    dtype_of,
    graph_inputs_of,
    is_subtraction,
    same_size,
    shape_of,
    single_user,
)
from qfuse.passes.forms.quant_forms import (
    Quantizer,
    constant_number,
    is_dynamic_scale,
    match_quantize,
    match_token_scale,
    uint8_as_int8,
)
from qfuse.passes.forms.scale_algebra import (Factor, NotAScale, Role, ScaleProduct, base_of, factors_of, factors_of_product,
                                        split_sides)
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, FP8_DTYPE, WEIGHT_ONLY_DTYPES, Granularity, QuantScheme, dtype_name

FAMILY = "reference_linear"
QUANTIZED = (torch.int8, FP8_DTYPE)


@dataclass
class Epilogue:
    """The state of the walk down from the matmul."""

    last: Node
    factors: list[Factor] = field(default_factory=list)
    bias: Node | None = None
    output_shape: list | None = None
    row_slice: tuple | None = None  # (start, end) of a row slice of the output, moved onto the activation
    azp_a: GraphValue | int | None = None  # the activation's zero point (a uint8 activation corrected by column sums)
    closed: bool = False  # after the output cast (or a bias fused by _scaled_mm), nothing more
    stopped_because: str = ""  # why the walk did not absorb the next node, when that is a near miss
    activation: GraphValue | None = None  # the matmul's activation operand: no weight scale is computed from it
    activation_inputs: frozenset | None = None  # its graph inputs (`graph_inputs_of`), once a linear


def _argument(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_exact_upcast(node) -> bool:
    """A conversion of an int8 / fp8 tensor to a float dtype (exact: every value is representable)."""
    target = converted_dtype(node) if isinstance(node, Node) else None
    return target is not None and target.is_floating_point and dtype_of(node.args[0]) in QUANTIZED


def _strip_weight(node: Node) -> tuple[Node, bool]:
    """Undo the float upcast on the weight side: returns (quantized [K, N] node, needs_permute).

    Only one exact upcast is undone: a conversion between float dtypes (int8 -> fp8 -> float,
    say) rounds, and what it rounds is not the quantized weight."""
    transposed = False
    while node.target == aten.permute.default and list(node.args[1]) == [1, 0]:
        node, transposed = node.args[0], not transposed
    if not _is_exact_upcast(node):
        return node, transposed
    node = node.args[0]
    while node.target == aten.permute.default and list(node.args[1]) == [1, 0]:
        node, transposed = node.args[0], not transposed
    return node, transposed


def _column_sum_correction(user: Node | None, acc: Node, b: Node):
    """The zero point zp of `acc - colsum(b) * zp` (how a uint8 activation's zero point is undone
    after `_int_mm(a_u8, b)`), or None when `user` is not that."""
    if not is_subtraction(user) or user.args[0] is not acc:
        return None
    product = user.args[1]
    if not isinstance(product, Node) or product.target != aten.mul.Tensor:
        return None
    for sums, zero_point in (product.args, product.args[::-1]):
        if (isinstance(sums, Node) and sums.target == aten.sum.dim_IntList and sums.args[0] is b
                and list(sums.args[1]) == [0] and sums.args[2:3] == (True,)):
            number = constant_number(zero_point)
            return int(number) if number is not None and number == int(number) else zero_point
    return None


def _int8_shifted_by_128(a_u8: Node) -> Node | None:
    """a_i8 when a_u8 = (a_i8.to(int32) + 128).to(uint8) (torchao's u8s8 path on VNNI CPUs)."""
    widened = a_u8.args[0] if converted_dtype(a_u8) == torch.uint8 else None
    if not (isinstance(widened, Node) and widened.target == aten.add.Tensor and widened.args[1] == 128):
        return None
    inner = widened.args[0]
    if isinstance(inner, Node) and converted_dtype(inner) == torch.int32 and dtype_of(inner.args[0]) == torch.int8:
        return inner.args[0]
    return None


def _parse_uint8_int_mm(node: Node) -> tuple[GraphValue, Node, Epilogue, str]:
    """_int_mm(a_u8, b) - colsum(b) * zp: a uint8 activation with zero point zp, as int8 with zp - 128."""
    a_u8, b = node.args
    user = single_user(node)
    zero_point = _column_sum_correction(user, node, b)
    if zero_point is None:
        raise NotFusable("_int_mm of a uint8 activation without the column-sum correction of its zero point")
    unshifted = _int8_shifted_by_128(a_u8)
    if unshifted is not None and isinstance(zero_point, int) and zero_point == 128:
        return unshifted, b, Epilogue(last=user), "_int_mm of int8 shifted to uint8"
    a, azp_a = uint8_as_int8(a_u8, zero_point)
    return a, b, Epilogue(last=user, azp_a=azp_a), "_int_mm of uint8 with a zero point"


#: torch.nn.functional.ScalingType values of _scaled_mm_v2's recipes that are one scale per tensor / row.
_V2_TENSORWISE, _V2_ROWWISE = 0, 1


def _parse_scaled_mm_v2(node: Node) -> tuple[Node, Node, Epilogue, str]:
    """torch.nn.functional.scaled_mm (aten._scaled_mm_v2): scales as lists with a recipe each."""
    a, b, scales_a, recipes_a, swizzles_a, scales_b, recipes_b, swizzles_b = node.args[:8]
    bias, contraction = _argument(node, 8, "bias"), _argument(node, 10, "contraction_dim", [])
    recipes = [*recipes_a, *recipes_b]
    if len(scales_a) != 1 or len(scales_b) != 1 or any(r not in (_V2_TENSORWISE, _V2_ROWWISE) for r in recipes):
        raise NotFusable(f"_scaled_mm_v2 with scale recipes {list(recipes_a)} x {list(recipes_b)}: qfuse takes "
                         "one tensor-wise or row-wise scale per operand")
    if any(swizzles_a) or any(swizzles_b) or list(contraction):
        raise NotFusable("_scaled_mm_v2 with swizzled scales or a contraction_dim")
    epilogue = Epilogue(last=node, bias=bias)
    for scale in (scales_a[0], scales_b[0]):
        try:
            epilogue.factors += factors_of(scale, node)
        except NotAScale as reason:
            raise NotFusable(f"_scaled_mm_v2's own scale is not per-tensor / row / column: {reason}") from None
    epilogue.closed = bias is not None or dtype_of(node) != torch.float32
    return a, b, epilogue, "_scaled_mm_v2"


def parse_matmul(node: Node) -> tuple[GraphValue, GraphValue, Epilogue, str] | None:
    """(a, b, the epilogue so far, pattern name) if `node` is a quantized matmul, else None; an
    operand that needs a new node (a shift, a transpose) is a pending call."""
    if node.target == aten._int_mm.default:
        if dtype_of(node.args[0]) == torch.uint8:
            return _parse_uint8_int_mm(node)
        return node.args[0], node.args[1], Epilogue(last=node), "_int_mm"
    if node.target == aten._scaled_mm.default:
        epilogue = Epilogue(last=node, bias=_argument(node, 4, "bias"))
        for scale in (_argument(node, 2, "scale_a"), _argument(node, 3, "scale_b")):
            try:
                epilogue.factors += factors_of(scale, node)
            except NotAScale as reason:
                raise NotFusable(f"_scaled_mm's own scale is not per-tensor / row / column: {reason}") from None
        if _argument(node, 5, "scale_result") is not None:
            raise NotFusable("_scaled_mm with scale_result is not supported")
        epilogue.closed = epilogue.bias is not None or dtype_of(node) != torch.float32
        return node.args[0], node.args[1], epilogue, "_scaled_mm"
    if node.target == aten._scaled_mm_v2.default:
        return _parse_scaled_mm_v2(node)
    if node.target == aten.mm.default:
        upcast_a, upcast_b = node.args
        weight, transposed = _strip_weight(upcast_b)
        if dtype_of(weight) not in QUANTIZED:
            return None
        if transposed:
            weight = PendingCall(aten.permute.default, (weight, [1, 0]))
        if not _is_exact_upcast(upcast_a):  # a float activation: weight-only, if the weight is int8 / fp8
            return upcast_a, weight, Epilogue(last=node), "float mm of an upcast weight"
        return upcast_a.args[0], weight, Epilogue(last=node), "float mm of upcast"
    return None


def _absorb_scale(epilogue: Epilogue, user: Node, current: Node) -> bool:
    """Take the factors of a mul / div of `current` into the epilogue; False ends the linear there."""
    if user.target == aten.div.Tensor and (user.args[0] is not current or "rounding_mode" in user.kwargs):
        return False  # s / acc, or a floor / trunc division: no dequantize
    (scale,) = [arg for arg in user.args if arg is not current] or [current]
    try:
        factors = factors_of(scale, current, inverted=user.target == aten.div.Tensor)
        factors = _weight_side_checked(factors, current, epilogue)
    except NotAScale as reason:
        if not (reason.ends_linear and epilogue.factors):
            epilogue.stopped_because = str(reason)
        return False
    epilogue.factors += factors
    return True


def _weight_side_checked(factors: list[Factor], output: Node, epilogue: Epilogue) -> list[Factor]:
    """`factors`, those computed from the activation's graph inputs marked (`Factor.from_activation`: never a
    weight scale, which is prepared once with its weight), a per-column one among them split into its own
    factors (at M = 1 the per-token scale times the weight's, `s * w_scale.reshape(1, -1)`, is [1, N] as a
    whole). NotAScale (a boundary) for such a factor that is no product and broadcasts like a weight scale: at
    M = 1 an output-shaped [1, N] tensor (SwiGLU's `silu(gate)` times `up`), or, on a weight-only linear,
    which scales no activation, any of them (a router's weight of the one token: `expert(x) * w[:, None]`)."""
    if epilogue.activation is None:
        return factors
    if epilogue.activation_inputs is None:
        epilogue.activation_inputs = graph_inputs_of(epilogue.activation)
    weight_only = dtype_of(epilogue.activation) in FLOAT_ACTIVATION_DTYPES
    checked = []
    for factor in factors:
        value = factor.value
        inputs = graph_inputs_of(value) if isinstance(value, Node) else frozenset()
        if not inputs & epilogue.activation_inputs:
            checked.append(factor)
        elif factor.role == Role.COLUMN and value.target in (aten.mul.Tensor, aten.div.Tensor):
            checked += _weight_side_checked(factors_of_product(value, output, factor.inverted), output, epilogue)
        elif factor.role == Role.COLUMN or weight_only:
            raise NotAScale(f"the factor {value.name} is computed from the activation's inputs: an ordinary "
                            "consumer of the output, not a weight scale", ends_linear=True)
        else:
            checked.append(replace(factor, from_activation=True))
    return checked


def _is_row_slice(node: Node) -> bool:
    """slice(y, 0, start, end) of a 2D matmul result (vLLM's narrow after padding the tokens)."""
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
    return node.target == aten.slice.Tensor and args[1] == 0 and args[4] == 1 and len(shape_of(node)) == 2


def _rows_can_move(epilogue: Epilogue) -> bool:
    """Whether a row slice here can move onto the activation: every row of the output so far is
    its own row of the activation, times its own row of the per-row factors (sliced with it), with
    one-value and per-column factors, a bias [N] and the output cast; no reshape mixed the rows."""
    azp_a = epilogue.azp_a
    one_zero_point = azp_a is None or isinstance(azp_a, int) or all(same_size(size, 1) for size in shape_of(azp_a))
    return epilogue.output_shape is None and epilogue.row_slice is None and one_zero_point


def _take_row_slice(epilogue: Epilogue, user: Node) -> None:
    args = list(user.args) + [0, None][len(user.args) - 2:]
    epilogue.row_slice = (args[2], args[3])
    epilogue.last = user


def walk_epilogue(epilogue: Epilogue) -> None:
    """Absorb the dequantize epilogue below the matmul into `epilogue`, as far as it goes; after
    the output cast only a row slice, which commutes with it."""
    _walk_to_output_cast(epilogue)
    user = single_user(epilogue.last)
    if epilogue.closed and user is not None and _is_row_slice(user) and _rows_can_move(epilogue):
        _take_row_slice(epilogue, user)


def _walk_to_output_cast(epilogue: Epilogue) -> None:
    while not epilogue.closed:
        current = epilogue.last
        user = single_user(current)
        if user is None and len(current.users) > 1 and not epilogue.factors:
            epilogue.stopped_because = (
                f"{current.name} has {len(current.users)} users, so what follows it cannot move into a fused op"
            )
        if user is None or user.op != "call_function":
            return
        target = user.target
        if converted_dtype(user) is not None:
            if converted_dtype(user) not in OUT_DTYPES:
                return
            epilogue.closed = dtype_of(current).is_floating_point  # an int32 -> float upcast goes on
        elif target in (aten.mul.Tensor, aten.div.Tensor) and epilogue.bias is None:
            if not _absorb_scale(epilogue, user, current):
                return
        elif target == aten.add.Tensor and epilogue.bias is None and "alpha" not in user.kwargs:
            (bias,) = [arg for arg in user.args if arg is not current] or [current]
            if not can_fuse_bias(bias, current):
                return
            epilogue.bias = bias
        elif target in VIEW_OPS and same_size(shape_of(user)[-1], shape_of(current)[-1]):
            epilogue.output_shape = list(user.args[1])
        elif _is_row_slice(user) and _rows_can_move(epilogue):
            _take_row_slice(epilogue, user)
            continue
        else:
            return
        epilogue.last = user


def can_fuse_bias(bias, output: Node) -> bool:
    """A bias [N] (or [1, N]) of `output`'s value, not growing it."""
    shape = shape_of(bias)
    return (
        shape is not None and dtype_of(bias).is_floating_point and 1 <= len(shape) <= len(shape_of(output))
        and all(same_size(size, 1) for size in shape[:-1]) and same_size(shape[-1], shape_of(output)[-1])
    )


def walk_dequantize(epilogue: Epilogue, found: str) -> torch.dtype:
    """Walk the dequantize epilogue (`walk_epilogue`) and return its output dtype; NotFusable, its
    message starting with `found`, when part of it cannot move (fusing the rest would mislead), it
    applies no scale, or it ends in a dtype a fused linear does not return."""
    walk_epilogue(epilogue)
    if epilogue.stopped_because:
        raise NotFusable(f"{found} {epilogue.stopped_because}")
    if not epilogue.factors:
        raise NotFusable(f"{found} no dequantize scale is applied to its output")
    out_dtype = dtype_of(epilogue.last)
    if out_dtype not in OUT_DTYPES:
        raise NotFusable(f"{found} the epilogue ends in {out_dtype}; a fused linear returns one of {OUT_DTYPES}")
    return out_dtype


def analyze(anchor: Node) -> FusedLinear | None:
    """Recognise the linear at `anchor`; None if it is no quantized matmul; NotFusable if it nearly is."""
    parsed = parse_matmul(anchor)
    if parsed is None:
        return None
    a, b, epilogue, pattern = parsed
    epilogue.activation = a
    a_dtype, b_dtype = dtype_of(a), dtype_of(b)
    if a_dtype in FLOAT_ACTIVATION_DTYPES:
        return _weight_only_linear(anchor, a, b, epilogue, pattern)
    if a_dtype not in QUANTIZED or b_dtype != a_dtype:
        raise NotFusable(f"{pattern} of {a_dtype} x {b_dtype}; qfuse fuses int8 x int8 and fp8 x fp8")
    out_dtype = walk_dequantize(epilogue, f"{pattern} ({dtype_name(a_dtype)}) found, but")
    quantizer = match_quantize(a)
    scale_a, scale_b = split_sides(epilogue.factors, quantizer.scale if quantizer else None)
    scheme = QuantScheme(
        activation_dtype=a_dtype, weight_dtype=b_dtype,
        activation_granularity=Granularity.PER_TOKEN if _per_token(scale_a, quantizer) else Granularity.PER_TENSOR,
        weight_granularity=Granularity.PER_CHANNEL if scale_b and scale_b.role == Role.COLUMN else Granularity.PER_TENSOR,
        dynamic=scale_a is not None and any(is_dynamic_scale(factor.value) for factor in scale_a.factors),
        symmetric=epilogue.azp_a is None,
    )
    if epilogue.row_slice is not None:
        a = PendingCall(aten.slice.Tensor, (a, 0, *epilogue.row_slice))
        scale_a = scale_a and scale_a.rows_sliced(epilogue.row_slice)
    return FusedLinear(
        anchor=anchor, family=FAMILY, pattern=f"{pattern} + dequant epilogue", a=a, b=b, scheme=scheme,
        out_dtype=out_dtype, replaces=epilogue.last, output_shape=epilogue.output_shape,
        scale_a=scale_a, scale_b=scale_b, bias=_bias_as_vector(epilogue.bias), azp_a=epilogue.azp_a,
        note=_scale_after_the_cast(epilogue) if scale_b is None else "",
    )


def _scale_after_the_cast(epilogue: Epilogue) -> str:
    """Why the record names no weight scale where the model applies one after its cast to the output dtype
    (torchao's bf16 int8 linear: `(acc * x_scale).to(bf16) * w_scale + bias`), or ''. The fused op stops at
    the cast: eager rounds there, and a scale taken into the op would be applied before that rounding."""
    user = single_user(epilogue.last)
    if not epilogue.closed or user is None or user.target not in (aten.mul.Tensor, aten.div.Tensor):
        return ""
    (other,) = [arg for arg in user.args if arg is not epilogue.last] or [None]
    shape, out_shape = shape_of(other) if isinstance(other, Node) else None, shape_of(epilogue.last)
    if shape is None or not shape or not all(same_size(size, 1) for size in shape[:-1]) or out_shape is None \
            or not same_size(shape[-1], out_shape[-1]) or same_size(shape[-1], 1):
        return ""
    return (f"the model's per-column weight scale ({other.name}) comes after its cast to "
            f"{dtype_name(dtype_of(epilogue.last))}: it and what follows stay in Inductor's code, where eager "
            "rounds to that dtype before them (the fused op applies the activation scale)")


def _weight_only_linear(anchor: Node, x: Node, b: GraphValue, epilogue: Epilogue, pattern: str) -> FusedLinear:
    """A float activation times an upcast int8 / fp8 weight, then the weight's scale: weight-only (W8A16).
    Every factor must belong to the weight (one value or one per column): the op scales no activation."""
    b_dtype = dtype_of(b)
    if b_dtype not in WEIGHT_ONLY_DTYPES:
        raise NotFusable(f"{pattern} of {dtype_name(b_dtype)}; weight-only linears take int8 / fp8 weights")
    found = f"{pattern} ({dtype_name(b_dtype)}) found, but"
    out_dtype = walk_dequantize(epilogue, found)
    if any(factor.role == Role.ROW for factor in epilogue.factors) or epilogue.row_slice is not None:
        raise NotFusable(f"{found} a factor scales the rows of the float activation; a weight-only linear takes "
                         "the weight's scale only")
    scale_b = ScaleProduct(tuple(epilogue.factors))
    granularity = Granularity.PER_CHANNEL if scale_b.role == Role.COLUMN else Granularity.PER_TENSOR
    return FusedLinear(
        anchor=anchor, family=FAMILY, pattern=f"{pattern} + dequant epilogue", a=x, b=b,
        scheme=QuantScheme.weight_only(b_dtype, granularity, dtype_of(x)), out_dtype=out_dtype,
        replaces=epilogue.last, output_shape=epilogue.output_shape, scale_b=scale_b,
        bias=_bias_as_vector(epilogue.bias),
    )


def _per_token(scale_a: ScaleProduct | None, quantizer: Quantizer | None) -> bool:
    """A row factor, or the quantizer's per-token scale (one row: M = 1 makes it look per-tensor)."""
    if scale_a is None:
        return False
    if scale_a.role == Role.ROW:
        return True
    return (quantizer is not None and match_token_scale(quantizer.scale) is not None
            and any(base_of(factor.value) is base_of(quantizer.scale) for factor in scale_a.factors))


def _bias_as_vector(bias: Node | None) -> GraphValue | None:
    if bias is None or len(shape_of(bias)) == 1:
        return bias
    return PendingCall(aten.reshape.default, (bias, [-1]))


ANCHORS = (aten._int_mm.default, aten._scaled_mm.default, aten._scaled_mm_v2.default, aten.mm.default)


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
