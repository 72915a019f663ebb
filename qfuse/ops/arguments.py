"""Named arguments of qfuse's custom ops, so no pass or lowering counts argument positions.

    call = ScaledMmArgs.of(node)                     an FX node of the op -> its arguments by name
    call.kernel, call._replace(bias=None)            read / change them by name
    graph.call_function(call.op, call.as_args())     emit the op with them in schema order

Each op's class is a named tuple whose fields are the op's parameters, read from the schema that
torch.library inferred from the op's Python signature: that signature stays the one statement of
the op's arguments, and a parameter added or renamed there is a field added or renamed here.
"""

from __future__ import annotations

import collections
from typing import Any

from torch._ops import OpOverload
from torch.fx import Node


class OpArguments:
    """What every op's named arguments can do; `op` is the op overload they are the arguments of."""

    __slots__ = ()
    op: OpOverload

    @classmethod
    def of(cls, node: Node) -> Any:
        """The arguments of `node`, a call of `op` (positional or keyword arguments alike)."""
        if node.op != "call_function" or node.target != cls.op:
            raise ValueError(f"{node.name} calls {node.target}, not {cls.op}")
        return cls(*node.args, **node.kwargs)

    def as_args(self) -> tuple:
        """The arguments as a plain tuple in schema order, for an FX node's or an op call's args."""
        return tuple(self)


def op_arguments(op: OpOverload) -> type:
    """A named-tuple base class whose fields are `op`'s parameters, in its schema's order (with the
    schema's defaults: a call may leave trailing defaulted arguments out).

    Use it as the base of the op's own class: `class ScaledMmArgs(op_arguments(...)): ...`."""
    arguments = op._schema.arguments
    defaults = [argument.default_value for argument in arguments if argument.has_default_value()]
    fields = collections.namedtuple(f"{op._schema.name.split('::')[-1]}_fields",
                                    [argument.name for argument in arguments], defaults=defaults)
    return type(fields.__name__, (OpArguments, fields), {"__slots__": (), "op": op})
