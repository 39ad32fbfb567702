"""Where the planar MoE layer's time goes at small T (issue 15: DeepSeek-V3 T = 1 within 1.6x of its byte floor,
T = 64 at 0.85 of copy): each kernel of ``planar_moe`` (the runtime's path, PDL as the runtime sets it) under
``torch.profiler`` over CUDA-graph replays, its mean device time beside the layer's graph median and the byte
floors of the two GEMMs' MXFP4 words (GEMM1: gate_up, 2 I x H; GEMM2: down, H x I, of the active experts).

Usage (GPU): PYTHONPATH=. python benchmarks/next/moe_kernels.py OUT_JSON [T ...]   (default T: 1 16 64)
"""

from __future__ import annotations

import collections
import json
import sys

import torch
from moe_probe import floor_us, header, moe_fn, planar_layer
from torch.profiler import ProfilerActivity, profile

from adapt.bench.ceilings import measure_ceilings
from adapt.bench.timer import time_cuda
from adapt.stages.bench_moe import _point

REPLAYS = 50


def kernel_means(fn, replays: int) -> tuple[list[dict], float]:
    """(kernel name, calls per layer, mean us) of ``fn``'s CUDA-graph replays under the profiler, and the summed
    mean of all of them per layer."""
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
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    acc = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name].append(ev.device_time)
    rows = [dict(kernel=k[:110], calls=len(v) / replays, mean_us=sum(v) / len(v), per_layer_us=sum(v) / replays)
            for k, v in acc.items()]
    rows.sort(key=lambda r: -r["per_layer_us"])
    return rows, sum(r["per_layer_us"] for r in rows)


def main(out: str, tokens: list[int]) -> None:
    ceil = measure_ceilings()
    res = header(ceil)
    for name in ("deepseek-v3", "gpt-oss-120b"):
        shape, planar = planar_layer(name)
        e, k, h = shape["experts"], shape["top_k"], shape["hidden"]
        for t in tokens:
            x, perm, active, topw = _point(t, e, k, h, "cuda")
            fn = moe_fn(shape, planar, x, perm, topw)
            layer = time_cuda(fn, 50).median_us
            rows, summed = kernel_means(fn, REPLAYS)
            floor = floor_us(shape, active, ceil["copy_tbps"])
            g1 = floor * 2 / 3  # gate_up: two thirds of an expert's MXFP4 bytes
            row = dict(shape=name, tokens=t, active=active, layer_us=layer, kernels_sum_us=summed, floor_us=floor,
                       gemm1_floor_us=g1, gemm2_floor_us=floor - g1, kernels=rows)
            res["rows"].append(row)
            print(f"{name:13s} T={t:5d} active {active:3d}: layer {layer:8.1f} us (graph median), kernels sum "
                  f"{summed:8.1f}, floor {floor:7.1f} (GEMM1 {g1:6.1f}, GEMM2 {floor - g1:6.1f})", flush=True)
            for r in rows:
                print(f"    {r['per_layer_us']:8.1f} us  x{r['calls']:.0f}  {r['kernel']}", flush=True)
        planar = None
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [1, 16, 64])
