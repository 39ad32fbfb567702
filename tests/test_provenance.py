"""Provenance: a pass is reused only for the inputs it was made with; the hand-off refuses reports
made for other inputs; the manifest is derived from the stage files, also under 50 concurrent
writers; run ids never collide."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from dataclasses import replace

import pytest

import adapt
from adapt.errors import InputError
from adapt.handoff.bundle import check_gates
from adapt.report import RunDir, StageReport, default_run_id, load_gates
from adapt.stages import pipeline
from adapt.stages.pipeline import PipelineOptions, stage_fingerprint, stamp, validate
from tests.cli_run import REPO, snapshot
from tests.cli_run import adapt as run_adapt

BASE = PipelineOptions(model="qwen3-30b-a3b", target="h200", devices=8, nodes=1, context=8192, batch=1)


@pytest.fixture
def fake_stages(monkeypatch):
    """Replace each stage's runner by one that records its call and passes; reads/gates stay real."""
    calls: list[str] = []

    def runner(name, number):
        def run(options, gates):
            calls.append(name)
            return StageReport(name, number, name)
        return run

    fakes = {n: replace(s, run=runner(s.name, n)) for n, s in pipeline.STAGES.items()}
    monkeypatch.setattr(pipeline, "STAGES", fakes)
    return calls


