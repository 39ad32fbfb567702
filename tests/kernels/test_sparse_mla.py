"""Sparse MLA attention kernel (Triton) against its torch twin and a float64 reference."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels.fp8 import quantize_fp8_groups
from adapt.kernels.reference import sparse_mla_reference
from adapt.kernels.sparse_mla import sparse_mla, sparse_mla_torch, wave_splits
from adapt.runtime.kv_cache import PagedKVCache, mla_layout

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def setup(lengths, *, heads, rank, rope, topk, latent_format, device, seed=0, scale_groups=2):
    gen = torch.Generator().manual_seed(seed)
    layout = mla_layout(rank, rope, 16, latent_format=latent_format,
                        latent_scale_group=min(128, rank // scale_groups))
    cache = PagedKVCache(sum(-(-n // 64) for n in lengths) + 2, {0: layout}, device)
    seqs = [cache.add_sequence() for _ in lengths]
    batch = cache.append_tokens(seqs, list(lengths))
    layer = cache.dsa_layer(0)
    n = batch.num_tokens
    layer.write(batch.slots, torch.randn(n, rank, generator=gen).to(device),
                torch.randn(n, rope, generator=gen).to(device),
                torch.zeros(n, 16, device=device).to(torch.float8_e4m3fn), torch.ones(n, device=device))
    rows = []
    for pos in batch.positions.tolist():
        chosen = torch.randperm(pos + 1, generator=gen)[:topk]
        padded = torch.cat([chosen, torch.full((topk - len(chosen),), -1)])
        rows.append(padded[torch.randperm(topk, generator=gen)])
    indices = torch.stack(rows).int().to(device)
    q_nope = torch.randn(n, heads, rank, generator=gen).to(device, torch.bfloat16)
    q_rope = torch.randn(n, heads, rope, generator=gen).to(device, torch.bfloat16)
    return layer, batch, indices, q_nope, q_rope


def reference(layer, batch, indices, q_nope, q_rope, scale):
    """The shared float64 reference over the layer's dequantized cache rows."""
    rows = layer.latent_rows(torch.arange(layer.latent_nope.shape[0] * 64, device=q_nope.device))
    return sparse_mla_reference(q_nope, q_rope, rows, batch.block_table, batch.token_seq, indices, scale)


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


# Kernel vs twin, ||kernel - twin|| / ||twin||. CPU (interpreter): the same fp32 math with the same
# bf16 roundings (dequantized latent, output), different summation order. GPU: the compiled kernel
# also rounds the softmax probabilities to bf16 for p @ v (the twin keeps them fp32).
TWIN_REL_TOL = {"cpu": 1e-6, "cuda": 5e-3}
# q.k in fp8 (qk_fp8) on the CPU: the kernel sums the rope dot and four scaled group dots in fp32 in another
# order than the twin's matmuls, which flips the bf16 rounding of about one output element in 10^4 (one
# element of the 18,816 below: 2.3e-5 in norm); so there the check is per element: at most one bf16 ulp
# apart, and in at most 1e-3 of the elements.
TWIN_REL_TOL_QK_FP8 = {"cuda": 5e-3}


def within_one_bf16_ulp(got, want):
    """Elements at most one bf16 ulp (of ``want``) apart, and fewer than 1e-3 of them apart at all."""
    g, w = got.float().cpu(), want.float().cpu()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0 ** -126))) - 7)
    diff = (g - w).abs()
    return bool((diff <= ulp).all()) and float((diff > 0).float().mean()) < 1e-3


