"""Paged GQA attention with an optional sliding window and learned sinks: the Triton kernel
``paged_gqa_attention`` and its torch twin ``paged_gqa_attention_torch`` (same arguments).

Under the interpreter bf16 dot operands are upcast to fp32 (``UPCAST``); fp32 dots use IEEE
precision, never TF32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from adapt.kernels.formats import PAGE_SIZE, slots_of
from adapt.kernels.formats import interpreting as _interpreting


@triton.jit
def paged_gqa_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    sink_ptr,
    block_table_ptr,
    seq_ptr,
    pos_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    out_ptr,
    bt_stride,
    n_heads,
    qk_scale_log2,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # one program: up to BLOCK_M consecutive query rows of one sequence x the GROUP query heads of
    # one kv head, flattened into BLOCK_M * GROUP_PAD rows of the score tile
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.load(tile_start_ptr + tile)
    count = tl.load(tile_rows_ptr + tile)
    m = tl.arange(0, BLOCK_M * GROUP_PAD)
    row_in_tile = m // GROUP_PAD
    head_in_group = m % GROUP_PAD
    valid = (row_in_tile < count) & (head_in_group < GROUP)
    rows = first + row_in_tile
    heads = kv_head * GROUP + head_in_group
    d = tl.arange(0, DIM)
    q = tl.load(
        q_ptr + (rows[:, None] * n_heads + heads[:, None]) * DIM + d[None, :], mask=valid[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + rows, mask=valid, other=0)
    seq = tl.load(seq_ptr + first)
    hi = tl.load(pos_ptr + first + count - 1) + 1
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.load(pos_ptr + first) - window + 1, 0)
    if HAS_SINK:
        m_i = tl.load(sink_ptr + heads, mask=valid, other=0.0) * 1.4426950408889634
        l_i = tl.where(valid, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        pmask = p < hi
        page = tl.load(block_table_ptr + seq * bt_stride + p // PAGE, mask=pmask, other=0)
        slot = page.to(tl.int64) * PAGE + p % PAGE
        offs = (slot[:, None] * KV_HEADS + kv_head) * DIM + d[None, :]
        k = tl.load(k_ptr + offs, mask=pmask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=pmask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = valid[:, None] & pmask[None, :] & (p[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (p[None, :] > pos[:, None] - window)
        s = tl.where(visible, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (rows[:, None] * n_heads + heads[:, None]) * DIM + d[None, :], out, mask=valid[:, None]
    )


def paged_gqa_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal GQA over the paged cache with an optional sliding window and sinks (Triton).

    q: [N, H, D] (the step's N new tokens, grouped by sequence, D a power of two >= 16); k_pool,
    v_pool: [pages, 64, KV, D] (fp32 or bf16), the new tokens already written; block_table: int32
    [B, P] pages of each sequence (slot addressing: ``adapt.kernels.formats``); token_seq: [N]
    sequence of each query row; positions: int64 [N] query positions; query_starts: int64 [B + 1]
    row offsets of the sequences; sinks: [H] or None; window: keys with position > query
    position - window are visible (None: all earlier keys). Returns fp32 [N, H, D].

    A program takes up to BLOCK_M consecutive query rows of one sequence times the H/KV query
    heads of one kv head (BLOCK_M * pow2(H/KV) rows of the score tile, at least 16), walks the
    keys the tile can see in blocks of 64 with an online softmax (base 2), and starts each row's
    softmax at its sink (running max = sink, sum = 1) when there are sinks. FLOPs:
    4 * D per (query head, visible key); bytes: 2 * D * itemsize per (kv head, key in the tile's
    span) and tile.
    """
    n, heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    out = torch.empty(n, heads, dim, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    group = heads // kv_heads
    group_pad = 1 << (group - 1).bit_length()
    block_m = max(1, max(16, min(128, 16 * group_pad)) // group_pad)
    starts, counts = [], []
    bounds = query_starts.tolist()
    for b in range(len(bounds) - 1):
        for first in range(bounds[b], bounds[b + 1], block_m):
            starts.append(first)
            counts.append(min(block_m, bounds[b + 1] - first))
    device = q.device
    sink = (sinks if sinks is not None else torch.zeros(heads, device=device)).float().contiguous()
    paged_gqa_kernel[(len(starts), kv_heads)](
        q.contiguous(),
        k_pool,
        v_pool,
        sink,
        block_table,
        token_seq.to(torch.int32).contiguous(),
        positions.contiguous(),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(counts, dtype=torch.int32, device=device),
        out,
        block_table.stride(0),
        heads,
        scale * math.log2(math.e),
        window or 0,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        KV_HEADS=kv_heads,
        DIM=dim,
        BLOCK_N=PAGE_SIZE,
        PAGE=PAGE_SIZE,
        HAS_SINK=sinks is not None,
        HAS_WINDOW=window is not None,
        UPCAST=_interpreting() or q.dtype == torch.float32,
        num_warps=4,
    )
    return out


def paged_gqa_attention_torch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Torch twin of ``paged_gqa_attention`` (same arguments): per sequence, the keys at positions
    0..last query position gathered from the pages, masked causally (and by the window), softmax with
    the sink as an extra logit, in q's dtype (softmax in fp32). Returns [N, H, D] in q's dtype."""
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    bounds = query_starts.tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if start == end:
            continue
        qpos = positions[start:end]
        kpos = torch.arange(int(qpos.max()) + 1, device=q.device)
        slots = slots_of(block_table[b], kpos)
        keys = k_pool.view(-1, *k_pool.shape[2:])[slots].to(q.dtype).repeat_interleave(group, dim=1)
        values = v_pool.view(-1, *v_pool.shape[2:])[slots].to(q.dtype).repeat_interleave(group, dim=1)
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= kpos[None, :] > qpos[:, None] - window
        logits = torch.einsum("nhd,lhd->hnl", q[start:end], keys) * scale
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        if sinks is not None:
            sink = sinks.to(logits.dtype).view(-1, 1, 1).expand(-1, logits.shape[1], 1)
            full = torch.cat([logits, sink], dim=-1)
            full = full - full.amax(dim=-1, keepdim=True)
            probs = torch.softmax(full.float(), dim=-1)[..., :-1].to(q.dtype)
        else:
            probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        out[start:end] = torch.einsum("hnl,lhd->nhd", probs, values)
    return out
