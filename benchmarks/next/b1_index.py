"""The batch-1 decode step with the decode indexer tiles before and after session 7 (issue 16), interleaved in one
process: the batch-64 grid (benchmarks/next/decode_index.py) made 64-key tiles with 8 stages the decode default, and
the acceptance runs after it timed the batch-1 step at 53.6 and 57.0 us, against 51.4-54.0 before.

Each tile set: index scores alone and the whole step (index + top-k + sparse MLA at their defaults) as CUDA-graph
medians, at each indexer program count, three interleaved rounds.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/b1_index.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, sparse_mla
from adapt.kernels.formats import PAGE_SIZE
from adapt.stages.bench_dsa import _queries, _random_cache

CONTEXT, TOPK = 131072, 2048
TILES = {
    "before (128 keys, 4 stages)": dict(key_block=128, num_stages=4, num_warps=4),
    "after (64 keys, 8 stages)": dict(key_block=64, num_stages=8, num_warps=4),
    "64 keys, 4 stages": dict(key_block=64, num_stages=4, num_warps=4),
}
PROGRAMS = (264, 528, 1056, 2048)


def batch1_inputs():
    """One decode row over a random 128K FP8 cache (seed 0): (layer, block table, token_seq, limits, q8, weights,
    q_nope, q_rope); also ``b1_select.py``'s."""
    torch.manual_seed(0)
    layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
    block_table = torch.arange(CONTEXT // PAGE_SIZE, device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(1, device="cuda", dtype=torch.int32)
    limits = torch.full((1,), CONTEXT, device="cuda", dtype=torch.int32)
    return (layer, block_table, token_seq, limits, *_queries(1))


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    layer, block_table, token_seq, limits, q8, weights, q_nope, q_rope = batch1_inputs()
    args = (q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits)

    def step(opts):
        idx, _ = dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1, **opts)
        return sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                     block_table, token_seq, idx, 0.1)

    rows = []
    for rnd in range(3):
        for name, tiles in TILES.items():
            for programs in PROGRAMS:
                opts = {**tiles, "programs": programs}
                scores = time_cuda(lambda o=opts: dsa.index_scores(*args, CONTEXT, rows_per_tile=1, **o), 50).median_us
                whole = time_cuda(lambda o=opts: step(o), 50).median_us
                rows.append({"round": rnd, "tiles": name, **opts, "scores_us": scores, "step_us": whole})
                print(f"round {rnd} {name:28s} programs {programs:5d}: scores {scores:6.1f} us, step {whole:6.1f} us",
                      flush=True)
    defaults = [time_cuda(lambda: step({}), 50).median_us for _ in range(3)]  # index_scores' own decode defaults
    print(f"the defaults (no tile options): step {defaults} us", flush=True)
    best = {"defaults_step_us": defaults}
    for name in TILES:
        mine = [r for r in rows if r["tiles"] == name]
        best[name] = {"best_step_us": min(r["step_us"] for r in mine),
                      "median_step_us_at_best_programs": sorted(
                          r["step_us"] for r in mine
                          if r["programs"] == min(mine, key=lambda r: r["step_us"])["programs"])[1]}
    print(json.dumps(best, indent=1))
    (out_dir / "b1_index.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows,
                                                       "summary": best}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
