"""Sparse MLA (absorbed form, e4m3 latent in four scale groups) in Gluon for Hopper (sm_90).

The same arithmetic as ``sparse_mla._sparse_mla_fp8x4_kernel`` (twin: ``sparse_mla.sparse_mla_torch``):
for each query row and 64 heads, over the row's selected positions in tiles of BLOCK_K,

    s = (q_rope . k_rope^T + q_nope . c^T) * scale,   c = bf16(e4m3 row * its group's fp32 scale),
    online softmax over the tiles, o = sum p . c  (p rounded to bf16 for the MMA).

What Gluon adds over the ``tl`` kernel (whose loads, dequantisation and both MMAs run in series and whose
wgmma is waited on at once, benchmarks/gpu-2026-11-30-dsa-s3-final/README.md):
- q (bf16 [64, 512]) and q_rope ([64, 64]) sit in shared memory for the whole program (wgmma's A from
  shared memory: no 256 registers of q per thread);
- the dequantised tile lives in a two-slot shared ring (bf16 [2, BLOCK_K, 512]) that serves both MMAs:
  q.k reads it transposed (K-major B), p @ v reads it as is (N-major B);
- both MMAs are issued asynchronously; the gathered e4m3 loads of tile t+1 are issued right after the
  q.k MMA of tile t, and tile t+1 is dequantised into the other ring slot while p @ v of tile t runs;
- 8 warps = 2 warpgroups split the MMA N side: q.k's positions (BLOCK_K / 2 each) and p @ v's output
  columns (256 each), so the fp32 accumulator is [64, 512] / 256 threads = 128 registers per thread.

Shared memory (BLOCK_K = 64): q 64 KB + q_rope 8 KB + ring 2 x (64 + 8) KB + p 8 KB = 224 KB of the H200's
227 KB: one program per SM. (BLOCK_K = 32 builds in 152 KB but ran 5.6x slower at batch 64 x 128K on the H200,
benchmarks/gpu-2026-12-01-dsa-s4-mla: ``sparse_mla`` launches 64.)

Gluon compiles only for a CUDA target (no interpreter); ``sparse_mla.sparse_mla`` calls it on devices of
capability 9.x where it measured faster (its ``gluon`` argument, ``sparse_mla.GLUON_DEFAULT``). The module
imports without a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from adapt.kernels import pdl
from adapt.kernels.formats import PAGE_SIZE, is_sm90


@gluon.jit
def _tile_idx(idx_ptr, row, k0, last, topk, BLOCK_K: gl.constexpr, LAYOUT: gl.constexpr):
    """The selected positions k0 .. k0 + BLOCK_K of the row (int32 [BLOCK_K] in the 1-D LAYOUT; -1 past
    ``last``, as for no position)."""
    kk = k0 + gl.arange(0, BLOCK_K, layout=LAYOUT)
    return gl.load(idx_ptr + row * topk + kk, mask=kk < last, other=-1)


@gluon.jit
def _idx_slots(block_table_ptr, seq, bt_stride, idx, PAGE: gl.constexpr):
    """Cache slots (int32) of positions ``idx`` through the sequence's block table; -1 where idx is -1."""
    valid = idx >= 0
    page = gl.load(block_table_ptr + seq * bt_stride + idx // PAGE, mask=valid, other=0)
    return gl.where(valid, page * PAGE + idx % PAGE, -1)


@gluon.jit
def _nope_ptrs(slot, nope_ptr, RANK: gl.constexpr, L3: gl.constexpr):
    """Addresses and mask of the gathered e4m3 rows [BLOCK_K, RANK / 16, 16] (L3, 16 bytes a thread) of cache slots
    ``slot`` (int32 [BLOCK_K] in SliceLayout(1, SliceLayout(2, L3)), -1 = none)."""
    c32 = gl.arange(0, RANK // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    cols3 = gl.expand_dims(gl.expand_dims(c32 * 16, 0), 2) + gl.expand_dims(gl.expand_dims(c16, 0), 1)
    return (nope_ptr + gl.expand_dims(gl.expand_dims(slot.to(gl.int64), 1), 2) * RANK + cols3,
            gl.expand_dims(gl.expand_dims(slot >= 0, 1), 2))


@gluon.jit
def _scale_ptrs(slot, nscale_ptr, RANK: gl.constexpr, GROUP: gl.constexpr, L3: gl.constexpr):
    """Addresses and mask of those rows' fp32 group scales, repeated per 16 columns [BLOCK_K, RANK / 16]."""
    c32 = gl.arange(0, RANK // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    return (nscale_ptr + gl.expand_dims(slot.to(gl.int64), 1) * (RANK // GROUP) + gl.expand_dims(c32 * 16 // GROUP, 0),
            gl.expand_dims(slot >= 0, 1))


@gluon.jit
def _rope_ptrs(slot_r, rope_ptr, ROPE: gl.constexpr, RL: gl.constexpr):
    """Addresses and mask of the bf16 rope rows [BLOCK_K, ROPE] (RL) of cache slots ``slot_r`` (SliceLayout(1, RL),
    -1 = none)."""
    rc = gl.arange(0, ROPE, layout=gl.SliceLayout(0, RL))
    return (rope_ptr + gl.expand_dims(slot_r.to(gl.int64), 1) * ROPE + gl.expand_dims(rc, 0),
            gl.expand_dims(slot_r >= 0, 1))


@gluon.jit
def _gather_rows(slot, nope_ptr, nscale_ptr, rope_ptr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                 L3: gl.constexpr, RL: gl.constexpr, VL: gl.constexpr, slot_rope, idx_v, DIRECT: gl.constexpr):
    """Issue the gathered loads of one tile's cache slots (int32 [BLOCK_K] in SliceLayout(1, SliceLayout(2, L3)),
    -1 = none): (e4m3 rows [BLOCK_K, RANK / 16, 16] in L3, their fp32 scales per 16 columns [BLOCK_K, RANK / 16],
    bf16 rope rows [BLOCK_K, ROPE] in RL, valid [BLOCK_K] in VL). Rows without a slot read as zeros. DIRECT: the
    rope rows' slots ``slot_rope`` (in SliceLayout(1, RL)) and the positions ``idx_v`` (in VL) are given, else
    both are converted from ``slot`` (a shared-memory round trip and a barrier each)."""
    nope_p, nope_m = _nope_ptrs(slot, nope_ptr, RANK, L3)
    raw = gl.load(nope_p, mask=nope_m, other=0.0)
    sc_p, sc_m = _scale_ptrs(slot, nscale_ptr, RANK, GROUP, L3)
    sc = gl.load(sc_p, mask=sc_m, other=0.0)
    if DIRECT:  # the rope rows' slots and the softmax validity given in their own layouts (no conversion)
        slot_r = slot_rope
        valid_v = idx_v >= 0
    else:
        slot_r = gl.convert_layout(slot.to(gl.int64), gl.SliceLayout(1, RL))
        valid_v = gl.convert_layout(slot >= 0, VL)
    rope_p, rope_m = _rope_ptrs(slot_r, rope_ptr, ROPE, RL)
    kr = gl.load(rope_p, mask=rope_m, other=0.0)
    return raw, sc, kr, valid_v


@gluon.jit
def _l2_prefetch_rows(slot, nope_ptr, nscale_ptr, rope_ptr, RANK: gl.constexpr, ROPE: gl.constexpr,
                      GROUP: gl.constexpr, PFL: gl.constexpr):
    """Ask L2 for one tile's cache rows ahead of their gathers (``prefetch.global.L2``: no registers held, no
    data returned). ``slot``: int32 [BLOCK_K] in SliceLayout(1, PFL), -1 = none (prefetches row 0, harmless).
    PFL spans [BLOCK_K, 8]: columns 0 .. RANK / 128 - 1 are the e4m3 row's 128-byte lines, the next its bf16
    rope row (ROPE * 2 = 128 bytes), the next its fp32 scales (16 bytes); the rest prefetch row 0's scales."""
    gl.static_assert(RANK // 128 + 2 <= 8)
    gl.static_assert(ROPE * 2 <= 128)
    s2 = gl.expand_dims(gl.maximum(slot, 0).to(gl.int64), 1)
    j = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, PFL)), 0)
    nope_a = (nope_ptr + s2 * RANK + gl.minimum(j, RANK // 128 - 1) * 128).to(gl.int64, bitcast=True)
    rope_a = (rope_ptr + s2 * ROPE).to(gl.int64, bitcast=True)
    sc_a = (nscale_ptr + gl.where(j == RANK // 128 + 1, s2, 0) * (RANK // GROUP)).to(gl.int64, bitcast=True)
    addr = gl.where(j < RANK // 128, nope_a, gl.where(j == RANK // 128, rope_a, sc_a))
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _dequant_rows(raw, sc, kr, kv_view, kr_view, RANK: gl.constexpr, ROWS: gl.constexpr, F16: gl.constexpr = False):
    """Dequantise ROWS gathered rows into their rows of a ring slot: the fp32 product rounded to bf16, as the twin;
    F16: e4m3 to fp16 (exact, two a conversion) times the scale rounded to fp16, an fp16 product (HMUL2), and the
    bf16 rope row converted to fp16."""
    if F16:
        kv = raw.to(gl.float16) * gl.expand_dims(sc.to(gl.float16), 2)
    else:
        kv = (raw.to(gl.float32) * gl.expand_dims(sc, 2)).to(gl.bfloat16)
    kv_view.store(gl.reshape(kv, [ROWS, RANK]))
    kr_view.store(kr.to(kr_view.dtype))


@gluon.jit
def _stage_tile(raw, sc, kr, kv_buf, kr_buf, RANK: gl.constexpr, BLOCK_K: gl.constexpr, F16: gl.constexpr = False):
    """Dequantise a gathered tile into its ring slot, visible to the MMAs' async reads."""
    _dequant_rows(raw, sc, kr, kv_buf, kr_buf, RANK, BLOCK_K, F16)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _online_softmax(s, valid, m_i, l_i, scale_log2, LAZY: gl.constexpr = 0.0, SUM: gl.constexpr = True):
    """One tile's online-softmax step in log2 units: the tile's probabilities p (positions not ``valid`` -inf),
    the rescale alpha of what came before, the running max and sum, and which rows' accumulators need alpha (max
    moved from a finite value; a row still at -inf has a zero accumulator). LAZY > 0 (log2 units): a row keeps its
    running max unless the tile's exceeds it by more than LAZY (alpha is then exactly 1 and p at most 2^LAZY).
    SUM False: ``l_i`` is returned as given (the caller keeps the sums itself; no cross-warp sum)."""
    s = gl.where(gl.expand_dims(valid, 0), s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    moved = m_new > m_i + LAZY
    rescale = moved & (m_i > float("-inf"))
    if LAZY > 0:
        m_new = gl.where(moved, m_new, m_i)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    if SUM:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i, rescale


@gluon.jit
def _any_rescale(flag_smem, BLOCK_H: gl.constexpr, WARPS: gl.constexpr):
    """Whether any row of the program flagged its accumulator for a rescale (``flag_smem``: int32 [BLOCK_H], 1 =
    rescale, stored before a barrier), as a scalar the same in every thread: each warp reads all BLOCK_H flags (2
    a thread, no barrier of its own) and reduces them in one warp reduction (sm_90: a REDUX to a uniform register)."""
    return gl.max(flag_smem.load(gl.BlockedLayout([BLOCK_H // 32], [32], [WARPS], [0])), axis=0) > 0


@gluon.jit
def _allocate(RANK: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
              F16: gl.constexpr = False, SLOTS: gl.constexpr = 2):
    """The shared memory of a sparse MLA program: q, q_rope, the ring of SLOTS dequantised tiles (latent and rope)
    and p, each in the NVMMA layout its MMA reads, all bf16 (fp16 with F16)."""
    DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    q_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, RANK], DT)
    qr_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], DT)
    kv_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, RANK], DT)
    kr_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, ROPE], DT)
    p_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], DT)
    q_smem = gl.allocate_shared_memory(DT, [BLOCK_H, RANK], q_lay)
    qr_smem = gl.allocate_shared_memory(DT, [BLOCK_H, ROPE], qr_lay)
    kv_smem = gl.allocate_shared_memory(DT, [SLOTS, BLOCK_K, RANK], kv_lay)
    kr_smem = gl.allocate_shared_memory(DT, [SLOTS, BLOCK_K, ROPE], kr_lay)
    p_smem = gl.allocate_shared_memory(DT, [BLOCK_H, BLOCK_K], p_lay)
    return q_smem, qr_smem, kv_smem, kr_smem, p_smem


