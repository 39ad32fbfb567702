"""The decode indexer's tiles at batch 64 x 128K (issue 16: the batch-64 step is 1.67x its byte floor).

On 2026-12-01 (H200, commit b7497e5, torch.profiler) ``_index_scores_kernel`` took 311.5 us of the 517 us step at
batch 64: 64 x 131072 keys x 132 B (e4m3 key + fp32 scale) = 1.107 GB read, 3.55 TB/s, where the same machine reads
4.48 TB/s (``measure_ceilings`` read_tbps). The decode tiles (``bench_dsa.RUN2_INDEX_TILES``: 128-key tiles, 4
stages, 4 warps, 2048 programs) were chosen in session 2 before the one-page key tile (64 keys: one block-table entry
and contiguous keys per tile). This times the key tile, pipeline depth, warps and program count, each checked against
the default's scores, graph-timed, in TB/s of key bytes beside the same-run read and copy ceilings.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/decode_index.py OUT_DIR [BUDGET_S [first|deep]]
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

from adapt.bench.ceilings import measure_ceilings
from adapt.bench.timer import time_cuda
from adapt.kernels import dsa
from adapt.stages.bench_dsa import INDEX_DIM, RUN2_INDEX_TILES, _decode_inputs

CONTEXT, BATCH = 131072, 64


def configs(grid: str) -> list[dict]:
    out = [dict(RUN2_INDEX_TILES["decode_index"])]
    if grid == "deep":  # the second grid: deeper pipelines of one-page tiles (the first grid's best: 8 stages)
        for stages, programs in itertools.product((8, 10, 12, 16), (2048, 4096, 8192)):
            out.append(dict(key_block=64, num_stages=stages, num_warps=4, programs=programs))
        out += [dict(key_block=128, num_stages=8, num_warps=4, programs=4096),
                dict(key_block=64, num_stages=12, num_warps=2, programs=8192),
                dict(key_block=32, num_stages=16, num_warps=4, programs=4096)]
        return out
    for kb, stages, warps, programs in itertools.product((64, 128), (3, 4, 6), (4, 8), (2048, 4096)):
        cfg = dict(key_block=kb, num_stages=stages, num_warps=warps, programs=programs)
        if cfg != out[0]:
            out.append(cfg)
    out += [dict(key_block=64, num_stages=8, num_warps=4, programs=4096),
            dict(key_block=256, num_stages=2, num_warps=8, programs=2048),
            dict(key_block=256, num_stages=3, num_warps=8, programs=1056)]
    return out


def main(out_dir: Path, budget_s: float, grid: str = "first") -> None:
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ceil = measure_ceilings(copy_gib=2, reps=10, matmul_reps=3)
    layer, block_table, token_seq, limits, (q8, weights, _, _) = _decode_inputs(BATCH, CONTEXT)
    key_bytes = BATCH * CONTEXT * (INDEX_DIM + 4)

    def run(cfg):
        return dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits,
                                CONTEXT, rows_per_tile=1, **cfg)

    want = run(RUN2_INDEX_TILES["decode_index"]).clone()
    result = {"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "key_bytes": key_bytes, "rows": []}
    for cfg in configs(grid):
        if time.monotonic() - t0 > budget_s:
            result["rows"].append({**cfg, "skipped": "budget"})
            continue
        try:
            got = run(cfg)
            err = float(((got - want).abs().max() / want.abs().max()).item())
            us = time_cuda(lambda c=cfg: run(c), 20, warmup=1).median_us
        except Exception as exc:  # recorded; the others still run
            result["rows"].append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            print(result["rows"][-1], flush=True)
            continue
        tbps = key_bytes / us / 1e6
        result["rows"].append({**cfg, "us": us, "TBps": tbps, "of_read": tbps / ceil["read_tbps"],
                               "max_rel_diff_vs_default": err})
        print(f"{cfg}: {us:7.1f} us {tbps:.2f} TB/s ({tbps / ceil['read_tbps']:.2f} of read "
              f"{ceil['read_tbps']:.2f}, copy {ceil['copy_tbps']:.2f}) diff {err:.1e}", flush=True)
        (out_dir / "decode_index.json").write_text(json.dumps(result, indent=1))
    (out_dir / "decode_index.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 90.0,
         sys.argv[3] if len(sys.argv) > 3 else "first")
