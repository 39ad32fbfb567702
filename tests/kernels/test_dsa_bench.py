"""The DSA benchmark's acceptance lines and Markdown, computed again from a recorded H200 result."""

import json
from pathlib import Path

import torch

from adapt.stages.bench_dsa import acceptance_lines, compact_summary, render_markdown

RECORD = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu-2026-11-30-dsa-s2"
          / "call4_5479533_dsa_bench.json")


def test_acceptance_lines_recomputed_from_the_recorded_rows():
    result = json.loads(RECORD.read_text())
    lines = {a["line"]: a for a in acceptance_lines(result)}
    assert [a["line"] for a in acceptance_lines(result)] == [a["line"] for a in result["acceptance"]]
    b1 = next(d for d in result["decode"] if d["batch"] == 1)
    layered = lines["decode batch 1 x 128K: step us per layer in a graph of 8 layers"]
    assert layered["measured"] == b1["step_us_per_layer_in_graph_of_layers"]
    assert layered["met"] == (b1["step_us_per_layer_in_graph_of_layers"] <= 40)
    b64 = next(d for d in result["decode"] if d["batch"] == 64)
    assert lines["decode batch 64 x 128K: step / byte floor"]["met"] == (b64["step_over_floor"] <= 1.5)
    # a row that was not measured counts as unmet, never as met
    b1.pop("step_us_per_layer_in_graph_of_layers")
    missing = {a["line"]: a for a in acceptance_lines(result)}
    assert missing[layered["line"]]["measured"] is None and not missing[layered["line"]]["met"]


def test_markdown_shows_the_sweeps_and_the_per_layer_graph():
    result = json.loads(RECORD.read_text())
    text = render_markdown(result)
    assert "step per layer in one graph of 8 layers" in text
    assert "indexer programs (us): 264:" in text
    assert "sparse MLA position splits (us)" in text
    assert "NOT MET" in text and "decode batch 1 x 128K" in compact_summary(result)


def test_markdown_shows_the_select_sweep_and_the_qk_fp8_movement():
    result = json.loads(RECORD.read_text())
    b64 = next(d for d in result["decode"] if d["batch"] == 64)
    b64["topk_kernel_sweep"] = [{"digit_bits": 4, "slice_size": 1024, "us": 201.5}]
    b64["sparse_mla_rel_err_vs_bf16_q_twin"] = 6.25e-3
    text = render_markdown(result)
    assert "select kernel tiles (us): {'digit_bits': 4, 'slice_size': 1024}: 201.5" in text
    assert "against the bf16-q twin: rel. error 6.3e-03 |" in text


def test_same_sets_ignores_order_and_counts_differing_rows():
    from adapt.stages.bench_dsa import _same_sets

    want = torch.arange(40, dtype=torch.int32).view(10, 4)
    got = want.flip(1).clone()  # same sets, other order
    assert _same_sets(got, want, rows=3) == {"rows_checked": 6, "rows_differing": 0}
    got[9, 0] = 99  # a last row differs
    got[4, 0] = 99  # a middle row differs, outside the checked first and last 3
    assert _same_sets(got, want, rows=3) == {"rows_checked": 6, "rows_differing": 1}
