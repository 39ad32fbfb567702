"""Prefill sparse MLA over the cache converted once to a dense bf16 latent (``sparse_mla(..., upconvert=True)``):
the conversion against its twin, bit for bit; attention over it against the twin of the fp8 path (the same values
reach the MMAs); the sm_90 build of the Gluon bf16 kernel on the CPU; on the GPU the DeepSeek-V3.2 shape against the
twin and against the fp8 Gluon kernel."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import sparse_mla as sm
from tests.kernels.test_sparse_mla import DEVICES, TWIN_REL_TOL, reference, rel, setup


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank,groups", [(32, 2), (64, 4)])
def test_upconvert_matches_its_twin_bit_for_bit(device, rank, groups):
    layer, batch, _, _, _ = setup((9, 70), heads=2, rank=rank, rope=16, topk=8, latent_format="fp8", device=device,
                                  scale_groups=groups)
    layer.latent_scale.uniform_(0.01, 3.0)  # scales that are not powers of two: the product rounds
    table = torch.cat([batch.block_table, torch.full_like(batch.block_table[:, :1], -1)], dim=1)  # a padded entry
    got = sm.upconvert_latent(layer.latent_nope, layer.latent_scale, layer.latent_rope, table)
    want = sm.upconvert_latent_torch(layer.latent_nope, layer.latent_scale, layer.latent_rope, table)
    assert got[0].shape == (2, table.shape[1] * 64, rank) and got[1].shape == (2, table.shape[1] * 64, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # position p of sequence b is its cache row through the block table, dequantised as the kernels do
    b, p = 1, 67
    slot = int(batch.block_table[b, p // 64]) * 64 + p % 64
    row = layer.latent_nope.reshape(-1, rank)[slot].float().view(groups, -1)
    deq = (row * layer.latent_scale.reshape(-1, groups)[slot].view(groups, 1)).to(torch.bfloat16).view(-1)
    assert torch.equal(got[0][b, p], deq)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
def test_upconverted_attention_matches_the_fp8_twin(device, splits):
    layer, batch, indices, q_nope, q_rope = setup((9, 40), heads=3, rank=32, rope=16, topk=24, latent_format="fp8",
                                                  device=device)
    indices[4] = -1  # a row with no position returns 0
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
            batch.token_seq, indices, 0.15)
    got = sm.sparse_mla(*args, upconvert=True, splits=splits)
    twin = sm.sparse_mla_torch(*args)
    assert torch.equal(got[4].float().cpu(), torch.zeros(3, 32))
    assert rel(got, twin) <= TWIN_REL_TOL[device]
    assert rel(got, reference(layer, batch, indices, q_nope, q_rope, 0.15)) < 1e-2


def test_upconvert_takes_an_fp8_latent_and_no_tile_option():
    layer, batch, indices, q_nope, q_rope = setup((9,), heads=2, rank=32, rope=16, topk=8, latent_format="bf16",
                                                  device="cpu")
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
            batch.token_seq, indices, 0.15)
    with pytest.raises(ValueError, match="e4m3 latent"):
        sm.sparse_mla(*args, upconvert=True)
    layer, batch, indices, q_nope, q_rope = setup((9,), heads=2, rank=32, rope=16, topk=8, latent_format="fp8",
                                                  device="cpu")
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
            batch.token_seq, indices, 0.15)
    with pytest.raises(ValueError, match="given: block_k"):
        sm.sparse_mla(*args, upconvert=True, block_k=16)


def test_upconvert_rule_counts_gathers_against_converted_positions(monkeypatch):
    table = torch.zeros(1, 2048, dtype=torch.int32)  # 128K positions
    monkeypatch.setattr(sm, "UPCONVERT_AUTO", True)
    assert sm.upconvert_worth(16384, 128, 2048, table)  # a prefill chunk: 256x more gathers than positions
    assert not sm.upconvert_worth(64, 128, 2048, table)  # decode: 2x fewer
    monkeypatch.setattr(sm, "UPCONVERT_MAX_BYTES", 1 << 20)
    assert not sm.upconvert_worth(16384, 128, 2048, table)  # the dense copy over its bound
    monkeypatch.setattr(sm, "UPCONVERT_MAX_BYTES", 4 << 30)
    assert not sm.upconvert_worth(16384, 128, 2048, table, gluon_bf16=False)  # no Gluon bf16 kernel (CPU, shape)
    monkeypatch.setattr(sm, "UPCONVERT_AUTO", False)
    assert not sm.upconvert_worth(16384, 128, 2048, table)


@pytest.mark.slow
def test_gluon_bf16_kernel_builds_for_sm90_with_its_mmas_in_flight():
    """The sm_90 build: within registers and shared memory, each tile's rows as cp.async copies (64 x 512 + 64 x 64
    bf16 over 256 threads: 18 LDGSTS a thread), no dequantisation in the loop (no HADD2; F2FP only for p), and the
    wgmmas not serialised (a few WARPGROUP ops a tile, not an arrive / wait pair per HGMMA: C7515)."""
    from tests.kernels.test_sparse_mla_gluon import H200_SHARED_BYTES
    from tests.kernels.test_sparse_mla_sass import sass_rows

    rows = sass_rows([{"bf16": True, "SPLIT": False, "DEFER_SUM": False},
                      {"bf16": True, "SPLIT": True, "DEFER_SUM": False},
                      {"bf16": True, "SPLIT": False, "EARLY_WAIT": False, "DEFER_SUM": False},
                      {"bf16": True, "SPLIT": True, "DEFER_SUM": True},
                      {"bf16": True, "SPLIT": False, "EARLY_WAIT": False, "COPY_ROWS4": True}])
    for row in rows:
        assert "error" not in row, row
        assert row["regs"] <= 255 and row["spill_bytes"] == 0 and row["shared"] <= H200_SHARED_BYTES, row
        ops = row["loop_ops"]
        assert ops.get("HGMMA", 0) == 40 and ops.get("WARPGROUP", 0) <= 8, row
        assert ops.get("LDGSTS", 0) == 18 and ops.get("HADD2", 0) == 0 and ops.get("F2FP", 0) <= 8, row
    # DEFER_SUM: one cross-warp reduction a tile instead of two (fewer barriers and shuffles)
    assert rows[3]["loop_ops"]["BAR"] < rows[1]["loop_ops"]["BAR"], rows
    # COPY_ROWS4 (the shipped default, with DEFER_SUM): 4 position loads and row addresses a thread, not 16
    assert rows[4]["loop_ops"]["LDG"] < rows[3]["loop_ops"]["LDG"] and rows[4]["loop_len"] < rows[3]["loop_len"], rows


def _v32_case(heads=128, topk=2048):
    from tests.kernels.test_sparse_mla_gluon import _case

    rows = torch.tensor([0, 63, 64, 2047, 2048, 3999, 4000, 4999]).cuda()
    return _case((4000, 1000), rows, heads=heads, topk=topk)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,early_wait,defer_sum,rows4", [(None, False, False, False), (16, False, False, False),
                                                             (None, True, False, False), (16, True, False, False),
                                                             (None, True, True, False), (16, True, True, False),
                                                             (None, False, False, True), (16, False, True, True)])
def test_upconverted_gluon_deepseek_v32_shape_matches_twin_and_fp8_kernel(monkeypatch, splits, early_wait,
                                                                          defer_sum, rows4):
    """128 heads, latent 512 + 64 in e4m3 (four groups), top-2048 over 5000 cached tokens: the Gluon bf16 kernel
    against the twin and the float64 reference, and bit-equal to the fp8 Gluon kernel (the same bf16 operands,
    tiles, MMA shapes and softmax) unless DEFER_SUM; ``upconvert=None`` takes it where the rule says so."""
    monkeypatch.setattr(sm.sparse_mla_gluon, "BF16_EARLY_WAIT", early_wait)
    monkeypatch.setattr(sm.sparse_mla_gluon, "BF16_DEFER_SUM", defer_sum)
    monkeypatch.setattr(sm.sparse_mla_gluon, "BF16_COPY_ROWS4", rows4)
    layer, sub, args = _v32_case()
    args[7][1] = -1
    got = sm.sparse_mla(*args, upconvert=True, splits=splits)
    assert torch.equal(got[1].float().cpu(), torch.zeros(128, 512))
    assert rel(got, sm.sparse_mla_torch(*args)) <= TWIN_REL_TOL["cuda"]
    assert rel(got, reference(layer, sub, args[7], args[0], args[1], 0.07)) < 1e-2
    if not defer_sum:  # DEFER_SUM adds the softmax sums in another order
        assert torch.equal(got, sm.sparse_mla(*args, gluon=True, splits=splits))
    # the default rule takes the bf16 kernel for these 8 rows x 2 head blocks x 2048 only with a low ratio
    monkeypatch.setattr(sm, "UPCONVERT_MIN_RATIO", 0)
    assert torch.equal(sm.sparse_mla(*args, splits=splits), got)
