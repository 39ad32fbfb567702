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

``sparse_mla`` is Triton; ``sparse_mla_torch`` is its twin (fp32 math on dequantized rows).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from adapt.runtime.kv_cache import PAGE_SIZE


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _sparse_mla_kernel(qn_ptr, qr_ptr, nope_ptr, nscale_ptr, rope_ptr, block_table_ptr, seq_ptr, idx_ptr,
                       out_ptr, n_heads, topk, bt_stride, scale_log2,
                       RANK: tl.constexpr, ROPE: tl.constexpr, V_SPLIT: tl.constexpr,
                       QK_CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                       PAGE: tl.constexpr, FP8: tl.constexpr,
                       GROUP: tl.constexpr, UPCAST: tl.constexpr):
    """One program: one query row, BLOCK_H heads, RANK / V_SPLIT output columns. q.k is summed
    over QK_CHUNK-wide slices of the latent so that neither q nor the gathered rows are held
    whole in registers; the gathered rows' output slice is loaded once more for p @ v."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    VDIM: tl.constexpr = RANK // V_SPLIT
    hmask = heads < n_heads
    vcols = tl.program_id(2) * VDIM + tl.arange(0, VDIM)
    ccols = tl.arange(0, QK_CHUNK)
    rcols = tl.arange(0, ROPE)
    q_base = (row * n_heads + heads[:, None]) * RANK
    q_rope = tl.load(qr_ptr + (row * n_heads + heads[:, None]) * ROPE + rcols[None, :], mask=hmask[:, None],
                     other=0.0)
    if UPCAST:
        q_rope = q_rope.to(tl.float32)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, VDIM], tl.float32)
    for k0 in range(0, topk, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + row * topk + kk, mask=kk < topk, other=-1)
        valid = idx >= 0
        page = tl.load(block_table_ptr + seq * bt_stride + idx // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + idx % PAGE
        k_rope = tl.load(rope_ptr + slot[:, None] * ROPE + rcols[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            k_rope = k_rope.to(tl.float32)
        s = tl.dot(q_rope, tl.trans(k_rope))
        for c in tl.static_range(RANK // QK_CHUNK):
            q_c = tl.load(qn_ptr + q_base + c * QK_CHUNK + ccols[None, :], mask=hmask[:, None], other=0.0)
            kv_c = tl.load(nope_ptr + slot[:, None] * RANK + c * QK_CHUNK + ccols[None, :],
                           mask=valid[:, None], other=0.0)
            if FP8:
                sc = tl.load(nscale_ptr + slot * (RANK // GROUP) + (c * QK_CHUNK) // GROUP, mask=valid,
                             other=0.0)
                kv_c = (kv_c.to(tl.float32) * sc[:, None]).to(tl.bfloat16)
            if UPCAST:
                q_c = q_c.to(tl.float32)
                kv_c = kv_c.to(tl.float32)
            s += tl.dot(q_c, tl.trans(kv_c))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        kv_v = tl.load(nope_ptr + slot[:, None] * RANK + vcols[None, :], mask=valid[:, None], other=0.0)
        if FP8:
            VG: tl.constexpr = VDIM // GROUP if VDIM >= GROUP else 1
            VW: tl.constexpr = GROUP if VDIM >= GROUP else VDIM
            sc_v = tl.load(nscale_ptr + slot[:, None] * (RANK // GROUP) + (tl.program_id(2) * VDIM) // GROUP
                           + tl.arange(0, VG)[None, :], mask=valid[:, None], other=0.0)
            kv_v = tl.reshape(tl.reshape(kv_v.to(tl.float32), [BLOCK_K, VG, VW]) * sc_v[:, :, None],
                              [BLOCK_K, VDIM]).to(tl.bfloat16)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, kv_v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv_v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (row * n_heads + heads[:, None]) * RANK + vcols[None, :], out.to(tl.bfloat16),
             mask=hmask[:, None])


def sparse_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_nope: torch.Tensor,
               latent_scale: torch.Tensor | None, latent_rope: torch.Tensor, block_table: torch.Tensor,
               token_seq: torch.Tensor, indices: torch.Tensor, softmax_scale: float, *,
               block_h: int | None = None, block_k: int | None = None, v_split: int | None = None,
               qk_chunk: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None) -> torch.Tensor:
    """Sparse latent attention of N query rows over their selected cached positions (Triton).

    q_nope: bf16 [N, H, R] absorbed latent queries; q_rope: bf16 [N, H, Dr];
    latent_nope: [pages, 64, R] bf16 or e4m3; latent_scale: fp32 [pages, 64, R / group] for
    e4m3, else None; latent_rope: bf16 [pages, 64, Dr]; block_table: int32 [B, max_pages];
    token_seq: int32 [N]; indices: int32 [N, K] positions in the row's sequence, -1 = none;
    softmax_scale: multiplies q.k. Returns bf16 [N, H, R], the latent attention output.
    The tile options default to a choice measured on an H200 (see ``benchmarks/dsa``).
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
    block_h = block_h or max(16, min(64, triton.next_power_of_2(n_heads)))
    block_k = block_k or (16 if interpreting else 32)
    v_split = v_split or (1 if interpreting or rank < 512 else 2)
    qk_chunk = min(rank, qk_chunk or 128, group)
    if fp8 and (group % qk_chunk or (rank // v_split) % min(group, rank // v_split)):
        raise ValueError(f"qk_chunk {qk_chunk} and output slice {rank // v_split} must align with the "
                         f"scale group {group}")
    num_warps = num_warps or (4 if interpreting else 8)
    num_stages = num_stages or (1 if interpreting else 2)
    grid = (n_rows, triton.cdiv(n_heads, block_h), v_split)
    _sparse_mla_kernel[grid](
        q_nope.contiguous(), q_rope.contiguous(), latent_nope, latent_scale if fp8 else latent_nope,
        latent_rope,
        block_table, token_seq.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous(), out,
        n_heads, topk, block_table.stride(0), softmax_scale * math.log2(math.e),
        RANK=rank, ROPE=rope, V_SPLIT=v_split, QK_CHUNK=qk_chunk, BLOCK_H=block_h, BLOCK_K=block_k,
        PAGE=PAGE_SIZE, FP8=fp8, GROUP=group, UPCAST=interpreting, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def sparse_mla_torch(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_nope: torch.Tensor,
                     latent_scale: torch.Tensor | None, latent_rope: torch.Tensor, block_table: torch.Tensor,
                     token_seq: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                     **_tile_options) -> torch.Tensor:
    """Torch twin of ``sparse_mla`` (fp32 math on dequantized rows; tile options ignored)."""
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
        if scale is not None:
            kv = kv.view(len(slots), scale.shape[-1], -1) * scale[slots].unsqueeze(-1)
            kv = kv.view(len(slots), rank)
        logits = (q_nope[row].float() @ kv.T + q_rope[row].float() @ rope[slots].float().T) * softmax_scale
        out[row] = torch.softmax(logits, dim=-1) @ kv
    return out.to(torch.bfloat16)
