"""Public entry points besides the backend: install / uninstall / installed, and explain.

`install` puts qfuse's pass into Inductor's `post_grad_custom_post_pass` (and `joint_custom_post_pass`,
where it runs under freezing), after a pass that is already there (both run); `uninstall` puts back
exactly what was there before. Installs nest.
`explain(model, *inputs)` compiles once and returns what qfuse did, for notebooks and tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from qfuse import debug
from qfuse.config import QfuseConfig, pass_skipping_caches_off, split_options
from qfuse.kernels.prepared import PreparedMemory, prepared_memory
from qfuse.ops.verify import verify_results
from qfuse.passes.core.manager import STAGE_SLOTS, QfusePass, graphs_compiled, prepare_pass, reports_since
from qfuse.passes.core.report import LinearRecord, PassReport, RecordSelection

_saved_passes: list[Any] = []


def install(config: QfuseConfig | None = None, **options: Any) -> QfusePass:
    """Run qfuse in every Inductor compile from now on; returns the installed pass."""
    from torch._inductor import config as inductor_config

    existing = {slot: getattr(inductor_config, slot) for slot in STAGE_SLOTS.values()}
    qfuse_pass, slots = prepare_pass(existing, config, **options)
    for slot, graph_pass in slots.items():
        setattr(inductor_config, slot, graph_pass)
    _saved_passes.append(existing)
    return qfuse_pass


def uninstall() -> None:
    """Undo the latest `install()`, restoring the pass that was configured before it."""
    from torch._inductor import config as inductor_config

    if not _saved_passes:
        raise RuntimeError("qfuse.uninstall() called without a matching qfuse.install()")
    for slot, graph_pass in _saved_passes.pop().items():
        setattr(inductor_config, slot, graph_pass)


@contextlib.contextmanager
def installed(config: QfuseConfig | None = None, **options: Any):
    qfuse_pass = install(config, **options)
    try:
        yield qfuse_pass
    finally:
        uninstall()


@dataclass
class Explanation(RecordSelection):
    """What qfuse did to each graph of one compile (`qfuse.explain`); prints as a table."""

    reports: list[PassReport]
    #: the prepared weights made from the model's tensors on the run (None: `explain` was given no nn.Module)
    prepared: PreparedMemory | None = None

    @property
    def records(self) -> list[LinearRecord]:
        return [record for report in self.reports for record in report.records]

    def __str__(self) -> str:
        if not self.reports:
            return "qfuse: no graph was compiled (was the model already compiled with these options?)"
        text = "\n\n".join(report.table() for report in self.reports)
        if self.prepared is not None:
            text += f"\n\n{self.prepared.describe()}"
        grouped = any(len(report.linear_groups()) < len(report.records) for report in self.reports)
        return text + "\n\n(one block per linear: print(explanation.details()))" if grouped else text

    def details(self) -> str:
        """The report with one block per linear (`str(explanation)` puts linears with the same outcome together)."""
        text = "\n\n".join(report.table(details=True) for report in self.reports)
        return text if self.prepared is None else f"{text}\n\n{self.prepared.describe()}"


def explain(model, *example_inputs, options: dict[str, Any] | None = None, **compile_kwargs) -> Explanation:
    """Compile `model` with backend="qfuse", run it once on `example_inputs`, and return the report.

    `options` are qfuse's / Inductor's options as for torch.compile; other keyword arguments go
    to torch.compile (`dynamic=True`, `fullgraph=True`, ...). Inductor's caches are off for this
    compile (a cache hit would skip the passes). With `debug` on, the compile runs inside depyf.
    In verify mode each record gets the max error measured on this first call. The explanation ends with
    what the prepared weights made from the model's tensors cost (`kernels.prepared.prepared_memory`).
    """
    import torch

    from qfuse.backend import qfuse_backend

    config = QfuseConfig.from_env().replace(**split_options(options)[0])
    marker = graphs_compiled()

    def backend(gm, example_inputs):  # a new backend per call: Dynamo reuses code compiled for an equal one
        return qfuse_backend(gm, example_inputs, options)

    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    if config.debug:
        debug.stop_depyf()  # a dump started by an earlier debug compile would swallow this one
    with pass_skipping_caches_off():
        with debug.DepyfDump(config) if config.debug else contextlib.nullcontext():
            compiled(*example_inputs)
    explanation = Explanation(reports_since(marker),
                              prepared_memory(model) if isinstance(model, torch.nn.Module) else None)
    results = verify_results()
    for report in explanation.reports:
        for record in report.records:
            result = results.get(f"{report.graph_name}/{record.node}")
            if result is not None:
                record.max_error = result.max_abs_error
    return explanation
