"""Decode top-k (device-side prefilter, Triton) against the twin ``topk_indices_torch``: exact positions and
tie order, on rows the sample judges right and rows it misjudges (selected again on the device)."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import dsa
from adapt.kernels.topk import select_candidates, topk_decode, topk_indices_torch

COLS = 4096
K = 128
SAMPLE = 64  # 8 runs of 8 over a 4096-column row: every 512th column starts a run


def sampled_columns(n):
    """Columns the kernel samples in a row of n visible columns (runs of 8, span a multiple of 8)."""
    runs = SAMPLE // 8
    per_run = -(-n // runs)
    span = max(-(-per_run // 8) * 8, 8)
    return torch.tensor([(i // 8) * span + i % 8 for i in range(SAMPLE) if (i // 8) * span + i % 8 < n])


def adversarial_rows(gen):
    """Rows and whether the sample misjudges them (so the full-row select runs):
    0 random (judged right); 1 few score levels (ties at the threshold spread over parts); 2 all equal (every
    score is a candidate: past the slots); 3 high scores only off the sample (tau too high: fewer than k
    candidates); 4 the sample lowest (tau too low: past the slots); 5 fewer than k visible (a short limit);
    6 -inf holes leaving fewer than k (the sample sees too few visible: every visible key); 7 +-0 ties with a
    few positives (the sampled zeros put every score past the slots); 8 nothing visible; 9 random, short limit."""
    s = torch.randn(10, COLS, generator=gen)
    s[1] = torch.randint(0, 40, (COLS,), generator=gen).float()
    s[2] = 0.5
    cols = sampled_columns(COLS)
    s[3] = -1.0
    s[3, torch.randperm(COLS, generator=gen)[:300]] = 2.0
    s[3, cols] = 5.0
    s[4] = s[4].abs()
    s[4, cols] = -3.0
    s[6] = torch.where(torch.rand(COLS, generator=gen) < 0.98, float("-inf"), s[6])
    s[7] = torch.where(torch.arange(COLS) % 2 == 0, 0.0, -0.0)
    s[7, 1000::500] = 1.0
    limits = torch.tensor([COLS, COLS, COLS, COLS, COLS, 100, COLS, COLS, 0, 3000])
    return s, limits


# radix passes over the candidates in memory (three parts, small steps); candidates in registers (one part,
# 4-bit digits in the full-row select); registers over three parts; the flat select (select_candidates) over
# three parts; the short select (fast, 2 and 1 bits a step) in registers and flat; the candidate pass loading a
# step ahead (prefetch). The register and flat tiles without ``fast`` pin the 32-step bisection (fast=0) and the
# first tile the candidate pass without prefetch, as they ran before the short select and prefetch became the
# defaults. The GPU runs the first, the flat ones, the fast register ones and the prefetch one (the graph test below
# runs the default).
TILES = [dict(parts=3, block=512, select_block=256, registers=False, prefetch=False), dict(parts=1, digit_bits=4),
         dict(parts=3, registers=True, select_block=64, fast=0), dict(parts=3, block=512, flat=True, fast=0),
         dict(parts=3, registers=True, select_block=64, fast=2), dict(parts=3, block=512, flat=True, fast=2),
         dict(parts=3, registers=True, select_block=64, fast=1), dict(parts=3, block=512, flat=True, fast=1),
         dict(parts=3, block=512, registers=True, fast=1, prefetch=True)]


@pytest.mark.parametrize("device, opts", [("cpu", opts) for opts in TILES]
                         + [pytest.param("cuda", TILES[i], marks=pytest.mark.gpu) for i in (0, 3, 4, 5, 6, 7, 8)])
def test_decode_topk_equals_twin_and_redoes_misjudged_rows_on_device(device, opts):
    """Three parts of 2k slots each: rows 0, 1, 9 select over their candidates. One part (2k slots for about
    1.5k candidates from a 64-score sample) may send those rows to the full select too: still the twin's."""
    s, limits = adversarial_rows(torch.Generator().manual_seed(1))
    redo = torch.full((s.shape[0],), -5, dtype=torch.int32, device=device)
    out = torch.full((s.shape[0] + 2, K), -7, dtype=torch.int32, device=device)
    topk_decode(s.to(device), limits.to(device), K, out=out[1:-1], redo=redo, sample=SAMPLE, **opts)
    assert torch.equal(out[1:-1].cpu(), topk_indices_torch(s, limits, K))
    assert (out[0] == -7).all() and (out[-1] == -7).all()
    got = redo.tolist()
    assert [got[r] for r in (2, 3, 4, 5, 6, 7, 8)] == [1, 1, 1, 0, 0, 1, 0]
    if opts["parts"] == 3:
        assert [got[r] for r in (0, 1, 9)] == [0, 0, 0]


