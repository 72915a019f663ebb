"""Debug output: per compiled graph, the post-grad graph around each qfuse pass and the report.

With `debug=True` (or `QFUSE_DEBUG=1`) each graph qfuse compiles gets its own directory,
`<debug_dir>/pid<process id>/graph_<n>/`, so several graphs, recompiles and processes never
overwrite each other. It holds:

    0_before.py, 1_after_<pass>.py, ...   the graph as readable FX code (shapes, dtypes, devices)
    patterns.txt                          what each pattern family in use matches
    report.txt, report.json               what was fused, with which kernel, and every near miss

    depyf/                                decompiled Dynamo bytecode and Inductor output code,
                                          when depyf is installed (`DepyfDump`)

The `qfuse` logger prints one line per graph at INFO (debug mode turns it on) and the per-linear
details at DEBUG.
"""

from __future__ import annotations

import atexit
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qfuse.config import QfuseConfig
    from qfuse.passes.core.report import PassReport

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
    (path / "report.txt").write_text(report.table(details=True) + "\n")
    (path / "report.json").write_text(report.to_json() + "\n")
    log.info("qfuse: debug files for %s in %s", report.graph_name, path)


class DepyfDump:
    """`depyf.prepare_debug` into `<debug_dir>/pid<n>/depyf`, made harmless.

    depyf gives decompiled Dynamo bytecode and Inductor's output code beside qfuse's graphs. It
    prints a spurious version warning on torch >= 2.10 and cannot decompile some functions with
    graph breaks; neither may break a compile, so its own failures are logged, never raised
    (errors of the compile inside the block still propagate). Without depyf this says so once.
    """

    _said_missing = False
    _active: DepyfDump | None = None  # depyf patches torch globally: one dump at a time

    def __init__(self, config: QfuseConfig) -> None:
        self.path = Path(config.debug_dir) / f"pid{os.getpid()}" / "depyf"
        self._inner = None

    def __enter__(self) -> DepyfDump:
        if DepyfDump._active is not None:
            return self  # already dumping (into DepyfDump._active.path)
        try:
            import depyf
        except ImportError:
            if not DepyfDump._said_missing:
                log.warning("qfuse: depyf is not installed (pip install depyf); no decompiled bytecode dumps")
                DepyfDump._said_missing = True
            return self
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                inner = depyf.prepare_debug(str(self.path))
                inner.__enter__()
            self._inner = inner
            DepyfDump._active = self
        except Exception as error:  # depyf's own failure: report it, keep compiling
            log.warning("qfuse: depyf could not start (%s: %s); going on without it", type(error).__name__, error)
        return self

    def __exit__(self, *exc_info) -> bool:
        if self._inner is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._inner.__exit__(*exc_info)
            except Exception as error:  # depyf failed to write its dump: report it only
                log.warning("qfuse: depyf could not write its dump (%s: %s)", type(error).__name__, error)
            self._inner = None
            DepyfDump._active = None
        return False


def start_depyf_for_process(config: QfuseConfig) -> None:
    """For `backend="qfuse"` with debug on: depyf for the compiles that follow (written at exit).

    A backend runs inside the compile it would have to wrap, so it starts depyf for the rest of
    the process (or until `stop_depyf`); `qfuse.explain` wraps its compile whole instead."""
    active = DepyfDump._active
    if active is not None and active.path == DepyfDump(config).path:
        return
    stop_depyf()
    DepyfDump(config).__enter__()
    if not getattr(start_depyf_for_process, "_atexit", False):
        atexit.register(stop_depyf)
        start_depyf_for_process._atexit = True


def stop_depyf() -> None:
    """Finish the depyf dump that is running, if any (its files are written now)."""
    if DepyfDump._active is not None:
        DepyfDump._active.__exit__(None, None, None)
