"""Gluon (Hopper, sm_90) form of the DSA indexer's stacked prefill scoring (``dsa._index_scores_kernel``).

Same arithmetic as the Triton tile (twin ``dsa.index_scores_torch``): one query tile of ROWS consecutive rows of
one sequence, its ROWS x BLOCK_H heads stacked as the N side of one FP8 wgmma per 64-key tile (keys on the M
side, HEAD_DIM = K), then the fp32 epilogue ``kscale[s] * sum_h w[t, h] * ReLU(logit)`` per (key, row) and the
causal -inf mask. What differs is the schedule, which Triton 3.6's ``tl`` cannot express:

- the query stack [ROWS * BLOCK_H, HEAD_DIM] e4m3 sits in shared memory for the whole program (the B operand);
- key tiles (one block-table entry each: a 64-key tile is one page, 8 KB of e4m3 at HEAD_DIM 128) stream
  through a NUM_STAGES-deep shared-memory ring by cp.async (16-byte copies, 4 per thread at 4 warps);
- the wgmma of tile j is issued asynchronously into one accumulator while the epilogue of tile j - 1 runs on
  the other (``warpgroup_mma_wait(num_outstanding=1)``): MMA and ReLU / weight sum overlap inside a program.

The row-split form (``_index_scores_gluon_rows_kernel``) issues one wgmma of N = BLOCK_H per query row instead,
each overlapped with the epilogue of the (tile, row) before it: half-size accumulators, 117 registers, 4 programs
per SM like the tl tile.

Measured on an H200 (2026-12-01, benchmarks/gpu-2026-12-01-dsa-s4-indexer): both forms match the tl kernel
exactly at DeepSeek shapes; over all 128K rows of a prefill they ran at 499-719 TFLOP/s against the tl tile's
737-739 (the row-split one capped at 96 registers, 5 programs per SM, was best, and 1.5% faster than tl on the
last 4096 rows only), so they stay opt-in (``dsa.PREFILL_GLUON``).

The multi-warpgroup form (``_index_scores_gluon_wg_kernel``, 2026-12-03) runs 2-row tiles on sm_90 with one warpgroup,
its carried second-row epilogue and TMA key pages (``dsa.PREFILL_WG_*``; benchmarks/gpu-2026-12-03-dsa-s17): bit-equal
to the tl kernel, 834-910 TFLOP/s over all 128K rows against 705-738.

The warp-specialised form (``_index_scores_gluon_ws_kernel``, session 18) is the sm_90 default: 4-row tiles (or 8)
on a warpgroup every 2 rows, each warpgroup the wg kernel's loop, all of them on one TMA key ring that the default
partition refills once the workers hand a stage back (an ``empty`` mbarrier). A key page serves 4 rows. The board
runs this work at its 700 W cap, and the page's L2 read and TMA copy are shared by twice the FLOPs: 919-948 TFLOP/s
over all rows against 864-901 for the wg kernel (``dsa.PREFILL_WS_ROWS``; benchmarks/gpu-2026-12-03-dsa-s18).

Gluon does not run under TRITON_INTERPRET; ``dsa.index_scores`` dispatches here only on a CUDA device of
capability 9.x when ``gluon=True`` (the CPU interpreter path stays the ``tl`` kernel). Shapes supported:
BLOCK_S = 64 keys per tile = one wgmma M of one warpgroup (num_warps 4), PAGE a multiple of BLOCK_S, HEAD_DIM a
multiple of 32 (the e4m3 wgmma K step), ROWS * BLOCK_H <= 256 (the wgmma N limit).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from adapt.kernels.formats import is_sm90

GLUON_WARPS = 4  # one warpgroup: the 64-key tile is one wgmma M


@gluon.constexpr_function
def _smem_layout(head_dim):
    """NVMMA shared layout of e4m3 rows of ``head_dim`` bytes: the widest swizzle a row fills (128 B at 128)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, head_dim), element_bitwidth=8, rank=2)


