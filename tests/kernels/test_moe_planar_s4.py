"""The planar tiles timed in session 4 (``bench_moe.PLANAR_SWEEP``, names ``s4_*``): each GEMM pair with the
combine in GEMM2's epilogue against its twin, under the interpreter (CPU) and at the real shapes (gpu).

The tiles are the table's with fields replaced (block_n 128 / 256, 8 warps, split-K, the flattened loop), so
these tests check that every tile the bench times computes the twin's arithmetic; the timings are in
benchmarks/moe/2026-12-01-s4-small.
"""

import dataclasses
import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.kernels import moe_configs as mc
from adapt.stages.bench_moe import FUSED_SUFFIX, PLANAR_SWEEP
from tests.kernels.test_moe import (
    DEV,
    GPU_SHAPES,
    TWIN_TOL,
    _combined_cases,
    _gen,
    _planar_case,
    _routed_planar_case,
    rel,
)

S4 = {n: v for n, v in PLANAR_SWEEP.items() if n.startswith("s4_")}


def _tiles(name, base1, base2):
    """The (GEMM1, GEMM2) configs of sweep row ``name`` over the given table configs."""
    _, a, b = S4[name]
    return tuple(dataclasses.replace(base, **fields) for base, fields in ((base1, a), (base2, b)))


def test_s4_rows_are_fused_and_replace_known_fields():
    assert len(S4) >= 6
    fields = {f.name for f in dataclasses.fields(mc.PlanarConfig)}
    for name, ((lo, hi), a, b) in S4.items():
        assert name.endswith(FUSED_SUFFIX) and 1 <= lo <= hi <= 64, name
        assert isinstance(a, dict) and isinstance(b, dict) and set(a) | set(b) <= fields, name


@pytest.mark.slow
def test_s4_tiles_match_twin_interpreter():
    # each row's fields over a small base tile, a layer of 4 experts (H 128, I 64) with bias and the gpt-oss
    # clamp, 6 tokens: split-K, block_n 128 / 256 and the flattened loop all give the twin's sums
    if DEV != "cpu":
        pytest.skip("the interpreter case; the gpu test below runs the real shapes")
    e, k, t = 4, 2, 6
    w, x, perm, planar, topw = _routed_planar_case(e, k, t, seed=71, bias=True, interleaved=True)
    base = mc.PlanarConfig(block_m=16, block_n=32, split_k=1, group_m=2, num_warps=4, num_stages=1, one_dot=True)
    cfgs = [_tiles(n, base, base) for n in S4]
    for cfg, got, twin, unfused in _combined_cases(planar, x, perm, topw, k, "swiglu_clamped", cfgs):
        assert rel(got, twin) < TWIN_TOL, cfg
        assert 0 < rel(got, unfused) < 4e-3, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_s4_tiles_real_shapes_gpu(name):
    # the real H and I, 16 experts; T = 1 rows at T = 1, the T = 16 / 64 rows at T = 64 (table tiles of each T)
    from adapt.kernels import moe_planar as mp
    from adapt.kernels import routing as rt

    s, e = GPU_SHAPES[name], 16
    for t in (1, 64):
        w, x, ids = _planar_case(e, s["h"], s["i"], t, s["k"], seed=72, bias=s["bias"], interleaved=s["interleaved"])
        planar = mp.PlanarExperts.from_weights(w)
        perm = rt.permute_by_expert(ids, e)
        topw = torch.rand(t, s["k"], generator=_gen(73), device=DEV)
        c1, c2 = mc.pick_planar_configs(t * s["k"], e, torch.cuda.get_device_name(), s["h"], s["i"])
        rows = [n for n, ((lo, hi), _, _) in S4.items() if lo <= t <= hi]
        assert rows
        cfgs = [_tiles(n, c1, c2) for n in rows]
        for cfg, got, twin, unfused in _combined_cases(planar, x, perm, topw, s["k"], s["act"], cfgs):
            assert rel(got, twin) < TWIN_TOL, cfg
            assert rel(got, unfused) < 4e-3, cfg


@pytest.mark.slow
def test_gluon_probe_builds_for_sm90_in_the_operand_layout():
    # benchmarks/moe/2026-12-01-s4-small/gluon_probe.py compiled for sm_90 on the CPU (a process without the
    # interpreter): the words' layout equals the wgmma A operand (convert_layout(assert_trivial=True) would
    # fail the build otherwise), 16 m64n8k16 wgmma a two-step loop, and the timed variant (LATE, 128-register
    # cap: 4 programs an SM) keeps its spill outside the loop
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run([sys.executable, str(root / "benchmarks/moe/2026-12-01-s4-small/gluon_probe.py"), "compile"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=root)
    rows = {(r["config"]["cap"], r["config"]["LATE"]): r
            for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {(0, True), (128, True)}, run.stdout + run.stderr
    for r in rows.values():
        assert r["loop_ops"].get("HGMMA") == 16 and r["loop_ops"].get("WARPGROUP", 0) >= 16, r
        assert "LDL" not in r["loop_ops"] and "STL" not in r["loop_ops"], r
    assert rows[(128, True)]["regs"] <= 128 and rows[(0, True)]["regs"] > 128
