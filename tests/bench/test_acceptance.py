"""Benchmark acceptance lines come from measured rows; a missing row is unmet; timed rows need a twin error."""

from adapt.bench.acceptance import Criterion, benchmark_report, find_row


def tokens_per_s(rows, batch):
    row = find_row(rows, batch=batch, phase="decode")
    return row["tokens_per_s"] if row else None


CRITERIA = [Criterion("decode at batch 1 >= 10 tokens/s", lambda rows: tokens_per_s(rows, 1), ">=", 10),
            Criterion("decode at batch 64 >= 100 tokens/s", lambda rows: tokens_per_s(rows, 64), ">=", 100)]
PROV = {"date": "2026-11-30", "commit": "abc", "device": "test"}


def test_missing_row_is_unmet_and_measured_rows_decide():
    rows = [{"batch": 1, "phase": "decode", "tokens_per_s": 12.0, "time_us": 5.0, "twin_rel_error": 1e-3}]
    report = benchmark_report("runtime", "t", rows, CRITERIA, provenance=PROV)
    assert [line["met"] for line in report.tables["acceptance"]] == [True, False]
    assert report.decide() == "fail"
    assert any("missing" in f.message for f in report.findings if f.severity == "error")
    rows.append({"batch": 64, "phase": "decode", "tokens_per_s": 150.0, "time_us": 9.0, "twin_rel_error": 2e-3})
    assert benchmark_report("runtime", "t", rows, CRITERIA, provenance=PROV).decide() == "pass"


def test_errored_rows_do_not_count_and_timed_rows_need_twin_error():
    rows = [{"batch": 1, "phase": "decode", "tokens_per_s": 12.0, "time_us": 5.0},
            {"batch": 64, "phase": "decode", "tokens_per_s": 500.0, "error": "OOM"}]
    report = benchmark_report("runtime", "t", rows, CRITERIA, provenance=PROV)
    codes = {f.code for f in report.findings if f.severity == "error"}
    assert codes == {"bench.untwinned", "bench.acceptance"}
    assert report.tables["acceptance"][1]["value"] is None
    rows[0].update(twin_rel_error=0.5, twin_tolerance=0.01)
    codes = {f.code for f in benchmark_report("runtime", "t", rows, CRITERIA, provenance=PROV).findings
             if f.severity == "error"}
    assert "bench.twin" in codes
