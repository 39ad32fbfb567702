"""Radix top-k select (Triton) against its twin (exact) and a plain-Python reference of its definition."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels.topk import (
    GRID_CAP,
    GRID_MAX_SLICE,
    grid_low_pass_rows,
    grid_parts,
    grid_work,
    topk_grid,
    topk_indices,
    topk_indices_torch,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference(scores, limits, k):
    """The definition, written out: sort visible (score, position) pairs by score descending then
    position ascending, keep k, list the kept positions ascending, pad with -1."""
    out = []
    for row, limit in zip(scores.tolist(), limits.tolist(), strict=True):
        visible = [(-v, p) for p, v in enumerate(row[:limit]) if v != float("-inf")]
        kept = sorted(p for _, p in sorted(visible)[:k])
        out.append(kept + [-1] * (k - len(kept)))
    return torch.tensor(out, dtype=torch.int32)


def score_rows(gen):
    """Rows that exercise the select: random, heavy ties, a -inf tail inside the limit, all negative,
    a short limit, nothing visible, +-0, a tie at the threshold spread over blocks."""
    cols = 200
    s = torch.randn(9, cols, generator=gen)
    s[1] = torch.randint(0, 4, (cols,), generator=gen).float()
    s[2, 60:] = float("-inf")
    s[3] = -s[3].abs() - 1
    s[6] = 0.0
    s[6, ::3] = -0.0
    s[7] = torch.where(torch.rand(cols, generator=gen) < 0.7, 1.5, s[7])
    s[8] = 1.0
    s[8, 150:] = float("-inf")
    limits = torch.tensor([cols, cols, cols, cols, 5, 0, cols, cols, 190])
    return s, limits


# 8-bit digits over 4 slices of 64; 4-bit digits over 2 slices of 128 in 64-score steps; defaults (one slice).
TILES = [dict(digit_bits=8, slice_size=64, block=32), dict(digit_bits=4, slice_size=128, block=64), {}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 13, 150, 256])
@pytest.mark.parametrize("tiles", TILES)
def test_topk_matches_twin_exactly_and_the_definition(device, k, tiles):
    s, limits = score_rows(torch.Generator().manual_seed(k))
    got = topk_indices(s.to(device), limits.to(device), k, **tiles).cpu()
    twin = topk_indices_torch(s, limits, k)
    assert torch.equal(got, twin)
    assert torch.equal(twin, reference(s, limits, k))


@pytest.mark.parametrize("device", DEVICES)
def test_topk_writes_into_a_strided_chunk_and_reads_only_visible_columns(device):
    """Columns past a row's limit are never read (NaN there), rows of a wider buffer (stride 48),
    output into a row slice of a larger index buffer; every output element is written."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 48, generator=gen)
    limits = torch.tensor([40, 33, 1, 32, 17])
    for r, lim in enumerate(limits.tolist()):
        wide[r, lim:] = float("nan")
    scores = wide[:, :40]
    out = torch.full((8, 20), -7, dtype=torch.int32)
    out_dev = out.to(device)
    topk_indices(scores.to(device), limits.to(device), 20, out=out_dev[2:7], slice_size=16, block=16)
    assert (out_dev[:2].cpu() == -7).all() and (out_dev[7:].cpu() == -7).all()
    assert torch.equal(out_dev[2:7].cpu(), reference(scores, limits, 20))


