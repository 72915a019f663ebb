"""Small helpers for reading and editing post-grad FX graphs.

Shapes come from each node's `meta["val"]` (a FakeTensor); symbolic sizes are compared only when
the answer is known without adding a guard (`statically_known_true`).

A pass plans the nodes a rewrite needs as `PendingCall`s while it checks, and inserts them
(`materialize`) only once every check passed and a kernel was chosen: a near miss leaves the
graph as it found it. A pending call has a FakeTensor value like a node, so `shape_of` /
`dtype_of` read both alike.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
prims = torch.ops.prims

VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
CONVERT_OPS = (prims.convert_element_type.default, aten._to_copy.default)
CONSTANT_OPS = (aten.full.default, aten.ones.default)


#: dtypes quantized weights are stored in (not int64 or bool: indices, positions and masks are)
STORED_QUANTIZED_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.float8_e4m3fn,
                           torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: where a stored tensor's values stop being followed: any product (an earlier layer's output, whatever
#: kernel made it: `mm`, `_int_mm`, `_scaled_mm(_v2)`, `_weight_int4pack_mm_for_cpu`, ...), and convolutions
_PRODUCT_SUFFIXES = ("mm", "mm_v2", "mm_for_cpu", "mv", "dot", "linear")
_PRODUCT_PREFIXES = ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_")
#: gathers, whose indices are positions, not values: only their data operand (the first) is followed
_GATHERS = (aten.index.Tensor, aten.embedding.default, aten.gather.default, aten.index_select.default)


def _is_product(op: torch._ops.OpOverload) -> bool:
    name = op._opname
    return name.endswith(_PRODUCT_SUFFIXES) or name.startswith(_PRODUCT_PREFIXES)


def stored_quantized_sources(node: Any, limit: int = 64) -> list[Node]:
    """The stored tensors (graph inputs, constants) of a quantized dtype (`STORED_QUANTIZED_DTYPES`, at
    least 2D) whose values reach `node` through the graph's own ops: a dequantize written in the
    graph. Not followed: matmuls' outputs, custom ops (qfuse's fused linears), the indices of a
    gather. At most `limit` nodes are looked at."""
    found, seen, frontier = [], set(), [node]
    while frontier and len(seen) < limit:
        current = frontier.pop()
        if not isinstance(current, Node) or current in seen:
            continue
        seen.add(current)
        if current.op in ("placeholder", "get_attr"):
            value = fake_value(current)
            if value is not None and value.dtype in STORED_QUANTIZED_DTYPES and value.dim() >= 2:
                found.append(current)
            continue
        if current.op != "call_function" or not isinstance(current.target, torch._ops.OpOverload):
            continue
        if current.target.namespace not in ("aten", "prims") or _is_product(current.target):
            continue
        inputs = current.args[:1] if current.target in _GATHERS else current.all_input_nodes
        frontier.extend(inputs)
    return found


def is_call(node: Any, *targets) -> bool:
    """`node` is a call of one of `targets`."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def is_subtraction(node: Any) -> bool:
    """`node` is `a - b`: an aten.sub.Tensor that does not scale b (`alpha`)."""
    return is_call(node, aten.sub.Tensor) and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2


def fake_value(node: Any) -> torch.Tensor | None:
    """The FakeTensor a node (or a pending call) produces, or None (a Python scalar, a node without
    metadata)."""
    if isinstance(node, PendingCall):
        return node.fake_value
    if isinstance(node, Node):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value
    return None


def shape_of(node: Any) -> tuple | None:
    value = fake_value(node)
    return None if value is None else tuple(value.shape)


def dtype_of(node: Any) -> torch.dtype | None:
    value = fake_value(node)
    return None if value is None else value.dtype


def same_size(left: Any, right: Any) -> bool:
    """Whether two (possibly symbolic) sizes are provably equal."""
    return statically_known_true(left == right)


def same_shape(left: Sequence, right: Sequence) -> bool:
    return len(left) == len(right) and all(same_size(a, b) for a, b in zip(left, right))


def static_int(size: Any) -> int | None:
    """A size as a Python int, or None when it is symbolic."""
    return size if isinstance(size, int) else None


def show_shape(shape: Sequence | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(size) for size in shape) + "]"


def strip_views(node: Any) -> tuple[Any, list | None]:
    """The value under a chain of view / reshape nodes, and the outermost view's shape argument."""
    shape = None
    while isinstance(node, Node) and node.target in VIEW_OPS:
        shape = shape if shape is not None else list(node.args[1])
        node = node.args[0]
    return node, shape


def strip_zero_padding(node: Any) -> tuple[Any, list[int]]:
    """Undo zero padding at the end of dims, as Inductor's shape padding (pad_mm) adds it to a
    matmul's operands: returns (the unpadded node, padding per dim from the first, [] if none).

    Recognised: constant_pad_nd(x, [0, p_last, 0, p_before_last, ...], 0) and cat([x, zeros], dim).
    """
    if not isinstance(node, Node) or node.op != "call_function":
        return node, []
    if node.target == aten.constant_pad_nd.default:
        pad = list(node.args[1])
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
        if value == 0 and all(isinstance(p, int) for p in pad) and not any(pad[0::2]):
            rank = len(shape_of(node))
            per_dim = [0] * rank
            for index, amount in enumerate(pad[1::2]):
                per_dim[rank - 1 - index] = amount
            return node.args[0], per_dim
    if node.target == aten.cat.default and len(node.args[0]) == 2:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        inner, zeros = node.args[0]
        if isinstance(zeros, Node) and zeros.target in (aten.full.default, aten.new_zeros.default, aten.zeros.default) \
                and (zeros.target != aten.full.default or zeros.args[1] == 0):
            rank = len(shape_of(node))
            per_dim = [0] * rank
            per_dim[dim % rank] = shape_of(zeros)[dim % rank]
            return inner, per_dim
    return node, []


