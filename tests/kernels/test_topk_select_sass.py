"""The sm_90 build of the short decode select (``topk._kth_key`` with FAST 1 / 2), compiled on the CPU by
``benchmarks/topk_select_sass.py`` in a process without the interpreter: no spills, at most 128 registers with
16 warps (512 threads must fit the SM's 64K registers, or the launch fails), and the bisection a loop of at most
three barriers a step (one block-wide count)."""

import pytest

from tests.kernels.test_sparse_mla_sass import sass_rows

CONFIGS = [{"kernel": "register", "FAST": 1, "warps": 16}, {"kernel": "register", "FAST": 2, "warps": 8},
           {"kernel": "flat", "FAST": 2, "warps": 16}]


@pytest.mark.slow
def test_short_select_builds_for_sm90_without_spills():
    for row in sass_rows(CONFIGS, "topk_select_sass.py"):
        assert "error" not in row, row
        assert row["spill_bytes"] == 0 and row["regs"] <= (128 if row["warps"] == 16 else 255), row
        steps = [loop for loop in row["loops"] if 0 < loop["bar"] <= 3 and loop["len"] < 600]
        assert steps, row  # the bisection step: a loop, one block-wide count