def shared_prefix_rows(gen):
    """Rows the sample judges right whose candidates share long key prefixes (the short select fixes those
    bits; narrower rows put every key above the sample's 16-bit threshold, past the slots): 0 scores in
    [1, 1 + 2^-4) (12 shared bits); 1 300 scores of 7.0 among N(0, 0.1) (every candidate equal: no free bit,
    the lowest K positions of the tie); 2 negative scores in (-5.25, -5]; 3 N(0, 1)."""
    s = torch.randn(4, COLS, generator=gen)
    s[0] = 1.0 + torch.rand(COLS, generator=gen) * 2.0 ** -4
    s[1] = s[1] * 0.1
    s[1, torch.randperm(COLS, generator=gen)[:300]] = 7.0
    s[2] = -5.0 - torch.rand(COLS, generator=gen) * 0.25
    return s, torch.full((4,), COLS)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("flat, fast", [(False, 2), (True, 2), (False, 1), (True, 1)])
def test_fast_select_on_shared_prefixes_and_ties_equals_twin(device, flat, fast):
    s, limits = shared_prefix_rows(torch.Generator().manual_seed(5))
    redo = torch.full((4,), -5, dtype=torch.int32, device=device)
    out = topk_decode(s.to(device), limits.to(device), K, redo=redo, sample=SAMPLE, parts=3, block=512,
                      registers=not flat, flat=flat, fast=fast)
    assert torch.equal(out.cpu(), topk_indices_torch(s, limits, K))
    assert redo.tolist() == [0, 0, 0, 0]  # every row selected from its candidates (the short select ran)


def order_keys(x):
    """``topk._order_key`` of fp32 ``x`` as int32 (the candidates' stored form)."""
    bits = torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    keys = bits ^ ((bits >> 31) * 0x7FFFFFFF | 0x80000000)
    return torch.where(keys >= 2 ** 31, keys - 2 ** 32, keys).to(torch.int32)


@pytest.mark.parametrize("fast", [1, 2])
def test_fast_select_spanning_the_key_range_rejects_wrapped_trials(fast):
    """Candidates (every visible score, tau 0) from 1e-19 to 3e38 and a few negatives: the keys span more
    than 2^31, so trial keys above lo wrap past 2^32 - 1 and must be rejected; ties at the k-th key too."""
    gen = torch.Generator().manual_seed(6)
    s = torch.full((2, 512), float("-inf"))
    s[0, :300] = 10.0 ** (torch.rand(300, generator=gen) * 57 - 19)
    s[0, :20] = -torch.rand(20, generator=gen)
    s[1, :300] = s[0, :300]
    s[1, 100:200] = s[0, 150]  # 100 ties around the k-th key
    limits = torch.tensor([300, 300])
    keys = order_keys(s[:, :300]).reshape(2, 1, 300).repeat(1, 1, 2)[:, :, :512]
    positions = torch.arange(300, dtype=torch.int32).repeat(2, 1, 2)[:, :, :512]
    counts = torch.full((2, 1), 300, dtype=torch.int32)
    out = torch.empty(2, K, dtype=torch.int32)
    redo = torch.empty(2, dtype=torch.int32)
    select_candidates(s, limits.int(), torch.zeros(2, dtype=torch.int32), keys.contiguous(), positions.contiguous(),
                      counts, K, out=out, redo=redo, fast=fast)
    assert redo.tolist() == [0, 0]
    assert torch.equal(out, topk_indices_torch(s, limits, K))


def test_fast_select_level_is_checked():
    with pytest.raises(ValueError, match="fast must be 0, 1 or 2"):
        topk_decode(torch.randn(2, 64), torch.full((2,), 64), 4, fast=3)


def test_index_topk_select_decode_is_the_twins_selection():
    """``select="decode"`` in dsa's select dispatch writes topk_decode's result (the twin's) into the chunk."""
    s, limits = adversarial_rows(torch.Generator().manual_seed(4))
    out = torch.full((s.shape[0], K), -7, dtype=torch.int32)
    assert dsa._select_topk(s, limits, K, out=out, method="decode") == 0
    assert torch.equal(out, topk_indices_torch(s, limits, K))


