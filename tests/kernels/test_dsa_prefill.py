"""Prefill parts of DSA: the prefiltered top-k select (Triton candidate pass) against the exact select."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import dsa
from adapt.kernels import topk as topk_mod
from adapt.kernels.topk import prefilter_applies, topk_indices_torch, topk_prefiltered

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def causal_scores(rows, cols, gen):
    """Random scores of the last ``rows`` rows of a causal prefill over ``cols`` keys: row r sees
    limits[r] keys, -inf after them (as ``index_scores`` writes), a few -inf inside too."""
    s = torch.randn(rows, cols, generator=gen)
    limits = torch.linspace(cols // 8, cols, rows).long()
    limits[0] = 40  # fewer visible keys than k
    s[torch.arange(cols)[None, :] >= limits[:, None]] = float("-inf")
    s[2, 100:300] = float("-inf")
    return s, limits


def sets(idx):
    """Each row's selected positions as a sorted list (order and the -1 padding position-free)."""
    return [sorted(p for p in row if p >= 0) for row in idx.tolist()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("final", ["torch", "triton"])
def test_prefiltered_select_equals_the_exact_set(device, final):
    gen = torch.Generator().manual_seed(3)
    k, cols = 64, 8192
    s, limits = causal_scores(12, cols, gen)
    # rows the sample misjudges and must fall back: the top scores all outside the sampled runs (too
    # few candidates), and a row where every score ties (too many)
    s[5] = torch.randn(cols, generator=gen) - 10
    s[5, 100:1000:8] = 5 + torch.rand(113, generator=gen)
    s[6, : limits[6]] = 1.0
    assert prefilter_applies(*s.shape, k)
    got, fell_back = topk_prefiltered(s.to(device), limits.to(device), k, final=final)
    want = topk_indices_torch(s, limits, k)
    if final == "triton":  # ascending positions, ties to the lowest (row 6), -1 padding: the twin exactly
        assert torch.equal(got.cpu(), want)
    assert 2 <= fell_back < 12  # at this small k the sample's quantile is coarse: more rows fall back
    assert sets(got.cpu())[:6] + sets(got.cpu())[7:] == sets(want)[:6] + sets(want)[7:]
    row6 = sets(got.cpu())[6]  # ties: any k distinct visible positions
    assert len(row6) == k and len(set(row6)) == k and max(row6) < int(limits[6])
    assert sets(got.cpu())[0] == list(range(40))


@pytest.mark.parametrize("device", DEVICES)
def test_candidate_pass_keeps_scores_at_or_above_tau_in_order(device):
    gen = torch.Generator().manual_seed(4)
    rows, cols, cap = 3, 3000, 256
    s = torch.randn(rows, cols, generator=gen)
    limits = torch.tensor([cols, 1000, 0])
    tau = torch.tensor([0.5, 1.5, 0.0])
    values = torch.full((rows, cap), 7.0, device=device)
    positions = torch.full((rows, cap), 7, dtype=torch.int32, device=device)
    count = torch.empty(rows, dtype=torch.int32, device=device)
    topk_mod._candidates_kernel[(rows,)](s.to(device), limits.to(device).int(), tau.to(device), values, positions,
                                         count, cols, cols, CAP=cap, BLOCK=512)
    for r in range(rows):
        keep = torch.nonzero(s[r, : limits[r]] >= tau[r]).flatten()
        assert int(count[r]) == keep.numel()
        n = min(cap, keep.numel())
        assert torch.equal(positions[r, :n].cpu().long(), keep[:n])
        assert torch.equal(values[r, :n].cpu(), s[r, keep[:n]])
        assert bool((positions[r, n:] == -1).all()) and bool((values[r, n:] == float("-inf")).all())
    assert int(count[0]) > cap  # row 0 overflows: only the first cap stored


@pytest.mark.parametrize("device", DEVICES)
def test_prefilter_at_deepseek_v32_width_needs_no_fallback(device):
    """Top-2048 of 131072 random scores: the sample's quantile lands the candidates inside [k, 2k]."""
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(3, 131072, generator=gen)
    limits = torch.tensor([131072, 100000, 9000])
    s[torch.arange(131072)[None, :] >= limits[:, None]] = float("-inf")
    got, fell_back = topk_prefiltered(s.to(device), limits.to(device), 2048)
    assert fell_back == 0
    assert sets(got.cpu()) == sets(topk_indices_torch(s, limits, 2048))


def test_prefilter_needs_wide_rows():
    assert not prefilter_applies(4096, 4096, 2048)
    assert prefilter_applies(4096, 131072, 2048)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [
    {"key_block": 64, "rows_per_tile": 4, "programs": 2},                      # one page per key tile
    {"key_block": 32, "rows_per_tile": 4, "programs": 2, "full_tiles": True},  # half pages, unmasked full tiles
    {"key_block": 16, "rows_per_tile": 2, "programs": 64, "full_tiles": True},
])
def test_prefill_scores_page_tiles_match_twin(device, tiles):
    """Key tiles inside one page read one block-table entry; with ``full_tiles`` the tiles every row of a query
    tile sees whole skip the masks. Sequences whose pages are not in order, query tiles cut mid-sequence."""
    from tests.kernels.test_dsa import assert_close_scores, filled_cache

    layer, batch, q8, weights = filled_cache((70, 200, 5), heads=3, dim=32, device=device, seed=7)
    table = batch.block_table.clone()
    table[1, :4] = table[1, :4].flip(0)  # the second sequence's pages out of order
    limits = (batch.positions + 1).int()
    args = (q8, weights, layer.index_k, layer.index_scale, table, batch.token_seq, limits, 256)
    got = dsa.index_scores(*args, **tiles)
    assert_close_scores(got, dsa.index_scores_torch(*args), device)