@gluon.constexpr_function
def _copy_layout(head_dim, warps):
    """Blocked layout for 16-byte copies of [rows, head_dim] e4m3: head_dim / 16 threads along a row."""
    along = min(32, head_dim // 16)
    return gl.BlockedLayout([1, 16], [32 // along, along], [warps, 1], [1, 0])


@gluon.jit
def _issue_key_tile(k_ptr, block_table_ptr, seq, bt_stride, kt, buf, HEAD_DIM: gl.constexpr,
                    BLOCK_S: gl.constexpr, PAGE: gl.constexpr, load_layout: gl.constexpr):
    """cp.async of key tile ``kt`` (BLOCK_S contiguous e4m3 rows of one page, [BLOCK_S, HEAD_DIM]) into ``buf``."""
    page = gl.load(block_table_ptr + seq * bt_stride + (kt * BLOCK_S) // PAGE).to(gl.int64)
    first = page * PAGE + (kt * BLOCK_S) % PAGE
    rows = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, load_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    cp.async_copy_global_to_shared(buf, k_ptr + (first + rows)[:, None] * HEAD_DIM + cols[None, :])


@gluon.jit
def _program_range(tiles_ptr, limit_ptr, out_cols, tiles_per_split, BLOCK_S: gl.constexpr,
                   EMPTY_TILES: gl.constexpr = False):
    """This program's query tile (first row, rows, sequence, keys its last row sees) and key tiles: [first, last)
    of its split, of which [first, live) hold visible keys."""
    tile = gl.program_id(0)
    row0 = gl.load(tiles_ptr + tile * 3)
    n_rows = gl.load(tiles_ptr + tile * 3 + 1)
    seq = gl.load(tiles_ptr + tile * 3 + 2).to(gl.int64)
    first = gl.program_id(1) * tiles_per_split
    last = gl.minimum(first + tiles_per_split, gl.cdiv(out_cols, BLOCK_S))
    if EMPTY_TILES:  # an empty tile (a padded table's, ``dsa.prefill_query_tiles``) has no key tiles
        tile_limit = gl.load(limit_ptr + row0 + n_rows - 1, mask=n_rows > 0, other=0)
        last = gl.where(n_rows > 0, last, first)
    else:
        tile_limit = gl.load(limit_ptr + row0 + n_rows - 1)
    live = gl.minimum(last, gl.cdiv(tile_limit, BLOCK_S))
    return row0, n_rows, seq, tile_limit, first, last, live


@gluon.jit
def _start_ring(k_ptr, block_table_ptr, seq, bt_stride, first, live, HEAD_DIM: gl.constexpr, BLOCK_S: gl.constexpr,
                PAGE: gl.constexpr, NUM_STAGES: gl.constexpr, smem_layout: gl.constexpr, load_layout: gl.constexpr):
    """The key ring [NUM_STAGES, BLOCK_S, HEAD_DIM] e4m3 in shared memory with its first NUM_STAGES tiles in flight
    (one commit group per stage, empty past ``live``)."""
    ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_S, HEAD_DIM], smem_layout)
    for s in gl.static_range(NUM_STAGES):
        if first + s < live:
            _issue_key_tile(k_ptr, block_table_ptr, seq, bt_stride, first + s, ring.index(s), HEAD_DIM, BLOCK_S,
                            PAGE, load_layout)
        cp.commit_group()
    fence_async_shared()
    return ring


@gluon.jit
def _mma_tile(ring, q_t, zero, i, NUM_STAGES: gl.constexpr):
    """Wait for the copies of the ``i``-th key tile of the program (every thread's; NUM_STAGES groups are in
    flight, the oldest is tile i), then issue its wgmma
    [BLOCK_S, HEAD_DIM] x [HEAD_DIM, N] asynchronously; returns the accumulator token."""
    cp.wait_group(NUM_STAGES - 1)
    fence_async_shared()
    gl.thread_barrier()
    return warpgroup_mma(ring.index(i % NUM_STAGES), q_t, zero, use_acc=False, is_async=True)


@gluon.jit
def _refill(k_ptr, block_table_ptr, seq, bt_stride, kt, first, live, ring, HEAD_DIM: gl.constexpr,
            BLOCK_S: gl.constexpr, PAGE: gl.constexpr, NUM_STAGES: gl.constexpr, load_layout: gl.constexpr):
    """After the MMA of tile kt - 1 completed: copy tile kt - 1 + NUM_STAGES into its stage (one commit group,
    empty past ``live``, so that group counts stay uniform: the ring holds NUM_STAGES tiles)."""
    nxt = kt + NUM_STAGES - 1
    if nxt < live:
        _issue_key_tile(k_ptr, block_table_ptr, seq, bt_stride, nxt, ring.index((nxt - first) % NUM_STAGES),
                        HEAD_DIM, BLOCK_S, PAGE, load_layout)
    cp.commit_group()


@gluon.jit
def _tile_epilogue(logits, kt, w_all, w_reg, ks_ptr, block_table_ptr, seq, bt_stride, tile_limit, row_limits, out_rows,
                   row_ok, out_cols, out_ptr, BLOCK_S: gl.constexpr, ROWS: gl.constexpr, BLOCK_H: gl.constexpr,
                   PAGE: gl.constexpr, mma_layout: gl.constexpr, out_layout: gl.constexpr, W_SMEM: gl.constexpr):
    """Scores [BLOCK_S, ROWS] of one key tile from its fp32 logits [BLOCK_S, ROWS * BLOCK_H]: the tl tile's
    epilogue (ReLU, x w, sum over the heads of each row, x kscale, -inf past each row's limit), then stored."""
    if W_SMEM:  # re-read after the wgmma issue: keeps ptxas from hoisting this epilogue above it
        w = w_all.load(gl.SliceLayout(0, mma_layout))
    else:
        w = w_reg
    weighted = gl.maximum(logits, 0.0) * w[None, :]  # ReLU applied twice to a carried tile: the same value
    score = gl.sum(gl.reshape(weighted, [BLOCK_S, ROWS, BLOCK_H]), axis=2)
    score = gl.convert_layout(score, out_layout)
    pos = kt * BLOCK_S + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, out_layout))
    page = gl.load(block_table_ptr + seq * bt_stride + (kt * BLOCK_S) // PAGE).to(gl.int64)
    kscale = gl.load(ks_ptr + page * PAGE + pos % PAGE, mask=pos < tile_limit, other=0.0)
    score = score * kscale[:, None]
    score = gl.where(pos[:, None] < row_limits[None, :], score, float("-inf"))
    gl.store(out_ptr + out_rows[None, :] + pos[:, None], score, mask=row_ok[None, :] & (pos[:, None] < out_cols))


@gluon.jit
def _index_scores_gluon_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, block_table_ptr, limit_ptr, tiles_ptr, out_ptr,
                               n_heads, bt_stride, out_stride, out_cols, tiles_per_split,
                               HEAD_DIM: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_S: gl.constexpr,
                               ROWS: gl.constexpr, PAGE: gl.constexpr, NUM_STAGES: gl.constexpr,
                               W_SMEM: gl.constexpr = True):
    """One program: query tile ``program_id(0)`` of ``tiles_ptr`` (first row, rows, sequence) against the key tiles
    of split ``program_id(1)``; the grid, tile table and output are those of ``dsa._index_scores_kernel``."""
    N: gl.constexpr = ROWS * BLOCK_H
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, N, 32])
    smem_layout: gl.constexpr = _smem_layout(HEAD_DIM)
    load_layout: gl.constexpr = _copy_layout(HEAD_DIM, 4)
    out_layout: gl.constexpr = gl.BlockedLayout([1, ROWS], [32, 1], [4, 1], [0, 1])
    vec_layout: gl.constexpr = gl.SliceLayout(0, out_layout)

    row0, n_rows, seq, tile_limit, first, last, live = _program_range(tiles_ptr, limit_ptr, out_cols,
                                                                       tiles_per_split, BLOCK_S)

    # the stacked query [ROWS * BLOCK_H, HEAD_DIM] (rows past n_rows and heads past n_heads read as 0) and weights
    stack = gl.arange(0, N, layout=gl.SliceLayout(1, load_layout))
    s_ok = (stack % BLOCK_H < n_heads) & (stack // BLOCK_H < n_rows)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    q_off = ((row0 + stack // BLOCK_H).to(gl.int64) * n_heads + stack % BLOCK_H) * HEAD_DIM
    q_all = gl.load(q_ptr + q_off[:, None] + dims[None, :], mask=s_ok[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, HEAD_DIM], smem_layout, q_all)
    q_t = q_smem.permute((1, 0))  # [HEAD_DIM, N], K-major as e4m3 wgmma needs
    wcol = gl.arange(0, N, layout=gl.SliceLayout(0, mma_layout))
    w_ok = (wcol % BLOCK_H < n_heads) & (wcol // BLOCK_H < n_rows)
    w_reg = gl.load(w_ptr + (row0 + wcol // BLOCK_H).to(gl.int64) * n_heads + wcol % BLOCK_H, mask=w_ok, other=0.0)
    w_all = gl.allocate_shared_memory(gl.float32, [N], gl.SwizzledSharedLayout(1, 1, 1, [0]), w_reg)
    tile_rows = gl.arange(0, ROWS, layout=vec_layout)
    row_ok = tile_rows < n_rows
    row_limits = gl.load(limit_ptr + row0 + tile_rows, mask=row_ok, other=0)
    out_rows = (row0 + tile_rows).to(gl.int64) * out_stride

    ring = _start_ring(k_ptr, block_table_ptr, seq, bt_stride, first, live, HEAD_DIM, BLOCK_S, PAGE, NUM_STAGES,
                       smem_layout, load_layout)

    # Two accumulators in fixed registers (the loop takes two key tiles per trip; a carried swap would cost 64
    # register moves per tile): the MMA of one tile runs while the epilogue of the tile before it does, and is
    # waited for only after that epilogue. An odd tile count ends with an MMA over a stale stage whose result is
    # never read. No wgmma is in flight across the loop's back edge (ptxas serialises every wgmma otherwise,
    # C7514), so the carried accumulator is a finished tensor.
    zero = gl.zeros([BLOCK_S, N], gl.float32, layout=mma_layout)
    done_b = zero
    for kt in range(first, live, 2):
        acc_a = _mma_tile(ring, q_t, zero, kt - first, NUM_STAGES)
        # unconditional (a branch here makes ptxas wait for the MMA above first, C7517): the first trip has no
        # tile before it and stores nothing
        _tile_epilogue(done_b, gl.maximum(kt - 1, first), w_all, w_reg, ks_ptr, block_table_ptr, seq, bt_stride,
                       tile_limit, row_limits, out_rows, row_ok & (kt > first), out_cols, out_ptr, BLOCK_S, ROWS,
                       BLOCK_H, PAGE, mma_layout, out_layout, W_SMEM)
        done_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, ))  # tile kt done: refill tile kt - 1's stage
        _refill(k_ptr, block_table_ptr, seq, bt_stride, kt + 1, first, live, ring, HEAD_DIM, BLOCK_S, PAGE,
                NUM_STAGES, load_layout)
        acc_b = _mma_tile(ring, q_t, zero, kt + 1 - first, NUM_STAGES)
        _tile_epilogue(done_a, kt, w_all, w_reg, ks_ptr, block_table_ptr, seq, bt_stride, tile_limit, row_limits,
                       out_rows, row_ok, out_cols, out_ptr, BLOCK_S, ROWS, BLOCK_H, PAGE, mma_layout, out_layout,
                       W_SMEM)
        # ReLU now, in the registers the next trip's epilogue reads (a read of wgmma-written registers carried
        # over the back edge makes ptxas wait for the next wgmma first, C7517)
        done_b = gl.maximum(warpgroup_mma_wait(num_outstanding=0, deps=(acc_b, )), 0.0)
        _refill(k_ptr, block_table_ptr, seq, bt_stride, kt + 2, first, live, ring, HEAD_DIM, BLOCK_S, PAGE,
                NUM_STAGES, load_layout)
    if (live > first) & ((live - first) % 2 == 0):
        _tile_epilogue(done_b, live - 1, w_all, w_reg, ks_ptr, block_table_ptr, seq, bt_stride, tile_limit,
                       row_limits, out_rows, row_ok, out_cols, out_ptr, BLOCK_S, ROWS, BLOCK_H, PAGE, mma_layout,
                       out_layout, W_SMEM)
    cp.wait_group(0)

    # key tiles of this split past the query tile's last visible key: -inf
    for kt in range(gl.maximum(first, live), last):
        pos = kt * BLOCK_S + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, out_layout))
        gl.store(out_ptr + out_rows[None, :] + pos[:, None],
                 gl.full([BLOCK_S, ROWS], float("-inf"), gl.float32, layout=out_layout),
                 mask=row_ok[None, :] & (pos[:, None] < out_cols))


