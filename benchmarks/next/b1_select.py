"""The batch-1 decode select (issue 16): the radix select's 11 launches (``topk.topk_indices``) and the one-launch
select meeting at grid barriers (``topk.topk_grid``), on the indexer's real 1 x 128K scores: the select alone and the
whole step (index + top-k + sparse MLA: a one-layer graph and the acceptance's graph of 8 layers), three interleaved
rounds, then sparse MLA tiles in that graph. Positions are compared with the twin first; then the eager step's kernel
times (torch.profiler), and with BARRIERS what one grid barrier costs (a kernel of 128 programs passing 0, 1, 4 or 8
barriers, nothing else). Session 12's call 6 also timed the indexer's scoring inside the grid select's kernel (one
launch): 46.4-47.7 us a layer against 43.7-44.2 apart (the scoring at one program an SM is slower); removed.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/b1_select.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from b1_index import CONTEXT, TOPK, batch1_inputs  # benchmarks/next, the script's own folder

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, sparse_mla, topk
from adapt.stages.bench_dsa import GRAPH_LAYERS, _layered_step_us

BARRIERS = False  # the barrier-cost rows (session 12, calls 2-4)
SELECTS = {  # name: (FEW_ROWS_SELECT, topk_grid options; None: topk_indices)
    "triton (11 launches)": ("triton", None),
    "grid, 8 warps": ("grid", {"num_warps": 8}),
    "grid, 4 warps": ("grid", {"num_warps": 4}),
    "grid, 8 warps, packed reductions": ("grid", {"num_warps": 8, "packed": True}),
}
# sparse MLA options timed in the graph of 8 layers with the default select (batch 1: 64-position tiles, one slice
# each by the wave rule, 32 slices whose partial outputs the combine reads)
MLA_TILES = ({}, {"splits": 16}, {"splits": 8})


@triton.jit
def _barriers_kernel(bar_ptr, N: tl.constexpr, PARTS: tl.constexpr):
    for i in tl.static_range(N):
        topk._grid_barrier(bar_ptr, (i + 1) * PARTS)


def barrier_rows() -> list[dict]:
    bar = torch.zeros(32, dtype=torch.int32, device="cuda")
    rows = []
    for rnd in range(3):
        for n in (0, 1, 4, 8):
            def run(n=n):
                bar.zero_()
                _barriers_kernel[(128,)](bar, N=n, PARTS=128, num_warps=4)
            rows.append({"round": rnd, "barriers": n, "us": time_cuda(run, 200).median_us})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    layer, block_table, token_seq, limits, q8, weights, q_nope, q_rope = batch1_inputs()
    args = (q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits)
    scores = dsa.index_scores(*args, CONTEXT, rows_per_tile=1)
    twin = topk.topk_indices_torch(scores, limits, TOPK)
    out = torch.empty(1, TOPK, dtype=torch.int32, device="cuda")
    equal = {}
    for name, (_, opts) in SELECTS.items():
        if opts is None:
            topk.topk_indices(scores, limits, TOPK, out=out)
        else:
            topk.topk_grid(scores, limits, TOPK, out=out, **opts)
        equal[name] = bool(torch.equal(out, twin))
    print("equal:", equal, flush=True)

    def step():
        idx, _ = dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1)
        return sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                     block_table, token_seq, idx, 0.1)

    def use(method, opts):
        dsa.FEW_ROWS_SELECT = method
        dsa.FEW_ROWS_GRID_OPTIONS = opts or {}

    rows = []
    for rnd in range(3):
        for name, (method, opts) in SELECTS.items():
            row = {"round": rnd, "select": name}
            use(method, opts)
            if opts is None:
                row["select_us"] = time_cuda(lambda: topk.topk_indices(scores, limits, TOPK, out=out), 200).median_us
            else:
                row["select_us"] = time_cuda(lambda o=opts: topk.topk_grid(scores, limits, TOPK, out=out, **o),
                                             200).median_us
            row["step_us"] = time_cuda(step, 200).median_us
            row["step_us_per_layer_graph_of_8"] = _layered_step_us(1, CONTEXT, TOPK, "fp8", block_table, {}, {}, 100,
                                                                   GRAPH_LAYERS)
            rows.append(row)
            print(json.dumps(row), flush=True)
    use(*SELECTS["grid, 8 warps"])
    # the slice combine: every slice at once (sparse_mla.COMBINE_AT_ONCE, session 13) against one after the other,
    # alone on the step's 32 slices x 128 heads x 512 partials and in the one-layer and 8-layer step graphs
    splits = 32
    partial = torch.randn(1, splits, 128, 512, device="cuda")
    lse = torch.randn(1, splits, 128, device="cuda")
    cout = torch.empty(1, 128, 512, dtype=torch.bfloat16, device="cuda")
    combine_rows = []
    for rnd in range(3):
        for at_once in (False, True):
            sparse_mla.COMBINE_AT_ONCE = at_once
            row = {"round": rnd, "combine_at_once": at_once,
                   "combine_us": time_cuda(lambda: sparse_mla._combine(partial, lse, cout, splits, False),
                                           200).median_us,
                   "step_us": time_cuda(step, 200).median_us,
                   "step_us_per_layer_graph_of_8": _layered_step_us(1, CONTEXT, TOPK, "fp8", block_table, {}, {},
                                                                    100, GRAPH_LAYERS)}
            combine_rows.append(row)
            print(json.dumps(row), flush=True)
    sparse_mla.COMBINE_AT_ONCE = True
    mla_rows = []
    for rnd in range(3):
        for tiles in MLA_TILES:
            us = _layered_step_us(1, CONTEXT, TOPK, "fp8", block_table, {}, tiles, 100, GRAPH_LAYERS)
            mla_rows.append({"round": rnd, "mla_tiles": tiles, "step_us_per_layer_graph_of_8": us})
            print(json.dumps(mla_rows[-1]), flush=True)
    for name in ("triton (11 launches)", "grid, 8 warps"):  # the eager step's kernels
        use(*SELECTS[name])
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
        print(f"eager step kernels, {name} (20 steps):\n{table}", flush=True)
        (out_dir / f"profile_{SELECTS[name][0]}.txt").write_text(table)
    barriers = barrier_rows() if BARRIERS else []
    summary = {"barrier_us": {n: statistics.median(r["us"] for r in barriers if r["barriers"] == n)
                              for n in (0, 1, 4, 8)} if barriers else None}
    for name in SELECTS:
        mine = [r for r in rows if r["select"] == name]
        summary[name] = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k not in ("round", "select")}
    summary["combine"] = {str(a): {k: statistics.median(r[k] for r in combine_rows if r["combine_at_once"] == a)
                                   for k in ("combine_us", "step_us", "step_us_per_layer_graph_of_8")}
                          for a in (False, True)}
    summary["mla_tiles"] = {json.dumps(t): statistics.median(r["step_us_per_layer_graph_of_8"] for r in mla_rows
                                                             if r["mla_tiles"] == t) for t in MLA_TILES}
    print(json.dumps(summary, indent=1))
    (out_dir / "b1_select.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "equal": equal,
                                                        "rows": rows, "combine_rows": combine_rows, "mla_rows": mla_rows, "barriers": barriers,
                                                        "summary": summary}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
