"""The workspace's word conversion under every program shape the H200 sweep times (``CONVERT_SWEEP``)."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from adapt.kernels import mxfp4 as mx
from adapt.kernels.workspace import CONVERT_CONFIG, convert_experts
from adapt.stages.bench_moe import CONVERT_SWEEP
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
