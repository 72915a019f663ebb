"""Debug output: per compiled graph, the post-grad graph around each qfuse pass and the report.

With `debug=True` (or `QFUSE_DEBUG=1`) each graph qfuse compiles gets its own directory,
`<debug_dir>/pid<process id>/graph_<n>/`, so several graphs, recompiles and processes never
overwrite each other. It holds:

    0_before.py, 1_after_<pass>.py, ...   the graph as readable FX code (shapes, dtypes, devices)
    patterns.txt                          the pattern families and the traced patterns in use
    report.txt, report.json               what was fused, with which kernel, and every near miss

The `qfuse` logger prints one line per graph at INFO (debug mode turns it on) and the per-linear
details at DEBUG.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qfuse.config import QfuseConfig
    from qfuse.passes.report import PassReport

log = logging.getLogger("qfuse")


def enable_logging(level: int = logging.INFO) -> None:
    """Show qfuse's log lines on stderr (once), as debug mode promises."""
    if not any(getattr(handler, "_qfuse", False) for handler in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._qfuse = True
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > level:
        log.setLevel(level)


def graph_dir(config: QfuseConfig, graph_name: str) -> Path:
    path = Path(config.debug_dir) / f"pid{os.getpid()}" / graph_name
    path.mkdir(parents=True, exist_ok=True)
    return path


def graph_code(graph: torch.fx.Graph) -> str:
    module = graph.owning_module
    if module is not None:
        return module.print_readable(print_output=False, include_stride=False, include_device=True)
    return str(graph)


def dump_graph(config: QfuseConfig, graph_name: str, stage: str, graph: torch.fx.Graph) -> None:
    (graph_dir(config, graph_name) / f"{stage}.py").write_text(graph_code(graph))


def write_patterns(config: QfuseConfig, graph_name: str, descriptions: dict[str, str]) -> None:
    text = "\n\n".join(f"== {family} ==\n{description}" for family, description in descriptions.items())
    (graph_dir(config, graph_name) / "patterns.txt").write_text(text + "\n")


def write_report(config: QfuseConfig, report: PassReport) -> None:
    path = graph_dir(config, report.graph_name)
    (path / "report.txt").write_text(report.table() + "\n")
    (path / "report.json").write_text(report.to_json() + "\n")
    log.info("qfuse: debug files for %s in %s", report.graph_name, path)
