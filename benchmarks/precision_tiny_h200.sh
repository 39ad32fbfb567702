#!/usr/bin/env bash
# Stage 5 (precision) with all of adapt's kernels on every tiny model (adapt.model.tiny.TINY_MODELS), target
# h200, on the GPU: adapted = attention, indexer, MoE and norm/rope kernels, FP8 experts (online conversion
# through the FP8 workspace), FP8 indexer, FP8 KV cache, bf16 compute; reference = adapt's torch path in
# float32 on the same GPU; attribution runs when a gate fails. The trained tiny models come from
# $ADAPT_CACHE_DIR (carry the CPU-built cache so the GPU spends no time training them).
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> ADAPT_CACHE_DIR=<cache> OUT=<dir> bash benchmarks/precision_tiny_h200.sh
# (CPU dry run of the plumbing: DEVICE=cpu MODELS=tiny-qwen3 TRITON_INTERPRET=1 OUT=/tmp/x bash ...)
# Files under $OUT (8): session.log, summary.json, <model>.json (the stage report) and <model>/precision_layers.png.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
timeout "${PRECISION_S:-130}" python3 - <<'PY'
import datetime, json, os, time
from pathlib import Path

import torch, triton

from adapt.model.tiny import TINY_MODELS, tiny_path
from adapt.report import load_gates
from adapt.stages.precision import run_precision

out = Path(os.environ["OUT"])
summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": os.environ.get("ADAPT_COMMIT", "unknown"), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "target": "h200", "kernels": "all",
           "formats": "experts fp8 (online), indexer fp8, kv fp8, compute bf16", "models": {}}
for name in os.environ.get("MODELS", " ".join(TINY_MODELS)).split():
    start = time.perf_counter()
    report = run_precision(str(tiny_path(name)), "h200", gates=load_gates(), kernels="all", weights="fp8",
                           indexer_dtype="fp8", kv_dtype="fp8", compute_dtype="bf16", report_dir=out / name,
                           device=os.environ.get("DEVICE", "cuda"))
    seconds = time.perf_counter() - start
    (out / f"{name}.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    keep = ("max_rel_error_layer", "router_agreement_min", "real_flip_rate_max", "near_tie_flips", "real_flips",
            "kl_mean", "top1_agreement", "top5_overlap", "perplexity_reference", "perplexity_adapted",
            "greedy_min_matched", "expert_gain_error_max", "expert_rel_error_max", "dsa_overlap_vs_reference",
            "dsa_overlap_vs_same_quantization", "attributed_to", "rollback_command")
    summary["models"][name] = {"verdict": report.decide(), "seconds": round(seconds, 1),
                               "failures": [f.message for f in report.findings if f.severity == "error"],
                               **{k: report.metrics[k] for k in keep if k in report.metrics}}
    print(name, json.dumps(summary["models"][name], default=str), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
PY
echo "rc=$?"; date -u
