"""What the passes did to one graph: each matmul they looked at, fused or not, and why.

The pass manager creates one `PassReport` per compiled graph. Each pass appends a `LinearRecord`
per quantized matmul it recognised: fused (pattern, scheme, kernel, and why every other kernel was
not used) or a near miss (the reason, from the `can_fuse_*` check that failed). Matmuls of plain
float tensors are listed apart: they are not quantized linears.

Formats: `headline()` is the one INFO line per graph, `table()` the readable report, `to_json()`
the machine-readable one (docs/debugging.md describes its fields).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from qfuse.kernels.registry import KernelRequest

#: A linear qfuse took back from Inductor's int8 weight-only pattern (`passes/core/inductor_woq.py`).
RECLAIMED = "taken back from Inductor's int8 weight-only pattern (woq_int8 -> _weight_int8pack_mm; passes/core/inductor_woq.py)"

#: What Inductor's own quantization passes turn a linear into before qfuse's pass runs (PT2E
#: linears with freezing=True, its weight-only int8 / int4 patterns); matched by name, since some
#: are Python callables of Inductor's, not ops.
INDUCTOR_QUANTIZED_OPS = ("onednn.qlinear", "_inductor.fx_passes.quantization", "_weight_int8pack_mm",
                          "_weight_int4pack_mm", "mkldnn._linear_pointwise")

MATMUL_OPS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._int_mm.default",
              "aten._scaled_mm.default", "aten._scaled_mm_v2.default")


@dataclass
class LinearRecord:
    node: str  # name of the matmul node in the post-grad graph
    family: str  # pattern family that looked at it
    fused: bool
    pattern: str = ""  # which form matched, e.g. "_int_mm + dequant epilogue"
    scheme: str = ""  # QuantScheme.describe()
    kernel: str = ""  # the kernel chosen
    rejected_kernels: dict[str, str] = field(default_factory=dict)
    reason: str = ""  # why it was not fused (a near miss)
    note: str = ""  # fused: what was left outside it, and why; a near miss: what later families said of it
    module: str = ""  # the user's module the matmul came from, when Dynamo recorded it
    max_error: float | None = None  # verify mode: max |fused - original| on the first call
    lowered: str = ""  # how the fused op entered Inductor's generated code (written by qfuse.lowerings)
    int4_in_place: bool = False  # an int4 weight's words to be read where they lie (`QfuseConfig.int4_in_place`)
    #: the question kernel choice was asked (`KernelRequest`): a lowering asks it again per bucket of a
    #: dynamic M; not part of the report's text or JSON
    request: KernelRequest | None = field(default=None, repr=False, compare=False)

    @property
    def where(self) -> str:
        return f"{self.node} ({self.module})" if self.module else self.node

    def as_dict(self) -> dict:
        """The record's fields for the JSON report (the request left out)."""
        return {name: value for name, value in dataclasses.asdict(self).items() if name != "request"}

    def add_note(self, note: str) -> None:
        """Append `note` to the record's note ('; ' between notes)."""
        self.note = "; ".join(filter(None, [self.note, note]))

    def summary(self) -> str:
        if self.fused:
            note = f" (note: {self.note})" if self.note else ""
            return f"{self.where}: fused [{self.family}] {self.pattern}, {self.scheme} -> {self.kernel}{note}"
        note = f" (also: {self.note})" if self.note else ""
        return f"{self.where}: not fused [{self.family}]: {self.reason}{note}"


class RecordSelection:
    """`fused` and `near_misses` of anything that has `records` (a report, an explanation)."""

    records: list[LinearRecord]

    @property
    def fused(self) -> list[LinearRecord]:
        return [record for record in self.records if record.fused]

    @property
    def near_misses(self) -> list[LinearRecord]:
        return [record for record in self.records if not record.fused]


