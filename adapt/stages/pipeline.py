"""The gate pipeline: run stage N after the stages before it, in one run directory.

``validate(n, options, run)`` runs every stage up to N that has no passing report in the run
directory yet, stops at the first failed gate, and returns the reports it produced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapt.errors import InputError
from adapt.report import RunDir, StageReport

STAGE_NAMES = {1: "inventory", 2: "memory", 3: "kernels", 4: "parallel", 5: "precision"}


@dataclass
class PipelineOptions:
    """What every stage may need; each stage reads its own subset.

    model: preset name, config.json or model directory; target: name or YAML path
    devices / nodes: devices in total / nodes; context: tokens per sequence; batch: sequences
    """

    model: str
    target: str
    devices: int = 8
    nodes: int = 1
    context: int = 8192
    batch: int = 1
    kv_dtype: str = "bf16"
    weights: str = "as-stored"
    stack: str | None = None
    layers: str | None = None  # stage 5: decoder layers (count or comma list) for reduced depth
    kernels: str = "all"  # stage 5: op families on adapt's kernels
    indexer_dtype: str = "fp8"  # stage 5: DSA indexer format
    compute_dtype: str = "bf16"  # stage 5: the adapted path's compute dtype
    report_dir: str | None = None  # where stages write extra files (stage 5's plot); set from the run


def _inventory(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.inventory import run_inventory

    return run_inventory(o.model, o.target, stack=o.stack, gates=gates)


def _memory(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.memory import run_plan_memory

    return run_plan_memory(o.model, o.target, devices=o.devices, nodes=o.nodes, context=o.context,
                           batch=o.batch, kv_dtype=o.kv_dtype, weights=o.weights, gates=gates)


def _kernels(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.kernels import run_kernel_tests

    return run_kernel_tests(o.model, o.target, stack=o.stack, gates=gates)


def _parallel(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.parallel import run_plan_parallel

    return run_plan_parallel(o.model, o.target, devices=o.devices, nodes=o.nodes, context=o.context,
                             batch=o.batch, kv_dtype=o.kv_dtype, weights=o.weights, gates=gates)


def _precision(o: PipelineOptions, gates: dict) -> StageReport:
    """Reads model, target, layers, kernels, weights, indexer_dtype, kv_dtype, compute_dtype, report_dir."""
    from adapt.stages.precision import run_precision

    return run_precision(o.model, o.target, gates=gates, layers=o.layers, kernels=o.kernels, weights=o.weights,
                         indexer_dtype=o.indexer_dtype, kv_dtype=o.kv_dtype, compute_dtype=o.compute_dtype,
                         report_dir=o.report_dir, invocation=[
                             "--devices", str(o.devices), "--nodes", str(o.nodes), "--context", str(o.context),
                             "--batch", str(o.batch), *(["--stack", o.stack] if o.stack else [])])


RUNNERS: dict[int, Callable[[PipelineOptions, dict], StageReport]] = {
    1: _inventory, 2: _memory, 3: _kernels, 4: _parallel, 5: _precision,
}


def validate(stage: int, options: PipelineOptions, run: RunDir, gates: dict[str, Any],
             on_report: Callable[[StageReport], None] | None = None) -> list[StageReport]:
    """Run stages 1..stage that have not passed in ``run``; stop at the first failed gate.

    Stage ``stage`` itself always runs again. Each report is written into the run directory
    as soon as it exists and passed to ``on_report``.
    """
    if stage not in RUNNERS:
        raise InputError(f"no stage {stage}; stages that run as gates: "
                         + ", ".join(f"{n} {name}" for n, name in STAGE_NAMES.items()), field="--stage")
    reports = []
    if options.report_dir is None:
        options.report_dir = str(run.path)
    for number in range(1, stage + 1):
        if number < stage and run.verdict_of(STAGE_NAMES[number]) in ("pass", "warn"):
            continue
        report = RUNNERS[number](options, gates)
        run.write(report)
        reports.append(report)
        if on_report:
            on_report(report)
        if report.decide() == "fail":
            break
    return reports
