"""Issue 15: do the offline GEMMs (one program an SM, register-capped) share SMs with small blocks of another kernel?

Session 15's calls 2-3 timed the layer's GEMMs and the persistent conversion on two streams with no dependency and
got their sum (about 23 ms against 13 + 11.4), whatever the register cap or the stream priority. This probe replaces
the conversion with a kernel that only waits (each block spins on %globaltimer for SPIN_MS): if its blocks sit beside
the GEMM programs the pair takes about the GEMMs' time, else GEMMs + SPIN_MS. Then the same with the spin kernel's
and the conversion's preferred shared-memory carveout set to the maximum (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_
CARVEOUT = 100), in case an SM set up for a small-shared-memory kernel cannot take a 144 KB GEMM program.

Last, a plain persistent copy (copy_*) of about the conversion's bytes as the co-resident job, with the carveout set.

Usage (GPU): PYTHONPATH=. python benchmarks/next/cohab_spin.py OUT_DIR
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from dataclasses import replace
from functools import partial

import torch
import triton
import triton.language as tl

from adapt.bench.timer import time_cuda
from adapt.kernels.moe_configs import pick_configs
from adapt.kernels.moe_gemm import expert_mlp
from adapt.kernels.moe_weights import FP8Weights
from adapt.kernels.workspace import FP8Workspace, convert_experts
from adapt.stages.bench_moe import SHAPES, _point, _random_layer

SPIN_MS = 4.0
# co-resident copies: (programs an SM, warps, BLOCK, UNROLL, nanosleep after each step); the throttled ones spread
# the copy's bytes over about the GEMMs' time, in case a co-resident job only hides while it leaves bandwidth free
COPIES = ((3, 2, 1024, 4, 0, False), (3, 2, 1024, 4, 2000, False), (3, 2, 1024, 4, 4000, False),
          (3, 2, 1024, 4, 8000, False))
if os.environ.get("COHAB_STREAM"):  # session 15, call 6: the same copies with L2 streaming hints
    COPIES = ((3, 2, 1024, 4, 0, True), (3, 2, 1024, 4, 4000, True), (3, 2, 1024, 4, 8000, True))
# (programs an SM at most, grid programs an SM) for the SM-limited copy
LIMITED = ((1, 4), (2, 4), (3, 4), (3, 8))
if os.environ.get("COHAB_LIMITED"):  # session 15, call 8: the SM-limited copy alone
    COPIES = ()
if os.environ.get("COHAB_FEW"):  # session 15, call 7: one and two copy programs an SM (room for them beyond doubt)
    COPIES = ((1, 2, 1024, 4, 0, False), (2, 2, 1024, 4, 0, False), (1, 2, 1024, 4, 0, True))
PARTS = os.environ.get("COHAB_PARTS", "spin,convert,copy").split(",")  # COHAB_PARTS=copy: the copy rows only
T = 16384


@triton.jit
def _spin_kernel(out_ptr, ns):
    pid = tl.program_id(0)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < ns:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                      pack=1)
    tl.store(out_ptr + pid, t - t0)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr, SLEEP_NS: tl.constexpr = 0,
                 STREAM: tl.constexpr = False):
    """Persistent copy of n int32 (n a multiple of BLOCK * UNROLL): one load of UNROLL x BLOCK, then its store;
    SLEEP_NS > 0: each thread sleeps that long (``nanosleep``) after each store, to throttle the copy's rate;
    STREAM: loads marked evict-first and stores streaming (``.cs``), so the copy does not push the GEMMs' tiles out
    of L2."""
    step = BLOCK * UNROLL
    for base in range(tl.program_id(0) * step, n, tl.num_programs(0) * step):
        offs = base + tl.arange(0, UNROLL)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        if STREAM:
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, eviction_policy="evict_first"), cache_modifier=".cs")
        else:
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs))
        if SLEEP_NS > 0:
            tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP_NS}; mov.u32 $0, 0;", "=r,r", [base], dtype=tl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def _copy_limited_kernel(src_ptr, dst_ptr, n, sm_count_ptr, ticket_ptr, LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                         UNROLL: tl.constexpr):
    """The copy with at most LIMIT programs an SM: a program reads its SM (%smid) and takes a place there
    (``sm_count_ptr``, zeroed before the launch); past LIMIT it exits at once. The ones that stay take steps from a
    shared ticket (``ticket_ptr``), so the work does not depend on which programs stayed. Without the limit the block
    scheduler may pack a persistent grid onto a few SMs, where no GEMM program then fits beside it."""
    pid = tl.program_id(0)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
    place = tl.atomic_add(sm_count_ptr + smid, 1)
    if place < LIMIT:
        step = BLOCK * UNROLL
        n_steps = n // step
        t = tl.atomic_add(ticket_ptr, 1)
        while t < n_steps:
            offs = t * step + tl.arange(0, UNROLL)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs))
            t = tl.atomic_add(ticket_ptr, 1)


def _carveout(compiled, percent: int) -> int:
    """cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT) on a Triton CompiledKernel; returns the CUresult."""
    compiled._init_handles()
    cuda = ctypes.CDLL("libcuda.so.1")
    return cuda.cuFuncSetAttribute(ctypes.c_void_p(compiled.function), 9, ctypes.c_int(percent))


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    shape = SHAPES["deepseek-v3"]
    torch.manual_seed(0)
    routed, _ = _random_layer(shape, "cuda")
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    x, perm, _, topw = _point(T, e, k, h, "cuda")
    off = FP8Weights.from_mxfp4(routed, validate=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    c1, c2 = pick_configs(T * k, e, "fp8_stored")
    cfg = (replace(c1, programs_per_sm=1, maxnreg=192), replace(c2, programs_per_sm=1, maxnreg=192))
    gemms = partial(expert_mlp, x, perm, routed, top_k=k, activation=shape["activation"], fp8_weights=off, config=cfg)
    spin_out = torch.zeros(sms * 8, dtype=torch.int64, device="cuda")
    ns = int(SPIN_MS * 1e6)
    state = {}

    def spin(per_sm: int):
        state["spin"] = _spin_kernel[(sms * per_sm,)](spin_out, ns, num_warps=2)

    ws = FP8Workspace(32, h, inter, "cuda")

    def convert():
        for lo in range(0, e, 32):
            for packed, scales, o, exps in ((routed.w1_packed, routed.w1_scales, ws.w1, ws.w1_exp),
                                            (routed.w2_packed, routed.w2_scales, ws.w2, ws.w2_exp)):
                convert_experts(packed, scales, o, exps, ws.lost, perm.expert_offsets, (lo, lo + 32), 0, False,
                                (4, 32, 2), programs=3 * sms)

    side, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)

    def pair(other):
        def fn():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            high.wait_stream(cur)
            with torch.cuda.stream(high):
                y = gemms()
            with torch.cuda.stream(side):
                other()
            cur.wait_stream(high)
            cur.wait_stream(side)
            return y
        return fn

    rows = []

    def timed(name, fn):
        fn()
        torch.cuda.synchronize()
        us = time_cuda(fn, reps=5).median_us
        rows.append(dict(variant=name, time_us=round(us, 1)))
        print(json.dumps(rows[-1]), flush=True)

    timed("gemms_r192", gemms)
    if "spin" not in PARTS:
        _copies(rows, timed, pair, state, sms)
        return _write(out, rows)
    timed("spin_3", partial(spin, 3))
    timed("convert_p3", convert)
    timed("pair_spin_3", pair(partial(spin, 3)))
    timed("pair_spin_1", pair(partial(spin, 1)))
    timed("pair_convert_p3", pair(convert))
    # the carveout at the maximum for the small kernels
    spin(3)
    torch.cuda.synchronize()
    rc_spin = _carveout(state["spin"], 100)
    from adapt.kernels import workspace as W
    conv_kernels = list(W._convert_experts_words_kernel.device_caches[0][0].values())
    rc_conv = [_carveout(ck, 100) for ck in conv_kernels]
    rows.append(dict(carveout_rc_spin=rc_spin, carveout_rc_convert=rc_conv))
    print(json.dumps(rows[-1]), flush=True)
    timed("pair_spin_3_carveout100", pair(partial(spin, 3)))
    timed("pair_convert_p3_carveout100", pair(convert))
    timed("convert_p3_carveout100", convert)
    _copies(rows, timed, pair, state, sms)
    _write(out, rows)


def _copies(rows, timed, pair, state, sms):
    # a plain streaming copy of 6.4 GB read and 6.4 GB written (the conversion: 17 GB) as the co-resident job: if the
    # pair stays near the GEMMs' time, a conversion that keeps as many bytes in flight could hide beside them
    n = 3 * 2**29  # int32 offsets: below 2**31
    src = torch.empty(n, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    for per_sm, warps, block, unroll, sleep, stream in COPIES:
        name = (f"copy_p{per_sm}w{warps}b{block}u{unroll}" + (f"_sleep{sleep}" if sleep else "")
                + ("_stream" if stream else ""))

        def copy(p=per_sm, w=warps, b=block, u=unroll, z=sleep, st=stream):
            state["copy"] = _copy_kernel[(sms * p,)](src, dst, n, BLOCK=b, UNROLL=u, SLEEP_NS=z, STREAM=st,
                                                     num_warps=w)

        copy()
        torch.cuda.synchronize()
        rows.append(dict(variant=name + "_carveout_rc", rc=_carveout(state["copy"], 100)))
        timed(name, copy)
        timed("pair_" + name, pair(copy))
    counters = torch.zeros(1024 + 1, dtype=torch.int32, device="cuda")
    for limit, grid_per_sm in LIMITED:
        name = f"copy_limited{limit}_grid{grid_per_sm}"

        def limited(lim=limit, g=grid_per_sm):
            counters.zero_()
            state["lim"] = _copy_limited_kernel[(sms * g,)](src, dst, n, counters, counters[1024:], LIMIT=lim,
                                                            BLOCK=1024, UNROLL=4, num_warps=2)

        limited()
        torch.cuda.synchronize()
        ok = bool(torch.equal(dst[:4096], src[:4096])) and bool(torch.equal(dst[-4096:], src[-4096:]))
        rows.append(dict(variant=name + "_carveout_rc", rc=_carveout(state["lim"], 100), copied=ok))
        timed(name, limited)
        timed("pair_" + name, pair(limited))
    timed("copy_torch_full_grid", lambda: dst.copy_(src))


def _write(out, rows):
    with open(os.path.join(out, "cohab_spin.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("ADAPT_COMMIT", "unknown"),
                       spin_ms=SPIN_MS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
