"""The workspace's conversions (from the MXFP4 words and from the planar copy) under every program shape the H200
sweep times (``CONVERT_SWEEP``, ``PLANAR_CONVERT_SWEEP``)."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import mxfp4 as mx
from adapt.kernels.workspace import CONVERT_CONFIG, convert_experts
from adapt.stages.bench_moe import CONVERT_SWEEP, PLANAR_CONVERT_SWEEP
from tests.kernels.test_moe import DEV, _gen


def test_convert_configs_match_the_offline_fold():
    """Rows not a multiple of the program's rows, K = 352 (11 blocks: a partial step), one idle expert:
    every (rows, blocks, warps) program writes the offline fold's bytes and row exponents, and no others."""
    g = _gen(31)
    p, s = mx.quantize_mxfp4(torch.randn(2, 20, 352, generator=g, device=DEV))
    ref = mx.mxfp4_to_fp8_torch(p[1], s[1], group_k=None)
    offsets = torch.tensor([0, 0, 4], dtype=torch.int32, device=DEV)
    lost = torch.zeros(1, dtype=torch.int64, device=DEV)
    for cfg in (CONVERT_CONFIG, *CONVERT_SWEEP.values()):
        out = torch.zeros(3, 20, 352, dtype=torch.float8_e4m3fn, device=DEV)
        exps = torch.zeros(3, 20, dtype=torch.int32, device=DEV)
        convert_experts(p, s, out, exps, lost, offsets, (0, 2), 1, count_loss=False, config=cfg)
        assert torch.equal(out[2].view(torch.uint8), ref.values.view(torch.uint8)), cfg
        assert torch.equal(exps[2], ref.exponents[..., 0]), cfg
        assert not out[:2].view(torch.uint8).any() and not exps[:2].any(), cfg


def _planar_case(kind, n, k, seed):
    """MXFP4 of e experts [3, n, k]: 'fast' scales (bytes <= 128: the one-multiply planar scales), 'e8m0'
    (bytes above 128: the two-multiply form), 'spread' (a row's blocks 20 binades apart, so the fold shifts
    reach below -5 and round to e4m3 denormals)."""
    g = _gen(seed)
    x = torch.randn(3, n, k, generator=g, device=DEV)
    if kind == "fast":
        x = x * 2.0**-8
    elif kind == "e8m0":
        x = x * 2.0**4
    else:
        shift = torch.randint(-20, 1, (3, n, k // 32, 1), generator=g, device=DEV).float()
        x = x * torch.exp2(shift).repeat_interleave(32, dim=2).reshape(3, n, k)
    return mx.quantize_mxfp4(x)


@pytest.mark.parametrize("kind,gate_up,interleaved", [("fast", True, False), ("e8m0", False, False),
                                                       ("spread", True, True)])
def test_planar_conversion_writes_the_word_conversions_bytes(kind, gate_up, interleaved):
    """The workspace conversion from the planar copy (``planar_to_fp8``) writes the bytes and row exponents the
    conversion from the checkpoint's tensors writes (GEMM1's rows in the planar order: gate/up interleaved), for
    one- and two-multiply scales, shifts below -5 and K = 352 (a partial 128-step), rows not a multiple of the
    program's, one idle expert, and nothing outside the chunk's slots, under every program shape."""
    from adapt.kernels.moe_planar import PLANAR_CONVERT_CONFIG, _interleave_gate_up, planar_from_mxfp4, planar_to_fp8

    n, k = (40, 352)
    p, s = _planar_case(kind, n, k, 40)
    planar = planar_from_mxfp4(p, s, gate_up=gate_up, interleaved=interleaved)
    assert planar.two_muls == (kind == "e8m0")
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=DEV)  # expert 1 idle
    ref = torch.zeros(4, n, k, dtype=torch.float8_e4m3fn, device=DEV)
    ref_exp = torch.zeros(4, n, dtype=torch.int32, device=DEV)
    lost = torch.zeros(1, dtype=torch.int64, device=DEV)
    convert_experts(p, s, ref, ref_exp, lost, offsets, (0, 3), 1, count_loss=False)
    if gate_up:
        ref, ref_exp = _interleave_gate_up(ref, interleaved), _interleave_gate_up(ref_exp, interleaved)
    if kind == "spread":  # the case exercises the denormal rounding
        d = s.int() - 127 - (s.int().amax(-1, keepdim=True) - 127 - 6)
        assert (d < mx.FOLD_WORD_MIN_SHIFT).any()
    for cfg in (PLANAR_CONVERT_CONFIG, (64, 3, 4), *PLANAR_CONVERT_SWEEP.values()):
        out = torch.zeros(4, n, k, dtype=torch.float8_e4m3fn, device=DEV)
        exps = torch.zeros(4, n, dtype=torch.int32, device=DEV)
        planar_to_fp8(planar, out, exps, offsets, (0, 3), 1, cfg)
        assert torch.equal(out[1:].view(torch.uint8)[[0, 2]], ref[1:].view(torch.uint8)[[0, 2]]), cfg
        assert torch.equal(exps[1:][[0, 2]], ref_exp[1:][[0, 2]]), cfg
        assert not out[[0, 2]].view(torch.uint8).any() and not exps[[0, 2]].any(), cfg  # idle and outside


def test_planar_conversion_refuses_a_mismatched_workspace():
    from adapt.errors import InputError
    from adapt.kernels.moe_planar import planar_from_mxfp4, planar_to_fp8

    p, s = _planar_case("fast", 64, 128, 41)
    planar = planar_from_mxfp4(p, s)
    offsets = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEV)
    exps = torch.zeros(2, 64, dtype=torch.int32, device=DEV)
    with pytest.raises(InputError, match="workspace slots"):
        planar_to_fp8(planar, torch.zeros(2, 64, 256, dtype=torch.float8_e4m3fn, device=DEV), exps, offsets, (0, 2), 0)
    with pytest.raises(InputError, match="divide"):
        planar_to_fp8(planar, torch.zeros(2, 64, 128, dtype=torch.float8_e4m3fn, device=DEV), exps, offsets, (0, 2),
                      0, (48, 1, 4))
