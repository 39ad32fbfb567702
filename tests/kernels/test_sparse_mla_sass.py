"""The sm_90 build of the sparse MLA decode tiles (compiled on the CPU with the ptxas and cuobjdump of the
triton wheel, by ``benchmarks/sparse_mla_sass.py`` in a process without the interpreter): every gathered
load of a tile comes before its first MMA. On the H200 an MMA issued between them cost a second memory
round trip per tile (2026-11-30: the default tile at batch 64 x 128K took 297 us with the rope MMA ahead of
the latent loads, against 203-218 us with all loads first)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [
    {},                                 # the GPU default: bf16 q.k, 128 positions, 1 stage
    {"QK_FP8": True, "swap_ab": True},  # q.k in e4m3 with positions on the MMA's M side
]


def sass_rows(configs: list[dict], script: str = "sparse_mla_sass.py") -> list[dict]:
    """``benchmarks/<script>``'s report of each config (default: the sparse MLA builds), built in a process without
    the interpreter (one row per config: a build error is a row with ``error``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), json.dumps(configs)],
                         capture_output=True, text=True, env=env, timeout=600)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(configs), run.stdout + run.stderr
    return rows


@pytest.mark.slow
def test_one_stage_tiles_load_everything_before_the_first_mma():
    for row in sass_rows(CONFIGS):
        assert "error" not in row, row
        assert re.fullmatch(r"L\d+ M\d+", row["order"]), row  # loads (L), then MMAs (M), no load after an MMA
        assert row["regs"] <= 255
