"""The batch-1 decode step (issue 16) run eagerly, for Nsight Compute: one 128K cache, the step (scores, select,
sparse MLA, combine) ``REPS`` times after a warm-up, so that ``ncu --launch-skip`` lands on warm launches. Under
ncu every kernel runs alone (no programmatic dependent launch overlap), so its per-kernel durations are each kernel's
own time, not its marginal cost in the chain (``b1_chain.py`` measures that).

Usage (repo root, CUDA machine): ncu ... python3 benchmarks/next/b1_ncu.py [REPS [shuffled]]
"""

from __future__ import annotations

import sys

import torch

from adapt.kernels import dsa, sparse_mla
from adapt.kernels.formats import PAGE_SIZE
from adapt.stages.bench_dsa import _queries, _random_cache

CONTEXT, TOPK = 131072, 2048


def main(reps: int, shuffled: bool) -> None:
    pages = CONTEXT // PAGE_SIZE
    if shuffled:
        table = torch.randperm(pages, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    else:
        table = torch.arange(pages, device="cuda")
    table = table.int()[None]
    token_seq = torch.zeros(1, device="cuda", dtype=torch.int32)
    limits = torch.full((1,), CONTEXT, device="cuda", dtype=torch.int32)
    layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
    q8, weights, q_nope, q_rope = _queries(1)
    for _ in range(reps):
        idx, _ = dsa.index_topk(q8, weights, layer.index_k, layer.index_scale, table, token_seq, limits, TOPK,
                                max_keys=CONTEXT, rows_per_tile=1)
        sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, table,
                              token_seq, idx, 0.1)
    torch.cuda.synchronize()
    print("done", reps, "steps", "shuffled" if shuffled else "ordered")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20, len(sys.argv) > 2 and sys.argv[2] == "shuffled")
