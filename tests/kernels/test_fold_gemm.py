"""The in-GEMM MXFP4 -> e4m3 fold by table look-up (``mxfp4.fold_words_fp8``, moe_gemm W_MODE 5 / 6).

The fold must give the offline conversion's bytes exactly (every code at every fold shift, denormals
and -0 included), and the GEMMs on it the offline FP8 path's output bit for bit. Tiny shapes under the
interpreter; the gpu-marked test runs the real shapes on the H200.
"""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from adapt.kernels import moe_configs as mc
from adapt.kernels import moe_gemm as mg
from adapt.kernels import mxfp4 as mx
from adapt.kernels import routing as rt
from adapt.stages.bench_moe import FOLD_SWEEP
from tests.kernels.test_moe import DEV, GPU_SHAPES, _gen, make_layer


@triton.jit
def _fold_kernel(p_ptr, s_ptr, g_ptr, o_ptr, K: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr):
    r = tl.program_id(0) * R + tl.arange(0, R)
    ks = tl.arange(0, K // 32)
    j = tl.arange(0, 16)
    p = tl.load(p_ptr + r[:, None, None] * (K // 2) + ks[None, :, None] * 16 + j[None, None, :])
    s = tl.load(s_ptr + r[:, None] * (K // 32) + ks[None, :])
    v = mx.fold_words_fp8(p, s, tl.load(g_ptr + r), R, K, SPLIT)
    kk = tl.arange(0, K)
    tl.store(o_ptr + r[:, None] * K + kk[None, :], v)


def _fold(packed, scales, split):
    n, k = packed.shape[0], packed.shape[1] * 2
    ref = mx.mxfp4_to_fp8_torch(packed, scales, group_k=None)
    out = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=DEV)
    src = mx.to_sign_split_words(packed) if split else packed
    _fold_kernel[(n // 16,)](src, scales, ref.exponents[:, 0].contiguous(), out, K=k, R=16, SPLIT=split)
    return out, ref


@pytest.mark.parametrize("split", [False, True])
def test_fold_words_every_code_every_shift(split):
    """All 256 byte values (every code pair) at every fold shift d in [-45, 6], two row exponents:
    the table fold's bytes equal the offline conversion's (mxfp4_to_fp8_torch), -0 and denormals included."""
    k = 512  # block 0 at d = 6 sets g; blocks 1..15 hold bytes 16..255 at shift d
    rows, scales = [], []
    for d in list(range(-12, 7)) + [-20, -30, -40, -45]:
        for top in (140, 60):
            rows.append(torch.arange(256))
            scales.append(torch.tensor([top] + [max(0, top + d - 6)] * 15))
    while len(rows) % 16:
        rows.append(torch.arange(256).flip(0))
        scales.append(torch.full((16,), 127))
    packed = torch.stack(rows).to(torch.uint8).reshape(len(rows), k // 2).to(DEV)
    sc = torch.stack(scales).to(torch.uint8).to(DEV)
    out, ref = _fold(packed, sc, split)
    assert torch.equal(out.view(torch.uint8), ref.values.view(torch.uint8))


def test_sign_split_layout_bits():
    """The sign-split word holds each code's bits where SIGN_SPLIT_MAG / SIGN_SPLIT_SIGN say."""
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (5, 64), generator=g, dtype=torch.uint8)
    w = packed.view(torch.int32).long() & 0xFFFFFFFF
    s = mx.to_sign_split_words(packed).view(torch.int32).long() & 0xFFFFFFFF
    for i in range(8):
        assert torch.equal((s >> mx.SIGN_SPLIT_MAG[i]) & 7, (w >> (4 * i)) & 7)
        assert torch.equal((s >> mx.SIGN_SPLIT_SIGN[i]) & 1, (w >> (4 * i + 3)) & 1)


@pytest.mark.parametrize(("split", "interleaved"), [(False, False), (True, True)])
def test_fold_gemm_equals_offline(split, interleaved):
    """compute='fp8_fold' (stored or sign-split bytes) gives the offline FP8 path's output bit for bit,
    both orientations (token-major with the scale prefetch and both tiles decoded first; swapped without),
    with biases, empty experts and a partial K step (K = 96 in steps of 64)."""
    g = _gen(21)
    w = make_layer(5, 96, 64, bias=True, interleaved=interleaved, seed=21)
    x = torch.randn(9, 96, generator=g, device=DEV).bfloat16()
    ids = torch.randint(0, 4, (9, 2), generator=g, device=DEV).int()  # expert 4 idle
    perm = rt.permute_by_expert(ids, 5)
    off = mg.FP8Weights.from_mxfp4(w)
    sw = (mx.to_sign_split_words(w.w1_packed), mx.to_sign_split_words(w.w2_packed)) if split else None
    act = "swiglu_clamped" if interleaved else "swiglu"
    for swap in (True, False):
        c = mc.GemmConfig(16, 32, 64, 2, 4, 1, 1, swap_ab=swap, prefetch_scales=not swap, early_up=not swap)
        kw = dict(top_k=2, activation=act, config=(c, c))
        ref = mg.expert_mlp(x, perm, w, fp8_weights=off, **kw)
        got = mg.expert_mlp(x, perm, w, compute="fp8_fold", split_words=sw, **kw)
        assert torch.equal(got, ref), swap


def real_shape_case(s: dict, t: int = 1400):
    """(experts, bf16 x [t, H], permutation) of one ``GPU_SHAPES`` entry: real H and I, fixed seeds."""
    w = make_layer(s["e"], s["h"], s["i"], bias=s["bias"], interleaved=s["interleaved"], seed=13)
    g = _gen(14)
    x = torch.randn(t, s["h"], generator=g, device=DEV).bfloat16()
    ids = torch.rand(t, s["e"], generator=g, device=DEV).topk(s["k"], dim=-1).indices.int()
    return w, x, rt.permute_by_expert(ids, s["e"])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_fold_gemm_real_shapes_gpu(name):
    """H200: the fold GEMMs at the large-T configs equal the offline path bit for bit (real H and I)."""
    s = GPU_SHAPES[name]
    w, x, perm = real_shape_case(s)
    off = mg.FP8Weights.from_mxfp4(w)
    kw = dict(top_k=s["k"], activation=s["act"])
    ref = mg.expert_mlp(x, perm, w, fp8_weights=off, **kw)
    sw = (mx.to_sign_split_words(w.w1_packed), mx.to_sign_split_words(w.w2_packed))
    for name in ("fp8_fold_m256_combine", "fp8_fold_m256_split_early_combine", "fp8_fold_w8_2p_split_combine"):
        _, _, c1, c2, split = FOLD_SWEEP[name]
        got = mg.expert_mlp(x, perm, w, compute="fp8_fold", config=(c1, c2), split_words=sw if split else None, **kw)
        assert torch.equal(got, ref), name