@gluon.jit
def _load_q(qn_ptr, qr_ptr, q_smem, qr_smem, row, head0, n_heads, RANK: gl.constexpr, ROPE: gl.constexpr,
            BLOCK_H: gl.constexpr, QL: gl.constexpr, RL: gl.constexpr):
    """q and q_rope of the row's BLOCK_H heads from head0 into shared memory (masked heads are zeros)."""
    hq = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, RANK, layout=gl.SliceLayout(0, QL))
    q = gl.load(qn_ptr + gl.expand_dims((row * n_heads + hq) * RANK, 1) + gl.expand_dims(qc, 0),
                mask=gl.expand_dims(hq < n_heads, 1), other=0.0)
    q_smem.store(q.to(q_smem.dtype))
    hr = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, RL))
    rc = gl.arange(0, ROPE, layout=gl.SliceLayout(0, RL))
    qr = gl.load(qr_ptr + gl.expand_dims((row * n_heads + hr) * ROPE, 1) + gl.expand_dims(rc, 0),
                 mask=gl.expand_dims(hr < n_heads, 1), other=0.0)
    qr_smem.store(qr.to(qr_smem.dtype))


@gluon.jit
def _finish(acc, m_i, l_i, out_ptr, lse_ptr, row, head0, split, n_heads, RANK: gl.constexpr, BLOCK_H: gl.constexpr,
            SPLIT: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
    """A program's end: with SPLIT the slice's log2-sum-exp first (fewer values live beside the accumulator) and its
    normalised partial (fp32, or bf16 where ``out_ptr`` is), else the bf16 output; waits for the last p @ v."""
    if SPLIT:
        hs = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        gl.store(lse_ptr + (row * gl.num_programs(2) + split) * n_heads + hs, lse, mask=hs < n_heads)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    o = o / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)
    ho = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    oc = gl.arange(0, RANK, layout=gl.SliceLayout(0, O_L))
    hmask = gl.expand_dims(ho < n_heads, 1)
    if SPLIT:  # the partial in the buffer's type (fp32, or bf16 with ``sparse_mla.PARTIAL_BF16``)
        part = (row * gl.num_programs(2) + split) * n_heads + ho
        gl.store(out_ptr + gl.expand_dims(part * RANK, 1) + gl.expand_dims(oc, 0), o.to(out_ptr.dtype.element_ty),
                 mask=hmask)
    else:
        gl.store(out_ptr + gl.expand_dims((row * n_heads + ho) * RANK, 1) + gl.expand_dims(oc, 0),
                 o.to(gl.bfloat16), mask=hmask)