@dataclass
class PassReport(RecordSelection):
    graph_name: str = ""
    records: list[LinearRecord] = field(default_factory=list)
    float_matmuls: list[str] = field(default_factory=list)  # matmuls with no quantized operand
    inductor_quantized: list[str] = field(default_factory=list)  # linears Inductor's own passes already took
    model_kernel_calls: list[str] = field(default_factory=list)  # quantized kernels the model calls itself (torchao's)
    reclaimed_from_inductor: list[str] = field(default_factory=list)  # mm nodes qfuse took back (`inductor_woq`)
    unpadded_from_inductor: list[str] = field(default_factory=list)  # matmuls whose row padding it took back
    matches: Counter = field(default_factory=Counter)  # pattern name -> times applied
    ops_before: Counter = field(default_factory=Counter)  # op name -> count in the graph
    ops_after: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # qfuse's own failures that undid a whole family (qfuse.errors)

    def add(self, record: LinearRecord) -> None:
        """Add a record. A linear that an earlier family passed over as a near miss and a later one
        fused is one linear: the near miss goes into the fused record's note. A linear that two
        families pass over keeps the first family's reason (the earlier families read the more
        specific forms), the later one's in its note."""
        earlier = self.record_for(record.node)
        if earlier is not None and not earlier.fused:  # merging keeps at most one near miss per linear
            if not record.fused:
                earlier.add_note(f"{record.family}: {record.reason}")
                return
            self.records[:] = [kept for kept in self.records if kept is not earlier]
            passed_over = f"passed over by {earlier.family}: {earlier.reason}" + (f"; {earlier.note}" if earlier.note else "")
            record.add_note(passed_over)
        if record.fused:
            self.matches[record.pattern] += 1
        self.records.append(record)

    def checkpoint(self) -> Callable[[], None]:
        """A function that puts the report back as it is now: its records, their fields (a later
        pass may have added to a record) and the match counts."""
        records, matches = list(self.records), self.matches.copy()
        saved = [{name: copy.copy(value) for name, value in vars(record).items()} for record in records]

        def rollback() -> None:
            self.records[:] = records
            for record, fields in zip(records, saved, strict=True):
                vars(record).update(fields)
            self.matches = matches
        return rollback

    def record_for(self, node_name: str) -> LinearRecord | None:
        return next((record for record in self.records if record.node == node_name), None)

    def headline(self) -> str:
        """One line: 'qfuse: 6 of 7 linears fused (6 int8 dyn-token x per-channel -> torch); 1 near miss'."""
        groups = Counter(f"{record.scheme} -> {record.kernel}" for record in self.fused)
        kinds = ", ".join(f"{count} {group}" for group, count in groups.items())
        line = f"qfuse: {self.graph_name}: {len(self.fused)} of {len(self.records)} linears fused"
        line += f" ({kinds})" if kinds else ""
        if self.near_misses:
            line += f"; {len(self.near_misses)} near miss{'es' if len(self.near_misses) > 1 else ''}"
        if self.float_matmuls:
            line += f"; {len(self.float_matmuls)} float matmul{'s' if len(self.float_matmuls) > 1 else ''} left alone"
        if self.inductor_quantized:
            line += f"; {len(self.inductor_quantized)} taken by Inductor's own quantization passes"
        if self.model_kernel_calls:
            count = len(self.model_kernel_calls)
            line += f"; {count} quantized kernel call{'s' if count > 1 else ''} of the model's own left alone"
        if self.errors:
            line += f"; {len(self.errors)} internal error{'s' if len(self.errors) > 1 else ''} (left to Inductor)"
        return line

    def summary(self) -> str:
        return "\n".join([self.headline(), *("  " + record.summary() for record in self.records)])

    def table(self, details: bool = False) -> str:
        """The readable report: the headline; the linears, those with the same outcome (pattern, scheme,
        kernel, the other kernels' reasons, ...) in one block under their names (`details`: one block per
        linear); then the float matmuls and match counts."""
        lines = [self.headline(), ""]
        for records in self.linear_groups(details):
            if len(records) == 1:
                lines.append(records[0].where)
            else:
                lines.append(f"{len(records)} linears: {_listed([record.module or record.node for record in records])}")
            lines += _block(records[0])
        if self.float_matmuls:
            lines += ["", "float matmuls (not quantized, left alone): " + ", ".join(self.float_matmuls)]
        if self.reclaimed_from_inductor:
            lines += ["", f"{RECLAIMED}: " + ", ".join(self.reclaimed_from_inductor)]
        if self.inductor_quantized:
            lines += ["", "taken by Inductor's own quantization passes before qfuse ran (freezing=True lowers PT2E "
                      "linears to oneDNN; weight-only int8 / int4 patterns): " + ", ".join(self.inductor_quantized)]
        if self.model_kernel_calls:
            lines += ["", "quantized kernels the model calls itself (e.g. torchao's packed int4 on CPU), left as they "
                      "are: " + ", ".join(self.model_kernel_calls)]
        if self.errors:
            lines += ["", "internal errors (the graph was left as it was before the failing family):"]
            lines += [f"  {error}" for error in self.errors]
        if self.matches:
            lines += ["", "matches per pattern:"] + [f"  {name}: {count}" for name, count in sorted(self.matches.items())]
        return "\n".join(lines)

    def linear_groups(self, details: bool = False) -> list[list[LinearRecord]]:
        """The records, those with the same report block together (`details`: each alone)."""
        groups: dict[str | tuple[str, ...], list[LinearRecord]] = {}
        for record in self.records:
            groups.setdefault(record.where if details else tuple(_block(record)), []).append(record)
        return list(groups.values())

    def to_json(self) -> str:
        return json.dumps({
            "graph": self.graph_name,
            "headline": self.headline(),
            "linears": [record.as_dict() for record in self.records],
            "float_matmuls": self.float_matmuls,
            "inductor_quantized": self.inductor_quantized,
            "model_kernel_calls": self.model_kernel_calls,
            "reclaimed_from_inductor": self.reclaimed_from_inductor,
            "unpadded_from_inductor": self.unpadded_from_inductor,
            "matches": dict(self.matches),
            "errors": self.errors,
            "ops_before": dict(self.ops_before),
            "ops_after": dict(self.ops_after),
        }, indent=2)


