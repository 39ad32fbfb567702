"""Lightning indexer kernels (Triton) against their torch twins, on CPU (interpreter) and GPU."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import dsa
from adapt.runtime.kv_cache import PagedKVCache, mla_layout

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def filled_cache(lengths, *, heads, dim, device, decode=False, seed=0):
    """Cache with sequences of ``lengths`` tokens; returns (cache layer, batch, q8, weights).

    With ``decode`` the last token of each sequence is appended as a separate decode step and
    the returned batch and queries are that step's."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(sum(-(-n // 64) for n in lengths) + 1, {0: mla_layout(32, 16, dim)}, device)
    seqs = [cache.add_sequence() for _ in lengths]
    first = [n - 1 for n in lengths] if decode else list(lengths)
    steps = [cache.append_tokens(seqs, first)]
    if decode:
        steps.append(cache.append_tokens(seqs, [1] * len(lengths)))
    layer = cache.dsa_layer(0)
    for batch in steps:
        n = batch.num_tokens
        keys, key_scale = dsa.quantize_fp8_rows_torch(torch.randn(n, dim, generator=gen).to(device))
        layer.write(batch.slots, torch.randn(n, 32, generator=gen).to(device),
                    torch.randn(n, 16, generator=gen).to(device), keys, key_scale)
    batch = steps[-1]
    n = batch.num_tokens
    q8, q_scale = dsa.quantize_fp8_rows_torch(torch.randn(n, heads, dim, generator=gen).to(device))
    weights = dsa.fold_index_weights(torch.randn(n, heads, generator=gen).to(device), q_scale, dim)
    return layer, batch, q8, weights


def score_tol(device, scores):
    """Absolute score difference that counts as a tie: none on CPU; on Hopper the FP8 MMA
    accumulates below fp32 precision."""
    finite = scores[torch.isfinite(scores)]
    return 0.0 if device == "cpu" else 2e-3 * float(finite.abs().max())


# ||kernel - reference|| / ||reference|| over the visible scores: fp32 accumulation of fp8 products
# on CPU (the interpreter) against float64 or the fp32 twin; Hopper's FP8 MMA accumulator on GPU.
SCORE_REL_TOL = {"cpu": 1e-6, "cuda": 5e-3}


def index_scores_float64(q8, weights, index_k, index_scale, block_table, token_seq, limits, num_cols):
    """The definition in float64, addressed per sequence: the sequence's pages in block-table order,
    flattened, give its keys in position order; I[t, s] = kscale[s] * sum_h w[t, h] * ReLU(q[t, h] . k[s])."""
    out = torch.full((q8.shape[0], num_cols), float("-inf"), dtype=torch.float64)
    for row in range(q8.shape[0]):
        limit = min(int(limits[row]), num_cols)
        pages = block_table[int(token_seq[row])].long().cpu()
        keys = index_k.cpu()[pages].reshape(-1, index_k.shape[-1])[:limit].double()
        kscale = index_scale.cpu()[pages].reshape(-1)[:limit].double()
        logits = torch.einsum("hd,sd->hs", q8[row].cpu().double(), keys)
        out[row, :limit] = kscale * (weights[row].cpu().double()[:, None] * logits.clamp_min(0)).sum(0)
    return out


def assert_close_scores(got, want, device):
    """Same visible set (finite entries) and relative error under SCORE_REL_TOL on it."""
    finite = torch.isfinite(want.cpu())
    assert torch.equal(torch.isfinite(got.cpu()), finite)
    g, w = got.cpu().double()[finite], want.cpu().double()[finite]
    err = float((g - w).norm() / w.norm())
    assert err <= SCORE_REL_TOL[device], f"relative error {err:.2e} > {SCORE_REL_TOL[device]:.0e}"


def assert_same_topk(got, want, scores, k, tol=0.0):
    """Same selected sets, except ties at the k-th score (within ``tol``); -1 exactly where a row
    sees fewer than k keys."""
    for row in range(scores.shape[0]):
        visible = int(torch.isfinite(scores[row]).sum())
        g, w = got[row], want[row]
        assert int((g == -1).sum()) == max(0, k - visible)
        assert int((w == -1).sum()) == max(0, k - visible)
        g, w = set(g[g >= 0].tolist()), set(w[w >= 0].tolist())
        assert len(g) == min(k, visible)
        if g != w:
            kth = scores[row].topk(min(k, visible)).values[-1]
            assert all(abs(scores[row, i] - kth) <= tol for i in g ^ w), f"row {row}: {g ^ w} not ties"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 32), (3, 48), (2, 4, 64)])
def test_quantize_fp8_rows_matches_twin(device, shape):
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 10).to(device)
    got, got_scale = dsa.quantize_fp8_rows(x)
    want, want_scale = dsa.quantize_fp8_rows_torch(x)
    torch.testing.assert_close(got_scale, want_scale)
    assert torch.equal(got.float(), want.float())
    assert ((got.float() * got_scale.unsqueeze(-1) - x).abs() <= x.abs().amax(-1, keepdim=True) / 16).all()