@gluon.jit
def sparse_mla_gluon_kernel(qn_ptr, qr_ptr, nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, seq_ptr, idx_ptr,
                            out_ptr, lse_ptr, n_heads, topk, positions_per_split, bt_stride, scale_log2,
                            RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr, BLOCK_H: gl.constexpr,
                            BLOCK_K: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
                            PREFETCH: gl.constexpr = True, EARLY_LOADS: gl.constexpr = False,
                            DIRECT: gl.constexpr = False, L2_AHEAD: gl.constexpr = 0, WARPS: gl.constexpr = 8,
                            ABLATE: gl.constexpr = 0, LAZY: gl.constexpr = 0.0, PDL: gl.constexpr = False,
                            F16: gl.constexpr = False, GATHER_ROWS: gl.constexpr = 1):
    """One program: one query row (program_id(0)), BLOCK_H = 64 heads (program_id(1)), one slice of the row's
    positions (program_id(2)); 8 warps. Outputs as ``_sparse_mla_fp8x4_kernel``: SPLIT writes the slice's
    normalised fp32 partial [rows, splits, H, RANK] and its log2-sum-exp [rows, splits, H]; else bf16 [rows, H,
    RANK]. L2_AHEAD > 0: at each step the cache rows of the tile L2_AHEAD steps ahead are prefetched into L2
    (``_l2_prefetch_rows``), so the gathers issued one step ahead wait on L2, not HBM.

    ABLATE (a timing probe only, ``launch(ablate=)``; the output is wrong when it is not 0): a bit mask of parts
    left out, to time the rest: 1 the gathers (every cache slot -1: masked loads), 2 the q.k MMAs, 4 the p @ v
    MMA, 8 the softmax arithmetic (p = s), 16 the block-table lookups (positions read as cache slots).

    LAZY > 0 (log2 units; 0 = off, the exact online softmax): the lazy rescale of FlashAttention-4. A row keeps its
    running max unless a tile's row max exceeds it by more than LAZY, so p = exp2(s * scale - m) stays at most
    2^LAZY (8: 256; bf16 rounds it with the same relative error, the fp32 accumulator is far from its range); l and
    the log2-sum-exp m + log2(l) stay consistent with the stale max. The rows that moved are flagged in shared
    memory before the tile's existing barrier after ``p_smem.store``; after it every warp reduces the flags to one
    scalar (``_any_rescale``: one LDS and a REDUX, no barrier of its own) and the accumulator's rescale (128 FMUL a
    thread) runs under that uniform branch. Rows still at -inf before the tile have a zero accumulator and never ask
    for it, so with random scores only rare tiles take the branch. Not bit-equal to LAZY 0 (p and l are taken
    against another max, so they round differently): within the kernel-vs-twin tolerance. Measured 4-6% slower than
    LAZY 0 on the H200 (``GLUON_FLAGS``): the flag round trip sits on the q.k -> p @ v chain.

    PDL: a kernel of the decode chain launched with programmatic dependent launch (``adapt.kernels.pdl``): it waits
    for the kernel before (the select) before any load, then lets the next (the slices' combine) launch.

    GATHER_ROWS: the rows one warp's gathered loads (and so its dequantised stores) span. With 1, a warp's 32 lanes
    take one row's 32 chunks of 16 columns, which the ring slot's 128-byte swizzle puts in the same bank group of
    its eight 64-column blocks: every store into the slot is an 8-way bank conflict (Nsight Compute, H200: 6.9-way
    on average, 42% of the kernel's shared-store wavefronts). With 8 a warp takes 4 chunks of each of 8 rows, whose
    swizzles differ, so its stores are conflict-free."""
    pdl.enter(PDL)
    gl.static_assert(BLOCK_H == 64)
    row = gl.program_id(0).to(gl.int64)
    head0 = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    # register layouts (WARPS = 8 or 16: WARPS / 4 warpgroups split both MMAs' N side)
    gl.static_assert(WARPS == 8 or WARPS == 16)
    WG: gl.constexpr = WARPS // 4
    # e4m3 rows, 16 B a thread, GATHER_ROWS rows a warp (lanes along the row's 16-byte chunks, then rows)
    gl.static_assert(GATHER_ROWS == 1 or GATHER_ROWS == 2 or GATHER_ROWS == 4 or GATHER_ROWS == 8)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [GATHER_ROWS, 32 // GATHER_ROWS, 1], [WARPS, 1, 1], [2, 1, 0])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])  # bf16 rows of 64
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])  # bf16 rows of 512
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, BLOCK_K // WG, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, RANK // WG, 16])
    VL: gl.constexpr = gl.SliceLayout(0, S_L)
    PFL: gl.constexpr = gl.BlockedLayout([1, 16 // WARPS], [16, 2], [4, WG], [1, 0])  # [64, 8]: a tile's L2 prefetches
    PFR: gl.constexpr = gl.SliceLayout(1, PFL)
    q_smem, qr_smem, kv_smem, kr_smem, p_smem = _allocate(RANK, ROPE, BLOCK_H, BLOCK_K, F16)

    _load_q(qn_ptr, qr_ptr, q_smem, qr_smem, row, head0, n_heads, RANK, ROPE, BLOCK_H, QL, RL)

    seq = gl.load(seq_ptr + row).to(gl.int64)
    first = split * positions_per_split
    last = gl.minimum(first + positions_per_split, topk)
    SL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))  # one value per gathered row
    RS: gl.constexpr = gl.SliceLayout(1, RL)
    slot = _idx_slots(block_table_ptr, seq, bt_stride, _tile_idx(idx_ptr, row, first, last, topk, BLOCK_K, SL), PAGE)
    slot_r = _idx_slots(block_table_ptr, seq, bt_stride, _tile_idx(idx_ptr, row, first, last, topk, BLOCK_K, RS), PAGE)
    idx_v = _tile_idx(idx_ptr, row, first, last, topk, BLOCK_K, VL)
    if ABLATE & 1:
        slot = slot * 0 - 1
        slot_r = slot_r * 0 - 1
    raw, sc, kr, valid = _gather_rows(slot, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL, VL, slot_r,
                                      idx_v, DIRECT)
    _stage_tile(raw, sc, kr, kv_smem.index(0), kr_smem.index(0), RANK, BLOCK_K, F16)
    # PREFETCH: the slots of the next tile are known before its loop step (its data loads then wait on one
    # memory round trip, not three: position -> block-table entry -> row)
    slot_n = _idx_slots(block_table_ptr, seq, bt_stride,
                        _tile_idx(idx_ptr, row, first + BLOCK_K, last, topk, BLOCK_K, SL), PAGE)
    slot_rn = _idx_slots(block_table_ptr, seq, bt_stride,
                         _tile_idx(idx_ptr, row, first + BLOCK_K, last, topk, BLOCK_K, RS), PAGE)

    if L2_AHEAD > 0:  # slots of the tile L2_AHEAD steps ahead (its rows are prefetched at the loop's first step)
        slot_pf = _idx_slots(block_table_ptr, seq, bt_stride,
                             _tile_idx(idx_ptr, row, first + L2_AHEAD * BLOCK_K, last, topk, BLOCK_K, PFR), PAGE)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, RANK], gl.float32, layout=O_L))
    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=S_L)
    buf = 0
    if LAZY > 0:  # per row, each tile: 1 = its accumulator takes the rescale
        flag_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for k0 in range(first, last, BLOCK_K):
        kv_buf = kv_smem.index(buf)
        if L2_AHEAD > 0:  # rows of the tile L2_AHEAD ahead into L2; positions of the one after (slots below)
            _l2_prefetch_rows(slot_pf, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, PFL)
            idx_pf = _tile_idx(idx_ptr, row, k0 + (L2_AHEAD + 1) * BLOCK_K, last, topk, BLOCK_K, PFR)
        if EARLY_LOADS:  # the next tile's gathers issued before this tile's q.k (PREFETCH: addresses known)
            raw, sc, kr, valid_n = _gather_rows(slot_n, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL, VL,
                                                slot_rn, _tile_idx(idx_ptr, row, k0 + BLOCK_K, last, topk, BLOCK_K,
                                                                   VL), DIRECT)
        if not (ABLATE & 2):
            s = warpgroup_mma(qr_smem, kr_smem.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_smem, kv_buf.permute((1, 0)), s, is_async=True)
        if ABLATE & 1:
            slot_n = slot_n * 0 - 1
            slot_rn = slot_rn * 0 - 1
        # the next tile's gathers fly while q.k runs
        if PREFETCH:
            if not EARLY_LOADS:
                raw, sc, kr, valid_n = _gather_rows(slot_n, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL,
                                                    VL, slot_rn, _tile_idx(idx_ptr, row, k0 + BLOCK_K, last, topk,
                                                                           BLOCK_K, VL), DIRECT)
            idx_nn = _tile_idx(idx_ptr, row, k0 + 2 * BLOCK_K, last, topk, BLOCK_K, SL)
            if DIRECT:
                idx_rnn = _tile_idx(idx_ptr, row, k0 + 2 * BLOCK_K, last, topk, BLOCK_K, RS)
        else:
            slot_n = _idx_slots(block_table_ptr, seq, bt_stride,
                                _tile_idx(idx_ptr, row, k0 + BLOCK_K, last, topk, BLOCK_K, SL), PAGE)
            slot_rn = _idx_slots(block_table_ptr, seq, bt_stride,
                                 _tile_idx(idx_ptr, row, k0 + BLOCK_K, last, topk, BLOCK_K, RS), PAGE)
            raw, sc, kr, valid_n = _gather_rows(slot_n, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL, VL,
                                                slot_rn, _tile_idx(idx_ptr, row, k0 + BLOCK_K, last, topk, BLOCK_K,
                                                                   VL), DIRECT)
        if ABLATE & 2:
            acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            s = s_zero + 1.0
        else:
            s, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))  # q.k of this tile, p @ v of the last
        if ABLATE & 8:
            p = s
            alpha = gl.full([BLOCK_H], 1.0, gl.float32, layout=gl.SliceLayout(1, S_L))
            l_i = l_i + 1.0
            rescale = alpha < 0.0  # no row
        else:
            p, alpha, m_i, l_i, rescale = _online_softmax(s, valid, m_i, l_i, scale_log2, LAZY)
        p_smem.store(p.to(p_smem.dtype))
        if LAZY > 0:  # read by every warp after the barrier below
            flag_smem.store(rescale.to(gl.int32))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        if LAZY > 0:  # a uniform branch: the rescale (128 FMUL a thread) only on tiles where some row's max moved
            if _any_rescale(flag_smem, BLOCK_H, WARPS):
                acc_t = acc_t * alpha_o
        else:
            acc_t = acc_t * alpha_o
        if ABLATE & 4:  # no p @ v: the accumulator passes through (the loop-carried type of an MMA's)
            acc = warpgroup_mma_init(acc_t)
        else:
            acc = warpgroup_mma(p_smem, kv_buf, acc_t, is_async=True)
        # dequantise the next tile into the other slot while p @ v runs
        buf = 1 - buf
        if PREFETCH:  # the block-table entries of the tile after next fly during the dequantisation
            if ABLATE & 16:  # no block table: the positions themselves as slots (one dependent load fewer)
                slot_n = idx_nn
                if DIRECT:
                    slot_rn = idx_rnn
            else:
                slot_n = _idx_slots(block_table_ptr, seq, bt_stride, idx_nn, PAGE)
                if DIRECT:
                    slot_rn = _idx_slots(block_table_ptr, seq, bt_stride, idx_rnn, PAGE)
        if L2_AHEAD > 0:
            slot_pf = _idx_slots(block_table_ptr, seq, bt_stride, idx_pf, PAGE)
        _stage_tile(raw, sc, kr, kv_smem.index(buf), kr_smem.index(buf), RANK, BLOCK_K, F16)
        valid = valid_n
    _finish(acc, m_i, l_i, out_ptr, lse_ptr, row, head0, split, n_heads, RANK, BLOCK_H, SPLIT, S_L, O_L)




