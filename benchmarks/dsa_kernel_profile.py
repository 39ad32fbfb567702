"""Per-kernel device time of one DSA decode step (indexer + top-k + sparse MLA) at DeepSeek-V3.2 shapes.

Runs the step eagerly under torch.profiler (CUDA activity, CUPTI kernel records) and prints, per kernel
name, launches per step and device microseconds per step (the sum of that kernel's durations / steps).
The gaps between kernels are not in these sums: their total against the graph-timed step of
``adapt.stages.bench_dsa`` says how much of a step is launch latency rather than kernel time.

Usage (repo root, CUDA machine): PYTHONPATH=. [DSA_MLA_TILES='{"swap_ab": true, "qk_fp8": true}'] python3
benchmarks/dsa_kernel_profile.py OUT_DIR [BATCH ...]; DSA_MLA_TILES: sparse MLA options as JSON (default: the
kernel's defaults). Writes OUT_DIR/dsa_kernel_profile.json.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from adapt.kernels import dsa, sparse_mla
from adapt.stages.bench_dsa import _decode_inputs

CONTEXT, TOPK, STEPS = 131072, 2048, 20
MLA_TILES = json.loads(os.environ.get("DSA_MLA_TILES") or "{}")


def kernel_times(fn, steps: int, warmup: int = 3) -> list[dict]:
    """Per kernel name over ``steps`` eager calls of ``fn`` (after ``warmup``): launches and device us per call,
    the most expensive first."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    launches: dict[str, int] = defaultdict(int)
    device_us: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches[event.name] += 1
            device_us[event.name] += (event.device_time_total if hasattr(event, "device_time_total")
                                       else event.cuda_time_total)
    return sorted(({"kernel": name[:90], "launches_per_step": launches[name] / steps,
                    "us_per_step": device_us[name] / steps} for name in launches), key=lambda r: -r["us_per_step"])


def profile_step(batch: int) -> dict:
    """Kernel names -> (launches per step, device us per step) over STEPS eager decode steps."""
    layer, block_table, token_seq, limits, (q8, weights, q_nope, q_rope) = _decode_inputs(batch, CONTEXT)

    def step():
        idx, _ = dsa.index_topk(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits, TOPK,
                                max_keys=CONTEXT, rows_per_tile=1)
        return sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                     block_table, token_seq, idx, 0.1, **MLA_TILES)

    rows = kernel_times(step, STEPS)
    return {"batch": batch, "context": CONTEXT, "topk": TOPK, "steps": STEPS, "kernels": rows,
            "kernel_us_per_step": sum(r["us_per_step"] for r in rows),
            "launches_per_step": sum(r["launches_per_step"] for r in rows)}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in sys.argv[2:]] or [1, 64]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mla_tiles": MLA_TILES, "cases": []}
    for batch in batches:
        case = profile_step(batch)
        result["cases"].append(case)
        (out / "dsa_kernel_profile.json").write_text(json.dumps(result, indent=2))
        print(f"batch {batch}: {case['launches_per_step']:.0f} launches, {case['kernel_us_per_step']:.1f} us of "
              f"kernels per step")
        for row in case["kernels"]:
            print(f"  {row['us_per_step']:8.1f} us  x{row['launches_per_step']:.0f}  {row['kernel']}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
