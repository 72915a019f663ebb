"""The pass manager: one Inductor `CustomGraphPass` that runs qfuse's passes in order.

It runs as Inductor's `post_grad_custom_post_pass` (post-grad, aten level, decomposed graph), after
Inductor's own post-grad patterns: first it takes back the int8 weight-only linears Inductor's
pattern took (`inductor_woq`), then the pattern families run in order. Under freezing
(`torch._inductor.config.freezing`, Inductor's recipe for CPU inference) it runs one stage earlier,
as `joint_custom_post_pass`: freezing folds every computation on constants into new constants
before the post-grad passes, so a weight-only linear's dequantize (int4 words unpacked, fp8 cast
up, times the scales) would reach qfuse as a float weight, four times the int4 memory, with nothing
left to fuse. PT2E's linears are the exception (`FREEZING_POST_GRAD_FAMILIES`): freezing lowers
them to oneDNN itself, the fastest path measured for them, so `pt2e_linear` still runs post-grad
and sees what Inductor left. Both slots hold the pass; each stage runs its families
(`families_in_stage`), and the two stages of one compile fill one report.
`uuid()` hashes qfuse's source files and the parts of the configuration that change the output,
so Inductor's FX graph cache never returns a graph compiled by another qfuse or another config.
On a warm cache hit Inductor skips post-grad passes entirely: the cached graph already holds the
qfuse ops, and no new report is produced.

`prepare_pass` is what both ways in (the backend and `install()`) do before a compile: register
the ops and lowerings, build the configuration, turn on debug logging, and compose qfuse's pass
after whatever pass is already configured in each slot.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import threading
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from qfuse import debug
from qfuse.config import QfuseConfig
from qfuse.errors import contain_internal_error
from qfuse.passes.families import PATTERN_FAMILIES, family_module
from qfuse.passes.core.fused_linear import PassContext
from qfuse.passes.core.graph_utils import dtype_of, module_path, shape_of, stored_quantized_sources
from qfuse.passes.core.inductor_padding import UNPADDED, unpad_quantized_matmuls
from qfuse.passes.core.inductor_woq import reclaim_woq_int8
from qfuse.passes.core.report import (RECLAIMED, LinearRecord, PassReport, count_ops, matmul_nodes,
                                 quantized_kernel_nodes, weight_operand)
from qfuse.passes.core.transaction import GraphSnapshot

log = logging.getLogger("qfuse")

# Each family is a module with `run(graph, context)`; its docstring says what it matches.
PASS_MODULES: dict[str, ModuleType] = {
    family: importlib.import_module(family_module(family)) for family in PATTERN_FAMILIES
}


def describe(family: str) -> str:
    """What a pattern family matches: its module docstring."""
    return (PASS_MODULES[family].__doc__ or "").strip()


_recent_reports: deque[PassReport] = deque(maxlen=64)
_graphs_compiled = 0


def recent_reports() -> list[PassReport]:
    """Reports of the (at most 64) graphs this process compiled most recently, oldest first."""
    return list(_recent_reports)


def graphs_compiled() -> int:
    """How many graphs qfuse's pass has run on in this process (a marker for `reports_since`)."""
    return _graphs_compiled


def reports_since(marker: int) -> list[PassReport]:
    """Reports of the graphs compiled after `graphs_compiled()` returned `marker`."""
    new = _graphs_compiled - marker
    return list(_recent_reports)[-new:] if new > 0 else []


@functools.cache
def source_files() -> tuple[str, ...]:
    """Every Python file of the qfuse package: the passes, and the kernel choice and lowerings whose code an FX
    graph cache entry holds (a change to any of them must miss the cache)."""
    package = Path(__file__).resolve().parents[2]
    return tuple(sorted(str(path) for path in package.rglob("*.py")))


def _source_hash() -> bytes:
    return get_hash_for_files(source_files())


def _run_family_or_restore(family: str, graph: torch.fx.Graph, context: PassContext) -> None:
    """Run one pattern family; if it raises (a bug in qfuse), put the graph and the report back as
    they were before it, record the error in the report and warn once (qfuse.errors)."""
    snapshot, rollback_report = GraphSnapshot(graph), context.report.checkpoint()
    try:
        PASS_MODULES[family].run(graph, context)
    except Exception as error:
        snapshot.restore()
        rollback_report()
        context.report.errors.append(contain_internal_error(f"pattern family {family}", error, "the graph is left as it was before it"))