@gluon.jit
def _copy_rows_fp8(slot, slot_r, nope_ptr, nscale_ptr, rope_ptr, raw_dst, sc_dst, kr_dst, RANK: gl.constexpr,
                   ROPE: gl.constexpr, GROUP: gl.constexpr, L3: gl.constexpr, RL: gl.constexpr):
    """cp.async (no registers) of one tile's gathered cache rows into the staging buffers: e4m3 rows [BLOCK_K,
    RANK / 16, 16] (16-byte copies, L3), their group scales repeated per 16 columns [BLOCK_K, RANK / 16] (4-byte
    copies) and the bf16 rope rows [BLOCK_K, ROPE] (RL); slots -1 = none, zero-filled. Each thread later reads back
    exactly the elements it copied (the same layouts), so its own ``cp.wait_group`` makes them visible to it."""
    nope_p, nope_m = _nope_ptrs(slot, nope_ptr, RANK, L3)
    cp.async_copy_global_to_shared(raw_dst, nope_p, mask=nope_m)
    sc_p, sc_m = _scale_ptrs(slot, nscale_ptr, RANK, GROUP, L3)
    cp.async_copy_global_to_shared(sc_dst, sc_p, mask=sc_m)
    rope_p, rope_m = _rope_ptrs(slot_r, rope_ptr, ROPE, RL)
    cp.async_copy_global_to_shared(kr_dst, rope_p, mask=rope_m)


