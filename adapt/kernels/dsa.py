"""DeepSeek Sparse Attention lightning indexer: FP8 scoring over the paged key cache + top-k.

Score of query token t against cached key s (DeepSeek-V3.2, transformers' deepseek_v32):

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * d**-0.5,   w = weights_proj(x) * H**-0.5

with q [H, D] per token (H = index_n_heads, D = index_head_dim) and one key k [D] per token.
q and k are stored as e4m3 with one fp32 scale per (token, head) and per token; because ReLU
commutes with a positive factor, the query scale, d**-0.5 and H**-0.5 fold into w
(``fold_index_weights``) and the key scale multiplies the head sum:

    I[t, s] = kscale[s] * sum_h w_eff[t, h] * ReLU(q8[t, h] . k8[s]).

Top-k (``index_topk``, 2048 for DeepSeek-V3.2) per query over the keys it may see (causal:
positions < limit[t] = position[t] + 1). Indices are absolute positions in the query's
sequence, -1 where a row has fewer visible keys than k.

What is Triton and what is torch here:
- ``quantize_fp8_rows``: Triton (torch twin ``quantize_fp8_rows_torch``).
- ``index_scores``: Triton FP8 scoring kernel over the paged cache. A program holds a query
  tile (decode: one row, its [H, D] query kept in registers; prefill: up to
  ``prefill_rows_per_tile`` consecutive rows of one sequence) and streams a contiguous range
  of 128-key tiles through a software pipeline (several tiles in flight); each key tile is
  read once per query tile. The context is split across programs so that about 1024 run
  (batch 64 decode at 128K: 64 sequences x 16 splits of 64 tiles). Torch twin
  ``index_scores_torch``.
- ``index_topk``: calls ``index_scores`` on bounded chunks of query rows and selects with
  ``adapt.kernels.topk.topk_indices`` (Triton radix threshold select, twin ``topk_indices_torch``)
  for chunks of at most ``TRITON_SELECT_MAX_ROWS`` rows, ``topk.topk_prefiltered`` for prefill chunks of
  at least ``PREFILTER_MIN_ROWS`` wide rows, torch.topk between (each measured faster where it runs).
  The [T, S] score matrix is never materialised: a chunk
  holds at most ``max_score_bytes`` of fp32 scores (rows x visible keys of its last row);
  ``IndexStats.peak_score_bytes`` reports what was used.

Work per call, for N query rows against the keys each sees (S_t keys for row t):
FLOPs = 2 * H * D * sum_t S_t (prefill: about H * D * T**2; decode: 2 * H * D * S per
sequence). Bytes (HBM): keys (D + 4) B per cached token per sequence (read once per query
tile), queries N * H * (D + 4) B, scores 4 B per (row, visible key) written and read
back by top-k, indices 4 * topk B per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapt.kernels import dsa_gluon, pdl
from adapt.kernels.formats import FP8_DTYPE, FP8_E4M3_MAX, PAGE_SIZE
from adapt.kernels.formats import interpreting as _interpreting
from adapt.kernels.fp8 import AMAX_FLOOR, amax_scale, quantize_fp8_groups
from adapt.kernels.topk import (
    DECODE_SAMPLE_RUN,
    DECODE_TAU_BITS,
    FUSED_CAP,
    order_key,
    prefilter_applies,
    sample_columns,
    sample_tau,
    select_candidates,
    topk_decode,
    topk_grid,
    topk_indices,
    topk_indices_torch,
    topk_prefiltered,
)

# Stacked prefill tile, fastest of the sweep on an H200 at 128K with one-page key tiles (2026-11-30, commit
# 4f58965, benchmarks/gpu-2026-11-30-dsa-s3-prefill: 2 rows x 64 keys, 4 warps, 740 TFLOP/s on the last 4096
# rows and 730 over all 128K rows; 4 x 64 on 8 warps, the default before, 663-671). Earlier, with a
# block-table entry read per key: 4 x 64 on 8 warps 617-646, 2 x 64 on 4 warps 561-571 (commits 0375b39,
# ab589f7, 4001191).
PREFILL_ROWS_PER_TILE = 2
# Whether prefill scoring takes the Gluon kernel (``dsa_gluon``) by default where it applies (CUDA capability 9.x,
# 64-key tiles in one page). Off: on an H200 (2026-12-01, commits 146e6ef / 63bde98 / 534dcd7) no Gluon form beat
# this tl tile over all 128K rows (best 719 against 737-739 TFLOP/s; benchmarks/gpu-2026-12-01-dsa-s4-indexer).
PREFILL_GLUON = False
# Where the prefill call leaves the kernel to the library (``gluon=None``, no Gluon options, 2-row tiles), on CUDA
# capability 9.x it takes the multi-warpgroup Gluon kernel (``dsa_gluon._index_scores_gluon_wg_kernel``) with
# PREFILL_WG_GROUPS warpgroups (0: the tl tile) and its carried second-row epilogue (PREFILL_WG_CARRY). H200,
# 2026-12-03 (benchmarks/gpu-2026-12-03-dsa-s17, call 1, benchmarks/next/index_wg.py, three rounds in turns, the
# same scores bit for bit): last 4096 rows 850-900 TFLOP/s against the tl tile's 720-746; every 4096-row chunk of
# the 128K prefill with all 128K columns written 761-779 against 706-717. Two and four warpgroups (128- and 256-key
# tiles, 2 and 1 programs an SM) were slower than one (4 an SM): 755 / 685-714 with the carry.
# (Since session 18 a call that leaves the tile rows open gets 4-row tiles on sm_90, PREFILL_WS_ROWS below; this
# kernel runs where the rows are given as 2.)
PREFILL_WG_GROUPS = 1
PREFILL_WG_CARRY = True
# ... and its key pages by TMA (one warpgroup, 64-key pages). H200, 2026-12-03, call 3 (1aece6a), three rounds in
# turns: 834-879 TFLOP/s over all rows against 815-841 with cp.async, both bit-equal to the tl tile.
PREFILL_WG_TMA = True
# ... and its key tile in registers as both rows' wgmma A operand (``gluon_reg_a``; 274 against 282 instructions a
# tile): off, slower. H200, 2026-12-03 (e3e4b1b, benchmarks/gpu-2026-12-03-dsa-s18 call 2, bit-equal): all rows
# 878-881 TFLOP/s against 900-905 (869-875 at 4 stages); the prefill acceptance with it 858.
PREFILL_WG_REG_A = False
# Where the library picks the prefill kernel on CUDA capability 9.x (64-key pages): tiles of PREFILL_WS_ROWS rows on
# the warp-specialised kernel (``dsa_gluon._index_scores_gluon_ws_kernel``: a warpgroup every 2 rows, each TMA'd key
# page serving all of them); 0: 2-row tiles on the one-warpgroup kernel above. H200, 2026-12-03 (890b066,
# benchmarks/gpu-2026-12-03-dsa-s18 call 7, three rounds in turns, bit-equal to the tl tile): 4 rows 935-948 TFLOP/s
# over all rows against 864-901 for the 2-row kernel; the prefill acceptance 886 and 3.57x dense (855-869, 3.45-3.49x
# at 2 rows in calls 1, 2, 6).
PREFILL_WS_ROWS = 4
# ... at PREFILL_WS_STAGES key pages in flight. The probe (calls 7-8) put 4 stages at or above 3 (937-944 against
# 935-948, then 940-943 against 919-926); the prefill acceptance in turns did not (benchmarks/gpu-2026-12-03-dsa-s19,
# call 1: 3 stages 933.9 / 926.8, 4 stages 890.9 / 927.9), so 3 stay.
PREFILL_WS_STAGES = 3


def prefill_rows_per_tile(device: torch.device, gluon: bool | None = None) -> int:
    """Query rows a prefill scoring tile holds where the library picks the kernel (``gluon`` None): PREFILL_WS_ROWS on
    CUDA capability 9.x (not under the interpreter), else (or with ``gluon`` given) PREFILL_ROWS_PER_TILE."""
    if gluon is None and PREFILL_WS_ROWS and PAGE_SIZE == 64 and not _interpreting() and dsa_gluon.is_sm90(device):
        return PREFILL_WS_ROWS
    return PREFILL_ROWS_PER_TILE


PREFILL_KEY_BLOCK = 64
PREFILL_WARPS = 4
KEY_BLOCK = 128
DEFAULT_PROGRAMS = 1024
# Decode tiles (one row per program): one-page key tiles of 64 keys (one block-table entry, contiguous keys), 8 in
# flight, about 4096 programs. H200, 2026-12-01, commit b4f843f/b7693cc (benchmarks/gpu-2026-12-01-dsa-s7,
# benchmarks/next/decode_index.py), batch 64 x 128K, CUDA graph: 281-283 us (3.91-3.94 TB/s of key bytes, 0.87 of
# the same-run read ceiling) against 322-324 us for the tiles before (128 keys, 4 stages, 2048 programs); scores
# identical.
# Few rows take at most DECODE_PROGRAMS_PER_ROW programs a row: at batch 1 x 128K one 64-key tile a program (2048)
# made the step 59-60 us against 53-55 at 264-528 programs (same call, benchmarks/next/b1_index.py, commit 7f65a15).
DECODE_KEY_BLOCK = 64
DECODE_STAGES = 8
DECODE_PROGRAMS = 4096
DECODE_PROGRAMS_PER_ROW = 512
DEFAULT_MAX_SCORE_BYTES = 1 << 30
# Prefill chunks scored widest first (``index_topk``): a causal prefill's first chunks take a fraction of a
# millisecond on the GPU each, less than the host takes to launch one (0.44-1.2 ms a scoring call on the H200
# machine, session 18), so in row order the GPU waits on the host until the chunks outgrow it; the widest chunk
# first puts the host ahead at once. Measured (H200, 2026-12-03, f3db705, benchmarks/gpu-2026-12-03-dsa-s18 call 5,
# 128K prefill): index_topk 179.3 / 180.5 ms widest first against 182.6 in row order; the scoring alone within the
# run-to-run spread (866 / 893 against 886 TFLOP/s).
CHUNKS_WIDEST_FIRST = True
_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def _quantize_fp8_rows_kernel(x_ptr, out_ptr, scale_ptr, n_rows, dim,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, STORE_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)
    offs = rows[:, None].to(tl.int64) * dim + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR) / _E4M3_MAX  # fp8.amax_scale, in the kernel
    q = tl.clamp(x / scale[:, None], -_E4M3_MAX, _E4M3_MAX)
    if STORE_FP32:
        tl.store(out_ptr + offs, q, mask=mask)
    else:
        tl.store(out_ptr + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < n_rows)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last axis) of ``x`` to e4m3 with one fp32 scale per row (Triton).

    x: [..., D] any float dtype. Returns (e4m3 [..., D], fp32 scale [...]), scale by
    ``fp8.amax_scale`` (max(amax, 1e-4) / 448). Bytes: read N * D * elt, write N * (D + 4).

    Under the interpreter the kernel stores the scaled fp32 values and torch casts them:
    the interpreter's fp32 -> e4m3 conversion drops the carry when rounding crosses a power
    of two (126.8 becomes 64, not 128); compiled kernels cast in the kernel.
    """
    *lead, dim = x.shape
    flat = x.reshape(-1, dim).contiguous()
    interpreting = _interpreting()
    out = torch.empty(flat.shape, dtype=torch.float32 if interpreting else FP8_DTYPE, device=x.device)
    scale = torch.empty(flat.shape[0], dtype=torch.float32, device=x.device)
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(64, 8192 // block_d))
    grid = (triton.cdiv(flat.shape[0], block_r),)
    _quantize_fp8_rows_kernel[grid](flat, out, scale, flat.shape[0], dim, BLOCK_R=block_r, BLOCK_D=block_d,
                                    STORE_FP32=interpreting)
    if interpreting:
        out = out.to(FP8_DTYPE)
    return out.reshape(*lead, dim), scale.reshape(lead)


def quantize_fp8_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``quantize_fp8_rows``: one ``fp8.amax_scale`` group per row."""
    q, scale = quantize_fp8_groups(x, x.shape[-1], amax_scale)
    return q, scale.squeeze(-1)


def fold_index_weights(weights: torch.Tensor, q_scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Fold the query scales and the constant factors into the per-head weights.

    weights: [N, H] raw ``weights_proj(x)``; q_scale: [N, H] fp32 per (token, head).
    Returns fp32 [N, H] = weights * H**-0.5 * head_dim**-0.5 * q_scale.
    """
    n_heads = weights.shape[-1]
    return weights.float() * (n_heads ** -0.5) * (head_dim ** -0.5) * q_scale.float()


@triton.jit
def _key_tile(k_ptr, ks_ptr, block_table_ptr, seq, bt_stride, kt, tile_limit, HEAD_DIM: tl.constexpr,
              BLOCK_S: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr = True):
    """Key tile ``kt`` of a sequence through its block table: (positions [BLOCK_S], e4m3 keys
    [BLOCK_S, HEAD_DIM] (fp32 under the interpreter), fp32 scales [BLOCK_S]); positions at or past
    ``tile_limit`` read as 0. A tile inside one page (PAGE a multiple of BLOCK_S: the prefill tile of 64 keys)
    reads one block-table entry (the tile's first key is below ``tile_limit``: only live tiles are read).
    MASKED False: the caller knows the whole tile is below ``tile_limit`` (no per-key mask)."""
    pos = kt * BLOCK_S + tl.arange(0, BLOCK_S)
    key_mask = pos < tile_limit
    if PAGE % BLOCK_S == 0:  # the tile lies in one page: one block-table entry, contiguous keys
        page = tl.load(block_table_ptr + seq * bt_stride + (kt * BLOCK_S) // PAGE)
        slot = page.to(tl.int64) * PAGE + ((kt * BLOCK_S) % PAGE + tl.arange(0, BLOCK_S))
    else:
        page = tl.load(block_table_ptr + seq * bt_stride + pos // PAGE, mask=key_mask, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
    if MASKED:
        keys = tl.load(k_ptr + slot[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], mask=key_mask[:, None],
                       other=0.0)
        kscale = tl.load(ks_ptr + slot, mask=key_mask, other=0.0)
    else:
        keys = tl.load(k_ptr + slot[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :])
        kscale = tl.load(ks_ptr + slot)
    if UPCAST:
        keys = keys.to(tl.float32)
    return pos, keys, kscale


@triton.jit
def _stacked_scores(keys, kscale, q_all, w_all, BLOCK_S: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 [BLOCK_S, ROWS] scores of one key tile against the ROWS x BLOCK_H stacked query heads (one MMA)."""
    logits = tl.dot(keys, tl.trans(q_all))
    weighted = tl.reshape(tl.maximum(logits, 0.0) * w_all[None, :], [BLOCK_S, ROWS, BLOCK_H])
    return tl.sum(weighted, axis=2) * kscale[:, None]


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, block_table_ptr, limit_ptr, tiles_ptr, seq_ptr, out_ptr,
                         n_heads, bt_stride, out_stride, out_cols, tiles_per_split,
                         sample_ptr, tau_ptr, cand_key_ptr, cand_pos_ptr, cand_count_ptr, seg_cap, topk,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                         ROWS: tl.constexpr, PAGE: tl.constexpr, NUM_STAGES: tl.constexpr,
                         UPCAST: tl.constexpr, STACKED: tl.constexpr, DIRECT: tl.constexpr = False,
                         FULL_TILES: tl.constexpr = False, EMIT: tl.constexpr = False, SAMPLE: tl.constexpr = 1,
                         RUN: tl.constexpr = 1, EXPECT_NUM: tl.constexpr = 1, EXPECT_DEN: tl.constexpr = 1,
                         TAU_BITS: tl.constexpr = 1, PDL: tl.constexpr = False):
    """One program: one query tile (up to ROWS consecutive rows of one sequence) against
    ``tiles_per_split`` consecutive BLOCK_S-key tiles (split ``program_id(1)`` of the
    context). Key tiles stream through a NUM_STAGES-deep software pipeline; each is read
    once and scored against every row of the query tile. With ROWS == 1 (decode) the query
    [H, D] and its weights stay in registers for the whole scan. STACKED (ROWS > 1): the tile's
    ROWS x BLOCK_H query heads are loaded once as one [ROWS * BLOCK_H, D] operand and each key tile
    takes one MMA with N = ROWS * BLOCK_H (instead of ROWS MMAs of N = BLOCK_H re-reading q).
    DIRECT (ROWS == 1): program_id(0) is the row and its sequence is read from ``seq_ptr`` (no tile table).
    FULL_TILES (STACKED): the key tiles below every row's limit run in a loop of their own without masks
    (in a causal prefill all but the last few tiles of a query tile).
    EMIT (DIRECT decode, ``index_topk_fused``): the program first takes its row's threshold key tau from the
    row's SAMPLE sampled scores (``sample_ptr``, [N, SAMPLE] fp32 from ``_decode_sample_kernel``; ``topk.sample_tau``,
    every program of the row the same tau; split 0 stores it in ``tau_ptr``), then, beside the scores, keeps
    each visible score whose order key is >= tau: order key and position, ascending, into this program's run of
    ``seg_cap`` slots at ``(row * splits + split) * seg_cap`` of ``cand_key_ptr`` / ``cand_pos_ptr``;
    ``cand_count_ptr[row * splits + split]`` = how many there were (possibly more than seg_cap).
    PDL: the first kernel of the decode chain launched with programmatic dependent launch (``pdl``)."""
    pdl.enter(PDL)
    tile = tl.program_id(0)
    if DIRECT:
        row0 = tile
        n_rows = 1
        seq = tl.load(seq_ptr + tile).to(tl.int64)
    else:
        row0 = tl.load(tiles_ptr + tile * 3)
        n_rows = tl.load(tiles_ptr + tile * 3 + 1)
        seq = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    tile_limit = tl.load(limit_ptr + row0 + n_rows - 1)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    dims = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_S)
    first = tl.program_id(1) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(out_cols, BLOCK_S))
    live = tl.minimum(last, tl.cdiv(tile_limit, BLOCK_S))
    if EMIT:
        n_vis = tl.minimum(tile_limit, out_cols)
        spos = sample_columns(n_vis, tl.arange(0, SAMPLE), SAMPLE, RUN)
        sampled = tl.load(sample_ptr + row0.to(tl.int64) * SAMPLE + tl.arange(0, SAMPLE))
        tau = sample_tau(order_key(sampled), sampled != float("-inf"), spos, n_vis, topk, EXPECT_NUM,
                         EXPECT_DEN, TAU_BITS)
        if tl.program_id(1) == 0:
            tl.store(tau_ptr + row0, tau.to(tl.int32, bitcast=True))
        run = row0.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        written = 0
    if ROWS == 1:
        q_one = tl.load(q_ptr + (row0.to(tl.int64) * n_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
                        mask=hmask[:, None], other=0.0)
        if UPCAST:
            q_one = q_one.to(tl.float32)
        w_one = tl.load(w_ptr + row0.to(tl.int64) * n_heads + heads, mask=hmask, other=0.0)
    if STACKED:
        stack = tl.arange(0, ROWS * BLOCK_H)
        srow = stack // BLOCK_H
        shead = stack % BLOCK_H
        s_ok = (shead < n_heads) & (srow < n_rows)
        q_all = tl.load(q_ptr + ((row0 + srow).to(tl.int64) * n_heads + shead)[:, None] * HEAD_DIM + dims[None, :],
                        mask=s_ok[:, None], other=0.0)
        if UPCAST:
            q_all = q_all.to(tl.float32)
        w_all = tl.load(w_ptr + (row0 + srow).to(tl.int64) * n_heads + shead, mask=s_ok, other=0.0)
        tile_rows = tl.arange(0, ROWS)
        row_limits = tl.load(limit_ptr + row0 + tile_rows, mask=tile_rows < n_rows, other=0)
        out_rows = (row0 + tile_rows).to(tl.int64) * out_stride
        tail = first
        if FULL_TILES:  # tiles every row of the query tile sees whole: no key, row or column masks
            tail = tl.maximum(first, tl.minimum(live, tl.min(row_limits, axis=0) // BLOCK_S))
            for kt in tl.range(first, tail, num_stages=NUM_STAGES):
                pos, keys, kscale = _key_tile(k_ptr, ks_ptr, block_table_ptr, seq, bt_stride, kt, tile_limit,
                                              HEAD_DIM, BLOCK_S, PAGE, UPCAST, False)
                score = _stacked_scores(keys, kscale, q_all, w_all, BLOCK_S, ROWS, BLOCK_H)
                tl.store(out_ptr + out_rows[None, :] + pos[:, None], score)
        for kt in tl.range(tail, live, num_stages=NUM_STAGES):
            pos, keys, kscale = _key_tile(k_ptr, ks_ptr, block_table_ptr, seq, bt_stride, kt, tile_limit, HEAD_DIM,
                                          BLOCK_S, PAGE, UPCAST)
            score = _stacked_scores(keys, kscale, q_all, w_all, BLOCK_S, ROWS, BLOCK_H)
            score = tl.where(pos[:, None] < row_limits[None, :], score, float("-inf"))
            tl.store(out_ptr + out_rows[None, :] + pos[:, None], score,
                     mask=(tile_rows[None, :] < n_rows) & (pos[:, None] < out_cols))
    else:
        for kt in tl.range(first, live, num_stages=NUM_STAGES):
            pos, keys, kscale = _key_tile(k_ptr, ks_ptr, block_table_ptr, seq, bt_stride, kt, tile_limit, HEAD_DIM,
                                          BLOCK_S, PAGE, UPCAST)
            for r in tl.static_range(ROWS):
                row = (row0 + r).to(tl.int64)
                row_ok = r < n_rows
                if ROWS == 1:
                    q_r = q_one
                    w_r = w_one
                else:
                    q_r = tl.load(q_ptr + (row * n_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
                                  mask=hmask[:, None] & row_ok, other=0.0)
                    if UPCAST:
                        q_r = q_r.to(tl.float32)
                    w_r = tl.load(w_ptr + row * n_heads + heads, mask=hmask & row_ok, other=0.0)
                logits = tl.dot(keys, tl.trans(q_r))
                score = tl.sum(tl.maximum(logits, 0.0) * w_r[None, :], axis=1) * kscale
                limit = tl.load(limit_ptr + row, mask=row_ok, other=0)
                score = tl.where(pos < limit, score, float("-inf"))
                tl.store(out_ptr + row * out_stride + pos, score, mask=row_ok & (pos < out_cols))
                if EMIT:
                    ckey = order_key(score)
                    take = (score != float("-inf")) & (pos < out_cols) & (ckey >= tau)
                    slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
                    keep = take & (slot < seg_cap)
                    tl.store(cand_key_ptr + run * seg_cap + slot, ckey.to(tl.int32, bitcast=True), mask=keep)
                    tl.store(cand_pos_ptr + run * seg_cap + slot, pos, mask=keep)
                    written += tl.sum(take.to(tl.int32), axis=0)
        if EMIT:
            tl.store(cand_count_ptr + run, written)
    for kt in range(tl.maximum(first, live), last):
        pos = kt * BLOCK_S + offs
        for r in tl.static_range(ROWS):
            row = (row0 + r).to(tl.int64)
            tl.store(out_ptr + row * out_stride + pos, tl.full([BLOCK_S], float("-inf"), tl.float32),
                     mask=(r < n_rows) & (pos < out_cols))


@triton.jit
def _decode_sample_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, block_table_ptr, limit_ptr, seq_ptr, sample_ptr, n_heads,
                          bt_stride, out_cols, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, SAMPLE: tl.constexpr,
                          RUN: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (row, part): scores of BLOCK of the row's SAMPLE sampled keys (``topk.sample_columns`` over its
    min(limit, out_cols) visible keys; part p takes sample entries [p * BLOCK, (p + 1) * BLOCK)) into
    ``sample_ptr`` [N, SAMPLE] fp32, -inf past the visible keys: ``_index_scores_kernel``'s function of one
    decode row, on keys gathered one by one through the block table."""
    row = tl.program_id(0).to(tl.int64)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    n = tl.minimum(tl.load(limit_ptr + row), out_cols)
    entry = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = sample_columns(n, entry, SAMPLE, RUN)
    m = pos < n
    page = tl.load(block_table_ptr + seq * bt_stride + pos // PAGE, mask=m, other=0)
    slot = page.to(tl.int64) * PAGE + pos % PAGE
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.load(k_ptr + slot[:, None] * HEAD_DIM + dims[None, :], mask=m[:, None], other=0.0)
    kscale = tl.load(ks_ptr + slot, mask=m, other=0.0)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    q = tl.load(q_ptr + (row * n_heads + heads[:, None]) * HEAD_DIM + dims[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + row * n_heads + heads, mask=hmask, other=0.0)
    if UPCAST:
        keys = keys.to(tl.float32)
        q = q.to(tl.float32)
    logits = tl.dot(keys, tl.trans(q))
    score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * kscale
    tl.store(sample_ptr + row * SAMPLE + entry, tl.where(m, score, float("-inf")))


def _query_tiles(token_seq: torch.Tensor, rows_per_tile: int, padded: bool = False) -> torch.Tensor:
    """int32 [tiles, 3] of (first row, rows, sequence): runs of consecutive rows of one
    sequence, cut every ``rows_per_tile`` rows (prefill; decode rows need no table). ``padded``: N entries
    whatever the tile count, the tiles first and then empty ones (rows 0, first row N - 1), built without reading
    anything back to the host (the exact table's length costs a sync)."""
    n = token_seq.shape[0]
    rows = torch.arange(n, device=token_seq.device)
    new_run = torch.ones(n, dtype=torch.bool, device=token_seq.device)
    new_run[1:] = token_seq[1:] != token_seq[:-1]
    run_start = torch.cummax(torch.where(new_run, rows, 0), dim=0).values
    first = (rows - run_start) % rows_per_tile == 0
    if padded:  # each tile's first row to its rank among them; the rest to a slot past the end
        slots = torch.full((n + 1,), n, dtype=rows.dtype, device=rows.device)
        slots.scatter_(0, torch.where(first, torch.cumsum(first, 0) - 1, n), rows)
        starts = slots[:n]
    else:
        starts = torch.nonzero(first).flatten()
    counts = torch.diff(starts, append=torch.full((1,), n, dtype=starts.dtype, device=starts.device))  # no copy in
    starts = starts.clamp(max=n - 1)
    return torch.stack([starts, counts, token_seq[starts].long()], dim=1).to(torch.int32).contiguous()


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _padded_tiles_kernel(seq_ptr, out_ptr, n, R: tl.constexpr, BLOCK: tl.constexpr):
    """``prefill_query_tiles(token_seq, R, padded=True)`` in one program: the rows in blocks of BLOCK, each block's
    run starts (a max scan) and tile ranks (a sum scan) carried into the next. Tile k (row order) goes to entry
    n - 1 - k; the entries below the tiles are empty (first row n - 1, no rows)."""
    run_carry = 0
    tiles = 0
    for b0 in range(0, n, BLOCK):
        rows = b0 + tl.arange(0, BLOCK)
        ok = rows < n
        seq = tl.load(seq_ptr + rows, mask=ok, other=0)
        prev = tl.load(seq_ptr + rows - 1, mask=ok & (rows > 0), other=0)
        new_run = ok & ((rows == 0) | (seq != prev))
        run_start = tl.maximum(tl.associative_scan(tl.where(new_run, rows, 0), 0, _max_combine), run_carry)
        first = ok & ((rows - run_start) % R == 0)
        rank = tiles + tl.cumsum(first.to(tl.int32), 0) - 1
        count = tl.full([BLOCK], 1, tl.int32)
        going = first
        for j in tl.static_range(1, R):  # the tile's rows: up to R, while no new run starts
            nxt = tl.load(seq_ptr + rows + j, mask=going & (rows + j < n), other=0)
            here = tl.load(seq_ptr + rows + j - 1, mask=going & (rows + j < n), other=0)
            going = going & (rows + j < n) & (nxt == here)
            count += going.to(tl.int32)
        entry = out_ptr + (n - 1 - rank) * 3
        tl.store(entry, rows, mask=first)
        tl.store(entry + 1, count, mask=first)
        tl.store(entry + 2, seq, mask=first)
        run_carry = tl.maximum(run_carry, tl.max(tl.where(ok, run_start, 0), 0))
        tiles += tl.sum(first.to(tl.int32), 0)
    last_seq = tl.load(seq_ptr + n - 1)
    for e0 in range(0, n - tiles, BLOCK):  # the empty entries
        e = e0 + tl.arange(0, BLOCK)
        empty = e < n - tiles
        tl.store(out_ptr + e * 3, tl.zeros([BLOCK], tl.int32) + (n - 1), mask=empty)
        tl.store(out_ptr + e * 3 + 1, tl.zeros([BLOCK], tl.int32), mask=empty)
        tl.store(out_ptr + e * 3 + 2, tl.zeros([BLOCK], tl.int32) + last_seq, mask=empty)


# The padded tile table by one Triton program (``_padded_tiles_kernel``) instead of about 17 torch operations:
# H200 machine, session 18, the torch form took 240 us of host time a call (index_scores 461 us in all).
PADDED_TILES_KERNEL = True


def prefill_query_tiles(token_seq: torch.Tensor, rows_per_tile: int, padded: bool = False) -> torch.Tensor:
    """The prefill tile table ``index_scores`` launches over (``_query_tiles``, longest rows first): exact, its length
    read back to the host (one sync), or ``padded`` to one entry a row with empty tiles (no sync; only the
    multi-warpgroup Gluon kernel takes empty tiles; one Triton program, PADDED_TILES_KERNEL)."""
    token_seq = token_seq.to(torch.int32).contiguous()
    n = token_seq.shape[0]
    if padded and PADDED_TILES_KERNEL and n:
        out = torch.empty(n, 3, dtype=torch.int32, device=token_seq.device)
        _padded_tiles_kernel[(1,)](token_seq, out, n, R=rows_per_tile, BLOCK=1024, num_warps=4)
        return out
    return _query_tiles(token_seq, rows_per_tile, padded).flip(0).contiguous()


def _key_splits(key_tiles: int, row_tiles: int, programs: int | None) -> tuple[int, int]:
    """(key tiles per program, programs per row tile): a row tile's key tiles split so that about ``programs``
    (default DEFAULT_PROGRAMS) programs run in all."""
    per_split = triton.cdiv(key_tiles, min(key_tiles, max(1, triton.cdiv(programs or DEFAULT_PROGRAMS, row_tiles))))
    return per_split, triton.cdiv(key_tiles, per_split)


def index_scores(q_fp8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, index_scale: torch.Tensor,
                 block_table: torch.Tensor, token_seq: torch.Tensor, limits: torch.Tensor,
                 num_cols: int, *, rows_per_tile: int | None = None, key_block: int | None = None,
                 num_stages: int | None = None, num_warps: int | None = None,
                 programs: int | None = None, stacked: bool = True, full_tiles: bool = False,
                 gluon: bool | None = None, gluon_w_smem: bool = True,
                 gluon_maxnreg: int | None = None, gluon_split_rows: bool = False,
                 gluon_warpgroups: int = 0, gluon_carry: bool = False, gluon_tma: bool = False,
                 gluon_reg_a: bool | None = None, gluon_ws: bool = False,
                 query_tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer scores of N query rows against the paged key cache (Triton, FP8 MMA).

    q_fp8: e4m3 [N, H, D]; weights: fp32 [N, H] from ``fold_index_weights``;
    index_k: e4m3 [pages, 64, D]; index_scale: fp32 [pages, 64];
    block_table: int32 [B, max_pages]; token_seq: int32 [N] sequence of each row (rows of one
    sequence consecutive, positions ascending); limits: int32 [N] keys row t may see
    (position + 1 when causal). Returns fp32 [N, num_cols]: I[t, s] for s < limits[t],
    -inf elsewhere. FLOPs 2 * H * D * sum(limits); bytes: keys (D + 4) B per visible key per
    query tile, N * num_cols * 4 written.
    Hopper's FP8 MMA accumulates with less than fp32 precision: scores differ from the fp32
    twin by about 1e-3 relative there (exactly equal under the interpreter).
    Tiling: ``rows_per_tile`` query rows share each key tile (default ``prefill_rows_per_tile``: 4 on sm_90,
    PREFILL_ROWS_PER_TILE = 2 elsewhere or with ``gluon`` given; 1 when every row is its own sequence, as in decode);
    ``key_block`` keys per tile (default DECODE_KEY_BLOCK = 64 in decode, 64 in prefill); ``num_stages`` key
    tiles in flight (default DECODE_STAGES = 8 in decode, 3 in prefill); the context is split so that about
    ``programs`` programs run (default in decode DECODE_PROGRAMS = 4096, at most DECODE_PROGRAMS_PER_ROW = 512 a
    row; 1024 in prefill: enough to fill 132 SMs several times); ``num_warps`` per program (default 4 in decode and
    ``PREFILL_WARPS`` in prefill); ``stacked`` (rows_per_tile > 1): one MMA per key tile over all the
    tile's rows x heads, q loaded once (default), else one MMA per row; ``full_tiles`` (stacked): the key
    tiles every row of the query tile sees whole run in a loop without masks (sm_90: 158 registers
    against 125, so one program per SM instead of two; H200: 399 against 663 TFLOP/s; off by default).
    ``gluon`` (stacked prefill tiles): the Gluon kernel of ``dsa_gluon`` (the same tile and arithmetic, MMA of
    one key tile overlapped with the epilogue of the one before; 4 warps, 64-key tiles); None: the
    multi-warpgroup kernel as PREFILL_WG_GROUPS / PREFILL_WG_CARRY say where it applies and no other Gluon option
    is given, else ``PREFILL_GLUON`` where ``dsa_gluon.gluon_applies``; True: required (ValueError where it does
    not apply, e.g. on CPU); False: the tl kernel;
    ``gluon_w_smem``: its epilogue re-reads the head weights from shared memory; ``gluon_maxnreg``: its
    register cap; ``gluon_split_rows``: one MMA per query row instead of the stacked one (see ``dsa_gluon.launch``);
    ``gluon_warpgroups`` G (with ``gluon``, 2-row tiles): the multi-warpgroup kernel, key tiles of 64 G keys on
    4 G warps (``key_block`` defaults to 64 G); ``gluon_carry``: its second row's epilogue under the next tile's MMAs;
    ``gluon_tma`` (G = 1, 64-key pages): its key pages by TMA; ``gluon_reg_a``: its key tile in registers as both
    rows' wgmma A operand (default PREFILL_WG_REG_A where the library picks the kernel, else off);
    ``gluon_ws`` (with ``gluon``, rows_per_tile 4 or 8): the warp-specialised kernel whose key pages serve all the
    tile's rows (where the library picks the kernel: PREFILL_WS_ROWS, and ``prefill_rows_per_tile`` rows a tile).
    ``query_tiles`` (prefill): the table of ``prefill_query_tiles(token_seq, rows_per_tile)`` computed ahead (the
    exact table, or the padded one for the multi-warpgroup kernel). Without it, the multi-warpgroup kernel's calls
    build the padded table (no host sync); the other kernels' cost one (its length is data-dependent; H200,
    2026-12-03: 32 chunked launches over a 128K prefill 859-873 TFLOP/s without the syncs, 787-802 with them).
    """
    n_rows, n_heads, head_dim = q_fp8.shape
    out = torch.empty(n_rows, num_cols, dtype=torch.float32, device=q_fp8.device)
    if n_rows == 0 or num_cols == 0:
        return out
    decode = rows_per_tile == 1 or (rows_per_tile is None and bool((token_seq[1:] != token_seq[:-1]).all()))
    per_tile = 1 if decode else (rows_per_tile or prefill_rows_per_tile(q_fp8.device, gluon))
    token_seq = token_seq.to(torch.int32).contiguous()
    # the library picks the prefill kernel: no Gluon option given, not under the interpreter
    library_picks = (gluon is None and not decode and stacked and not gluon_warpgroups and not gluon_split_rows
                     and not _interpreting())
    if (library_picks and PREFILL_WG_GROUPS and gluon_maxnreg is None and key_block in (None, 64 * PREFILL_WG_GROUPS)
            and dsa_gluon.gluon_applies(q_fp8, per_tile, 64 * PREFILL_WG_GROUPS, PAGE_SIZE, PREFILL_WG_GROUPS)):
        gluon, gluon_warpgroups, gluon_carry = True, PREFILL_WG_GROUPS, PREFILL_WG_CARRY
        gluon_tma = PREFILL_WG_TMA and PREFILL_WG_GROUPS == 1 and PAGE_SIZE == 64
        gluon_reg_a = PREFILL_WG_REG_A if gluon_reg_a is None else gluon_reg_a
    elif (library_picks and PREFILL_WS_ROWS and per_tile == PREFILL_WS_ROWS and key_block in (None, 64)
          and dsa_gluon.ws_applies(q_fp8, per_tile, PAGE_SIZE)):
        gluon, gluon_ws, gluon_carry = True, True, True
        num_stages = num_stages or PREFILL_WS_STAGES
    block_s = key_block or (64 * gluon_warpgroups if gluon_warpgroups and not decode else
                            DECODE_KEY_BLOCK if decode else PREFILL_KEY_BLOCK)
    use_gluon = not decode and stacked and (gluon or (gluon is None and PREFILL_GLUON))
    if use_gluon and (_interpreting() or not (dsa_gluon.ws_applies(q_fp8, per_tile, PAGE_SIZE) if gluon_ws else
                                              dsa_gluon.gluon_applies(q_fp8, per_tile, block_s, PAGE_SIZE,
                                                                      gluon_warpgroups))):
        if gluon_ws:
            raise ValueError("gluon_ws=True needs a CUDA device of capability 9.x, rows_per_tile 4 or 8, 64-key pages, "
                             "at most 64 heads and a head dim that is a multiple of 32")
        if gluon:
            raise ValueError("gluon=True needs a CUDA device of capability 9.x, 64-key tiles inside one page, "
                             "a head dim that is a multiple of 32 and rows_per_tile x heads <= 256 (with "
                             "gluon_warpgroups: 2-row tiles and at most 64 heads)")
        use_gluon = False
    if gluon_ws and not use_gluon:
        raise ValueError("gluon_ws=True needs gluon=True (the Gluon kernels)")
    # the wg and ws kernels take empty tiles: a table without a host sync
    padded = use_gluon and (bool(gluon_warpgroups) or gluon_ws)
    if decode:  # one row per program, sequence read in the kernel: no tile table (no extra launches)
        tiles = token_seq
    elif query_tiles is not None:
        tiles = query_tiles
    else:
        tiles = prefill_query_tiles(token_seq, per_tile, padded=padded)
    key_tiles = triton.cdiv(num_cols, block_s)
    if decode and not programs:
        programs = min(DECODE_PROGRAMS, DECODE_PROGRAMS_PER_ROW * tiles.shape[0])
    # a padded table has an entry a row: split as for the tiles of one sequence
    tiles_per_split, splits = _key_splits(key_tiles, triton.cdiv(n_rows, per_tile) if padded else tiles.shape[0],
                                          programs)
    num_stages = num_stages or (DECODE_STAGES if decode else 3)
    grid = (tiles.shape[0], splits)
    block_h = max(16, triton.next_power_of_2(n_heads))
    if use_gluon:
        dsa_gluon.launch(grid, q_fp8.contiguous(), weights.float().contiguous(), index_k, index_scale, block_table,
                         limits.to(torch.int32).contiguous(), tiles, out, tiles_per_split, block_h=block_h,
                         rows=per_tile, page=PAGE_SIZE, num_stages=num_stages or 3, w_smem=gluon_w_smem,
                         maxnreg=gluon_maxnreg, split_rows=gluon_split_rows, warpgroups=gluon_warpgroups,
                         carry=gluon_carry, use_tma=gluon_tma, reg_a=bool(gluon_reg_a),
                         ws_rows=per_tile if gluon_ws else 0)
        return out
    _index_scores_kernel[grid](
        q_fp8.contiguous(), weights.float().contiguous(), index_k, index_scale, block_table,
        limits.to(torch.int32).contiguous(), tiles, token_seq, out,
        n_heads, block_table.stride(0), out.stride(0), num_cols, tiles_per_split,
        out, out, out, out, out, 0, 0,  # the decode candidate outputs (EMIT, ``index_topk_fused``): unused here
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_S=block_s, ROWS=per_tile,
        PAGE=PAGE_SIZE, NUM_STAGES=num_stages or 3, UPCAST=_interpreting(), STACKED=stacked and per_tile > 1,
        DIRECT=decode, FULL_TILES=bool(full_tiles) and stacked and per_tile > 1,
        num_warps=num_warps or (4 if decode else PREFILL_WARPS),
        **(pdl.launch_options(q_fp8.device) if decode else {}),
    )
    return out


# Fused decode top-k (``index_topk_fused``): sampled keys scored per row, candidates kept by the scoring kernel.
FUSED_SAMPLE = 4096  # sampled keys per row (runs of DECODE_SAMPLE_RUN spread over the visible keys)
FUSED_SAMPLE_BLOCK = 128  # sampled keys per sample program
FUSED_EXPECT = (2, 1)  # candidates aimed at, in units of topk (the select holds topk.FUSED_CAP = 4 * 2048)
# Candidate slots per scoring program (fewer when it scores fewer keys, at most topk.FUSED_CAP): a row of 4K-8K
# visible keys puts about 2 * topk candidates in one program, so 4096 slots sent such rows to the full-row select.
FUSED_SEG_CAP = 8192
# Register cap of the EMIT scoring build: sm_90, 4 warps, 4096 sampled keys: 134 registers uncapped (3 programs an
# SM), 111 and no spills at 128 (4 an SM, as the plain decode build's 103); ptxas -v on the CPU, commit of this line.
FUSED_MAXNREG = 128


def index_topk_fused(q_fp8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, index_scale: torch.Tensor,
                     block_table: torch.Tensor, token_seq: torch.Tensor, limits: torch.Tensor, topk: int,
                     num_cols: int, *, out: torch.Tensor | None = None, redo: torch.Tensor | None = None,
                     key_block: int | None = None, num_stages: int | None = None, num_warps: int | None = None,
                     programs: int | None = None, sample: int | None = None, select_warps: int = 8,
                     **_tile_options) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode index + top-k in three launches, no host sync (capturable in a CUDA graph), for rows that are each
    their own sequence (one decode token per sequence; arguments as in ``index_scores``):

    1. ``_decode_sample_kernel``: the scores of ``sample`` keys per row (runs of 8 spread over its visible keys);
    2. ``_index_scores_kernel`` with EMIT: each program takes the row's threshold key tau from that sample
       (aimed at FUSED_EXPECT * topk keys at or above it), scores its contiguous keys as ``index_scores`` does and
       keeps, beside the scores, the order keys and positions of those >= tau (no second pass over the scores);
    3. ``topk.select_candidates``: one program per row selects from its candidates in registers; a row the sample
       misjudged (fewer than topk candidates above tau, a program past its FUSED_SEG_CAP slots, more than
       topk.FUSED_CAP candidates) is selected there from its full scores instead (slow, exact), and flagged in
       ``redo`` (int32 [N]).

    Returns (int32 [N, topk]: ``topk_indices`` of the kernel's scores exactly: ascending positions, ties at the
    k-th score to the lowest, -1 after them; the fp32 [N, num_cols] scores, kept for the misjudged rows).
    Workspace: N * splits * min(keys per program, FUSED_SEG_CAP) * 8 B of candidate slots, N * sample * 4 B.
    """
    n_rows, n_heads, head_dim = q_fp8.shape
    device = q_fp8.device
    sample = sample or FUSED_SAMPLE
    if sample & (sample - 1) or sample < 16:
        raise ValueError(f"sample must be a power of two >= 16, not {sample}")
    out = torch.empty(n_rows, topk, dtype=torch.int32, device=device) if out is None else out
    redo = torch.empty(n_rows, dtype=torch.int32, device=device) if redo is None else redo
    scores = torch.empty(n_rows, num_cols, dtype=torch.float32, device=device)
    if n_rows == 0 or num_cols == 0 or topk == 0:
        out.fill_(-1)
        redo.zero_()
        return out, scores.fill_(float("-inf"))
    block_s = key_block or KEY_BLOCK
    key_tiles = triton.cdiv(num_cols, block_s)
    tiles_per_split, splits = _key_splits(key_tiles, n_rows, programs)
    seg_cap = min(tiles_per_split * block_s, FUSED_SEG_CAP, FUSED_CAP)
    token_seq = token_seq.to(torch.int32).contiguous()
    limits = limits.to(torch.int32).contiguous()
    q_fp8 = q_fp8.contiguous()
    weights = weights.float().contiguous()
    block_h = max(16, triton.next_power_of_2(n_heads))
    interpreting = _interpreting()
    sampled = torch.empty(n_rows, sample, dtype=torch.float32, device=device)
    sample_block = min(FUSED_SAMPLE_BLOCK, sample)
    _decode_sample_kernel[(n_rows, sample // sample_block)](
        q_fp8, weights, index_k, index_scale, block_table, limits, token_seq, sampled, n_heads, block_table.stride(0),
        num_cols, HEAD_DIM=head_dim, BLOCK_H=block_h, SAMPLE=sample, RUN=DECODE_SAMPLE_RUN, BLOCK=sample_block,
        PAGE=PAGE_SIZE, UPCAST=interpreting, num_warps=4)
    tau = torch.empty(n_rows, dtype=torch.int32, device=device)
    cand_keys = torch.empty(n_rows, splits, seg_cap, dtype=torch.int32, device=device)
    cand_pos = torch.empty(n_rows, splits, seg_cap, dtype=torch.int32, device=device)
    counts = torch.empty(n_rows, splits, dtype=torch.int32, device=device)
    _index_scores_kernel[(n_rows, splits)](
        q_fp8, weights, index_k, index_scale, block_table, limits, token_seq, token_seq, scores,
        n_heads, block_table.stride(0), scores.stride(0), num_cols, tiles_per_split,
        sampled, tau, cand_keys, cand_pos, counts, seg_cap, topk,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_S=block_s, ROWS=1, PAGE=PAGE_SIZE, NUM_STAGES=num_stages or 3,
        UPCAST=interpreting, STACKED=False, DIRECT=True, FULL_TILES=False, EMIT=True, SAMPLE=sample,
        RUN=DECODE_SAMPLE_RUN, EXPECT_NUM=FUSED_EXPECT[0], EXPECT_DEN=FUSED_EXPECT[1], TAU_BITS=DECODE_TAU_BITS,
        num_warps=num_warps or 4, **({} if interpreting else {"maxnreg": FUSED_MAXNREG}))
    select_candidates(scores, limits, tau, cand_keys, cand_pos, counts, topk, out=out, redo=redo,
                      num_warps=select_warps)
    return out, scores


def index_scores_torch(q_fp8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                       index_scale: torch.Tensor, block_table: torch.Tensor, token_seq: torch.Tensor,
                       limits: torch.Tensor, num_cols: int, **_tile_options) -> torch.Tensor:
    """Torch twin of ``index_scores`` (dequantized fp32 math; tile options are ignored)."""
    n_rows = q_fp8.shape[0]
    out = torch.full((n_rows, num_cols), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    if n_rows == 0 or num_cols == 0:
        return out
    keys_flat = index_k.reshape(-1, index_k.shape[-1])
    scale_flat = index_scale.reshape(-1)
    pos = torch.arange(num_cols, device=q_fp8.device)
    for row in range(n_rows):
        limit = min(int(limits[row]), num_cols)
        if limit == 0:
            continue
        pages = block_table[int(token_seq[row])].long()[pos[:limit] // PAGE_SIZE]
        slots = pages * PAGE_SIZE + pos[:limit] % PAGE_SIZE
        logits = q_fp8[row].float() @ keys_flat[slots].float().T
        out[row, :limit] = (logits.clamp_min(0) * weights[row].float()[:, None]).sum(0) * scale_flat[slots]
    return out


@dataclass(frozen=True)
class IndexStats:
    """How ``index_topk`` bounded its memory: chunks run and the largest fp32 score buffer (bytes)."""

    chunks: int
    peak_score_bytes: int
    prefilter_fallback_rows: int = 0


# Rows up to which ``index_topk`` selects with the Triton radix select; above it torch.topk, measured
# faster there. H200, 2026-11-30, commit 0375b39, scores of 128K keys, top-2048: 1 row 28.6 us (Triton,
# 8-bit digits) against 56.0 us (torch.topk); 64 rows 225 against 146 us; 4096 rows 12.0 against 6.0 ms.
TRITON_SELECT_MAX_ROWS = 8
# Chunks of at most TRITON_SELECT_MAX_ROWS rows (decode batches of a few sequences) select under ``auto`` with
# FEW_ROWS_SELECT: "grid" (``topk.topk_grid``: the radix select's result from one launch whose programs meet at grid
# barriers, plus a zeroing launch), "triton" (the radix select, ``topk_indices``: 11 launches) or "decode"
# (``topk_decode`` with FEW_ROWS_DECODE_OPTIONS: two launches, a row's candidate pass spread over many programs, the
# flat select). H200, 2026-12-02, commit 114a308, batch 1 x 128K, top-2048 (benchmarks/gpu-2026-12-02-dsa-s12), the
# step per layer in a graph of 8 layers, three rounds in turn: "grid" with 8 warps 43.8-43.9 us, with 4 warps
# 45.1-45.6, "triton" 47.0-47.5; the select's kernels (4 warps) 14.0 against 20.7 us (profile, commit ed727c7); the
# acceptance harness (commit bc05ba3, four rounds in turn, medians): 42.6 / 46.0 us (one layer / graph of 8) against
# 44.6 / 48.9.
FEW_ROWS_SELECT = "grid"
FEW_ROWS_GRID_OPTIONS: dict = {"num_warps": 8}  # ``topk_grid`` options under "grid" (``parts``, ``cap``, ``num_warps``)
# Measured and removed (session 13, commit 0a33c3e, benchmarks/gpu-2026-12-02-dsa-s13): the grid select's counters
# zeroed by the decode scoring kernel instead of a zeroing launch, 50.0-51.0 us a layer against 44.4-44.5 (batch 1 x
# 128K, graph of 8 layers). Likely why: with programmatic dependent launch a kernel lets the next one launch once it
# starts, so without the launch between them the select's 128 programs are placed while the scoring kernel's 512
# still run.
FEW_ROWS_DECODE_OPTIONS: dict = {"parts": 64, "seg_cap": 2048, "flat": True, "block": 1024, "num_warps": 4,
                                 "select_warps": 16}
# Chunks of at least this many rows (prefill; decode batches stay below it) select through
# ``topk.topk_prefiltered`` when their rows are wide enough (``topk.prefilter_applies``).
PREFILTER_MIN_ROWS = 512
# Chunks of at least this many rows and fewer than PREFILTER_MIN_ROWS (decode batches) select with
# ``topk_decode`` under ``auto`` (None: never). H200, 2026-11-30, commit 1b23ffe, 128K keys, top-2048, CUDA
# graph: 64 rows 94.9 us against torch.topk's 144.4 (the batch-64 step 672 -> 617 us); 1 row 68.6 against
# 57.2, so a single row keeps the Triton radix select (benchmarks/gpu-2026-11-30-dsa-s3-final).
DECODE_SELECT_MIN_ROWS: int | None = 16
# The select ``auto`` takes for chunks of at least PREFILTER_MIN_ROWS rows (prefill): "decode" (``topk_decode`` with
# PREFILL_DECODE_OPTIONS: exact, no host sync) or "prefilter" (``topk_prefiltered``, torch.topk over its candidates).
# H200, 2026-12-01, commit 69853b4 (benchmarks/gpu-2026-12-01-dsa-s7), 128K causal prefill scores in 4096-row chunks,
# every row's set equal to torch.topk's: rows 32768-36864 prefilter 1.72 ms, topk_decode at its decode defaults 1.39,
# with these options 0.88; rows 126976-131072: 3.66 / 4.13 / 3.10 ms; the whole prefill's index_topk (eager, 3 reps)
# 291.1 ms with the prefilter, 283.8 with these options, 304.5 with the decode defaults.
PREFILL_SELECT = "decode"
# ``topk_decode`` launch options for chunks of at least PREFILTER_MIN_ROWS rows under ``decode`` (above): candidate
# pass steps of 2048 scores on 4 warps (decode's 4096 on 8 give too few programs an SM work) and 8 select warps.
PREFILL_DECODE_OPTIONS: dict = {"block": 2048, "num_warps": 4, "select_warps": 8}
SELECT_METHODS = ("auto", "triton", "grid", "torch", "prefilter", "prefilter_triton", "decode", "fused")
# Decode calls (``rows_per_tile=1``) of at least this many rows and fewer than PREFILTER_MIN_ROWS take
# ``index_topk_fused`` under ``auto`` (None: never). None: slower than scores + select where measured (H200,
# 2026-12-01, commit 59af2df, 128K keys, top-2048, CUDA graph, index + top-k: batch 1 57.9 us at its fastest tile
# against 32.1 for scores + the radix select; batch 64 428 us against 422 for scores + topk_decode; the EMIT
# scoring build 387 us against 310 plain; benchmarks/gpu-2026-12-01-dsa-s4-decode).
FUSED_DECODE_MIN_ROWS: int | None = None


def auto_select(rows: int, cols: int, topk: int) -> str:
    """``_select_topk``'s method for ``auto`` on a [rows, cols] score chunk (see there)."""
    if rows <= TRITON_SELECT_MAX_ROWS:
        return FEW_ROWS_SELECT
    if rows >= PREFILTER_MIN_ROWS:
        if PREFILL_SELECT == "decode":
            return "decode"
        return "prefilter" if prefilter_applies(rows, cols, topk) else "torch"
    return "decode" if DECODE_SELECT_MIN_ROWS is not None and rows >= DECODE_SELECT_MIN_ROWS else "torch"


def _select_topk(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor,
                 method: str = "auto") -> int:
    """Top-``topk`` positions of each row of ``scores`` (-inf past ``limits``) into ``out``; returns the
    rows the prefilter sent back to a full select (0 for the other methods). ``auto``: FEW_ROWS_SELECT (the radix
    select's result from ``topk_grid``'s one launch by default, ``topk_indices`` under the interpreter, which runs
    the grid's steps as separate launches; ascending positions, ties to the lowest) for at most
    TRITON_SELECT_MAX_ROWS rows;
    PREFILL_SELECT
    (``decode`` with PREFILL_DECODE_OPTIONS, or the prefiltered select for wide rows) for at least
    PREFILTER_MIN_ROWS rows; else torch.topk (unordered, ties arbitrary, as the prefiltered one); -1 where a row
    sees fewer than ``topk`` keys. ``decode``:
    ``topk_decode`` (the radix select's result, device-side prefilter, capturable; its rows re-selected
    from their full scores stay on the device and are not counted here; FEW_ROWS_DECODE_OPTIONS for at most
    TRITON_SELECT_MAX_ROWS rows, PREFILL_DECODE_OPTIONS from PREFILTER_MIN_ROWS); ``auto`` takes it for
    DECODE_SELECT_MIN_ROWS rows and more (None: never) below PREFILTER_MIN_ROWS."""
    rows, cols = scores.shape
    if method not in SELECT_METHODS:
        raise ValueError(f"select must be one of {SELECT_METHODS}, not {method!r}")
    if method == "auto":
        method = auto_select(rows, cols, topk)
        if method == "grid" and _interpreting():  # same positions; the interpreter's grid steps cost 10-30x more
            method = "triton"
    if method == "triton":
        topk_indices(scores, limits, topk, out=out)
        return 0
    if method == "grid":  # the radix select in one launch (rows too many or too wide: ``topk_indices``)
        topk_grid(scores, limits, topk, out=out, **FEW_ROWS_GRID_OPTIONS)
        return 0
    if method == "decode":  # device-side prefilter: exact, no host sync (misjudged rows are redone on the device)
        options = (PREFILL_DECODE_OPTIONS if rows >= PREFILTER_MIN_ROWS
                   else FEW_ROWS_DECODE_OPTIONS if rows <= TRITON_SELECT_MAX_ROWS else {})
        topk_decode(scores, limits, topk, out=out, **options)
        return 0
    if method in ("prefilter", "prefilter_triton") and prefilter_applies(rows, cols, topk):
        final = "triton" if method == "prefilter_triton" else "torch"
        return topk_prefiltered(scores, limits, topk, out=out, final=final)[1]
    k = min(topk, cols)
    values, idx = torch.topk(scores, k, dim=-1, sorted=False)
    out[:, :k] = torch.where(values == float("-inf"), -1, idx).to(torch.int32)
    out[:, k:] = -1
    return 0


def _select_twin(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor, method: str) -> int:
    topk_indices_torch(scores, limits, topk, out=out)
    return 0


def _index_topk_chunked(score_fn, select_fn, q_fp8, weights, index_k, index_scale, block_table, token_seq, limits,
                        topk, max_score_bytes, max_keys, select, tile_options, fused=False):
    n_rows = q_fp8.shape[0]
    out = torch.empty(n_rows, topk, dtype=torch.int32, device=q_fp8.device)
    if n_rows == 0:
        return out, IndexStats(chunks=0, peak_score_bytes=0)

    def round_up(keys: int) -> int:
        return max(KEY_BLOCK, -(-keys // KEY_BLOCK) * KEY_BLOCK)

    widest = round_up(max_keys if max_keys is not None else int(limits.max()))
    rows_per_chunk = max(1, max_score_bytes // (4 * widest))
    starts = range(0, n_rows, rows_per_chunk)
    chunk_rows = [None] * len(starts)
    if max_keys is None:  # every chunk's widest row in one read-back, not one a chunk
        pad = -n_rows % rows_per_chunk
        chunk_max = torch.nn.functional.pad(limits.to(torch.int64), (0, pad)).view(-1, rows_per_chunk).amax(dim=1)
        if tile_options.get("rows_per_tile") is None and not fused:
            # and whether each chunk's rows are all of different sequences (decode tiles, as ``index_scores``
            # decides when rows_per_tile is None): decided here, so that no chunk's call reads it back
            same = torch.zeros(n_rows, dtype=torch.int64, device=token_seq.device)
            same[1:] = (token_seq[1:] == token_seq[:-1]).to(torch.int64)
            cum = torch.cumsum(same, 0)
            first = torch.arange(0, n_rows, rows_per_chunk, device=token_seq.device)
            last = (first + rows_per_chunk).clamp(max=n_rows) - 1
            repeats = cum[last] - cum[first]  # pairs of neighbours of one sequence inside each chunk
            chunk_max, decode_rows = torch.stack([chunk_max, repeats]).tolist()
            rows = prefill_rows_per_tile(q_fp8.device, tile_options.get("gluon"))
            chunk_rows = [1 if r == 0 else rows for r in decode_rows]
        else:
            chunk_max = chunk_max.tolist()
        chunk_cols = [round_up(int(v)) for v in chunk_max]
    peak = 0
    chunks = 0
    fallback = 0
    order = list(enumerate(starts))
    if CHUNKS_WIDEST_FIRST and max_keys is None:  # each chunk writes its own rows of ``out``: any order holds
        order.sort(key=lambda item: -chunk_cols[item[0]])
    for i, start in order:
        end = min(n_rows, start + rows_per_chunk)
        cols = widest if max_keys is not None else chunk_cols[i]
        args = (q_fp8[start:end], weights[start:end], index_k, index_scale, block_table, token_seq[start:end],
                limits[start:end])
        if fused:  # scoring keeps the candidates, one select over them (misjudged rows: redone on the device)
            scores = index_topk_fused(*args, topk, cols, out=out[start:end], **tile_options)[1]
        else:
            options = tile_options if chunk_rows[i] is None else {**tile_options, "rows_per_tile": chunk_rows[i]}
            scores = score_fn(*args, cols, **options)
            fallback += select_fn(scores, limits[start:end], topk, out=out[start:end], method=select)
        peak = max(peak, scores.numel() * 4)
        del scores
        chunks += 1
    return out, IndexStats(chunks=chunks, peak_score_bytes=peak, prefilter_fallback_rows=fallback)


def index_topk(q_fp8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, index_scale: torch.Tensor,
               block_table: torch.Tensor, token_seq: torch.Tensor, limits: torch.Tensor, topk: int, *,
               max_score_bytes: int = DEFAULT_MAX_SCORE_BYTES, max_keys: int | None = None,
               select: str = "auto", **tile_options) -> tuple[torch.Tensor, IndexStats]:
    """Top-``topk`` key positions per query row: Triton scoring on bounded chunks, then a select per chunk.

    Arguments (and tile options) as in ``index_scores``. Returns (int32 [N, topk] positions, -1 where the
    row sees fewer than ``topk`` keys; stats). A chunk of at most ``TRITON_SELECT_MAX_ROWS`` rows (decode
    at small batch) selects with FEW_ROWS_SELECT, ``adapt.kernels.topk.topk_grid`` by default (``topk_indices``' result
    in one launch: ascending positions, -1 after them, ties at the k-th score to the lowest positions, exactly as the
    twin); prefill chunks of at least
    ``PREFILTER_MIN_ROWS`` rows with ``PREFILL_SELECT``: ``topk.topk_decode`` (the same exact result, no host
    sync) or ``topk.topk_prefiltered`` (H200, 128K prefill: 70 against 107 ms for torch.topk); other chunks with
    torch.topk (it and the prefiltered select: order unspecified, ties arbitrary). Rows are
    chunked so that
    each chunk's score buffer (rows x visible keys of the widest row, fp32) stays under
    ``max_score_bytes``; a chunk holds at least one row (4 * S bytes for S keys).
    ``max_keys`` (an upper bound on ``limits``) sizes every chunk's score buffer without reading
    ``limits`` back to the host; with it and ``rows_per_tile=1`` a decode step makes no host sync
    (CUDA-graph capturable). The scores of a chunk are still written to memory and read back by the
    select (decode, batch 64 x 128K: 32 MiB, L2-sized); scoring and select are not fused yet.
    ``select``: ``_select_topk``'s method (``auto``: FEW_ROWS_SELECT for a few rows, PREFILL_SELECT for
    prefill chunks, torch.topk or ``topk_decode`` between), or ``fused``: ``index_topk_fused`` (candidates kept by the
    scoring kernel, one select over them; the radix select's result; ``auto`` takes it for decode calls, i.e.
    ``rows_per_tile=1``, of FUSED_DECODE_MIN_ROWS to PREFILTER_MIN_ROWS - 1 rows); ``stats.prefilter_fallback_rows``
    counts the rows the prefilter re-selected from their full scores.
    """
    n_rows = q_fp8.shape[0]
    fused = select == "fused" or (select == "auto" and tile_options.get("rows_per_tile") == 1
                                  and FUSED_DECODE_MIN_ROWS is not None and FUSED_DECODE_MIN_ROWS <= n_rows
                                  < PREFILTER_MIN_ROWS)
    return _index_topk_chunked(index_scores, _select_topk, q_fp8, weights, index_k, index_scale, block_table,
                               token_seq, limits, topk, max_score_bytes, max_keys, select, tile_options, fused)


def index_topk_torch(q_fp8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                     index_scale: torch.Tensor, block_table: torch.Tensor, token_seq: torch.Tensor,
                     limits: torch.Tensor, topk: int, *, max_score_bytes: int = DEFAULT_MAX_SCORE_BYTES,
                     max_keys: int | None = None, select: str = "auto",
                     **tile_options) -> tuple[torch.Tensor, IndexStats]:
    """Torch twin of ``index_topk``."""
    return _index_topk_chunked(index_scores_torch, _select_twin, q_fp8, weights, index_k, index_scale,
                               block_table, token_seq, limits, topk, max_score_bytes, max_keys, select, tile_options)
