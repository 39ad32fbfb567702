"""Gluon (Hopper, sm_90) form of the decode top-k's candidate pass (``topk._decode_candidates_kernel``).

Same result, slot for slot: each (row, part) program draws the row's sample, finds the threshold key tau by the
same bisection, then reads its contiguous columns once and keeps the visible keys >= tau, in ascending position
order, in the part's slots (order keys and positions) and counts them. What differs is the layout, which Triton
3.6's ``tl`` picks on its own: there, the 16-byte loads and the slot-addressed stores get different layouts, and
the step is built with two scans, four layout conversions through shared memory and 23 barriers, about 1,500
instructions a thread for 16 scores (sm_90 build of 2026-12-01; the pass ran at 0.55 TB/s on an H200).

Here one layout holds a step from load to store: [WARPS, 32 * PER_THREAD] scores, warp w holding the step's w-th
run of 32 * PER_THREAD columns and each thread PER_THREAD consecutive ones (16-byte loads). The in-order slot of a
kept score is its thread's running count (in registers), plus the lanes before it in the warp (shuffles), plus
the warps before it (the step's only exchange through shared memory: WARPS counts).

Measured on an H200 (2026-12-01, benchmarks/gpu-2026-12-01-dsa-s8): at batch 64 x 128K the pass takes 23.0-23.8 us
against the tl pass's 56.2-56.5 (the same tau, counts and slots), so ``topk_decode`` 42.6-44.7 us against 75.2-77.4
and the decode step 1.46x its byte floor; the last 4096-row chunk of a 128K prefill 1.59-1.65 ms against 3.09.

Gluon does not run under TRITON_INTERPRET: ``topk.topk_decode(gluon=True)`` dispatches here on a CUDA device of
capability 9.x only; elsewhere the ``tl`` kernel runs.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _order_key(x):
    """uint32 key whose unsigned order is fp32 ``x``'s order (``topk._order_key``)."""
    bits = gl.where(x == 0.0, 0.0, x).to(gl.uint32, bitcast=True)
    return bits ^ (((bits >> 31) * 0x7FFFFFFF) | 0x80000000)