@gluon.jit
def sparse_mla_gluon_cp_kernel(qn_ptr, qr_ptr, nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, seq_ptr, idx_ptr,
                               out_ptr, lse_ptr, n_heads, topk, positions_per_split, bt_stride, scale_log2,
                               RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr, BLOCK_H: gl.constexpr,
                               BLOCK_K: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
                               F16: gl.constexpr = False):
    """``sparse_mla_gluon_kernel``'s arithmetic (same grid, arguments and outputs; F16 as there) with the gathers two
    tiles ahead through shared memory: the cache rows of tile t + 2 are copied by cp.async into a staging buffer
    (e4m3 rows, scales, rope rows: 48 KB) right after tile t + 1's were read out of it, so each row has a whole step
    to arrive without holding registers. To make room there is one dequantised slot, not two (q 64 KB + q_rope 8 +
    slot 72 + p 8 + staging 48 = 200 KB): the dequantisation of tile t + 1 waits for p @ v of tile t instead of
    running under it. 8 warps, 64 heads."""
    gl.static_assert(BLOCK_H == 64)
    row = gl.program_id(0).to(gl.int64)
    head0 = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [8, 1, 1], [2, 1, 0])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_K // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, RANK // 2, 16])
    VL: gl.constexpr = gl.SliceLayout(0, S_L)
    SL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    RS: gl.constexpr = gl.SliceLayout(1, RL)
    q_smem, qr_smem, kv_smem, kr_smem, p_smem = _allocate(RANK, ROPE, BLOCK_H, BLOCK_K, F16, 1)
    kv_buf = kv_smem.index(0)
    kr_buf = kr_smem.index(0)
    flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    raw_st = gl.allocate_shared_memory(nope_ptr.dtype.element_ty, [BLOCK_K, RANK // 16, 16], flat3)
    sc_st = gl.allocate_shared_memory(gl.float32, [BLOCK_K, RANK // 16], flat2)
    kr_st = gl.allocate_shared_memory(rope_ptr.dtype.element_ty, [BLOCK_K, ROPE], flat2)

    _load_q(qn_ptr, qr_ptr, q_smem, qr_smem, row, head0, n_heads, RANK, ROPE, BLOCK_H, QL, RL)
    seq = gl.load(seq_ptr + row).to(gl.int64)
    first = split * positions_per_split
    last = gl.minimum(first + positions_per_split, topk)
    # tile 0 through registers into the slot; tile 1 copied into the staging buffer; the slots of tile 2
    slot, slot_r = _ws_slots(idx_ptr, block_table_ptr, row, seq, first, last, topk, bt_stride, BLOCK_K, PAGE, L3, RL)
    raw, sc, kr, valid = _gather_rows(slot, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL, VL, slot_r,
                                      _tile_idx(idx_ptr, row, first, last, topk, BLOCK_K, VL), True)
    slot, slot_r = _ws_slots(idx_ptr, block_table_ptr, row, seq, first + BLOCK_K, last, topk, bt_stride, BLOCK_K,
                             PAGE, L3, RL)
    _copy_rows_fp8(slot, slot_r, nope_ptr, nscale_ptr, rope_ptr, raw_st, sc_st, kr_st, RANK, ROPE, GROUP, L3, RL)
    cp.commit_group()
    _stage_tile(raw, sc, kr, kv_buf, kr_buf, RANK, BLOCK_K, F16)
    slot, slot_r = _ws_slots(idx_ptr, block_table_ptr, row, seq, first + 2 * BLOCK_K, last, topk, bt_stride, BLOCK_K,
                             PAGE, L3, RL)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, RANK], gl.float32, layout=O_L)
    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=S_L)
    for k0 in range(first, last, BLOCK_K):
        s = warpgroup_mma(qr_smem, kr_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_smem, kv_buf.permute((1, 0)), s, is_async=True)
        idx_nn = _tile_idx(idx_ptr, row, k0 + 3 * BLOCK_K, last, topk, BLOCK_K, SL)
        idx_rnn = _tile_idx(idx_ptr, row, k0 + 3 * BLOCK_K, last, topk, BLOCK_K, RS)
        valid_n = _tile_idx(idx_ptr, row, k0 + BLOCK_K, last, topk, BLOCK_K, VL) >= 0
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i, _ = _online_softmax(s, valid, m_i, l_i, scale_log2)
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = warpgroup_mma(p_smem, kv_buf, acc, is_async=True)
        # tile t + 1 out of the staging buffer (this thread's own copies) while p @ v runs
        cp.wait_group(0)
        raw = raw_st.load(L3)
        sc = sc_st.load(gl.SliceLayout(2, L3))
        kr = kr_st.load(RL)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # both warpgroups' p @ v done reading the slot; every staging read done
        _copy_rows_fp8(slot, slot_r, nope_ptr, nscale_ptr, rope_ptr, raw_st, sc_st, kr_st, RANK, ROPE, GROUP, L3, RL)
        cp.commit_group()
        slot = _idx_slots(block_table_ptr, seq, bt_stride, idx_nn, PAGE)
        slot_r = _idx_slots(block_table_ptr, seq, bt_stride, idx_rnn, PAGE)
        _stage_tile(raw, sc, kr, kv_buf, kr_buf, RANK, BLOCK_K, F16)
        valid = valid_n
    cp.wait_group(0)
    _finish(acc, m_i, l_i, out_ptr, lse_ptr, row, head0, split, n_heads, RANK, BLOCK_H, SPLIT, S_L, O_L)


@gluon.jit
def _copy_tile_bf16(base, idx_c, idx_r, nope_ptr, rope_ptr, kv_dst, kr_dst, RANK: gl.constexpr, ROPE: gl.constexpr,
                    CL: gl.constexpr, RL: gl.constexpr):
    """cp.async (16-byte copies, no registers) of one tile's bf16 rows of a dense latent (row ``base + position``)
    into a ring slot: the latent [BLOCK_K, RANK] with positions ``idx_c`` (SliceLayout(1, CL)) and the rope rows
    [BLOCK_K, ROPE] with ``idx_r`` (SliceLayout(1, RL)); -1 = none, zero-filled (the copy's source size 0)."""
    rows_c = base + idx_c.to(gl.int64)
    cols = gl.arange(0, RANK, layout=gl.SliceLayout(0, CL))
    cp.async_copy_global_to_shared(kv_dst, nope_ptr + gl.expand_dims(rows_c * RANK, 1) + gl.expand_dims(cols, 0),
                                   mask=gl.expand_dims(idx_c >= 0, 1))
    rows_r = base + idx_r.to(gl.int64)
    rc = gl.arange(0, ROPE, layout=gl.SliceLayout(0, RL))
    cp.async_copy_global_to_shared(kr_dst, rope_ptr + gl.expand_dims(rows_r * ROPE, 1) + gl.expand_dims(rc, 0),
                                   mask=gl.expand_dims(idx_r >= 0, 1))


@gluon.jit
def sparse_mla_gluon_bf16_kernel(qn_ptr, qr_ptr, nope_ptr, rope_ptr, seq_ptr, idx_ptr, out_ptr, lse_ptr, n_heads,
                                 topk, positions_per_split, seq_rows, scale_log2, RANK: gl.constexpr,
                                 ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                                 SPLIT: gl.constexpr, HEAD_BLOCKS: gl.constexpr,
                                 HEADS_INNER: gl.constexpr = True, EARLY_WAIT: gl.constexpr = False,
                                 DEFER_SUM: gl.constexpr = False, COPY_ROWS4: gl.constexpr = False):
    """``sparse_mla_gluon_kernel``'s arithmetic over a dense bf16 latent (``sparse_mla.upconvert_latent``'s: sequence
    s's position p is row ``s * seq_rows + p`` of ``nope_ptr`` [., RANK] and ``rope_ptr`` [., ROPE]), for prefill.
    The same tiles, ring, MMA shapes and softmax, so the same values where the bf16 rows are the fp8 kernel's
    dequantised ones; what differs is how a tile reaches its ring slot and the step's order. No block table, no
    registers and no dequantisation: at the top of step t the rows of tile t + 1 go into the other slot as cp.async
    copies (16 bytes each, -1 positions zero-filled), which land while tile t's q.k, softmax and p @ v run; the step
    ends waiting for them (wait_group, fence, barrier). Both MMAs are waited for inside their step: with p @ v in
    flight across the loop's back edge ptxas serialises every wgmma of the loop (C7515: it reuses the q.k
    accumulator's registers for addresses while p @ v runs). 8 warps, one program an SM (224 KB of shared
    memory, as the fp8 kernel).

    EARLY_WAIT: each thread waits for its copies before the barrier that publishes p (they have had the q.k and the
    softmax to land), and the step's closing wait and barrier go: warpgroup w's copies write only the latent columns
    its own p @ v read, which it waited for, and the rope rows were last read by a q.k that ended before that
    barrier; p itself is rewritten only after the next softmax's cross-warp reductions, which wait for both
    warpgroups.

    COPY_ROWS4 (not with EARLY_WAIT): the latent copies in a layout of 4 rows a thread instead of 16 (4 position loads
    and row addresses a tile instead of 16), whose columns are not split by warpgroup.

    DEFER_SUM: the softmax's row sums are kept as an elementwise [64, BLOCK_K] running sum (l * alpha + p, 16 FMA a
    thread) and reduced once at the end, so a tile takes one cross-warp reduction (the max) instead of two. The sums
    then add in another order than the fp8 kernel's: within the kernel-vs-twin tolerance, not bit-equal to it."""
    gl.static_assert(BLOCK_H == 64)
    # a row's head blocks are neighbours in launch order (program_id(0) = row * HEAD_BLOCKS + block), so they run
    # together and the second reads the row's gathered rows from L2
    if HEADS_INNER:
        row = (gl.program_id(0) // HEAD_BLOCKS).to(gl.int64)
        head0 = (gl.program_id(0) % HEAD_BLOCKS) * BLOCK_H
    else:  # row-major (the fp8 kernel's order): program_id(0) = block * rows + row
        n_rows = gl.num_programs(0) // HEAD_BLOCKS
        row = (gl.program_id(0) % n_rows).to(gl.int64)
        head0 = (gl.program_id(0) // n_rows) * BLOCK_H
    split = gl.program_id(2)
    WG: gl.constexpr = 2
    if COPY_ROWS4:  # 4 rows a thread (fewer position loads and row addresses), columns interleaved across warpgroups
        gl.static_assert(not EARLY_WAIT)
        CL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, WG], [1, 0])
    else:  # warps 0-3 (warpgroup 0) copy columns 0 .. RANK / 2, warps 4-7 the rest (warp order dim 0 first)
        CL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, WG], [0, 1])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # bf16 rows of 64
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # bf16 rows of 512
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, BLOCK_K // WG, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, RANK // WG, 16])
    VL: gl.constexpr = gl.SliceLayout(0, S_L)
    CS: gl.constexpr = gl.SliceLayout(1, CL)
    RS: gl.constexpr = gl.SliceLayout(1, RL)
    q_smem, qr_smem, kv_smem, kr_smem, p_smem = _allocate(RANK, ROPE, BLOCK_H, BLOCK_K)

    seq = gl.load(seq_ptr + row).to(gl.int64)
    base = seq * seq_rows
    first = split * positions_per_split
    last = gl.minimum(first + positions_per_split, topk)
    _copy_tile_bf16(base, _tile_idx(idx_ptr, row, first, last, topk, BLOCK_K, CS),
                    _tile_idx(idx_ptr, row, first, last, topk, BLOCK_K, RS), nope_ptr, rope_ptr, kv_smem.index(0),
                    kr_smem.index(0), RANK, ROPE, CL, RL)
    cp.commit_group()
    _load_q(qn_ptr, qr_ptr, q_smem, qr_smem, row, head0, n_heads, RANK, ROPE, BLOCK_H, QL, RL)
    valid = _tile_idx(idx_ptr, row, first, last, topk, BLOCK_K, VL) >= 0
    idx_c = _tile_idx(idx_ptr, row, first + BLOCK_K, last, topk, BLOCK_K, CS)
    idx_r = _tile_idx(idx_ptr, row, first + BLOCK_K, last, topk, BLOCK_K, RS)
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    l_acc = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=S_L)  # DEFER_SUM: the row sums' elementwise parts
    acc = gl.zeros([BLOCK_H, RANK], gl.float32, layout=O_L)
    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=S_L)
    buf = 0
    for k0 in range(first, last, BLOCK_K):
        kv_buf = kv_smem.index(buf)
        # the next tile into the other slot (free: its MMAs were waited for before the last step's barrier)
        _copy_tile_bf16(base, idx_c, idx_r, nope_ptr, rope_ptr, kv_smem.index(1 - buf), kr_smem.index(1 - buf),
                        RANK, ROPE, CL, RL)
        cp.commit_group()
        s = warpgroup_mma(qr_smem, kr_smem.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_smem, kv_buf.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        valid_n = _tile_idx(idx_ptr, row, k0 + BLOCK_K, last, topk, BLOCK_K, VL) >= 0
        idx_c = _tile_idx(idx_ptr, row, k0 + 2 * BLOCK_K, last, topk, BLOCK_K, CS)
        idx_r = _tile_idx(idx_ptr, row, k0 + 2 * BLOCK_K, last, topk, BLOCK_K, RS)
        p, alpha, m_i, l_i, rescale = _online_softmax(s, valid, m_i, l_i, scale_log2, 0.0, not DEFER_SUM)
        if DEFER_SUM:
            l_acc = l_acc * gl.expand_dims(alpha, 1) + p
        if EARLY_WAIT:  # the next tile's rows landed (this thread's copies; the barrier below: everyone's)
            cp.wait_group(0)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = warpgroup_mma(p_smem, kv_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if not EARLY_WAIT:
            cp.wait_group(0)  # the next tile's rows landed (every thread's copies: the barrier)
            fence_async_shared()
            gl.thread_barrier()
        buf = 1 - buf
        valid = valid_n
    if DEFER_SUM:
        l_i = gl.sum(l_acc, axis=1)
    _finish(acc, m_i, l_i, out_ptr, lse_ptr, row, head0, split, n_heads, RANK, BLOCK_H, SPLIT, S_L, O_L)


@gluon.jit
def _ws_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride, RB: gl.constexpr, PAGE: gl.constexpr,
              L3: gl.constexpr, RL: gl.constexpr):
    """Cache slots of positions k0 .. k0 + RB (-1 = none) in the gathers' two row layouts (e4m3 rows, rope rows)."""
    SL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    RS: gl.constexpr = gl.SliceLayout(1, RL)
    slot = _idx_slots(block_table_ptr, seq, bt_stride, _tile_idx(idx_ptr, row, k0, last, topk, RB, SL), PAGE)
    slot_r = _idx_slots(block_table_ptr, seq, bt_stride, _tile_idx(idx_ptr, row, k0, last, topk, RB, RS), PAGE)
    return slot, slot_r


@gluon.jit
def _ws_tile_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride, RB: gl.constexpr,
                   PAGE: gl.constexpr, L3: gl.constexpr, RL: gl.constexpr):
    """``_ws_slots`` of the four RB-row blocks of the tile at k0 (block b: positions k0 + b * RB ..)."""
    s0, r0 = _ws_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride, RB, PAGE, L3, RL)
    s1, r1 = _ws_slots(idx_ptr, block_table_ptr, row, seq, k0 + RB, last, topk, bt_stride, RB, PAGE, L3, RL)
    s2, r2 = _ws_slots(idx_ptr, block_table_ptr, row, seq, k0 + 2 * RB, last, topk, bt_stride, RB, PAGE, L3, RL)
    s3, r3 = _ws_slots(idx_ptr, block_table_ptr, row, seq, k0 + 3 * RB, last, topk, bt_stride, RB, PAGE, L3, RL)
    return s0, r0, s1, r1, s2, r2, s3, r3


