"""Programmatic dependent launch on the planar MoE path (issue 15: DeepSeek-V3 T = 1 within 1.6x of its byte floor,
T = 64 at 0.85 of copy). The runtime's MXFP4 layer without a workspace (``planar_moe``: tile map, GEMM1 + SwiGLU,
GEMM2, the combine or GEMM2's fused combine; 4-5 kernels) with ``adapt.kernels.pdl`` off and on, at both real shapes
and T = 1..1024 on ``bench_moe``'s random layer and uniform routing: outputs bit for bit, then each T in turns
(ROUNDS rounds, CUDA-graph medians of REPS replays), beside the same-run copy rate and the byte floor of the active
experts' MXFP4 bytes.

Usage (GPU): PYTHONPATH=. python benchmarks/next/moe_pdl.py OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch
from moe_probe import floor_us, header, in_turns, moe_fn, planar_layer

from adapt.bench.ceilings import measure_ceilings
from adapt.kernels import pdl
from adapt.stages.bench_moe import _point

TOKENS, ROUNDS, REPS = (1, 16, 64, 256, 1024), 5, 20


def main(out: str) -> None:
    ceil = measure_ceilings()
    res = header(ceil)
    for name in ("deepseek-v3", "gpt-oss-120b"):
        shape, planar = planar_layer(name)
        e, k, h = shape["experts"], shape["top_k"], shape["hidden"]
        for t in TOKENS:
            x, perm, active, topw = _point(t, e, k, h, "cuda")
            fn = moe_fn(shape, planar, x, perm, topw)
            got = {on: pdl.with_setting(on, fn)() for on in (False, True)}
            torch.cuda.synchronize()
            equal = bool(torch.equal(got[False], got[True]))
            times, med = in_turns({"off": pdl.with_setting(False, fn), "on": pdl.with_setting(True, fn)}, ROUNDS, REPS)
            floor = floor_us(shape, active, ceil["copy_tbps"])
            row = dict(shape=name, tokens=t, active=active, equal=equal, floor_us=floor, us=times,
                       off_us=med["off"], on_us=med["on"])
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