def dequantized_q(q_nope, layer):
    """q_nope as the qk_fp8 kernel multiplies it: e4m3 per (row, head, scale group) times its scale."""
    groups = layer.latent_scale.shape[-1]
    q8, scale = quantize_fp8_groups(q_nope, q_nope.shape[-1] // groups)
    return (q8.float().unflatten(-1, (groups, -1)) * scale[..., None]).flatten(-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("latent_format,tiles", [
    ("bf16", {}),                                      # fused form: one q.k over the whole latent
    ("fp8", {}),
    ("fp8", {"v_split": 2}),                           # sliced output, q held once
    ("fp8", {"qk_chunk": 16, "splits": 3}),            # q.k summed over slices; 3 position slices
    ("bf16", {"splits": 4, "block_h": 16}),            # flash-decoding combine, fused form
    ("fp8", {"prefetch": True}),                       # next tile's slots read ahead
    ("fp8", {"groups4": True, "prefetch": True}),     # the four-scale-group kernel
    ("fp8", {"groups4": True, "splits": 3}),
    ("fp8", {"groups4": True, "qk_fp8": True}),       # q.k e4m3 x e4m3, q quantized in the kernel
    ("fp8", {"groups4": True, "qk_fp8": True, "splits": 3, "prefetch": True}),
    ("fp8", {"groups4": True, "swap_ab": True, "splits": 3}),  # q.k with positions on the MMA's M side
    ("fp8", {"groups4": True, "swap_ab": True, "qk_fp8": True, "prefetch": True}),
])
def test_sparse_mla_matches_twin_and_reference(device, latent_format, tiles):
    # groups4: four scale groups; with q.k in e4m3 each group is 32 wide (a GPU fp8 MMA needs K >= 32)
    rank, groups = (128 if tiles.get("qk_fp8") else 64, 4) if tiles.get("groups4") else (32, 2)
    layer, batch, indices, q_nope, q_rope = setup((9, 40), heads=3, rank=rank, rope=16, topk=24,
                                                  latent_format=latent_format, device=device, scale_groups=groups)
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
            batch.token_seq, indices, 0.15)
    got = sparse_mla(*args, **tiles)
    qk_fp8 = tiles.get("qk_fp8", False)
    twin = sparse_mla_torch(*args, qk_fp8=qk_fp8)
    # float64 reference of the function the kernel computes: with qk_fp8, of the e4m3 q
    want = reference(layer, batch, indices, dequantized_q(q_nope, layer) if qk_fp8 else q_nope, q_rope, 0.15)
    assert torch.isfinite(got).all()
    assert rel(got, want) < 1e-2 and rel(twin, want) < 1e-2
    if qk_fp8 and device == "cpu":
        assert within_one_bf16_ulp(got, twin)
    else:
        assert rel(got, twin) <= (TWIN_REL_TOL_QK_FP8 if qk_fp8 else TWIN_REL_TOL)[device]
    if qk_fp8:  # what quantizing q costs against the bf16-q result (about 2e-2 here, 2.5e-3 without)
        exact_q = reference(layer, batch, indices, q_nope, q_rope, 0.15)
        assert rel(got, exact_q) < 4e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2])
def test_rows_without_positions_are_zero_and_masked_slots_unread(device, splits):
    """Row 3 selects nothing (0 in every position slice); row 5's 6 positions among 32 leave
    empty slices and -1 entries whose cache rows (NaN here) must never be read."""
    layer, batch, indices, q_nope, q_rope = setup((20,), heads=2, rank=32, rope=16, topk=32,
                                                  latent_format="bf16", device=device)
    indices[3] = -1
    poisoned = layer.latent_nope.clone()
    pos = batch.positions.tolist()
    unused = sorted(set(range(20)) - set(indices[5].tolist()))
    layer.latent_nope.view(-1, 32)[batch.slots[unused]] = float("nan")
    got = sparse_mla(q_nope, q_rope, layer.latent_nope, None, layer.latent_rope, batch.block_table,
                     batch.token_seq, indices, 0.2, splits=splits, block_k=16)
    assert torch.equal(got[3].float().cpu(), torch.zeros(2, 32))
    assert torch.isfinite(got[5]).all()
    layer.latent_nope.copy_(poisoned)
    want = reference(layer, batch, indices, q_nope, q_rope, 0.2)
    assert rel(got[5], want[5]) < 1e-2 and pos[5] == 5


@pytest.mark.gpu
@pytest.mark.parametrize("latent_format", ["bf16", "fp8"])
@pytest.mark.parametrize("tiles", [
    {}, {"v_split": 4, "block_h": 64}, {"block_h": 32, "num_warps": 4}, {"splits": 16},
    {"v_split": 1, "qk_chunk": 512, "block_k": 32, "num_stages": 2, "groups4": False},
    {"v_split": 1, "qk_chunk": 512, "block_k": 32, "splits": 8},
    {"v_split": 2, "qk_chunk": 512, "block_k": 32, "num_stages": 2, "splits": 2},
    {"prefetch": True},
    {"groups4": True, "prefetch": True},
    {"groups4": True, "block_k": 64, "num_stages": 2, "prefetch": True, "splits": 8},
    {"groups4": True, "qk_fp8": True},
    {"groups4": True, "qk_fp8": True, "block_k": 64, "num_stages": 2, "prefetch": True, "splits": 8},
    {"groups4": True, "swap_ab": True},
    {"groups4": True, "swap_ab": True, "qk_fp8": True, "block_k": 64, "num_stages": 2, "prefetch": True, "splits": 8},
])
def test_deepseek_v32_shapes_on_gpu(latent_format, tiles):
    """128 heads, latent 512 + 64, top-2048 over 5000 cached tokens, against float64."""
    if tiles.get("groups4") and latent_format != "fp8":
        pytest.skip("the four-scale-group kernel reads an fp8 latent")
    layer, batch, indices, q_nope, q_rope = setup((4000, 1000), heads=128, rank=512, rope=64, topk=2048,
                                                  latent_format=latent_format, device="cuda")
    rows = torch.tensor([0, 63, 64, 2047, 2048, 3999, 4000, 4999]).cuda()
    got = sparse_mla(q_nope[rows], q_rope[rows], layer.latent_nope, layer.latent_scale, layer.latent_rope,
                     batch.block_table, batch.token_seq[rows], indices[rows], 0.07, **tiles)
    sub = type(batch)(batch.slots, batch.positions[rows], batch.token_seq[rows], batch.query_starts,
                      batch.block_table, batch.seq_lens)
    qk_fp8 = tiles.get("qk_fp8", False)
    q_ref = dequantized_q(q_nope[rows], layer) if qk_fp8 else q_nope[rows]
    want = reference(layer, sub, indices[rows], q_ref, q_rope[rows], 0.07)
    twin = sparse_mla_torch(q_nope[rows], q_rope[rows], layer.latent_nope, layer.latent_scale, layer.latent_rope,
                            batch.block_table, batch.token_seq[rows], indices[rows], 0.07, qk_fp8=qk_fp8)
    assert rel(got, want) < 1e-2
    assert rel(got, twin) <= TWIN_REL_TOL["cuda"]


