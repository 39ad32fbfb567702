"""Issue 16: why the acceptance's indexer line (``bench_dsa._prefill_case``'s ``index_scores_all_TFLOPs``, 855-858 in
session 18's calls 1-2) sits below ``index_wg.py``'s same call over the same chunks (900-905).

One process: the probe's all-rows scoring (4096-row chunks, 2-row tiles, the library's default kernel) timed in
turns with the bench's form and with the chunks widest first, then the bench's own prefill case as the acceptance
runs it (``--no-sweep``; ``dsa.CHUNKS_WIDEST_FIRST`` on, off, on), then the probe's form again. Each line prints the
SM clock (NVML) before and after; first, the host's microseconds a call of the scoring call's parts.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/index_acc.py OUT_DIR [ROUNDS]
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from adapt.bench.timer import time_eager_ms
from adapt.kernels import dsa
from adapt.stages import bench_dsa
from adapt.stages.bench_dsa import INDEX_DIM, INDEX_HEADS
from benchmarks.next.index_wg import prefill_inputs

LENGTH, CHUNK = 131072, 4096
FLOPS = 2 * INDEX_HEADS * INDEX_DIM * LENGTH * (LENGTH + 1) / 2


def clock() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return out.replace(", ", "/")


CALLS: dict = collections.defaultdict(lambda: {"calls": 0, "host_ms": 0.0, "syncs": 0})
PHASE = ["setup"]


def _watch_index_scores() -> None:
    """Wrap ``dsa.index_scores``: per phase and option set, its calls, host milliseconds and the syncs torch
    reports inside it (``torch.cuda.set_sync_debug_mode``)."""
    inner = dsa.index_scores

    def wrapped(*args, **kwargs):
        key = f"{PHASE[0]} | rows {args[0].shape[0]} | " + json.dumps(
            {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}, sort_keys=True)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return inner(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                entry = CALLS[key]
                entry["calls"] += 1
                entry["host_ms"] += (time.perf_counter() - t0) * 1e3
                entry["syncs"] += sum("synchroniz" in str(w.message) for w in caught)

    dsa.index_scores = wrapped


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rows = []
    _watch_index_scores()

    def record(name: str, ms: float, before: str) -> None:
        row = {"form": name, "ms": ms, "TFLOPs": FLOPS / ms / 1e9, "clock_before": before, "clock_after": clock()}
        rows.append(row)
        print(json.dumps(row), flush=True)

    layer, table, seq, limits, q8, weights = prefill_inputs(LENGTH)

    def all_rows() -> None:
        for r0 in range(0, LENGTH, CHUNK):
            r1 = r0 + CHUNK
            dsa.index_scores(q8[r0:r1], weights[r0:r1], layer.index_k, layer.index_scale, table, seq[r0:r1],
                             limits[r0:r1], -(-r1 // dsa.KEY_BLOCK) * dsa.KEY_BLOCK, rows_per_tile=2)

    def all_rows_widest_first() -> None:
        for r0 in reversed(range(0, LENGTH, CHUNK)):
            r1 = r0 + CHUNK
            dsa.index_scores(q8[r0:r1], weights[r0:r1], layer.index_k, layer.index_scale, table, seq[r0:r1],
                             limits[r0:r1], -(-r1 // dsa.KEY_BLOCK) * dsa.KEY_BLOCK, rows_per_tile=2)

    host = {}  # host microseconds a call of the scoring call's parts, the GPU idle before each batch
    first = (q8[:CHUNK], weights[:CHUNK], layer.index_k, layer.index_scale, table, seq[:CHUNK], limits[:CHUNK])
    parts = {"index_scores (first chunk)": lambda: dsa.index_scores(*first, CHUNK, rows_per_tile=2),
             "prefill_query_tiles padded": lambda: dsa.prefill_query_tiles(seq[:CHUNK], 2, padded=True),
             "key_page_descriptor": lambda: dsa.dsa_gluon.key_page_descriptor(layer.index_k, 64),
             "torch.empty 4096 x 131072": lambda: torch.empty(CHUNK, LENGTH, device="cuda")}
    for name, fn in parts.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host[name] = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
    print("host us a call:", json.dumps({k: round(v, 1) for k, v in host.items()}), flush=True)
    PHASE[0] = "probe form"
    for _ in range(rounds):
        for name, fn, reps in (("probe form, 2 reps", all_rows, 2), ("probe form, 5 reps", all_rows, 5),
                               ("probe form widest first, 2 reps", all_rows_widest_first, 2)):
            before = clock()
            record(name, time_eager_ms(fn, reps), before)
    del layer
    torch.cuda.empty_cache()
    for widest in (True, False, True):
        dsa.CHUNKS_WIDEST_FIRST = widest
        before = clock()
        PHASE[0] = f"bench case, widest first {widest}"
        case = bench_dsa._prefill_case(LENGTH, 2048, "fp8", 2, 2 << 30, 16384,
                                       {"decode_index": {}, "prefill_index": {}, "mla": {}}, index_sweep=({},),
                                       mla_sweep=({},), selects=("auto",))
        rows.append({"form": PHASE[0], "ms": case["index_scores_ms"],
                     "TFLOPs": case["index_scores_all_TFLOPs"], "clock_before": before, "clock_after": clock(),
                     "last4096_TFLOPs": case["index_scores_TFLOPs"], "index_topk_ms": case["index_topk_ms"],
                     "total_ms": case["total_ms"], "speedup": case["speedup_vs_dense"]})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    dsa.CHUNKS_WIDEST_FIRST = True
    layer = prefill_inputs(LENGTH)[0]
    PHASE[0] = "probe form after"
    for _ in range(rounds):
        before = clock()
        record("probe form after the case, 2 reps", time_eager_ms(all_rows, 2), before)
    for key, entry in CALLS.items():
        print(f"{key}: {entry['calls']} calls, {entry['host_ms'] / max(1, entry['calls']):.3f} host ms a call, "
              f"{entry['syncs']} syncs", flush=True)
    (out_dir / "index_acc.json").write_text(json.dumps({"rows": rows, "calls": CALLS}, indent=1))


if __name__ == "__main__":
    main()
