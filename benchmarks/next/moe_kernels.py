"""Where the planar MoE layer's time goes at small T (issue 15: DeepSeek-V3 T = 1 within 1.6x of its byte floor,
T = 64 at 0.85 of copy), and two changes to the chain timed against the former one.

1. Each kernel of ``planar_moe`` (the runtime's path) under ``torch.profiler`` over CUDA-graph replays, labelled by
   its place in the layer, with PDL off (with PDL a kernel's span includes its wait for the one before), beside the
   byte floors of the two GEMMs' MXFP4 words (GEMM1: gate_up, 2 I x H; GEMM2: down, H x I, of the active experts).
2. In turns (PDL on, CUDA-graph medians of replays back to back, as ``bench_moe`` times T <= 1024):
   - ``former``: the fused combine's fp32 sum zeroed between GEMM1 and GEMM2 (``moe_planar.ZERO_FIRST`` False);
   - ``zero_first``: zeroed before the tile map, so GEMM2 follows GEMM1 in the PDL chain (the default now);
   - ``other_combine``: that with the combine the other way (fused into GEMM2's epilogue where the table does not
     fuse it, and the reverse).
   Session 19's call 3 (bc82479) also timed ``early_l2``, GEMM2's programs prefetching their first work item's words
   into L2 before their PDL wait: 1.07-1.12x slower, removed (benchmarks/moe/2026-12-03-s19).

Usage (GPU): PYTHONPATH=. python benchmarks/next/moe_kernels.py OUT_JSON [T ...]   (default T: 1 16 64)
"""

from __future__ import annotations

import collections
import json
import statistics
import sys

import torch
from moe_probe import floor_us, header, planar_layer
from torch.profiler import ProfilerActivity, profile

from adapt.bench.ceilings import measure_ceilings
from adapt.bench.timer import time_cuda, time_in_turns
from adapt.kernels import moe_planar, pdl
from adapt.kernels.moe_configs import pick_planar_fused_combine
from adapt.kernels.moe_gemm import ACTIVATIONS
from adapt.stages.bench_moe import _point

REPLAYS, ROUNDS, REPS = 30, 5, 20


def graph_of(fn):
    """A CUDA graph of ``fn`` (captured after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g


def kernel_means(fn, replays: int) -> list[dict]:
    """Each kernel of a replay of ``fn``'s graph, in launch order: its name and mean device us."""
    g = graph_of(fn)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    per = len(evs) // replays
    acc = collections.defaultdict(list)
    names = {}
    for i, ev in enumerate(evs[: per * replays]):
        acc[i % per].append(ev.device_time)
        names[i % per] = ev.name[:90]
    return [dict(place=i, kernel=names[i], mean_us=statistics.mean(acc[i])) for i in range(per)]


def variant(fn, zero_first: bool):
    """``fn`` run with ``moe_planar.ZERO_FIRST`` set (a graph captured inside keeps the order)."""

    def run():
        moe_planar.ZERO_FIRST = zero_first
        return fn()

    return run


def main(out: str, tokens: list[int]) -> None:
    ceil = measure_ceilings()
    res = header(ceil)
    for name in ("deepseek-v3", "gpt-oss-120b"):
        shape, planar = planar_layer(name)
        e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
        act = ACTIVATIONS[shape["activation"]]
        for t in tokens:
            x, perm, active, topw = _point(t, e, k, h, "cuda")
            fused = pick_planar_fused_combine(t * k, e, torch.cuda.get_device_name(), h, inter)

            def layer(config=None, fuse=fused, args=(x, perm, planar, topw, k, act)):
                return lambda: moe_planar.planar_moe(*args[:4], top_k=args[4], activation=args[5], config=config,
                                                     fused=fuse)

            fns = {"former": variant(layer(), False), "zero_first": variant(layer(), True),
                   "other_combine": variant(layer(fuse=not fused), True)}
            outs = {v: f() for v, f in fns.items()}
            torch.cuda.synchronize()
            diff = {v: float((o.float() - outs["former"].float()).abs().max()) for v, o in outs.items()}
            pdl.set_enabled(False)
            kernels = kernel_means(variant(layer(), True), REPLAYS)
            pdl.set_enabled(True)
            times = time_in_turns(fns, ROUNDS, REPS, timer=lambda fn, reps: time_cuda(fn, reps, batch=10))
            med = {v: statistics.median(ts) for v, ts in times.items()}
            floor = floor_us(shape, active, ceil["copy_tbps"])
            row = dict(shape=name, tokens=t, active=active, fused_combine=fused, floor_us=floor,
                       gemm1_floor_us=floor * 2 / 3, gemm2_floor_us=floor / 3, us=times, median_us=med,
                       max_abs_diff=diff, kernels_pdl_off=kernels)
            res["rows"].append(row)
            print(f"{name:13s} T={t:5d} active {active:3d} fused {fused}: floor {floor:7.1f} us "
                  f"(GEMM1 {floor * 2 / 3:6.1f}, GEMM2 {floor / 3:6.1f}); max |diff| vs former {diff}", flush=True)
            print("    in turns (PDL on): " + ", ".join(
                f"{v} {m:8.1f} ({m / floor:.3f}x floor, {floor / m:.3f} of copy; {m / med['former']:.3f})"
                for v, m in med.items()), flush=True)
            print("    kernels, PDL off: " + "; ".join(f"{r['place']}:{r['kernel'][:28]} {r['mean_us']:.1f}"
                                                      for r in kernels) +
                  f"; sum {sum(r['mean_us'] for r in kernels):.1f}", flush=True)
        moe_planar.ZERO_FIRST = True
        planar = None
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [1, 16, 64])