def test_sample_threshold_reads_the_first_run_of_every_span():
    """The k_s-th largest of the sampled runs, on a row whose width is no multiple of the span."""
    gen = torch.Generator().manual_seed(6)
    cols = 3 * topk_mod.SAMPLE_SPAN + 100
    s = torch.randn(2, cols, generator=gen)
    k = 2 * topk_mod.SAMPLE_SPAN // topk_mod.SAMPLE_RUN  # k_s = ceil(1.5 * k * run / span) = 3
    sample = torch.cat([s[:, i * topk_mod.SAMPLE_SPAN:][:, : topk_mod.SAMPLE_RUN] for i in range(3)], dim=1)
    want = sample.topk(3, dim=1).values[:, -1]
    assert torch.equal(topk_mod.sample_threshold(s, k), want)
    assert torch.isinf(topk_mod.sample_threshold(s[:, :1000], k)).all()  # no whole span: no sample


def test_select_dispatch_takes_the_prefilter_for_prefill_chunks(monkeypatch):
    """With PREFILL_SELECT "prefilter", ``_select_topk`` (auto) takes the prefiltered select for chunks of at
    least PREFILTER_MIN_ROWS wide rows (here lowered to 16 rows of 16K keys, causal) and returns torch.topk's
    sets; a narrower chunk (12 rows) keeps torch.topk."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return topk_prefiltered(*args, **kwargs)

    monkeypatch.setattr(dsa, "PREFILTER_MIN_ROWS", 16)
    monkeypatch.setattr(dsa, "PREFILL_SELECT", "prefilter")
    monkeypatch.setattr(dsa, "topk_prefiltered", spy)
    gen = torch.Generator().manual_seed(8)
    rows, cols, k = 16, 16384, 2048
    s = torch.randn(rows, cols, generator=gen)
    limits = torch.arange(cols - rows + 1, cols + 1)
    s[torch.arange(cols)[None, :] >= limits[:, None]] = float("-inf")
    out = torch.empty(rows, k, dtype=torch.int32)
    assert dsa._select_topk(s, limits, k, out=out) == 0  # no row fell back
    assert calls == [(rows, cols)]
    assert sets(out) == sets(torch.topk(s, k, dim=1).indices)
    dsa._select_topk(s[:12], limits[:12], k, out=out[:12])
    assert len(calls) == 1 and sets(out[:12]) == sets(torch.topk(s[:12], k, dim=1).indices)
    with pytest.raises(ValueError, match="select"):
        dsa._select_topk(s, limits, k, out=out, method="radix")


def test_select_dispatch_takes_topk_decode_with_its_prefill_options(monkeypatch):
    """By default (PREFILL_SELECT "decode") ``_select_topk`` (auto) hands chunks of at least PREFILTER_MIN_ROWS rows
    (here 16 rows of 16K keys, causal, with ties at the k-th score) to topk_decode with PREFILL_DECODE_OPTIONS and
    returns exactly the twin's positions; a decode-sized chunk gets no prefill options."""
    seen = []

    def spy(*args, **kwargs):
        seen.append((args[0].shape[0], {k: v for k, v in kwargs.items() if k != "out"}))
        return dsa_topk_decode(*args, **kwargs)

    dsa_topk_decode = dsa.topk_decode
    monkeypatch.setattr(dsa, "PREFILTER_MIN_ROWS", 16)
    monkeypatch.setattr(dsa, "DECODE_SELECT_MIN_ROWS", 9)
    monkeypatch.setattr(dsa, "topk_decode", spy)
    assert dsa.PREFILL_SELECT == "decode"
    gen = torch.Generator().manual_seed(9)
    rows, cols, k = 16, 16384, 2048
    s = torch.randn(rows, cols, generator=gen).round(decimals=1)  # many ties at the k-th score
    limits = torch.arange(cols - rows + 1, cols + 1)
    s[torch.arange(cols)[None, :] >= limits[:, None]] = float("-inf")
    out = torch.empty(rows, k, dtype=torch.int32)
    assert dsa._select_topk(s, limits, k, out=out) == 0
    assert torch.equal(out, topk_indices_torch(s, limits, k))
    dsa._select_topk(s[:12], limits[:12], k, out=out[:12])
    assert seen == [(rows, dsa.PREFILL_DECODE_OPTIONS), (12, {})]


