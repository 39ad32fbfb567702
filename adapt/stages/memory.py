"""Stage 2, the memory plan, as a gated report: one ``plan_memory`` of the model on the target at
the requested layout, its per-device terms as tables, and the headroom rule (adapt/plan/headroom.py)
as the gate. The byte rules themselves live in ``adapt.plan.layout``, which stage 4 shares."""

from __future__ import annotations

from typing import Any

from adapt.plan.layout import EXACT_TERMS, GiB, gib_text, load_model, plan_headroom, plan_memory
from adapt.report import StageReport, fingerprint, now_iso
from adapt.targets.target import load_target


def run_plan_memory(
    model: str, target: str, *, gates: dict, headroom: float | None = None, **plan_args: Any
) -> StageReport:
    """Stage 2 as a gated report. ``plan_args``: ``plan_memory``'s keyword arguments (devices,
    context, batch, ...; not checkpoint, which comes from ``model``). ``gates["memory"]``:
    headroom_fraction (default margin on the estimated terms). The gate is the headroom rule
    (``adapt.plan.headroom.assess``): it fails unless every requested sequence fits."""
    started = now_iso()
    thresholds = gates.get("memory", {})
    if headroom is None:
        headroom = float(thresholds.get("headroom_fraction", 0.2))
    spec, checkpoint = load_model(model)
    tgt = load_target(target)
    plan = plan_memory(spec, tgt, headroom=headroom, checkpoint=checkpoint, **plan_args)
    context, batch, weights = plan.context, plan.batch, plan.weights_format
    report = StageReport(stage="memory", number=2, title="Memory plan", started=started)
    report.summary = " ".join(plan.explanation)
    report.metrics = plan.to_dict()
    report.tables["terms per device"] = [
        {
            "term": name,
            "GiB": round(value / GiB, 3),
            "bytes": value,
            "kind": "exact" if name in EXACT_TERMS else "estimate",
        }
        for name, value in plan.terms.items()
    ]
    report.tables["kv cache per token per device"] = [
        {"group": k, "bytes": v} for k, v in plan.kv_bytes_per_token.items() if v
    ]
    if plan.mxfp4_comparison:
        report.tables["mxfp4 online vs offline fp8 (per device)"] = [
            {"item": k, "GiB": round(v / GiB, 3), "bytes": v} for k, v in plan.mxfp4_comparison.items()
        ]
    rule = plan_headroom(plan)
    if not rule.passes:
        hint = (
            f"fewest devices that fit: {plan.fewest_devices}"
            if plan.fewest_devices
            else "no device count of this target fits"
        )
        if plan.longest_context:
            hint += f"; longest context for {plan.sequences_per_replica} sequence(s) here: {plan.longest_context:,}"
        if plan.min_gpu_memory_utilization:
            hint += f"; or --gpu-memory-utilization {plan.min_gpu_memory_utilization:.2f}"
        report.add(
            "error",
            "memory.does_not_fit" if plan.verdict == "does-not-fit" else "memory.fewer_sequences",
            f"{plan.verdict}: {rule.describe(plan.budget_bytes)} (headroom rule, adapt/plan/headroom.py); "
            f"binding term {plan.binding_term} {gib_text(plan.terms[plan.binding_term])}",
            hint,
        )
    else:
        report.add(
            "info", "memory.fits", f"fits: {rule.describe(plan.budget_bytes)}"
        )
    if plan.terms["weight_layout_padding"]:
        report.add(
            "info",
            "memory.mxfp4_layout_padding",
            f"vLLM's MXFP4 MoE kernels pad the expert layout: +{gib_text(plan.terms['weight_layout_padding'])}",
        )
    if checkpoint is not None and weights != "as-stored":
        report.add(
            "info",
            "memory.weights_from_spec",
            f"--weights {weights}: weight bytes come from the spec, not the checkpoint headers",
        )
    report.add(
        "info",
        "memory.estimates",
        "activations, buffers, CUDA graphs and overhead are estimates (sources in adapt/plan/layout.py); "
        f"weights and KV are exact; headroom {headroom:.0%} is added to the estimates",
    )
    report.fingerprint = fingerprint(
        spec_hash=spec.spec_hash(),
        target=tgt.name,
        devices=plan_args["devices"],
        nodes=plan.nodes,
        context=context,
        batch=batch,
        kv_dtype=plan.kv_dtype,
        weights=weights,
        layout=plan.layout.label(),
        gates=thresholds,
    )
    report.finished = now_iso()
    report.decide()
    return report
