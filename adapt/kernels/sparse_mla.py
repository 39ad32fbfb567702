"""Sparse MLA attention over the positions the DSA indexer selected (prefill and decode).

Absorbed ("latent") form, the same for prefill and decode: each query head carries a 512-dim
latent query (q_nope @ W_UK) plus its 64-dim rotated part; each selected position supplies
one cached latent row (512 values + 64 rope values) shared by all heads, so

    s[h, j] = (q_lat[h] . c[j] + q_rope[h] . r[j]) * softmax_scale,
    o_lat[h] = sum_j softmax_j(s[h, :]) * c[j]      (then o = o_lat @ W_UV outside),

with online softmax over blocks of selected positions; positions marked -1 (rows that see
fewer keys than top-k) are masked out, never read. A row with no valid position returns 0.

Why the absorbed form for prefill too (counted for DeepSeek-V3.2: 128 heads, top-2048):
the per-head form (192-dim q.k, 128-dim v) must gather, for every query, 2048 positions x
128 heads x (192 + 128) bf16 values = 168 MB of expanded K/V (no two queries share one
gather), against 2048 x 1152 B = 2.36 MB of latent rows shared by all 128 heads in the
absorbed form: 71x fewer bytes for 3.4x more FLOPs (2 x 128 x 2048 x (576 + 512) = 570
MFLOP per query vs 168 MFLOP), which keeps prefill on the MMA units instead of the memory
bus. ``benchmarks/dsa`` records the measured times of both forms at the same shapes.

Work per query row: FLOPs 2 * H * K * (R + Dr + R) for K valid positions; bytes K rows of
(R * elt + 2 * Dr [+ 4 * R / group for fp8]) gathered (shared by all heads; read once per
head block of ``BLOCK_H`` heads), plus q (H * (R + Dr) * 2 B) and o (H * R * 2 B).

Decode at small batch is latency-bound if one program walks all top-k positions of a row
(batch 1 x 128 heads = 4 programs on 132 SMs); ``sparse_mla`` then splits each row's
positions into slices (flash-decoding): every program attends over one slice and writes a
normalised partial output with its log-sum-exp, and ``_combine_kernel`` merges the slices.

``sparse_mla`` is Triton; ``sparse_mla_torch`` is its twin (fp32 math on dequantized rows).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from adapt.kernels import pdl, sparse_mla_gluon
from adapt.kernels.dsa import quantize_fp8_rows
from adapt.kernels.formats import PAGE_SIZE, is_sm90
from adapt.kernels.formats import interpreting as _interpreting
from adapt.kernels.fp8 import amax_scale, quantize_fp8_groups


@triton.jit
def _to_bf16(x, UPCAST: tl.constexpr):
    """bf16 of fp32 ``x``, rounded to nearest even. The interpreter's own fp32 -> bf16 cast truncates,
    so under it the rounding is done on the bits first (then the cast is exact)."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _dequant_cols(kv, scale_ptr, slot, valid, col0, RANK: tl.constexpr, WIDTH: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """bf16 [BLOCK_K, WIDTH] from e4m3 columns col0.. of the gathered rows times their per-GROUP scales."""
    if WIDTH > GROUP:
        NG: tl.constexpr = WIDTH // GROUP
        sc = tl.load(scale_ptr + slot[:, None] * (RANK // GROUP) + col0 // GROUP + tl.arange(0, NG)[None, :],
                     mask=valid[:, None], other=0.0)
        out = tl.reshape(tl.reshape(kv.to(tl.float32), [BLOCK_K, NG, GROUP]) * sc[:, :, None],
                         [BLOCK_K, WIDTH])
    else:
        sc = tl.load(scale_ptr + slot * (RANK // GROUP) + col0 // GROUP, mask=valid, other=0.0)
        out = kv.to(tl.float32) * sc[:, None]
    return _to_bf16(out, UPCAST)


@triton.jit
def _tile_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride, BLOCK_K: tl.constexpr,
                PAGE: tl.constexpr):
    """Cache slots (int64 [BLOCK_K]) of the row's selected positions k0 .. k0 + BLOCK_K (before ``last``)
    and which of them are valid (index >= 0)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + row * topk + kk, mask=kk < last, other=-1)
    valid = idx >= 0
    page = tl.load(block_table_ptr + seq * bt_stride + idx // PAGE, mask=valid, other=0)
    return page.to(tl.int64) * PAGE + idx % PAGE, valid


@triton.jit
def _first_slots(idx_ptr, block_table_ptr, row, seq, first, last, topk, bt_stride, BLOCK_K: tl.constexpr,
                 PAGE: tl.constexpr, PREFETCH: tl.constexpr):
    """With PREFETCH the first tile's (slots, valid), read before the loop; else placeholders never read."""
    if PREFETCH:
        slot, valid = _tile_slots(idx_ptr, block_table_ptr, row, seq, first, last, topk, bt_stride, BLOCK_K, PAGE)
    else:
        slot = tl.zeros([BLOCK_K], tl.int64)
        valid = slot < 0
    return slot, valid


@triton.jit
def _step_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride, slot_n, valid_n,
                BLOCK_K: tl.constexpr, PAGE: tl.constexpr, PREFETCH: tl.constexpr):
    """(slots, valid) of the tile at k0, then those of the next tile: with PREFETCH the current ones were
    read one step earlier (slot_n, valid_n) and the next ones are read now; else the current ones are read
    now and slot_n, valid_n pass through."""
    if PREFETCH:
        slot = slot_n
        valid = valid_n
        slot_n, valid_n = _tile_slots(idx_ptr, block_table_ptr, row, seq, k0 + BLOCK_K, last, topk, bt_stride,
                                      BLOCK_K, PAGE)
    else:
        slot, valid = _tile_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride, BLOCK_K, PAGE)
    return slot, valid, slot_n, valid_n


@triton.jit
def _q_rope_rows(qr_ptr, row, heads, hmask, n_heads, ROPE: tl.constexpr, UPCAST: tl.constexpr):
    """The row's rotated query part [BLOCK_H, ROPE] (fp32 under the interpreter)."""
    q_rope = tl.load(qr_ptr + (row * n_heads + heads[:, None]) * ROPE + tl.arange(0, ROPE)[None, :],
                     mask=hmask[:, None], other=0.0)
    if UPCAST:
        q_rope = q_rope.to(tl.float32)
    return q_rope


