"""The Gluon candidate pass of the decode top-k (``topk_gluon``, sm_90 only): its sm_90 build on the CPU (by
``benchmarks/topk_gluon_sass.py`` in a process without the interpreter: one layout from load to store, so a step
holds two barriers where the tl pass holds 23), and on the GPU the same tau, counts and stored candidates as the tl
pass, and ``topk_decode``'s result through it equal to the twin's."""

import pytest
import torch

from tests.kernels.test_sparse_mla_sass import sass_rows


@pytest.mark.slow
def test_gluon_candidate_pass_builds_for_sm90_with_two_barriers_a_step():
    *gluon_rows, tl_row = sass_rows([{}, {"warps": 4}, {"DEPTH": 2}, {"kernel": "tl"}], script="topk_gluon_sass.py")
    for row in gluon_rows:
        assert "error" not in row, row
        assert row["spill_bytes"] == 0 and row["regs"] <= 255, row
        assert row["loops"] and all(loop["bar"] <= 2 for loop in row["loops"]), row
        # fewer than half the tl step's instructions for 16 scores a thread (4096 a step on 8 warps)
        assert max(loop["len"] for loop in row["loops"]) * 2 < tl_row["loops"][0]["len"], (row, tl_row)
    assert tl_row["loops"][0]["bar"] > 2  # what the Gluon form removes (the tl pass converts layouts each step)


def _candidates(s, limits, k, gluon, **opts):
    from adapt.kernels.topk import decode_candidates

    return decode_candidates(s, limits.int().contiguous(), k, gluon=gluon, **opts)


def _same_candidates(a, b):
    """Equal tau and counts, and equal stored slots (those below each part's count, capped at its slots)."""
    tau_a, keys_a, pos_a, counts_a = a
    tau_b, keys_b, pos_b, counts_b = b
    assert torch.equal(tau_a, tau_b) and torch.equal(counts_a, counts_b)
    stored = torch.arange(keys_a.shape[2], device=keys_a.device) < counts_a.clamp(max=keys_a.shape[2])[..., None]
    assert torch.equal(torch.where(stored, keys_a, 0), torch.where(stored, keys_b, 0))
    assert torch.equal(torch.where(stored, pos_a, 0), torch.where(stored, pos_b, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("opts", [dict(parts=3, block=512, num_warps=8), dict(parts=1, block=2048, num_warps=4),
                                  dict(parts=2, block=4096, num_warps=8), dict(parts=5, block=256, num_warps=8),
                                  dict(parts=1, block=4096, num_warps=16), dict(parts=2, block=8192, num_warps=16)])
def test_gluon_candidates_equal_the_tl_pass_on_adversarial_rows(opts, depth, monkeypatch):
    """test_topk_decode's adversarial rows (ties, misjudged samples, -inf holes, short and empty rows), columns not a
    multiple of 16 too (unaligned rows: scalar loads), at several step sizes and part counts: the same workspace."""
    from tests.kernels.test_topk_decode import SAMPLE, K, adversarial_rows

    s, limits = adversarial_rows(torch.Generator().manual_seed(1))
    s, limits = s.cuda(), limits.cuda()
    for scores in (s, s[:, :4001]):
        lim = limits.clamp(max=scores.shape[1])
        for cap in (2 * K, 40):  # the default slots, and few enough that parts pass them
            args = dict(opts, sample=SAMPLE, seg_cap=cap)
            _same_candidates(_candidates(scores, lim, K, True, **args), _candidates(scores, lim, K, False, **args))


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, dict(parts=4, seg_cap=2048), dict(block=2048, num_warps=4, select_warps=8),
                                  dict(block=8192, num_warps=16)])
def test_topk_decode_through_the_gluon_pass_at_deepseek_v32_batch64(opts):
    """64 rows x 128K keys, top-2048 (random limits; one row of rounded scores: ties; one all equal: the full-row
    select), in a CUDA graph: the twin's positions, the same candidates as the tl pass."""
    from adapt.kernels.topk import topk_decode, topk_indices_torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(64, 131072, device="cuda", generator=gen)
    s[1] = torch.round(s[1] * 4)
    s[2] = 1.0
    limits = torch.randint(1000, 131073, (64,), device="cuda", generator=gen).int()
    limits[0] = 131072
    out = torch.empty(64, 2048, dtype=torch.int32, device="cuda")
    redo = torch.empty(64, dtype=torch.int32, device="cuda")
    topk_decode(s, limits, 2048, out=out, redo=redo, gluon=True, **opts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_decode(s, limits, 2048, out=out, redo=redo, gluon=True, **opts)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, topk_indices_torch(s, limits, 2048))
    assert redo[2].item() == 1
    pass_opts = {k: v for k, v in opts.items() if k in ("block", "num_warps")}
    parts, cap = opts.get("parts", 2), opts.get("seg_cap", 4096)
    _same_candidates(_candidates(s, limits, 2048, True, parts=parts, sample=4096, seg_cap=cap, **pass_opts),
                     _candidates(s, limits, 2048, False, parts=parts, sample=4096, seg_cap=cap, **pass_opts))
