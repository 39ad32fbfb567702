import json
import xml.etree.ElementTree as ET

import pytest

from adapt.errors import InputError
from adapt.report import RunDir, StageReport, atomic_write, load_gates


def make_report(*severities):
    report = StageReport(stage="memory", number=2, title="memory plan")
    for i, severity in enumerate(severities):
        report.add(severity, f"code{i}", f"message {i} | with pipe", hint="do this")
    return report


@pytest.mark.parametrize("severities, verdict, code", [
    ((), "pass", 0), (("info",), "pass", 0), (("warn", "info"), "warn", 0), (("warn", "error"), "fail", 1),
])
def test_verdict_follows_findings(severities, verdict, code):
    report = make_report(*severities)
    assert report.decide() == verdict
    assert report.exit_code == code


def test_unknown_severity_is_rejected():
    with pytest.raises(ValueError):
        make_report("fatal")


def test_writers_produce_parseable_files_and_manifest(tmp_path):
    run = RunDir(tmp_path, "r1")
    report = make_report("error")
    report.metrics = {"weights": {"bytes": 123456}, "fits": False}
    report.tables = {"terms": [{"term": "weights", "GiB": 1.5}]}
    written = run.write(report)
    data = json.loads(written["memory.json"].read_text())
    assert data["verdict"] == "fail" and data["findings"][0]["code"] == "code0"
    md = written["memory.md"].read_text()
    assert "FAIL" in md and "weights.bytes" in md and "message 0 \\| with pipe" in md
    suite = ET.fromstring(written["memory.junit.xml"].read_text())
    assert suite.get("failures") == "1"
    assert run.verdict_of("memory") == "fail"
    assert run.verdict_of("parallel") is None
    assert not [p for p in (tmp_path / "r1").iterdir() if p.name.endswith(".tmp")]


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    atomic_write(path, "old")

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_gates_override_and_typos(tmp_path):
    good = tmp_path / "g.yaml"
    good.write_text("memory:\n  headroom_fraction: 0.1\n")
    assert load_gates(good)["memory"]["headroom_fraction"] == 0.1
    assert load_gates()["memory"]["headroom_fraction"] == 0.2
    for text, field in [("memroy: {headroom_fraction: 0.1}\n", "memroy"),
                        ("memory: {headroom: 0.1}\n", "memory.headroom"),
                        ("memory: {headroom_fraction: lots}\n", "memory.headroom_fraction")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(InputError) as err:
            load_gates(bad)
        assert field in str(err.value) and "bad.yaml" in str(err.value)


def test_run_id_is_checked():
    with pytest.raises(InputError):
        RunDir("reports", "../escape")


def test_report_json_matches_schema_required_fields(tmp_path):
    from pathlib import Path

    schema = json.loads((Path(__file__).parent.parent / "reports" / "schema.json").read_text())
    data = make_report("warn").to_dict()
    assert set(schema["required"]) <= set(data)
    assert data["schema"] == schema["properties"]["schema"]["const"]
    assert data["verdict"] in schema["properties"]["verdict"]["enum"]
