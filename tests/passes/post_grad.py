"""Run one pass family by hand on the post-grad graph of a real compile, to see exactly what it edits.

The pass manager eliminates dead code after the passes, which would hide nodes a pass inserted and
left unused; here the family's `run` is all that touches the graph, and its graph is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from qfuse.config import QfuseConfig
from qfuse.lowerings import register_lowerings
from qfuse.passes.core.fused_linear import PassContext
from qfuse.passes.core.report import PassReport


@dataclass
class FamilyRun:
    code_before: str
    code_after: str
    nodes_before: int
    nodes_after: int
    report: PassReport
    graph: torch.fx.Graph  # after the family ran

    @property
    def untouched(self) -> bool:
        return self.code_after == self.code_before and self.nodes_after == self.nodes_before


class _Probe(CustomGraphPass):
    """Inductor deep-copies its configuration (and this pass with it): what the probe keeps are
    functions, which copy as themselves, so the runs land in the caller's list."""

    def __init__(self, run_family_pass: Callable, config: QfuseConfig, record: Callable) -> None:
        self.run_family_pass, self.config, self.record = run_family_pass, config, record

    def __call__(self, graph: torch.fx.Graph) -> None:
        code_before, nodes_before = graph.python_code("self").src, len(graph.nodes)
        context = PassContext(self.config)
        self.run_family_pass(graph, context)
        self.record(FamilyRun(code_before, graph.python_code("self").src, nodes_before, len(graph.nodes),
                              context.report, graph))

    def uuid(self) -> None:
        return None  # the tests compile with the caches off


def run_family(family: ModuleType, fn, *args, **config) -> FamilyRun:
    """Compile `fn` with plain Inductor, run `family.run` (with QfuseConfig fields `config`) on its
    post-grad graph, run the result on `args`, and return what the family did to the graph."""
    register_lowerings()
    runs: list[FamilyRun] = []
    probe = _Probe(family.run, QfuseConfig().replace(**config), runs.append)
    with torch._inductor.config.patch(post_grad_custom_post_pass=probe), torch.no_grad():
        torch.compile(fn, backend="inductor")(*args)
    (run,) = runs
    return run
