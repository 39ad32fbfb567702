"""The planar GEMM's stream-K form (``PlanarConfig.stream_k``): the tiles x K steps of a call cut into one equal run
a persistent program, tiles cut between programs summed by fp32 atomic adds. Against the twin and the plain
tiles, under the interpreter (CPU: 2 SMs, so 2-8 programs over a handful of tiles, most of them cut) and at the
real shapes (gpu)."""

import dataclasses
import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import moe_configs as mc
from adapt.kernels import moe_gemm as mg
from adapt.kernels import routing as rt
from tests.kernels.test_moe import (
    DEV,
    GPU_SHAPES,
    TWIN_TOL,
    _combined_cases,
    _gen,
    _planar_case,
    rel,
)

BASE = mc.PlanarConfig(block_m=16, block_n=32, split_k=1, group_m=2, num_warps=4, num_stages=1, one_dot=True)


def _cuts_a_tile(perm, n_rows: int, k: int, cfg) -> bool:
    """Whether some program's run of ``cfg`` (stream-K, the interpreter's 2 SMs) starts inside a tile: the case
    then checks partial sums of one tile from two programs."""
    counts = (perm.expert_offsets[1:] - perm.expert_offsets[:-1]).tolist()
    tiles = sum(-(-c // cfg.block_m) for c in counts) * -(-n_rows // cfg.block_n)
    steps = -(-k // 128)
    p = 2 * cfg.programs_per_sm
    return any(q * tiles * steps // p % steps for q in range(1, p))


@pytest.mark.parametrize("pps", [5])
def test_stream_k_expert_gemms_match_plain_tiles(pps):
    # GEMM1 (bias, gpt-oss clamp, interleaved gate/up: its partial sums through the epilogue kernel) and GEMM2
    # (bias) with every program's run crossing tile boundaries: the plain tiles' outputs within the twin tolerance
    from adapt.kernels import moe_planar as mp

    w, x, ids = _planar_case(3, 512, 352, 5, 2, seed=81, bias=True, interleaved=True)  # 4 and 3 K steps a tile
    planar = mp.PlanarExperts.from_weights(w)
    perm = rt.permute_by_expert(ids, 3)
    stream = dataclasses.replace(BASE, programs_per_sm=pps, stream_k=True)
    assert _cuts_a_tile(perm, 2 * 352, 512, stream) and _cuts_a_tile(perm, 512, 352, stream)
    plain = mg.expert_mlp(x, perm, w, top_k=2, activation="swiglu_clamped", planar=planar, config=(BASE, BASE))
    got = mg.expert_mlp(x, perm, w, top_k=2, activation="swiglu_clamped", planar=planar, config=(stream, stream))
    assert got.shape == plain.shape
    assert rel(got, plain) < TWIN_TOL
    y_t = mg.expert_mlp_torch(x, perm, w, top_k=2, activation="swiglu_clamped")
    assert rel(got, y_t) < TWIN_TOL


def test_stream_k_combine_matches_twin():
    # GEMM2 with the combine in its epilogue, stream-K (bias added once, by the part holding step 0), after a plain
    # or a stream-K GEMM1: against the twin and against the unfused kernels + routing.combine
    from adapt.kernels import moe_planar as mp

    e, k, t = 4, 2, 6
    # GEMM2: 4 m-tiles x 4 n-tiles x 2 K steps over 6 programs (3 an SM on the interpreter's 2): runs cut tiles
    w, x, ids = _planar_case(e, 128, 256, t, k, seed=82, bias=True, interleaved=True)
    perm, planar = rt.permute_by_expert(ids, e), mp.PlanarExperts.from_weights(w)
    topw = torch.rand(t, k, generator=_gen(83), device=DEV)
    s1 = dataclasses.replace(BASE, programs_per_sm=2, stream_k=True)
    s2 = dataclasses.replace(BASE, programs_per_sm=4, stream_k=True)
    assert _cuts_a_tile(perm, 128, 256, s2)
    for cfg, got, twin, unfused in _combined_cases(planar, x, perm, topw, k, "swiglu_clamped", [(BASE, s2), (s1, s2)]):
        assert rel(got, twin) < TWIN_TOL, cfg
        assert 0 < rel(got, unfused) < 4e-3, cfg


def test_stream_k_idle_programs_add_nothing():
    # more programs than K steps in all: programs with an empty run add no partial sum (nor a bias) anywhere
    from adapt.kernels import moe_planar as mp

    w, x, ids = _planar_case(2, 256, 64, 1, 1, seed=86, bias=True, interleaved=False)
    planar = mp.PlanarExperts.from_weights(w)
    perm = rt.permute_by_expert(ids, 2)
    stream = dataclasses.replace(BASE, programs_per_sm=16, stream_k=True)  # 32 programs, a handful of steps
    plain = mg.expert_mlp(x, perm, w, top_k=1, planar=planar, config=(BASE, BASE))
    got = mg.expert_mlp(x, perm, w, top_k=1, planar=planar, config=(stream, stream))
    assert rel(got, plain) < TWIN_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_stream_k_real_shapes_gpu(name):
    # the real H and I, 32 experts, T = 1 / 16 / 64, the table's tiles made stream-K (4 programs an SM): the fused
    # path against its twin, the unfused GEMMs against the plain tiles
    from adapt.kernels import moe_planar as mp

    s, e = GPU_SHAPES[name], 32
    for t in (1, 16, 64):
        w, x, ids = _planar_case(e, s["h"], s["i"], t, s["k"], seed=84, bias=s["bias"], interleaved=s["interleaved"])
        planar = mp.PlanarExperts.from_weights(w)
        perm = rt.permute_by_expert(ids, e)
        topw = torch.rand(t, s["k"], generator=_gen(85), device=DEV)
        c1, c2 = mc.pick_planar_configs(t * s["k"], e, torch.cuda.get_device_name(), s["h"], s["i"])
        st = tuple(dataclasses.replace(c, programs_per_sm=4, stream_k=True) for c in (c1, c2))
        for _cfg, got, twin, unfused in _combined_cases(planar, x, perm, topw, s["k"], s["act"], [st]):
            assert rel(got, twin) < TWIN_TOL, (name, t)
            assert rel(got, unfused) < 4e-3, (name, t)
        plain = mg.expert_mlp(x, perm, w, top_k=s["k"], activation=s["act"], planar=planar, config=(c1, c2))
        got = mg.expert_mlp(x, perm, w, top_k=s["k"], activation=s["act"], planar=planar, config=st)
        assert rel(got, plain) < TWIN_TOL, (name, t)