def _model_dir(tmp_path, header_extra: str = "") -> str:
    """A model directory: the qwen3 preset's config and one safetensors shard (header only matters)."""
    directory = tmp_path / f"model{len(header_extra)}"
    directory.mkdir()
    shutil.copy(REPO / "adapt" / "model" / "presets" / "qwen3-30b-a3b.json", directory / "config.json")
    header = json.dumps({"__metadata__": {"format": "pt", "note": "x" + header_extra},
                         "lm_head.weight": {"dtype": "BF16", "shape": [1, 1], "data_offsets": [0, 2]}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    return str(directory)


def _target_copy(tmp_path) -> str:
    text = (REPO / "adapt" / "targets" / "h200.yaml").read_text()
    path = tmp_path / "h200-copy.yaml"
    path.write_text(text.replace("name: h200", "name: h200", 1) + "\n# same numbers, another profile file\n")
    return str(path)


def _gates_file(tmp_path, section: str, key: str, value) -> str:
    path = tmp_path / f"gates-{section}.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    return str(path)


# field -> (how to change the invocation, stages below 3 that must run again)
CHANGES = {
    "model": (lambda o, g, t: (replace(o, model="mixtral-8x7b"), g), {"inventory", "memory"}),
    "checkpoint": (lambda o, g, t: (replace(o, model=_model_dir(t, "changed")), g), {"inventory", "memory"}),
    "target": (lambda o, g, t: (replace(o, target="h100-sxm"), g), {"inventory", "memory"}),
    "target.profile": (lambda o, g, t: (replace(o, target=_target_copy(t)), g), {"inventory", "memory"}),
    "stack": (lambda o, g, t: (replace(o, stack="vllm-rocm"), g), {"inventory", "memory"}),
    "options.devices": (lambda o, g, t: (replace(o, devices=4), g), {"memory"}),
    "options.nodes": (lambda o, g, t: (replace(o, nodes=2), g), {"memory"}),
    "options.context": (lambda o, g, t: (replace(o, context=4096), g), {"memory"}),
    "options.batch": (lambda o, g, t: (replace(o, batch=2), g), {"memory"}),
    "options.kv_dtype": (lambda o, g, t: (replace(o, kv_dtype="fp8"), g), {"memory"}),
    "options.weights": (lambda o, g, t: (replace(o, weights="fp8"), g), {"memory"}),
    "gates.memory": (lambda o, g, t: (o, load_gates(_gates_file(t, "memory", "headroom_fraction", 0.3))),
                     {"memory"}),
    "gates.inventory": (lambda o, g, t: (o, load_gates(_gates_file(t, "inventory", "max_missing", 2))),
                        {"inventory"}),
    "adapt_version": (None, {"inventory", "memory"}),
}


def test_a_pass_with_the_same_fingerprint_is_reused(tmp_path, fake_stages):
    run = RunDir(tmp_path, "r")
    options = replace(BASE, model=_model_dir(tmp_path))
    validate(3, options, run, load_gates())
    assert fake_stages == ["inventory", "memory", "kernels"]
    fake_stages.clear()
    validate(3, options, run, load_gates())
    assert fake_stages == ["kernels"]


@pytest.mark.parametrize("field", list(CHANGES))
def test_a_changed_fingerprint_field_runs_the_stage_again(tmp_path, fake_stages, monkeypatch, field):
    run = RunDir(tmp_path, "r")
    options = replace(BASE, model=_model_dir(tmp_path))
    gates = load_gates()
    validate(3, options, run, gates)
    before = {name: run.stage_report(name)["fingerprint"] for name in ("inventory", "memory")}
    fake_stages.clear()
    change, rerun = CHANGES[field]
    if change is None:
        monkeypatch.setattr(adapt, "__version__", "0.0.0-other")
    else:
        options, gates = change(options, gates, tmp_path)
    validate(3, options, run, gates)
    assert set(fake_stages) - {"kernels"} == rerun
    for name in rerun:  # the new report records the new value of the field
        top = field.split(".")[0]
        assert run.stage_report(name)["fingerprint"][top] != before[name][top]


def test_hand_written_manifest_does_not_count(tmp_path, capsys):
    """The issue's case: a manifest claiming stage 1 passed, with no inventory.json, is not trusted."""
    run_dir = tmp_path / "prov"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text('{"stages": {"inventory": {"verdict": "pass"}}}')
    result = run_adapt(capsys, "validate", "qwen3-30b-a3b", "--stage", "2", "--target", "h200", "--devices", "1",
                       "--output", tmp_path, "--run", "prov", "--json")
    assert result.code == 0, result.stderr
    assert [r["stage"] for r in json.loads(result.stdout)["reports"]] == ["inventory", "memory"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"inventory", "memory"}
    assert manifest["stages"]["inventory"]["fingerprint"]["options"] == {}


@pytest.mark.parametrize("text", ['[1, 2]', '{"stages": []}', '{"stages": {"inventory": 1}', "not json"])
def test_manifest_of_the_wrong_shape_is_bad_input(tmp_path, capsys, text):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text(text)
    before = snapshot(run_dir)
    result = run_adapt(capsys, "validate", "qwen3-30b-a3b", "--stage", "1", "--target", "h200",
                       "--output", tmp_path, "--run", "r")
    assert result.code == 2
    assert len(result.lines) == 1 and "manifest.json" in result.lines[0] and "manifest" in result.lines[0]
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------- hand-off refusal


def _stamped_run(tmp_path, options: PipelineOptions, gates=None, run_id="h") -> RunDir:
    run = RunDir(tmp_path, run_id)
    gates = gates or load_gates()
    for number, name in ((1, "inventory"), (2, "memory"), (3, "kernels"), (4, "parallel")):
        report = StageReport(name, number, name)
        stamp(report, stage_fingerprint(number, options, gates))
        run.write(report)
    return run


HANDOFF_CHANGES = {
    "model": (dict(model="mixtral-8x7b"), "model"),
    "target": (dict(target="h100-sxm"), "target"),
    "options.devices": (dict(devices=4), "options.devices"),
    "options.nodes": (dict(devices=8, nodes=2), "options.nodes"),
}


@pytest.mark.parametrize("field", list(HANDOFF_CHANGES))
def test_handoff_refuses_reports_made_for_other_inputs(tmp_path, field):
    changes, named = HANDOFF_CHANGES[field]
    run = _stamped_run(tmp_path, BASE)
    invocation = dict(model=BASE.model, target=BASE.target, devices=BASE.devices, nodes=BASE.nodes) | changes
    with pytest.raises(InputError) as err:
        check_gates(run, force=True, **invocation)
    assert "hand-off refused" in err.value.line() and f"{named}:" in err.value.line()
    check_gates(run, model=BASE.model, target=BASE.target, devices=BASE.devices, nodes=BASE.nodes, force=False)


def test_handoff_refuses_a_checkpoint_that_changed(tmp_path):
    model = _model_dir(tmp_path)
    run = _stamped_run(tmp_path, replace(BASE, model=model))
    check_gates(run, model=model, target="h200", devices=8, nodes=1, force=False)
    shard = tmp_path / "model0" / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data.replace(b'"note": "x"', b'"note": "y"'))
    with pytest.raises(InputError, match="checkpoint: recorded"):
        check_gates(run, model=model, target="h200", devices=8, nodes=1, force=True)


def test_handoff_refuses_another_adapt_version(tmp_path, monkeypatch):
    run = _stamped_run(tmp_path, BASE)
    monkeypatch.setattr(adapt, "__version__", "9.9.9")
    with pytest.raises(InputError, match="adapt_version: recorded"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_handoff_refuses_stages_that_disagree_with_each_other(tmp_path):
    run = _stamped_run(tmp_path, BASE)
    report = StageReport("memory", 2, "memory")
    stamp(report, stage_fingerprint(2, replace(BASE, context=4096), load_gates()))
    run.write(report)
    with pytest.raises(InputError, match=r"options.context is 8192 but memory planned with 4096"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_handoff_of_another_model_and_target_from_the_cli(tmp_path, capsys):
    """The issue's case: DeepSeek's H200 run handed off as Mixtral on MI300X is refused, nothing written."""
    run = _stamped_run(tmp_path, replace(BASE, model="deepseek-v3.2"), run_id="prov")
    before = snapshot(run.path)
    result = run_adapt(capsys, "handoff", "mixtral-8x7b", "--target", "mi300x", "--devices", "8",
                       "--run", "prov", "--output", tmp_path)
    assert result.code == 2
    assert len(result.lines) == 1 and "hand-off refused" in result.lines[0] and "model: recorded" in result.lines[0]
    assert snapshot(run.path) == before and not (run.path / "handoff").exists()


# ---------------------------------------------------------------- manifest and run ids

_WRITER = r"""
import json, sys
from adapt.report import RunDir, StageReport
root, index = sys.argv[1], int(sys.argv[2])
stages = ["inventory", "memory", "kernels", "parallel", "precision"]
for round_ in range(2):
    name = stages[(index + round_) % len(stages)]
    report = StageReport(name, stages.index(name) + 1, name)
    if (index + round_) % 3 == 0:
        report.add("error", "x", f"writer {index}")
    report.metrics["writer"] = [index, round_]
    report.fingerprint = {"writer": index, "round": round_}
    RunDir(root, "shared").write(report)
"""


def test_fifty_concurrent_writers_leave_a_manifest_that_agrees_with_the_stage_files(tmp_path):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(i)], env=env,
                              stderr=subprocess.PIPE) for i in range(50)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    run = RunDir(tmp_path, "shared")
    manifest = json.loads(run.manifest_path.read_text())
    on_disk = {p.stem for p in run.path.glob("*.json") if p.name != "manifest.json"}
    assert set(manifest["stages"]) == on_disk == {"inventory", "memory", "kernels", "parallel", "precision"}
    for name, entry in manifest["stages"].items():
        report = json.loads((run.path / f"{name}.json").read_text())
        assert entry["verdict"] == report["verdict"]
        assert entry["fingerprint"] == report["fingerprint"]
        assert entry["finished"] == report["finished"]
        assert sorted(entry["files"]) == sorted(report["files"])
        assert (report["verdict"] == "fail") == (sum(report["metrics"]["writer"]) % 3 == 0)
    assert not list(run.path.glob("*.tmp")) and not list(run.path.glob(".*.tmp"))


def test_default_run_ids_do_not_collide(tmp_path):
    ids = {default_run_id() for _ in range(200)}
    assert len(ids) == 200
    code = "from adapt.report import default_run_id; print(default_run_id())"
    others = {subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(REPO)}, capture_output=True,
                             text=True, check=True).stdout.strip() for _ in range(3)}
    assert len(others) == 3 and all(RunDir(tmp_path, i).run_id == i for i in others)


def test_plan_memory_and_plan_parallel_into_one_run_at_once(tmp_path):
    """The issue's case: both commands writing one run at the same time; neither entry is lost and
    the manifest's verdicts are the stage files' (batch 8 at 32K on one H100 fails both)."""
    from tests.cli_run import adapt_process

    args = ["qwen3-30b-a3b", "--target", "h100-sxm", "--devices", "1", "--context", "32768", "--batch", "8",
            "--output", tmp_path, "--json"]
    procs = [adapt_process("plan-memory", *args, "--run", "both"),
             adapt_process("plan-parallel", *args, "--run", "both"),
             adapt_process("plan-memory", *args), adapt_process("plan-memory", *args)]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [1, 1, 1, 1], [p.stderr.read() for p in procs]
    manifest = json.loads((tmp_path / "both" / "manifest.json").read_text())
    assert {k: v["verdict"] for k, v in manifest["stages"].items()} == {"memory": "fail", "parallel": "fail"}
    for name in ("memory", "parallel"):
        assert json.loads((tmp_path / "both" / f"{name}.json").read_text())["verdict"] == "fail"
    runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(runs) == 3  # the two runs without --run got directories of their own
