"""Fused decode index + top-k (``dsa.index_topk_fused``): the scoring kernel keeps the candidates above a sampled
threshold, one select over them. Exact against the twin select of the kernel's own scores (positions, tie order,
-1 after them), on rows the sample judges right and rows it misjudges (selected again on the device)."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import dsa, topk
from adapt.kernels.formats import FP8_DTYPE, PAGE_SIZE
from adapt.kernels.topk import topk_indices_torch
from tests.kernels.test_dsa import assert_close_scores, assert_same_topk, filled_cache, score_tol

LENGTHS = (10, 64, 65, 129, 700, 1500, 1500)
COLS = 1536
K = 100
SAMPLE = 64


def sampled_positions(n, sample=SAMPLE, run=8):
    """``topk.sample_columns`` of a row of n visible keys (runs of 8, span a multiple of 8), those below n."""
    per_run = -(-n // (sample // run))
    span = max(-(-per_run // run) * run, run)
    return [p for p in ((i // run) * span + i % run for i in range(sample)) if p < n]


def adversarial_case(device):
    """Row 4: every score 0 or -0 (all tie: the lowest positions win); row 6: the sampled keys alone score high
    (tau above all but a few keys: fewer than K candidates, so the full-row select runs); the rest random, row 0
    shorter than K (-1 after its 10 positions)."""
    layer, batch, q8, weights = filled_cache(LENGTHS, heads=4, dim=32, device=device, decode=True)
    bt = batch.block_table.cpu().long()
    scale = layer.index_scale.view(-1)
    for p in range(700):
        scale[int(bt[4, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE] = 0.0
    for p in sampled_positions(1500):
        scale[int(bt[6, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE] *= 1000.0
    limits = (batch.positions + 1).int()
    return (q8, weights, layer.index_k, layer.index_scale, batch.block_table, batch.token_seq, limits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("opts, patch", [
    ({"programs": 24, "sample": SAMPLE}, {}),  # 3-4 programs a row, candidates of several runs
    ({"programs": 7, "sample": SAMPLE, "key_block": 64}, {"FUSED_SEG_CAP": 8}),  # runs past their slots
    ({"programs": 400, "sample": 128}, {"FUSED_CAP": 256}),  # one tile a program; rows past the select's slots
])
def test_fused_decode_topk_is_the_twin_select_of_its_scores(device, opts, patch, monkeypatch):
    for name, value in patch.items():  # FUSED_SEG_CAP: dsa's (the scoring programs' slots); FUSED_CAP: the select's
        monkeypatch.setattr(dsa if name == "FUSED_SEG_CAP" else topk, name, value)
    args = adversarial_case(device)
    limits = args[-1]
    redo = torch.full((len(LENGTHS),), -5, dtype=torch.int32, device=device)
    out = torch.full((len(LENGTHS) + 2, K), -7, dtype=torch.int32, device=device)
    got, scores = dsa.index_topk_fused(*args, K, COLS, out=out[1:-1], redo=redo, **opts)
    assert got.data_ptr() == out[1:-1].data_ptr() and (out[0] == -7).all() and (out[-1] == -7).all()
    assert torch.equal(got.cpu(), topk_indices_torch(scores.cpu(), limits.cpu(), K))
    want = dsa.index_scores_torch(*args, COLS)
    assert_close_scores(scores, want, device)
    assert_same_topk(got.cpu(), topk_indices_torch(want, limits, K).cpu(), want.cpu(), K, score_tol(device, want))
    flags = redo.tolist()
    assert set(flags) <= {0, 1} and flags[6] == 1
    if not patch:
        assert flags == [0, 0, 0, 0, 0, 0, 1]
    if "FUSED_CAP" in patch:
        assert flags[4] == 1 and flags[0] == 0  # 700 tied candidates, 256 slots; 10 fit
    if "FUSED_SEG_CAP" in patch:
        assert flags[4] == 1 and flags[0] == 1  # every key a candidate: 10 keys and more a run, 8 slots


def test_index_topk_auto_takes_fused_for_decode_calls(monkeypatch):
    """With FUSED_DECODE_MIN_ROWS set, ``auto`` with rows_per_tile=1 (a decode call) runs index_topk_fused; without
    rows_per_tile, or with FUSED_DECODE_MIN_ROWS None (the default: measured slower), the scores + select path.
    Both give the twin's positions."""
    assert dsa.FUSED_DECODE_MIN_ROWS is None
    monkeypatch.setattr(dsa, "FUSED_DECODE_MIN_ROWS", 1)
    args = adversarial_case("cpu")
    calls = []
    real = dsa.index_topk_fused
    monkeypatch.setattr(dsa, "index_topk_fused", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    ref, _ = dsa.index_topk_torch(*args, K)
    fused, _ = dsa.index_topk(*args, K, max_keys=COLS, rows_per_tile=1, programs=24, sample=SAMPLE)
    assert calls == [len(LENGTHS)]
    plain, _ = dsa.index_topk(*args, K, max_keys=COLS, programs=24)
    monkeypatch.setattr(dsa, "FUSED_DECODE_MIN_ROWS", None)
    plain_decode, _ = dsa.index_topk(*args, K, max_keys=COLS, rows_per_tile=1, programs=24)
    assert calls == [len(LENGTHS)]
    scores = dsa.index_scores(*args, COLS, rows_per_tile=1, programs=24)
    for idx in (fused, plain, plain_decode):
        assert_same_topk(idx, ref, scores, K)
    assert torch.equal(fused, topk_indices_torch(scores, args[-1], K))


def test_fused_decode_rejects_a_sample_that_is_no_power_of_two():
    args = adversarial_case("cpu")
    with pytest.raises(ValueError, match="power of two"):
        dsa.index_topk_fused(*args, K, COLS, sample=100)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_fused_decode_deepseek_v32_shapes_in_a_cuda_graph(batch):
    """64 index heads x 128 dims, 128K keys, top-2048, replayed from a CUDA graph: identical to the twin select of
    the kernel's scores, which match the plain scoring kernel's; a row of all-equal scores (weights 0: every key
    ties, more than the select's slots) is selected again inside the graph (no host sync). Rows of random limits
    may be redone (exact either way); the full 128K row 0 is judged right."""
    context, k = 131072, 2048
    gen = torch.Generator(device="cuda").manual_seed(batch)
    pages = batch * context // PAGE_SIZE
    index_k = torch.randn(pages, PAGE_SIZE, 128, device="cuda", generator=gen).to(FP8_DTYPE)
    index_scale = torch.rand(pages, PAGE_SIZE, device="cuda", generator=gen) + 0.5
    block_table = torch.randperm(pages, device="cuda", generator=gen).view(batch, -1).int()
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    limits = torch.randint(1000, context + 1, (batch,), device="cuda", generator=gen).int()
    limits[0] = context
    q8 = torch.randn(batch, 64, 128, device="cuda", generator=gen).to(FP8_DTYPE)
    weights = torch.randn(batch, 64, device="cuda", generator=gen) * 0.01
    args = (q8, weights, index_k, index_scale, block_table, token_seq, limits)
    out = torch.empty(batch, k, dtype=torch.int32, device="cuda")
    redo = torch.empty(batch, dtype=torch.int32, device="cuda")
    holder = {}
    holder["scores"] = dsa.index_topk_fused(*args, k, context, out=out, redo=redo)[1]  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        holder["scores"] = dsa.index_topk_fused(*args, k, context, out=out, redo=redo)[1]
    for step in range(2):
        if step:
            weights[-1] = 0.0
        graph.replay()
        torch.cuda.synchronize()
        scores = holder["scores"]
        assert torch.equal(out, topk_indices_torch(scores, limits, k))
        assert_close_scores(scores, dsa.index_scores(*args, context, rows_per_tile=1), "cuda")
        assert redo[-1].item() == step and (batch == 1 or redo[0].item() == 0)


def test_bench_line_shows_fused_tiles_and_the_fastest():
    from adapt.stages.bench_dsa import _fused_line

    case = {"fused_sweep": [{"us": 40.5, "equals_twin": True, "redo_rows": 0, "timed_as": "graph"},
                            {"sample": 2048, "error": "out of resources"}],
            "fused_tiles": {"sample": None, "programs": None}}
    line = _fused_line(case)
    assert "default: 40.5 (graph, twin True, redo 0)" in line and "{'sample': 2048}: out of resources" in line
    assert line.endswith("fastest {'sample': None, 'programs': None}")
