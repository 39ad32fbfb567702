"""The batch-1 decode step (issue 16) taken apart in the acceptance's form (one CUDA graph of 8 layers, each over its
own random 128K cache), interleaved rounds: the whole step, the step's prefixes (scores; scores + select) and the
sparse MLA alone on fixed positions (with and without its slice combine), so that each part's marginal cost in the
chain shows; then sparse MLA options (MLA_VARIANTS, with the combine's switches) alone and in the step.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/b1_chain.py OUT_DIR [ROUNDS]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from adapt.bench.timer import time_graph_ms
from adapt.kernels import dsa, sparse_mla
from adapt.stages.bench_dsa import GRAPH_LAYERS, _queries, _random_cache

CONTEXT, TOPK = 131072, 2048
# Session 13's call 2 also timed the select's counters zeroed by the scoring kernel (50.0-51.0 us a layer against
# 44.4-44.5, removed) and, over the tl kernel's 16 slices, the combine a slice at a time (44.4 against 44.5 at once).
# sparse MLA options at batch 1 (the default since session 13: the Gluon kernel, 32 slices of 64 positions x 2 head
# blocks, the combine at once; before: the four-group tl kernel, 16 slices of 128), each timed alone and in the
# step. Session 13's call 3 also timed the slices merged inside the tl kernel after a grid barrier (its share of
# the merge a program each): MLA 42.9 us against 18.3, removed.
# _at_once: sparse_mla.COMBINE_AT_ONCE for the variant; _elements: sparse_mla.COMBINE_ELEMENTS (the combine's
# program size: 8192 partial values, 4 heads x 64 columns x 32 slices, 256 programs at batch 1; call 7: 2048 / 4096 /
# 16384 gave MLA 17.5 / 16.2 / 16.2 us and step 41.6 / 40.3 / 40.3 against 15.8 / 40.0)
MLA_VARIANTS = ({}, {"gluon": False, "_at_once": False}, {"_elements": 2048}, {"_elements": 4096},
                {"_elements": 16384})
# Call 4 (commit 6db6369, when the default was the tl kernel in 16 slices with the slice loop) timed: {"block_k": 64,
# "splits": 32} 18.8 / 44.0 us (MLA / step), the same with 4 warps 28.3 / 58.3, {"block_h": 32} 25.3 / 55.6,
# {"gluon": True} 19.6 / 43.6, {"block_k": 64, "splits": 16} 20.6 / 45.7, {"block_k": 64, "splits": 32} with the
# combine at once 16.3 / 41.5, {"gluon": True} with it 15.8 / 39.6; the default 18.4 / 43.8.


def layers(n: int):
    block_table = torch.arange(CONTEXT // 64, device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(1, device="cuda", dtype=torch.int32)
    limits = torch.full((1,), CONTEXT, device="cuda", dtype=torch.int32)
    stack = []
    for _ in range(n):
        layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
        q8, weights, q_nope, q_rope = _queries(1)
        args = (q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits)
        idx, _ = dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1)
        stack.append((layer, args, q_nope, q_rope, idx.clone()))
    return stack, block_table, token_seq


def main(out_dir: Path, rounds: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stack, block_table, token_seq = layers(GRAPH_LAYERS)

    def mla(layer, q_nope, q_rope, idx, **opts):
        return sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                     block_table, token_seq, idx, 0.1, **opts)

    def part(name, opts=None):
        opts = opts or {}

        def run():
            for layer, args, q_nope, q_rope, idx in stack:
                if name == "scores":
                    dsa.index_scores(*args, CONTEXT, rows_per_tile=1)
                elif name == "scores+select":
                    dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1)
                elif name in ("mla", "mla without combine"):
                    mla(layer, q_nope, q_rope, idx, **opts)
                else:
                    got, _ = dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1)
                    mla(layer, q_nope, q_rope, got, **opts)
        return run

    real_combine = sparse_mla._combine
    parts = ("step", "scores", "scores+select", "mla", "mla without combine")
    at_once, elements = sparse_mla.COMBINE_AT_ONCE, sparse_mla.COMBINE_ELEMENTS
    rows = []
    for rnd in range(rounds):
        for name in parts:
            sparse_mla._combine = (lambda *a, **k: None) if name == "mla without combine" else real_combine
            us = time_graph_ms(part(name), 100) * 1e3 / GRAPH_LAYERS
            rows.append({"round": rnd, "part": name, "us_per_layer": us})
            print(json.dumps(rows[-1]), flush=True)
        sparse_mla._combine = real_combine
        for opts in MLA_VARIANTS[1:]:
            sparse_mla.COMBINE_AT_ONCE = opts.get("_at_once", at_once)  # (the MLA_VARIANTS comment)
            sparse_mla.COMBINE_ELEMENTS = opts.get("_elements", elements)
            kwargs = {k: v for k, v in opts.items() if not k.startswith("_")}
            for what in ("mla", "step"):
                try:
                    us = time_graph_ms(part(what, kwargs), 100) * 1e3 / GRAPH_LAYERS
                except Exception as err:  # a variant that does not compile or apply: recorded
                    us = None
                    print(f"{what} {opts}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                rows.append({"round": rnd, "part": f"{what}: {json.dumps(opts)}", "us_per_layer": us})
                print(json.dumps(rows[-1]), flush=True)
            sparse_mla.COMBINE_AT_ONCE, sparse_mla.COMBINE_ELEMENTS = at_once, elements
    names = list(dict.fromkeys(r["part"] for r in rows))
    summary = {n: statistics.median(r["us_per_layer"] for r in rows if r["part"] == n and r["us_per_layer"])
               if any(r["us_per_layer"] for r in rows if r["part"] == n) else None for n in names}
    print(json.dumps(summary, indent=1))
    (out_dir / "b1_chain.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows,
                                                       "summary": summary}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5)