UNRECOGNISED = "unrecognised"  # the family name of a quantized linear no family read
LINEAR_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _account_for_quantized_matmuls(graph: torch.fx.Graph, report: PassReport, matmuls: dict[str, str],
                                   record: bool, families_off: list[str]) -> set[str]:
    """The names of the linears (mm, addmm) no family recorded whose weight operand (the right one: an
    activation read from stored integers, as image pixels are, is data) is computed from stored
    quantized tensors (`stored_quantized_sources`): quantized linears, not float matmuls. With `record`,
    each gets a near miss (a form qfuse does not read: a 3-bit unpack, another packing; or one of a family
    the configuration switched off). Batched matmuls are not looked at: attention's read KV caches and
    rotary embeddings' positions, which are no linears. Under freezing the joint stage records them,
    where the dequantizes are whole; the post-grad stage's matmuls are new nodes of the same linears,
    which it only keeps off the float list."""
    by_name = {node.name: node for node in graph.nodes}
    quantized = set()
    for name, module in matmuls.items():
        node = by_name.get(name)
        if node is None or node.target not in LINEAR_MATMULS or report.record_for(name):
            continue
        if sources := stored_quantized_sources(weight_operand(node)):
            quantized.add(name)
            if not record:
                continue
            stored = ", ".join(f"{str(dtype_of(source)).removeprefix('torch.')} {list(shape_of(source))}" for source in sources)
            off = f"; not run, by the configuration's `patterns`: {', '.join(families_off)}" if families_off else ""
            report.add(LinearRecord(
                node=name, module=module, family=UNRECOGNISED, fused=False,
                reason=f"the weight operand is computed from stored quantized tensors ({stored}) by ops no qfuse form "
                       f"matches (docs/forms.md lists the forms){off}; left to Inductor"))
    return quantized


def _take_back_or_restore(graph: torch.fx.Graph, report: PassReport, woq_int8: bool) -> None:
    """Take back what Inductor's own passes made of quantized linears before qfuse's pass: the row padding
    of their matmuls (`inductor_padding`) and, with `woq_int8`, its int8 weight-only linears
    (`inductor_woq`); if that raises (a bug in qfuse), put the graph back as it was and record the error,
    as for a family."""
    snapshot = GraphSnapshot(graph)
    try:
        unpadded = unpad_quantized_matmuls(graph)
        reclaimed = reclaim_woq_int8(graph) if woq_int8 else []
    except Exception as error:
        snapshot.restore()
        report.errors.append(contain_internal_error("taking back Inductor's padding and woq_int8 linears", error,
                                                    "they are left to Inductor"))
        return
    report.unpadded_from_inductor += unpadded
    report.reclaimed_from_inductor += reclaimed


#: The Inductor config slot of each stage qfuse's pass can run in.
STAGE_SLOTS = {"post_grad": "post_grad_custom_post_pass", "joint": "joint_custom_post_pass"}
#: Under freezing, the families that still run post-grad (module docstring); the others run before.
FREEZING_POST_GRAD_FAMILIES = ("pt2e_linear",)

# The report of a freezing compile whose joint stage ran and whose post-grad stage has not yet
# (Inductor runs the two in turn in one thread).
_report_in_progress = threading.local()


def _freezing() -> bool:
    from torch._inductor import config as inductor_config

    return bool(inductor_config.freezing)


def _is_training_graph(graph: torch.fx.Graph) -> bool:
    """A joint forward + backward graph (its placeholders take tangents): freezing never applies."""
    return any(node.op == "placeholder" and node.name.startswith("tangents") for node in graph.nodes)


def families_in_stage(stage: str, families: list[str]) -> list[str]:
    """Which of the configured `families` run in `stage` of this compile (module docstring)."""
    if not _freezing():
        return families if stage == "post_grad" else []
    late = [family for family in families if family in FREEZING_POST_GRAD_FAMILIES]
    return late if stage == "post_grad" else [family for family in families if family not in late]


