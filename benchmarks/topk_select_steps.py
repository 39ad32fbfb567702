"""Bisection steps the decode selects take per row, counted on the CPU (numpy emulation of ``topk._kth_key``
on the candidates ``topk_decode`` keeps: visible keys >= the sample's 16-bit threshold, here from the same
4096-score sample rule), for N(0, 1) rows of 128K keys, top-2048. FAST 0 always takes 32 steps.

Usage: python benchmarks/topk_select_steps.py [ROWS]   (prints one JSON line: steps per level, min/median/max)
"""

from __future__ import annotations

import json
import sys

import numpy as np

CONTEXT, TOPK, SAMPLE, RUN, TAU_BITS, EXPECT = 131072, 2048, 4096, 8, 16, (7, 4)  # 2 parts a row at batch 64


def order_keys(x: np.ndarray) -> np.ndarray:
    bits = np.where(x == 0, 0, x).astype(np.float32).view(np.uint32).astype(np.uint64)
    return (bits ^ ((bits >> 31) * 0x7FFFFFFF | 0x80000000)).astype(np.uint64)


def candidates(keys: np.ndarray) -> np.ndarray:
    runs = SAMPLE // RUN
    per_run = -(-CONTEXT // runs)
    span = max(-(-per_run // RUN) * RUN, RUN)
    i = np.arange(SAMPLE)
    sampled = keys[(i // RUN) * span + i % RUN]
    want = max(-(-EXPECT[0] * TOPK * SAMPLE // (EXPECT[1] * CONTEXT)), 1)
    tau = 0
    for b in range(TAU_BITS):
        trial = tau | (1 << (31 - b))
        if (sampled >= trial).sum() >= want:
            tau = trial
    return keys[keys >= tau]


def steps(cand: np.ndarray, fast: int) -> int:
    lo, hi, total = int(cand.min()), int(cand.max()), len(cand)
    free = min(max(int(np.frexp(np.float32(hi - lo))[1]), 0), 32) if hi > lo else 0
    free += free & (fast - 1)
    threshold, at_least, step = lo, total, 0
    while step < free // fast and at_least != TOPK:
        lb = 1 << (free - fast - fast * step)
        for t in sorted((threshold + j * lb for j in range(1, 1 << fast)), reverse=True):
            c = int((cand >= t).sum()) if t <= 0xFFFFFFFF else 0
            if c >= TOPK:
                threshold, at_least = t, c
                break
        step += 1
    kth = int(np.sort(cand)[-TOPK])  # the k-th key, or (stopped early) a key with exactly TOPK at or above it
    assert threshold == kth or int((cand >= threshold).sum()) == TOPK
    return step


if __name__ == "__main__":
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    rng = np.random.default_rng(0)
    got = {1: [], 2: []}
    counts = []
    for _ in range(rows):
        cand = candidates(order_keys(rng.standard_normal(CONTEXT).astype(np.float32)))
        counts.append(len(cand))
        for fast in got:
            got[fast].append(steps(cand, fast))
    print(json.dumps({"rows": rows, "candidates_median": int(np.median(counts)), "fast0": 32,
                      **{f"fast{f}": [min(v), float(np.median(v)), max(v)] for f, v in got.items()}}))