@gluon.jit
def _ws_gather(slot, slot_r, nope_ptr, nscale_ptr, rope_ptr, RANK: gl.constexpr, ROPE: gl.constexpr,
               GROUP: gl.constexpr, L3: gl.constexpr, RL: gl.constexpr):
    """Issue the loads of RB gathered rows (e4m3 [RB, RANK / 16, 16], fp32 scales [RB, RANK / 16], bf16 rope
    [RB, ROPE]); rows without a slot read as zeros."""
    nope_p, nope_m = _nope_ptrs(slot, nope_ptr, RANK, L3)
    raw = gl.load(nope_p, mask=nope_m, other=0.0)
    sc_p, sc_m = _scale_ptrs(slot, nscale_ptr, RANK, GROUP, L3)
    sc = gl.load(sc_p, mask=sc_m, other=0.0)
    rope_p, rope_m = _rope_ptrs(slot_r, rope_ptr, ROPE, RL)
    return raw, sc, gl.load(rope_p, mask=rope_m, other=0.0)


@gluon.jit
def _ws_stage_tile(raw0, sc0, kr0, raw1, sc1, kr1, raw2, sc2, kr2, raw3, sc3, kr3, kv_buf, kr_buf, RANK: gl.constexpr,
                   RB: gl.constexpr, F16: gl.constexpr = False):
    """A whole tile's four gathered blocks dequantised into its ring slot (``_dequant_rows``' F16)."""
    _dequant_rows(raw0, sc0, kr0, kv_buf.slice(0, RB), kr_buf.slice(0, RB), RANK, RB, F16)
    _dequant_rows(raw1, sc1, kr1, kv_buf.slice(RB, RB), kr_buf.slice(RB, RB), RANK, RB, F16)
    _dequant_rows(raw2, sc2, kr2, kv_buf.slice(2 * RB, RB), kr_buf.slice(2 * RB, RB), RANK, RB, F16)
    _dequant_rows(raw3, sc3, kr3, kv_buf.slice(3 * RB, RB), kr_buf.slice(3 * RB, RB), RANK, RB, F16)


