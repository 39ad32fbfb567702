"""Where a sparse MLA decode tile's time goes: the single-partition Gluon kernel with parts left out (issue 16).

``sparse_mla_gluon_kernel``'s ABLATE bit mask (a timing probe: the output is wrong when it is not 0) drops 1 the
gathers (masked loads), 2 the q.k MMAs, 4 the p @ v MMA, 8 the softmax arithmetic, 16 the block-table lookups.
Times each mask at decode batch 64 x 128K, top-2048, 128 heads (one slice a program: 32 tiles of 64 positions),
graph-replayed, with the full kernel first and last; prints us and us per tile.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/mla_ablate.py OUT_DIR [MASK,...] [BLOCK_K,...]
(BLOCK_K: the positions a tile, 64 by default; 32 builds in 152 KB of shared memory.)
Writes OUT_DIR/mla_ablate.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import sparse_mla_gluon
from adapt.kernels.sparse_mla import sparse_mla_torch
from adapt.stages.bench_dsa import HEADS, RANK, _decode_inputs, _rel_err

CONTEXT, TOPK, BATCH = 131072, 2048, 64
MASKS = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0, 1, 2, 4, 8, 6, 3, 5, 9, 10, 12, 0]
BLOCK_KS = [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64]


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    layer, block_table, token_seq, _, (_, _, q_nope, q_rope) = _decode_inputs(BATCH, CONTEXT)
    idx = torch.stack([torch.randperm(CONTEXT, device="cuda")[:TOPK] for _ in range(BATCH)]).int()
    out = torch.empty(BATCH, HEADS, RANK, dtype=torch.bfloat16, device="cuda")
    twin = sparse_mla_torch(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table,
                            token_seq, idx, 0.1)
    rows = []
    for block_k in BLOCK_KS:
        for mask in MASKS:
            def run(m=mask, b=block_k):
                sparse_mla_gluon.launch(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                        block_table, token_seq, idx, 0.1, out, out, 1, TOPK, block_k=b, ablate=m)
            try:
                t = time_cuda(run, 30, warmup=2)
                run()
                row = {"block_k": block_k, "ablate": mask, "us": t.median_us,
                       "us_per_64_positions": t.median_us / (TOPK // 64), "timed_as": t.mode}
                if mask == 0:
                    row["rel_err_vs_twin"] = _rel_err(out.float(), twin.float())
            except Exception as err:  # recorded; the other masks still run
                row = {"block_k": block_k, "ablate": mask, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "mla_ablate.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                                         indent=1))


if __name__ == "__main__":
    main()
