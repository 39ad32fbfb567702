"""Row-wise top-k positions of fp32 scores by radix threshold select (Triton), for the DSA indexer.

For each row r of ``scores`` [N, C], over its first ``limits[r]`` columns (the keys row r may
see; -inf scores there count as not visible too), the kernels find the k-th largest score
exactly and write the positions of the k largest:

1. every fp32 score becomes a 32-bit key whose unsigned order is the float order (negative
   values: all bits flipped; others: the sign bit set; -0 counts as +0);
2. ``32 / digit_bits`` radix passes. Each row is cut into slices of ``slice_size`` scores, one
   program per (row, slice): ``_digit_hist_kernel`` counts the next digit (2**digit_bits bins,
   ``tl.histogram``) among the keys that share the digits fixed so far and adds its counts to the
   row's histogram (one atomic per bin); ``_digit_pick_kernel`` (one program per row) takes the
   suffix sum over the bins, fixes the digit that holds the k-th key and clears the histogram.
   After the last pass the threshold key T and the number of T-valued keys still to take are exact;
3. ``_slice_count_kernel`` counts, per slice, the keys above T and equal to T;
   ``_slice_write_kernel`` writes each slice's positions at the offset its earlier slices leave:
   every position with key > T, plus the lowest-position keys equal to T until k are taken,
   in ascending position order (prefix sums, no sort).

Ties at the threshold go to the lowest positions; a row with fewer than k visible keys returns
all of them followed by -1. Output int32 [N, k], ascending positions then -1: the same function
as ``topk_indices_torch`` (stable descending sort), so the two agree exactly.

Launches: 2 * 32 / digit_bits + 2, no host sync (capturable in a CUDA graph). Bytes per row:
(32 / digit_bits + 2) reads of 4 * limits[r] bytes (from L2 when the rows were just written and
fit in it: a decode step's 64 x 128K scores are 32 MiB, under the H200's 50 MB L2), 4 * k written.
A 2**b-bin ``tl.histogram`` costs about b warp ballots plus 2**b / 32 bin counts per 32 keys:
4-bit digits (8 passes) are cheaper in issue slots when many rows fill the GPU, 8-bit digits
(4 passes) need fewer launches when few rows leave it idle. Programs per row: one per slice of
``slice_size`` scores (a one-program-per-row form leaves all but one SM idle per row; its H200
times are in benchmarks/gpu-2026-11-30-dsa/README.md).

``topk_grid`` (a few rows: the batch-1 decode step, capturable) returns the same positions from one launch whose
programs meet at grid barriers instead of kernel boundaries (see the comment above GRID_CAP).

``topk_decode`` (decode batches, capturable) returns the same positions with two launches: a sampled
threshold and one candidate pass over each row, then a select over the few thousand candidates, with
rows the sample misjudged selected again from their full scores inside the same select kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapt.kernels import pdl
from adapt.kernels.formats import interpreting as _interpreting
from adapt.kernels.formats import is_sm90

TOPK_BLOCK = 1024


@triton.jit
def _order_key(x):
    """uint32 key of fp32 ``x`` whose unsigned order is the float order (-0 and +0 one key: they tie)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return bits ^ (((bits >> 31) * 0x7FFFFFFF) | 0x80000000)


