"""Issue 15, T = 16384: the workspace conversion co-resident with the GEMMs (``FP8Workspace(schedule="cohabit")``).

The offline GEMMs take 255 registers x 256 threads, the whole register file, so a conversion block never shares an
SM with them (the "side" and "split" schedules of 2026-11-30-s2 did not overlap). Here the GEMMs run one persistent
program an SM under a register cap (``gemm_maxnreg``), which leaves room for a few persistent conversion programs
an SM on a side stream: the conversion (memory) runs beside the fp8 MMAs (tensor cores) on the same SMs.

Rows, per shape, in one process (CUDA-graph medians, with the weighted combine):
- offline FP8 (the line's reference), and offline under each register cap (the cap's own cost);
- the workspace today (serial), and cohabit variants (cap, conversion program, programs an SM, chunk);
- the conversion alone with the persistent programs (its rate with a few programs an SM).
Each workspace row is compared bit for bit with offline.

- ``pair_*``: the diagnostic, every GEMM of the layer (offline weights, capped, one program an SM) and the whole
  layer's persistent conversion on two streams with no dependency; about the longer of ``gemms_*`` and
  ``convert_*`` if the two share SMs, their sum if not.

Usage (GPU): PYTHONPATH=. python benchmarks/next/moe_cohabit.py OUT_DIR [shapes] [reps] [only: name prefixes]
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from dataclasses import replace
from functools import partial

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels.moe_configs import pick_configs
from adapt.kernels.moe_gemm import expert_mlp
from adapt.kernels.moe_weights import FP8Weights
from adapt.kernels.workspace import FP8Workspace, convert_experts
from adapt.stages.bench_moe import SHAPES, _combined, _point, _random_layer

T = 16384
# (name, chunk experts, gemm cap, conversion (rows, 32-blocks, warps), conversion programs an SM)
COHABIT = [
    ("co_c32_r192_a4b32w2_p2", 32, 192, (4, 32, 2), 2),
    ("co_c32_r192_a4b32w2_p3", 32, 192, (4, 32, 2), 3),
    ("co_c16_r192_a4b32w2_p2", 16, 192, (4, 32, 2), 2),
    ("co_c16_r192_a4b32w2_p3", 16, 192, (4, 32, 2), 3),
    ("co_c16_r192_a8b16w4_p1", 16, 192, (8, 16, 4), 1),
    ("co_c16_r192_a8b32w4_p1", 16, 192, (8, 32, 4), 1),
    ("co_c16_r208_a4b32w2_p2", 16, 208, (4, 32, 2), 2),
    ("co_c8_r192_a4b32w2_p3", 8, 192, (4, 32, 2), 3),
]
CAPS = (192, 208)


def _convert_persistent(routed, ws, perm, config, programs):
    e, c = routed.n_experts, ws.chunk_experts
    for n, lo in enumerate(range(0, e, c)):
        chunk = (lo, min(e, lo + c))
        base = (n % 2) * c
        for packed, scales, out, exps in ((routed.w1_packed, routed.w1_scales, ws.w1, ws.w1_exp),
                                          (routed.w2_packed, routed.w2_scales, ws.w2, ws.w2_exp)):
            convert_experts(packed, scales, out, exps, ws.lost, perm.expert_offsets, chunk, base, False, config,
                            programs=programs)
    return ws.w1[0, 0].float()


def run_shape(name: str, reps: int, log, only: str = "") -> list[dict]:
    shape = SHAPES[name]
    torch.manual_seed(0)
    routed, _ = _random_layer(shape, "cuda")
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    x, perm, _, topw = _point(T, e, k, h, "cuda")
    mlp = partial(expert_mlp, x, perm, routed, top_k=k, activation=shape["activation"])
    off = FP8Weights.from_mxfp4(routed, validate=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    c1, c2 = pick_configs(T * k, e, "fp8_stored")
    variants = {"fp8_offline_combine": _combined(partial(mlp, fp8_weights=off), topw, perm)}
    for cap in CAPS:
        cfg = (replace(c1, maxnreg=cap), replace(c2, maxnreg=cap))
        variants[f"fp8_offline_r{cap}"] = _combined(partial(mlp, fp8_weights=off, config=cfg), topw, perm)
    variants["ws_serial_c32"] = _combined(partial(mlp, workspace=FP8Workspace(32, h, inter, "cuda")), topw, perm)
    variants["ws_serial_c16"] = _combined(partial(mlp, workspace=FP8Workspace(16, h, inter, "cuda")), topw, perm)
    for vname, chunk, cap, conv, pps in COHABIT:
        ws = FP8Workspace(chunk, h, inter, "cuda", schedule="cohabit", convert_config=conv, gemm_maxnreg=cap,
                          convert_programs_per_sm=pps)
        variants[vname] = _combined(partial(mlp, workspace=ws), topw, perm)
    conv_ws = FP8Workspace(32, h, inter, "cuda")
    for conv, pps in (((4, 32, 2), 0), ((4, 32, 2), 2), ((4, 32, 2), 3), ((8, 16, 4), 1), ((8, 32, 4), 1)):
        variants[f"convert_a{conv[0]}b{conv[1]}w{conv[2]}_p{pps}"] = partial(
            _convert_persistent, routed, conv_ws, perm, conv, pps * sms)
    # the diagnostic: all GEMMs (offline weights, capped) and the whole layer's conversion on two streams with no
    # dependency between them; if the two share SMs the pair takes about the longer of the two, else their sum
    # hi: the GEMMs on a high-priority stream and enqueued first, so their programs are placed before the
    # conversion's (an SM whose conversion blocks took it first may not take a GEMM program beside them)
    side = torch.cuda.Stream()
    high = torch.cuda.Stream(priority=-1)

    def pair(cap, conv, pps, hi):
        cfg = (replace(c1, programs_per_sm=1, maxnreg=cap), replace(c2, programs_per_sm=1, maxnreg=cap))

        def fn():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            if hi:
                high.wait_stream(cur)
                with torch.cuda.stream(high):
                    y = mlp(fp8_weights=off, config=cfg)
                with torch.cuda.stream(side):
                    _convert_persistent(routed, conv_ws, perm, conv, pps * sms)
                cur.wait_stream(high)
            else:
                with torch.cuda.stream(side):
                    _convert_persistent(routed, conv_ws, perm, conv, pps * sms)
                y = mlp(fp8_weights=off, config=cfg)
            cur.wait_stream(side)
            return y
        return fn

    for cap, conv, pps, hi in ((192, (4, 32, 2), 3, True), (192, (4, 32, 2), 2, True), (192, (4, 32, 2), 3, False),
                               (208, (4, 32, 2), 2, True), (0, (4, 32, 2), 3, True)):
        variants[f"pair_r{cap}_a{conv[0]}b{conv[1]}w{conv[2]}_p{pps}{'_hi' if hi else ''}"] = pair(cap, conv, pps, hi)
        cfg = (replace(c1, programs_per_sm=1, maxnreg=cap), replace(c2, programs_per_sm=1, maxnreg=cap))
        variants[f"gemms_r{cap}"] = partial(mlp, fp8_weights=off, config=cfg)
    rows, ref, base_us = [], None, None
    flops = 6 * T * k * h * inter
    for vname, fn in variants.items():
        if only and vname != "fp8_offline_combine" and not vname.startswith(tuple(only.split(","))):
            continue
        try:
            y = fn()
            torch.cuda.synchronize()
            same = None
            if vname == "fp8_offline_combine":
                ref = y
            elif not vname.startswith(("convert", "pair", "gemms")):
                same = bool(torch.equal(y, ref))
            us = time_cuda(fn, reps=reps).median_us
        except Exception as exc:  # a variant that fails to compile or run is recorded, the rest go on
            rows.append(dict(shape=name, variant=vname, error=f"{type(exc).__name__}: {exc}"[:400]))
            log(json.dumps(rows[-1]))
            continue
        if vname == "fp8_offline_combine":
            base_us = us
        row = dict(shape=name, tokens=T, variant=vname, time_us=round(us, 1), equal_to_offline=same)
        if not vname.startswith(("convert", "pair", "gemms")):
            row["tflops"] = round(flops / us / 1e6, 1)
            row["x_offline"] = round(us / base_us, 4)
        rows.append(row)
        log(json.dumps(row))
    return rows


def main(out: str, shapes: str = "deepseek-v3,gpt-oss-120b", reps: str = "10", only: str = "") -> None:
    os.makedirs(out, exist_ok=True)
    logf = open(os.path.join(out, "cohabit.log"), "a")

    def log(line: str) -> None:
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    rows = []
    for name in shapes.split(","):
        rows += run_shape(name, int(reps), log, only)
    result = dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                  commit=os.environ.get("ADAPT_COMMIT", "unknown"), torch=torch.__version__, rows=rows)
    with open(os.path.join(out, "cohabit.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
