"""The sm_90 build of the DSA indexer's prefill scoring tile (compiled on the CPU by ``benchmarks/dsa_sass_report.py``):
the report tool builds the kernel with every constexpr set (it broke once when decode-only constexprs were added),
and the default prefill tile keeps its wgmma in the key-tile loop without spilling."""

import pytest

from tests.kernels.test_sparse_mla_sass import sass_rows


@pytest.mark.slow
def test_prefill_scoring_tile_builds_for_sm90_without_spills():
    (row,) = sass_rows([{"ROWS": 2, "warps": 4}], script="dsa_sass_report.py")  # the prefill default tile
    assert "error" not in row, row
    assert row["spill_bytes"] == 0 and row["regs"] <= 255, row
    assert any("GMMA" in op for op in row["loop_ops"]), row  # the key-tile loop is the MMA loop