@pytest.mark.gpu
def test_topk_deepseek_v32_decode_shape_on_gpu():
    """4 and 16 rows x 128K keys, top-2048, fp32 scores with ties: identical to the twin (both digit widths)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(16, 131072, device="cuda", generator=gen)
    s[1] = torch.round(s[1] * 4)
    limits = torch.randint(1000, 131073, (16,), device="cuda")
    limits[0] = 131072
    for rows in (4, 16):
        want = topk_indices_torch(s[:rows], limits[:rows], 2048)
        for bits in (4, 8):
            assert torch.equal(topk_indices(s[:rows], limits[:rows], 2048, digit_bits=bits), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("k", "parts", "cap", "packed"), [(1, 4, 4096, False), (13, 4, 64, False),
                                                           (256, 4, 4096, False), (150, 16, 64, False),
                                                           (1, 4, 4096, True), (13, 4, 64, True)])
def test_grid_select_matches_twin_exactly(device, k, parts, cap, packed):
    """The one-launch select (``topk_grid``): the radix select's positions on the same rows, 4 programs of 64
    keys a row or 16 of 16 (the last three past the row) on the CPU; rows whose threshold bin holds more than
    ``cap`` keys take the low passes, the others the candidates; ``packed``: fewer CTA-wide reductions, the same
    positions; the candidate list loaded once for its sweeps (``cand_once``) or once a sweep, the same positions. On
    the CPU each grid barrier is a launch boundary."""
    s, limits = score_rows(torch.Generator().manual_seed(100 + k))
    assert grid_parts(9, 200, torch.device("cpu"), parts) == ((4, 64) if parts == 4 else (16, 16))
    work = torch.zeros(9, grid_work(parts, cap), dtype=torch.int32, device=device)
    got = topk_grid(s.to(device), limits.to(device), k, parts=parts, cap=cap, work=work, packed=packed,
                    cand_once=False).cpu()
    assert torch.equal(got, topk_indices_torch(s, limits, k))
    once = topk_grid(s.to(device), limits.to(device), k, parts=parts, cap=cap, packed=packed, cand_once=True).cpu()
    assert torch.equal(once, got)
    low = grid_low_pass_rows(work).cpu()
    assert not low[0]  # random scores: a few keys in the bin, the candidates
    # row 6, 200 keys all +-0 (one bin): more than cap takes the low passes, unless k covers the row (every visible
    # key taken after the first barrier)
    assert low[6] == (k < 200 and cap < 200)


@pytest.mark.parametrize("device", DEVICES)
def test_grid_select_candidates_loaded_once_past_the_first_block(device):
    """A row whose threshold bin holds 1,024 candidates (every key in one 16-bit bin, distinct low bits, shuffled):
    with ``cand_once`` the list's first 256 entries come from the one load before the sweeps and the rest from
    the sweeps' own loads; the same positions as the twin either way."""
    gen = torch.Generator().manual_seed(7)
    base = torch.tensor([1.5]).view(torch.int32)
    keys = (base & ~0xFFFF) | torch.randperm(1024, generator=gen).to(torch.int32) * 61 % 65536
    s = keys.view(torch.float32)[None]
    limits = torch.tensor([1024])
    want = topk_indices_torch(s, limits, 500)
    for once in (False, True):
        work = torch.zeros(1, grid_work(4), dtype=torch.int32, device=device)
        got = topk_grid(s.to(device), limits.to(device), 500, parts=4, work=work, cand_once=once).cpu()
        assert torch.equal(got, want)
        assert not grid_low_pass_rows(work).cpu()[0]  # 1,024 candidates within the cap: the candidate list


def test_grid_select_writes_into_a_strided_chunk_and_falls_back_when_rows_are_too_wide():
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(3, 48, generator=gen)
    limits = torch.tensor([40, 9, 33])
    for r, lim in enumerate(limits.tolist()):
        wide[r, lim:] = float("nan")  # past the limit: never read
    out = torch.full((6, 20), -7, dtype=torch.int32)
    topk_grid(wide[:, :40], limits, 20, out=out[1:4], parts=2)
    assert (out[0] == -7).all() and (out[4:] == -7).all()
    assert torch.equal(out[1:4], reference(wide[:, :40], limits, 20))
    # more keys than the programs a row may hold: no grid shape, topk_indices selects instead
    assert grid_parts(1, 16 * GRID_MAX_SLICE + 1, torch.device("cpu")) is None
    assert grid_parts(1, 16 * GRID_MAX_SLICE, torch.device("cpu")) == (16, GRID_MAX_SLICE)
    with pytest.raises(ValueError, match="work must be contiguous int32"):
        topk_grid(wide[:, :40], limits, 20, parts=2, work=torch.zeros(3, 10, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed needs cap < 65536"):
        topk_grid(wide[:, :40], limits, 20, parts=2, cap=1 << 16, packed=True)


@pytest.mark.gpu
def test_grid_select_deepseek_v32_decode_shape_on_gpu():
    """1, 2 and 8 rows x 128K keys, top-2048, with ties and short rows: the grid select equals the twin, with the
    programs a row the SM count allows and with fewer, by the candidates and (caps 1 and 64) the low passes, with
    and without the packed reductions; and in a CUDA graph replayed several times."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    s = torch.randn(8, 131072, device="cuda", generator=gen)
    s[1] = torch.round(s[1] * 4)
    limits = torch.randint(1000, 131073, (8,), device="cuda")
    limits[0] = 131072
    limits[2] = 1500  # fewer visible keys than k
    for rows in (1, 2, 8):
        want = topk_indices_torch(s[:rows], limits[:rows], 2048)
        for parts, cap in ((None, GRID_CAP), (32, GRID_CAP), (None, 1), (None, 64)):
            for packed in (False, True):
                got = topk_grid(s[:rows], limits[:rows], 2048, parts=parts, cap=cap, packed=packed)
                assert torch.equal(got, want)
        # the candidate list loaded once a sweep (GRID_CAND_ONCE off; each constexpr set is a compile, so one shape)
        assert torch.equal(topk_grid(s[:rows], limits[:rows], 2048, cand_once=False), want)
        graph = torch.cuda.CUDAGraph()  # replays reuse the zeroed workspace each time
        out = torch.empty(rows, 2048, dtype=torch.int32, device="cuda")
        topk_grid(s[:rows], limits[:rows], 2048, out=out)
        with torch.cuda.graph(graph):
            topk_grid(s[:rows], limits[:rows], 2048, out=out)
        for _ in range(3):
            out.zero_()
            graph.replay()
            assert torch.equal(out, want)
