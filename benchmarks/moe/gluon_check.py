"""One shape at T = 16384, the Gluon fold rows of ``bench_moe.FOLD_SWEEP`` named on the command line beside the
offline FP8 path (same process, CUDA-graph medians, each output compared with the offline path's bit for bit).
No ceilings, no peer: the short second call of benchmarks/moe/2026-12-01-s4-fold.

Usage (GPU): PYTHONPATH=. python benchmarks/moe/gluon_check.py OUT_JSON SHAPE ROW [ROW ...]
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from functools import partial

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels.moe_gemm import expert_mlp
from adapt.kernels.moe_weights import FP8Weights
from adapt.kernels.mxfp4 import to_sign_split_words
from adapt.stages.bench_moe import FOLD_SWEEP, SHAPES, _combined, _point, _random_layer


def main(out: str, name: str, *names: str, t: int = 16384) -> None:
    shape = SHAPES[name]
    torch.manual_seed(0)
    routed, _ = _random_layer(shape, "cuda")
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    x, perm, _, topw = _point(t, e, k, h, "cuda")
    mlp = partial(expert_mlp, x, perm, routed, top_k=k, activation=shape["activation"])
    off = FP8Weights.from_mxfp4(routed, validate=False)
    split = to_sign_split_words(routed.w1_packed), to_sign_split_words(routed.w2_packed)
    variants = {"fp8_offline_combine": _combined(partial(mlp, fp8_weights=off), topw, perm)}
    for n in names:
        _, _, c1, c2, sw = FOLD_SWEEP[n]
        variants[n] = _combined(partial(mlp, compute="fp8_fold", config=(c1, c2), split_words=split if sw else None),
                                topw, perm)
    rows, ref = [], None
    for vname, fn in variants.items():
        y = fn()
        torch.cuda.synchronize()
        ref = y if ref is None else ref
        us = time_cuda(fn, reps=10).median_us
        rows.append(dict(shape=name, tokens=t, variant=vname, time_us=us, tflops=6 * t * k * h * inter / us / 1e6,
                         equal_to_offline=bool(torch.equal(y, ref))))
        print(json.dumps(rows[-1]), flush=True)
        with open(out, "w") as f:
            json.dump(dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                           gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
