"""One shape at T = 16384: the workspace path with the default conversion program beside the offline FP8
path, and the conversion alone under a few program shapes (same process, CUDA-graph medians).

Usage (GPU): PYTHONPATH=. python benchmarks/moe/ws_check.py OUT_JSON [shape]
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
from adapt.kernels.workspace import CONVERT_CONFIG, FP8Workspace
from adapt.stages.bench_moe import SHAPES, WORKSPACE_CHUNK, _combined, _convert_all, _point, _random_layer

CONFIGS = {"ws_convert_r4b16w2": (4, 16, 2), "ws_convert_r2b16w1": (2, 16, 1), "ws_convert_r4b32w2": (4, 32, 2)}


def main(out: str, name: str = "deepseek-v3", t: int = 16384) -> None:
    shape = SHAPES[name]
    torch.manual_seed(0)
    routed, _ = _random_layer(shape, "cuda")
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    x, perm, _, topw = _point(t, e, k, h, "cuda")
    ws = FP8Workspace(WORKSPACE_CHUNK, h, inter, "cuda")
    mlp = partial(expert_mlp, x, perm, routed, top_k=k, activation=shape["activation"])
    off = FP8Weights.from_mxfp4(routed, validate=False)
    variants = {"fp8_offline_combine": _combined(partial(mlp, fp8_weights=off), topw, perm),
                "fp8_ws_combine": _combined(partial(mlp, workspace=ws), topw, perm)}
    variants |= {n: partial(_convert_all, routed, ws, perm, c) for n, c in CONFIGS.items()}
    rows, ref = [], None
    for vname, fn in variants.items():
        y = fn()
        torch.cuda.synchronize()
        same = None
        if vname == "fp8_offline_combine":
            ref = y
        elif vname == "fp8_ws_combine":
            same = bool(torch.equal(y, ref))
        us = time_cuda(fn, reps=10).median_us
        rows.append(dict(shape=name, tokens=t, variant=vname, time_us=us, tflops=6 * t * k * h * inter / us / 1e6,
                         equal_to_offline=same))
        print(json.dumps(rows[-1]), flush=True)
    result = dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                  convert_config=CONVERT_CONFIG, rows=rows)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
