"""Why the acceptance harness's batch-1 scoring swings between about 11 and 20 us from one process to the next
(issue 16, session 13: `benchmarks/gpu-2026-12-02-dsa-s13/README.md`) while `b1_chain.py` reads 8.9-9.2 us in every
round. The harness shuffles the cache's pages (`bench_dsa._decode_inputs`: a random block table); `b1_chain.py`
reads them in order. This times the batch-1 scoring (`dsa.index_scores`, one-call CUDA graph) and the whole step
(one-layer graph) over several caches (separate allocations) x block tables (in order, and shuffled with several
seeds), three interleaved rounds, in one process: if the shuffle is what costs, every shuffled row reads slow; if
the allocation is, a cache reads slow or fast whatever its table.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/b1_pages.py OUT_DIR [CACHES [SHUFFLES]]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, sparse_mla
from adapt.kernels.formats import PAGE_SIZE
from adapt.stages.bench_dsa import _queries, _random_cache

CONTEXT, TOPK = 131072, 2048


def main(out_dir: Path, caches: int, shuffles: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = CONTEXT // PAGE_SIZE
    token_seq = torch.zeros(1, device="cuda", dtype=torch.int32)
    limits = torch.full((1,), CONTEXT, device="cuda", dtype=torch.int32)
    tables = {"ordered": torch.arange(pages, device="cuda", dtype=torch.int32)[None]}
    for seed in range(shuffles):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tables[f"shuffled {seed}"] = torch.randperm(pages, device="cuda", generator=gen).int()[None]
    layers = [(_random_cache(CONTEXT, "fp8").dsa_layer(0), *_queries(1)) for _ in range(caches)]
    rows = []
    for rnd in range(3):
        for c, (layer, q8, weights, q_nope, q_rope) in enumerate(layers):
            for name, table in tables.items():
                args = (q8, weights, layer.index_k, layer.index_scale, table, token_seq, limits)

                def step(args=args, layer=layer, table=table, q_nope=q_nope, q_rope=q_rope):
                    idx, _ = dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1)
                    return sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale,
                                                 layer.latent_rope, table, token_seq, idx, 0.1)

                row = {"round": rnd, "cache": c, "table": name,
                       "scores_us": time_cuda(lambda a=args: dsa.index_scores(*a, CONTEXT, rows_per_tile=1),
                                              100).median_us,
                       "step_us": time_cuda(step, 100).median_us}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {f"cache {c}, {name}": {k: statistics.median(r[k] for r in rows if r["cache"] == c
                                                           and r["table"] == name) for k in ("scores_us", "step_us")}
               for c in range(caches) for name in tables}
    print(json.dumps(summary, indent=1))
    (out_dir / "b1_pages.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows,
                                                       "summary": summary}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
