"""Stage 5 on a reduced-depth DeepSeek-V3.2-width checkpoint (layers 0 and 3), all of adapt's kernels on.

The checkpoint is generated in place (no download): ``runtime_reduced_depth.generate_checkpoint``
with DeepSeek-V3.2's published config.json (``adapt/model/presets/deepseek-v3.2.json``; vocab
129,280, hidden 7,168, 256 routed experts of width 2,048; fp8 block projections, MXFP4 experts,
random weights). Stage 5 then runs with ``--layers 0,3``: adapted = every kernel family (sparse MLA,
FP8 indexer, MXFP4 MoE through the FP8 workspace, RMSNorm/RoPE), FP8 experts/indexer/KV, bf16
compute; reference = adapt's torch path in float32.

    ADAPT_COMMIT=<sha> python benchmarks/precision_reduced_depth.py --out DIR            # the H200 run
    python benchmarks/precision_reduced_depth.py --out DIR --shrink --kernels ...        # CPU dry run

Writes DIR/precision.json, precision.md, precision_layers.png and summary.json (date, commit,
device, timings).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "adapt" / "model" / "presets" / "deepseek-v3.2.json"
SHRUNK = {"vocab_size": 1024, "hidden_size": 512, "intermediate_size": 512, "moe_intermediate_size": 128,
          "n_routed_experts": 16, "num_attention_heads": 2, "index_n_heads": 4, "index_topk": 64}  # CPU dry run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernels", default="all")
    parser.add_argument("--shrink", action="store_true", help="small widths (a CPU dry run of the plumbing)")
    parser.add_argument("--attribute", action="store_true", help="re-run with components moved back on failure")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from adapt.report import load_gates
    from adapt.stages.precision import run_precision

    spec = importlib.util.spec_from_file_location("reduced", ROOT / "benchmarks" / "runtime_reduced_depth.py")
    reduced = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reduced)
    work = Path(tempfile.mkdtemp(prefix="adapt-v32-precision-"))
    config = json.loads(PRESET.read_text())
    if args.shrink:
        config.update(SHRUNK)
    (work / "source.json").write_text(json.dumps(config))
    reduced.REAL_CONFIG = work / "source.json"
    model = work / "model"
    model.mkdir()
    args.out.mkdir(parents=True, exist_ok=True)
    timings = {}
    try:
        t0 = time.perf_counter()
        sizes = reduced.generate_checkpoint(model)
        timings["generate_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        report = run_precision(str(model), "h200", gates=load_gates(), layers="0,3", kernels=args.kernels,
                               weights="mxfp4-online", indexer_dtype="fp8", kv_dtype="fp8", compute_dtype="bf16",
                               report_dir=args.out, attribute=args.attribute)
        timings["stage5_s"] = round(time.perf_counter() - t0, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.decide()
    (args.out / "precision.json").write_text(report.to_json())
    (args.out / "precision.md").write_text(report.to_markdown())
    cuda = torch.cuda.is_available()
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("ADAPT_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "shrunk": args.shrink, "kernels": args.kernels, "checkpoint_bytes": sum(sizes.values()),
        "verdict": report.verdict, "timings": timings,
        "findings": [f"{f.severity} {f.code}: {f.message}" for f in report.findings],
        "metrics": {k: v for k, v in report.metrics.items() if not isinstance(v, dict | list) or k.startswith("dsa")},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