def graph_inputs_of(value: Any) -> frozenset[Node]:
    """The placeholders and graph constants (get_attr) `value` is computed from: a node, a pending call
    (its arguments), or a number (none)."""
    pending = [value]
    seen: set[int] = set()
    inputs: set[Node] = set()
    while pending:
        item = pending.pop()
        if isinstance(item, PendingCall):
            pending.extend(item.args)
            continue
        if isinstance(item, (list, tuple)):
            pending.extend(item)
            continue
        if not isinstance(item, Node) or id(item) in seen:
            continue
        seen.add(id(item))
        if item.op in ("placeholder", "get_attr"):
            inputs.add(item)
        pending.extend(item.all_input_nodes)
    return frozenset(inputs)


def module_path(node: Node) -> str:
    """The user's module a node came from ("blocks.0.mlp.up_proj"), or '' when not recorded."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return re.sub(r"^[LG]\['[^']*'\]\.?", "", path)  # drop Dynamo's L['self'] / L['fn'] root


def single_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def converted_dtype(node: Node) -> torch.dtype | None:
    """The target dtype of a dtype-conversion node, else None."""
    if node.op != "call_function" or node.target not in CONVERT_OPS:
        return None
    if node.target == prims.convert_element_type.default:
        return node.args[1]
    if set(node.kwargs) - {"dtype"}:
        return None  # a device or layout change as well
    return node.kwargs.get("dtype")


def _example(arg: Any) -> Any:
    if isinstance(arg, (PendingCall, PendingConstant)):
        return arg.fake_value
    if isinstance(arg, Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_example(item) for item in arg)
    return arg


def graph_fake_mode(graph: Graph):
    """The FakeTensorMode the graph's metadata was computed under."""
    values = [node.meta["val"] for node in graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)]
    return torch._guards.detect_fake_mode(values) or torch._subclasses.FakeTensorMode()


def _evaluate(graph: Graph, target: Any, args: tuple, kwargs: dict) -> Any:
    """What target(*args, **kwargs) produces, on the FakeTensors of the graph's nodes."""
    with graph_fake_mode(graph):
        return target(*_example(args), **_example(kwargs))


def insert_call(graph: Graph, target: Any, args: tuple, kwargs: dict | None = None) -> Node:
    """Insert a call (at the graph's current insertion point) with its meta["val"] filled in."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = _evaluate(graph, target, args, kwargs)
    return node


@dataclass(eq=False)
class PendingCall:
    """target(*args, **kwargs), to be inserted into the graph of the nodes it reads (`materialize`);
    its args may hold nodes and other pending calls."""

    target: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    node: Node | None = field(default=None, init=False)  # once inserted

    @property
    def graph(self) -> Graph:
        """The graph of the first node among the arguments (a pending call reads at least one)."""
        for arg in self.args:
            if isinstance(arg, (Node, PendingCall)):
                return arg.graph
        raise ValueError(f"a pending call of {self.target} reads no graph node")

    @functools.cached_property
    def fake_value(self) -> Any:
        return _evaluate(self.graph, self.target, self.args, self.kwargs)


@dataclass(eq=False)
class PendingConstant:
    """A tensor a rewrite computes at compile time from the graph's constants (AWQ's shifts in its
    channel order), to be inserted as a constant of the graph's module (`materialize`)."""

    value: torch.Tensor  # on the device the graph's ops read it from
    graph: Graph
    name: str  # a readable stem for the module attribute
    node: Node | None = field(default=None, init=False)  # once inserted

    @functools.cached_property
    def fake_value(self) -> Any:
        return graph_fake_mode(self.graph).from_tensor(self.value, static_shapes=True)


def materialize(graph: Graph, value: Any) -> Any:
    """`value` with its pending calls and constants inserted at the graph's current insertion point
    (each once); anything else (a node, a number, None) as it is."""
    if isinstance(value, PendingConstant):
        if value.node is None:
            module, index = graph.owning_module, 0
            while hasattr(module, f"_qfuse_{value.name}_{index}"):
                index += 1
            module.register_buffer(f"_qfuse_{value.name}_{index}", value.value)
            value.node = graph.get_attr(f"_qfuse_{value.name}_{index}")
            value.node.meta["val"] = value.fake_value
        return value.node
    if not isinstance(value, PendingCall):
        return value
    if value.node is None:
        args = tuple(materialize(graph, arg) for arg in value.args)
        value.node = graph.call_function(value.target, args, value.kwargs)
        value.node.meta["val"] = value.fake_value
    return value.node


def scalar_tensor(graph: Graph, value: float | int, dtype: torch.dtype, device: torch.device) -> Node:
    """A 0-dim constant tensor node holding a Python scalar from the graph."""
    return insert_call(graph, aten.full.default, ([], value), {"dtype": dtype, "device": device, "pin_memory": False})
