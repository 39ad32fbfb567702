"""The Gluon fold GEMM (``adapt.kernels.moe_gluon``): on CPU the shipped configs compile for sm_90 without
spills and keep the MMAs in flight (a ``wgmma.wait_group`` with pending groups in the K loop); on the H200
(gpu-marked) its output equals the offline FP8 path's bit for bit at small and at real shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapt.kernels import moe_configs as mc
from adapt.kernels import moe_gemm as mg
from adapt.kernels import moe_gluon as gk
from adapt.kernels import mxfp4 as mx
from adapt.kernels import routing as rt
from adapt.stages.bench_moe import FOLD_SWEEP
from tests.kernels.test_fold_gemm import real_shape_case
from tests.kernels.test_moe import DEV, GPU_SHAPES, _gen, make_layer

GLUON_ROWS = [n for n, row in FOLD_SWEEP.items() if row[2].gluon and not row[2].probe]
PROBE_ROWS = [n for n, row in FOLD_SWEEP.items() if row[2].gluon and row[2].probe]
"""Timing probes (wrong outputs by design): compiled here, never compared."""
SHIPPED = ("fp8_gluon_split_combine", "fp8_gluon_combine")
"""The rows whose tiles the runtime's dispatch uses: no spills allowed; the other rows are timing probes."""
ROOT = Path(__file__).resolve().parents[2]


def _shipped() -> list[tuple[str, dict, int]]:
    """(name, constexprs, warps) of every Gluon GEMM the bench rows launch: GEMM1 with both SwiGLU forms,
    GEMM2 without an activation (DeepSeek-V3: TOPK 8, no bias; gpt-oss: TOPK 4, biases)."""
    out = []
    for name in GLUON_ROWS + PROBE_ROWS:
        _, _, c1, c2, split = FOLD_SWEEP[name]
        for act, c in ((1, c1), (2, c1), (0, c2)):
            const = dict(TOPK=8 if act == 1 else 4, GATHER=act != 0, ACTIVATION=act, HAS_BIAS=act != 1, SPLIT=split,
                         BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                         STAGES=c.num_stages)
            cap = 0
            if c.probe:
                const["PROBE"] = c.probe
            if c.gluon_ws:
                const.update(LOAD_WARPS=gk.WS_LOAD_WARPS, LOAD_REGS=gk.WS_LOAD_REGS)
                cap = gk.WS_MAXNREG
            out.append((f"{name}-act{act}", const, c.num_warps, cap))
    return list({str(sorted(c.items())) + str(w): (n, c, w, m) for n, c, w, m in out}.values())


@pytest.mark.slow
def test_gluon_fold_compiles_sm90_in_flight():
    """Each Gluon row's kernels and the timing probes compile for sm_90 (a child process: Gluon needs the compiler,
    the CPU tests run the interpreter): no register spills in SHIPPED, shared memory within the H200's 227 KiB,
    and the K loop waits with MMAs still pending (``wgmma.wait_group`` 1 or 2), not for all of them."""
    assert GLUON_ROWS, "no Gluon rows in FOLD_SWEEP"
    shipped = _shipped()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    arg = json.dumps([[c, w, m] for _, c, w, m in shipped])
    run = subprocess.run([sys.executable, "-m", "adapt.kernels.moe_gluon", arg], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(reports) == len(shipped)
    for (name, _, _, _), rep in zip(shipped, reports, strict=True):
        if name.split("-")[0] in SHIPPED:
            assert rep["spill_bytes"] == 0 and rep["registers"] <= 255, (name, rep)
        assert rep["shared_bytes"] <= 227 * 1024, (name, rep)
        assert set(rep["wgmma_waits"]) & {1, 2}, (name, rep)


def _check(x, perm, w, k, act, names, split_words):
    off = mg.FP8Weights.from_mxfp4(w)
    kw = dict(top_k=k, activation=act)
    ref = mg.expert_mlp(x, perm, w, fp8_weights=off, **kw)
    for name in names:
        _, _, c1, c2, split = FOLD_SWEEP[name]
        got = mg.expert_mlp(x, perm, w, compute="fp8_fold", config=(c1, c2),
                            split_words=split_words if split else None, **kw)
        assert torch.equal(got, ref), name


@pytest.mark.gpu
@pytest.mark.parametrize("name", GLUON_ROWS)
def test_gluon_fold_small_gpu(name):
    """H200: small experts (K = 96 and 64: partial K steps, n-tiles mostly masked), biases, an idle expert;
    rows on sign-split bytes with the interleaved clamped SwiGLU, rows on stored bytes with the plain one."""
    assert gk.usable(torch.device(DEV))
    split = FOLD_SWEEP[name][4]
    g = _gen(21)
    w = make_layer(5, 96, 64, bias=True, interleaved=split, seed=21)
    x = torch.randn(300, 96, generator=g, device=DEV).bfloat16()
    ids = torch.randint(0, 4, (300, 2), generator=g, device=DEV).int()  # expert 4 idle
    perm = rt.permute_by_expert(ids, 5)
    sw = (mx.to_sign_split_words(w.w1_packed), mx.to_sign_split_words(w.w2_packed))
    _check(x, perm, w, 2, "swiglu_clamped" if split else "swiglu", [name], sw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gluon_fold_real_shapes_gpu(name):
    """H200: 32 experts of the real H and I, 1,400 tokens: every Gluon row equals the offline path."""
    s = GPU_SHAPES[name]
    w, x, perm = real_shape_case(s)
    sw = (mx.to_sign_split_words(w.w1_packed), mx.to_sign_split_words(w.w2_packed))
    _check(x, perm, w, s["k"], s["act"], GLUON_ROWS, sw)


def test_gluon_config_falls_back_off_sm90():
    """Off a 9.x CUDA device a gluon config runs the ``tl`` fold (here: the interpreter), bit-equal to offline."""
    if gk.usable(torch.device(DEV)):
        pytest.skip("sm_90: the Gluon kernel runs (gpu tests)")
    g = _gen(5)
    w = make_layer(3, 64, 64, seed=5)
    x = torch.randn(7, 64, generator=g, device=DEV).bfloat16()
    ids = torch.randint(0, 3, (7, 2), generator=g, device=DEV).int()
    perm = rt.permute_by_expert(ids, 3)
    c = mc.GemmConfig(16, 32, 64, 2, 4, 1, 1, swap_ab=False, gluon=True)
    ref = mg.expert_mlp(x, perm, w, fp8_weights=mg.FP8Weights.from_mxfp4(w), top_k=2, config=(c, c))
    got = mg.expert_mlp(x, perm, w, compute="fp8_fold", top_k=2, config=(c, c))
    assert torch.equal(got, ref)
