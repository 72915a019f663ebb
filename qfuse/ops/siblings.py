"""Sibling calls: fused linears that read one activation (q / k / v, gate / up) as one call.

    <op>_siblings(shared..., lists...) = cat([<op>(shared..., member i), ...], dim=-1)

For `qfuse::scaled_mm`, `qfuse::weight_only_scaled_mm` and `qfuse::int4_weight_only_mm`, the op of the same
name plus `_siblings`: its schema is the member op's with each weight-side parameter (`SiblingForm.per_member`)
a list, one entry a member; the activation side (the activation, its scale and zero point, the settings) is
shared. The output is the members' outputs side by side along N, in the lists' order.

A kernel that runs siblings (`Kernel.runs_siblings_of`) gets the members' weights concatenated along N and
prepared once (`qfuse.kernels.prepared.built_once`, keyed by every member's tensors; biases joined per call),
and runs one call: one launch reads the activation once and streams every weight, where the members took a
launch each (k and v of a GQA model are N = 1024 each, too few output tiles to fill the GPU; measured:
docs/benchmarks.md, "Sibling linears: one launch for the linears that read one activation"). A per-tensor
weight scale or zero point becomes a column of the concatenation's per-column one: the same product. Any
other kernel, and a call whose members cannot be concatenated (`why_not_one_call`: block scales, GPTQ's act
order, differing dtypes), runs the members in turn: the op is the members' math for every input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._ops import OpOverload

from qfuse.kernels import get_kernel
from qfuse.kernels.prepared import Packing, PreparedWeight, built_once
from qfuse.ops.arguments import op_arguments
from qfuse.ops import int4_weight_only, weight_only
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs, dense_weight, int4_product, int4_values
from qfuse.ops.scaled_mm import ScaledMmArgs, _checked_output_shape, _flatten_operands, _normalize_scale_b
from qfuse.ops.weight_only import WeightOnlyScaledMmArgs


def _one_value_or_per_column(tensors: list[Tensor | None], widths: list[int]) -> str:
    """Why these members' weight scales (or zero points) make no per-column concatenation, or ''."""
    present = [tensor for tensor in tensors if tensor is not None]
    if len({tensor.dtype for tensor in present}) > 1:
        return "their weight scales or zero points differ in dtype"
    if any(tensor.numel() not in (1, n) for tensor, n in zip(tensors, widths) if tensor is not None):
        return "a weight scale is per 128 x 128 block, which concatenates along N only on whole blocks"
    return ""


def _per_column(tensors: list[Tensor | None], widths: list[int], k: int, fill: float) -> Tensor | None:
    """The members' one-value / per-column scales (or zero points) as one [1, sum N] (None if all are None;
    a missing one is `fill`, the value that means none)."""
    present = [tensor for tensor in tensors if tensor is not None]
    if not present:
        return None
    columns = []
    for tensor, n in zip(tensors, widths):
        if tensor is None:
            columns.append(torch.full((1, n), fill, dtype=present[0].dtype, device=present[0].device))
        else:
            columns.append(_normalize_scale_b(tensor, k, n).reshape(-1, 1 if tensor.numel() == 1 else n).expand(1, n))
    return torch.cat(columns, dim=1)


def _biases_why_not(biases: list[Tensor | None]) -> str:
    present = [bias for bias in biases if bias is not None]
    if len({bias.dtype for bias in present}) > 1:
        return "their biases differ in dtype"
    return ""


def _concatenated_bias(biases: list[Tensor | None], widths: list[int]) -> Tensor | None:
    """The members' biases as one [sum N] vector (a missing one is zeros), or None. Joined on every call, not
    made once: a bias is often computed in the graph (`bias.to(x.dtype)`), a new tensor each call."""
    if all(bias is None for bias in biases):
        return None
    like = next(bias for bias in biases if bias is not None)
    return torch.cat([torch.zeros(n, dtype=like.dtype, device=like.device) if bias is None else bias
                      for bias, n in zip(biases, widths)])


def _8bit_why_not(call) -> str:
    """Why the members of a scaled_mm / weight_only_scaled_mm sibling call make no one call, or ''."""
    k = call.b[0].shape[0]
    widths = [b.shape[1] for b in call.b]
    if len({b.dtype for b in call.b}) > 1 or any(b.shape[0] != k for b in call.b):
        return "their weights differ in dtype or K"
    return (_one_value_or_per_column(call.scale_b, widths) or _one_value_or_per_column(call.azp_b, widths)
            or _biases_why_not(call.bias))


