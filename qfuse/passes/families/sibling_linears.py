"""sibling_linears: fused linears that read one activation become one call (q / k / v, gate / up).

After the families have fused the linears, the calls of one fused op (`qfuse::scaled_mm`,
`qfuse::weight_only_scaled_mm`, `qfuse::int4_weight_only_mm`) that share their activation side (the
activation node, its scale and zero point, the settings) are siblings. They become one
`qfuse::<op>_siblings` call whose output the members read as column slices, where

- kernel choice for the concatenated shape (N the members' sum; a per-tensor weight scale read as
  per channel) picks, at the graph's M, a kernel that runs siblings as one call (`Kernel.runs_siblings_of`:
  it runs the op as an extern call on a weight copy of its own, so the concatenation, made once, costs no
  memory and no lowering is lost). A dynamic M is asked at its bucket (`KernelRequest.choose_by_rows`, each
  bound a guard, as the lowering guards it: `ir.rows_at_most`), so a batch that changes within the decode
  bucket stays one call, and an M of another bucket compiles again, where the members may stay apart. (Asked
  for every bucket at once, a dynamic graph left its siblings apart wherever a larger M would run another
  kernel: each member then prepared a weight of its own beside the static graphs' joined one);
- the members can be concatenated (`qfuse.ops.siblings`' `why_not_one_call`: no block scales, no
  act order, one dtype);
- no member's weight is computed from another member's output;
- every member's weight-side input (weight, scales, zero points; not the bias, joined per call) is a graph
  input or a view of one: the concatenation is made once and kept, which a scale the graph computes on
  every call (torchao's bf16 linears cast their float32 scale in the forward) would make stale.

One launch then reads the activation once and streams every weight: at decode k and v of a GQA
model (N = 1024 each) leave many of the GPU's multiprocessors idle in launches of their own
(measured: docs/benchmarks.md, "Sibling linears: one launch for the linears that read one activation").
A group that stays apart says why in its records' notes.
Not under freezing: there the lowerings take constant weights one by one (the CPU int4pack), which
a sibling call would give up.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch
from torch._inductor import config as inductor_config
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import guard_or_false

from qfuse.kernels import KernelChoice, KernelRequest
from qfuse.ops import RECORD_KEY, SIBLING_ARGUMENTS, SIBLING_FORMS
from qfuse.ops.siblings import SiblingForm
from qfuse.passes.core.fused_linear import PassContext
from qfuse.passes.core.graph_utils import VIEW_OPS, aten, fake_value, insert_call
from qfuse.passes.core.report import LinearRecord
from qfuse.platform import current_platform
from qfuse.schemes import Granularity

FAMILY = "sibling_linears"


def run(graph: Graph, context: PassContext) -> None:
    if inductor_config.freezing:
        return
    for form in SIBLING_FORMS.values():
        for nodes in _sibling_sets(graph, form):
            _join(graph, form, nodes, context)


def _mutates(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _is_value_of_its_arguments(node: Node) -> bool:
    """Whether `node`'s value is a function of its arguments alone: a functional ATen call that draws no random
    numbers, allocates no uninitialised memory and whose result no later call writes into."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and not _mutates(node)
            and torch.Tag.nondeterministic_seeded not in target.tags and "empty" not in target.__name__
            and not any(_mutates(user) for user in node.users))


class _ValueNumbers:
    """Value numbering: one number for arguments that compute the same value, the same node or the same pure
    ATen call on the same values (each linear of vLLM's fallbacks quantizes the activation with a chain of its
    own; each linear of a 3D activation flattens it with a view of its own). A call's key holds its arguments'
    numbers, not their keys, so it stays one level deep however deep the graph (a residual stream's keys
    written out in full would double with every layer)."""

    def __init__(self, graph: Graph) -> None:
        self.of_node: dict[Node, int] = {}
        of_call: dict[tuple, int] = {}
        for node in graph.nodes:  # in order: a node's arguments are numbered before it
            call = ((node.target, self.key(node.args), tuple((name, self.key(arg)) for name, arg in sorted(node.kwargs.items())))
                    if _is_value_of_its_arguments(node) else ("node", node.name))
            try:
                self.of_node[node] = of_call.setdefault(call, len(of_call))
            except TypeError:  # an argument no key can hold: the node is only itself
                self.of_node[node] = of_call.setdefault(("node", node.name), len(of_call))

    def key(self, value):
        """What `value` (an argument) computes, as a key: equal for equal values."""
        if isinstance(value, (list, tuple)):
            return tuple(self.key(item) for item in value)
        if isinstance(value, torch.SymInt):
            return str(value)
        if isinstance(value, Node):
            return ("value", self.of_node[value])
        return value


def _sibling_sets(graph: Graph, form: SiblingForm) -> list[list[Node]]:
    """The calls of `form`'s op, by their shared (activation) side, two or more to a set, in graph order."""
    shared = [name for name in form.member._fields if name not in form.per_member and name != "kernel"]
    sets, numbers = defaultdict(list), _ValueNumbers(graph)
    for node in graph.find_nodes(op="call_function", target=form.member.op):
        call = form.member.of(node)
        if isinstance(node.meta.get(RECORD_KEY), LinearRecord):
            sets[tuple(numbers.key(getattr(call, name)) for name in shared)].append(node)
    return [nodes for nodes in sets.values() if len(nodes) > 1]


