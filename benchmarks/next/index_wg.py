"""Issue 16, indexer prefill: the multi-warpgroup Gluon kernel (``dsa_gluon._index_scores_gluon_wg_kernel``:
2-row query tiles, key tiles of 64 G keys on G warpgroups, each row its own N = 64 bank, row 0's epilogue under row
1's MMA, head weights in registers) against the tl 2 x 64 tile (the default) and the row-split Gluon kernel.

One causal 128K sequence, DeepSeek-V3.2's indexer (64 heads x 128, e4m3). Each variant is first checked on the last
64 rows against the tl kernel (max |diff| over max |tl|) and the twin, then timed in turns (ROUNDS rounds) on the
last 4096 rows and over all 128K rows in chunks of 4096 rows (the acceptance line's measure, ``bench_dsa``'s
``all_rows_TFLOPs``). FLOPs 2 * 64 * 128 per visible (row, key).

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/index_wg.py OUT_DIR [ROUNDS [BUDGET_S]]
Writes OUT_DIR/index_wg.json; prints one line per row. Under Nsight Compute:
``ncu ... python3 benchmarks/next/index_wg.py --ncu "wg2 s3" ...``: each named variant's last 4096 rows, twice.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from adapt.bench.timer import time_eager_ms
from adapt.kernels import dsa
from adapt.stages.bench_dsa import INDEX_DIM, INDEX_HEADS, _queries, _random_cache

LENGTH, TAIL = 131072, 4096
VARIANTS = {
    "tl 2x64": dict(rows_per_tile=2, key_block=64, gluon=False),
    "default 2 rows": dict(rows_per_tile=2),  # no read-back of whether the rows are one sequence's
    "default": dict(),  # rows_per_tile None: prefill_rows_per_tile (one read-back a chunk: decode rows or not)
    "ws4": dict(rows_per_tile=4),
    "ws4 s4": dict(rows_per_tile=4, num_stages=4),
    "ws8": dict(rows_per_tile=8, gluon=True, gluon_ws=True, gluon_carry=True),
    "ws8 s4": dict(rows_per_tile=8, gluon=True, gluon_ws=True, gluon_carry=True, num_stages=4),
    "ws8 s6": dict(rows_per_tile=8, gluon=True, gluon_ws=True, gluon_carry=True, num_stages=6),
}
# Session 18, call 7 (890b066): 4-row tiles on the warp-specialised kernel at 2-6 stages with the carry 911-948 over
# all rows (3 stages 935-948, 4 stages 937-944), without the carry 893-901, against the 2-row kernel's 864-901.
# Calls 1-2: the default with a read-back a chunk ("default": dict()) 816-842 over all rows, with the
# tile tables computed ahead ("default presync": dict(presync=True)) 873-895. Call 2 (e3e4b1b): REG_A (the key tile
# in registers as both wgmmas' A operand) 878-881 (869-875 at 4 stages) against the default's 900-905; key splits
# over 2048 / 4096 programs 893-894.
# Session 17 also ran wg1 s2 / s3 / s4 with the carry, with and without TMA (call 4 / session 18 call 1: s3 tma
# 885-895, s4 tma 897-902 over all rows; s2-s4 with cp.async 850-865).
# Session 17, call 1 (b9c0252) also ran: wg2 without the carry at 2, 3, 4 stages (tail 762-779, all rows 719-729),
# wg4 at 2 and 3 stages (671-708 / 645-661) and wg4 s2 carry (726-742 / 685-714), all below wg1; call 2 (8dafb98,
# columns per chunk as bench_dsa) the row-split Gluon kernel capped at 96 (696-720 over all rows), wg1 s3 without
# the carry (811-814) and wg2 s3 carry (779-808) against the default (wg1 s3 carry, 800-839).


def prefill_inputs(length: int):
    """One causal sequence of ``length`` tokens in a random one-layer cache (pages in order) and its indexer queries,
    as ``bench_dsa``'s prefill case builds them: (layer, block table, token_seq, limits, q8, weights)."""
    layer = _random_cache(length, "fp8").dsa_layer(0)
    table = torch.arange(-(-length // 64), device="cuda", dtype=torch.int32)[None]
    seq = torch.zeros(length, device="cuda", dtype=torch.int32)
    limits = torch.arange(1, length + 1, device="cuda", dtype=torch.int32)
    q8, weights, _, _ = _queries(length)
    return layer, table, seq, limits, q8, weights


def main() -> None:
    if sys.argv[1] == "--ncu":
        return profile(sys.argv[2:])
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    budget = float(sys.argv[3]) if len(sys.argv) > 3 else 150.0
    t0 = time.time()
    layer, table, seq, limits, q8, weights = prefill_inputs(LENGTH)

    def run(opts: dict, r0: int, r1: int) -> torch.Tensor:
        opts = {k: v for k, v in opts.items() if k != "presync"}
        return dsa.index_scores(q8[r0:r1], weights[r0:r1], layer.index_k, layer.index_scale, table, seq[r0:r1],
                                limits[r0:r1], LENGTH, **opts)

    chunk_tiles = [dsa.prefill_query_tiles(seq[r0:r0 + TAIL], 2) for r0 in range(0, LENGTH, TAIL)]

    def all_rows(opts: dict) -> None:  # as bench_dsa's scores_only: each chunk's columns up to its last row
        opts = dict(opts)
        presync = opts.pop("presync", False)  # the tile tables computed ahead: no host sync between the launches
        for i, r0 in enumerate(range(0, LENGTH, TAIL)):
            r1 = r0 + TAIL
            dsa.index_scores(q8[r0:r1], weights[r0:r1], layer.index_k, layer.index_scale, table, seq[r0:r1],
                             limits[r0:r1], -(-r1 // dsa.KEY_BLOCK) * dsa.KEY_BLOCK,
                             query_tiles=chunk_tiles[i] if presync else None, **opts)

    tail_flops = 2 * INDEX_HEADS * INDEX_DIM * sum(range(LENGTH - TAIL + 1, LENGTH + 1))
    all_flops = 2 * INDEX_HEADS * INDEX_DIM * LENGTH * (LENGTH + 1) / 2
    result = {"device": torch.cuda.get_device_name(), "rows": [], "checks": {}}
    ref = run(VARIANTS["tl 2x64"], LENGTH - 64, LENGTH)
    twin = dsa.index_scores_torch(q8[-64:], weights[-64:], layer.index_k, layer.index_scale, table, seq[-64:],
                                  limits[-64:], LENGTH)
    finite = torch.isfinite(ref)
    scale = float(ref[finite].abs().max())
    live = {}
    skip = [w for w in os.environ.get("INDEX_WG_SKIP", "").split(",") if w]  # variants whose name holds one of these
    for name, opts in VARIANTS.items():
        if any(w in name for w in skip):
            continue
        try:
            got = run(opts, LENGTH - 64, LENGTH)
            torch.cuda.synchronize()
        except Exception as err:  # a variant that fails is recorded, the others still run
            result["checks"][name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(name, "ERROR", result["checks"][name]["error"], flush=True)
            continue
        same_inf = bool(torch.equal(torch.isfinite(got), finite))
        check = {"vs_tl": float((got[finite] - ref[finite]).abs().max()) / scale,
                 "vs_twin": float((got[finite] - twin[finite]).abs().max()) / scale,
                 "bit_equal_tl": bool(torch.equal(got, ref)), "same_inf": same_inf}
        result["checks"][name] = check
        print(name, json.dumps(check), flush=True)
        if same_inf and check["vs_twin"] < 5e-3:
            live[name] = opts
    for rnd in range(rounds):
        for name, opts in live.items():
            if time.time() - t0 > budget:
                break
            tail_ms = time_eager_ms(lambda o=opts: run(o, LENGTH - TAIL, LENGTH), 5)
            all_ms = time_eager_ms(lambda o=opts: all_rows(o), 2)
            row = {"variant": name, "round": rnd, "tail_ms": tail_ms, "tail_TFLOPs": tail_flops / tail_ms / 1e9,
                   "all_ms": all_ms, "all_TFLOPs": all_flops / all_ms / 1e9}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "index_wg.json").write_text(json.dumps(result, indent=1))
    for name in dict.fromkeys(row["variant"] for row in result["rows"]):  # min-max (median) over the rounds
        tail = [row["tail_TFLOPs"] for row in result["rows"] if row["variant"] == name]
        every = [row["all_TFLOPs"] for row in result["rows"] if row["variant"] == name]
        print(f"{name:18s} tail {min(tail):6.1f}-{max(tail):6.1f} ({statistics.median(tail):6.1f})  all rows "
              f"{min(every):6.1f}-{max(every):6.1f} ({statistics.median(every):6.1f})", flush=True)


def profile(names: list[str]) -> None:
    """Each named variant on the last 4096 rows, twice (for ``ncu --launch-skip``)."""
    cache = _random_cache(LENGTH, "fp8")
    layer = cache.dsa_layer(0)
    table = torch.arange(LENGTH // 64, device="cuda", dtype=torch.int32)[None]
    seq = torch.zeros(TAIL, device="cuda", dtype=torch.int32)
    limits = torch.arange(LENGTH - TAIL + 1, LENGTH + 1, device="cuda", dtype=torch.int32)
    q8, weights, _, _ = _queries(TAIL)
    for name in names:
        for _ in range(2):
            dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, table, seq, limits, LENGTH,
                             **VARIANTS[name])
    torch.cuda.synchronize()
    print("profiled", names)


if __name__ == "__main__":
    main()