@gluon.jit
def _row_epilogue(logits, kt, r, w_rows, ks_ptr, block_table_ptr, seq, bt_stride, tile_limit, limit_ptr, row0, n_rows,
                  out_stride, out_cols, out_ptr, valid, BLOCK_S: gl.constexpr, PAGE: gl.constexpr,
                  mma_layout: gl.constexpr, ROWS: gl.constexpr):
    """Scores [BLOCK_S] of key tile ``kt`` for row ``r`` of the query tile from its fp32 logits [BLOCK_S, BLOCK_H]
    (ReLU'd or not: ReLU again is the same value): the tl tile's epilogue for one row, stored when ``valid``."""
    w = w_rows.slice(r * w_rows.shape[0] // ROWS, w_rows.shape[0] // ROWS).load(gl.SliceLayout(0, mma_layout))
    score = gl.sum(gl.maximum(logits, 0.0) * w[None, :], axis=1)
    pos = kt * BLOCK_S + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, mma_layout))
    page = gl.load(block_table_ptr + seq * bt_stride + (kt * BLOCK_S) // PAGE).to(gl.int64)
    kscale = gl.load(ks_ptr + page * PAGE + pos % PAGE, mask=pos < tile_limit, other=0.0)
    ok = valid & (r < n_rows)
    limit = gl.load(limit_ptr + row0 + r, mask=ok, other=0)
    score = gl.where(pos < limit, score * kscale, float("-inf"))
    gl.store(out_ptr + (row0 + r).to(gl.int64) * out_stride + pos, score, mask=ok & (pos < out_cols))


@gluon.jit
def _index_scores_gluon_rows_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, block_table_ptr, limit_ptr, tiles_ptr, out_ptr,
                                    n_heads, bt_stride, out_stride, out_cols, tiles_per_split,
                                    HEAD_DIM: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_S: gl.constexpr,
                                    ROWS: gl.constexpr, PAGE: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The row-split form of ``_index_scores_gluon_kernel`` (same grid, tiles, arithmetic and output): one wgmma
    of N = BLOCK_H per query row and key tile, each overlapped with the epilogue of the (tile, row) before it.
    The accumulators are [BLOCK_S, BLOCK_H] (32 registers at 64 heads, against 64 per stacked [BLOCK_S, 2 x 64]),
    so the program fits in 128 registers: 4 programs per SM, as the tl tile."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_H, 32])
    smem_layout: gl.constexpr = _smem_layout(HEAD_DIM)
    load_layout: gl.constexpr = _copy_layout(HEAD_DIM, 4)

    row0, n_rows, seq, tile_limit, first, last, live = _program_range(tiles_ptr, limit_ptr, out_cols,
                                                                       tiles_per_split, BLOCK_S)

    # q of each row [BLOCK_H, HEAD_DIM] (heads past n_heads and rows past n_rows read as 0) and the weights
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, load_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    q_rows = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, BLOCK_H, HEAD_DIM], smem_layout)
    w_rows = gl.allocate_shared_memory(gl.float32, [ROWS * BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    wh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, mma_layout))
    for r in gl.static_range(ROWS):
        row = (row0 + r).to(gl.int64)
        q_off = (row * n_heads + heads) * HEAD_DIM
        q_rows.index(r).store(gl.load(q_ptr + q_off[:, None] + dims[None, :],
                                      mask=((heads < n_heads) & (r < n_rows))[:, None], other=0.0))
        w_rows.slice(r * BLOCK_H, BLOCK_H).store(gl.load(w_ptr + row * n_heads + wh, mask=(wh < n_heads) & (r < n_rows),
                                                         other=0.0))

    ring = _start_ring(k_ptr, block_table_ptr, seq, bt_stride, first, live, HEAD_DIM, BLOCK_S, PAGE, NUM_STAGES,
                       smem_layout, load_layout)

    zero = gl.zeros([BLOCK_S, BLOCK_H], gl.float32, layout=mma_layout)
    prev = zero  # ReLU'd logits of (tile kt - 1, row ROWS - 1): carried as a finished, non-wgmma tensor (C7517)
    for kt in range(first, live):
        stage = ring.index((kt - first) % NUM_STAGES)
        cp.wait_group(NUM_STAGES - 1)
        fence_async_shared()
        gl.thread_barrier()
        for r in gl.static_range(ROWS):
            acc = warpgroup_mma(stage, q_rows.index(r).permute((1, 0)), zero, use_acc=False, is_async=True)
            if r == 0:  # (kt - 1, ROWS - 1); nothing on the first trip
                _row_epilogue(prev, gl.maximum(kt - 1, first), ROWS - 1, w_rows, ks_ptr, block_table_ptr, seq,
                              bt_stride, tile_limit, limit_ptr, row0, n_rows, out_stride, out_cols, out_ptr,
                              kt > first, BLOCK_S, PAGE, mma_layout, ROWS)
            else:
                _row_epilogue(prev, kt, r - 1, w_rows, ks_ptr, block_table_ptr, seq, bt_stride, tile_limit,
                              limit_ptr, row0, n_rows, out_stride, out_cols, out_ptr, True, BLOCK_S, PAGE,
                              mma_layout, ROWS)
            prev = gl.maximum(warpgroup_mma_wait(num_outstanding=0, deps=(acc, )), 0.0)
        _refill(k_ptr, block_table_ptr, seq, bt_stride, kt + 1, first, live, ring, HEAD_DIM, BLOCK_S, PAGE,
                NUM_STAGES, load_layout)
    if live > first:
        _row_epilogue(prev, live - 1, ROWS - 1, w_rows, ks_ptr, block_table_ptr, seq, bt_stride, tile_limit,
                      limit_ptr, row0, n_rows, out_stride, out_cols, out_ptr, True, BLOCK_S, PAGE, mma_layout,
                      ROWS)
    cp.wait_group(0)

    for kt in range(gl.maximum(first, live), last):  # tiles past the query tile's last visible key: -inf
        pos = kt * BLOCK_S + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, mma_layout))
        for r in gl.static_range(ROWS):
            gl.store(out_ptr + (row0 + r).to(gl.int64) * out_stride + pos,
                     gl.full([BLOCK_S], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_layout)),
                     mask=(r < n_rows) & (pos < out_cols))