# One program per key tile (default split), and few programs each streaming many key tiles
# of 64 keys through the pipeline, with query tiles cut mid-sequence.
TILE_OPTIONS = [{}, {"programs": 1, "key_block": 64, "rows_per_tile": 4, "num_stages": 2}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths,tiles", [((3, 64, 65), TILE_OPTIONS[0]), ((130,), TILE_OPTIONS[0]),
                                           ((3, 64, 65), TILE_OPTIONS[1]),
                                           ((3, 64, 65), {**TILE_OPTIONS[1], "stacked": False})])
def test_prefill_scores_match_twin(device, lengths, tiles):
    layer, batch, q8, weights = filled_cache(lengths, heads=3, dim=32, device=device)
    limits = (batch.positions + 1).int()
    cols = 256
    got = dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq,
                           limits, cols, **tiles)
    want = dsa.index_scores_torch(q8, weights, layer.index_k, layer.index_scale, batch.block_table,
                                  batch.token_seq, limits, cols)
    exact = index_scores_float64(q8, weights, layer.index_k, layer.index_scale, batch.block_table,
                                 batch.token_seq, limits, cols)
    assert torch.isfinite(want).sum(1).tolist() == limits.tolist()
    assert_close_scores(got, want, device)
    assert_close_scores(want, exact, "cpu")
    assert_close_scores(got, exact, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [TILE_OPTIONS[0], {"programs": 4, "key_block": 64}])
def test_decode_scores_and_topk_match_twin(device, tiles):
    layer, batch, q8, weights = filled_cache((10, 64, 65, 129), heads=4, dim=32, device=device, decode=True)
    limits = (batch.positions + 1).int()
    assert limits.tolist() == [10, 64, 65, 129]
    args = (q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq, limits)
    got = dsa.index_scores(*args, 192, **tiles)
    want = dsa.index_scores_torch(*args, 192)
    assert_close_scores(got, want, device)
    assert_close_scores(got, index_scores_float64(*args, 192), device)
    idx, _ = dsa.index_topk(*args, 32, **tiles)
    ref, _ = dsa.index_topk_torch(*args, 32)
    assert_same_topk(idx.cpu(), ref.cpu(), want.cpu(), 32, score_tol(device, want))
    if device == "cpu":  # same scores to rounding, same tie rule: the same positions in the same order
        assert torch.equal(idx, ref)
    synced_free, _ = dsa.index_topk(*args, 32, max_keys=192, rows_per_tile=1, **tiles)
    assert_same_topk(synced_free.cpu(), ref.cpu(), want.cpu(), 32, score_tol(device, want))