def _block(record: LinearRecord) -> list[str]:
    """The lines under a linear's name in `PassReport.table`."""
    if not record.fused:
        return [f"  NOT FUSED  [{record.family}] {record.reason}", *([f"  also       {record.note}"] if record.note else [])]
    lines = [f"  fused      {record.pattern}  [{record.family}]", f"  scheme     {record.scheme}",
             f"  kernel     {record.kernel}"]
    if record.lowered:
        lines.append(f"  code       {record.lowered}")
    lines += [f"  {'not ' + name:<10} {reason}" for name, reason in record.rejected_kernels.items()]
    if record.note:
        lines.append(f"  note       {record.note}")
    if record.max_error is not None:
        lines.append(f"  verified   max abs error {record.max_error:.3e}")
    return lines


def _listed(names: list[str], shown: int = 6) -> str:
    """'a, b, c' or, past `shown` names, the first ones and how many more."""
    if len(names) <= shown:
        return ", ".join(names)
    return ", ".join(names[:shown]) + f" and {len(names) - shown} more"


def count_ops(graph) -> Counter:
    """How many times each op is called in an FX graph, by its printed name."""
    return Counter(str(node.target) for node in graph.nodes if node.op == "call_function")


def weight_operand(matmul):
    """The right operand of a matmul node of `MATMUL_OPS` (addmm's and baddbmm's third argument)."""
    return matmul.args[2] if "addmm" in str(matmul.target) or "baddbmm" in str(matmul.target) else matmul.args[1]


def matmul_nodes(graph) -> list:
    return [node for node in graph.nodes if node.op == "call_function" and str(node.target) in MATMUL_OPS]


def quantized_kernel_nodes(graph) -> tuple[list[str], list[str]]:
    """'name (target)' of each quantized kernel call in the graph (`INDUCTOR_QUANTIZED_OPS`): (those Inductor's
    own quantization passes made of a linear, those the model called itself). A node the model's code
    traced to is its own `original_aten` (torchao's int4 on CPU calls `_weight_int4pack_mm_for_cpu`);
    one a pass made records the op it replaced there."""
    made, called = [], []
    for node in graph.nodes:
        if node.op == "call_function" and any(op in _qualified_name(node.target) for op in INDUCTOR_QUANTIZED_OPS):
            traced = str(node.meta.get("original_aten")) == str(node.target)
            (called if traced else made).append(f"{node.name} ({getattr(node.target, '__name__', node.target)})")
    return made, called


def _qualified_name(target) -> str:
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__name__', '')} {target}"