@gluon.constexpr_function
def _wg_copy_layout(head_dim, warps):
    """Blocked layout for 16-byte copies of [16 * warps, head_dim] e4m3 in which warp w writes rows [16 w, 16 w + 16)
    (4 rows a thread), so that each warpgroup copies exactly the 64 rows its own wgmma reads."""
    along = min(8, head_dim // 16)
    return gl.BlockedLayout([max(1, along // 2), 16], [32 // along, along], [warps, 1], [1, 0])


@gluon.jit
def _issue_wg_keys(k_ptr, block_table_ptr, seq, bt_stride, kt, kv_end, in_page, buf, HEAD_DIM: gl.constexpr,
                   BLOCK_S: gl.constexpr, PAGE: gl.constexpr, load_layout: gl.constexpr):
    """cp.async of key tile ``kt`` ([BLOCK_S, HEAD_DIM] e4m3, BLOCK_S / PAGE whole pages through the block table)
    into ``buf``; ``in_page``: each element's offset inside its page (the same for every tile); pages at or past
    ``kv_end`` (the sequence's allocated keys) are not read."""
    if BLOCK_S == PAGE:  # one page: a uniform block-table read, no mask (tiles below ``live`` are allocated)
        page = gl.load(block_table_ptr + seq * bt_stride + kt).to(gl.int64)
        cp.async_copy_global_to_shared(buf, k_ptr + page * (PAGE * HEAD_DIM) + in_page)
    else:
        rows = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, load_layout))
        ok = kt * BLOCK_S + rows < kv_end
        page = gl.load(block_table_ptr + seq * bt_stride + kt * (BLOCK_S // PAGE) + rows // PAGE, mask=ok, other=0)
        cp.async_copy_global_to_shared(buf, k_ptr + page.to(gl.int64)[:, None] * (PAGE * HEAD_DIM) + in_page,
                                       mask=ok[:, None])


@gluon.jit
def _tma_key_page(k_desc, block_table_ptr, seq, bt_stride, kt, buf, bar, BLOCK_S: gl.constexpr,
                  HEAD_DIM: gl.constexpr):
    """TMA of key tile ``kt`` (one whole page of BLOCK_S keys) into ``buf``, completing ``bar``."""
    page = gl.load(block_table_ptr + seq * bt_stride + kt)
    mbarrier.expect(bar, BLOCK_S * HEAD_DIM)
    tma.async_copy_global_to_shared(k_desc, [page * BLOCK_S, 0], bar, buf)


@gluon.jit
def _wg_row_epilogue(logits, w, kscale, pos, limit, out_row, store_ok, out_cols):
    """One query row's scores over the tile: sum over heads of ReLU(logit) x w, x kscale, -inf at and past the row's
    limit; stored where ``store_ok`` and inside the output."""
    score = gl.sum(gl.maximum(logits, 0.0) * w[None, :], axis=1)
    score = gl.where(pos < limit, score * kscale, float("-inf"))
    gl.store(out_row + pos, score, mask=store_ok & (pos < out_cols))


@gluon.jit
def _index_scores_gluon_wg_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, block_table_ptr, limit_ptr, tiles_ptr, out_ptr,
                                  n_heads, bt_stride, out_stride, out_cols, tiles_per_split, k_desc,
                                  HEAD_DIM: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_S: gl.constexpr,
                                  PAGE: gl.constexpr, NUM_STAGES: gl.constexpr, WARPS: gl.constexpr,
                                  CARRY: gl.constexpr = False, TMA: gl.constexpr = False,
                                  REG_A: gl.constexpr = False):
    """The multi-warpgroup form (``launch(..., warpgroups=G)``): 2-row query tiles against key tiles of
    BLOCK_S = 64 G keys, one warpgroup a 64-key slice (keys on the wgmma M side). Each row is its own N = BLOCK_H
    bank: both banks' wgmmas are issued together and row 0's epilogue runs while row 1's MMA does. The head
    weights stay in registers; the per-key scale is loaded once a tile for both rows; each warpgroup copies the
    rows its own wgmma reads. Same grid, tile table, arithmetic and output as ``_index_scores_gluon_kernel``
    (key tiles of BLOCK_S). CARRY: row 1's epilogue of a tile runs after the next tile's wgmmas are issued (its
    ReLU'd logits carried over the back edge as a finished tensor), so both rows' epilogues run under an MMA.
    TMA (one warpgroup, one-page tiles): the key pages come by TMA (``k_desc``: the cache as [pages * PAGE,
    HEAD_DIM]) on one mbarrier a stage instead of per-thread cp.async. REG_A: the key tile is read from shared
    memory into registers once (ldmatrix) and is both wgmmas' A operand (the MMAs then read only the query rows
    from shared memory: 16 of the 24 KB a tile)."""
    gl.static_assert(BLOCK_S == 16 * WARPS)
    if TMA:
        gl.static_assert(BLOCK_S == PAGE)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_H, 32])
    smem_layout: gl.constexpr = _smem_layout(HEAD_DIM)
    load_layout: gl.constexpr = _wg_copy_layout(HEAD_DIM, WARPS)
    q_layout: gl.constexpr = _copy_layout(HEAD_DIM, WARPS)
    key_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    head_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)

    row0, n_rows, seq, tile_limit, first, last, live = _program_range(tiles_ptr, limit_ptr, out_cols,
                                                                       tiles_per_split, BLOCK_S, True)
    kv_end = gl.cdiv(tile_limit, PAGE) * PAGE  # keys of the pages the last row sees

    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q_rows = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_H, HEAD_DIM], smem_layout)
    wh = gl.arange(0, BLOCK_H, layout=head_layout)
    q_off = (row0.to(gl.int64) * n_heads + heads) * HEAD_DIM
    q_rows.index(0).store(gl.load(q_ptr + q_off[:, None] + dims[None, :],
                                  mask=((heads < n_heads) & (n_rows > 0))[:, None], other=0.0))
    q_rows.index(1).store(gl.load(q_ptr + q_off[:, None] + n_heads * HEAD_DIM + dims[None, :],
                                  mask=((heads < n_heads) & (n_rows > 1))[:, None], other=0.0))
    w0 = gl.load(w_ptr + row0.to(gl.int64) * n_heads + wh, mask=(wh < n_heads) & (n_rows > 0), other=0.0)
    w1 = gl.load(w_ptr + (row0 + 1).to(gl.int64) * n_heads + wh, mask=(wh < n_heads) & (n_rows > 1), other=0.0)
    limit0 = gl.load(limit_ptr + row0, mask=n_rows > 0, other=0)
    limit1 = gl.load(limit_ptr + row0 + 1, mask=n_rows > 1, other=0)
    out0 = out_ptr + row0.to(gl.int64) * out_stride
    out1 = out0 + out_stride
    q0_t = q_rows.index(0).permute((1, 0))
    q1_t = q_rows.index(1).permute((1, 0))

    ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_S, HEAD_DIM], smem_layout)
    copy_rows = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, load_layout))
    copy_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    in_page = (copy_rows % PAGE)[:, None] * HEAD_DIM + copy_cols[None, :]
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    if TMA:
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
        fence_async_shared()
        for s in gl.static_range(NUM_STAGES):
            if first + s < live:
                _tma_key_page(k_desc, block_table_ptr, seq, bt_stride, first + s, ring.index(s), ready.index(s),
                              BLOCK_S, HEAD_DIM)
    else:
        for s in gl.static_range(NUM_STAGES):
            if first + s < live:
                _issue_wg_keys(k_ptr, block_table_ptr, seq, bt_stride, first + s, kv_end, in_page, ring.index(s),
                               HEAD_DIM, BLOCK_S, PAGE, load_layout)
            cp.commit_group()
        fence_async_shared()

    zero = gl.zeros([BLOCK_S, BLOCK_H], gl.float32, layout=mma_layout)
    keys = gl.arange(0, BLOCK_S, layout=key_layout)
    prev1 = zero  # CARRY: row 1's ReLU'd logits of the tile before, its scale and positions
    prev_scale = gl.zeros([BLOCK_S], gl.float32, layout=key_layout)
    prev_pos = keys
    for kt in range(first, live):
        stage = ring.index((kt - first) % NUM_STAGES)
        if TMA:
            mbarrier.wait(ready.index((kt - first) % NUM_STAGES), ((kt - first) // NUM_STAGES) & 1)
        else:
            cp.wait_group(NUM_STAGES - 1)
            fence_async_shared()
            gl.thread_barrier()
        if REG_A:
            key_regs = stage.load(a_layout)
            acc0 = warpgroup_mma(key_regs, q0_t, zero, use_acc=False, is_async=True)
            acc1 = warpgroup_mma(key_regs, q1_t, zero, use_acc=False, is_async=True)
        else:
            acc0 = warpgroup_mma(stage, q0_t, zero, use_acc=False, is_async=True)
            acc1 = warpgroup_mma(stage, q1_t, zero, use_acc=False, is_async=True)
        pos = kt * BLOCK_S + keys
        key_ok = pos < tile_limit
        if BLOCK_S == PAGE:
            kscale = gl.load(ks_ptr + gl.load(block_table_ptr + seq * bt_stride + kt).to(gl.int64) * PAGE + keys,
                             mask=key_ok, other=0.0)
        else:
            page = gl.load(block_table_ptr + seq * bt_stride + kt * (BLOCK_S // PAGE) + keys // PAGE, mask=key_ok,
                           other=0)
            kscale = gl.load(ks_ptr + page.to(gl.int64) * PAGE + keys % PAGE, mask=key_ok, other=0.0)
        if CARRY:  # unconditional (nothing stored on the first trip): a branch here waits for the wgmmas first
            _wg_row_epilogue(prev1, w1, prev_scale, prev_pos, limit1, out1, (n_rows > 1) & (kt > first), out_cols)
        logits0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
        _wg_row_epilogue(logits0, w0, kscale, pos, limit0, out0, n_rows > 0, out_cols)
        logits1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
        # both wgmmas of this warpgroup are done with the stage: refill it (this warpgroup's rows only)
        nxt = kt + NUM_STAGES
        if TMA:
            gl.thread_barrier()  # every warp's wgmma reads of the stage are done before one thread refills it
            if nxt < live:
                _tma_key_page(k_desc, block_table_ptr, seq, bt_stride, nxt, stage,
                              ready.index((kt - first) % NUM_STAGES), BLOCK_S, HEAD_DIM)
        else:
            if nxt < live:
                _issue_wg_keys(k_ptr, block_table_ptr, seq, bt_stride, nxt, kv_end, in_page, stage, HEAD_DIM,
                               BLOCK_S, PAGE, load_layout)
            cp.commit_group()
        if CARRY:  # ReLU now: the carried registers are no longer wgmma-written (C7517 otherwise)
            prev1 = gl.maximum(logits1, 0.0)
            prev_scale = kscale
            prev_pos = pos
        else:
            _wg_row_epilogue(logits1, w1, kscale, pos, limit1, out1, n_rows > 1, out_cols)
    if CARRY:
        if live > first:
            _wg_row_epilogue(prev1, w1, prev_scale, prev_pos, limit1, out1, n_rows > 1, out_cols)
    if not TMA:
        cp.wait_group(0)

    for kt in range(gl.maximum(first, live), last):  # tiles past the query tile's last visible key: -inf
        pos = kt * BLOCK_S + gl.arange(0, BLOCK_S, layout=key_layout)
        inf = gl.full([BLOCK_S], float("-inf"), gl.float32, layout=key_layout)
        gl.store(out0 + pos, inf, mask=pos < out_cols)
        gl.store(out1 + pos, inf, mask=(pos < out_cols) & (n_rows > 1))


@gluon.jit
def _ws_rows(ROW_OFF: gl.constexpr, PRODUCER: gl.constexpr, shared, HEAD_DIM: gl.constexpr, BLOCK_H: gl.constexpr,
             BLOCK_S: gl.constexpr, NUM_STAGES: gl.constexpr, CARRY: gl.constexpr):
    """One warpgroup of ``_index_scores_gluon_ws_kernel``: rows ROW_OFF and ROW_OFF + 1 of the tile against every
    key page of the shared ring, as ``_index_scores_gluon_wg_kernel`` runs its 2 rows (a bank a row, CARRY).
    PRODUCER: this warpgroup refills each stage by TMA once the others have handed it back (``empty``); the others
    hand each stage back after their two wgmmas read it. ``shared``: what every partition gets (the shared-memory
    buffers and barriers, the pointers and the program's tile and key range)."""
    (q_rows, ring, ready, empty, k_desc, w_ptr, ks_ptr, block_table_ptr, limit_ptr, out_ptr, seq, bt_stride, row0,
     n_rows, n_heads, out_stride, out_cols, tile_limit, first, last, live) = shared
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_H, 32])
    key_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    head_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    ra = row0 + ROW_OFF
    ok0 = n_rows > ROW_OFF
    ok1 = n_rows > ROW_OFF + 1
    wh = gl.arange(0, BLOCK_H, layout=head_layout)
    w0 = gl.load(w_ptr + ra.to(gl.int64) * n_heads + wh, mask=(wh < n_heads) & ok0, other=0.0)
    w1 = gl.load(w_ptr + (ra + 1).to(gl.int64) * n_heads + wh, mask=(wh < n_heads) & ok1, other=0.0)
    limit0 = gl.load(limit_ptr + ra, mask=ok0, other=0)
    limit1 = gl.load(limit_ptr + ra + 1, mask=ok1, other=0)
    out0 = out_ptr + ra.to(gl.int64) * out_stride
    out1 = out0 + out_stride
    q0_t = q_rows.index(ROW_OFF).permute((1, 0))
    q1_t = q_rows.index(ROW_OFF + 1).permute((1, 0))
    zero = gl.zeros([BLOCK_S, BLOCK_H], gl.float32, layout=mma_layout)
    keys = gl.arange(0, BLOCK_S, layout=key_layout)
    prev1 = zero
    prev_scale = gl.zeros([BLOCK_S], gl.float32, layout=key_layout)
    prev_pos = keys
    for kt in range(first, live):
        i = kt - first
        stage = ring.index(i % NUM_STAGES)
        mbarrier.wait(ready.index(i % NUM_STAGES), (i // NUM_STAGES) & 1)
        acc0 = warpgroup_mma(stage, q0_t, zero, use_acc=False, is_async=True)
        acc1 = warpgroup_mma(stage, q1_t, zero, use_acc=False, is_async=True)
        pos = kt * BLOCK_S + keys
        kscale = gl.load(ks_ptr + gl.load(block_table_ptr + seq * bt_stride + kt).to(gl.int64) * BLOCK_S + keys,
                         mask=pos < tile_limit, other=0.0)
        if CARRY:
            _wg_row_epilogue(prev1, w1, prev_scale, prev_pos, limit1, out1, ok1 & (kt > first), out_cols)
        logits0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
        _wg_row_epilogue(logits0, w0, kscale, pos, limit0, out0, ok0, out_cols)
        logits1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
        gl.thread_barrier()  # this warpgroup's wgmmas are done with the stage
        if PRODUCER:
            nxt = kt + NUM_STAGES
            if nxt < live:
                mbarrier.wait(empty.index(i % NUM_STAGES), (i // NUM_STAGES) & 1)
                _tma_key_page(k_desc, block_table_ptr, seq, bt_stride, nxt, stage, ready.index(i % NUM_STAGES),
                              BLOCK_S, HEAD_DIM)
        else:
            mbarrier.arrive(empty.index(i % NUM_STAGES), count=1)
        if CARRY:
            prev1 = gl.maximum(logits1, 0.0)
            prev_scale = kscale
            prev_pos = pos
        else:
            _wg_row_epilogue(logits1, w1, kscale, pos, limit1, out1, ok1, out_cols)
    if CARRY:
        if live > first:
            _wg_row_epilogue(prev1, w1, prev_scale, prev_pos, limit1, out1, ok1, out_cols)
    for kt in range(gl.maximum(first, live), last):  # tiles past the query tile's last visible key: -inf
        pos = kt * BLOCK_S + gl.arange(0, BLOCK_S, layout=key_layout)
        inf = gl.full([BLOCK_S], float("-inf"), gl.float32, layout=key_layout)
        gl.store(out0 + pos, inf, mask=(pos < out_cols) & ok0)
        gl.store(out1 + pos, inf, mask=(pos < out_cols) & ok1)


@gluon.jit
def _index_scores_gluon_ws_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, block_table_ptr, limit_ptr, tiles_ptr, out_ptr,
                                  n_heads, bt_stride, out_stride, out_cols, tiles_per_split, k_desc,
                                  HEAD_DIM: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_S: gl.constexpr,
                                  PAGE: gl.constexpr, NUM_STAGES: gl.constexpr, CARRY: gl.constexpr,
                                  ROWS: gl.constexpr, WREGS: gl.constexpr):
    """ROWS-row query tiles (4 or 8) on ROWS / 2 warpgroups that share each TMA'd key page (``launch(...,
    ws_rows=ROWS)``): the default partition runs rows 0-1 and refills the ring once every worker has handed the
    stage back (``empty``, one arrival a worker), each worker partition of 4 warps (WREGS registers) two more rows,
    each warpgroup as ``_index_scores_gluon_wg_kernel`` runs its 2 rows. A key page then serves ROWS rows: 2 / ROWS
    of the 2-row kernel's L2 reads and TMA copies a FLOP. Same scores as the 2-row kernels, bit for bit."""
    gl.static_assert(BLOCK_S == PAGE)
    gl.static_assert(BLOCK_S == 64)
    gl.static_assert(ROWS == 4 or ROWS == 8)
    smem_layout: gl.constexpr = _smem_layout(HEAD_DIM)
    q_layout: gl.constexpr = _copy_layout(HEAD_DIM, 4)
    row0, n_rows, seq, tile_limit, first, last, live = _program_range(tiles_ptr, limit_ptr, out_cols,
                                                                       tiles_per_split, BLOCK_S, True)
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q_rows = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, BLOCK_H, HEAD_DIM], smem_layout)
    q_off = (row0.to(gl.int64) * n_heads + heads) * HEAD_DIM
    for r in gl.static_range(ROWS):
        q_rows.index(r).store(gl.load(q_ptr + q_off[:, None] + r * n_heads * HEAD_DIM + dims[None, :],
                                      mask=((heads < n_heads) & (n_rows > r))[:, None], other=0.0))
    ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_S, HEAD_DIM], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=ROWS // 2 - 1)
    fence_async_shared()
    gl.thread_barrier()
    for s in gl.static_range(NUM_STAGES):
        if first + s < live:
            _tma_key_page(k_desc, block_table_ptr, seq, bt_stride, first + s, ring.index(s), ready.index(s),
                          BLOCK_S, HEAD_DIM)
    shared = (q_rows, ring, ready, empty, k_desc, w_ptr, ks_ptr, block_table_ptr, limit_ptr, out_ptr, seq, bt_stride,
              row0, n_rows, n_heads, out_stride, out_cols, tile_limit, first, last, live)
    if ROWS == 4:
        gl.warp_specialize([(_ws_rows, (0, True, shared, HEAD_DIM, BLOCK_H, BLOCK_S, NUM_STAGES, CARRY)),
                            (_ws_rows, (2, False, shared, HEAD_DIM, BLOCK_H, BLOCK_S, NUM_STAGES, CARRY))],
                           [4], [WREGS])
    else:
        gl.warp_specialize([(_ws_rows, (0, True, shared, HEAD_DIM, BLOCK_H, BLOCK_S, NUM_STAGES, CARRY)),
                            (_ws_rows, (2, False, shared, HEAD_DIM, BLOCK_H, BLOCK_S, NUM_STAGES, CARRY)),
                            (_ws_rows, (4, False, shared, HEAD_DIM, BLOCK_H, BLOCK_S, NUM_STAGES, CARRY)),
                            (_ws_rows, (6, False, shared, HEAD_DIM, BLOCK_H, BLOCK_S, NUM_STAGES, CARRY))],
                           [4, 4, 4], [WREGS, WREGS, WREGS])


# Registers a thread of the ws kernel's worker warpgroups; the default partition runs under the launch's cap (128:
# sm_90, 64 x 128 heads, no spills; 4 rows: two programs of 8 warps an SM, 8 rows: one of 16;
# benchmarks/dsa_gluon_sass.py).
WS_WORKER_REGS = 128


def key_page_descriptor(index_k: torch.Tensor, page: int) -> TensorDescriptor:
    """TMA descriptor of the key cache e4m3 [pages, PAGE, D] as [pages * PAGE, D] rows, one page a box, in the
    shared layout of the kernels' key ring."""
    head_dim = index_k.shape[-1]
    return TensorDescriptor.from_tensor(index_k.view(-1, head_dim), [page, head_dim],
                                        gl.NVMMASharedLayout(swizzle_byte_width=min(128, head_dim), element_bitwidth=8,
                                                             rank=2))


def launch(grid: tuple[int, int], q_fp8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
           index_scale: torch.Tensor, block_table: torch.Tensor, limits: torch.Tensor, tiles: torch.Tensor,
           out: torch.Tensor, tiles_per_split: int, *, block_h: int, rows: int, page: int, num_stages: int,
           w_smem: bool = True, maxnreg: int | None = None, split_rows: bool = False, warpgroups: int = 0,
           carry: bool = False, use_tma: bool = False, reg_a: bool = False, ws_rows: int = 0) -> None:
    """``_index_scores_gluon_kernel`` over ``grid`` (query tiles, splits) with ``dsa.index_scores``' arguments:
    q_fp8 e4m3 [N, H, D], weights fp32 [N, H], index_k e4m3 [pages, PAGE, D], index_scale fp32 [pages, PAGE],
    limits int32 [N], tiles int32 [query tiles, 3], out fp32 [N, cols]; 64-key tiles, 4 warps. ``maxnreg``: a
    register cap (sm_90 at 64 x 128 heads, 2 rows: 186 registers uncapped, 2 programs per SM; 162 under a cap of
    168 without spills, 3 per SM; ``benchmarks/dsa_gluon_sass.py``). ``split_rows``: the row-split kernel
    (``_index_scores_gluon_rows_kernel``: 117 registers, 4 programs per SM; ``w_smem`` does not apply).
    ``reg_a`` (the wg kernel): each key tile read into registers once, the A operand of both rows' wgmmas.
    ``ws_rows`` (4 or 8): ``_index_scores_gluon_ws_kernel`` (tiles of that many rows, 64-key pages by TMA, a
    warpgroup every 2 rows)."""
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    n_heads, head_dim = q_fp8.shape[1], q_fp8.shape[2]
    args = (q_fp8, weights, index_k, index_scale, block_table, limits, tiles, out,
            n_heads, block_table.stride(0), out.stride(0), out.shape[1], tiles_per_split)
    const = dict(HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_S=64, ROWS=rows, PAGE=page, NUM_STAGES=num_stages)
    if ws_rows:
        if ws_rows not in (4, 8) or rows != ws_rows or page != 64:
            raise ValueError(f"the warp-specialised indexer kernel takes 4- or 8-row tiles (ws_rows) and 64-key pages, "
                             f"not {rows} rows and {page}-key pages")
        _index_scores_gluon_ws_kernel[grid](*args, key_page_descriptor(index_k, page), HEAD_DIM=head_dim,
                                            BLOCK_H=block_h, BLOCK_S=64, PAGE=page, NUM_STAGES=num_stages,
                                            CARRY=carry, ROWS=rows, WREGS=WS_WORKER_REGS, num_warps=4,
                                            maxnreg=maxnreg or 128)
    elif warpgroups:
        if rows != 2:
            raise ValueError(f"the multi-warpgroup indexer kernel takes 2-row query tiles, not {rows}")
        if carry and not maxnreg:  # sm_90, 64 x 128 heads: 167 registers uncapped, 128 without spills capped
            extra = {"maxnreg": 128}
        if use_tma and (warpgroups != 1 or page != 64):
            raise ValueError("the TMA key loads take one warpgroup and 64-key pages")
        k_desc = key_page_descriptor(index_k, page) if use_tma else index_k
        _index_scores_gluon_wg_kernel[grid](*args, k_desc, HEAD_DIM=head_dim, BLOCK_H=block_h,
                                            BLOCK_S=64 * warpgroups, PAGE=page, NUM_STAGES=num_stages,
                                            WARPS=4 * warpgroups, CARRY=carry, TMA=use_tma, REG_A=reg_a,
                                            num_warps=4 * warpgroups, **extra)
    elif split_rows:
        _index_scores_gluon_rows_kernel[grid](*args, **const, num_warps=GLUON_WARPS, **extra)
    else:
        _index_scores_gluon_kernel[grid](*args, **const, W_SMEM=w_smem, num_warps=GLUON_WARPS, **extra)


def ws_applies(q_fp8: torch.Tensor, rows_per_tile: int, page: int) -> bool:
    """Whether ``_index_scores_gluon_ws_kernel`` takes these shapes on this device: CUDA capability 9.x, 4- or 8-row
    tiles, 64-key pages, HEAD_DIM a multiple of 32 (at most 256), at most 64 heads (BLOCK_H 128 spills 1,904 bytes
    under the 128-register cap, sm_90 build), the tile's query rows at most 64 KB of e4m3."""
    n_heads, head_dim = q_fp8.shape[1], q_fp8.shape[2]
    block_h = max(16, 1 << (n_heads - 1).bit_length())
    return (is_sm90(q_fp8.device) and rows_per_tile in (4, 8) and page == 64 and head_dim % 32 == 0
            and head_dim <= 256 and block_h <= 64 and rows_per_tile * block_h * head_dim <= 65536)


def gluon_applies(q_fp8: torch.Tensor, rows_per_tile: int, key_block: int, page: int, warpgroups: int = 0) -> bool:
    """Whether ``_index_scores_gluon_kernel`` takes these shapes on this device: CUDA capability 9.x, 64-key
    tiles inside one page, HEAD_DIM a multiple of 32, ROWS * BLOCK_H at most 256 (BLOCK_H: heads padded to a
    power of two, at least 16). With ``warpgroups`` G (``_index_scores_gluon_wg_kernel``): 2-row tiles, key tiles
    of 64 G keys (whole pages), BLOCK_H at most 64."""
    n_heads, head_dim = q_fp8.shape[1], q_fp8.shape[2]
    block_h = max(16, 1 << (n_heads - 1).bit_length())
    if warpgroups:  # at most 64 heads: BLOCK_H 128 spills 784 bytes under the carry's 128-register cap (sm_90)
        return (is_sm90(q_fp8.device) and warpgroups in (1, 2, 4) and key_block == 64 * warpgroups
                and rows_per_tile == 2 and key_block % page == 0 and head_dim % 32 == 0 and head_dim <= 256
                and block_h <= 64)
    return (is_sm90(q_fp8.device) and key_block == 64
            and page % key_block == 0 and head_dim % 32 == 0 and head_dim <= 256 and rows_per_tile * block_h <= 256
            and rows_per_tile & (rows_per_tile - 1) == 0)