def _8bit_weight(implementation, call) -> tuple[PreparedWeight, Tensor | None]:
    """(the members' weights as one prepared weight, their biases as one), each made once."""
    k = call.b[0].shape[0]
    widths = [b.shape[1] for b in call.b]
    count = len(call.b)

    def build(*sources) -> PreparedWeight:  # (holds no tensor: the cache keeps it)
        weights, scales, zero_points = sources[:count], sources[count: 2 * count], sources[2 * count:]
        return implementation.prepare_weight(torch.cat(weights, dim=1), _per_column(list(scales), widths, k, 1.0),
                                             _per_column(list(zero_points), widths, k, 0))

    label = ("siblings", implementation.name)
    weight = built_once(label, (*call.b, *call.scale_b, *call.azp_b), build)
    return weight, _concatenated_bias(call.bias, widths)


def _scaled_mm_one_call(implementation, call) -> Tensor:
    a2d, scale_a, _, azp_a, _ = _flatten_operands(call.a, call.b[0], call.scale_a, None, None, call.azp_a, None,
                                                  "scaled_mm_siblings")
    weight, bias = _8bit_weight(implementation, call)
    return implementation.apply(a2d, weight, scale_a, bias, azp_a, call.out_dtype)


def _weight_only_one_call(implementation, call) -> Tensor:
    weight, bias = _8bit_weight(implementation, call)
    return implementation.weight_only_apply(call.x.reshape(-1, call.x.shape[-1]), weight, bias, call.out_dtype)


def _int4_why_not(call) -> str:
    if any(g_idx is not None for g_idx in call.g_idx):
        return "GPTQ's act order (g_idx): each member's rows are sorted by its own groups"
    if len({packed.dtype for packed in call.packed}) > 1 or len({scales.dtype for scales in call.scales}) > 1:
        return "their packed words or group scales differ in dtype"
    return _biases_why_not(call.bias)


def prepared_int4_siblings(implementation, packed: list, shifts: list, scales: list, packed_zeros: list,
                           group_size: int, zero_convention: str, packed_along_n: bool,
                           in_place: bool = False) -> PreparedWeight:
    """The members' int4 weights (one entry a member in each list; no act order) concatenated along N and
    prepared once for `implementation`; `in_place`: read where they lie, side by side, where the kernel can
    (`Kernel.int4_checkpoint_weight`)."""
    members = list(zip(packed, shifts, scales, packed_zeros))
    count = len(members)
    settings = (group_size, None, zero_convention, packed_along_n)

    def build(*sources) -> PreparedWeight:  # (holds no tensor: the cache keeps it)
        tensors = [sources[4 * i: 4 * i + 4] for i in range(count)]  # per member: packed, shifts, scales, zeros
        if in_place and not packed_along_n and (as_stored := implementation.int4_checkpoint_weight(
                tensors, group_size, zero_convention)):
            return as_stored
        parts = [int4_values(packed, shifts, scales, zeros, *settings) for packed, shifts, scales, zeros in tensors]
        if any(part is None for part in parts):  # int8 storage outside int4's range: all of it dense
            dense = [dense_weight(packed, shifts, scales, zeros, *settings) for packed, shifts, scales, zeros in tensors]
            return PreparedWeight(torch.cat([weight.data for weight in dense], dim=1), None, None, dense[0].k,
                                  sum(weight.n for weight in dense), packing=Packing.DENSE)
        values, scales, zeros = (torch.cat(column, dim=1) for column in zip(*[
            (v, s, torch.zeros_like(v[:: settings[0]]) if z is None else z) for v, s, z, _ in parts]))
        folded = all(z is None for _, _, z, _ in parts)
        return implementation.prepare_int4_weight(values.contiguous(), scales.contiguous(),
                                                  None if folded else zeros.contiguous())

    label = ("int4 siblings", implementation.name, group_size, zero_convention, packed_along_n, in_place)
    return built_once(label, tuple(tensor for member in members for tensor in member), build)


def _int4_one_call(implementation, call) -> Tensor:
    weight = prepared_int4_siblings(implementation, call.packed, call.shifts, call.scales, call.packed_zeros,
                                    call.group_size, call.zero_convention, call.packed_along_n)  # (no g_idx)
    widths = [scales.shape[0] for scales in call.scales]
    return int4_product(implementation, call.x.reshape(-1, call.x.shape[-1]), weight,
                        _concatenated_bias(call.bias, widths), call.out_dtype)


def _check_scaled_mm(m: ScaledMmArgs) -> None:
    _checked_output_shape(m.a, m.a.dtype, m.b, m.out_dtype, "scaled_mm")
    _flatten_operands(m.a, m.b, m.scale_a, m.scale_b, m.bias, m.azp_a, m.azp_b, "scaled_mm")


