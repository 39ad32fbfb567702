"""Sparse MLA launch orders for prefill: the head blocks of a row side by side (``heads_inner``) compute the
same function as the row-major grid, on CPU (interpreter) and GPU."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels.sparse_mla import sparse_mla, sparse_mla_torch
from tests.kernels.test_sparse_mla import TWIN_REL_TOL, rel, setup
from tests.kernels.twin import twin_rel

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [
    {"block_h": 16},                                     # 2 head blocks of 16 (20 heads: the second one partial)
    {"block_h": 16, "groups4": True, "splits": 2},       # four-group kernel with position slices
])
def test_heads_inner_grid_matches_row_major_and_twin(device, tiles):
    rank = 64 if tiles.get("groups4") else 32
    layer, batch, indices, q_nope, q_rope = setup((7, 3), heads=20, rank=rank, rope=16, topk=24,
                                                  latent_format="fp8", device=device, scale_groups=4)
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
            batch.token_seq, indices, 0.3)
    row_major = sparse_mla(*args, **tiles)
    inner = sparse_mla(*args, heads_inner=True, **tiles)
    assert torch.isfinite(inner).all() and torch.equal(inner, row_major)
    # the same function as the twin (its tight kernel-vs-twin tolerance is held by test_sparse_mla.py's
    # shapes; at these 20 heads a few bf16 output roundings differ on CPU too, about 5e-5)
    assert rel(inner, sparse_mla_torch(*args)) <= TWIN_REL_TOL["cuda"]


@pytest.mark.gpu
def test_heads_inner_at_deepseek_v32_shapes_on_gpu():
    """128 heads, latent 512 + 64 fp8, top-2048, the default tile: bitwise equal to the row-major grid."""
    layer, batch, indices, q_nope, q_rope = setup((4000,), heads=128, rank=512, rope=64, topk=2048,
                                                  latent_format="fp8", device="cuda", scale_groups=4)
    rows = torch.arange(2000, 2300, device="cuda")
    args = (q_nope[rows], q_rope[rows], layer.latent_nope, layer.latent_scale, layer.latent_rope,
            batch.block_table, batch.token_seq[rows], indices[rows], 0.07)
    assert torch.equal(sparse_mla(*args, heads_inner=True), sparse_mla(*args))
    assert torch.equal(sparse_mla(*args, heads_inner=True, prefetch=True), sparse_mla(*args, prefetch=True))


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [{"half": True}, {"half": True, "heads_inner": True},
                                   {"half": True, "block_k": 64, "num_stages": 2, "prefetch": True}])
def test_half_at_deepseek_v32_shapes_on_gpu(tiles):
    """128 heads, latent 512 + 64 fp8, top-2048 over 4000 tokens: the fp16 tile against float64 and its twin."""
    from tests.kernels.test_sparse_mla import reference

    layer, batch, indices, q_nope, q_rope = setup((4000,), heads=128, rank=512, rope=64, topk=2048,
                                                  latent_format="fp8", device="cuda", scale_groups=4)
    rows = torch.tensor([0, 63, 2047, 2048, 3999]).cuda()
    sub = type(batch)(batch.slots, batch.positions[rows], batch.token_seq[rows], batch.query_starts,
                      batch.block_table, batch.seq_lens)
    args = (q_nope[rows], q_rope[rows], layer.latent_nope, layer.latent_scale, layer.latent_rope,
            batch.block_table, batch.token_seq[rows], indices[rows], 0.07)
    got = sparse_mla(*args, groups4=True, **tiles)
    assert rel(got, reference(layer, sub, indices[rows], q_nope[rows], q_rope[rows], 0.07)) < 1e-2
    assert rel(got, sparse_mla_torch(*args, half=True)) <= TWIN_REL_TOL["cuda"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [{"groups4": True, "half": True},
                                   {"groups4": True, "half": True, "heads_inner": True, "prefetch": True}])
def test_half_latent_matches_its_twin_and_reference(device, tiles):
    """fp16 dequantization and fp16 MMAs against the twin that rounds the same way (tight), and against
    float64 (the bf16 tolerance)."""
    from tests.kernels.test_sparse_mla import reference

    layer, batch, indices, q_nope, q_rope = setup((9, 40), heads=3, rank=64, rope=16, topk=24,
                                                  latent_format="fp8", device=device, scale_groups=4)
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
            batch.token_seq, indices, 0.15)
    got = sparse_mla(*args, **tiles)
    twin = sparse_mla_torch(*args, half=True)
    assert torch.isfinite(got).all()
    assert twin_rel(got, twin) <= TWIN_REL_TOL[device]  # softmax exp: torch vs the interpreter's numpy
    assert rel(got, reference(layer, batch, indices, q_nope, q_rope, 0.15)) < 1e-2
    assert rel(twin, sparse_mla_torch(*args)) > 0  # the half twin rounds differently from the bf16 one


def test_half_needs_the_four_group_kernel():
    layer, batch, indices, q_nope, q_rope = setup((9,), heads=3, rank=64, rope=16, topk=8, latent_format="fp8",
                                                  device="cpu", scale_groups=4)
    with pytest.raises(ValueError, match="groups4"):
        sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
                   batch.token_seq, indices, 0.1, half=True, groups4=False)
