"""The Gluon indexer prefill kernel (``adapt.kernels.dsa_gluon``): its sm_90 build on the CPU (ptxas of the triton
wheel, through ``benchmarks/dsa_gluon_sass.py`` in a process without the interpreter), the dispatch that keeps it
off the CPU, and on the GPU the kernel against the twin and the tl kernel."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import dsa
from tests.kernels.test_dsa import assert_close_scores, filled_cache, index_scores_float64
from tests.kernels.test_sparse_mla_sass import sass_rows

# The configs the prefill sweep times on the H200 (DeepSeek-V3.2: 64 heads x 128, 2 rows, 64-key pages), and the
# small head count / head dim of the GPU test below.
SHIPPED = [{}, {"maxnreg": 168}, {"NUM_STAGES": 4, "maxnreg": 168}, {"W_SMEM": False}, {"SPLIT_ROWS": True},
           {"SPLIT_ROWS": True, "ROWS": 4}, {"SPLIT_ROWS": True, "maxnreg": 96},
           {"WARPGROUPS": 1}, {"WARPGROUPS": 2}, {"WARPGROUPS": 2, "NUM_STAGES": 4}, {"WARPGROUPS": 4},
           {"WARPGROUPS": 2, "CARRY": True, "maxnreg": 128}, {"WARPGROUPS": 4, "CARRY": True},
           {"WARPGROUPS": 1, "CARRY": True, "maxnreg": 128},
           {"WARPGROUPS": 1, "CARRY": True, "TMA": True, "maxnreg": 128},
           {"WARPGROUPS": 1, "CARRY": True, "TMA": True, "REG_A": True, "maxnreg": 128},
           {"WS": 4, "maxnreg": 128}, {"WS": 4, "CARRY": False, "maxnreg": 128}, {"WS": 8, "maxnreg": 128}]
SMALL = [{"HEAD_DIM": 32, "BLOCK_H": 16}, {"HEAD_DIM": 32, "BLOCK_H": 16, "SPLIT_ROWS": True},
         {"HEAD_DIM": 32, "BLOCK_H": 16, "WARPGROUPS": 2},
         {"HEAD_DIM": 32, "BLOCK_H": 16, "WARPGROUPS": 1, "CARRY": True, "TMA": True, "REG_A": True},
         {"HEAD_DIM": 32, "BLOCK_H": 16, "WS": 4, "maxnreg": 128},
         {"HEAD_DIM": 32, "BLOCK_H": 16, "WS": 8, "maxnreg": 128}]


def test_sm90_build_keeps_the_wgmma_async_without_spills():
    """Every config compiles for sm_90 with no spill and without ptxas serialising the wgmma (C7514) or waiting
    on it before the epilogue of the other tile (C7517); the key-tile loop holds its MMAs (stacked: two key
    tiles per trip; split rows: one MMA per row; HEAD_DIM / 32 k-steps each) and 16-byte copies."""
    for row in sass_rows(SHIPPED + SMALL, "dsa_gluon_sass.py"):
        assert "error" not in row, row
        assert row["notes"] == [], row
        assert row["spill_bytes"] == 0, row
        # two key tiles per trip (stacked) or ROWS MMAs per key tile (split rows), HEAD_DIM / 32 k-steps each
        per_trip = row["config"].get("ROWS", 2) if row["config"].get("SPLIT_ROWS") else 2
        assert row["loop_ops"].get("QGMMA") == per_trip * row["config"].get("HEAD_DIM", 128) // 32, row
        if not row["config"].get("WS"):  # (ws: the loop found may be a worker's, which issues no copies)
            assert row["loop_ops"].get("UTMALDG" if row["config"].get("TMA") else "LDGSTS", 0) >= 1, row
        if row["config"].get("REG_A"):  # the key tile read into registers once (ldmatrix) for both wgmmas
            assert row["loop_ops"].get("LDSM", 0) >= 1, row
        if "maxnreg" in row["config"]:
            assert row["regs"] <= row["config"]["maxnreg"], row
        if row["config"].get("SPLIT_ROWS"):  # 4 programs of 128 threads per SM
            assert row["regs"] <= 128, row
        if row["config"].get("WARPGROUPS", 0) in (1, 2) or row["config"].get("WS"):
            # 2 programs of 8 warps per SM (4 of 4 warps at G = 1; ws: 8 warps at 4 rows, 16 at 8)
            assert row["regs"] <= 128, row


def test_dispatch_keeps_the_tl_kernel_off_hopper():
    """On the CPU (interpreter) the default takes the tl kernel; asking for the Gluon one is an error."""
    layer, batch, q8, weights = filled_cache((70,), heads=3, dim=32, device="cpu", seed=2)
    limits = (batch.positions + 1).int()
    args = (q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq, limits, 128)
    got = dsa.index_scores(*args, rows_per_tile=2, key_block=64)
    assert_close_scores(got, dsa.index_scores_torch(*args), "cpu")
    with pytest.raises(ValueError, match="gluon=True"):
        dsa.index_scores(*args, rows_per_tile=2, key_block=64, gluon=True)
    with pytest.raises(ValueError, match="gluon=True"):
        dsa.index_scores(*args, rows_per_tile=2, gluon=True, gluon_warpgroups=2)
    with pytest.raises(ValueError, match="gluon_ws=True needs a CUDA"):  # the warp-specialised kernel: sm_90 only
        dsa.index_scores(*args, rows_per_tile=4, gluon=True, gluon_ws=True)
    with pytest.raises(ValueError, match="gluon_ws=True needs gluon=True"):
        dsa.index_scores(*args, rows_per_tile=4, gluon=False, gluon_ws=True)
    # the library's prefill tile rows off sm_90: the 2-row default (4 rows on sm_90, the warp-specialised kernel)
    assert dsa.prefill_rows_per_tile(q8.device) == dsa.PREFILL_ROWS_PER_TILE == 2
    # a tile table computed ahead (no host sync in the call) gives the same scores
    tiles = dsa.prefill_query_tiles(batch.token_seq, 2)
    assert torch.equal(dsa.index_scores(*args, rows_per_tile=2, key_block=64, query_tiles=tiles), got)
    # asked for without gluon=True, the warpgroup option keeps the tl kernel (with its own 128-key tiles) here
    got = dsa.index_scores(*args, rows_per_tile=2, gluon_warpgroups=2)
    assert_close_scores(got, dsa.index_scores_torch(*args), "cpu")


GPU_OPTIONS = [dict(gluon=True), dict(gluon=True, gluon_maxnreg=168), dict(gluon=True, num_stages=2),
               dict(gluon=True, gluon_w_smem=False), dict(gluon=True, programs=1),
               dict(gluon=True, gluon_split_rows=True), dict(gluon=True, gluon_split_rows=True, programs=1),
               dict(gluon=True, gluon_split_rows=True, rows_per_tile=4, num_stages=2),
               dict(gluon=True, gluon_split_rows=True, gluon_maxnreg=96),
               dict(gluon=True, gluon_warpgroups=2, key_block=None), dict(gluon=True, gluon_warpgroups=1),
               dict(gluon=True, gluon_warpgroups=4, key_block=None, num_stages=2),
               dict(gluon=True, gluon_warpgroups=2, key_block=None, programs=1),
               dict(gluon=True, gluon_warpgroups=2, key_block=None, gluon_carry=True),
               dict(gluon=True, gluon_warpgroups=1, gluon_carry=True, programs=1),
               dict(gluon=True, gluon_warpgroups=1, gluon_carry=True, gluon_tma=True),
               dict(gluon=True, gluon_warpgroups=1, gluon_carry=True, gluon_tma=True, programs=1, num_stages=2),
               dict(gluon=True, gluon_warpgroups=1, gluon_carry=True, gluon_tma=True, gluon_reg_a=True),
               dict(gluon=True, gluon_warpgroups=1, gluon_carry=True, gluon_tma=True, gluon_reg_a=True, programs=1,
                    num_stages=2),
               dict(gluon=True, gluon_ws=True, gluon_carry=True, rows_per_tile=4),
               dict(gluon=True, gluon_ws=True, gluon_carry=True, rows_per_tile=4, programs=1, num_stages=2),
               dict(gluon=True, gluon_ws=True, rows_per_tile=4, num_stages=4),
               dict(gluon=True, gluon_ws=True, gluon_carry=True, rows_per_tile=8),
               dict(gluon=True, gluon_ws=True, gluon_carry=True, rows_per_tile=8, programs=1, num_stages=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("opts", GPU_OPTIONS)
def test_gluon_scores_match_twin_on_gpu(opts):
    """Three sequences (pages out of order in one), query tiles cut mid-sequence, odd and even key-tile counts
    per split, rows past a sequence's end: the Gluon kernel against the twin and float64."""
    layer, batch, q8, weights = filled_cache((70, 200, 5, 129), heads=3, dim=32, device="cuda", seed=7)
    table = batch.block_table.clone()
    table[1, :4] = table[1, :4].flip(0)
    limits = (batch.positions + 1).int()
    args = (q8, weights, layer.index_k, layer.index_scale, table, batch.token_seq, limits, 256)
    got = dsa.index_scores(*args, **{"rows_per_tile": 2, "key_block": 64, **opts})
    assert_close_scores(got, dsa.index_scores_torch(*args), "cuda")
    assert_close_scores(got, index_scores_float64(*args), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("split_rows", [False, True, "wg2", "wg2c", "ws4", "ws8"])
def test_gluon_scores_at_deepseek_shapes_on_gpu(split_rows):
    """DeepSeek-V3.2's indexer (64 heads x 128) on the last 64 rows of a 4160-token causal prefill: against the
    twin at the tight GPU tolerance, and against the tl kernel (the same arithmetic)."""
    n = 4160
    layer, batch, q8, weights = filled_cache((n,), heads=64, dim=128, device="cuda", seed=11)
    limits = (batch.positions + 1).int()
    last = slice(n - 64, n)
    args = (q8[last], weights[last], layer.index_k, layer.index_scale, batch.block_table, batch.token_seq[last],
            limits[last], n)
    if split_rows in ("ws4", "ws8"):  # 4- or 8-row tiles on a warpgroup every 2 rows, sharing the key pages
        got = dsa.index_scores(*args, rows_per_tile=int(split_rows[2]), gluon=True, gluon_ws=True, gluon_carry=True)
    elif split_rows in ("wg2", "wg2c"):  # the two-warpgroup kernel, 128-key tiles (with its carried epilogue)
        got = dsa.index_scores(*args, rows_per_tile=2, gluon=True, gluon_warpgroups=2, gluon_carry=split_rows == "wg2c")
    else:
        got = dsa.index_scores(*args, rows_per_tile=2, key_block=64, gluon=True, gluon_split_rows=split_rows)
    tl_scores = dsa.index_scores(*args, rows_per_tile=2, key_block=64, gluon=False)
    assert_close_scores(got, dsa.index_scores_torch(*args), "cuda")
    assert_close_scores(got, tl_scores, "cuda")
    finite = torch.isfinite(tl_scores)
    assert float((got[finite] - tl_scores[finite]).abs().max()) <= 1e-3 * float(tl_scores[finite].abs().max())


def test_padded_query_tiles_hold_the_exact_tiles_then_empty_ones():
    """The padded prefill tile table (no host sync) holds the exact table's tiles in the same order, then empty
    tiles whose rows are in range; one entry a row."""
    token_seq = torch.tensor([0] * 5 + [1] * 2 + [2] * 1 + [3] * 6, dtype=torch.int32)
    exact = dsa.prefill_query_tiles(token_seq, 2)
    padded = dsa.prefill_query_tiles(token_seq, 2, padded=True)
    assert padded.shape == (token_seq.numel(), 3)
    real = padded[padded[:, 1] > 0]
    assert torch.equal(real, exact)
    empty = padded[padded[:, 1] == 0]
    assert empty.shape[0] == token_seq.numel() - exact.shape[0]
    assert bool((empty[:, 0] >= 0).all() and (empty[:, 0] < token_seq.numel()).all())
    assert torch.equal(padded[: empty.shape[0], 1], torch.zeros(empty.shape[0], dtype=torch.int32))
