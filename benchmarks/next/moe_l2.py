"""GEMM1 prefetching GEMM2's words into L2 (``PlanarConfig.l2_next``; issue 15: DeepSeek-V3 T = 1 within 1.6x of
its byte floor). At small T the planar GEMM1 leaves HBM bandwidth unused (DeepSeek-V3 T = 1: 0.85 of copy for 57 us)
and GEMM2 then streams its own words (31.6 us, 1.9x their floor); with l2_next the programs of each expert's first
m-tile issue ``prefetch.global.L2::evict_last`` for their share of that expert's GEMM2 words, so GEMM2 reads them
from L2 (50 MB: all of gpt-oss-120b's 4 experts, 17 MB; about 0.8 of DeepSeek-V3's 8, 59 MB). ``planar_moe`` (the
runtime's path, PDL on) on the table's configs with GEMM1's l2_next in FRACTIONS, both shapes, T in TOKENS: outputs
against the table's bit for bit, then in turns (ROUNDS rounds, CUDA-graph medians of REPS replays).

Usage (GPU): PYTHONPATH=. python benchmarks/next/moe_l2.py OUT_JSON
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

TOKENS, FRACTIONS, ROUNDS, REPS = (1, 16, 64), (0.4, 0.7, 1.0), 5, 20


def main(out: str) -> None:
    ceil = measure_ceilings()
    res = header(ceil)
    name_dev = torch.cuda.get_device_name()
    for name in ("deepseek-v3", "gpt-oss-120b"):
        shape, planar = planar_layer(name)
        e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
        for t in TOKENS:
            x, perm, active, topw = _point(t, e, k, h, "cuda")
            c1, c2 = pick_planar_configs(t * k, e, name_dev, h, inter)
            variants = {"table": (c1, c2)}
            variants |= {f"l2_next {f}": (dataclasses.replace(c1, l2_next=f), c2) for f in FRACTIONS}
            fns = {v: moe_fn(shape, planar, x, perm, topw, cfg) for v, cfg in variants.items()}
            ref = fns["table"]()
            equal = {v: bool(torch.equal(fn(), ref)) for v, fn in fns.items()}
            times, med = in_turns(fns, ROUNDS, REPS)
            floor = floor_us(shape, active, ceil["copy_tbps"])
            row = dict(shape=name, tokens=t, active=active, floor_us=floor, equal=equal, us=times, median_us=med)
            res["rows"].append(row)
            print(f"{name:13s} T={t:4d} floor {floor:7.1f} us | " + " | ".join(
                f"{v} {m:8.1f} ({m / med['table']:.3f}, {m / floor:.2f}x floor{'' if equal[v] else ', NOT EQUAL'})"
                for v, m in med.items()), flush=True)
        planar = None
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
