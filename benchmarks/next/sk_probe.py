"""Stream-K planar tiles against the table's (issue 15): per shape and T, the fused path (combine in GEMM2's epilogue,
``bench_moe._fused``) with the table's configs and with the ``s10_*`` rows of ``bench_moe.PLANAR_SWEEP``, timed in
turns (ROUNDS rounds, each variant once a round, CUDA-graph medians of 20 replays), each output against the table's.
Also the unfused GEMMs apart (planar_combine's two GEMMs) with the table's and the stream-K tiles.

Usage (GPU): PYTHONPATH=. python benchmarks/next/sk_probe.py OUT_JSON [BUDGET_S]
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

from adapt.bench.ceilings import measure_ceilings
from adapt.bench.timer import time_in_turns
from adapt.kernels.moe_planar import PlanarExperts
from adapt.kernels.moe_weights import mxfp4_expert_bytes
from adapt.stages.bench_moe import PLANAR_SWEEP, SHAPES, _fused, _planar_config, _point, _random_layer

ROUNDS = 3
TOKENS = (64, 16, 256, 1, 1024)


def main(out: str, budget: float = 200.0) -> None:
    start = time.monotonic()
    ceil = measure_ceilings()
    res = dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), commit=os.environ.get("ADAPT_COMMIT"),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, ceilings=ceil, rows=[])
    for name in ("gpt-oss-120b", "deepseek-v3"):
        shape = dict(SHAPES[name], name=name)
        torch.manual_seed(0)
        routed, _ = _random_layer(shape, "cuda")
        planar = PlanarExperts.from_weights(routed)
        ebytes = mxfp4_expert_bytes(shape["hidden"], shape["intermediate"])
        for t in TOKENS:
            if time.monotonic() > start + budget:
                break
            x, perm, active, topw = _point(t, shape["experts"], shape["top_k"], shape["hidden"], "cuda")
            variants = {"table": partial(_fused, x, perm, planar, topw, shape)}
            for row, ((lo, hi), a, b) in PLANAR_SWEEP.items():
                if row.startswith("s10_") and lo <= t <= hi:
                    cfg = tuple(_planar_config(c, i, x, shape) for i, c in enumerate((a, b)))
                    variants[row] = partial(_fused, x, perm, planar, topw, shape, cfg)
            ref = variants["table"]().float()
            errs = {}
            for v, fn in variants.items():
                got = fn().float()
                errs[v] = float((got - ref).norm() / ref.norm())
            times = time_in_turns(variants, ROUNDS, 20)
            floor = active * ebytes / (ceil["copy_tbps"] * 1e6)
            for v in variants:
                us = statistics.median(times[v])
                row = dict(shape=name, tokens=t, active=active, variant=v, time_us=us, rounds=times[v],
                           copy_fraction=floor / us, vs_table=us / statistics.median(times["table"]), rel_err=errs[v])
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(float(a) for a in sys.argv[2:]))