@gluon.jit
def _sample_tau(base, n, n_read, topk, SAMPLE: gl.constexpr, RUN: gl.constexpr, EXPECT_NUM: gl.constexpr,
                EXPECT_DEN: gl.constexpr, TAU_BITS: gl.constexpr, WARPS: gl.constexpr):
    """``topk.sample_tau`` over ``topk.sample_columns``' sample (runs of RUN columns, one a thread)."""
    LS: gl.constexpr = gl.BlockedLayout([RUN], [32], [WARPS], [0])
    i = gl.arange(0, SAMPLE, layout=LS)
    runs: gl.constexpr = SAMPLE // RUN
    span = gl.maximum(gl.cdiv(gl.cdiv(n, runs), RUN) * RUN, RUN)
    spos = (i // RUN) * span + i % RUN
    x = gl.load(base + spos, mask=spos < n_read, other=float("-inf"))
    key = _order_key(x)
    vis = (x != float("-inf")) & (spos < n)
    sampled = gl.sum(vis.to(gl.int32), axis=0)
    in_range = gl.sum((spos < n).to(gl.int64), axis=0)
    want = gl.cdiv(EXPECT_NUM * topk * in_range, EXPECT_DEN * gl.maximum(n, 1).to(gl.int64))
    want = gl.maximum(want, 1)
    tau = gl.full([], 0, gl.uint32)
    for b in gl.static_range(TAU_BITS):
        trial = tau | (gl.full([], 1, gl.uint32) << (31 - b))
        hits = gl.sum((vis & (key >= trial)).to(gl.int32), axis=0)
        tau = gl.where(hits >= want, trial, tau)
    return gl.where(want > sampled, 0, tau)


@gluon.jit
def _emit(x, pos, tau, n, hi, written, key_base, pos_base, below, SEG_CAP: gl.constexpr, LT: gl.constexpr,
          LW: gl.constexpr, MASKED: gl.constexpr):
    """Keep one step's visible keys >= tau after the ``written`` before them (ascending positions; those past
    SEG_CAP slots only counted); returns the new count. MASKED: positions at or past n or hi are not kept (else
    the step is known to lie inside both)."""
    key = _order_key(x)
    take = (x != float("-inf")) & (key >= tau)
    if MASKED:
        take = take & (pos < n) & (pos < hi)
    t = take.to(gl.int32)
    incl = gl.associative_scan(t, 1, _add)  # thread-local, then across the warp's lanes
    every = gl.convert_layout(gl.sum(t, axis=1), gl.SliceLayout(0, LW))  # each warp's count, in every thread
    before = gl.sum(gl.where(below, gl.expand_dims(every, 0), 0), axis=1)  # thread-local
    before = gl.convert_layout(before, gl.SliceLayout(1, LT))  # the same row a warp: no data moved
    slot = written + gl.expand_dims(before, 1) + incl - 1
    total = gl.sum(every, axis=0)
    if MASKED:
        take = take & (slot < SEG_CAP)
    elif written + total > SEG_CAP:  # a scalar test a step: the slot cap applied only when it can bind
        take = take & (slot < SEG_CAP)
    gl.store(key_base + slot, key.to(gl.int32, bitcast=True), mask=take)
    gl.store(pos_base + slot, pos, mask=take)
    return written + total


@gluon.jit
def _whole_step(base, start, full_end, off, WARPS: gl.constexpr, WIDTH: gl.constexpr, LT: gl.constexpr):
    """The scores of the whole step at ``start`` when it lies before ``full_end`` (one scalar predicate on the
    loads); undefined registers otherwise (never read)."""
    inside = gl.full([WARPS, WIDTH], 0, gl.int32, LT) + start < full_end
    return gl.load(base + start + off, mask=inside)


@gluon.jit
def decode_candidates_gluon_kernel(scores_ptr, limits_ptr, tau_ptr, key_ptr, pos_ptr, count_ptr, stride, n_cols,
                                   topk, SAMPLE: gl.constexpr, RUN: gl.constexpr, EXPECT_NUM: gl.constexpr,
                                   EXPECT_DEN: gl.constexpr, SEG_CAP: gl.constexpr, PARTS: gl.constexpr,
                                   PER_THREAD: gl.constexpr, ALIGNED: gl.constexpr, TAU_BITS: gl.constexpr,
                                   WARPS: gl.constexpr, DEPTH: gl.constexpr = 1):
    """Program (row, part) of ``topk._decode_candidates_kernel`` (same arguments and result; BLOCK = WARPS * 32 *
    PER_THREAD scores a step). The steps wholly inside the part's visible columns are built without position
    masks (and their stores without the slot cap when the step cannot pass it), the one or two after them with.
    DEPTH (1 or 2) whole steps are in flight: step i + DEPTH is requested before step i's scan and stores, and
    the first DEPTH before the sample's threshold search."""
    LT: gl.constexpr = gl.BlockedLayout([1, PER_THREAD], [1, 32], [WARPS, 1], [1, 0])
    LW: gl.constexpr = gl.BlockedLayout([1, WARPS], [1, 32], [WARPS, 1], [1, 0])  # [WARPS, WARPS]: a row a warp
    WIDTH: gl.constexpr = 32 * PER_THREAD
    BLOCK: gl.constexpr = WARPS * WIDTH
    row = gl.program_id(0).to(gl.int64)
    part = gl.program_id(1)
    n = gl.minimum(gl.load(limits_ptr + row), n_cols)
    if ALIGNED:
        n_read = gl.multiple_of(gl.minimum((n + 15) // 16 * 16, n_cols), 16)
    else:
        n_read = n
    base = scores_ptr + row * stride
    width = gl.cdiv(gl.cdiv(n_read, PARTS), 16) * 16
    lo = part * width
    hi = gl.minimum(lo + width, n_read)
    if ALIGNED:
        hi = gl.multiple_of(hi, 16)
    seg = row * PARTS + part
    key_base = key_ptr + seg * SEG_CAP
    pos_base = pos_ptr + seg * SEG_CAP
    w_rows = gl.arange(0, WARPS, layout=gl.SliceLayout(1, LT))
    off = gl.expand_dims(w_rows * WIDTH, 1) + gl.expand_dims(gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LT)), 0)
    # below[w, v]: warp v's run comes before warp w's (the exclusive sum over warps)
    below = (gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(0, LW)), 0)
             < gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(1, LW)), 1))
    # whole steps of visible columns (no position masks), then the one or two steps after them (masked)
    full_end = lo + gl.maximum(gl.minimum(hi, n) - lo, 0) // BLOCK * BLOCK
    x = _whole_step(base, lo, full_end, off, WARPS, WIDTH, LT)  # requested before the sample's threshold
    x1 = x
    if DEPTH > 1:
        x1 = _whole_step(base, lo + BLOCK, full_end, off, WARPS, WIDTH, LT)
    tau = _sample_tau(base, n, n_read, topk, SAMPLE, RUN, EXPECT_NUM, EXPECT_DEN, TAU_BITS, WARPS)
    if part == 0:
        gl.store(tau_ptr + row, tau.to(gl.int32, bitcast=True))
    written = gl.zeros([], gl.int32)
    for start in range(lo, full_end, BLOCK):
        if DEPTH > 1:  # DEPTH steps in flight: step i + 2 requested before step i's work
            x2 = _whole_step(base, start + 2 * BLOCK, full_end, off, WARPS, WIDTH, LT)
        else:
            x2 = x1
            x1 = _whole_step(base, start + BLOCK, full_end, off, WARPS, WIDTH, LT)
        written = _emit(x, start + off, tau, n, hi, written, key_base, pos_base, below, SEG_CAP, LT, LW, False)
        x = x1
        x1 = x2
    for start in range(full_end, hi, BLOCK):
        pos = start + off
        x = gl.load(base + pos, mask=pos < hi, other=float("-inf"))
        written = _emit(x, pos, tau, n, hi, written, key_base, pos_base, below, SEG_CAP, LT, LW, True)
    gl.store(count_ptr + seg, written)
