"""Row-wise top-k positions of fp32 scores by radix threshold select (Triton), for the DSA indexer.

For each row r of ``scores`` [N, C], over its first ``limits[r]`` columns (the keys row r may
see; -inf scores there count as not visible too), the kernel finds the k-th largest score
exactly and writes the positions of the k largest:

1. every fp32 score becomes a 32-bit key whose unsigned order is the float order (negative
   values: all bits flipped; others: the sign bit set; -0 counts as +0);
2. ``32 / RADIX_BITS`` passes over the row, each a 2**RADIX_BITS-bin histogram (``tl.histogram``)
   of the next digit among the keys that share the digits fixed so far; a suffix sum over the
   bins picks the digit that holds the k-th key. After the last pass the threshold key T and the
   number of T-valued keys still to take are exact;
3. one pass writes every position with key > T, plus the first (lowest-position) keys equal to T
   until k are taken, in ascending position order (a running offset plus a prefix sum per block;
   no atomics, no sort).

Ties at the threshold go to the lowest positions; a row with fewer than k visible keys returns
all of them followed by -1. Output int32 [N, k], ascending positions then -1: the same function
as ``topk_indices_torch`` (stable descending sort), so the two agree exactly.

One program per row. Bytes per row: (32 / RADIX_BITS + 1) reads of 4 * limits[r] bytes (from L2
when the rows were just written and fit in it: a decode step's 64 x 128K scores are 32 MiB, under
the H200's 50 MB L2), 4 * k written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RADIX_BITS = 8
TOPK_BLOCK = 4096


@triton.jit
def _order_key(x):
    """uint32 key of fp32 ``x`` whose unsigned order is the float order (-0 and +0 one key: they tie)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return bits ^ (((bits >> 31) * 0x7FFFFFFF) | 0x80000000)


@triton.jit
def _topk_kernel(scores_ptr, limits_ptr, out_ptr, stride, n_cols, topk,
                 BLOCK: tl.constexpr, BITS: tl.constexpr, ALIGNED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(limits_ptr + row), n_cols)
    if ALIGNED:  # columns and row stride are multiples of 16: read whole 16-column groups (16-byte loads)
        n_read = tl.multiple_of(tl.minimum((n + 15) // 16 * 16, n_cols), 16)
    else:
        n_read = n
    base = scores_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    BINS: tl.constexpr = 1 << BITS
    PASSES: tl.constexpr = 32 // BITS
    bins = tl.arange(0, BINS)
    prefix = tl.zeros([], tl.uint32)
    rem = topk
    take_all = False
    for p in tl.static_range(PASSES):
        shift = 32 - (p + 1) * BITS
        hist = tl.zeros([BINS], tl.int32)
        for start in range(0, n_read, BLOCK):
            pos = start + offs
            x = tl.load(base + pos, mask=pos < n_read, other=float("-inf"))
            key = _order_key(x)
            match = (x != float("-inf")) & (pos < n)
            if p > 0:
                match = match & ((key >> (shift + BITS)) == (prefix >> (shift + BITS)))
            digit = ((key >> shift) & (BINS - 1)).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=match)
        total = tl.sum(hist, axis=0)
        if p == 0:
            take_all = total <= topk
        at_least = total - tl.cumsum(hist, axis=0) + hist  # keys whose digit >= bin
        d = tl.maximum(tl.max(tl.where(at_least >= rem, bins, -1), axis=0), 0)
        rem -= tl.sum(tl.where(bins == d, at_least - hist, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << shift)
    threshold = tl.where(take_all, tl.zeros([], tl.uint32), prefix)
    rem = tl.where(take_all, 0, rem)
    out_base = out_ptr + row * topk
    written = 0
    ties_seen = 0
    for start in range(0, n_read, BLOCK):
        pos = start + offs
        x = tl.load(base + pos, mask=pos < n_read, other=float("-inf"))
        key = _order_key(x)
        valid = (x != float("-inf")) & (pos < n)
        above = valid & (key > threshold)
        tie = valid & (key == threshold)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = above | (tie & (tie_rank < rem))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_base + slot, pos, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
    for start in range(written, topk, BLOCK):
        pos = start + offs
        tl.store(out_base + pos, tl.full([BLOCK], -1, tl.int32), mask=pos < topk)


def topk_indices(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor | None = None,
                 block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Positions of the ``topk`` largest scores of each row among its visible columns (Triton).

    scores: fp32 [N, C] (row stride free, unit column stride); limits: int [N], row r sees columns
    < min(limits[r], C), and -inf scores count as not visible; ``out``: optional int32 [N, topk]
    to write into. Returns int32 [N, topk]: ascending positions, then -1 when fewer than ``topk``
    are visible; ties at the k-th score go to the lowest positions. No host sync (capturable in a
    CUDA graph). ``block`` scores per loop step (default 4096), ``num_warps`` per row (default 8).
    """
    n_rows, n_cols = scores.shape
    if scores.dtype != torch.float32 or (n_cols > 1 and scores.stride(1) != 1):
        raise ValueError("topk_indices needs fp32 scores with unit column stride")
    if out is None:
        out = torch.empty(n_rows, topk, dtype=torch.int32, device=scores.device)
    if n_rows == 0 or topk == 0:
        return out
    _topk_kernel[(n_rows,)](scores, limits.to(torch.int32).contiguous(), out, scores.stride(0), n_cols, topk,
                            BLOCK=block or TOPK_BLOCK, BITS=RADIX_BITS,
                            ALIGNED=n_cols % 16 == 0 and scores.stride(0) % 16 == 0, num_warps=num_warps or 8)
    return out


def topk_indices_torch(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor | None = None,
                       **_tile_options) -> torch.Tensor:
    """Torch twin of ``topk_indices`` (stable descending sort; tile options ignored)."""
    n_rows, n_cols = scores.shape
    cols = torch.arange(n_cols, device=scores.device)
    visible = (cols[None, :] < limits.to(scores.device)[:, None].long()) & (scores != float("-inf"))
    masked = torch.where(visible, scores.float(), float("-inf"))
    values, order = torch.sort(masked, dim=1, descending=True, stable=True)
    k = min(topk, n_cols)
    chosen = torch.where(values[:, :k] == float("-inf"), n_cols, order[:, :k])
    chosen = torch.sort(chosen, dim=1).values
    if out is None:
        out = torch.empty(n_rows, topk, dtype=torch.int32, device=scores.device)
    out.fill_(-1)
    out[:, :k] = torch.where(chosen == n_cols, -1, chosen).to(torch.int32)
    return out
