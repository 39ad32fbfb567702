"""The fourth session's H200 call for the indexer prefill (issue 16): ``bench_dsa``'s acceptance prefill case at
128K (same-run ceilings, indexer sweep on the last 4096 rows and over all 128K rows, the fastest tile for the
whole prefill with top-k, sparse MLA and cuDNN dense SDPA), its indexer sweep cut to the tl default (2 x 64, 4
warps, 3 stages) and the Gluon rows, and sparse MLA to one tile (see below).

Usage (repo root, GPU machine): python benchmarks/gpu_dsa_s4_indexer.py OUT_DIR

Before the sweep each Gluon row is checked against the tl kernel and the twin on the last 64 rows of an 8192-token
random prefill (DeepSeek shapes); a row that fails to run or exceeds the GPU twin tolerance (5e-3 relative) is
left out of the sweep (and printed), so a wrong kernel cannot become the step's tile.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from adapt.kernels import dsa
from adapt.stages import bench_dsa

TWIN_TOL = 5e-3  # tests/kernels/test_dsa.py SCORE_REL_TOL["cuda"]


def checked(rows: tuple[dict, ...], tl_default: dict) -> tuple[dict, ...]:
    """The rows whose scores match the tl kernel and the twin on a small DeepSeek-shaped prefill."""
    n = 8192
    torch.manual_seed(1)
    layer = bench_dsa._random_cache(n, "fp8").dsa_layer(0)
    q8, weights, _, _ = bench_dsa._queries(64)
    table = torch.arange(n // 64, device="cuda", dtype=torch.int32)[None]
    seq = torch.zeros(64, device="cuda", dtype=torch.int32)
    limits = torch.arange(n - 63, n + 1, device="cuda", dtype=torch.int32)
    args = (q8, weights, layer.index_k, layer.index_scale, table, seq, limits, n)
    want = dsa.index_scores_torch(*args)
    ref = dsa.index_scores(*args, **tl_default)
    keep = []
    for opt in rows:
        try:
            got = dsa.index_scores(*args, **opt)
            err = (bench_dsa._rel_err(got, want), bench_dsa._rel_err(got, ref))
            same_mask = bool(torch.equal(torch.isfinite(got), torch.isfinite(want)))
        except Exception as e:  # left out of the sweep, reported
            print(json.dumps({"check": opt, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
            continue
        ok = same_mask and max(err) <= TWIN_TOL
        print(json.dumps({"check": opt, "rel_err_vs_twin": err[0], "rel_err_vs_tl": err[1], "mask_ok": same_mask,
                          "kept": ok}), flush=True)
        if ok:
            keep.append(opt)
    print(json.dumps({"check": tl_default, "rel_err_vs_twin": bench_dsa._rel_err(ref, want)}), flush=True)
    return tuple(keep)

if __name__ == "__main__":
    # call 3 (63bde98) ran the stacked Gluon row capped at 168 registers with 2 stages and the four row-split rows;
    # PREFILL_INDEX_SWEEP now keeps the row-split row of call 3 and the row-split rows capped at 96 registers
    # (the other Gluon rows measured slower: see the comment there)
    gluon_rows = tuple(o for o in bench_dsa.PREFILL_INDEX_SWEEP if o.get("gluon"))
    tl_default = dict(rows_per_tile=2, key_block=64, num_stages=3, num_warps=4)
    bench_dsa.PREFILL_INDEX_SWEEP = (tl_default, *checked(gluon_rows, tl_default))
    # calls 1-3: the third session's fastest tl tile, dict(half=True, heads_inner=True, block_k=64, num_stages=2,
    # prefetch=True); from call 4 (after main brought the Gluon sparse MLA): the kernel's default
    bench_dsa.PREFILL_MLA_SWEEP = ({},)
    result = bench_dsa.run_dsa_acceptance(Path(sys.argv[1]), prefill_only=True)
    print(bench_dsa.compact_summary(result))
