"""Tile maps of the grouped MoE GEMMs: the m-tiles of each expert's sorted slots, built on the device.

``tile_map(expert_offsets, block_m, max_tiles) -> TileMap`` (one Triton program, no host sync) and
its twin ``tile_map_torch``; ``max_m_tiles`` bounds the tile count from the slot and expert counts
so a CUDA graph can size its grid once. Empty experts own no tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapt.kernels import pdl


@dataclass
class TileMap:
    """Work items of a grouped GEMM: m-tiles of block_m sorted positions, expert-major.

    tile_expert int32 [max_tiles], tile_row int32 [max_tiles] (first sorted position),
    tile_start int32 [E+1] (first m-tile of each expert; tile_start[E] = number of m-tiles).
    """

    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    tile_start: torch.Tensor
    block_m: int
    max_tiles: int


def max_m_tiles(slots: int, n_experts: int, block_m: int) -> int:
    """Upper bound on m-tiles: sum_e ceil(c_e / bm) <= ceil(S / bm) + min(E, S)."""
    return triton.cdiv(slots, block_m) + min(n_experts, slots) + 1


def tile_map_torch(expert_offsets: torch.Tensor, block_m: int, max_tiles: int) -> TileMap:
    """Twin of ``tile_map``."""
    e = expert_offsets.numel() - 1
    counts = (expert_offsets[1:] - expert_offsets[:-1]).long()
    nt = (counts + block_m - 1) // block_m
    start = torch.zeros(e + 1, dtype=torch.int64, device=counts.device)
    start[1:] = torch.cumsum(nt, 0)
    i = torch.arange(max_tiles, device=counts.device)
    ex = torch.searchsorted(start[1:], i, right=True).clamp(max=e - 1)
    row = expert_offsets.long()[ex] + (i - start[ex]) * block_m
    return TileMap(ex.int(), row.int(), start.int(), block_m, max_tiles)


@triton.jit
def _tile_map_kernel(
    offsets_ptr,
    expert_ptr,
    row_ptr,
    start_ptr,
    n_experts,
    max_tiles,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: tiles per expert, their exclusive prefix, then expert and row of every tile."""
    pdl.enter(PDL)
    e = tl.arange(0, E_PAD)
    em = e < n_experts
    lo = tl.load(offsets_ptr + e, mask=em, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=em, other=0)
    nt = (hi - lo + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(nt, axis=0)
    start = end - nt
    tl.store(start_ptr + e, start, mask=em)
    tl.store(start_ptr + n_experts + e * 0, tl.sum(nt, axis=0), mask=e == 0)
    for i0 in range(0, max_tiles, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        ex = tl.sum(((end[None, :] <= i[:, None]) & em[None, :]).to(tl.int32), axis=1)
        ex = tl.minimum(ex, n_experts - 1)
        st = tl.sum(tl.where(e[None, :] == ex[:, None], start[None, :], 0), axis=1)
        base = tl.sum(tl.where(e[None, :] == ex[:, None], lo[None, :], 0), axis=1)
        ok = i < max_tiles
        tl.store(expert_ptr + i, ex, mask=ok)
        tl.store(row_ptr + i, base + (i - st) * BLOCK_M, mask=ok)


def tile_map(expert_offsets: torch.Tensor, block_m: int, max_tiles: int) -> TileMap:
    """m-tiles of each expert's sorted positions (Triton, one program)."""
    e = expert_offsets.numel() - 1
    dev = expert_offsets.device
    ex = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    row = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    start = torch.empty(e + 1, dtype=torch.int32, device=dev)
    _tile_map_kernel[(1,)](
        expert_offsets,
        ex,
        row,
        start,
        e,
        max_tiles,
        BLOCK_M=block_m,
        E_PAD=triton.next_power_of_2(e),
        CHUNK=32,
        **pdl.launch_options(dev),
    )
    return TileMap(ex, row, start, block_m, max_tiles)


@triton.jit
def tile_slots(
    tile,
    n_m,
    n_n,
    m_lo,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    sorted_slot_ptr,
    TOPK: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Work item ``tile`` of a grouped GEMM over n_m m-tiles (from m-tile m_lo) x n_n n-tiles,
    GROUP_M m-tiles at a time so a weight tile and its activation rows stay in L2.

    Returns (expert, n-tile, sorted rows int32 [BLOCK_M], row mask, activation row int64
    [BLOCK_M]: the token sorted_slot // TOPK with GATHER, else the sorted position)."""
    width = GROUP_M * n_n
    first_m = (tile // width) * GROUP_M
    gsz = tl.minimum(n_m - first_m, GROUP_M)
    mt = m_lo + first_m + (tile % width) % gsz
    nt = (tile % width) // gsz
    e = tl.load(tile_expert_ptr + mt)
    rows = tl.load(tile_row_ptr + mt) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(offsets_ptr + e + 1)
    if GATHER:
        tok = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0) // TOPK
    else:
        tok = rows
    return e, nt, rows, row_ok, tok.to(tl.int64)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (2 for the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2
