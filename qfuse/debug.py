"""Debug output: the post-grad graph before and after qfuse, and the match report, per graph.

Files go to `<debug_dir>/<graph name>/`: `before.py`, `after.py` (readable FX code with shapes and
dtypes) and `report.txt`. The graph name is unique per compiled graph in the process, so
recompiles and several graphs never overwrite each other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qfuse.config import QfuseConfig
    from qfuse.passes.report import PassReport

log = logging.getLogger("qfuse")


def enable_logging() -> None:
    """Show qfuse's INFO lines on stderr (once), as debug mode promises."""
    if not any(getattr(handler, "_qfuse", False) for handler in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._qfuse = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def _graph_dir(config: QfuseConfig, graph_name: str) -> Path:
    path = Path(config.debug_dir) / graph_name
    path.mkdir(parents=True, exist_ok=True)
    return path


def graph_code(graph: torch.fx.Graph) -> str:
    module = graph.owning_module
    if module is not None:
        return module.print_readable(print_output=False, include_stride=False, include_device=True)
    return str(graph)


def dump_graph(config: QfuseConfig, graph_name: str, stage: str, graph: torch.fx.Graph) -> None:
    path = _graph_dir(config, graph_name) / f"{stage}.py"
    path.write_text(graph_code(graph))


def write_report(config: QfuseConfig, report: PassReport) -> None:
    path = _graph_dir(config, report.graph_name) / "report.txt"
    matches = "\n".join(f"  {pattern}: {count}" for pattern, count in sorted(report.matches.items()))
    path.write_text(report.summary() + "\n\nmatches per pattern:\n" + (matches or "  none") + "\n")
    log.info("qfuse: debug files for %s in %s", report.graph_name, path.parent)
