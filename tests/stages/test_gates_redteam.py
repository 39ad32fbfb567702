"""Red team of the run directory and the hand-off on the tiny models, CPU only (session 3): each test is a way
a green gate could stand on stale, mismatched or half-written evidence. The holes found fail here before their
fix; the checks that held are kept so they stay held. (A kill between removing the old stage JSON and writing
the new one: tests/stages/test_gates_audit.py::test_a_report_killed_mid_write_leaves_no_old_pass_behind.)"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from adapt.errors import InputError
from adapt.handoff.bundle import check_gates
from adapt.report import StageReport, load_gates
from adapt.stages.pipeline import stage_fingerprint, stamp
from tests.cli_run import adapt as run_adapt
from tests.cli_run import snapshot
from tests.test_provenance import BASE, _model_dir, _stamped_run


@pytest.mark.parametrize("verdict, severity, code", [("pass", "error", "kl"), ("warn", "error", "kl"),
                                                     ("pass", "warn", "unmeasured"),
                                                     ("warn", "warn", "unmeasured")])
def test_a_report_whose_verdict_contradicts_its_findings_is_refused(tmp_path, verdict, severity, code):
    """A stage JSON edited, copied from another tool, or written by a stage that overrode its verdict: PASS
    beside an error finding is not evidence of a pass. validate and the hand-off read it as bad input."""
    run = _stamped_run(tmp_path, BASE)
    path = run.path / "kernels.json"
    data = json.loads(path.read_text())
    data["verdict"] = verdict
    data["findings"] = [{"severity": severity, "code": code, "message": "m", "hint": ""}]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"kernels.json.*verdict"):
        run.stage_report("kernels")
    with pytest.raises(InputError, match=r"verdict"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)
    run.write(StageReport("preflight", 0, "preflight"))  # any write rebuilds the manifest from the stage files
    listed = json.loads(run.manifest_path.read_text())["stages"]["kernels"]["verdict"]
    assert listed == ("fail" if severity == "error" else "unmeasured")


def test_validate_json_states_the_exit_code_and_the_worst_verdict(tmp_path, capsys):
    """A CI job that reads `--json` must see what the exit code says: the worst verdict and the code."""
    result = run_adapt(capsys, "validate", "qwen3-30b-a3b", "--stage", "2", "--target", "h100-sxm", "--devices", "1",
                       "--context", "32768", "--batch", "8", "--output", tmp_path, "--run", "j", "--json")
    data = json.loads(result.stdout)
    assert result.code == 1 and data["exit_code"] == 1 and data["verdict"] == "fail"
    result = run_adapt(capsys, "validate", "qwen3-30b-a3b", "--stage", "1", "--target", "h200",
                       "--output", tmp_path, "--run", "k", "--json")
    data = json.loads(result.stdout)
    assert result.code == data["exit_code"] == 0 and data["verdict"] in ("pass", "warn")


# ---------------------------------------------------------------- checks that held


def test_a_stage_report_copied_from_another_model_run_is_refused_and_rerun(tmp_path, capsys):
    """memory.json of another model's run copied into this run: validate runs stage 2 again, the hand-off
    refuses it before that."""
    other = _stamped_run(tmp_path, replace(BASE, model="mixtral-8x7b"), run_id="other")
    run = _stamped_run(tmp_path, BASE, run_id="this")
    shutil.copy(other.path / "memory.json", run.path / "memory.json")
    with pytest.raises(InputError, match=r"memory: model: recorded"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)
    before = run.stage_report("memory")["fingerprint"]["model"]
    result = run_adapt(capsys, "validate", BASE.model, "--stage", "2", "--target", "h200", "--devices", "8",
                       "--output", tmp_path, "--run", "this", "--json")
    assert [r["stage"] for r in json.loads(result.stdout)["reports"]] == ["memory"]
    assert run.stage_report("memory")["fingerprint"]["model"] != before


def test_a_stage_report_copied_under_another_stage_name_is_refused(tmp_path):
    run = _stamped_run(tmp_path, BASE)
    shutil.copy(run.path / "inventory.json", run.path / "kernels.json")
    with pytest.raises(InputError, match=r"not an adapt stage report of stage 'kernels'"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_the_handoff_refuses_stage_reports_older_than_the_checkpoint(tmp_path):
    """Stages 1-4 made before the checkpoint's shards changed (header) and stage 5 before its tensors changed
    (same header): each is refused by name."""
    model = _model_dir(tmp_path)
    options = replace(BASE, model=model)
    run = _stamped_run(tmp_path, options)
    report = StageReport("precision", 5, "precision")
    stamp(report, stage_fingerprint(5, options, load_gates()))
    run.write(report)
    check_gates(run, model=model, target="h200", devices=8, nodes=1, force=False)
    shard = Path(model) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x07\x07")   # tensor bytes only
    with pytest.raises(InputError, match=r"precision: checkpoint_data"):
        check_gates(run, model=model, target="h200", devices=8, nodes=1, force=True)
    shard.write_bytes(shard.read_bytes().replace(b'"note": "x"', b'"note": "z"'))   # the header
    with pytest.raises(InputError, match=r"inventory: checkpoint: recorded"):
        check_gates(run, model=model, target="h200", devices=8, nodes=1, force=True)


def test_a_refused_handoff_writes_nothing(tmp_path, capsys):
    run = _stamped_run(tmp_path, BASE, run_id="r")
    report = StageReport("bench", 6, "bench")
    report.not_measured("no request was served", "serve it")
    stamp(report, stage_fingerprint(6, replace(BASE, run_path=str(run.path)), load_gates()))
    run.write(report)
    before = snapshot(run.path)
    result = run_adapt(capsys, "handoff", BASE.model, "--target", "h200", "--devices", "8", "--run", "r",
                       "--output", tmp_path, "--json")
    assert result.code == 2 and "bench: unmeasured" in result.lines[0] and result.stdout == ""
    assert snapshot(run.path) == before


def test_a_precision_report_with_no_fingerprint_is_refused(tmp_path):
    """Only `bench serve --url` writes a later-stage report without the pipeline's fingerprint; a precision.json
    without one (copied from elsewhere, or hand-written) is no evidence about this model."""
    run = _stamped_run(tmp_path, BASE)
    run.write(StageReport("precision", 5, "precision"))
    with pytest.raises(InputError, match=r"precision: its report has no provenance fingerprint"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_validate_says_why_a_stale_stage_runs_again(tmp_path, capsys, monkeypatch):
    """A stage whose earlier report exists but is stale runs again with one line naming the stage and the
    fingerprint field that changed, and `--json` carries the same reason (a silent re-run hid why)."""
    args = ("validate", BASE.model, "--stage", "2", "--target", "h200", "--devices", "8", "--output", tmp_path,
            "--run", "r")
    assert run_adapt(capsys, *args, "--json").code == 0
    gates = tmp_path / "gates.yaml"
    gates.write_text("inventory:\n  max_missing: 2\n")
    result = run_adapt(capsys, *args, "--gates", gates)
    (line,) = [line for line in result.stdout.splitlines() if "runs again" in line]
    assert line.startswith("inventory: runs again") and "gates: recorded" in line
    from adapt.stages import pipeline

    monkeypatch.setattr(pipeline, "code_digest", lambda: "0" * 16)
    data = json.loads(run_adapt(capsys, *args, "--gates", gates, "--json").stdout)
    assert [r["stage"] for r in data["reran"]] == ["inventory"]
    assert data["reran"][0]["reason"].startswith("written by other adapt code (digest ")
    assert data["reused"] == []
    data = json.loads(run_adapt(capsys, *args, "--gates", gates, "--json").stdout)
    assert data["reran"] == [] and [r["stage"] for r in data["reused"]] == ["inventory"]
