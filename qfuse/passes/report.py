"""What the passes did to one graph: each matmul they looked at, fused or not, and why.

The pass manager creates one `PassReport` per compiled graph; each pass appends a
`LinearRecord` per candidate matmul. Near-miss reasons come from the `can_fuse_*` checks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


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
    note: str = ""  # for a fused one: what was left outside it, and why
    module: str = ""  # the user's module the matmul came from, when Dynamo recorded it

    @property
    def where(self) -> str:
        return f"{self.node} ({self.module})" if self.module else self.node

    def summary(self) -> str:
        if self.fused:
            note = f" (note: {self.note})" if self.note else ""
            return f"{self.where}: fused [{self.family}] {self.pattern}, {self.scheme} -> {self.kernel}{note}"
        return f"{self.where}: not fused [{self.family}]: {self.reason}"


@dataclass
class PassReport:
    graph_name: str = ""
    records: list[LinearRecord] = field(default_factory=list)
    matches: Counter = field(default_factory=Counter)  # pattern name -> times applied
    ops_before: Counter = field(default_factory=Counter)  # op name -> count in the graph
    ops_after: Counter = field(default_factory=Counter)

    def add(self, record: LinearRecord) -> None:
        self.records.append(record)
        if record.fused:
            self.matches[record.pattern] += 1

    @property
    def fused(self) -> list[LinearRecord]:
        return [record for record in self.records if record.fused]

    @property
    def near_misses(self) -> list[LinearRecord]:
        return [record for record in self.records if not record.fused]

    def summary(self) -> str:
        lines = [f"qfuse: {len(self.fused)} of {len(self.records)} matmuls fused in {self.graph_name or 'graph'}"]
        lines += ["  " + record.summary() for record in self.records]
        return "\n".join(lines)


def count_ops(graph) -> Counter:
    """How many times each op is called in an FX graph, by its printed name."""
    return Counter(str(node.target) for node in graph.nodes if node.op == "call_function")
