"""Why the acceptance harness's batch-1 numbers swing from one process to the next (issue 16, session 14): the
timer syncs after every replay, so a graph of ~10 us keeps the GPU busy a fraction of the time, and a measurement
that follows a stretch of host-only work may run before the SM clock is back up. This times the batch-1 scoring
(one-call graph) and the step (one-layer graph) after the GPU idled (``time.sleep``), as the harness's timer does
(10 replays, a sync each), then after a warm-up of back-to-back replays, then as batches of back-to-back replays
between one event pair, reading the SM clock (nvidia-smi) around each.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/b1_clock.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, sparse_mla
from adapt.stages.bench_dsa import _queries, _random_cache

CONTEXT, TOPK = 131072, 2048


def sm_clock() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"], capture_output=True,
                         text=True)
    return out.stdout.strip()


def capture(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def per_replay(g, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return times


def batched(g, n):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = torch.arange(CONTEXT // 64, device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(1, device="cuda", dtype=torch.int32)
    limits = torch.full((1,), CONTEXT, device="cuda", dtype=torch.int32)
    layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
    q8, weights, q_nope, q_rope = _queries(1)
    args = (q8, weights, layer.index_k, layer.index_scale, table, token_seq, limits)

    def step():
        idx, _ = dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1)
        return sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                     table, token_seq, idx, 0.1)

    graphs = {"scores": capture(lambda: dsa.index_scores(*args, CONTEXT, rows_per_tile=1)), "step": capture(step)}
    rows = []
    for trial in range(4):
        for name, g in graphs.items():
            row = {"trial": trial, "what": name}
            time.sleep(1.0)
            row["clock_idle"] = sm_clock()
            t = per_replay(g, 10)
            row["cold_10_sync"] = statistics.median(t)
            row["cold_first_last"] = [round(t[0], 2), round(t[-1], 2)]
            row["clock_after_cold"] = sm_clock()
            n = 0
            start = time.perf_counter()
            while time.perf_counter() - start < 0.05:  # 50 ms of back-to-back replays
                for _ in range(50):
                    g.replay()
                torch.cuda.synchronize()
                n += 50
            row["warm_replays"] = n
            row["warm_10_sync"] = statistics.median(per_replay(g, 10))
            row["warm_100_sync"] = statistics.median(per_replay(g, 100))
            row["batched_200"] = statistics.median(batched(g, 200) for _ in range(5))
            row["clock_end"] = sm_clock()
            row["time_cuda_100"] = time_cuda(lambda g=g: g.replay(), 100, graph=False).median_us
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "b1_clock.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