@triton.jit
def _row_extent(limits_ptr, row, n_cols, ALIGNED: tl.constexpr):
    """(visible columns n, columns read n_read): with ALIGNED, n rounded up to 16 (16-byte loads)."""
    n = tl.minimum(tl.load(limits_ptr + row), n_cols)
    if ALIGNED:
        n_read = tl.multiple_of(tl.minimum((n + 15) // 16 * 16, n_cols), 16)
    else:
        n_read = n
    return n, n_read


@triton.jit
def _slice_keys(base, pos, n, n_read):
    """Keys of the scores at ``pos`` and whether each is visible (pos < n and not -inf)."""
    x = tl.load(base + pos, mask=pos < n_read, other=float("-inf"))
    return _order_key(x), (x != float("-inf")) & (pos < n)


@triton.jit
def _digit_hist_kernel(scores_ptr, limits_ptr, state_ptr, hist_ptr, stride, n_cols,
                       SLICE: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, PASS: tl.constexpr,
                       ALIGNED: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    n, n_read = _row_extent(limits_ptr, row, n_cols, ALIGNED)
    BINS: tl.constexpr = 1 << BITS
    shift = 32 - (PASS + 1) * BITS
    bins = tl.arange(0, BINS)
    offs = tl.arange(0, BLOCK)
    base = scores_ptr + row * stride
    lo = tl.program_id(1) * SLICE
    hi = tl.minimum(lo + SLICE, n_read)
    if PASS > 0:
        prefix = tl.load(state_ptr + row * 4).to(tl.uint32, bitcast=True)
        hi = tl.where(tl.load(state_ptr + row * 4 + 2) != 0, lo, hi)  # row already settled
    hist = tl.zeros([BINS], tl.int32)
    for start in range(lo, hi, BLOCK):
        key, match = _slice_keys(base, start + offs, n, n_read)
        if PASS > 0:
            match = match & ((key >> (shift + BITS)) == (prefix >> (shift + BITS)))
        hist += tl.histogram(((key >> shift) & (BINS - 1)).to(tl.int32), BINS, mask=match)
    tl.atomic_add(hist_ptr + row * BINS + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _zero_rows_kernel(ptr, WIDTH: tl.constexpr, PDL: tl.constexpr = False):
    """Row ``program_id(0)`` of an int32 [N, WIDTH] buffer set to zero (the radix histogram, in the PDL chain)."""
    pdl.enter(PDL)
    tl.store(ptr + tl.program_id(0).to(tl.int64) * WIDTH + tl.arange(0, WIDTH), tl.zeros([WIDTH], tl.int32))


@triton.jit
def _digit_pick_kernel(hist_ptr, state_ptr, topk, BITS: tl.constexpr, PASS: tl.constexpr, PDL: tl.constexpr = False):
    """Row state (int32 [4]): threshold key bits fixed so far, keys still to take at the
    threshold, settled (every visible key taken: fewer than k), unused."""
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    BINS: tl.constexpr = 1 << BITS
    shift = 32 - (PASS + 1) * BITS
    bins = tl.arange(0, BINS)
    hist = tl.load(hist_ptr + row * BINS + bins)
    tl.store(hist_ptr + row * BINS + bins, tl.zeros([BINS], tl.int32))
    total = tl.sum(hist, axis=0)
    if PASS == 0:
        prefix = tl.zeros([], tl.uint32)
        rem = tl.zeros([], tl.int32) + topk
        settled = total <= topk
    else:
        prefix = tl.load(state_ptr + row * 4).to(tl.uint32, bitcast=True)
        rem = tl.load(state_ptr + row * 4 + 1)
        settled = tl.load(state_ptr + row * 4 + 2) != 0
    at_least = total - tl.cumsum(hist, axis=0) + hist  # keys whose digit >= bin
    d = tl.maximum(tl.max(tl.where(at_least >= rem, bins, -1), axis=0), 0)
    rem = rem - tl.sum(tl.where(bins == d, at_least - hist, 0), axis=0)
    prefix = prefix | (d.to(tl.uint32) << shift)
    tl.store(state_ptr + row * 4, tl.where(settled, 0, prefix.to(tl.int32, bitcast=True)))
    tl.store(state_ptr + row * 4 + 1, tl.where(settled, 0, rem))
    tl.store(state_ptr + row * 4 + 2, settled.to(tl.int32))


@triton.jit
def _slice_count_kernel(scores_ptr, limits_ptr, state_ptr, counts_ptr, stride, n_cols, n_parts,
                        SLICE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n, n_read = _row_extent(limits_ptr, row, n_cols, ALIGNED)
    threshold = tl.load(state_ptr + row * 4).to(tl.uint32, bitcast=True)
    offs = tl.arange(0, BLOCK)
    base = scores_ptr + row * stride
    lo = part * SLICE
    above = 0
    ties = 0
    for start in range(lo, tl.minimum(lo + SLICE, n_read), BLOCK):
        key, valid = _slice_keys(base, start + offs, n, n_read)
        above += tl.sum((valid & (key > threshold)).to(tl.int32), axis=0)
        ties += tl.sum((valid & (key == threshold)).to(tl.int32), axis=0)
    tl.store(counts_ptr + (row * n_parts + part) * 2, above)
    tl.store(counts_ptr + (row * n_parts + part) * 2 + 1, ties)


@triton.jit
def _slice_write_kernel(scores_ptr, limits_ptr, state_ptr, counts_ptr, out_ptr, stride, n_cols, n_parts, topk,
                        SLICE: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, ALIGNED: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n, n_read = _row_extent(limits_ptr, row, n_cols, ALIGNED)
    threshold = tl.load(state_ptr + row * 4).to(tl.uint32, bitcast=True)
    rem = tl.load(state_ptr + row * 4 + 1)
    parts = tl.arange(0, PARTS)
    c_above = tl.load(counts_ptr + (row * n_parts + parts) * 2, mask=parts < n_parts, other=0)
    c_ties = tl.load(counts_ptr + (row * n_parts + parts) * 2 + 1, mask=parts < n_parts, other=0)
    ties_seen = tl.sum(tl.where(parts < part, c_ties, 0), axis=0)
    written = tl.sum(tl.where(parts < part, c_above, 0), axis=0) + tl.minimum(ties_seen, rem)
    offs = tl.arange(0, BLOCK)
    base = scores_ptr + row * stride
    out_base = out_ptr + row * topk
    lo = part * SLICE
    for start in range(lo, tl.minimum(lo + SLICE, n_read), BLOCK):
        pos = start + offs
        key, valid = _slice_keys(base, pos, n, n_read)
        tie = valid & (key == threshold)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = (valid & (key > threshold)) | (tie & (tie_rank < rem))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_base + slot, pos, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
    if part == 0:  # -1 after the selected positions when fewer than k are visible
        selected = tl.sum(c_above, axis=0) + tl.minimum(tl.sum(c_ties, axis=0), rem)
        for start in range(selected, topk, BLOCK):
            pos = start + offs
            tl.store(out_base + pos, tl.full([BLOCK], -1, tl.int32), mask=pos < topk)


def topk_indices(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor | None = None,
                 digit_bits: int | None = None, slice_size: int | None = None, block: int | None = None,
                 num_warps: int | None = None) -> torch.Tensor:
    """Positions of the ``topk`` largest scores of each row among its visible columns (Triton).

    scores: fp32 [N, C] (row stride free, unit column stride); limits: int [N], row r sees columns
    < min(limits[r], C), and -inf scores count as not visible; ``out``: optional int32 [N, topk]
    to write into. Returns int32 [N, topk]: ascending positions, then -1 when fewer than ``topk``
    are visible; ties at the k-th score go to the lowest positions. No host sync (capturable in a
    CUDA graph). ``digit_bits`` per radix pass, 4 or 8 (default: 8 for at most 8 rows or under the
    interpreter, else 4);
    ``slice_size`` scores per program (default: 4096, or 1024 when fewer than 264 programs would
    run); ``block`` scores per loop step (default 1024); ``num_warps`` per program (default 4).
    Workspace: N * (2**digit_bits + 4 + 2 * C / slice_size) int32.
    """
    n_rows, n_cols = scores.shape
    if scores.dtype != torch.float32 or (n_cols > 1 and scores.stride(1) != 1):
        raise ValueError("topk_indices needs fp32 scores with unit column stride")
    interpreting = _interpreting()  # the interpreter's cost is per launch: fewer passes
    bits = digit_bits or (8 if n_rows <= 8 or interpreting else 4)
    if bits not in (4, 8):
        raise ValueError(f"digit_bits must be 4 or 8, not {bits}")
    if out is None:
        out = torch.empty(n_rows, topk, dtype=torch.int32, device=scores.device)
    if n_rows == 0 or topk == 0:
        return out
    block = block or TOPK_BLOCK
    size = slice_size or (4096 if n_rows * triton.cdiv(n_cols, 4096) >= 264 else 1024)
    size = max(block, triton.cdiv(size, block) * block)
    parts = max(1, triton.cdiv(n_cols, size))
    chain = pdl.launch_options(scores.device)  # programmatic dependent launch of the passes (on sm_90 and newer)
    if chain["PDL"]:  # the zeroing joins the chain (torch's fill kernel would wait for the whole kernel before)
        hist = torch.empty(n_rows, 1 << bits, dtype=torch.int32, device=scores.device)
        _zero_rows_kernel[(n_rows,)](hist, WIDTH=1 << bits, num_warps=1, **chain)
    else:
        hist = torch.zeros(n_rows, 1 << bits, dtype=torch.int32, device=scores.device)
    state = torch.empty(n_rows, 4, dtype=torch.int32, device=scores.device)
    counts = torch.empty(n_rows, parts, 2, dtype=torch.int32, device=scores.device)
    limits = limits.to(torch.int32).contiguous()
    aligned = n_cols % 16 == 0 and scores.stride(0) % 16 == 0
    warps = num_warps or 4
    for p in range(32 // bits):
        _digit_hist_kernel[(n_rows, parts)](scores, limits, state, hist, scores.stride(0), n_cols, SLICE=size,
                                            BLOCK=block, BITS=bits, PASS=p, ALIGNED=aligned, num_warps=warps,
                                            **chain)
        _digit_pick_kernel[(n_rows,)](hist, state, topk, BITS=bits, PASS=p, num_warps=1, **chain)
    _slice_count_kernel[(n_rows, parts)](scores, limits, state, counts, scores.stride(0), n_cols, parts, SLICE=size,
                                         BLOCK=block, ALIGNED=aligned, num_warps=warps, **chain)
    _slice_write_kernel[(n_rows, parts)](scores, limits, state, counts, out, scores.stride(0), n_cols, parts, topk,
                                         SLICE=size, BLOCK=block, PARTS=triton.next_power_of_2(parts),
                                         ALIGNED=aligned, num_warps=warps, **chain)
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


# One-launch select for a few rows (the batch-1 decode step): the radix select's result from one kernel whose
# programs meet at grid barriers instead of kernel boundaries. Each program holds its slice's keys in registers for
# the whole select (loaded once). Three barriers in the common case:
# 1. the top 8 bits of the threshold key: a 256-bin histogram per program, one atomic per non-empty bin into the
#    row's, a barrier, then every program picks the bin from the same histogram;
# 2. the next 8 bits the same way, over the keys in that bin;
# 3. each program stores how many of its keys lie above that 16-bit bin and appends the low 16 bits of its keys inside
#    it (with its index) to the row's candidate list (an atomic counter hands out the slots); after the barrier every
#    program finds the exact threshold among the candidates (three sweeps over the list, 256 at a time) and the
#    offset its positions start at, and writes them.
# When the bin holds more than CAP keys of the row (heavy ties, or very narrow scores), the row takes two more 8-bit
# passes over the low 16 bits and a count (three barriers more), as ``topk_indices`` does.
# H200, 2026-12-02, 1 x 128K, top-2048 (benchmarks/gpu-2026-12-02-dsa-s12): the kernel takes 13.4 us at 8 warps (14.0
# at 4) against 20.7 us for ``topk_indices``' eleven; the batch-1 step takes it (``dsa.FEW_ROWS_SELECT``). A grid
# barrier alone costs about 0.5 us; one 65,536-bin histogram filled by one atomic a key made the kernel 27.7 us
# (hot bins serialise), hence two aggregated 8-bit passes.
GRID_CAP = 4096
GRID_MAX_SLICE = 8192  # keys a program holds at most (registers); wider rows go to ``topk_indices``
GRID_MAX_PARTS = 256
_GRID_FIXED = 256 + 256 + 2 * 256 + 32  # zeroed: coarse + fine histograms, the low passes' two, the barrier


def grid_work(parts: int, cap: int = GRID_CAP) -> int:
    """int32 workspace per row of ``topk_grid``: the zeroed histograms, barrier and candidate counters, then per
    program the count above the 16-bit bin and the count pass's two counts, then the row's CAP candidates."""
    return _GRID_FIXED + parts * 3 + cap


@triton.jit
def _load_acquire(ptr):
    """int32 at ``ptr``, read with gpu-scope acquire (CUDA only: the interpreter never reaches a barrier)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Every program of the row arrives at ``bar_ptr`` (a gpu-scope release after the program's own threads met),
    then waits until ``target`` programs in all have arrived (gpu-scope acquire reads). Needs every program of the
    row resident at once: ``grid_parts`` keeps rows x programs within the SM count."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    while _load_acquire(bar_ptr) < target:
        pass
    tl.debug_barrier()


@triton.jit
def _grid_pick(hist, bins, prefix, rem, settled, topk, shift, FIRST: tl.constexpr, PACKED: tl.constexpr = False):
    """``_digit_pick_kernel``'s step on a 256-bin histogram held in registers. PACKED: two CTA-wide reductions
    instead of four (a suffix sum, then one max over (bin, keys above the bin) packed in 64 bits); the same digit
    and count wherever some bin holds the ``rem``-th key (a settled row's values are discarded by the caller)."""
    if PACKED:
        at_least = tl.cumsum(hist, axis=0, reverse=True)  # keys whose digit >= bin
        if FIRST:
            settled = tl.max(at_least, axis=0) <= topk
        packed = tl.where(at_least >= rem, (bins.to(tl.int64) << 32) | (at_least - hist).to(tl.int64), -1)
        best = tl.max(packed, axis=0)
        d = tl.maximum(best >> 32, 0).to(tl.int32)
        rem = rem - tl.where(best >= 0, best & 0xFFFFFFFF, 0).to(tl.int32)
    else:
        total = tl.sum(hist, axis=0)
        if FIRST:
            settled = total <= topk
        at_least = total - tl.cumsum(hist, axis=0) + hist  # keys whose digit >= bin
        d = tl.maximum(tl.max(tl.where(at_least >= rem, bins, -1), axis=0), 0)
        rem = rem - tl.sum(tl.where(bins == d, at_least - hist, 0), axis=0)
    prefix = prefix | (d.to(tl.uint32) << shift)
    return prefix, rem, settled


@triton.jit
def _grid_write(key, vis, pos, threshold, rem, written, ties_seen, out_base, PACKED: tl.constexpr = False):
    """This program's positions: keys above ``threshold``, and ties at it while the row's tie rank (``ties_seen``
    in earlier programs) is below ``rem``, in ascending order from slot ``written``. PACKED: one prefix sum over
    (above, tie) counts packed in 64 bits instead of two."""
    tie = vis & (key == threshold)
    above = vis & (key > threshold)
    if PACKED:
        both = tl.cumsum((above.to(tl.int64) << 32) | tie.to(tl.int64), axis=0)
        ties_in = (both & 0xFFFFFFFF).to(tl.int32)  # ties up to and including each key
        take = above | (tie & (ties_seen + ties_in - 1 < rem))
        slot = written + (both >> 32).to(tl.int32) + tl.minimum(ties_in, tl.maximum(rem - ties_seen, 0)) - 1
    else:
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = above | (tie & (tie_rank < rem))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_base + slot, pos, mask=take)


@triton.jit
def _grid_fill(out_base, selected, topk, FILL: tl.constexpr):
    """-1 after the ``selected`` positions (fewer than k visible)."""
    for start in range(selected, topk, FILL):
        fill = start + tl.arange(0, FILL)
        tl.store(out_base + fill, tl.full([FILL], -1, tl.int32), mask=fill < topk)


@triton.jit
def _grid_cand_block(cand, n_cand, start, c0, STEP: tl.constexpr, ONCE: tl.constexpr):
    """Candidates [start, start + STEP) of the row's list (0 past ``n_cand``); ONCE: the first block is ``c0``,
    loaded once before the sweeps (no L2 round trip a sweep for a list of at most STEP candidates)."""
    i = start + tl.arange(0, STEP)
    if ONCE:
        if start == 0:
            c = c0
        else:
            c = tl.load(cand + i, mask=i < n_cand, other=0, volatile=True)
    else:
        c = tl.load(cand + i, mask=i < n_cand, other=0, volatile=True)
    return c, i < n_cand


@triton.jit
def _grid_candidates_kth(cand, n_cand, bins, rem, settled, topk, STEP: tl.constexpr = 256,
                         PACKED: tl.constexpr = False, c0=None, ONCE: tl.constexpr = False):
    """(t, rem): the low 16 bits of the row's threshold key, the ``rem``-th largest of the ``n_cand`` candidates'
    (two 8-bit digits, a sweep over the list each), and how many candidates equal to it are still to take
    (0 and 0 for a settled row). ONCE: the list's first STEP entries are ``c0`` (``_grid_cand_block``)."""
    hist = tl.zeros([256], tl.int32)
    for start in range(0, n_cand, STEP):
        c, ok = _grid_cand_block(cand, n_cand, start, c0, STEP, ONCE)
        hist += tl.histogram((c >> 8) & 255, 256, mask=ok)
    t, rem, settled = _grid_pick(hist, bins, tl.zeros([], tl.uint32), rem, settled, topk, 8, False, PACKED)
    hist = tl.zeros([256], tl.int32)
    for start in range(0, n_cand, STEP):
        c, ok = _grid_cand_block(cand, n_cand, start, c0, STEP, ONCE)
        hist += tl.histogram(c & 255, 256, mask=ok & (((c >> 8) & 255).to(tl.uint32) == (t >> 8)))
    t, rem, settled = _grid_pick(hist, bins, t, rem, settled, topk, 0, False, PACKED)
    return tl.where(settled, 0, t), tl.where(settled, 0, rem)


@triton.jit
def _grid_candidates_before(cand, n_cand, part, t, STEP: tl.constexpr = 256, PACKED: tl.constexpr = False,
                            c0=None, ONCE: tl.constexpr = False):
    """(ties, above) among the candidates of programs before ``part``, and among all: low 16 bits equal to ``t``
    and above it. PACKED: the four counts in one reduction (16 bits each of an int64: at most CAP < 65,536).
    ONCE: as ``_grid_candidates_kth``."""
    ties_seen = 0
    above_seen = 0
    ties_all = 0
    above_all = 0
    for start in range(0, n_cand, STEP):
        c, ok = _grid_cand_block(cand, n_cand, start, c0, STEP, ONCE)
        low16 = (c & 0xFFFF).to(tl.uint32)
        before = ok & ((c >> 16) < part)
        if PACKED:
            four = tl.sum((before & (low16 == t)).to(tl.int64) | ((before & (low16 > t)).to(tl.int64) << 16)
                          | ((ok & (low16 == t)).to(tl.int64) << 32) | ((ok & (low16 > t)).to(tl.int64) << 48), axis=0)
            ties_seen += (four & 0xFFFF).to(tl.int32)
            above_seen += ((four >> 16) & 0xFFFF).to(tl.int32)
            ties_all += ((four >> 32) & 0xFFFF).to(tl.int32)
            above_all += ((four >> 48) & 0xFFFF).to(tl.int32)
        else:
            ties_seen += tl.sum((before & (low16 == t)).to(tl.int32), axis=0)
            above_seen += tl.sum((before & (low16 > t)).to(tl.int32), axis=0)
            ties_all += tl.sum((ok & (low16 == t)).to(tl.int32), axis=0)
            above_all += tl.sum((ok & (low16 > t)).to(tl.int32), axis=0)
    return ties_seen, above_seen, ties_all, above_all


# ``topk_grid``'s candidate list (the keys of the threshold's 16-bit bin: a few tens at batch 1 x 128K) loaded once
# for its three sweeps instead of once a sweep (two fewer L2 round trips on the select's chain). H200, 2026-12-02
# (benchmarks/gpu-2026-12-02-dsa-s14, calls 2 and 6, five rounds in turn, batch-1 step in a graph of 8 layers):
# 39.47-39.52 against 38.28-39.79 us a layer (synced replays), 39.20-39.26 against 39.38-39.39 (back to back, rounds
# 2-5); the same positions.
GRID_CAND_ONCE = True
GRID_PHASES = 7  # the steps of ``_grid_select_kernel`` launched one by one under the interpreter


@triton.jit
def _grid_select_kernel(scores_ptr, limits_ptr, work_ptr, out_ptr, stride, n_cols, topk,
                        SLICE: tl.constexpr, PARTS: tl.constexpr, CAP: tl.constexpr, WORK: tl.constexpr,
                        PHASE: tl.constexpr, ALIGNED: tl.constexpr, FILL: tl.constexpr = 1024,
                        PACKED: tl.constexpr = False, PDL: tl.constexpr = False, CAND_ONCE: tl.constexpr = False):
    """Program (row, part) of ``topk_grid``: the keys of columns [part * SLICE, (part + 1) * SLICE) of the row
    (see the comment above GRID_CAP). PHASE -1: the whole select with grid barriers (CUDA). PHASE p >= 0: only step
    p, the barriers being kernel boundaries (the interpreter runs programs one after another, so a barrier would
    never open): 0 and 1 the two 8-bit passes, 2 the candidates, 3 the write (or the first low pass), 4 the second
    low pass, 5 the count, 6 the write after a low pass; every step re-derives what the steps before it fixed from
    ``work_ptr``. CAND_ONCE: the candidate list's first 256 entries loaded once for the three sweeps over it
    (``_grid_cand_block``)."""
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n, n_read = _row_extent(limits_ptr, row, n_cols, ALIGNED)
    pos = part * SLICE + tl.arange(0, SLICE)
    key, vis = _slice_keys(scores_ptr + row * stride, pos, n, n_read)
    coarse = work_ptr + row * WORK
    fine = coarse + 256
    low = fine + 256  # the low passes' two histograms
    bar = low + 512
    n_cand_ptr = bar + 16
    above_ptr = bar + 32
    counts = above_ptr + PARTS
    cand = counts + 2 * PARTS
    out_base = out_ptr + row * topk
    bins = tl.arange(0, 256)
    hi = key >> 16
    if PHASE < 0 or PHASE == 0:
        hist = tl.histogram((hi >> 8).to(tl.int32), 256, mask=vis)
        tl.atomic_add(coarse + bins, hist, mask=hist > 0, sem="relaxed")
    if PHASE < 0:
        _grid_barrier(bar, PARTS)
    if PHASE < 0 or PHASE >= 1:
        prefix, rem, settled = _grid_pick(tl.load(coarse + bins, volatile=True), bins, tl.zeros([], tl.uint32),
                                          tl.zeros([], tl.int32) + topk, False, topk, 24, True, PACKED)
        if PHASE < 0 or PHASE == 1:
            hist = tl.histogram((hi & 255).to(tl.int32), 256, mask=vis & ((hi >> 8) == (prefix >> 24)))
            tl.atomic_add(fine + bins, hist, mask=hist > 0, sem="relaxed")
        if PHASE < 0:
            _grid_barrier(bar, 2 * PARTS)
    if PHASE < 0 or PHASE >= 2:
        prefix, rem, settled = _grid_pick(tl.load(fine + bins, volatile=True), bins, prefix, rem, settled, topk, 16,
                                          False, PACKED)
        p16 = tl.where(settled, 0, prefix >> 16)
        rem = tl.where(settled, 0, rem)
        if PHASE < 0 or PHASE == 2:
            inside = vis & (hi == p16)
            tl.store(above_ptr + part, tl.sum((vis & (hi > p16)).to(tl.int32), axis=0))
            n_inside = tl.sum(inside.to(tl.int32), axis=0)
            first = tl.atomic_add(n_cand_ptr, n_inside, sem="relaxed")
            slot = first + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(cand + slot, (part << 16) | (key & 0xFFFF).to(tl.int32), mask=inside & (slot < CAP))
        if PHASE < 0:
            _grid_barrier(bar, 3 * PARTS)
        if PHASE < 0 or PHASE >= 3:
            parts = tl.arange(0, PARTS)
            n_cand = tl.load(n_cand_ptr, volatile=True)
            if n_cand <= CAP:  # the threshold among the row's candidates
                if PHASE < 0 or PHASE == 3:
                    if CAND_ONCE:
                        c0 = tl.load(cand + bins, mask=bins < n_cand, other=0, volatile=True)
                    else:
                        c0 = bins
                    t, crem = _grid_candidates_kth(cand, n_cand, bins, rem, settled, topk, 256, PACKED, c0, CAND_ONCE)
                    ties_seen, above_seen, ties_all, above_all = _grid_candidates_before(cand, n_cand, part, t, 256,
                                                                                         PACKED, c0, CAND_ONCE)
                    above = tl.load(above_ptr + parts, volatile=True)
                    written = tl.sum(tl.where(parts < part, above, 0), axis=0) + above_seen
                    written += tl.minimum(ties_seen, crem)
                    _grid_write(key, vis, pos, (p16 << 16) | t, crem, written, ties_seen, out_base, PACKED)
                    if part == 0:
                        selected = tl.sum(above, axis=0) + above_all + tl.minimum(ties_all, crem)
                        _grid_fill(out_base, selected, topk, FILL)
            else:  # too many keys in the bin: two 8-bit passes over the low 16 bits, then a count
                prefix = p16 << 16
                for p in tl.static_range(2):
                    shift = 8 - 8 * p
                    if PHASE < 0 or PHASE == 3 + p:
                        match = vis & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                        hist = tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
                        tl.atomic_add(low + p * 256 + bins, hist, mask=hist > 0, sem="relaxed")
                    if PHASE < 0:
                        _grid_barrier(bar, (4 + p) * PARTS)
                    if PHASE < 0 or PHASE > 3 + p:
                        prefix, rem, settled = _grid_pick(tl.load(low + p * 256 + bins, volatile=True), bins, prefix,
                                                          rem, settled, topk, shift, False, PACKED)
                threshold = tl.where(settled, 0, prefix)
                rem = tl.where(settled, 0, rem)
                if PHASE < 0 or PHASE == 5:
                    tl.store(counts + part * 2, tl.sum((vis & (key > threshold)).to(tl.int32), axis=0))
                    tl.store(counts + part * 2 + 1, tl.sum((vis & (key == threshold)).to(tl.int32), axis=0))
                if PHASE < 0:
                    _grid_barrier(bar, 6 * PARTS)
                if PHASE < 0 or PHASE == 6:
                    c_above = tl.load(counts + parts * 2, volatile=True)
                    c_ties = tl.load(counts + parts * 2 + 1, volatile=True)
                    ties_seen = tl.sum(tl.where(parts < part, c_ties, 0), axis=0)
                    written = tl.sum(tl.where(parts < part, c_above, 0), axis=0) + tl.minimum(ties_seen, rem)
                    _grid_write(key, vis, pos, threshold, rem, written, ties_seen, out_base, PACKED)
                    if part == 0:
                        selected = tl.sum(c_above, axis=0) + tl.minimum(tl.sum(c_ties, axis=0), rem)
                        _grid_fill(out_base, selected, topk, FILL)


@triton.jit
def _zero_prefix_kernel(ptr, row_stride, width, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Columns [0, width) of row ``program_id(0)`` of an int32 buffer set to zero, BLOCK a program (in the PDL
    chain)."""
    pdl.enter(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + tl.program_id(0).to(tl.int64) * row_stride + cols, tl.zeros([BLOCK], tl.int32), mask=cols < width)


def grid_parts(n_rows: int, n_cols: int, device: torch.device, parts: int | None = None) -> tuple[int, int] | None:
    """(programs per row, keys per program) for ``topk_grid``, or None where it does not apply: every program of
    every row must be resident at once, so rows x programs stays within the SM count (CUDA; the interpreter runs
    the steps as separate launches and takes 16, or ``parts``), a power of two of programs per row up to
    GRID_MAX_PARTS, and at most GRID_MAX_SLICE keys a program. (Two programs an SM, 256 of 512 keys at batch 1,
    were slower: H200, 2026-12-02, benchmarks/gpu-2026-12-02-dsa-s14 call 6, batch-1 step 46.4 us a layer at 8 warps
    and 42.9 at 4 against 39.4.)"""
    if n_rows == 0 or n_cols == 0:
        return None
    if device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).multi_processor_count // n_rows
        if parts is not None:
            budget = min(budget, parts)
    else:
        budget = parts or 16
    if budget < 1:
        return None
    budget = min(GRID_MAX_PARTS, 1 << (budget.bit_length() - 1))
    size = max(16, triton.next_power_of_2(triton.cdiv(n_cols, budget)))
    if size > GRID_MAX_SLICE:
        return None
    return triton.next_power_of_2(triton.cdiv(n_cols, size)), size


def grid_low_pass_rows(work: torch.Tensor) -> torch.Tensor:
    """bool [N]: the rows of a ``topk_grid`` workspace whose select took the two low passes (more than ``cap`` keys
    of the row in the threshold's 16-bit bin) rather than the candidates."""
    return (work[:, 512:1024] != 0).any(dim=1)


def topk_grid(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor | None = None,
              parts: int | None = None, cap: int = GRID_CAP, num_warps: int = 4,
              work: torch.Tensor | None = None, packed: bool = False, cand_once: bool | None = None) -> torch.Tensor:
    """``topk_indices``' result (the same positions, ascending, -1 after them) from one kernel launch plus a
    zeroing one, for a few rows: ``grid_parts`` programs a row meet at three grid barriers (three more for a row
    whose threshold bin holds more than ``cap`` keys; see the comment above GRID_CAP). Rows too wide
    or too many for every program to be resident go to ``topk_indices``. ``parts``: at most this many programs a
    row (default: the SM count over the rows). ``work``: int32 [N, >= grid_work(parts, cap)] to use as the
    workspace (default: a new one). ``packed``: the picks, counts and prefix sums with fewer CTA-wide reductions
    (counts packed in 64-bit words; the same positions; H200: no faster, off by default). ``cand_once``: the
    candidate list's first 256 entries loaded once for the three sweeps over it (None: GRID_CAND_ONCE; the same
    positions). No host sync (capturable)."""
    n_rows, n_cols = scores.shape
    if scores.dtype != torch.float32 or (n_cols > 1 and scores.stride(1) != 1):
        raise ValueError("topk_grid needs fp32 scores with unit column stride")
    shape = grid_parts(n_rows, n_cols, scores.device, parts)
    if shape is None or topk == 0:
        return topk_indices(scores, limits, topk, out=out)
    parts, size = shape
    if out is None:
        out = torch.empty(n_rows, topk, dtype=torch.int32, device=scores.device)
    limits = limits.to(torch.int32).contiguous()
    aligned = n_cols % 16 == 0 and scores.stride(0) % 16 == 0
    chain = pdl.launch_options(scores.device)
    width = grid_work(parts, cap)
    if work is None:
        work = torch.empty(n_rows, width, dtype=torch.int32, device=scores.device)
    elif work.dtype != torch.int32 or work.shape[0] != n_rows or work.shape[1] < width or not work.is_contiguous():
        raise ValueError(f"topk_grid's work must be contiguous int32 [{n_rows}, >= {width}], not "
                         f"{work.dtype} {list(work.shape)}")
    if packed and cap >= 1 << 16:
        raise ValueError(f"topk_grid packs candidate counts in 16 bits: packed needs cap < 65536, not {cap}")
    _zero_prefix_kernel[(n_rows, triton.cdiv(_GRID_FIXED, 4096))](work, work.shape[1], _GRID_FIXED, BLOCK=4096,
                                                                   num_warps=4, **chain)
    once = GRID_CAND_ONCE if cand_once is None else bool(cand_once)
    common = dict(SLICE=size, PARTS=parts, CAP=cap, WORK=work.shape[1], ALIGNED=aligned, PACKED=bool(packed),
                  CAND_ONCE=once, num_warps=num_warps)
    args = (scores, limits, work, out, scores.stride(0), n_cols, topk)
    if _interpreting():  # the barriers as launch boundaries: one launch per step
        for phase in range(GRID_PHASES):
            _grid_select_kernel[(n_rows, parts)](*args, PHASE=phase, **common)
    else:
        _grid_select_kernel[(n_rows, parts)](*args, PHASE=-1, **common, **chain)
    return out


# Prefiltered select for many wide rows (prefill chunks): a sample fixes a threshold below the k-th score,
# one pass keeps the scores at or above it, and the exact select runs over those few candidates.
SAMPLE_SPAN = 1024  # the sample: the first SAMPLE_RUN positions of every SAMPLE_SPAN (1/16 of a row)
SAMPLE_RUN = 64
PREFILTER_EXPECT = 1.5  # candidates aimed at, in units of k (the sample's quantile), ...
PREFILTER_CAPACITY = 2  # ... and the candidate buffer, in units of k (a row past it falls back)
PREFILTER_BLOCK = 2048


@triton.jit
def _candidates_kernel(scores_ptr, limits_ptr, tau_ptr, val_ptr, pos_ptr, count_ptr, stride, n_cols,
                       CAP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the visible scores >= tau[row] (-inf never), in ascending position order,
    into the row's CAP candidate slots (values and positions; -inf / -1 after them); count[row] = how
    many there were (possibly more than CAP: then only the first CAP are stored)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(limits_ptr + row), n_cols)
    tau = tl.load(tau_ptr + row)
    offs = tl.arange(0, BLOCK)
    base = scores_ptr + row * stride
    val_base = val_ptr + row * CAP
    pos_base = pos_ptr + row * CAP
    written = 0
    for start in range(0, n, BLOCK):
        pos = start + offs
        x = tl.load(base + pos, mask=pos < n, other=float("-inf"))
        take = (x >= tau) & (x != float("-inf"))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        keep = take & (slot < CAP)
        tl.store(val_base + slot, x, mask=keep)
        tl.store(pos_base + slot, pos, mask=keep)
        written += tl.sum(take.to(tl.int32), axis=0)
    tl.store(count_ptr + row, written)
    for start in range(tl.minimum(written, CAP), CAP, BLOCK):
        slot = start + offs
        tl.store(val_base + slot, tl.full([BLOCK], float("-inf"), tl.float32), mask=slot < CAP)
        tl.store(pos_base + slot, tl.full([BLOCK], -1, tl.int32), mask=slot < CAP)


def prefilter_applies(n_rows: int, n_cols: int, topk: int) -> bool:
    """Whether ``topk_prefiltered`` can cut the select's work: the sample holds enough scores for its
    quantile and the candidate buffer is well under a row."""
    return n_cols >= 4 * PREFILTER_CAPACITY * topk and n_cols >= 4 * SAMPLE_SPAN and topk > 0 and n_rows > 0


def sample_threshold(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """fp32 [N]: per row a score below which about (1 - PREFILTER_EXPECT * topk / visible) of the row
    lies: the (PREFILTER_EXPECT * topk * SAMPLE_RUN / SAMPLE_SPAN)-th largest of the sample (the first
    SAMPLE_RUN of every SAMPLE_SPAN columns); -inf where the sample holds fewer finite scores."""
    n_rows, n_cols = scores.shape
    spans = n_cols // SAMPLE_SPAN
    runs = scores.as_strided((n_rows, spans, SAMPLE_RUN), (scores.stride(0), SAMPLE_SPAN, 1))  # a view
    sample = runs.reshape(n_rows, spans * SAMPLE_RUN)  # copies the sample only
    k_sample = max(1, -(-int(PREFILTER_EXPECT * topk * SAMPLE_RUN) // SAMPLE_SPAN))
    if k_sample > sample.shape[1]:
        return torch.full((n_rows,), float("-inf"), device=scores.device)
    return torch.topk(sample, k_sample, dim=1, sorted=False).values.amin(dim=1).contiguous()


def topk_prefiltered(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor | None = None,
                     block: int | None = None, num_warps: int | None = None,
                     final: str = "torch") -> tuple[torch.Tensor, int]:
    """Positions of the ``topk`` largest visible scores of each row (the set ``topk_indices`` selects; order
    unspecified, ties at the k-th score arbitrary, -1 where fewer are visible), for many wide rows.

    1. ``sample_threshold``: a threshold tau per row from 1/16 of its columns, aiming at about
       PREFILTER_EXPECT * topk scores >= tau (torch.topk over the sample);
    2. ``_candidates_kernel`` (Triton, one program per row, one read of the visible scores): the scores
       >= tau and their positions, ascending, into PREFILTER_CAPACITY * topk slots;
    3. torch.topk over the candidates. A row is exact when its candidates hold every score >= tau and
       (tau is -inf or there are at least topk of them); any other row (the sample misjudged it: count
       outside [topk, capacity]) is selected again from its full scores (torch.topk), so the result never
       depends on the sample. One host sync (which rows fell back).
    ``final="triton"``: ``topk_indices`` selects in step 3 and for the rows that fall back; the candidates
    being in position order, the result is then ``topk_indices_torch``'s exactly (ascending positions, ties
    at the k-th score to the lowest positions).

    scores fp32 [N, C] (unit column stride), limits int [N]. Returns (int32 [N, topk], rows that fell
    back). Bytes: the visible scores read once (plus 1/16 for the sample), N * capacity * 8 written and
    read back, against several passes over every score for torch.topk.
    """
    n_rows, n_cols = scores.shape
    if scores.dtype != torch.float32 or (n_cols > 1 and scores.stride(1) != 1):
        raise ValueError("topk_prefiltered needs fp32 scores with unit column stride")
    if out is None:
        out = torch.empty(n_rows, topk, dtype=torch.int32, device=scores.device)
    if n_rows == 0 or topk == 0:
        return out, 0
    cap = PREFILTER_CAPACITY * topk
    tau = sample_threshold(scores, topk)
    values = torch.empty(n_rows, cap, dtype=torch.float32, device=scores.device)
    positions = torch.empty(n_rows, cap, dtype=torch.int32, device=scores.device)
    count = torch.empty(n_rows, dtype=torch.int32, device=scores.device)
    _candidates_kernel[(n_rows,)](scores, limits.to(torch.int32).contiguous(), tau, values, positions, count,
                                  scores.stride(0), n_cols, CAP=cap, BLOCK=block or PREFILTER_BLOCK,
                                  num_warps=num_warps or 8)
    if final == "triton":
        j = topk_indices(values, torch.clamp(count, max=cap), topk)
        out.copy_(torch.where(j < 0, -1, positions.gather(1, j.clamp(min=0).long())))
    else:
        best, j = torch.topk(values, topk, dim=1, sorted=False)
        out.copy_(torch.where(best == float("-inf"), -1, positions.gather(1, j)))
    exact = (count <= cap) & ((tau == float("-inf")) | (count >= topk))
    redo = torch.nonzero(~exact).flatten()
    if redo.numel():
        if final == "triton":
            out[redo] = topk_indices(scores[redo], limits[redo].to(scores.device), topk)
            return out, int(redo.numel())
        cols = torch.arange(n_cols, device=scores.device)
        visible = cols[None, :] < limits[redo].to(scores.device).long()[:, None]
        again, at = torch.topk(scores[redo].masked_fill(~visible, float("-inf")), topk, dim=1, sorted=False)
        out[redo] = torch.where(again == float("-inf"), -1, at).to(torch.int32)
    return out, int(redo.numel())


# Decode select for a batch of wide rows inside a captured step: the prefilter idea with every decision on
# the device. Two launches, no host sync, no data-dependent host branch (capturable in a CUDA graph).
DECODE_SAMPLE = 4096  # sampled scores per row (runs of DECODE_SAMPLE_RUN spread evenly over the visible columns)
DECODE_SAMPLE_RUN = 8  # one 32-byte sector per run
# Candidates aimed at, in units of topk (the sample's quantile): 3/2 with one part per row (2 * topk slots);
# 7/4 with more (2 * topk slots per part). A row falls back when its count leaves [topk, slots]: with 4096
# sampled scores at 128K x top-2048 the quantile's relative error is about 1/sqrt(96) ~ 10%, so 3/2 is
# 3.3 of those from either edge and 7/4 is 4.3 from the lower one.
DECODE_EXPECT = {1: (3, 2), 2: (7, 4)}
DECODE_SEG_CAP = 2  # candidate slots per (row, part), in units of topk; a part past it sends its row to the fallback
DECODE_BLOCK = 4096
DECODE_TAU_BITS = 16  # bisection steps for the sample threshold (its top bits; the rest 0)
DECODE_REGISTER_SLOTS = 8192  # candidate slots a select program holds in registers (8 warps: 32 a thread)
DECODE_SELECT_BLOCK = 1024


@triton.jit
def sample_columns(n, i, SAMPLE: tl.constexpr, RUN: tl.constexpr):
    """Columns of entries ``i`` (int32 block) of a row's sample: SAMPLE / RUN runs of RUN columns, one every
    ``span`` columns (span a multiple of RUN covering the n visible columns; columns at or past n are not
    visible)."""
    runs: tl.constexpr = SAMPLE // RUN
    span = tl.maximum(tl.cdiv(tl.cdiv(n, runs), RUN) * RUN, RUN)
    return (i // RUN) * span + i % RUN


@triton.jit
def sample_tau(key, vis, spos, n, topk, EXPECT_NUM: tl.constexpr, EXPECT_DEN: tl.constexpr,
               TAU_BITS: tl.constexpr):
    """Threshold order key (uint32 scalar) from a row's sampled keys ``key`` [SAMPLE] (``vis``: visible) at
    columns ``spos`` of n visible: the k_s-th largest visible sampled key, k_s = ceil(EXPECT * topk * (sampled
    columns < n) / n), rounded down to its top TAU_BITS bits by TAU_BITS bisection steps; 0 (every visible key)
    when the sample holds fewer than k_s visible keys."""
    sampled = tl.sum(vis.to(tl.int32), axis=0)  # visible sampled scores (-inf holes left out)
    in_range = tl.sum((spos < n).to(tl.int64), axis=0)
    want = tl.cdiv(EXPECT_NUM * topk * in_range, EXPECT_DEN * tl.maximum(n, 1).to(tl.int64))
    want = tl.maximum(want, 1)
    tau = tl.zeros([], tl.uint32)
    for b in tl.static_range(TAU_BITS):  # the lower bits stay 0: tau at or below the k_s-th key
        trial = tau | (tl.full([], 1, tl.uint32) << (31 - b))
        hits = tl.sum((vis & (key >= trial)).to(tl.int32), axis=0)
        tau = tl.where(hits >= want, trial, tau)
    return tl.where(want > sampled, 0, tau)


@triton.jit
def order_key(x):
    """``_order_key`` for other modules' kernels (uint32 key whose unsigned order is fp32 ``x``'s order)."""
    return _order_key(x)


@triton.jit
def _decode_candidates_kernel(scores_ptr, limits_ptr, tau_ptr, key_ptr, pos_ptr, count_ptr, stride, n_cols, topk,
                              SAMPLE: tl.constexpr, RUN: tl.constexpr, EXPECT_NUM: tl.constexpr,
                              EXPECT_DEN: tl.constexpr, SEG_CAP: tl.constexpr, PARTS: tl.constexpr,
                              BLOCK: tl.constexpr, ALIGNED: tl.constexpr, TAU_BITS: tl.constexpr,
                              PREFETCH: tl.constexpr):
    """Program (row, part). Every part of a row draws the same sample and threshold key tau: the
    k_s-th largest visible sampled key, k_s = ceil(EXPECT * topk * (sampled columns < n) / n), rounded down to
    its top TAU_BITS bits (sign, exponent and 7 mantissa bits at 16: under 1% of the value, so a few more
    candidates), found by TAU_BITS bisection steps over the sample in registers (tau = 0, i.e. every visible
    key, when the sample holds fewer than k_s visible scores: -inf holes or a short row).
    Then the part's columns (a contiguous 1/PARTS of the row) are read once and its visible keys >= tau go,
    in ascending position order, to the part's SEG_CAP slots (order keys and positions); count = how many
    there were (possibly more than SEG_CAP: only the first SEG_CAP are stored). PREFETCH: the scores of step
    i + 1 are loaded before step i's scan and stores (Triton does not pipeline this loop on its own)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n, n_read = _row_extent(limits_ptr, row, n_cols, ALIGNED)
    base = scores_ptr + row * stride
    spos = sample_columns(n, tl.arange(0, SAMPLE), SAMPLE, RUN)
    key, vis = _slice_keys(base, spos, n, n_read)
    tau = sample_tau(key, vis, spos, n, topk, EXPECT_NUM, EXPECT_DEN, TAU_BITS)
    if part == 0:
        tl.store(tau_ptr + row, tau.to(tl.int32, bitcast=True))
    # the candidate pass over this part's columns
    width = tl.cdiv(tl.cdiv(n_read, PARTS), 16) * 16
    lo = part * width
    hi = tl.minimum(lo + width, n_read)
    seg = row * PARTS + part
    key_base = key_ptr + seg * SEG_CAP
    pos_base = pos_ptr + seg * SEG_CAP
    offs = tl.arange(0, BLOCK)
    written = 0
    if PREFETCH:  # the next step's scores requested before this step's scan and stores (one step in flight)
        if ALIGNED:
            hi = tl.multiple_of(hi, 16)  # (16-byte loads: lo, width and n_read are multiples of 16)
        x = tl.load(base + lo + offs, mask=lo + offs < hi, other=float("-inf"))
        for start in range(lo, hi, BLOCK):
            pos = start + offs
            x_next = tl.load(base + pos + BLOCK, mask=pos + BLOCK < hi, other=float("-inf"))
            written = _emit_candidates(_order_key(x), (x != float("-inf")) & (pos < n), pos, tau, hi, written,
                                       key_base, pos_base, SEG_CAP)
            x = x_next
    else:
        for start in range(lo, hi, BLOCK):
            pos = start + offs
            step_key, step_vis = _slice_keys(base, pos, n, n_read)
            written = _emit_candidates(step_key, step_vis, pos, tau, hi, written, key_base, pos_base, SEG_CAP)
    tl.store(count_ptr + seg, written)


@triton.jit
def _emit_candidates(step_key, step_vis, pos, tau, hi, written, key_base, pos_base, SEG_CAP: tl.constexpr):
    """Store the visible keys >= tau at positions < hi of one step (ascending) after the ``written`` before them
    (those past SEG_CAP slots only counted); returns the new count."""
    take = step_vis & (step_key >= tau) & (pos < hi)
    slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
    keep = take & (slot < SEG_CAP)
    tl.store(key_base + slot, step_key.to(tl.int32, bitcast=True), mask=keep)
    tl.store(pos_base + slot, pos, mask=keep)
    return written + tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _runs_keys(src_ptr, pos_ptr, idx, n, FROM_SCORES: tl.constexpr):
    """(order keys, visible, positions) of entries ``idx`` < n of one run: fp32 scores at column ``idx``
    (FROM_SCORES; -inf not visible) or stored candidate keys and positions."""
    m = idx < n
    if FROM_SCORES:
        x = tl.load(src_ptr + idx, mask=m, other=float("-inf"))
        return _order_key(x), m & (x != float("-inf")), idx
    key = tl.load(src_ptr + idx, mask=m, other=0).to(tl.uint32, bitcast=True)
    return key, m, tl.load(pos_ptr + idx, mask=m, other=-1)


@triton.jit
def _select_runs(src_ptr, pos_ptr, count_ptr, run_stride, run_cap, out_base, topk,
                 RUNS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, FROM_SCORES: tl.constexpr):
    """Exact top-``topk`` of the entries of RUNS runs (run s: min(count[s], run_cap) entries at
    ``src_ptr + s * run_stride``, in ascending position order), by 32 / BITS radix passes with a histogram
    in this program, then one write pass: positions of the keys above the threshold plus the lowest-position
    ties, ascending, then -1 up to ``topk``."""
    BINS: tl.constexpr = 1 << BITS
    bins = tl.arange(0, BINS)
    offs = tl.arange(0, BLOCK)
    prefix = tl.zeros([], tl.uint32)
    rem = tl.zeros([], tl.int32) + topk
    total = tl.zeros([], tl.int32)
    for p in tl.static_range(32 // BITS):
        shift = 32 - (p + 1) * BITS
        hist = tl.zeros([BINS], tl.int32)
        for s in range(RUNS):
            n = tl.minimum(tl.load(count_ptr + s), run_cap)
            for start in range(0, n, BLOCK):
                key, vis, _ = _runs_keys(src_ptr + s * run_stride, pos_ptr + s * run_stride, start + offs, n,
                                         FROM_SCORES)
                if p > 0:
                    vis = vis & ((key >> (shift + BITS)) == (prefix >> (shift + BITS)))
                hist += tl.histogram(((key >> shift) & (BINS - 1)).to(tl.int32), BINS, mask=vis)
        count = tl.sum(hist, axis=0)
        if p == 0:
            total = count
        at_least = count - tl.cumsum(hist, axis=0) + hist  # keys whose digit >= bin
        d = tl.maximum(tl.max(tl.where(at_least >= rem, bins, -1), axis=0), 0)
        rem = rem - tl.sum(tl.where(bins == d, at_least - hist, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << shift)
    settled = total <= topk  # every visible key is taken
    threshold = tl.where(settled, 0, prefix)
    rem = tl.where(settled, topk, rem)
    written = 0
    ties_seen = 0
    for s in range(RUNS):
        n = tl.minimum(tl.load(count_ptr + s), run_cap)
        for start in range(0, n, BLOCK):
            key, vis, pos = _runs_keys(src_ptr + s * run_stride, pos_ptr + s * run_stride, start + offs, n,
                                       FROM_SCORES)
            tie = vis & (key == threshold)
            tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            take = (vis & (key > threshold)) | (tie & (tie_rank < rem))
            slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(out_base + slot, pos, mask=take)
            written += tl.sum(take.to(tl.int32), axis=0)
            ties_seen += tl.sum(tie.to(tl.int32), axis=0)
    for start in range(written, topk, BLOCK):
        slot = start + offs
        tl.store(out_base + slot, tl.full([BLOCK], -1, tl.int32), mask=slot < topk)


# The short select (``fast``): 0 off (the 32-step bisection), 1 one bit a step below the candidates' common
# prefix, 2 two bits a step there. DECODE_REGISTER_WARPS: warps of topk_decode's register and flat select programs
# (16 fits the short select's build in 128 registers). DECODE_PREFETCH: the candidate pass loads step i + 1's scores
# ahead (``topk_decode(prefetch=)``). Timed on one H200, 2026-12-01, 64 x 128K, CUDA graph, every row exact
# (benchmarks/gpu-2026-12-01-dsa-s4-decode/, closing call): the old default 87.7 us, fast 1 81.1, fast 1 with 16 warps
# 81.1, fast 2 with 16 warps 83.9, fast 1 with 16 warps and the prefetch 76.1 (now the default).
FAST_SELECT = 1
DECODE_REGISTER_WARPS = 16
DECODE_PREFETCH = True
# DECODE_GLUON: the candidate pass by ``topk_gluon.decode_candidates_gluon_kernel`` on sm_90 (one layout from load to
# store; the same slots, counts and tau), ``topk_decode(gluon=)``. H200, 2026-12-01, commit 23e9a93, one call
# (benchmarks/gpu-2026-12-01-dsa-s8): batch 64 x 128K candidate pass 56.5 -> 23.8 us, topk_decode 75.4-76.5 ->
# 42.6-43.2 us (graph), the last 4096-row prefill chunk 3.09 -> 1.59 ms, the whole prefill's index_topk 264-266 ->
# 236-239 ms; every row the twin's, the candidates the tl pass's.
DECODE_GLUON = True
# DECODE_GLUON_DEPTH: whole steps the Gluon pass keeps in flight (1 or 2). H200, 2026-12-01, commit 7a70a7c (call 2 of
# benchmarks/gpu-2026-12-01-dsa-s8): batch 64 candidate pass 23.2 us at 1, 23.0 at 2; topk_decode 44.4-44.7 / 44.1-44.3;
# the last prefill chunk 1.65 / 1.63 ms; the whole prefill's index_topk 229.0-232.7 / 228.6-232.1 ms: no gain from
# the second step in flight (and 15% more instructions a step), so 1.
DECODE_GLUON_DEPTH = 1


def _fast_level(fast: int | None) -> int:
    """The short select's level (FAST_SELECT for None); 0, 1 or 2."""
    level = FAST_SELECT if fast is None else int(fast)
    if level not in (0, 1, 2):
        raise ValueError(f"fast must be 0, 1 or 2 (bits a bisection step), not {fast}")
    return level


@triton.jit
def _kth_key(key, m, total, topk, FAST: tl.constexpr):
    """Order key t (uint32 scalar) at which the top ``topk`` of the masked keys ``key`` (uint32, any shape, ``m``
    its mask; ``total`` of them, more than topk) split: the keys above t plus the first ``topk - (keys above t)``
    keys equal to t are the top-k. FAST 0: the k-th largest key, by 32 bisection steps, one block-wide count
    each (unrolled). FAST 1 / 2: the k-th key is searched between the masked keys' min lo and max hi only,
    bisected as offsets above the smallest masked key lo: bit_length(hi - lo) steps of one bit (FAST 1) or half
    as many of two (FAST 2: three trial keys counted by one reduction of int64 counts packed 21 bits apart: at
    most 2^21 - 1 masked keys), a trial past 2^32 - 1 rejected uncounted; the steps stop once exactly topk keys
    are >= the partial key T (then T itself splits them: every key equal to T is taken). E.g. N(0, 1) candidates
    in [1.93, 4.5) (order keys 0xBFF70A3D-0xC0900000): 24 bits against 32, fewer with the early stop."""
    if FAST > 0:
        all_ones = tl.full([], 0xFFFFFFFF, tl.uint32)
        hi = tl.max(tl.where(m, key, 0), axis=None)
        lo = all_ones - tl.max(tl.where(m, all_ones - key, 0), axis=None)  # (no ~ on uint32: the interpreter)
        # free = bit length of hi - lo from its fp32 exponent (rounding up can only add a bit: still exact),
        # rounded up to a multiple of FAST
        bits = (hi - lo).to(tl.float32).to(tl.int32, bitcast=True)
        free = tl.minimum(tl.maximum((bits >> 23) - 126, 0), 32)
        free = free + (free & (FAST - 1))
        threshold = lo  # lo + the offset bits settled so far: at least topk masked keys are >= it
        at_least = total  # masked keys >= threshold
        step = free * 0
        while (step < free // FAST) & (at_least != topk):
            lb = tl.full([], 1, tl.uint32) << (free - FAST - FAST * step).to(tl.uint32)
            t1 = threshold + lb  # below threshold: wrapped past 2^32 - 1 (no key that high): rejected
            if FAST == 1:
                c1 = tl.where(t1 < threshold, 0, tl.sum((m & (key >= t1)).to(tl.int32), axis=None))
                at_least = tl.where(c1 >= topk, c1, at_least)
                threshold = tl.where(c1 >= topk, t1, threshold)
            else:
                t2 = t1 + lb
                t3 = t2 + lb
                counts = tl.sum((m & (key >= t1)).to(tl.int64) + ((m & (key >= t2)).to(tl.int64) << 21)
                                + ((m & (key >= t3)).to(tl.int64) << 42), axis=None)
                c1 = tl.where(t1 < threshold, 0, (counts & 0x1FFFFF).to(tl.int32))
                c2 = tl.where(t2 < threshold, 0, ((counts >> 21) & 0x1FFFFF).to(tl.int32))
                c3 = tl.where(t3 < threshold, 0, (counts >> 42).to(tl.int32))
                at_least = tl.where(c3 >= topk, c3, tl.where(c2 >= topk, c2, tl.where(c1 >= topk, c1, at_least)))
                threshold = tl.where(c3 >= topk, t3, tl.where(c2 >= topk, t2, tl.where(c1 >= topk, t1, threshold)))
            step += 1
    else:
        threshold = tl.zeros([], tl.uint32)
        for b in tl.static_range(32):  # unrolled, as the register select was timed
            trial = threshold | (tl.full([], 1, tl.uint32) << (31 - b))
            hits = tl.sum((m & (key >= trial)).to(tl.int32), axis=None)
            threshold = tl.where(hits >= topk, trial, threshold)
    return threshold


@triton.jit
def _kept_packed(key, m, threshold, topk):
    """(packed int32, rem): per slot 1 for a masked key above ``threshold`` plus 1 << 16 for one equal to it
    (at most 65535 slots: one scan counts both), and rem = topk - keys above (ties to take)."""
    above = (m & (key > threshold)).to(tl.int32)
    return above + ((m & (key == threshold)).to(tl.int32) << 16), topk - tl.sum(above, axis=None)


@triton.jit
def _kept_slots(packed, incl, rem):
    """(take, slot) of ``_kept_packed``'s slots from the inclusive scan ``incl`` of packed (slot order =
    ascending positions): keys above the threshold, then the first ``rem`` ties; slot = output index."""
    excl = incl - packed
    tie_before = excl >> 16
    take = ((packed & 0xFFFF) != 0) | ((packed >= 65536) & (tie_before < rem))
    return take, (excl & 0xFFFF) + tl.minimum(tie_before, rem)


@triton.jit
def _select_in_registers(key_ptr, pos_ptr, count_ptr, out_base, topk, SEG_CAP: tl.constexpr, PARTS: tl.constexpr,
                         PARTS_P2: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """``_select_runs``' result over PARTS runs of at most SEG_CAP stored candidates (order keys, positions),
    all held in registers at once: the k-th key by ``_kth_key`` (FAST > 0: the short bisection), then one write
    of the kept positions (run-major order, i.e. ascending positions; FAST > 0: both counts in one packed
    scan)."""
    part = tl.arange(0, PARTS_P2)[:, None]
    slot_in = tl.arange(0, SEG_CAP)[None, :]
    count = tl.load(count_ptr + part, mask=part < PARTS, other=0)
    m = slot_in < count
    key = tl.load(key_ptr + part * SEG_CAP + slot_in, mask=m, other=0).to(tl.uint32, bitcast=True)
    total = tl.sum(m.to(tl.int32), axis=None)
    threshold = _kth_key(key, m, total, topk, FAST)
    threshold = tl.where(total <= topk, 0, threshold)  # every candidate is taken
    if FAST > 0:
        packed, rem = _kept_packed(key, m, threshold, topk)
        packed_runs = tl.sum(packed, axis=1)
        incl = (tl.cumsum(packed_runs, axis=0) - packed_runs)[:, None] + tl.cumsum(packed, axis=1)
        take, slot = _kept_slots(packed, incl, rem)
        written = tl.minimum(total, topk)
    else:
        above = m & (key > threshold)
        rem = topk - tl.sum(above.to(tl.int32), axis=None)
        tie = (m & (key == threshold)).to(tl.int32)
        tie_runs = tl.sum(tie, axis=1)
        tie_rank = (tl.cumsum(tie_runs, axis=0) - tie_runs)[:, None] + tl.cumsum(tie, axis=1) - 1
        take = above | ((tie != 0) & (tie_rank < rem))
        take_runs = tl.sum(take.to(tl.int32), axis=1)
        slot = (tl.cumsum(take_runs, axis=0) - take_runs)[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
        written = tl.sum(take_runs, axis=0)
    pos = tl.load(pos_ptr + part * SEG_CAP + slot_in, mask=take, other=-1)
    tl.store(out_base + slot, pos, mask=take)
    offs = tl.arange(0, BLOCK)
    for start in range(written, topk, BLOCK):
        tl.store(out_base + start + offs, tl.full([BLOCK], -1, tl.int32), mask=start + offs < topk)


@triton.jit
def _decode_select_kernel(scores_ptr, limits_ptr, tau_ptr, key_ptr, pos_ptr, count_ptr, out_ptr, redo_ptr, stride,
                          n_cols, topk, SEG_CAP: tl.constexpr, PARTS: tl.constexpr, PARTS_P2: tl.constexpr,
                          BLOCK: tl.constexpr, BITS: tl.constexpr, REGISTERS: tl.constexpr,
                          FULL_BLOCK: tl.constexpr, FAST: tl.constexpr):
    """One program per row: exact when every part's candidates were stored and either tau took every visible
    key or at least topk keys are >= tau (then the top-k are all candidates, ties included); it selects over
    the candidates. Any other row (the sample misjudged it) is selected here from its full scores, FULL_BLOCK
    scores a step (5 passes over the row by this one program: slow, but only for that row)."""
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, PARTS_P2)
    counts = tl.load(count_ptr + row * PARTS + parts, mask=parts < PARTS, other=0)
    tau = tl.load(tau_ptr + row)
    exact = (tl.max(counts, axis=0) <= SEG_CAP) & ((tau == 0) | (tl.sum(counts, axis=0) >= topk))
    tl.store(redo_ptr + row, (~exact).to(tl.int32))
    out_base = out_ptr + row * topk
    seg = row * PARTS * SEG_CAP
    if exact:
        if REGISTERS:
            _select_in_registers(key_ptr + seg, pos_ptr + seg, count_ptr + row * PARTS, out_base, topk,
                                 SEG_CAP=SEG_CAP, PARTS=PARTS, PARTS_P2=PARTS_P2, BLOCK=BLOCK, FAST=FAST)
        else:
            _select_runs(key_ptr + seg, pos_ptr + seg, count_ptr + row * PARTS, SEG_CAP, SEG_CAP, out_base, topk,
                         RUNS=PARTS, BLOCK=BLOCK, BITS=BITS, FROM_SCORES=False)
    else:
        _select_runs(scores_ptr + row * stride, pos_ptr, limits_ptr + row, 0, n_cols, out_base, topk, RUNS=1,
                     BLOCK=FULL_BLOCK, BITS=BITS, FROM_SCORES=True)


def decode_parts(n_rows: int, device: torch.device) -> int:
    """Default programs per row of the decode candidate pass: enough rows x parts to cover the SMs once
    (1 to 8; 1 under the interpreter)."""
    if device.type != "cuda" or _interpreting():
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(8, sms // max(n_rows, 1)))


def topk_decode(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, out: torch.Tensor | None = None,
                parts: int | None = None, block: int | None = None, select_block: int | None = None,
                num_warps: int | None = None, digit_bits: int = 8, sample: int | None = None,
                redo: torch.Tensor | None = None, registers: bool | None = None,
                select_warps: int | None = None, flat: bool = False, fast: int | None = None,
                prefetch: bool | None = None, seg_cap: int | None = None, gluon: bool | None = None) -> torch.Tensor:
    """``topk_indices``' result (the same positions, ascending, ties at the k-th score to the lowest
    positions, -1 after them) for a decode batch of wide rows, by a device-side prefilter (Triton, two
    launches, no host sync: capturable in a CUDA graph):

    1. ``_decode_candidates_kernel``, grid (rows, parts): each row's threshold key tau from ``sample``
       scores (runs of 8 spread over its visible columns; aimed at 3/2 * topk candidates with one part per
       row, 7/4 with more), then one read of the row: the visible scores >= tau and their positions,
       ascending, into per-part buffers of 2 * topk slots;
    2. ``_decode_select_kernel``, one program per row: the radix select (``digit_bits`` per pass, histogram
       in the program) over the row's few thousand candidates; a row the sample misjudged (fewer than topk
       candidates above a finite tau, or a part past its slots) is selected by the same program from its
       full scores instead (slow for that row, still exact): the result never depends on the sample.
       ``registers`` (default: when parts x 2 * topk <= DECODE_REGISTER_SLOTS): the candidates are held in
       registers and the k-th key found by 32 bisection steps there (one load), instead of the radix passes
       over them in memory (five loads); ``select_warps`` per select program (default DECODE_REGISTER_WARPS, 4
       for the passes).
    ``flat``: the select is ``select_candidates`` instead (the parts' candidates read as one ascending array of
    FUSED_CAP slots in registers, any number of parts; ``registers``, ``digit_bits`` and ``select_block`` do not
    apply: its full-row select of a misjudged row takes 8-bit digits over DECODE_BLOCK scores a step).
    ``fast`` (default FAST_SELECT; 0, 1 or 2): the register and flat selects find the k-th key by ``_kth_key``'s
    short bisection (``fast`` bits a step below the candidates' common prefix) and count kept keys and ties in
    one scan; 0: the 32-step bisection.
    ``prefetch`` (default DECODE_PREFETCH): the candidate pass loads step i + 1's scores before step i's scan.
    ``gluon`` (default DECODE_GLUON; sm_90 only, elsewhere ignored): the candidate pass is the Gluon kernel
    (``topk_gluon``: the same slots, counts and tau; ``block`` / ``num_warps`` give its step, ``prefetch`` does not
    apply: it always loads ahead).
    ``num_warps`` / ``block`` (scores per loop step): the candidate pass's launch (defaults 8 / 4096; its loop
    is not software-pipelined by Triton: no async copies in the sm_90 build); ``parts`` per row (default
    ``decode_parts``); ``sample`` a power of two. ``seg_cap``: candidate slots per (row, part) (default
    DECODE_SEG_CAP * topk). A part that finds more sends its row to the full-row select, so a smaller cap trades
    workspace and register-select slots (parts x seg_cap) against more such rows; with two parts or more a part
    expects about 7/4 * topk / parts candidates.

    scores fp32 [N, C] (unit column stride), limits int [N] (row r sees columns < limits[r]; -inf scores are
    not visible). ``out``: optional int32 [N, topk]; ``redo``: optional int32 [N] that receives 1 for the
    rows selected from their full scores. Bytes: each visible score read once (plus the sample, 1/32 of a
    128K row), the candidates (8 B each, about 1.5 * topk a row) written and read 5 times from L2;
    workspace N * parts * seg_cap * 8 B.
    """
    n_rows, n_cols = scores.shape
    if scores.dtype != torch.float32 or (n_cols > 1 and scores.stride(1) != 1):
        raise ValueError("topk_decode needs fp32 scores with unit column stride")
    if digit_bits not in (4, 8):
        raise ValueError(f"digit_bits must be 4 or 8, not {digit_bits}")
    if out is None:
        out = torch.empty(n_rows, topk, dtype=torch.int32, device=scores.device)
    if out.shape != (n_rows, topk) or (topk > 1 and out.stride() != (topk, 1)):
        raise ValueError(f"topk_decode writes a contiguous int32 [{n_rows}, {topk}] out, not {tuple(out.shape)} "
                         f"with strides {out.stride()}")
    if redo is None:
        redo = torch.empty(n_rows, dtype=torch.int32, device=scores.device)
    if n_rows == 0 or topk == 0:
        redo.zero_()
        return out
    parts = parts or decode_parts(n_rows, scores.device)
    sample = sample or DECODE_SAMPLE
    if sample & (sample - 1) or sample < DECODE_SAMPLE_RUN:
        raise ValueError(f"sample must be a power of two >= {DECODE_SAMPLE_RUN}, not {sample}")
    fast = _fast_level(fast)  # checked before any allocation or launch
    if seg_cap is not None and seg_cap < 1:
        raise ValueError(f"seg_cap must be a positive number of slots, not {seg_cap}")
    seg_cap = seg_cap or DECODE_SEG_CAP * topk
    slots = triton.next_power_of_2(parts) * seg_cap
    registers = slots <= DECODE_REGISTER_SLOTS and seg_cap & (seg_cap - 1) == 0 if registers is None else registers
    if registers and seg_cap & (seg_cap - 1) and not flat:
        raise ValueError(f"registers=True needs a power-of-two number of slots per part, not {seg_cap}")
    limits = limits.to(torch.int32).contiguous()
    tau, keys, positions, counts = decode_candidates(scores, limits, topk, parts=parts, sample=sample,
                                                     seg_cap=seg_cap, block=block, num_warps=num_warps,
                                                     prefetch=prefetch, gluon=gluon)
    if flat:
        return select_candidates(scores, limits, tau, keys, positions, counts, topk, out=out, redo=redo,
                                 num_warps=select_warps or DECODE_REGISTER_WARPS, fast=fast)
    _decode_select_kernel[(n_rows,)](
        scores, limits, tau, keys, positions, counts, out, redo, scores.stride(0), n_cols, topk, SEG_CAP=seg_cap,
        PARTS=parts, PARTS_P2=triton.next_power_of_2(parts), BLOCK=select_block or DECODE_SELECT_BLOCK,
        BITS=digit_bits, REGISTERS=registers, FULL_BLOCK=block or DECODE_BLOCK,
        FAST=fast, num_warps=select_warps or (DECODE_REGISTER_WARPS if registers else 4))
    return out


def decode_candidates(scores: torch.Tensor, limits: torch.Tensor, topk: int, *, parts: int, sample: int,
                      seg_cap: int, block: int | None = None, num_warps: int | None = None,
                      prefetch: bool | None = None, gluon: bool | None = None):
    """``topk_decode``'s first launch (its options as there; ``limits`` int32, contiguous): (tau int32 [N], keys
    and positions int32 [N, parts, seg_cap], counts int32 [N, parts]): each row's threshold key and each part's
    visible keys >= tau in ascending position order, the first seg_cap of them stored. The Gluon kernel
    (``gluon``, default DECODE_GLUON, sm_90 only) writes the same tau, counts and stored slots as the tl one."""
    n_rows, n_cols = scores.shape
    block = block or DECODE_BLOCK
    warps = num_warps or 8
    use_gluon = (DECODE_GLUON if gluon is None else gluon) and is_sm90(scores.device) and not _interpreting()
    per_thread = block // (32 * warps)
    if use_gluon and (per_thread < 1 or per_thread * 32 * warps != block or per_thread & (per_thread - 1)):
        raise ValueError(f"the Gluon candidate pass takes a block of 32 * num_warps * 2^i scores, not {block} on "
                         f"{warps} warps")
    expect = DECODE_EXPECT[min(parts, 2)]
    tau = torch.empty(n_rows, dtype=torch.int32, device=scores.device)
    keys = torch.empty(n_rows, parts, seg_cap, dtype=torch.int32, device=scores.device)
    positions = torch.empty(n_rows, parts, seg_cap, dtype=torch.int32, device=scores.device)
    counts = torch.empty(n_rows, parts, dtype=torch.int32, device=scores.device)
    aligned = n_cols % 16 == 0 and scores.stride(0) % 16 == 0
    if use_gluon:
        from adapt.kernels.topk_gluon import decode_candidates_gluon_kernel

        decode_candidates_gluon_kernel[(n_rows, parts)](
            scores, limits, tau, keys, positions, counts, scores.stride(0), n_cols, topk, SAMPLE=sample,
            RUN=DECODE_SAMPLE_RUN, EXPECT_NUM=expect[0], EXPECT_DEN=expect[1], SEG_CAP=seg_cap, PARTS=parts,
            PER_THREAD=per_thread, ALIGNED=aligned, TAU_BITS=DECODE_TAU_BITS, WARPS=warps, DEPTH=DECODE_GLUON_DEPTH,
            num_warps=warps)
    else:
        _decode_candidates_kernel[(n_rows, parts)](
            scores, limits, tau, keys, positions, counts, scores.stride(0), n_cols, topk, SAMPLE=sample,
            RUN=DECODE_SAMPLE_RUN, EXPECT_NUM=expect[0], EXPECT_DEN=expect[1], SEG_CAP=seg_cap,
            PARTS=parts, BLOCK=block, ALIGNED=aligned, TAU_BITS=DECODE_TAU_BITS,
            PREFETCH=DECODE_PREFETCH if prefetch is None else prefetch, num_warps=warps)
    return tau, keys, positions, counts


# Select over candidates the indexer's decode scoring kernel emitted (``dsa.index_topk_fused``): one run of
# candidates per scoring program (a contiguous range of the row, ascending), any number of runs per row.
FUSED_CAP = 8192  # candidates a select program holds in registers (8 warps: 32 a thread); more: the full-row select
FUSED_LOG_PARTS_MAX = 12  # runs per row the select's binary search covers (4096)


@triton.jit
def _fused_select_kernel(scores_ptr, limits_ptr, tau_ptr, key_ptr, pos_ptr, count_ptr, incl_ptr, out_ptr, redo_ptr,
                         stride, n_cols, topk, seg_cap, n_parts, PARTS_P2: tl.constexpr, LOG_PARTS: tl.constexpr,
                         CAP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, FULL_BLOCK: tl.constexpr,
                         FAST: tl.constexpr):
    """One program per row over its n_parts runs of candidates (run p: count[p] order keys and positions at
    ``(row * n_parts + p) * seg_cap``, ascending positions). Exact when no run overflowed its seg_cap slots,
    the row holds at most CAP candidates, and either tau took every visible key or at least topk keys are
    >= tau: the runs are then read as one ascending array of CAP slots (slot j's run by a binary search over
    the runs' inclusive counts, stored in ``incl_ptr`` [PARTS_P2] a row), the k-th key found by 32 bisection
    steps in registers, and the kept positions (keys above it, then the lowest-position ties) written in
    order. Any other row is selected from its full scores (``_select_runs``; slow for that row, exact)."""
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, PARTS_P2)
    counts = tl.load(count_ptr + row * n_parts + parts, mask=parts < n_parts, other=0)
    tau = tl.load(tau_ptr + row)
    total = tl.sum(counts, axis=0)
    exact = (tl.max(counts, axis=0) <= seg_cap) & (total <= CAP) & ((tau == 0) | (total >= topk))
    tl.store(redo_ptr + row, (~exact).to(tl.int32))
    out_base = out_ptr + row * topk
    if exact:
        incl_base = incl_ptr + row * PARTS_P2
        tl.store(incl_base + parts, tl.where(parts < n_parts, tl.cumsum(counts, axis=0), 0x7FFFFFFF))
        tl.debug_barrier()  # the inclusive counts, written by every thread, read back by every thread
        j = tl.arange(0, CAP)
        m = j < total
        part = tl.zeros([CAP], tl.int32)
        for b in tl.static_range(LOG_PARTS):  # part = how many runs end at or before slot j
            ends = tl.load(incl_base + part + ((PARTS_P2 >> (b + 1)) - 1), mask=m, other=0x7FFFFFFF)
            part = tl.where(ends <= j, part + (PARTS_P2 >> (b + 1)), part)
        start = tl.load(incl_base + part - 1, mask=m & (part > 0), other=0)
        addr = (row * n_parts + part) * seg_cap + (j - start)
        key = tl.load(key_ptr + addr, mask=m, other=0).to(tl.uint32, bitcast=True)
        if FAST > 0:  # the short bisection and one packed scan
            threshold = tl.where(total <= topk, 0, _kth_key(key, m, total, topk, FAST))
            packed, rem = _kept_packed(key, m, threshold, topk)
            take, slot = _kept_slots(packed, tl.cumsum(packed, axis=0), rem)
            written = tl.minimum(total, topk)
        else:
            threshold = tl.zeros([], tl.uint32)
            for b in range(32):  # a loop, not unrolled: a smaller build (sm_90 compile 2-3x faster on the CPU)
                trial = threshold | (tl.full([], 1, tl.uint32) << (31 - b))
                hits = tl.sum((m & (key >= trial)).to(tl.int32), axis=0)
                threshold = tl.where(hits >= topk, trial, threshold)
            threshold = tl.where(total <= topk, 0, threshold)  # every candidate is taken
            above = m & (key > threshold)
            rem = topk - tl.sum(above.to(tl.int32), axis=0)
            tie = m & (key == threshold)
            take = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) - 1 < rem))
            slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
            written = tl.sum(take.to(tl.int32), axis=0)
        tl.store(out_base + slot, tl.load(pos_ptr + addr, mask=take, other=-1), mask=take)
        offs = tl.arange(0, BLOCK)
        for start in range(written, topk, BLOCK):
            tl.store(out_base + start + offs, tl.full([BLOCK], -1, tl.int32), mask=start + offs < topk)
    else:
        _select_runs(scores_ptr + row * stride, pos_ptr, limits_ptr + row, 0, n_cols, out_base, topk, RUNS=1,
                     BLOCK=FULL_BLOCK, BITS=BITS, FROM_SCORES=True)


def select_candidates(scores: torch.Tensor, limits: torch.Tensor, tau: torch.Tensor, keys: torch.Tensor,
                      positions: torch.Tensor, counts: torch.Tensor, topk: int, *, out: torch.Tensor,
                      redo: torch.Tensor, num_warps: int = 8, fast: int | None = None) -> torch.Tensor:
    """``topk_indices``' result from candidates emitted per run (one launch, no host sync): keys / positions
    int32 [N, parts, seg_cap] (order keys, ascending positions), counts int32 [N, parts] (how many each run
    found, possibly more than seg_cap), tau int32 [N] (the order key they were kept at or above; 0: every visible
    key; ``fast``: ``topk_decode``'s option, default FAST_SELECT). Rows whose candidates
    cannot be trusted (a run past seg_cap, more than FUSED_CAP, or fewer than topk
    above a nonzero tau) are selected from ``scores`` fp32 [N, C] (limits int32 [N]) and flagged in ``redo``.
    Writes int32 [N, topk] ``out`` (contiguous) and returns it."""
    n_rows, n_parts, seg_cap = keys.shape
    if n_rows == 0 or topk == 0:
        redo.zero_()
        return out
    parts_p2 = triton.next_power_of_2(n_parts)
    log_parts = parts_p2.bit_length() - 1
    if log_parts > FUSED_LOG_PARTS_MAX:
        raise ValueError(f"select_candidates takes at most {1 << FUSED_LOG_PARTS_MAX} runs a row, not {n_parts}")
    incl = torch.empty(n_rows, parts_p2, dtype=torch.int32, device=keys.device)
    _fused_select_kernel[(n_rows,)](
        scores, limits, tau, keys, positions, counts, incl, out, redo, scores.stride(0), scores.shape[1], topk,
        seg_cap, n_parts, PARTS_P2=parts_p2, LOG_PARTS=log_parts, CAP=FUSED_CAP, BLOCK=DECODE_SELECT_BLOCK,
        BITS=8, FULL_BLOCK=DECODE_BLOCK, FAST=_fast_level(fast), num_warps=num_warps)
    return out