def _merged_request(form: SiblingForm, records: list[LinearRecord], widths: list[int]) -> KernelRequest | str:
    """The kernel question of the concatenated weight, or why the members ask different ones."""
    zero_points = any(record.request.key.weight_zero_point for record in records)  # a member without: zeros

    def as_merged(request: KernelRequest) -> KernelRequest:
        scheme = request.key.scheme
        if scheme.weight_granularity == Granularity.PER_TENSOR:  # its column of a per-column scale
            scheme = dataclasses.replace(scheme, weight_granularity=Granularity.PER_CHANNEL)
        key = dataclasses.replace(request.key, n=sum(widths), scheme=scheme, weight_zero_point=zero_points)
        return dataclasses.replace(request, key=key)

    merged = {as_merged(record.request) for record in records}
    return merged.pop() if len(merged) == 1 else "their kernel questions differ beyond N (scheme, dtypes or sizes)"


#: ATen calls whose result is a view of their first argument: a weight-side input made of a graph input by
#: these alone is the same memory on every call
_VIEWS = {*VIEW_OPS, aten.permute.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.slice.Tensor,
          aten.select.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.alias.default}


def _computed_per_call(value) -> Node | None:
    """The node that computes `value` anew on every call (anything but a graph input and views of one), or None."""
    while isinstance(value, Node) and value.op == "call_function" and value.target in _VIEWS:
        value = value.args[0]
    return value if isinstance(value, Node) and value.op not in ("placeholder", "get_attr") else None


def _choice(request: KernelRequest, call) -> KernelChoice:
    """The joined call's kernel choice at the graph's M: for a dynamic M, its bucket's, each bound asked a guard
    (as the lowering asks them: `ir.rows_at_most`; an M with no hint counts as large). The op's first argument is
    its activation, whose leading dims are M."""
    x = fake_value(call[0])
    platform = current_platform(x.device.type)
    if request.key.m is not None:
        return request.choose(platform)
    rows = math.prod(x.shape[:-1])
    return request.choose_by_rows(platform, lambda bound: guard_or_false(rows <= bound))[0]


def _why_apart(form: SiblingForm, nodes: list[Node], call, reads_a_member: bool) -> tuple[str, KernelRequest | None]:
    """(why these siblings stay apart or '', the merged request)."""
    records = [node.meta[RECORD_KEY] for node in nodes]
    if any(record.request is None for record in records):
        return "a member has no kernel request", None
    for name in form.per_member:
        computed = [node for node in map(_computed_per_call, getattr(call, name)) if node is not None]
        if computed and name != "bias":
            return (f"a member's {name} is computed on every call ({computed[0].name}), and the joined weight is "
                    "made once from inputs that stay the same"), None
    fakes = {name: [fake_value(value) for value in getattr(call, name)] for name in form.per_member}
    if reason := form.why_not_one_call(call._replace(**fakes)):
        return reason, None
    widths = [fake_value(node).shape[-1] for node in nodes]
    request = _merged_request(form, records, widths)
    if isinstance(request, str):
        return request, None
    if reads_a_member:
        return "a member's weight is computed from another member's output", None
    choice = _choice(request, call)  # last: a dynamic M's bucket is a guard
    if choice.kernel is None:
        return f"no kernel runs the concatenated weight ({choice.rejections()})", None
    if form.name not in choice.kernel.runs_siblings_of:
        return f"kernel {choice.kernel.name} runs no sibling calls of {form.name}", None
    return "", request


def _late_inputs(nodes: list[Node], call, form: SiblingForm) -> tuple[list[Node], bool]:
    """(the weight-side inputs placed after the first member, and what they read from after it, in graph order;
    whether any weight-side input is, or is computed from, a member's output)."""
    order = {node: index for index, node in enumerate(nodes[0].graph.nodes)}
    first, members = order[nodes[0]], set(nodes)
    late, reads_a_member = set(), False
    stack = [value for name in form.per_member for value in getattr(call, name) if isinstance(value, Node)]
    while stack:
        node = stack.pop()
        reads_a_member |= node in members
        if node not in late and order[node] > first:
            late.add(node)
            stack.extend(node.all_input_nodes)
    return sorted(late, key=order.__getitem__), reads_a_member


def _join(graph: Graph, form: SiblingForm, nodes: list[Node], context: PassContext) -> None:
    calls = [form.member.of(node) for node in nodes]
    fields = calls[0]._asdict()
    fields.update({name: [getattr(call, name) for call in calls] for name in form.per_member})
    records = [node.meta[RECORD_KEY] for node in nodes]
    names = ", ".join(record.module or record.node for record in records)
    call = SIBLING_ARGUMENTS[form.name](**fields)
    late, reads_a_member = _late_inputs(nodes, call, form)
    reason, request = _why_apart(form, nodes, call, reads_a_member)
    if reason:
        for record in records:
            record.add_note(f"not one call with its siblings ({names}): {reason}")
        return
    choice = _choice(request, call)
    sibling = call._replace(kernel=choice.kernel.name)
    for node in late:  # before the first member, where the sibling call goes
        nodes[0].prepend(node)
    widths = [fake_value(node).shape[-1] for node in nodes]
    with graph.inserting_before(nodes[0]):
        joined = insert_call(graph, sibling.op, sibling.as_args())
        joined.meta[RECORD_KEY] = records[0]  # the lowering writes how the call entered the code into the first
        start = 0
        for node, width in zip(nodes, widths):
            node.replace_all_uses_with(insert_call(graph, aten.slice.Tensor, (joined, -1, start, start + width)))
            start += width
    for node in nodes:
        graph.erase_node(node)
    widths_text = " + ".join(map(str, widths))
    for record in records:
        record.kernel, record.request, record.rejected_kernels = choice.kernel.name, request, choice.rejected
        record.add_note(f"one call with its siblings {names} (qfuse::{form.name}_siblings, N = {widths_text}): "
                        "the activation read once, one launch")
    for record in records[1:]:
        record.lowered = f"in the sibling call of {records[0].module or records[0].node}"
    context.report.matches[f"{form.name} siblings joined"] += 1
