"""Where the Gluon in-GEMM fold overtakes the planar path (issue 15): per shape and T, the runtime's planar path
(``planar_moe``: the table's tiles and combine) beside the Gluon fold on the layer's own MXFP4 words
(``fp8_gluon_combine``) and on sign-split words (``fp8_gluon_split_combine``, a layout the layer does not hold), and
the offline FP8 path, timed in turns (ROUNDS rounds, CUDA-graph medians of 10 replays); each fold output compared
with the offline path's bit for bit.

Usage (GPU): PYTHONPATH=. python benchmarks/next/fold_cross.py OUT_JSON [BUDGET_S]
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import sys
import time
from functools import partial

import torch

from adapt.bench.timer import time_in_turns
from adapt.kernels.moe_gemm import ACTIVATIONS, expert_mlp
from adapt.kernels.moe_planar import PlanarExperts, planar_moe
from adapt.kernels.moe_weights import FP8Weights
from adapt.kernels.mxfp4 import to_sign_split_words
from adapt.stages.bench_moe import FOLD_SWEEP, SHAPES, _combined, _point, _random_layer

ROUNDS = 3
TOKENS = (4096, 2048, 1024)


def main(out: str, budget: float = 150.0) -> None:
    start = time.monotonic()
    res = dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), commit=os.environ.get("ADAPT_COMMIT"),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=[])
    for name in ("gpt-oss-120b", "deepseek-v3"):
        shape = SHAPES[name]
        torch.manual_seed(0)
        routed, _ = _random_layer(shape, "cuda")
        planar = PlanarExperts.from_weights(routed)
        off = FP8Weights.from_mxfp4(routed, validate=False)
        split = to_sign_split_words(routed.w1_packed), to_sign_split_words(routed.w2_packed)
        e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
        for t in TOKENS:
            if time.monotonic() > start + budget:
                break
            x, perm, active, topw = _point(t, e, k, h, "cuda")
            mlp = partial(expert_mlp, x, perm, routed, top_k=k, activation=shape["activation"])
            variants = {
                "planar_runtime": partial(planar_moe, x, perm, planar, topw, top_k=k,
                                          activation=ACTIVATIONS[shape["activation"]]),
                "fp8_offline_combine": _combined(partial(mlp, fp8_weights=off), topw, perm),
            }
            for row in ("fp8_gluon_combine", "fp8_gluon_split_combine"):
                _, _, c1, c2, sw = FOLD_SWEEP[row]
                variants[row] = _combined(partial(mlp, compute="fp8_fold", config=(c1, c2),
                                                  split_words=split if sw else None), topw, perm)
            ref = variants["fp8_offline_combine"]()
            same = {v: bool(torch.equal(fn(), ref)) for v, fn in variants.items() if v.startswith("fp8_gluon")}
            times = time_in_turns(variants, ROUNDS, 10)
            base = statistics.median(times["planar_runtime"])
            for v in variants:
                us = statistics.median(times[v])
                row = dict(shape=name, tokens=t, active=active, variant=v, time_us=us, rounds=times[v],
                           vs_planar=us / base, tflops=6 * t * k * h * inter / us / 1e6,
                           equal_to_offline=same.get(v))
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(float(a) for a in sys.argv[2:]))