@triton.jit
def _row_heads(n_heads, BLOCK_H: tl.constexpr, HEADS_INNER: tl.constexpr):
    """(query row, BLOCK_H head indices) of this program. HEADS_INNER: program_id(0) = row * head blocks +
    head block, so the head blocks of one row run side by side and share its gathered latent rows in L2
    (prefill: with the row on axis 0 and the head block on axis 1, the second head block of a row runs
    rows / SMs waves after the first); else program_id(0) is the row and program_id(1) the head block."""
    if HEADS_INNER:
        blocks = tl.cdiv(n_heads, BLOCK_H)
        row = (tl.program_id(0) // blocks).to(tl.int64)
        block = tl.program_id(0) % blocks
    else:
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
    return row, block * BLOCK_H + tl.arange(0, BLOCK_H)


@triton.jit
def _softmax_step(s, valid, scale_log2, m_i, l_i):
    """One online-softmax step over a tile of logits s [BLOCK_H, BLOCK_K] (log2 units after scale_log2;
    invalid positions -inf): (probabilities against the new running maximum, the factor that rescales
    the earlier sums, the new maximum, the new sum)."""
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _sparse_mla_kernel(qn_ptr, qr_ptr, nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, seq_ptr, idx_ptr,
                       out_ptr, lse_ptr, n_heads, topk, positions_per_split, bt_stride, scale_log2,
                       RANK: tl.constexpr, ROPE: tl.constexpr, V_SPLIT: tl.constexpr,
                       QK_CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                       PAGE: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
                       UPCAST: tl.constexpr, PREFETCH: tl.constexpr = False, HEADS_INNER: tl.constexpr = False):
    """One program: one query row, BLOCK_H heads (the MMA M dimension: all heads of a row share
    its gathered latent rows), RANK / V_SPLIT output columns, and one slice of the row's
    selected positions (``program_id(2) // V_SPLIT``; the whole list when SPLIT is false).

    Two loop forms:
    - fused (QK_CHUNK == RANK and V_SPLIT == 1): q [BLOCK_H, RANK] is loaded once; each gathered
      latent tile [BLOCK_K, RANK] is dequantized once and used for both q.k and p @ v.
    - sliced: q.k is summed over QK_CHUNK-wide slices (q slices re-read from cache each tile) and
      the tile's output slice is gathered once more for p @ v (less shared memory per stage).

    PREFETCH (software pipelining by hand; the default one-stage loop has none): reads the next
    tile's positions and cache slots (the dependent index -> block-table loads) while the current
    tile is multiplied.

    SPLIT: writes the slice's normalised partial output (fp32 [rows, splits, H, RANK]) and its
    log2-sum-exp (fp32 [rows, splits, H], -inf when the slice has no valid position) for
    ``_combine_kernel``; otherwise the final bf16 output [rows, H, RANK].
    """
    row, heads = _row_heads(n_heads, BLOCK_H, HEADS_INNER)
    vpart = tl.program_id(2) % V_SPLIT
    split = tl.program_id(2) // V_SPLIT
    VDIM: tl.constexpr = RANK // V_SPLIT
    FUSED: tl.constexpr = (QK_CHUNK == RANK) and (V_SPLIT == 1)
    hmask = heads < n_heads
    vcols = vpart * VDIM + tl.arange(0, VDIM)
    ccols = tl.arange(0, QK_CHUNK)
    rcols = tl.arange(0, ROPE)
    q_base = (row * n_heads + heads[:, None]) * RANK
    q_rope = _q_rope_rows(qr_ptr, row, heads, hmask, n_heads, ROPE, UPCAST)
    if QK_CHUNK == RANK:
        q_all = tl.load(qn_ptr + q_base + ccols[None, :], mask=hmask[:, None], other=0.0)
        if UPCAST:
            q_all = q_all.to(tl.float32)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    first = split * positions_per_split
    last = tl.minimum(first + positions_per_split, topk)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, VDIM], tl.float32)
    slot_n, valid_n = _first_slots(idx_ptr, block_table_ptr, row, seq, first, last, topk, bt_stride, BLOCK_K, PAGE,
                                   PREFETCH)
    for k0 in range(first, last, BLOCK_K):
        slot, valid, slot_n, valid_n = _step_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride,
                                                   slot_n, valid_n, BLOCK_K, PAGE, PREFETCH)
        k_rope = tl.load(rope_ptr + slot[:, None] * ROPE + rcols[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            k_rope = k_rope.to(tl.float32)
        s = tl.dot(q_rope, tl.trans(k_rope))
        if FUSED:
            kv = tl.load(nope_ptr + slot[:, None] * RANK + ccols[None, :], mask=valid[:, None], other=0.0)
            if FP8:
                kv = _dequant_cols(kv, nscale_ptr, slot, valid, 0, RANK, RANK, GROUP, BLOCK_K, UPCAST)
            if UPCAST:
                kv = kv.to(tl.float32)
            s += tl.dot(q_all, tl.trans(kv))
        else:
            for c in tl.static_range(RANK // QK_CHUNK):
                if QK_CHUNK == RANK:
                    q_c = q_all
                else:
                    q_c = tl.load(qn_ptr + q_base + c * QK_CHUNK + ccols[None, :], mask=hmask[:, None],
                                  other=0.0)
                    if UPCAST:
                        q_c = q_c.to(tl.float32)
                kv_c = tl.load(nope_ptr + slot[:, None] * RANK + c * QK_CHUNK + ccols[None, :],
                               mask=valid[:, None], other=0.0)
                if FP8:
                    kv_c = _dequant_cols(kv_c, nscale_ptr, slot, valid, c * QK_CHUNK, RANK, QK_CHUNK, GROUP,
                                         BLOCK_K, UPCAST)
                if UPCAST:
                    kv_c = kv_c.to(tl.float32)
                s += tl.dot(q_c, tl.trans(kv_c))
            kv = tl.load(nope_ptr + slot[:, None] * RANK + vcols[None, :], mask=valid[:, None], other=0.0)
            if FP8:
                kv = _dequant_cols(kv, nscale_ptr, slot, valid, vpart * VDIM, RANK, VDIM, GROUP, BLOCK_K, UPCAST)
            if UPCAST:
                kv = kv.to(tl.float32)
        p, alpha, m_new, l_i = _softmax_step(s, valid, scale_log2, m_i, l_i)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")  # fp32 p: no tf32 rounding
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        n_splits = tl.num_programs(2) // V_SPLIT
        part = (row * n_splits + split) * n_heads + heads
        tl.store(out_ptr + part[:, None] * RANK + vcols[None, :], out, mask=hmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=hmask & (vpart == 0))
    else:
        tl.store(out_ptr + (row * n_heads + heads[:, None]) * RANK + vcols[None, :], _to_bf16(out, UPCAST),
                 mask=hmask[:, None])


@triton.jit
def _dequant_chunk(nope_ptr, scale_ptr, slot, valid, c: tl.constexpr, RANK: tl.constexpr, GROUP: tl.constexpr,
                   UPCAST: tl.constexpr, HALF: tl.constexpr = False):
    """bf16 [BLOCK_K, GROUP]: scale group ``c`` (columns c * GROUP ..) of the gathered e4m3 rows, dequantized
    (fp32 product rounded to bf16). HALF: fp16, as the fp16 product of the e4m3 value (exact in fp16) and the
    scale rounded to fp16 (packed half math: about one instruction per element instead of three)."""
    cols = c * GROUP + tl.arange(0, GROUP)
    kv = tl.load(nope_ptr + slot[:, None] * RANK + cols[None, :], mask=valid[:, None], other=0.0)
    sc = tl.load(scale_ptr + slot * (RANK // GROUP) + c, mask=valid, other=0.0)
    if HALF:
        out = kv.to(tl.float16) * sc.to(tl.float16)[:, None]
    else:
        out = _to_bf16(kv.to(tl.float32) * sc[:, None], UPCAST)
    if UPCAST:
        out = out.to(tl.float32)
    return out


@triton.jit
def _raw_chunk(nope_ptr, scale_ptr, slot, valid, c: tl.constexpr, RANK: tl.constexpr, GROUP: tl.constexpr,
               UPCAST: tl.constexpr):
    """Scale group ``c`` of the gathered rows as stored: (e4m3 [BLOCK_K, GROUP] (fp32 under the
    interpreter), fp32 scales [BLOCK_K]); masked rows read as 0."""
    cols = c * GROUP + tl.arange(0, GROUP)
    kv = tl.load(nope_ptr + slot[:, None] * RANK + cols[None, :], mask=valid[:, None], other=0.0)
    sc = tl.load(scale_ptr + slot * (RANK // GROUP) + c, mask=valid, other=0.0)
    if UPCAST:
        kv = kv.to(tl.float32)
    return kv, sc


@triton.jit
def _bf16_rows(c8, sc, UPCAST: tl.constexpr):
    """bf16 [BLOCK_K, GROUP] of stored e4m3 rows ``c8`` times their scales ``sc`` [BLOCK_K] (fp32 under the
    interpreter): the p @ v operand, the values ``_dequant_chunk`` gives."""
    kv = _to_bf16(c8.to(tl.float32) * sc[:, None], UPCAST)
    if UPCAST:
        kv = kv.to(tl.float32)
    return kv


@triton.jit
def _q_groups(qn_ptr, qscale_ptr, q_base, row, heads, hmask, n_heads, RANK: tl.constexpr, GROUP: tl.constexpr,
              QK_FP8: tl.constexpr, UPCAST: tl.constexpr, HALF: tl.constexpr = False):
    """The row's q in four [BLOCK_H, GROUP] slices (bf16, e4m3 with QK_FP8, fp16 with HALF) and, with QK_FP8,
    their fp32 scales [BLOCK_H] per slice (zeros otherwise, never read)."""
    q0 = _q_chunk(qn_ptr, q_base, hmask, 0, GROUP, UPCAST, HALF)
    q1 = _q_chunk(qn_ptr, q_base, hmask, 1, GROUP, UPCAST, HALF)
    q2 = _q_chunk(qn_ptr, q_base, hmask, 2, GROUP, UPCAST, HALF)
    q3 = _q_chunk(qn_ptr, q_base, hmask, 3, GROUP, UPCAST, HALF)
    if QK_FP8:
        qs_base = (row * n_heads + heads) * (RANK // GROUP)
        qs0 = tl.load(qscale_ptr + qs_base, mask=hmask, other=0.0)
        qs1 = tl.load(qscale_ptr + qs_base + 1, mask=hmask, other=0.0)
        qs2 = tl.load(qscale_ptr + qs_base + 2, mask=hmask, other=0.0)
        qs3 = tl.load(qscale_ptr + qs_base + 3, mask=hmask, other=0.0)
    else:
        qs0 = tl.zeros_like(heads).to(tl.float32)
        qs1 = qs0
        qs2 = qs0
        qs3 = qs0
    return q0, q1, q2, q3, qs0, qs1, qs2, qs3


@triton.jit
def _group_state(BLOCK_H: tl.constexpr, GROUP: tl.constexpr):
    """Online-softmax state of the four-group kernels: running maximum (-inf) and sum [BLOCK_H], and four
    fp32 [BLOCK_H, GROUP] output accumulators (zeros)."""
    acc = tl.zeros([BLOCK_H, GROUP], tl.float32)
    return tl.full([BLOCK_H], float("-inf"), tl.float32), tl.zeros([BLOCK_H], tl.float32), acc, acc, acc, acc


@triton.jit
def _q_chunk(qn_ptr, q_base, hmask, c: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr,
             HALF: tl.constexpr = False):
    q = tl.load(qn_ptr + q_base + c * GROUP + tl.arange(0, GROUP)[None, :], mask=hmask[:, None], other=0.0)
    if HALF:
        q = q.to(tl.float16)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _pv(acc, p, kv, alpha, UPCAST: tl.constexpr, HALF: tl.constexpr = False):
    """acc * alpha + p @ kv (fp32 accumulator [BLOCK_H, cols]; compiled, p is rounded to kv's MMA type, bf16
    or fp16)."""
    acc = acc * alpha[:, None]
    if UPCAST:  # the interpreter keeps p in fp32, as the twin does
        acc = tl.dot(p, kv, acc, input_precision="ieee")  # fp32 p: no tf32 rounding
    else:
        acc = tl.dot(p.to(kv.dtype), kv, acc)
    return acc


@triton.jit
def _sparse_mla_fp8x4_kernel(qn_ptr, qr_ptr, qscale_ptr, nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, seq_ptr,
                             idx_ptr, out_ptr, lse_ptr, n_heads, topk, positions_per_split, bt_stride, scale_log2,
                             RANK: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_K: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                             PREFETCH: tl.constexpr, QK_FP8: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
                             HEADS_INNER: tl.constexpr = False, HALF: tl.constexpr = False, PDL: tl.constexpr = False):
    """The fused fp8 tile of ``_sparse_mla_kernel`` in four column groups (RANK == 4 * GROUP, one fp32 scale
    per row and group): q is held as four [BLOCK_H, GROUP] slices, each gathered latent tile is loaded
    and dequantized one scale group at a time (no reshape of the tile), q.k chains four MMAs over the
    groups and p @ v writes four [BLOCK_H, GROUP] accumulators. Same grid, outputs and PREFETCH as
    ``_sparse_mla_kernel`` with V_SPLIT 1.

    QK_FP8: q.k in e4m3 x e4m3. ``qn_ptr`` holds q as e4m3 [rows, heads, RANK] and ``qscale_ptr`` its fp32
    scales [rows, heads, RANK / GROUP] (``quantize_q_groups``; quantized outside the kernel so that the
    MMA reads q from shared memory: quantized in the kernel, Triton kept the four e4m3 slices in registers
    as the MMA's A operand and the sm_90 build spilled 2.7 KB). Each gathered e4m3 group enters the q.k
    MMA as loaded (no dequantization for q.k) and the group's logits [BLOCK_H, BLOCK_K] take the product
    of the two scales; the dequantized bf16 rows still feed p @ v.

    SWAP_AB: q.k with its MMA operands swapped, positions on the MMA's M side: logits s^T [BLOCK_K, BLOCK_H]
    = rows . q^T, softmax down the positions (axis 0), and p @ v takes p = (p^T)^T [BLOCK_H, BLOCK_K] into
    the four [BLOCK_H, GROUP] accumulators as without it. Why (read from the sm_90 build, Triton 3.6): with
    64 heads on M and 8 warps, Triton lays the chained q.k result out with all 8 warps along M
    (warpsPerCTA [8, 1]: 128 rows of MMA for 64 heads), so both warpgroups compute the same q.k and the
    same softmax (104 HGMMA in the loop of 128 positions); with 128 positions on M each warpgroup takes 64
    of them (68 HGMMA). The cost: the rows feed q.k as its A operand, which Triton keeps in registers
    (bf16 q.k: the four dequantized tiles, 2.3 KB of spills; with QK_FP8 the stored e4m3 tiles). Swapping
    p @ v too (rows^T as A) kept the rows in registers for a transpose and spilled 2.2 KB: not an option.

    HEADS_INNER: ``_row_heads``' launch order. HALF (neither QK_FP8 nor SWAP_AB): the latent is dequantized
    to fp16 and q.k (latent part) and p @ v run as fp16 MMAs (``_dequant_chunk``; the rope part stays bf16)."""
    pdl.enter(PDL)
    row, heads = _row_heads(n_heads, BLOCK_H, HEADS_INNER)
    split = tl.program_id(2)
    hmask = heads < n_heads
    rcols = tl.arange(0, ROPE)
    q_base = (row * n_heads + heads[:, None]) * RANK
    q_rope = _q_rope_rows(qr_ptr, row, heads, hmask, n_heads, ROPE, UPCAST)
    q0, q1, q2, q3, qs0, qs1, qs2, qs3 = _q_groups(qn_ptr, qscale_ptr, q_base, row, heads, hmask, n_heads, RANK,
                                                   GROUP, QK_FP8, UPCAST, HALF)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    first = split * positions_per_split
    last = tl.minimum(first + positions_per_split, topk)
    m_i, l_i, acc0, acc1, acc2, acc3 = _group_state(BLOCK_H, GROUP)
    slot_n, valid_n = _first_slots(idx_ptr, block_table_ptr, row, seq, first, last, topk, bt_stride, BLOCK_K, PAGE,
                                   PREFETCH)
    for k0 in range(first, last, BLOCK_K):
        slot, valid, slot_n, valid_n = _step_slots(idx_ptr, block_table_ptr, row, seq, k0, last, topk, bt_stride,
                                                   slot_n, valid_n, BLOCK_K, PAGE, PREFETCH)
        k_rope = tl.load(rope_ptr + slot[:, None] * ROPE + rcols[None, :], mask=valid[:, None], other=0.0)
        # every gathered load of the tile is issued before the first MMA: an MMA between them puts a second
        # memory round trip into each tile (H200, 2026-11-30: 297 us against 203-218 us at batch 64)
        if QK_FP8 or SWAP_AB:
            c0, sc0 = _raw_chunk(nope_ptr, nscale_ptr, slot, valid, 0, RANK, GROUP, UPCAST)
            c1, sc1 = _raw_chunk(nope_ptr, nscale_ptr, slot, valid, 1, RANK, GROUP, UPCAST)
            c2, sc2 = _raw_chunk(nope_ptr, nscale_ptr, slot, valid, 2, RANK, GROUP, UPCAST)
            c3, sc3 = _raw_chunk(nope_ptr, nscale_ptr, slot, valid, 3, RANK, GROUP, UPCAST)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            if SWAP_AB:
                s_t = tl.dot(k_rope, tl.trans(q_rope))
                s_t, kv0 = _qk_group_t(s_t, q0, qs0, c0, sc0, QK_FP8, UPCAST)
                s_t, kv1 = _qk_group_t(s_t, q1, qs1, c1, sc1, QK_FP8, UPCAST)
                s_t, kv2 = _qk_group_t(s_t, q2, qs2, c2, sc2, QK_FP8, UPCAST)
                s_t, kv3 = _qk_group_t(s_t, q3, qs3, c3, sc3, QK_FP8, UPCAST)
                p, alpha, m_new, l_i = _softmax_step_t(s_t, valid, scale_log2, m_i, l_i)
            else:
                s = tl.dot(q_rope, tl.trans(k_rope))
                s += tl.dot(q0, tl.trans(c0)) * (qs0[:, None] * sc0[None, :])
                s += tl.dot(q1, tl.trans(c1)) * (qs1[:, None] * sc1[None, :])
                s += tl.dot(q2, tl.trans(c2)) * (qs2[:, None] * sc2[None, :])
                s += tl.dot(q3, tl.trans(c3)) * (qs3[:, None] * sc3[None, :])
                kv0 = _bf16_rows(c0, sc0, UPCAST)
                kv1 = _bf16_rows(c1, sc1, UPCAST)
                kv2 = _bf16_rows(c2, sc2, UPCAST)
                kv3 = _bf16_rows(c3, sc3, UPCAST)
                p, alpha, m_new, l_i = _softmax_step(s, valid, scale_log2, m_i, l_i)
        else:
            kv0 = _dequant_chunk(nope_ptr, nscale_ptr, slot, valid, 0, RANK, GROUP, UPCAST, HALF)
            kv1 = _dequant_chunk(nope_ptr, nscale_ptr, slot, valid, 1, RANK, GROUP, UPCAST, HALF)
            kv2 = _dequant_chunk(nope_ptr, nscale_ptr, slot, valid, 2, RANK, GROUP, UPCAST, HALF)
            kv3 = _dequant_chunk(nope_ptr, nscale_ptr, slot, valid, 3, RANK, GROUP, UPCAST, HALF)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            s = tl.dot(q_rope, tl.trans(k_rope))
            s = tl.dot(q0, tl.trans(kv0), s)
            s = tl.dot(q1, tl.trans(kv1), s)
            s = tl.dot(q2, tl.trans(kv2), s)
            s = tl.dot(q3, tl.trans(kv3), s)
            p, alpha, m_new, l_i = _softmax_step(s, valid, scale_log2, m_i, l_i)
        acc0 = _pv(acc0, p, kv0, alpha, UPCAST, HALF)
        acc1 = _pv(acc1, p, kv1, alpha, UPCAST, HALF)
        acc2 = _pv(acc2, p, kv2, alpha, UPCAST, HALF)
        acc3 = _pv(acc3, p, kv3, alpha, UPCAST, HALF)
        m_i = m_new
    denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
    cols = tl.arange(0, GROUP)
    if SPLIT:
        n_splits = tl.num_programs(2)
        part = (row * n_splits + split) * n_heads + heads
        base = out_ptr + part[:, None] * RANK + cols[None, :]
        tl.store(base, acc0 / denom, mask=hmask[:, None])
        tl.store(base + GROUP, acc1 / denom, mask=hmask[:, None])
        tl.store(base + 2 * GROUP, acc2 / denom, mask=hmask[:, None])
        tl.store(base + 3 * GROUP, acc3 / denom, mask=hmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=hmask)
    else:
        base = out_ptr + q_base + cols[None, :]
        tl.store(base, _to_bf16(acc0 / denom, UPCAST), mask=hmask[:, None])
        tl.store(base + GROUP, _to_bf16(acc1 / denom, UPCAST), mask=hmask[:, None])
        tl.store(base + 2 * GROUP, _to_bf16(acc2 / denom, UPCAST), mask=hmask[:, None])
        tl.store(base + 3 * GROUP, _to_bf16(acc3 / denom, UPCAST), mask=hmask[:, None])


@triton.jit
def _qk_group_t(s_t, q, q_scale, c8, sc, QK_FP8: tl.constexpr, UPCAST: tl.constexpr):
    """One scale group of a tile in the swapped form, from its stored e4m3 rows ``c8`` [BLOCK_K, GROUP] and
    scales ``sc``: (s_t [BLOCK_K, BLOCK_H] + rows . q^T, the rows dequantized to bf16 for p @ v). QK_FP8: q
    is e4m3 and ``c8`` enters the MMA as stored, the product times the row scale x q's per-head scale;
    else the dequantized rows do."""
    kv = _bf16_rows(c8, sc, UPCAST)
    if QK_FP8:
        s_t += tl.dot(c8, tl.trans(q)) * (sc[:, None] * q_scale[None, :])
    else:
        s_t = tl.dot(kv, tl.trans(q), s_t)
    return s_t, kv


@triton.jit
def _softmax_step_t(s_t, valid, scale_log2, m_i, l_i):
    """``_softmax_step`` on transposed logits s_t [BLOCK_K, BLOCK_H] (down the positions): (p [BLOCK_H,
    BLOCK_K], the factor that rescales the earlier sums, the new maximum, the new sum)."""
    s_t = tl.where(valid[:, None], s_t * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p_t = tl.exp2(s_t - m_safe[None, :])
    return tl.trans(p_t), alpha, m_new, l_i * alpha + tl.sum(p_t, axis=0)


@triton.jit
def _merge_slices(part_ptr, lse_ptr, out_ptr, row, heads, cols, n_heads, n_splits, RANK: tl.constexpr,
                  SLICES: tl.constexpr, UPCAST: tl.constexpr):
    """Output [heads, cols] of one row from every slice's partial and log2-sum-exp loaded at once (SLICES a power
    of two >= n_splits): out = sum_s 2**lse_s * o_s / sum_s 2**lse_s, 0 where no slice saw a position, stored
    bf16."""
    hmask = heads < n_heads
    sl = tl.arange(0, SLICES)
    part = (row * n_splits + sl[:, None]) * n_heads + heads[None, :]  # [SLICES, heads]
    ok = (sl[:, None] < n_splits) & hmask[None, :]
    lse = tl.load(lse_ptr + part, mask=ok, other=float("-inf"))
    o = tl.load(part_ptr + part[:, :, None] * RANK + cols[None, None, :], mask=ok[:, :, None],
                other=0.0).to(tl.float32)
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[None, :])  # 0 for empty and padding slices
    den = tl.sum(w, axis=0)
    acc = tl.sum(w[:, :, None] * o, axis=0)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + (row * n_heads + heads[:, None]) * RANK + cols[None, :], _to_bf16(out, UPCAST),
             mask=hmask[:, None])


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, n_heads, n_splits, RANK: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_C: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False, SLICES: tl.constexpr = 0):
    """One program: one row, BLOCK_H heads, BLOCK_C output columns. Merges the n_splits partial
    outputs by their log2-sum-exp weights: out = sum_s 2**lse_s * o_s / sum_s 2**lse_s (0 when no
    slice saw a valid position). Bytes: reads n_splits * BLOCK_H * (BLOCK_C + 1) * 4, writes
    BLOCK_H * BLOCK_C * 2. Small blocks on purpose: batch-1 decode has one row, and the partials
    (splits x 128 heads x 512 x 4 B) must be read by many SMs at once.
    SLICES (a power of two >= n_splits): every slice's log-sum-exp and partial loaded at once (two loads in
    flight, then the max, the weights and one sum over the slices), instead of one slice after the other
    with an online rescale (SLICES 0: n_splits dependent load round trips, 32 at batch-1 decode)."""
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    if SLICES > 0:
        _merge_slices(part_ptr, lse_ptr, out_ptr, row, heads, cols, n_heads, n_splits, RANK, SLICES, UPCAST)
    else:
        m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for s in range(0, n_splits):
            part = (row * n_splits + s) * n_heads + heads
            lse = tl.load(lse_ptr + part, mask=hmask, other=float("-inf"))
            o = tl.load(part_ptr + part[:, None] * RANK + cols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
            m_new = tl.maximum(m_run, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_run - m_safe)
            w = tl.exp2(lse - m_safe)
            acc = acc * alpha[:, None] + w[:, None] * o
            l_run = l_run * alpha + w
            m_run = m_new
        out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
        tl.store(out_ptr + (row * n_heads + heads[:, None]) * RANK + cols[None, :], _to_bf16(out, UPCAST),
                 mask=hmask[:, None])


def _default_splits(device: torch.device, programs: int, topk: int, block_k: int) -> int:
    """Position slices per row, from a one-program-per-SM wave model (the fp8 tiles take a whole SM:
    255 registers x 256 threads): the count s that minimises waves x tiles per slice,
    ceil(s * programs / SMs) * ceil(tiles / s), the fewest slices on a tie (each extra slice costs
    partial-output bytes and the combine); 1 from one program per SM up. Batch-1 decode, 128 heads in
    2 blocks, top-2048 in 16 tiles of 128: 16 slices (32 programs, one tile each); batch 64 (128
    programs on 132 SMs): 1, where the former rule (about two programs per SM) took 3 slices in 3
    waves plus a combine (16 us in the 2026-11-30 profile)."""
    if device.type != "cuda":
        return 1
    return wave_splits(programs, topk, block_k, torch.cuda.get_device_properties(device).multi_processor_count)


def wave_splits(programs: int, topk: int, block_k: int, sms: int) -> int:
    """``_default_splits``' rule for ``sms`` multiprocessors (host arithmetic only)."""
    if programs >= sms:  # one wave or more already: slices would only add partial outputs and a combine
        return 1
    tiles = max(1, triton.cdiv(topk, block_k))
    return min(range(1, tiles + 1), key=lambda s: (triton.cdiv(s * programs, sms) * triton.cdiv(tiles, s), s))


@triton.jit
def _upconvert_kernel(nope_ptr, scale_ptr, rope_ptr, block_table_ptr, out_nope_ptr, out_rope_ptr, bt_stride, width,
                      RANK: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                      ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """ROWS cache rows of block-table entry program_id(0) (sequence // width, entry % width) as bf16: the e4m3 row
    times its group's fp32 scale, rounded once to bf16 (the sparse MLA kernels' MMA operand), and the rope row as is,
    into dense row entry * PAGE + r. Entries below 0 read page 0 (rows no selection reaches)."""
    entry = tl.program_id(0)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    page = tl.maximum(tl.load(block_table_ptr + (entry // width) * bt_stride + entry % width), 0).to(tl.int64)
    src = page * PAGE + r
    dst = entry.to(tl.int64) * PAGE + r
    cols = tl.arange(0, RANK)
    raw = tl.load(nope_ptr + src[:, None] * RANK + cols[None, :]).to(tl.float32)
    scale = tl.load(scale_ptr + src[:, None] * (RANK // GROUP) + cols[None, :] // GROUP)
    tl.store(out_nope_ptr + dst[:, None] * RANK + cols[None, :], _to_bf16(raw * scale, UPCAST))
    rc = tl.arange(0, ROPE)
    tl.store(out_rope_ptr + dst[:, None] * ROPE + rc[None, :], tl.load(rope_ptr + src[:, None] * ROPE + rc[None, :]))


def upconvert_latent(latent_nope: torch.Tensor, latent_scale: torch.Tensor, latent_rope: torch.Tensor,
                     block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged e4m3 latent cache of every block-table row as a dense bf16 latent, for a prefill's sparse MLA: (nope
    bf16 [B, W * 64, R], rope bf16 [B, W * 64, Dr]) for a block table [B, W]; sequence b's position p is [b, p].
    Each value is what the sparse MLA kernels dequantise in their loop (``bf16(e4m3 * fp32 scale)``), so attention
    over it is the same arithmetic; it is computed once instead of once a (row, 64 heads) program that selects it.
    One launch; bytes read B * W * 64 * (R + 4 * R / group + 2 * Dr), written B * W * 64 * 2 * (R + Dr) (at 128K
    positions: 86 MB read, 151 MB written). Twin: ``upconvert_latent_torch``."""
    rank, rope = latent_nope.shape[-1], latent_rope.shape[-1]
    n_seq, width = block_table.shape
    out_nope = torch.empty(n_seq, width * PAGE_SIZE, rank, dtype=torch.bfloat16, device=latent_nope.device)
    out_rope = torch.empty(n_seq, width * PAGE_SIZE, rope, dtype=torch.bfloat16, device=latent_nope.device)
    rows = 4 if _interpreting() else 16
    if n_seq * width:
        _upconvert_kernel[(n_seq * width, PAGE_SIZE // rows)](
            latent_nope, latent_scale, latent_rope, block_table, out_nope, out_rope, block_table.stride(0), width,
            RANK=rank, ROPE=rope, GROUP=rank // latent_scale.shape[-1], PAGE=PAGE_SIZE, ROWS=rows,
            UPCAST=_interpreting(), num_warps=4)
    return out_nope, out_rope


def upconvert_latent_torch(latent_nope: torch.Tensor, latent_scale: torch.Tensor, latent_rope: torch.Tensor,
                           block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``upconvert_latent`` (torch gathers and fp32 math)."""
    rank = latent_nope.shape[-1]
    n_seq, width = block_table.shape
    pages = block_table.long().clamp(min=0).reshape(-1)
    nope = latent_nope[pages].float().reshape(-1, latent_scale.shape[-1], rank // latent_scale.shape[-1])
    nope = (nope * latent_scale[pages].reshape(-1, latent_scale.shape[-1], 1)).to(torch.bfloat16)
    return (nope.reshape(n_seq, width * PAGE_SIZE, rank),
            latent_rope[pages].reshape(n_seq, width * PAGE_SIZE, latent_rope.shape[-1]).clone())


def upconvert_worth(n_rows: int, n_heads: int, topk: int, block_table: torch.Tensor, gluon_bf16: bool = True,
                    row_bytes: int = 2 * (512 + 64)) -> bool:
    """Whether ``sparse_mla``'s ``upconvert=None`` converts the cache first: where the Gluon bf16 kernel takes the
    call (``gluon_bf16``), once the rows' (row, 64 heads) programs would dequantise at least UPCONVERT_MIN_RATIO
    times the positions converted, and the dense copy (``row_bytes`` a position) stays within UPCONVERT_MAX_BYTES."""
    if not (UPCONVERT_AUTO and gluon_bf16):
        return False
    positions = block_table.shape[0] * block_table.shape[1] * PAGE_SIZE
    gathered = n_rows * triton.cdiv(n_heads, sparse_mla_gluon.GLUON_BLOCK_H) * topk
    return gathered >= UPCONVERT_MIN_RATIO * positions and positions * row_bytes <= UPCONVERT_MAX_BYTES


# ``sparse_mla``'s upconvert=None rule (``upconvert_worth``). H200, 2026-12-03 (benchmarks/gpu-2026-12-03-dsa-s16): the
# 128K prefill's sparse MLA (16384-row chunks, each converting the whole 128K cache first: 72-77 us) 193.9-194.6 ms
# at the bf16 kernel's final defaults against 239.6-239.7 for the fp8 Gluon kernel (call 5; 208.2-208.7 against
# 239.7-239.8 with none of its options, call 1, bit-equal). Decode batches stay on the fp8 kernel (64 rows x 128K: 2
# head blocks x 2048 gathers a row against 8.4M positions to convert).
UPCONVERT_AUTO = True
UPCONVERT_MIN_RATIO = 8
UPCONVERT_MAX_BYTES = 4 << 30


def sparse_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_nope: torch.Tensor,
               latent_scale: torch.Tensor | None, latent_rope: torch.Tensor, block_table: torch.Tensor,
               token_seq: torch.Tensor, indices: torch.Tensor, softmax_scale: float, *,
               block_h: int | None = None, block_k: int | None = None, v_split: int | None = None,
               qk_chunk: int | None = None, splits: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, prefetch: bool | None = None, groups4: bool | None = None,
               qk_fp8: bool | None = None, swap_ab: bool = False, heads_inner: bool = False,
               half: bool = False, gluon: bool | dict | None = None, upconvert: bool | None = None) -> torch.Tensor:
    """Sparse latent attention of N query rows over their selected cached positions (Triton).

    q_nope: bf16 [N, H, R] absorbed latent queries; q_rope: bf16 [N, H, Dr];
    latent_nope: [pages, 64, R] bf16 or e4m3; latent_scale: fp32 [pages, 64, R / group] for
    e4m3, else None; latent_rope: bf16 [pages, 64, Dr]; block_table: int32 [B, max_pages];
    token_seq: int32 [N]; indices: int32 [N, K] positions in the row's sequence, -1 = none;
    softmax_scale: multiplies q.k. Returns bf16 [N, H, R], the latent attention output.

    Grid: (N, H / block_h, v_split * splits). ``block_h`` heads form the MMA M dimension (they
    share the row's gathered latent tile); ``block_k`` positions per tile; ``v_split`` output
    column slices (1 with ``qk_chunk == R`` is the fused form: q loaded once, each latent tile
    dequantized once for q.k and p @ v); ``splits`` slices of the K positions per row
    (flash-decoding: each slice writes a partial output + log-sum-exp, ``_combine_kernel``
    merges them; default ``_default_splits``: many slices for batch-1 decode, 1 once the rows x head
    blocks fill the GPU's SMs). Extra bytes with splits > 1:
    N * splits * H * (R + 1) * 4 written and read back.

    ``prefetch``: reads the next tile's slots ahead by hand. ``heads_inner``: the head blocks of a row are
    neighbours in launch order (grid axis 0 = row x head block), so a row's gathered latent rows are read
    from HBM once and from L2 by its other head blocks. ``half`` (groups4 only): the latent dequantized to
    fp16 in packed half math and fp16 MMAs for its q.k and p @ v (q rounded to fp16; twin:
    ``sparse_mla_torch(..., half=True)``). ``groups4``: the fused fp8 tile as
    ``_sparse_mla_fp8x4_kernel`` (four scale groups of R / 4 columns, no reshape of the tile).
    ``gluon``: the Gluon kernel (``sparse_mla_gluon``: 64 heads, q in shared memory, asynchronous MMAs, the next
    tile gathered and dequantised while the current one multiplies; e4m3 latent of rank 512 in four groups, a
    CUDA device of capability 9.x; only ``block_k`` (64), ``splits`` and ``prefetch`` apply, ``prefetch`` there
    on unless False: the slots of the tile after next read a step ahead; a dict: the Gluon kernel with these
    ``sparse_mla_gluon.GLUON_FLAGS`` overridden). None: the Gluon kernel where
    ``GLUON_DEFAULT`` holds, it applies and no other tile option is given (``splits`` may be): batch 64 decode and
    prefill, and with GLUON_SLICED the decode batches that take position slices (batch 1: 32 slices of 64
    positions, merged by the combine loading every slice at once).
    ``qk_fp8`` (groups4 only): q.k as e4m3 x e4m3, q quantized first (``quantize_q_groups``: one scale per
    row, head and scale group, one extra launch; the twin: ``sparse_mla_torch(..., qk_fp8=True)``); p @ v
    stays bf16. Off by default (H200 sweep of 2026-11-30: benchmarks/gpu-2026-11-30-dsa-s3-decode). ``swap_ab`` (groups4
    only): q.k with positions on the MMA's M side (``_sparse_mla_fp8x4_kernel``'s SWAP_AB; same function).

    ``upconvert`` (e4m3 latent): first convert the cache of every block-table row to a dense bf16 latent
    (``upconvert_latent``, the same values the kernels dequantise), then attend over that: on sm_90 with
    ``sparse_mla_gluon.sparse_mla_gluon_bf16_kernel`` (no dequantisation in the loop, cp.async gathers), elsewhere
    the tl kernel's bf16 path. For prefill, where each position is gathered by many rows. None: ``upconvert_worth``.
    Other tile options do not apply with it.

    Defaults: an fp8 latent of rank 512 in four scale groups on the GPU takes the four-group kernel
    (groups4) with block_k 128 and 1 stage (H200 sweep of 2026-11-30, batch 64 x 128K: 218 us against
    247-263 us for the fused tile with block_k 64: benchmarks/gpu-2026-11-30-dsa-s2/README.md); another
    fp8 latent of rank 512 on the GPU the fused tile (v_split 1, qk_chunk 512) with block_k 64 and 1
    stage; otherwise block_k 64 (16 under the interpreter), v_split 2 at rank 512 (1 below it and under
    the interpreter), qk_chunk 128. Older tile notes: benchmarks/dsa/README.md.
    """
    n_rows, n_heads, rank = q_nope.shape
    rope = q_rope.shape[-1]
    topk = indices.shape[1]
    out = torch.empty(n_rows, n_heads, rank, dtype=torch.bfloat16, device=q_nope.device)
    if n_rows == 0:
        return out
    fp8 = latent_scale is not None
    group = rank // latent_scale.shape[-1] if fp8 else rank
    interpreting = _interpreting()
    if upconvert is None:
        upconvert = fp8 and upconvert_worth(n_rows, n_heads, topk, block_table,
                                            _gluon_bf16_applies(q_nope, q_rope, rank), 2 * (rank + rope))
    if upconvert:
        given = [k for k, v in dict(block_h=block_h, block_k=block_k, v_split=v_split, qk_chunk=qk_chunk,
                                    num_warps=num_warps, num_stages=num_stages, prefetch=prefetch, groups4=groups4,
                                    qk_fp8=qk_fp8, swap_ab=swap_ab, heads_inner=heads_inner, half=half,
                                    gluon=gluon).items() if v is not None and v is not False]
        if not fp8 or given:
            raise ValueError("upconvert needs an e4m3 latent and takes no tile option but splits"
                             + (f" (given: {', '.join(given)})" if given else ""))
        return _sparse_mla_upconverted(q_nope, q_rope, latent_nope, latent_scale, latent_rope, block_table,
                                       token_seq, indices, softmax_scale, out, splits)
    tl_options = dict(block_h=block_h, v_split=v_split, qk_chunk=qk_chunk, num_warps=num_warps,
                      num_stages=num_stages, groups4=groups4, qk_fp8=qk_fp8, swap_ab=swap_ab,
                      heads_inner=heads_inner, half=half)
    tl_given = [k for k, v in tl_options.items() if v]
    flags = gluon if isinstance(gluon, dict) else None  # a dict (even empty): the Gluon kernel with these flags
    if gluon is None:
        gluon = (GLUON_DEFAULT and not tl_given and prefetch is None and block_k in (None, 64)
                 and sparse_mla_gluon.gluon_supported(q_nope, latent_scale)
                 and (GLUON_SLICED or (splits in (None, 1) and _default_splits(
                     q_nope.device, n_rows * triton.cdiv(n_heads, sparse_mla_gluon.GLUON_BLOCK_H), topk, 64) == 1)))
    elif gluon is not False:  # asked for: checked here, the default's conditions above hold by construction
        if tl_given:
            raise ValueError(f"gluon takes only block_k and splits, not {', '.join(tl_given)}")
        if not sparse_mla_gluon.gluon_supported(q_nope, latent_scale) or block_k not in (None, 64):
            raise ValueError("gluon needs an e4m3 latent of rank 512 in four scale groups on a CUDA device of "
                             "capability 9.x, and block_k 64")
        gluon = True
    if gluon:
        return _sparse_mla_gluon(q_nope, q_rope, latent_nope, latent_scale, latent_rope, block_table, token_seq,
                                 indices, softmax_scale, out, splits, prefetch is not False, flags)
    # fp8 latent on the GPU: the fused tile with 64-position tiles, one stage (the sweep: benchmarks/dsa/README.md)
    fused_fp8 = fp8 and not interpreting and rank == 512
    block_h = block_h or max(16, min(64, triton.next_power_of_2(n_heads)))
    if groups4 is None:  # the measured-fastest tile where it applies (see Defaults)
        groups4 = ((fused_fp8 or bool(qk_fp8) or swap_ab) and fp8 and rank == 4 * group and v_split in (None, 1)
                   and qk_chunk in (None, rank))
    block_k = block_k or (16 if interpreting else 128 if groups4 else 64)
    v_split = v_split or (1 if interpreting or rank < 512 or fused_fp8 or groups4 else 2)
    qk_chunk = min(rank, qk_chunk or (rank if fused_fp8 or groups4 else 128))
    vdim = rank // v_split
    if rank % qk_chunk or rank % v_split:
        raise ValueError(f"qk_chunk {qk_chunk} and v_split {v_split} must divide the latent rank {rank}")
    if fp8:
        for width in (qk_chunk, vdim):
            groups = width // group
            if (width % group if width >= group else group % width) or (groups & (groups - 1)):
                raise ValueError(f"latent slice {width} must align with the scale group {group} "
                                 f"(a power-of-two multiple or a divisor of it)")
    num_warps = num_warps or (4 if interpreting else 8)
    num_stages = num_stages or 1
    head_blocks = triton.cdiv(n_heads, block_h)
    splits, positions_per_split, partial, lse = _slices(out, topk, block_k, splits, head_blocks * v_split)
    latent_scale_arg = latent_scale if fp8 else latent_nope
    grid_rows, grid_heads = (n_rows * head_blocks, 1) if heads_inner else (n_rows, head_blocks)
    if (qk_fp8 or swap_ab or half) and not groups4:
        raise ValueError("qk_fp8, swap_ab and half need the four-scale-group kernel (groups4)")
    if half and (qk_fp8 or swap_ab):
        raise ValueError("half is a form of the plain four-group tile: not with qk_fp8 or swap_ab")
    if qk_fp8 and group < 32 and not interpreting:
        raise ValueError(f"qk_fp8 needs scale groups of at least 32 columns (an fp8 MMA's K), not {group}")
    if groups4:
        if not (fp8 and rank == 4 * group and v_split == 1 and qk_chunk == rank):
            raise ValueError("groups4 needs an fp8 latent of four scale groups and the fused tile")
        if qk_fp8:
            q_arg, q_scale = quantize_q_groups(q_nope, group)
        else:
            q_arg, q_scale = q_nope.contiguous(), latent_scale
        _sparse_mla_fp8x4_kernel[(grid_rows, grid_heads, splits)](
            q_arg, q_rope.contiguous(), q_scale, latent_nope, latent_scale, latent_rope,
            block_table, token_seq.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous(),
            partial, lse,
            n_heads, topk, positions_per_split, block_table.stride(0), softmax_scale * math.log2(math.e),
            RANK=rank, ROPE=rope, GROUP=group, BLOCK_H=block_h, BLOCK_K=block_k, PAGE=PAGE_SIZE, SPLIT=splits > 1,
            UPCAST=interpreting, PREFETCH=bool(prefetch), QK_FP8=bool(qk_fp8), SWAP_AB=bool(swap_ab),
            HEADS_INNER=bool(heads_inner), HALF=bool(half), num_warps=num_warps, num_stages=num_stages,
            **pdl.launch_options(q_nope.device),
        )
    else:
        _sparse_mla_kernel[(grid_rows, grid_heads, v_split * splits)](
            q_nope.contiguous(), q_rope.contiguous(), latent_nope, latent_scale_arg, latent_rope,
            block_table, token_seq.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous(),
            partial, lse,
            n_heads, topk, positions_per_split, block_table.stride(0), softmax_scale * math.log2(math.e),
            RANK=rank, ROPE=rope, V_SPLIT=v_split, QK_CHUNK=qk_chunk, BLOCK_H=block_h, BLOCK_K=block_k,
            PAGE=PAGE_SIZE, FP8=fp8, GROUP=group, SPLIT=splits > 1, UPCAST=interpreting, PREFETCH=bool(prefetch),
            HEADS_INNER=bool(heads_inner), num_warps=num_warps, num_stages=num_stages,
        )
    if splits > 1:
        _combine(partial, lse, out, splits, interpreting)
    return out


# The Gluon kernel as the default on sm_90 (see ``sparse_mla``'s ``gluon``): set from the H200 measurement in
# benchmarks/gpu-2026-12-01-dsa-s4-mla/README.md (call 2: batch 64 x 128K 134.6 us against 207.9 us for the tl
# default; the last 4096 rows of a 128K prefill 7.75 ms against 11.19 ms for the tl sweep's best tile; batch 1
# with position slices: 23.3-24.8 us either way, so the tl tile stays there).
GLUON_DEFAULT = True
# ... also where the one-wave rule takes position slices (a few decode rows): H200, 2026-12-02, commit 6db6369,
# benchmarks/gpu-2026-12-02-dsa-s13 (call 4), batch 1 x 128K, graph of 8 layers, medians of four rounds in turn:
# step 39.6 us a layer with the Gluon kernel (32 slices of 64 positions) and the combine at once, against 43.8 for
# the four-group tl kernel (16 slices of 128 positions) and the slice loop; 43.6 Gluon with the slice loop (32
# dependent round trips). Sparse MLA alone 15.8 against 18.4 us.
GLUON_SLICED = True
# The Gluon kernel's slice partials in bf16 instead of fp32 (half the bytes written and read back by the combine: 4
# instead of 8 MB at batch 1 x 128 heads x 32 slices); one more rounding of each partial before the merge. Slower,
# so off: H200, 2026-12-02 (benchmarks/gpu-2026-12-02-dsa-s14, call 2), the batch-1 step in a graph of 8 layers
# 43.01-43.39 us a layer against 38.28-39.79 (the kernel's 4-byte stores and the combine's bf16 loads both slower).
PARTIAL_BF16 = False


def _sparse_mla_gluon(q_nope, q_rope, latent_nope, latent_scale, latent_rope, block_table, token_seq, indices,
                      softmax_scale, out, splits, prefetch, flags) -> torch.Tensor:
    """``sparse_mla`` through ``sparse_mla_gluon.launch`` (64-position tiles; the caller checked that it
    applies): position slices by the same one-wave rule (one program per SM: 64 heads, up to 224 KB of shared
    memory), then the same combine."""
    block_k = 64
    head_blocks = triton.cdiv(q_nope.shape[1], sparse_mla_gluon.GLUON_BLOCK_H)
    splits, positions_per_split, partial, lse = _slices(out, indices.shape[1], block_k, splits, head_blocks,
                                                        torch.bfloat16 if PARTIAL_BF16 else torch.float32)
    sparse_mla_gluon.launch(q_nope, q_rope, latent_nope, latent_scale, latent_rope, block_table, token_seq, indices,
                            softmax_scale, partial, lse, splits, positions_per_split, block_k, prefetch, flags)
    if splits > 1:
        _combine(partial, lse, out, splits, False)
    return out


def _gluon_bf16_applies(q_nope: torch.Tensor, q_rope: torch.Tensor, rank: int) -> bool:
    """Whether ``sparse_mla_gluon.sparse_mla_gluon_bf16_kernel`` takes an upconverted call: sm_90, rank 512, rope 64."""
    return (not _interpreting() and q_nope.device.type == "cuda" and rank == 512 and q_rope.shape[-1] == 64
            and is_sm90(q_nope.device))


def _sparse_mla_upconverted(q_nope, q_rope, latent_nope, latent_scale, latent_rope, block_table, token_seq, indices,
                            softmax_scale, out, splits) -> torch.Tensor:
    """``sparse_mla(..., upconvert=True)``: the dense bf16 latent, then the Gluon bf16 kernel on sm_90 (rank 512,
    rope 64), else the tl kernel's bf16 path over the dense rows (a block table of consecutive pages)."""
    nope, rope = upconvert_latent(latent_nope, latent_scale, latent_rope, block_table)
    n_seq, width = block_table.shape
    rank = q_nope.shape[-1]
    if _gluon_bf16_applies(q_nope, q_rope, rank):
        head_blocks = triton.cdiv(q_nope.shape[1], sparse_mla_gluon.GLUON_BLOCK_H)
        splits, positions_per_split, partial, lse = _slices(out, indices.shape[1], 64, splits, head_blocks)
        sparse_mla_gluon.launch_bf16(q_nope, q_rope, nope, rope, width * PAGE_SIZE, token_seq, indices,
                                     softmax_scale, partial, lse, splits, positions_per_split)
        if splits > 1:
            _combine(partial, lse, out, splits, False)
        return out
    dense_table = torch.arange(n_seq * width, dtype=torch.int32, device=block_table.device).view(n_seq, width)
    out.copy_(sparse_mla(q_nope, q_rope, nope.view(n_seq * width, PAGE_SIZE, rank), None,
                         rope.view(n_seq * width, PAGE_SIZE, -1), dense_table, token_seq, indices, softmax_scale,
                         splits=splits, upconvert=False))
    return out


def _slices(out: torch.Tensor, topk: int, block_k: int, splits: int | None, blocks_per_row: int,
            partial_dtype: torch.dtype = torch.float32):
    """Position slices of each row: (slices, positions per slice (a multiple of block_k), partial outputs
    [N, slices, H, R] (``partial_dtype``) and fp32 log2-sum-exps [N, slices, H] for the combine; with one slice both
    are ``out``). ``splits`` None: ``_default_splits`` for N x ``blocks_per_row`` programs."""
    n_rows, n_heads, rank = out.shape
    splits = splits or _default_splits(out.device, n_rows * blocks_per_row, topk, block_k)
    positions_per_split = triton.cdiv(triton.cdiv(topk, splits), block_k) * block_k
    splits = triton.cdiv(topk, positions_per_split)
    if splits == 1:
        return splits, positions_per_split, out, out
    partial = torch.empty(n_rows, splits, n_heads, rank, dtype=partial_dtype, device=out.device)
    lse = torch.empty(n_rows, splits, n_heads, dtype=torch.float32, device=out.device)
    return splits, positions_per_split, partial, lse


# The combine loads every slice at once up to this many slices (``_combine_kernel``'s SLICES); more, or
# COMBINE_AT_ONCE False: one slice after the other. H200, 2026-12-02 (benchmarks/gpu-2026-12-02-dsa-s13): over the
# tl kernel's 16 slices no faster in the batch-1 step (calls 1-2: graph of 8 layers 44.0-44.5 us against
# 44.0-44.4); over the Gluon kernel's 32 slices 39.6 against 43.6 (call 4).
COMBINE_AT_ONCE = True
COMBINE_MAX_SLICES = 64
# partial values a combine program holds at once (64 a thread at 4 warps); H200, batch 1, 32 slices (session 13,
# call 7): 2048 / 4096 / 16384 made the sparse MLA 17.5 / 16.2 / 16.2 us against 15.8
COMBINE_ELEMENTS = 8192


def combine_blocks(n_heads: int, rank: int, splits: int, at_once: bool) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_C, SLICES) of ``_combine_kernel``: 4 heads (fewer when there are fewer) and 128 columns a
    program one slice after the other; at once, SLICES = splits to a power of two and the columns narrowed so that
    a program holds at most COMBINE_ELEMENTS partial values (at least 16 columns)."""
    block_h = min(triton.next_power_of_2(n_heads), 4)
    block_c = min(rank, 128)
    if not at_once or splits > COMBINE_MAX_SLICES:
        return block_h, block_c, 0
    slices = triton.next_power_of_2(splits)
    while block_c > 16 and slices * block_h * block_c > COMBINE_ELEMENTS and rank % (block_c // 2) == 0:
        block_c //= 2
    return block_h, block_c, slices


def _combine(partial, lse, out, splits: int, interpreting: bool) -> None:
    """``_combine_kernel`` over the ``splits`` partial outputs of every row into ``out`` (bf16 [N, H, R])."""
    n_rows, n_heads, rank = out.shape
    block_h, block_c, slices = combine_blocks(n_heads, rank, splits, COMBINE_AT_ONCE)
    _combine_kernel[(n_rows, triton.cdiv(n_heads, block_h), triton.cdiv(rank, block_c))](
        partial, lse, out, n_heads, splits, RANK=rank, BLOCK_H=block_h, BLOCK_C=block_c,
        UPCAST=interpreting, SLICES=slices, num_warps=4, **pdl.launch_options(out.device))


def quantize_q_groups(q_nope: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope [N, H, R] as e4m3 with one fp32 scale per (row, head, ``group`` columns): (e4m3 [N, H, R],
    fp32 [N, H, R / group]), the amax rule of ``fp8.quantize_fp8_groups`` through the Triton row quantizer
    (one launch; bytes read N * H * R * 2, written N * H * (R + 4 * R / group))."""
    n_rows, n_heads, rank = q_nope.shape
    q8, scale = quantize_fp8_rows(q_nope.reshape(n_rows, n_heads, rank // group, group))
    return q8.reshape(n_rows, n_heads, rank), scale.contiguous()


def sparse_mla_torch(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_nope: torch.Tensor,
                     latent_scale: torch.Tensor | None, latent_rope: torch.Tensor, block_table: torch.Tensor,
                     token_seq: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                     out_dtype: torch.dtype = torch.bfloat16, qk_fp8: bool = False, half: bool = False,
                     **_tile_options) -> torch.Tensor:
    """Torch twin of ``sparse_mla`` (fp32 math on rows dequantized to bf16 as the kernel's MMA operand;
    the compiled kernel also rounds the softmax probabilities to bf16 for p @ v, which the twin does not
    (its running maximum is per tile); other tile options ignored). Returns ``out_dtype`` (the kernel's bf16
    by default; float32 gives the result before that rounding). ``qk_fp8`` (e4m3 latent): q.k as the
    kernel's option computes it, q_nope quantized to e4m3 per (row, head, scale group) by
    ``fp8.quantize_fp8_groups`` and multiplied with the stored e4m3 rows, each group's dot times both scales.
    ``half``: as the kernel's ``half`` tile, rows dequantized as the fp16 product of the e4m3 value and the
    fp16-rounded scale, q_nope rounded to fp16."""
    n_rows, n_heads, rank = q_nope.shape
    out = torch.zeros(n_rows, n_heads, rank, dtype=torch.float32, device=q_nope.device)
    nope = latent_nope.reshape(-1, rank)
    rope = latent_rope.reshape(-1, latent_rope.shape[-1])
    scale = None if latent_scale is None else latent_scale.reshape(-1, latent_scale.shape[-1])
    for row in range(n_rows):
        idx = indices[row].long()
        idx = idx[idx >= 0]
        if idx.numel() == 0:
            continue
        pages = block_table[int(token_seq[row])].long()[idx // PAGE_SIZE]
        slots = pages * PAGE_SIZE + idx % PAGE_SIZE
        kv = nope[slots].float()
        q = q_nope[row].float()
        if scale is not None and half:  # fp16 product, the half kernel's MMA operand
            kv = nope[slots].to(torch.float16).view(len(slots), scale.shape[-1], -1)
            kv = (kv * scale[slots].to(torch.float16).unsqueeze(-1)).view(len(slots), rank).float()
            q = q_nope[row].to(torch.float16).float()
        elif scale is not None:  # dequantized to bf16, the kernel's MMA operand
            kv = kv.view(len(slots), scale.shape[-1], -1) * scale[slots].unsqueeze(-1)
            kv = kv.view(len(slots), rank).to(torch.bfloat16).float()
        if qk_fp8:
            if scale is None:
                raise ValueError("qk_fp8 needs an e4m3 latent with scales")
            groups = scale.shape[-1]
            q8, q_scale = quantize_fp8_groups(q_nope[row], rank // groups, amax_scale)
            q8 = q8.float().view(n_heads, groups, -1)
            c8 = nope[slots].float().view(len(slots), groups, -1)
            logits = q_rope[row].float() @ rope[slots].float().T
            for g in range(groups):  # the kernel's order: rope part, then each group's scaled dot
                logits = logits + (q8[:, g] @ c8[:, g].T) * (q_scale[:, g, None] * scale[slots][None, :, g])
        else:
            logits = q @ kv.T + q_rope[row].float() @ rope[slots].float().T
        logits = logits * softmax_scale
        out[row] = torch.softmax(logits, dim=-1) @ kv
    return out.to(out_dtype)