@gluon.jit
def _ws_producer(nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, idx_ptr, kv_smem, kr_smem, ready, empty, row, seq,
                 first, n_tiles, last, topk, bt_stride, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                 BLOCK_K: gl.constexpr, PAGE: gl.constexpr, PWARPS: gl.constexpr, F16: gl.constexpr = False):
    """The producer partition (PWARPS warps) of ``sparse_mla_gluon_ws_kernel`` without PAIR: each tile in four
    blocks of BLOCK_K / 4 rows (gathered e4m3 rows, fp32 scales, bf16 rope rows), all four issued at the top of
    the tile's step (their cache slots looked up one tile ahead), then dequantised into the tile's ring slot once
    it is empty, then the slot's ``ready`` barrier signalled."""
    RB: gl.constexpr = BLOCK_K // 4
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [PWARPS, 1, 1], [2, 1, 0])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PWARPS, 1], [1, 0])
    s0, r0, s1, r1, s2, r2, s3, r3 = _ws_tile_slots(idx_ptr, block_table_ptr, row, seq, first, last, topk, bt_stride,
                                                     RB, PAGE, L3, RL)
    for t in range(n_tiles):
        buf = t % 2
        raw0, sc0, kr0 = _ws_gather(s0, r0, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        raw1, sc1, kr1 = _ws_gather(s1, r1, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        raw2, sc2, kr2 = _ws_gather(s2, r2, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        raw3, sc3, kr3 = _ws_gather(s3, r3, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        kn = first + (t + 1) * BLOCK_K
        s0, r0, s1, r1, s2, r2, s3, r3 = _ws_tile_slots(idx_ptr, block_table_ptr, row, seq, kn, last, topk, bt_stride,
                                                         RB, PAGE, L3, RL)
        mbarrier.wait(empty.index(buf), ((t // 2) & 1) ^ 1)
        _ws_stage_tile(raw0, sc0, kr0, raw1, sc1, kr1, raw2, sc2, kr2, raw3, sc3, kr3, kv_smem.index(buf),
                       kr_smem.index(buf), RANK, RB, F16)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(buf), count=1)


@gluon.jit
def _ws_producer_pair(nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, idx_ptr, kv_smem, kr_smem, ready, empty, row,
                      seq, first, n_tiles, last, topk, bt_stride, RANK: gl.constexpr, ROPE: gl.constexpr,
                      GROUP: gl.constexpr, BLOCK_K: gl.constexpr, PAGE: gl.constexpr, PWARPS: gl.constexpr,
                      F16: gl.constexpr = False):
    """The producer of ``sparse_mla_gluon_ws_kernel`` with PAIR: tiles two at a step (t0 = 2u into slot 0, t1 into
    slot 1). The first tile's four blocks are issued at the top of the step; each block of the second tile is issued
    as soon as the same block of the first is stored, so the second tile's loads fly while the first is
    dequantised (no gathered data is carried across steps: the loop carries only cache slots)."""
    RB: gl.constexpr = BLOCK_K // 4
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [PWARPS, 1, 1], [2, 1, 0])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PWARPS, 1], [1, 0])
    s0, r0, s1, r1, s2, r2, s3, r3 = _ws_tile_slots(idx_ptr, block_table_ptr, row, seq, first, last, topk, bt_stride,
                                                     RB, PAGE, L3, RL)
    for u in range(gl.cdiv(n_tiles, 2)):
        phase = u & 1
        k1 = first + (2 * u + 1) * BLOCK_K
        raw0, sc0, kr0 = _ws_gather(s0, r0, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        raw1, sc1, kr1 = _ws_gather(s1, r1, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        raw2, sc2, kr2 = _ws_gather(s2, r2, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        raw3, sc3, kr3 = _ws_gather(s3, r3, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        # cache slots of the second tile (positions past ``last`` give -1: masked loads, no traffic)
        s0, r0, s1, r1, s2, r2, s3, r3 = _ws_tile_slots(idx_ptr, block_table_ptr, row, seq, k1, last, topk, bt_stride,
                                                         RB, PAGE, L3, RL)
        mbarrier.wait(empty.index(0), phase ^ 1)
        kv_buf = kv_smem.index(0)
        kr_buf = kr_smem.index(0)
        _dequant_rows(raw0, sc0, kr0, kv_buf.slice(0, RB), kr_buf.slice(0, RB), RANK, RB, F16)
        raw0, sc0, kr0 = _ws_gather(s0, r0, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        _dequant_rows(raw1, sc1, kr1, kv_buf.slice(RB, RB), kr_buf.slice(RB, RB), RANK, RB, F16)
        raw1, sc1, kr1 = _ws_gather(s1, r1, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        _dequant_rows(raw2, sc2, kr2, kv_buf.slice(2 * RB, RB), kr_buf.slice(2 * RB, RB), RANK, RB, F16)
        raw2, sc2, kr2 = _ws_gather(s2, r2, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        _dequant_rows(raw3, sc3, kr3, kv_buf.slice(3 * RB, RB), kr_buf.slice(3 * RB, RB), RANK, RB, F16)
        raw3, sc3, kr3 = _ws_gather(s3, r3, nope_ptr, nscale_ptr, rope_ptr, RANK, ROPE, GROUP, L3, RL)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(0), count=1)
        # cache slots of the next step's first tile, read while the second tile is dequantised
        k2 = k1 + BLOCK_K
        s0, r0, s1, r1, s2, r2, s3, r3 = _ws_tile_slots(idx_ptr, block_table_ptr, row, seq, k2, last, topk, bt_stride,
                                                         RB, PAGE, L3, RL)
        if 2 * u + 1 < n_tiles:
            mbarrier.wait(empty.index(1), phase ^ 1)
            _ws_stage_tile(raw0, sc0, kr0, raw1, sc1, kr1, raw2, sc2, kr2, raw3, sc3, kr3, kv_smem.index(1),
                           kr_smem.index(1), RANK, RB, F16)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(1), count=1)


@gluon.jit
def _ws_consumer(q_smem, qr_smem, kv_smem, kr_smem, p_smem, ready, empty, idx_ptr, out_ptr, lse_ptr, row, head0,
                 split, n_heads, first, n_tiles, last, topk, scale_log2, RANK: gl.constexpr, BLOCK_H: gl.constexpr,
                 BLOCK_K: gl.constexpr, SPLIT: gl.constexpr, PV_WAIT: gl.constexpr):
    """Default partition (8 warps = 2 warpgroups splitting the MMA N side, as ``sparse_mla_gluon_kernel``): per
    tile, wait for its ring slot, issue q.k, wait for p @ v of the tile before and hand that slot back to the
    producer, then the online softmax and p @ v (asynchronous); the normalised output and log2-sum-exp at the end."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_K // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, RANK // 2, 16])
    VL: gl.constexpr = gl.SliceLayout(0, S_L)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, RANK], gl.float32, layout=O_L))
    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=S_L)
    for t in range(n_tiles):
        buf = t % 2
        idx_v = _tile_idx(idx_ptr, row, first + t * BLOCK_K, last, topk, BLOCK_K, VL)
        mbarrier.wait(ready.index(buf), (t // 2) & 1)
        s = warpgroup_mma(qr_smem, kr_smem.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_smem, kv_smem.index(buf).permute((1, 0)), s, is_async=True)
        # q.k of this tile and p @ v of the one before (its slot is then free). Waiting for p @ v alone first
        # (num_outstanding=1) would free the slot earlier but makes ptxas serialise every wgmma (C7514: "non
        # wgmma instructions reading accumulator registers"); as written ptxas still serialises them (C7515:
        # "... defining accumulator registers ..."), which the single-partition kernel does not have
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(1 - buf), count=1, pred=t > 0)
        p, alpha, m_i, l_i, _ = _online_softmax(s, idx_v >= 0, m_i, l_i, scale_log2)
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = warpgroup_mma(p_smem, kv_smem.index(buf), acc, is_async=True)
        if PV_WAIT:  # p @ v done inside its step: no wgmma in flight across the loop's back edge
            acc = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(acc,)))
    _finish(acc, m_i, l_i, out_ptr, lse_ptr, row, head0, split, n_heads, RANK, BLOCK_H, SPLIT, S_L, O_L)


@gluon.jit
def sparse_mla_gluon_ws_kernel(qn_ptr, qr_ptr, nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, seq_ptr, idx_ptr,
                               out_ptr, lse_ptr, n_heads, topk, positions_per_split, bt_stride, scale_log2,
                               RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr, BLOCK_H: gl.constexpr,
                               BLOCK_K: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
                               PWARPS: gl.constexpr, PREGS: gl.constexpr, PAIR: gl.constexpr,
                               PV_WAIT: gl.constexpr = False, F16: gl.constexpr = False):
    """Warp-specialised form of ``sparse_mla_gluon_kernel`` (same grid, arguments, outputs and arithmetic): a
    producer partition of PWARPS warps (PREGS registers a thread) gathers and dequantises each tile into the two-slot
    ring while the 8 warps of the default partition run q.k, the softmax and p @ v. The two sides meet at an mbarrier
    pair per slot (``ready``: dequantised; ``empty``: p @ v done reading it), so the gathers and the dequantisation
    leave the MMA chain that bounds the single-partition kernel (benchmarks/NEXT_CALL.md, sparse MLA decode)."""
    gl.static_assert(BLOCK_H == 64)
    row = gl.program_id(0).to(gl.int64)
    head0 = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    q_smem, qr_smem, kv_smem, kr_smem, p_smem = _allocate(RANK, ROPE, BLOCK_H, BLOCK_K, F16)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    _load_q(qn_ptr, qr_ptr, q_smem, qr_smem, row, head0, n_heads, RANK, ROPE, BLOCK_H, QL, RL)
    fence_async_shared()
    gl.thread_barrier()

    seq = gl.load(seq_ptr + row).to(gl.int64)
    first = split * positions_per_split
    last = gl.minimum(first + positions_per_split, topk)
    n_tiles = gl.cdiv(gl.maximum(last - first, 0), BLOCK_K)
    if PAIR:
        gl.warp_specialize([
            (_ws_consumer, (q_smem, qr_smem, kv_smem, kr_smem, p_smem, ready, empty, idx_ptr, out_ptr, lse_ptr, row,
                            head0, split, n_heads, first, n_tiles, last, topk, scale_log2, RANK, BLOCK_H, BLOCK_K,
                            SPLIT, PV_WAIT)),
            (_ws_producer_pair, (nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, idx_ptr, kv_smem, kr_smem, ready,
                                 empty, row, seq, first, n_tiles, last, topk, bt_stride, RANK, ROPE, GROUP, BLOCK_K,
                                 PAGE, PWARPS, F16)),
        ], [PWARPS], [PREGS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (q_smem, qr_smem, kv_smem, kr_smem, p_smem, ready, empty, idx_ptr, out_ptr, lse_ptr, row,
                            head0, split, n_heads, first, n_tiles, last, topk, scale_log2, RANK, BLOCK_H, BLOCK_K,
                            SPLIT, PV_WAIT)),
            (_ws_producer, (nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, idx_ptr, kv_smem, kr_smem, ready, empty,
                            row, seq, first, n_tiles, last, topk, bt_stride, RANK, ROPE, GROUP, BLOCK_K, PAGE, PWARPS,
                            F16)),
        ], [PWARPS], [PREGS])

GLUON_BLOCK_H = 64


def gluon_supported(q_nope: torch.Tensor, latent_scale: torch.Tensor | None) -> bool:
    """Whether this kernel can take the call: a CUDA device of capability 9.x, an e4m3 latent of rank 512 in
    four scale groups (the DeepSeek-V3.2 cache), rope 64."""
    if latent_scale is None or q_nope.device.type != "cuda" or q_nope.shape[-1] != 512:
        return False
    return is_sm90(q_nope.device) and latent_scale.shape[-1] == 4


# Kernel flags ``launch`` passes unless the call names them (``sparse_mla(..., gluon={"DIRECT": False})``):
# EARLY_LOADS issues the next tile's gathers before this tile's q.k; DIRECT reads the rope rows' slots and the
# softmax validity in their own layouts (4 fewer barriers a tile, 12 more loads). H200, call 2 of
# benchmarks/gpu-2026-12-01-dsa-s4-mla: DIRECT 134.6 us against 141.3 at decode batch 64 x 128K and 7.75 against
# 8.14 ms on the last 4096 prefill rows; EARLY_LOADS 147.0 us (slower), with DIRECT 136.8.
# L2_AHEAD (0 = off): the cache rows of the tile that many steps ahead are prefetched into L2; measured slower in the
# closing call (benchmarks/gpu-2026-12-01-dsa-s4-final, 564516d): decode 144.6 / 144.9 us at 2 / 4 against 137.5,
# prefill rows 8.34 / 8.40 ms against 7.81.
# LAZY (0 = off, else the threshold in log2 units, 8.0 as FlashAttention-4): the lazy rescale of
# ``sparse_mla_gluon_kernel`` (its docstring). Slower, so off: benchmarks/gpu-2026-12-02-dsa-s11 (422ab57), TAU 8 at
# batch 64 x 128K 141.8 / 142.3 us against 136.1 / 133.9, 4096 prefill rows 8.18 / 8.19 ms against 7.73 / 7.74.
# F16: the MMAs in fp16 instead of bf16 (q, q_rope, the dequantised tile and p rounded to fp16; fp32 accumulators as
# before): the tile's dequantisation becomes one e4m3x2 -> f16x2 conversion and one HMUL2 per two elements, against
# the conversion, two widenings, two FMUL and a pack (the sm_90 loop 1,006 instructions a thread a tile against
# 1,226). Not bit-equal to the twin's bf16 tile: fp16 keeps 3 more mantissa bits (relative error against float64 at
# batch 64 x 128K 1.69e-3 against 2.65e-3), and q and the latent must stay within fp16's range (65504). No faster:
# H200, 2026-12-03 (benchmarks/gpu-2026-12-03-dsa-s20), batch 64 x 128K 135.4-138.8 us against 133.1-137.8 over five
# calls in turns, 4096 prefill rows 7.77 against 7.66-7.71 ms. So off: the tile's arithmetic is not what bounds it.
# GATHER_ROWS (``sparse_mla_gluon_kernel``'s docstring): 8 takes the ring slot's 8-way bank conflicts away (Nsight
# Compute) but ran slower, 148.8-149.1 us against 133.1-136.5 (4: 163.7; with F16 137.6 against 135.4), so 1.
GLUON_FLAGS = {"EARLY_LOADS": False, "DIRECT": True, "L2_AHEAD": 0, "WARPS": 8, "LAZY": 0.0, "F16": False,
               "GATHER_ROWS": 1}
# CP: ``sparse_mla_gluon_cp_kernel`` instead (the gathers two tiles ahead by cp.async into a staging buffer, one
# dequantised slot). Bit-equal to the default and slower, so off: H200, 2026-12-03 (benchmarks/gpu-2026-12-03-dsa-s20,
# call 8), batch 64 x 128K 173.6 / 177.0 us (with F16 168.9 / 167.9) against 137.4 / 137.3, 4096 prefill rows 9.99 /
# 10.02 ms against 7.75 / 7.70: the dequantisation after p @ v, not under it, costs more than the gathers' wait.
CP_FLAGS = {"CP": False}
# Programmatic dependent launch for ``sparse_mla_gluon_kernel`` where ``pdl.active`` (the decode chain's other kernels
# take it there since session 10): the kernel launches while the select ends and waits for it in hardware. Bit-equal
# and slower, so off: H200, 2026-12-02 (benchmarks/gpu-2026-12-02-dsa-s14, call 2, five rounds in turn), the batch-1
# step in a graph of 8 layers 40.92-41.65 us a layer against 38.28-39.79 without.
GLUON_PDL = False
# WS: ``sparse_mla_gluon_ws_kernel`` instead (a producer partition of PWARPS warps with PREGS registers a thread
# gathers and dequantises; MAXNREG caps the launch so that 8 + PWARPS warps fit one SM's 64K registers: the
# default partition gets (MAXNREG * (8 + PWARPS) - PREGS * PWARPS) / 8 a thread). PAIR: the producer takes tiles
# two at a step; PV_WAIT: the consumers wait for p @ v inside its step (else ptxas serialises their wgmmas).
# Measured slower than the single-partition kernel on the H200 (benchmarks/gpu-2026-12-01-dsa-s9): batch 64 x 128K
# 146.8-149.7 us (PV_WAIT 153.8-156.1, PAIR 175-188) against 134.4-141.4; WARPS 16: 201-203 us. Off by default.
# With F16 (session 20, benchmarks/gpu-2026-12-03-dsa-s20, call 2) slower still: PAIR 196.8 us (bf16 175.7), single
# tiles with a 96- or 112-register producer (the consumers then without spills) 278.7-291.8.
WS_FLAGS = {"WS": False, "PWARPS": 4, "PREGS": 152, "MAXNREG": 168, "PAIR": True, "PV_WAIT": False}


def launch(q_nope, q_rope, latent_nope, latent_scale, latent_rope, block_table, token_seq, indices, softmax_scale,
           partial, lse, splits: int, positions_per_split: int, block_k: int = 64, prefetch: bool = True,
           flags: dict | None = None, ablate: int = 0) -> None:
    """Launch ``sparse_mla_gluon_kernel`` (with the WS flag ``sparse_mla_gluon_ws_kernel``, with CP
    ``sparse_mla_gluon_cp_kernel``) on grid (rows, heads / 64, splits): ``partial``/``lse`` as
    ``sparse_mla.sparse_mla`` allocates them (the bf16 output itself when splits == 1); ``flags`` override
    ``GLUON_FLAGS``, ``WS_FLAGS`` and ``CP_FLAGS``. ``ablate``: the kernel's ABLATE (timing probes only: a
    non-zero value gives a wrong output; ``sparse_mla`` never passes it)."""
    known = {**GLUON_FLAGS, **WS_FLAGS, **CP_FLAGS}
    unknown = set(flags or {}) - set(known)
    if unknown:
        raise ValueError(f"unknown Gluon kernel flags {sorted(unknown)}; known: {sorted(known)}")
    opts = {**known, **(flags or {})}
    if opts["WS"] and opts["LAZY"]:
        raise ValueError("the Gluon flag LAZY applies to the single-partition kernel only; drop WS or LAZY")
    n_rows, n_heads, rank = q_nope.shape
    topk = indices.shape[1]
    grid = (n_rows, triton.cdiv(n_heads, GLUON_BLOCK_H), splits)
    args = (q_nope.contiguous(), q_rope.contiguous(), latent_nope, latent_scale, latent_rope, block_table,
            token_seq.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous(), partial, lse,
            n_heads, topk, positions_per_split, block_table.stride(0), softmax_scale * math.log2(math.e))
    shape = dict(RANK=rank, ROPE=q_rope.shape[-1], GROUP=rank // latent_scale.shape[-1], BLOCK_H=GLUON_BLOCK_H,
                 BLOCK_K=block_k, PAGE=PAGE_SIZE, SPLIT=splits > 1)
    if opts["CP"]:
        if opts["WS"] or opts["LAZY"] or opts["L2_AHEAD"] or opts["EARLY_LOADS"] or opts["WARPS"] != 8 or ablate:
            raise ValueError("the Gluon flag CP takes only F16 besides it (no WS, LAZY, L2_AHEAD, EARLY_LOADS, "
                             "WARPS other than 8, or ablate)")
        sparse_mla_gluon_cp_kernel[grid](*args, **shape, F16=opts["F16"], num_warps=8)
    elif opts["WS"]:
        sparse_mla_gluon_ws_kernel[grid](*args, **shape, PWARPS=opts["PWARPS"], PREGS=opts["PREGS"],
                                         PAIR=opts["PAIR"], PV_WAIT=opts["PV_WAIT"], F16=opts["F16"], num_warps=8,
                                         maxnreg=opts["MAXNREG"])
    else:
        chain = pdl.launch_options(q_nope.device) if GLUON_PDL else {}
        sparse_mla_gluon_kernel[grid](*args, **shape, PREFETCH=prefetch, ABLATE=ablate,
                                      **{k: opts[k] for k in GLUON_FLAGS}, num_warps=opts["WARPS"], **chain)


# ``sparse_mla_gluon_bf16_kernel``'s EARLY_WAIT by default. H200, 2026-12-03, commit 3546204
# (benchmarks/gpu-2026-12-03-dsa-s16, call 2): the 128K prefill's attention 204.7-205.8 ms against 208.8-209.8 without,
# three rounds in turn, bit-equal.
BF16_EARLY_WAIT = True
# DEFER_SUM by default. H200, 2026-12-03, commit 7b780f2 (benchmarks/gpu-2026-12-03-dsa-s16, call 3): the 128K
# prefill's attention 198.7 / 200.3 ms against 206.4 / 206.9 with EARLY_WAIT alone (two rounds in turn); relative error
# against the twin on 256 rows 0.0020858, as before to 5 digits; the prefill acceptance case 414.6 against 422.0 ms.
BF16_DEFER_SUM = True
# COPY_ROWS4 by default (it turns EARLY_WAIT off). H200, 2026-12-03, commit 132e8e3 (benchmarks/gpu-2026-12-03-dsa-s16,
# call 5): the 128K prefill's attention 193.9 / 194.6 ms against 197.0 / 196.8 with EARLY_WAIT (two rounds in turn),
# bit-equal; the sm_90 loop 615 instructions a thread a tile against 754.
BF16_COPY_ROWS4 = True


def bf16_flags(early_wait: bool | None = None, defer_sum: bool | None = None,
               copy_rows4: bool | None = None) -> dict:
    """The options ``launch_bf16`` gives ``sparse_mla_gluon_bf16_kernel``: the named ones, else the ``BF16_*``
    defaults; COPY_ROWS4 turns EARLY_WAIT off."""
    copy_rows4 = BF16_COPY_ROWS4 if copy_rows4 is None else copy_rows4
    return {"early_wait": (BF16_EARLY_WAIT if early_wait is None else early_wait) and not copy_rows4,
            "defer_sum": BF16_DEFER_SUM if defer_sum is None else defer_sum, "copy_rows4": copy_rows4}


def launch_bf16(q_nope, q_rope, dense_nope, dense_rope, seq_rows, token_seq, indices, softmax_scale, partial, lse,
                splits: int, positions_per_split: int, block_k: int = 64, heads_inner: bool = True,
                early_wait: bool | None = None, defer_sum: bool | None = None, copy_rows4: bool | None = None) -> None:
    """Launch ``sparse_mla_gluon_bf16_kernel`` on grid (rows x heads / 64, 1, splits) over a dense bf16 latent
    (``sparse_mla.upconvert_latent``: ``dense_nope`` [sequences * seq_rows, RANK], ``dense_rope`` [., ROPE]);
    ``partial`` / ``lse`` as for ``launch``. ``heads_inner`` False: a row's head blocks as far apart in launch order
    as the fp8 kernel's grid puts them (a probe of what the L2 sharing gives). ``early_wait``: the kernel's
    EARLY_WAIT (None: ``BF16_EARLY_WAIT``); ``defer_sum``: its DEFER_SUM (None: ``BF16_DEFER_SUM``); ``copy_rows4``:
    its COPY_ROWS4 (None: ``BF16_COPY_ROWS4``; it turns EARLY_WAIT off)."""
    n_rows, n_heads, rank = q_nope.shape
    head_blocks = triton.cdiv(n_heads, GLUON_BLOCK_H)
    flags = bf16_flags(early_wait, defer_sum, copy_rows4)
    sparse_mla_gluon_bf16_kernel[(n_rows * head_blocks, 1, splits)](
        q_nope.contiguous(), q_rope.contiguous(), dense_nope, dense_rope, token_seq.to(torch.int32).contiguous(),
        indices.to(torch.int32).contiguous(), partial, lse, n_heads, indices.shape[1], positions_per_split, seq_rows,
        softmax_scale * math.log2(math.e), RANK=rank, ROPE=q_rope.shape[-1], BLOCK_H=GLUON_BLOCK_H, BLOCK_K=block_k,
        SPLIT=splits > 1, HEAD_BLOCKS=head_blocks, HEADS_INNER=heads_inner,
        EARLY_WAIT=flags["early_wait"], DEFER_SUM=flags["defer_sum"], COPY_ROWS4=flags["copy_rows4"], num_warps=8)
