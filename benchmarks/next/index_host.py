"""Issue 16: the host's share of prefill scoring. Host microseconds a call of the padded tile table (one Triton
program, ``dsa.PADDED_TILES_KERNEL``, against the torch form) and of ``index_scores`` on a 4096-row chunk, the GPU
idle before each batch of calls; then ``index_topk`` over one sequence of 4K-16K tokens (eager, as a prefill
step runs), both forms in turns, and the chunk of the 128K prefill's first 4096 rows.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/index_host.py OUT_DIR [ROUNDS]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from adapt.bench.timer import time_eager_ms
from adapt.kernels import dsa
from benchmarks.next.index_wg import prefill_inputs

LENGTHS = (4096, 8192, 16384)


def host_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    length = max(LENGTHS)
    layer, table, seq, limits, q8, weights = prefill_inputs(length)
    result = {"device": torch.cuda.get_device_name(), "host_us": {}, "index_topk_ms": {}}
    for kernel in (True, False):
        dsa.PADDED_TILES_KERNEL = kernel
        tag = "kernel" if kernel else "torch"
        result["host_us"][f"prefill_query_tiles 4096 ({tag})"] = host_us(
            lambda: dsa.prefill_query_tiles(seq[:4096], 2, padded=True))
        result["host_us"][f"index_scores first 4096 rows ({tag})"] = host_us(
            lambda: dsa.index_scores(q8[:4096], weights[:4096], layer.index_k, layer.index_scale, table, seq[:4096],
                                     limits[:4096], 4096, rows_per_tile=2))
    print(json.dumps(result["host_us"]), flush=True)
    for _ in range(rounds):
        for n in LENGTHS:
            for kernel in (True, False):
                dsa.PADDED_TILES_KERNEL = kernel
                ms = time_eager_ms(lambda n=n: dsa.index_topk(q8[:n], weights[:n], layer.index_k, layer.index_scale,
                                                              table, seq[:n], limits[:n], 2048), 5)
                key = f"{n} {'kernel' if kernel else 'torch'}"
                result["index_topk_ms"].setdefault(key, []).append(ms)
    dsa.PADDED_TILES_KERNEL = True
    for key, ms in result["index_topk_ms"].items():
        print(f"index_topk {key:14s} {min(ms):8.3f}-{max(ms):8.3f} ms", flush=True)
    (out_dir / "index_host.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
