"""Stage 4's cost model, fed the calibrated H200 target, against the kernel times the H200 benchmarks measured.

Run from the repository root:  PYTHONPATH=. python benchmarks/predict/predict_vs_measured.py
Writes benchmarks/predict/predict_vs_measured.{json,md}. Ratio = measured / predicted (1.0 = the roofline
holds; the goal for adapt's kernels is within 25%, i.e. 0.8-1.25).

Predictions: ``adapt.stages.parallel.moe_layer_cost`` (the routed experts of one DeepSeek-V3.2 MoE layer:
E=256, top-8, hidden 7168, expert width 2048, the benchmarks' shape) and ``attention_layer_cost`` (one
DSA layer: indexer over the whole context + sparse MLA over top-2048, fp8 latent cache), on the target
``benchmarks/calibrate/h200-x1.yaml`` (read bandwidth, bf16 and fp8 matmul rates measured 2026-11-30).
"""

from __future__ import annotations

import json
from pathlib import Path

from adapt.plan.layout import load_model
from adapt.stages.parallel import attention_layer_cost, moe_layer_cost
from adapt.targets.target import load_target

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TARGET = ROOT / "benchmarks" / "calibrate" / "h200-x1.yaml"
MEASURED = ROOT / "benchmarks" / "gpu-2026-11-30"
# benchmark variant -> (weights format of stage 2/4, matrix dtype override, whose kernel, what it is)
MOE_VARIANTS = {
    "fp8_offline": ("mxfp4-offline-fp8", None, "adapt", "FP8 experts converted offline, fp8 grouped GEMM"),
    "fp8_ws": ("mxfp4-online", None, "adapt", "MXFP4 -> FP8 workspace (online) + fp8 grouped GEMM"),
    "fp8": ("mxfp4-online", None, "adapt", "MXFP4 decoded to FP8 inside the fused GEMM"),
    "bf16": ("mxfp4-online", "bf16", "adapt", "MXFP4 decoded to bf16 inside the fused GEMM"),
    "torch_grouped_bf16": ("bf16", None, "torch", "torch._grouped_mm over bf16 experts (baseline)"),
}
GOAL = 1.25


def _moe_rows(spec, target) -> list[dict]:
    # T = 16384 from call 1 (b00688c); T = 64 and 1 from call 2 (614515f), after the bf16 capture fix
    sources = [("moe_bench_b00688c.json", {16384}), ("moe_bench_smallT_614515f.json", {64, 1})]
    rows = []
    for name, tokens in sources:
        data = json.loads((MEASURED / name).read_text())
        for r in data["rows"]:
            if r["tokens"] not in tokens or "time_us" not in r or r["variant"] not in MOE_VARIANTS:
                continue
            weights, dtype, owner, what = MOE_VARIANTS[r["variant"]]
            cost = moe_layer_cost(spec, target, tokens=r["tokens"], weights=weights, compute_dtype=dtype)
            rows.append(_row("MoE layer (routed experts)", f"DeepSeek-V3 E256 top8 7168x2048, T={r['tokens']}",
                             r["variant"], owner, what, r["time_us"], cost, f"{name} ({data['commit']})"))
    return rows


def _dsa_rows(spec, target) -> list[dict]:
    name = "dsa_acceptance_b00688c.json"
    data = json.loads((MEASURED / name).read_text())
    rows = []
    for r in data["decode"]:
        batch = r["batch"]
        cost = attention_layer_cost(spec, target, tokens=batch, sequences=batch, attended=r["context"],
                                    kv_dtype="fp8")
        rows.append(_row("DSA decode step (one layer)", f"B={batch}, context {r['context']:,}", "step", "adapt",
                         "indexer scores + torch top-k + sparse MLA", r["step_us"], cost,
                         f"{name} ({data['commit']})"))
    for r in data["prefill"]:
        tokens = r["tokens"]
        cost = attention_layer_cost(spec, target, tokens=tokens, sequences=1, attended=tokens // 2, kv_dtype="fp8")
        rows.append(_row("DSA prefill (one layer)", f"{tokens:,} tokens, causal", "total", "adapt",
                         "indexer scores + top-k + sparse MLA", r["total_ms"] * 1e3, cost,
                         f"{name} ({data['commit']})"))
    return rows


def _row(kernel, shape, variant, owner, what, measured_us, cost, source) -> dict:
    ratio = measured_us / (cost.seconds * 1e6)
    return {"kernel": kernel, "shape": shape, "variant": variant, "kernel_of": owner, "what": what,
            "measured_us": measured_us, "predicted_us": cost.seconds * 1e6, "bound": "memory"
            if cost.memory_s >= cost.compute_s else f"compute ({cost.dtype})",
            "predicted_bytes": cost.bytes, "predicted_flops": cost.flops, "ratio": ratio,
            "within_25pct": 1 / GOAL <= ratio <= GOAL, "measured_in": source}


def compare() -> dict:
    spec, _ = load_model("deepseek-v3.2")
    target = load_target(str(TARGET))
    rows = _moe_rows(spec, target) + _dsa_rows(spec, target)
    return {"target": str(TARGET.relative_to(ROOT)), "target_sources": {
        k: target.sources[k] for k in ("hbm_bandwidth_tbs", "peak_tflops")}, "goal": f"ratio within 1/{GOAL}..{GOAL}",
        "rows": rows}


def markdown(result: dict) -> str:
    lines = ["# Stage 4's cost model against the H200 kernel measurements", "",
             f"Target: `{result['target']}` (calibrated 2026-11-30). Ratio = measured / predicted; "
             f"goal for adapt's kernels: {result['goal']}.", "",
             "| kernel | shape | variant | kernel of | measured us | predicted us | bound | ratio | within 25% |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['variant']} | {r['kernel_of']} | "
                     f"{r['measured_us']:,.1f} | {r['predicted_us']:,.1f} | {r['bound']} | {r['ratio']:.2f} | "
                     f"{'yes' if r['within_25pct'] else 'no'} |")
    lines += ["", "Measurements: " + "; ".join(sorted({r["measured_in"] for r in result["rows"]})) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    out = compare()
    (HERE / "predict_vs_measured.json").write_text(json.dumps(out, indent=1) + "\n")
    (HERE / "predict_vs_measured.md").write_text(markdown(out))
    print(markdown(out))