def test_decode_default_tiles_and_programs_per_row(monkeypatch):
    """Decode calls without tile options take the DECODE_* tiles (64-key tiles, 8 stages) and at most
    DECODE_PROGRAMS_PER_ROW programs a row up to DECODE_PROGRAMS; explicit programs are kept; the scores are the
    twin's."""
    seen = []
    real = dsa._key_splits
    monkeypatch.setattr(dsa, "_key_splits", lambda tiles, rows, programs: seen.append((tiles, rows, programs))
                        or real(tiles, rows, programs))
    monkeypatch.setattr(dsa, "DECODE_PROGRAMS_PER_ROW", 3)
    monkeypatch.setattr(dsa, "DECODE_PROGRAMS", 10)
    layer, batch, q8, weights = filled_cache((10, 64, 65, 129), heads=4, dim=32, device="cpu", decode=True)
    limits = (batch.positions + 1).int()
    args = (q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq, limits)
    got = dsa.index_scores(*args, 192, rows_per_tile=1)
    assert_close_scores(got, dsa.index_scores_torch(*args, 192), "cpu")
    dsa.index_scores(*[a[:1] for a in args[:2]], *args[2:5], batch.token_seq[:1], limits[:1], 192, rows_per_tile=1)
    dsa.index_scores(*args, 192, rows_per_tile=1, programs=7)
    assert seen == [(192 // dsa.DECODE_KEY_BLOCK, 4, 10), (192 // dsa.DECODE_KEY_BLOCK, 1, 3),
                    (192 // dsa.DECODE_KEY_BLOCK, 4, 7)]


@pytest.mark.parametrize("device", DEVICES)
def test_topk_chunks_stay_under_the_memory_bound(device):
    layer, batch, q8, weights = filled_cache((100,), heads=4, dim=32, device=device)
    limits = (batch.positions + 1).int()
    args = (q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq, limits)
    bound = 16 * 128 * 4
    idx, stats = dsa.index_topk(*args, 24, max_score_bytes=bound)
    whole, whole_stats = dsa.index_topk_torch(*args, 24)
    assert stats.chunks >= 100 // 16 and stats.peak_score_bytes <= bound
    assert whole_stats.chunks == 1
    scores = dsa.index_scores_torch(*args, 128)
    assert_same_topk(idx.cpu(), whole.cpu(), scores.cpu(), 24, score_tol(device, scores))
    assert (idx.cpu() <= batch.positions.cpu()[:, None]).all()


@pytest.mark.gpu
def test_deepseek_v32_shapes_on_gpu():
    """64 heads x 128 dims, top-2048, prefill of 3000 tokens + decode at 5000 against the twin."""
    layer, batch, q8, weights = filled_cache((3000, 700), heads=64, dim=128, device="cuda")
    limits = (batch.positions + 1).int()
    rows = torch.cat([torch.arange(0, 3700, 97), torch.tensor([2999, 3000, 3699])]).cuda()
    args = (layer.index_k, layer.index_scale, batch.block_table)
    got = dsa.index_scores(q8, weights, *args, batch.token_seq, limits, 3072)[rows]
    want = dsa.index_scores_torch(q8[rows], weights[rows], *args, batch.token_seq[rows], limits[rows], 3072)
    assert_close_scores(got, want, "cuda")
    idx, stats = dsa.index_topk(q8, weights, *args, batch.token_seq, limits, 2048, max_score_bytes=1 << 24)
    assert stats.peak_score_bytes <= 1 << 24 and stats.chunks > 1
    ref, _ = dsa.index_topk_torch(q8[rows], weights[rows], *args, batch.token_seq[rows], limits[rows], 2048)
    assert_same_topk(idx[rows].cpu(), ref.cpu(), want.cpu(), 2048, score_tol("cuda", want))


def test_topk_chunks_decide_their_tile_rows_once(monkeypatch):
    """index_topk without rows_per_tile decides every chunk's tiles in one read-back: a chunk whose rows are all of
    different sequences gets decode tiles (1 row), a chunk with neighbours of one sequence prefill tiles; the result
    is the twin's either way."""
    layer, batch, q8, weights = filled_cache((1, 1, 1, 1, 60), heads=4, dim=32, device="cpu")
    limits = (batch.positions + 1).int()
    args = (q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq, limits)
    seen = []
    real = dsa.index_scores
    monkeypatch.setattr(dsa, "index_scores", lambda *a, **kw: seen.append(kw.get("rows_per_tile")) or real(*a, **kw))
    idx, stats = dsa._index_topk_chunked(dsa.index_scores, dsa._select_topk, *args, 8, 4 * 128 * 4, None, "auto", {})
    assert stats.chunks == 16 and seen[0] == 1 and set(seen[1:]) == {dsa.PREFILL_ROWS_PER_TILE}
    ref, _ = dsa.index_topk_torch(*args, 8)
    scores = dsa.index_scores_torch(*args, 128)
    assert_same_topk(idx, ref, scores, 8, score_tol("cpu", scores))


def test_topk_chunks_run_widest_first(monkeypatch):
    """A causal prefill's chunks are scored widest first (the host ahead of the GPU from the first launch); each
    chunk writes its own rows, so the result is the one in row order, bit for bit (the twin scores the chunks here:
    the order is the chunking's, whatever kernel scores them)."""
    layer, batch, q8, weights = filled_cache((300,), heads=4, dim=32, device="cpu")
    limits = (batch.positions + 1).int()
    args = (q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq, limits)
    widths = []

    def score(*a, **kw):
        widths.append(a[7])
        return dsa.index_scores_torch(*a, **kw)

    def select(scores, lims, k, *, out, method):
        out.copy_(dsa.topk_indices_torch(scores, lims, k))
        return 0

    bound = 64 * 384 * 4  # 64 rows a chunk (the widest row's 300 keys in 384 columns): widths 128, 128, 256, 256, 384
    idx, stats = dsa._index_topk_chunked(score, select, *args, 16, bound, None, "auto", {})
    assert stats.chunks == 5 and widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    monkeypatch.setattr(dsa, "CHUNKS_WIDEST_FIRST", False)
    widths.clear()
    in_order, _ = dsa._index_topk_chunked(score, select, *args, 16, bound, None, "auto", {})
    assert widths == sorted(widths) and torch.equal(idx, in_order)
    ref, _ = dsa.index_topk_torch(*args, 16)
    assert torch.equal(idx, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows_per_tile", [1, 2, 3, 4])
def test_padded_tile_table_kernel_matches_the_torch_form(monkeypatch, rows_per_tile, device):
    """The padded tile table's one-program kernel (``dsa._padded_tiles_kernel``) equals the torch form bit for bit:
    runs of 1-700 rows (a run across the kernel's 1024-row blocks), a single row, one run."""
    gen = torch.Generator().manual_seed(rows_per_tile)
    lengths = torch.randint(1, 700, (9,), generator=gen).tolist() + [1, 3]
    cases = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
             torch.zeros(1, dtype=torch.int64), torch.full((2049,), 5), torch.arange(7)]
    for token_seq in cases:
        token_seq = token_seq.to(device=device, dtype=torch.int32)
        got = dsa.prefill_query_tiles(token_seq, rows_per_tile, padded=True)
        monkeypatch.setattr(dsa, "PADDED_TILES_KERNEL", False)
        want = dsa.prefill_query_tiles(token_seq, rows_per_tile, padded=True)
        monkeypatch.setattr(dsa, "PADDED_TILES_KERNEL", True)
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want), token_seq.numel()