def test_few_rows_select_takes_topk_decode_with_its_options_when_asked(monkeypatch):
    """A decode batch of at most TRITON_SELECT_MAX_ROWS rows takes the grid select by default (the radix select's
    kernels under the interpreter, which runs the grid's steps one launch each); with FEW_ROWS_SELECT
    "decode" it takes topk_decode with FEW_ROWS_DECODE_OPTIONS (here 3 rows of 4K keys, many parts over the flat
    select, ties at the k-th score), the twin's positions either way."""
    seen = []

    def spy(*args, **kwargs):
        seen.append((args[0].shape[0], {k: v for k, v in kwargs.items() if k != "out"}))
        return dsa_topk_decode(*args, **kwargs)

    dsa_topk_decode = dsa.topk_decode
    monkeypatch.setattr(dsa, "topk_decode", spy)
    gen = torch.Generator().manual_seed(10)
    s = torch.randn(3, 4096, generator=gen).round(decimals=1)
    limits = torch.tensor([4096, 3000, 100])
    out = torch.empty(3, 256, dtype=torch.int32)
    assert dsa.auto_select(3, 4096, 256) == dsa.FEW_ROWS_SELECT == "grid"
    grids = []
    real_grid = dsa.topk_grid
    monkeypatch.setattr(dsa, "topk_grid", lambda *a, **k: grids.append(a[0].shape) or real_grid(*a, **k))
    dsa._select_topk(s, limits, 256, out=out)  # the interpreter: auto takes topk_indices (the same positions)
    assert seen == [] and grids == [] and torch.equal(out, topk_indices_torch(s, limits, 256))
    out.fill_(-7)
    dsa._select_topk(s[:1], limits[:1], 256, out=out[:1], method="grid")  # asked for: the grid select
    assert grids == [(1, 4096)] and torch.equal(out[:1], topk_indices_torch(s[:1], limits[:1], 256))
    options = {"parts": 8, "seg_cap": 512, "flat": True, "block": 256, "num_warps": 4, "select_warps": 4}
    monkeypatch.setattr(dsa, "FEW_ROWS_SELECT", "decode")
    monkeypatch.setattr(dsa, "FEW_ROWS_DECODE_OPTIONS", options)
    out.fill_(-7)
    dsa._select_topk(s, limits, 256, out=out)
    assert seen == [(3, options)] and torch.equal(out, topk_indices_torch(s, limits, 256))