def _check_weight_only(m: WeightOnlyScaledMmArgs) -> None:
    weight_only.check_call(m.x, m.b, m.scale_b, m.bias, m.azp_b, m.out_dtype)


def _check_int4(m: Int4WeightOnlyMmArgs) -> None:
    int4_weight_only.check_operands(m.x, m.packed, m.shifts, m.scales, m.packed_zeros, m.bias, m.group_size,
                                    m.out_dtype, m.g_idx, m.zero_convention, m.packed_along_n)


@dataclass(frozen=True)
class SiblingForm:
    """One member op and how its sibling op runs."""

    member: type  # the member op's named arguments (`qfuse.ops.arguments`)
    per_member: tuple[str, ...]  # its weight-side parameters: a list each in the sibling op
    why_not_one_call: Callable[[object], str]  # of a sibling call (real or fake tensors): '' if one call runs it
    one_call: Callable[[object, object], Tensor]  # (kernel, sibling call) -> the [M, sum N] output
    check: Callable[[object], object]  # the member op's checks of one member call (ValueError naming the problem)

    @property
    def name(self) -> str:
        return self.member.op._schema.name.split("::")[-1]


SIBLING_FORMS = {form.name: form for form in (
    SiblingForm(ScaledMmArgs, ("b", "scale_b", "bias", "azp_b"), _8bit_why_not, _scaled_mm_one_call, _check_scaled_mm),
    SiblingForm(WeightOnlyScaledMmArgs, ("b", "scale_b", "bias", "azp_b"), _8bit_why_not, _weight_only_one_call,
                _check_weight_only),
    SiblingForm(Int4WeightOnlyMmArgs, ("packed", "shifts", "scales", "packed_zeros", "bias", "g_idx"), _int4_why_not,
                _int4_one_call, _check_int4),
)}


def _sibling_schema(member: OpOverload, per_member: tuple[str, ...]) -> str:
    """The member's schema with each `per_member` parameter a list (and no default), named <op>_siblings."""
    text = str(member._schema)
    name, rest = text.split("(", 1)
    parameters, returns = rest.rsplit(") -> ", 1)
    listed = []
    for parameter in parameters.split(", "):
        kind, declaration = parameter.split(" ", 1)
        parameter_name = declaration.split("=")[0]
        listed.append(f"{kind}[] {parameter_name}" if parameter_name in per_member else parameter)
    return f"{name.split('::')[-1]}_siblings({', '.join(listed)}) -> {returns}"


def members(form: SiblingForm, call) -> list:
    """The member calls of a sibling call (each member op's named arguments)."""
    count = len(getattr(call, form.per_member[0]))
    if count == 0 or any(len(getattr(call, name)) != count for name in form.per_member):
        raise ValueError(f"qfuse::{form.name}_siblings: {', '.join(form.per_member)} must be lists of one length, "
                         "at least one entry")
    fields = call._asdict()
    return [form.member(**{name: fields[name][i] if name in form.per_member else fields[name]
                           for name in form.member._fields}) for i in range(count)]


def _each_member(form: SiblingForm, call) -> Tensor:
    return torch.cat([member.op(*member.as_args()) for member in members(form, call)], dim=-1)


_LIBRARY = torch.library.Library("qfuse", "FRAGMENT")
SIBLING_ARGUMENTS: dict[str, type] = {}  # form name -> the sibling op's named arguments


def _define(form: SiblingForm) -> None:
    _LIBRARY.define(_sibling_schema(form.member.op, form.per_member))
    op = getattr(torch.ops.qfuse, f"{form.name}_siblings").default
    arguments = type(f"{form.member.__name__.removesuffix('Args')}SiblingsArgs", (op_arguments(op),),
                     {"__doc__": f"`qfuse::{form.name}_siblings`'s arguments by name."})
    SIBLING_ARGUMENTS[form.name] = arguments

    def run(*args) -> Tensor:
        call = arguments(*args)
        siblings = members(form, call)  # checks the lists
        implementation = get_kernel(call.kernel)
        if form.name not in implementation.runs_siblings_of or form.why_not_one_call(call):
            return _each_member(form, call)
        for member in siblings:
            form.check(member)
        out = form.one_call(implementation, call)
        return out.reshape(*siblings[0].as_args()[0].shape[:-1], out.shape[-1])

    _LIBRARY.impl(op._schema.name.split("::")[-1], run, "CompositeExplicitAutograd")
    torch.library.register_fake(op, lambda *args: _each_member(form, arguments(*args)), lib=_LIBRARY)


for _form in SIBLING_FORMS.values():
    _define(_form)