class QfusePass(CustomGraphPass):
    def __init__(self, config: QfuseConfig | None = None, stage: str = "post_grad") -> None:
        if stage not in STAGE_SLOTS:
            raise ValueError(f"qfuse: stage must be one of {tuple(STAGE_SLOTS)}, got {stage!r}")
        self.config = config if config is not None else QfuseConfig.from_env()
        self.stage = stage

    def _report(self, graph: torch.fx.Graph) -> tuple[PassReport, bool]:
        """(this graph's report, whether an earlier stage of this compile started it)."""
        global _graphs_compiled
        earlier = getattr(_report_in_progress, "report", None)
        _report_in_progress.report = None
        if self.stage == "post_grad" and _freezing() and earlier is not None:
            return earlier, True
        report = PassReport(graph_name=f"graph_{_graphs_compiled}")
        _graphs_compiled += 1
        report.ops_before = count_ops(graph)
        return report, False

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.stage == "joint" and (not _freezing() or _is_training_graph(graph)):
            return
        configured = [family for family in PATTERN_FAMILIES if family in self.config.patterns]
        families = families_in_stage(self.stage, configured)
        report, continued = self._report(graph)
        context = PassContext(self.config, report)
        # what Inductor's weight-only pattern took (it runs post-grad; under freezing the family ran before,
        # and the linears taken back would stay Inductor's dequantize + mm), and the rows pad_mm padded
        _take_back_or_restore(graph, report, self.stage == "post_grad" and "reference_linear" in configured)
        matmuls = {node.name: module_path(node) for node in matmul_nodes(graph)}
        report.inductor_quantized, report.model_kernel_calls = quantized_kernel_nodes(graph)
        if self.config.debug:
            if not continued:  # the patterns once a graph; the graph before each stage
                debug.write_patterns(self.config, report.graph_name, {family: describe(family) for family in configured})
            debug.dump_graph(self.config, report.graph_name, "0_before_post_grad" if continued else "0_before", graph)
        for family in families:
            _run_family_or_restore(family, graph, context)
            graph.eliminate_dead_code()  # what a family replaced is gone before the next family looks
            if self.config.debug:
                step = configured.index(family) + 1
                debug.dump_graph(self.config, report.graph_name, f"{step}_after_{family}", graph)
        graph.lint()
        families_off = [family for family in PATTERN_FAMILIES if family not in configured]
        if self.stage == "joint":  # the post-grad stage finishes the report
            _account_for_quantized_matmuls(graph, report, matmuls, True, families_off)
            _report_in_progress.report = report
            return
        for names, note in ((report.reclaimed_from_inductor, RECLAIMED), (report.unpadded_from_inductor, UNPADDED)):
            for name in names:
                if (record := report.record_for(name)) is not None:
                    record.add_note(note)
        report.ops_after = count_ops(graph)
        quantized = _account_for_quantized_matmuls(graph, report, matmuls, not continued, families_off)
        report.float_matmuls = [f"{name} ({module})" if module else name for name, module in matmuls.items()
                                if not report.record_for(name) and name not in quantized]
        _recent_reports.append(report)
        if report.records:
            log.info(report.headline())
            log.debug(report.summary())
        if self.config.debug:
            debug.write_report(self.config, report)

    def uuid(self) -> str | None:
        """The FX graph cache key of the pass; None (no caching) under freezing: a frozen graph's
        cache entry holds the constants qfuse's lowerings make from the weights (the int4 weight
        packed at compile time, `lowerings.frozen`), while Inductor keys frozen parameters by
        shape and dtype only, so another model's weights would reuse them."""
        if _freezing():
            return None
        return hashlib.sha256(_source_hash() + self.config.cache_key().encode() + self.stage.encode()).hexdigest()


class ComposedPass(CustomGraphPass):
    """Several custom passes run in order as one (Inductor takes a single post-grad custom pass)."""

    def __init__(self, passes: list[CustomGraphPass]) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> str | None:
        uuids = [graph_pass.uuid() for graph_pass in self.passes]
        if any(uuid is None for uuid in uuids):
            return None  # one pass cannot be cached: neither can the composition
        return hashlib.sha256(repr(uuids).encode()).hexdigest()


def compose(existing: CustomGraphPass | None, qfuse_pass: QfusePass) -> CustomGraphPass:
    """`existing` (minus any QfusePass already in it) followed by `qfuse_pass`."""
    def without_qfuse(graph_pass):
        if isinstance(graph_pass, QfusePass):
            return []
        if isinstance(graph_pass, ComposedPass):
            return [inner for nested in graph_pass.passes for inner in without_qfuse(nested)]
        return [graph_pass]

    others = without_qfuse(existing) if existing is not None else []
    return ComposedPass([*others, qfuse_pass]) if others else qfuse_pass


def prepare_pass(existing: dict[str, CustomGraphPass | None], config: QfuseConfig | None = None,
                 **options: Any) -> tuple[QfusePass, dict[str, CustomGraphPass]]:
    """Get qfuse ready to compile: its ops and lowerings registered, the configuration (`config`, else
    the `QFUSE_*` environment, with `options` applied), debug logging on in debug mode. `existing`:
    the pass configured in each of `STAGE_SLOTS`' slots (by slot name). Returns (qfuse's post-grad
    pass, the pass to configure in each slot: the existing one followed by qfuse's for that stage)."""
    import qfuse.ops  # noqa: F401  (the compiled code calls torch.ops.qfuse.*)
    from qfuse.lowerings import register_lowerings

    register_lowerings()
    config = (config or QfuseConfig.from_env()).replace(**options)
    if config.debug:
        debug.enable_logging()
    passes = {stage: QfusePass(config, stage) for stage in STAGE_SLOTS}
    slots = {slot: compose(existing.get(slot), passes[stage]) for stage, slot in STAGE_SLOTS.items()}
    return passes["post_grad"], slots