def test_auto_select_takes_decode_from_its_row_count(monkeypatch):
    """``auto`` dispatches decode-sized chunks to topk_decode once DECODE_SELECT_MIN_ROWS is set (None: never)."""
    calls = []
    monkeypatch.setattr(dsa, "topk_decode", lambda *a, **kw: calls.append(a[0].shape[0]))
    scores, limits = torch.randn(12, 64), torch.full((12,), 64)
    out = torch.empty(12, 4, dtype=torch.int32)
    dsa._select_topk(scores, limits, 4, out=out)
    assert calls == []
    monkeypatch.setattr(dsa, "DECODE_SELECT_MIN_ROWS", 10)
    dsa._select_topk(scores, limits, 4, out=out)
    dsa._select_topk(scores[:9], limits[:9], 4, out=out[:9])
    assert calls == [12]


def test_decode_topk_default_sample_and_k_past_the_columns():
    """The default sample (4096 scores: the whole of a short row) and k larger than a row's columns."""
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(3, 1000, generator=gen)
    s[1, ::7] = 2.0
    limits = torch.tensor([1000, 999, 17])
    for k in (1, 40, 1200):
        assert torch.equal(topk_decode(s, limits, k), topk_indices_torch(s, limits, k))


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, dict(fast=2, select_warps=16), dict(fast=0, select_warps=8, prefetch=False)])
def test_decode_topk_deepseek_v32_batch64_in_a_cuda_graph(opts):
    """64 rows x 128K keys, top-2048, replayed from a CUDA graph: identical to the twin; a row the sample
    misjudges is selected again inside the graph (no host sync); new scores replay with new results. The
    default select (the short one, fast 1, 16 warps a select program, the candidate pass loading a step ahead),
    fast 2, and the 32-step bisection on 8 warps without the prefetch (the default before 2026-12-01)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(64, 131072, device="cuda", generator=gen)
    s[1] = torch.round(s[1] * 4)
    limits = torch.randint(1000, 131073, (64,), device="cuda", generator=gen)
    limits[0] = 131072
    out = torch.empty(64, 2048, dtype=torch.int32, device="cuda")
    redo = torch.empty(64, dtype=torch.int32, device="cuda")
    topk_decode(s, limits, 2048, out=out, redo=redo, **opts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_decode(s, limits, 2048, out=out, redo=redo, **opts)
    for step in range(2):
        if step:
            s.copy_(torch.randn(64, 131072, device="cuda", generator=gen))
            s[2] = 1.0  # all equal: the full-row select
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_indices_torch(s, limits, 2048))
        assert redo[2].item() == step and redo.sum().item() <= 2 + step


def test_bench_line_shows_decode_select_beside_torch_topk():
    """bench_dsa's decode line: each topk_decode tile (timed as, twin, redo rows), torch.topk and the step."""
    from adapt.stages.bench_dsa import _decode_select_line

    case = {"torch_topk_us": 144.1, "step_us_decode_select": 600.0, "topk_us_decode_select": 40.0,
            "step_over_floor_decode_select": 1.94,
            "topk_decode_sweep": [{"us": 35.5, "equals_twin": True, "redo_rows": 0, "timed_as": "graph"},
                                  {"parts": 4, "error": "out of resources"}]}
    line = _decode_select_line(case)
    assert "default: 35.5 (graph, twin True, redo 0)" in line and "{'parts': 4}: out of resources" in line
    assert "torch.topk 144.1" in line and "select=decode 600.0 us" in line and "step / floor 1.94" in line


def test_decode_topk_slots_per_part_trade_rows_for_the_full_select():
    """``seg_cap``: with 4 parts of 64 slots (the register select over 256) rows stay exact; a part that finds
    more candidates than its slots sends its row to the full-row select (``redo``), still exact; a cap below 1 is
    refused."""
    gen = torch.Generator().manual_seed(11)
    s = torch.randn(6, 4096, generator=gen)
    s[2, :] = 0.5  # all equal: every key is a candidate
    s[4, 1000:1100] = 9.0  # one part holds the whole top
    limits = torch.tensor([4096, 4000, 4096, 3000, 4096, 700])
    want = topk_indices_torch(s, limits, 32)
    for cap in (64, 16):
        redo = torch.empty(6, dtype=torch.int32)
        got = topk_decode(s, limits, 32, parts=4, seg_cap=cap, redo=redo)
        assert torch.equal(got, want), cap
        assert redo[2] == 1  # all equal: more candidates than any cap here
        if cap == 16:
            assert redo[4] == 1  # 100 equal top keys in one part of 16 slots
    with pytest.raises(ValueError, match="seg_cap"):
        topk_decode(s, limits, 32, seg_cap=0)