def test_position_splits_fill_one_wave_of_the_sms():
    """H200 (132 SMs), top-2048 in 128-position tiles: batch 1 (2 head blocks) takes 16 slices of one tile,
    batch 16 takes 4 (one wave of 128 programs), batch 64 (128 programs) and prefill take none."""
    assert wave_splits(2, 2048, 128, 132) == 16
    assert wave_splits(32, 2048, 128, 132) == 4
    assert wave_splits(128, 2048, 128, 132) == 1
    assert wave_splits(32768, 2048, 128, 132) == 1
    assert wave_splits(2, 2048, 64, 132) == 32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits,heads,rank", [(3, 6, 64), (32, 5, 128), (5, 2, 32)])
def test_combine_all_slices_at_once_matches_the_slice_loop(device, splits, heads, rank):
    """The combine's two forms (every slice loaded at once, and one slice after the other with an online rescale)
    against the float64 merge sum_s 2**lse_s o_s / sum_s 2**lse_s, with empty slices (lse -inf, partial 0) and a
    row whose slices are all empty (output 0); bf16 partials give the merge of their fp32 values bit for bit."""
    from adapt.kernels import sparse_mla as sm

    gen = torch.Generator().manual_seed(splits)
    rows = 3
    partial = torch.randn(rows, splits, heads, rank, generator=gen)
    lse = torch.randn(rows, splits, heads, generator=gen) * 4
    empty = torch.rand(rows, splits, heads, generator=gen) < 0.3
    empty[2] = True
    lse[empty] = float("-inf")
    partial[empty] = 0.0
    w = torch.exp2(lse.double() - lse.double().amax(1, keepdim=True).nan_to_num(0.0, neginf=0.0))
    den = w.sum(1)
    want = (w[..., None] * partial.double()).sum(1) / torch.where(den > 0, den, 1.0)[..., None]
    got = {}
    default = sm.COMBINE_AT_ONCE
    for at_once in (True, False):
        out = torch.empty(rows, heads, rank, dtype=torch.bfloat16, device=device)
        sm.COMBINE_AT_ONCE = at_once
        try:
            sm._combine(partial.to(device), lse.to(device), out, splits, device == "cpu")
        finally:
            sm.COMBINE_AT_ONCE = default
        got[at_once] = out.float().cpu()
        assert torch.equal(got[at_once][2], torch.zeros(heads, rank))
        # the bf16 output rounding of an fp32 sum: every element within one bf16 ulp of the float64 merge
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -126))) - 7)
        assert bool(((got[at_once].double() - want).abs() <= ulp).all())
        # bf16 partials (``PARTIAL_BF16``): read and widened to fp32, so the merge of the bf16-rounded values
        out16 = torch.empty(rows, heads, rank, dtype=torch.bfloat16, device=device)
        sm.COMBINE_AT_ONCE = at_once
        try:
            sm._combine(partial.to(device).bfloat16(), lse.to(device), out16, splits, device == "cpu")
            sm._combine(partial.to(device).bfloat16().float(), lse.to(device), out, splits, device == "cpu")
        finally:
            sm.COMBINE_AT_ONCE = default
        assert torch.equal(out16, out)
    assert sm.combine_blocks(heads, rank, splits, True)[2] == triton_pow2(splits)


def triton_pow2(n):
    return 1 << (n - 1).bit_length()


def test_combine_blocks_hold_at_most_the_element_budget():
    from adapt.kernels.sparse_mla import COMBINE_ELEMENTS, COMBINE_MAX_SLICES, combine_blocks

    assert combine_blocks(128, 512, 32, True) == (4, 64, 32)  # batch-1 decode: 32 slices of 64 positions
    assert combine_blocks(128, 512, 16, True) == (4, 128, 16)
    assert combine_blocks(128, 512, 32, False) == (4, 128, 0)
    assert combine_blocks(128, 512, COMBINE_MAX_SLICES + 1, True)[2] == 0
    for splits in (2, 3, 9, 17, 33, 64):
        h, c, s = combine_blocks(128, 512, splits, True)
        assert s >= splits and h * c * s <= COMBINE_ELEMENTS and 512 % c == 0

