"""The sm_90 build of the short decode select (``topk._kth_key`` with FAST 1 / 2), compiled on the CPU by
``benchmarks/topk_select_sass.py`` in a process without the interpreter: no spills, at most 128 registers with
16 warps (512 threads must fit the SM's 64K registers, or the launch fails), and the bisection a loop of at most
three barriers a step (one block-wide count)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [{"kernel": "register", "FAST": 1, "warps": 16}, {"kernel": "register", "FAST": 2, "warps": 8},
           {"kernel": "flat", "FAST": 2, "warps": 16}]


@pytest.mark.slow
def test_short_select_builds_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "topk_select_sass.py"), json.dumps(CONFIGS)],
                         capture_output=True, text=True, env=env, timeout=600)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(CONFIGS), run.stdout + run.stderr
    for row in rows:
        assert "error" not in row, row
        assert row["spill_bytes"] == 0 and row["regs"] <= (128 if row["warps"] == 16 else 255), row
        steps = [loop for loop in row["loops"] if 0 < loop["bar"] <= 3 and loop["len"] < 600]
        assert steps, row  # the bisection step: a loop, one block-wide count
