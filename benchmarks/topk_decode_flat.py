"""Decode top-k tiles on one GPU: ``topk_decode`` with its register select against the flat select
(``select_candidates``, any number of parts per row), and the radix select, on fp32 scores of 128K keys, top-2048.
``fast`` (second argument): the short select (``fast=2``: two bits a step below the candidates' common
prefix, one packed scan; ``fast=1`` one bit a step) beside the defaults each batch size runs now, and with 16
warps a select program.

Each tile: CUDA-graph replays (``adapt.bench.timer.time_cuda``, median), whether the positions equal
``topk_indices_torch``'s (all rows, and how many rows do), and how many rows the sample misjudged. Scores:
standard normal (the timing of these selects depends on the candidate count, which the sample fixes, not on the
score distribution; the bench's index scores were timed in ``adapt.stages.bench_dsa``).

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/topk_decode_flat.py OUT_DIR [fast]
Writes OUT_DIR/topk_decode_flat.json (OUT_DIR/topk_decode_fast.json) and prints one line per tile.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels.topk import topk_decode, topk_indices, topk_indices_torch

CONTEXT, TOPK, REPS = 131072, 2048, 10
TILES = {
    64: [("topk_decode", {}), ("topk_decode", dict(flat=True, parts=2)), ("topk_decode", dict(flat=True, parts=4)),
         ("topk_decode", dict(flat=True, parts=8)), ("topk_decode", dict(flat=True, parts=8, block=2048))],
    1: [("topk_indices", dict(digit_bits=8)), ("topk_decode", {}), ("topk_decode", dict(flat=True, parts=8)),
        ("topk_decode", dict(flat=True, parts=32, block=2048, num_warps=4)),
        ("topk_decode", dict(flat=True, parts=128, block=1024, num_warps=4))],
}
# The defaults of session 4's call A first (radix select at batch 1; at 64 topk_decode's register select by 32-step
# bisection with 8 warps and no prefetch, pinned since the short select, 16 warps and prefetch became the defaults),
# then the short select (with 16 warps a select program; the last two batch-64 tiles also change the candidate pass:
# the next step's scores loaded ahead (prefetch, today's default), or 8192 scores a step with 16 warps: twice the
# loads in flight, 128 registers, no spills in the CPU sm_90 build). At batch 1 topk_decode's 8
# parts hold 32K slots (past the register select's 8K: radix passes in memory), so the short select runs there
# as the flat one, beside the flat tile of call 2 (44.1 us).
_OLD = dict(select_warps=8, prefetch=False)
FAST_TILES = {
    64: [("topk_decode", dict(fast=0, **_OLD)), ("topk_decode", dict(fast=1, **_OLD)),
         ("topk_decode", dict(fast=1, select_warps=16, prefetch=False)),
         ("topk_decode", dict(fast=2, select_warps=16, prefetch=False)),
         ("topk_decode", dict(fast=1, select_warps=16, prefetch=True)),
         ("topk_decode", dict(fast=1, select_warps=16, block=8192, num_warps=16))],
    1: [("topk_indices", dict(digit_bits=8))]
    + [("topk_decode", dict(flat=True, parts=128, block=1024, num_warps=4, **o))
       for o in (dict(fast=0, **_OLD), dict(fast=1, select_warps=16, prefetch=False))],
}


def main() -> None:
    out_dir = Path(sys.argv[1])
    fast = sys.argv[2:] == ["fast"]
    tile_sets, json_name = (FAST_TILES, "topk_decode_fast.json") if fast else (TILES, "topk_decode_flat.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "context": CONTEXT, "topk": TOPK,
              "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, tiles in tile_sets.items():
        scores = torch.randn(batch, CONTEXT, device="cuda", generator=gen)
        limits = torch.full((batch,), CONTEXT, device="cuda", dtype=torch.int32)
        twin = topk_indices_torch(scores, limits, TOPK)
        out = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
        redo = torch.zeros(batch, dtype=torch.int32, device="cuda")
        for name, opts in tiles:
            def call(n=name, o=opts, s=scores, lim=limits, dst=out, flags=redo):
                if n == "topk_indices":
                    return topk_indices(s, lim, TOPK, out=dst, **o)
                return topk_decode(s, lim, TOPK, out=dst, redo=flags, **o)
            row = {"batch": batch, "select": name, **opts}
            try:
                redo.zero_()
                timing = time_cuda(call, REPS, warmup=1)
                call()
                row.update(us=timing.median_us, timed_as=timing.mode, equals_twin=bool(torch.equal(out, twin)),
                           rows_equal=int((out == twin).all(dim=1).sum()), redo_rows=int(redo.sum()))
            except Exception as err:  # recorded; the other tiles still run
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out_dir / json_name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
