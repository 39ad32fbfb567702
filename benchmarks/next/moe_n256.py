"""Planar tiles of 256 weight rows and 8 warps at small T (issue 15: DeepSeek-V3 T = 64 at 0.85 of copy). The table's
rows at T = 16..256 are 128-row tiles of 4 warps (32 rows a warp). A 256-row tile of 8 warps keeps 32 rows a warp
(the same 391-instruction step a warp, sm_90 build, 128 registers, no spills) and halves the activation tile's loads
and the programs per weight byte: two programs an SM instead of four. ``planar_moe`` (the runtime's path) on the
table's configs and with GEMM1, GEMM2 or both at (256 rows, 8 warps, 3 or 4 stages), in turns (ROUNDS rounds,
CUDA-graph medians of REPS replays), beside the same-run copy rate. From T = LARGE (the planar path of the
runtime's layer without a workspace, 0.89-0.92x the peer on gpt-oss-120b at 4096 and 16384): the table's 128 x 256
tiles of 8 warps, 3 stages (sm_90 build: 255 registers, 64 bytes spilled) against 128-row tiles of 8 warps (3 or 4
stages: 236 registers, no spills), 64-token tiles (254, none) and 128-row GEMM2 tiles alone.

Usage (GPU): PYTHONPATH=. python benchmarks/next/moe_n256.py OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
from moe_probe import floor_us, header, in_turns, moe_fn, planar_layer

from adapt.bench.ceilings import measure_ceilings
from adapt.kernels.moe_configs import pick_planar_configs
from adapt.stages.bench_moe import _point

TOKENS = {"deepseek-v3": (16, 64, 16384), "gpt-oss-120b": (16, 64, 256, 4096, 16384)}
ROUNDS, REPS = 7, 20
LARGE = 4096
"""From this T (the table's 128 x 256 tiles of 8 warps, 3 stages): other large tiles, 3 rounds of 10 replays."""


def _wide(c, stages):
    return dataclasses.replace(c, block_n=256, num_warps=8, num_stages=stages)


def main(out: str) -> None:
    ceil = measure_ceilings()
    res = header(ceil)
    dev_name = torch.cuda.get_device_name()
    for name, tokens in TOKENS.items():
        shape, planar = planar_layer(name)
        e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
        for t in tokens:
            x, perm, active, topw = _point(t, e, k, h, "cuda")
            c1, c2 = pick_planar_configs(t * k, e, dev_name, h, inter)
            if t >= LARGE:
                r = dataclasses.replace
                n128 = {"block_n": 128, "num_warps": 8, "num_stages": 4}
                variants = {"table": (c1, c2), "n128 w8 st3": (r(c1, block_n=128), r(c2, block_n=128)),
                            "n128 w8 st4": (r(c1, **n128), r(c2, **n128)),
                            "m64": (r(c1, block_m=64), r(c2, block_m=64)),
                            "g2 n128 w8 st4": (c1, r(c2, **n128))}
            else:
                variants = {"table": (c1, c2), "g1 n256 st3": (_wide(c1, 3), c2),
                            "both n256 st3": (_wide(c1, 3), _wide(c2, 3)),
                            "both n256 st4": (_wide(c1, 4), _wide(c2, 4)), "g2 n256 st3": (c1, _wide(c2, 3))}
            fns = {v: moe_fn(shape, planar, x, perm, topw, cfg) for v, cfg in variants.items()}
            ref = fns["table"]().float()
            err = {v: float((fn().float() - ref).abs().max() / ref.abs().max()) for v, fn in fns.items()}
            times, med = in_turns(fns, 3 if t >= LARGE else ROUNDS, 10 if t >= LARGE else REPS)
            floor = floor_us(shape, active, ceil["copy_tbps"])
            res["rows"].append(dict(shape=name, tokens=t, active=active, floor_us=floor, max_rel_diff=err, us=times,
                                    median_us=med))
            print(f"{name:13s} T={t:4d} | " + " | ".join(
                f"{v} {m:8.1f} ({m / med['table']:.3f}, {floor / m:.3f} of copy, diff {err[v]:.1e})"
                for v, m in med.items()), flush=True)
        planar = None
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
