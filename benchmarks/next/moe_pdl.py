"""Programmatic dependent launch on the planar MoE path (issue 15: DeepSeek-V3 T = 1 within 1.6x of its byte floor,
T = 64 at 0.85 of copy). The runtime's MXFP4 layer without a workspace (``planar_moe``: tile map, GEMM1 + SwiGLU,
GEMM2, the combine or GEMM2's fused combine; 4-5 kernels) with ``adapt.kernels.pdl`` off and on, at both real shapes
and T = 1..1024 on ``bench_moe``'s random layer and uniform routing: outputs bit for bit, then each T in turns
(ROUNDS rounds, CUDA-graph medians of REPS replays), beside the same-run copy rate and the byte floor of the active
experts' MXFP4 bytes.

Usage (GPU): PYTHONPATH=. python benchmarks/next/moe_pdl.py OUT_JSON
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import sys

import torch

from adapt.bench.ceilings import measure_ceilings
from adapt.bench.timer import time_in_turns
from adapt.kernels import pdl
from adapt.kernels.moe_gemm import ACTIVATIONS
from adapt.kernels.moe_planar import PlanarExperts, planar_moe
from adapt.kernels.moe_weights import mxfp4_expert_bytes
from adapt.stages.bench_moe import SHAPES, _point, _random_layer

TOKENS, ROUNDS, REPS = (1, 16, 64, 256, 1024), 5, 20


def _with(on: bool, fn):
    def run():
        pdl.set_enabled(on)
        return fn()
    return run


def main(out: str) -> None:
    ceil = measure_ceilings()
    res = dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), commit=os.environ.get("ADAPT_COMMIT"),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tbps=ceil["copy_tbps"], rows=[])
    for name in ("deepseek-v3", "gpt-oss-120b"):
        shape = SHAPES[name]
        torch.manual_seed(0)
        routed, _ = _random_layer(shape, "cuda")
        planar = PlanarExperts.from_weights(routed)
        routed = None
        e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
        for t in TOKENS:
            x, perm, active, topw = _point(t, e, k, h, "cuda")
            fn = lambda x=x, perm=perm, topw=topw, p=planar, k=k, a=ACTIVATIONS[shape["activation"]]: planar_moe(  # noqa: E731
                x, perm, p, topw, top_k=k, activation=a)
            got = {on: _with(on, fn)() for on in (False, True)}
            torch.cuda.synchronize()
            equal = bool(torch.equal(got[False], got[True]))
            times = time_in_turns({"off": _with(False, fn), "on": _with(True, fn)}, ROUNDS, REPS)
            floor = active * mxfp4_expert_bytes(h, inter) / (ceil["copy_tbps"] * 1e6)
            row = dict(shape=name, tokens=t, active=active, equal=equal, floor_us=floor, us=times,
                       off_us=statistics.median(times["off"]), on_us=statistics.median(times["on"]))
            row["x_floor_on"], row["copy_fraction_on"] = row["on_us"] / floor, floor / row["on_us"]
            res["rows"].append(row)
            print(f"{name:13s} T={t:5d} equal {equal} off {row['off_us']:9.1f} on {row['on_us']:9.1f} us "
                  f"({row['on_us'] / row['off_us']:.3f}); on: {row['x_floor_on']:.2f}x floor, "
                  f"{row['copy_fraction_on']:.3f} of copy", flush=True)
        planar = None
        torch.cuda.empty_cache()
    pdl.set_enabled(True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
