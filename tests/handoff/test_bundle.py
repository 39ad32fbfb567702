"""Hand-off refusal, --force, and the deployment bundle (no vLLM needed)."""

import json
import shlex

import pytest
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.handoff.bundle import REQUIRED_STAGES, write_bundle
from adapt.handoff.vllm import find_vllm
from adapt.report import RunDir, StageReport, fingerprint, load_gates
from adapt.stages.parallel import run_plan_parallel
from adapt.stages.pipeline import PipelineOptions, stage_fingerprint, stamp


def options(devices=8, nodes=1, model="deepseek-v3.2", target="h200"):
    return PipelineOptions(model=model, target=target, devices=devices, nodes=nodes, context=8192, batch=1)


def record(run, stage, verdict, number=1, devices=8, nodes=1):
    """A stage report with the given verdict and the pipeline's fingerprint for DeepSeek-V3.2 on H200."""
    report = StageReport(stage, number, stage)
    if verdict == "fail":
        report.add("error", "x", "failed")
    elif verdict == "warn":
        report.add("warn", "x", "warned")
    stamp(report, stage_fingerprint(number, options(devices, nodes), load_gates()))
    run.write(report)


def passed_run(tmp_path, devices=8, nodes=1, skip=()):
    """A run where stages 1-3 passed and stage 4 is the real planner's DeepSeek-V3.2 plan on H200."""
    run = RunDir(tmp_path / "reports", "r1")
    for number, stage in enumerate(REQUIRED_STAGES[:3], start=1):
        if stage not in skip:
            record(run, stage, "pass", number, devices, nodes)
    if "parallel" not in skip:
        report = run_plan_parallel("deepseek-v3.2", "h200", gates=load_gates(), devices=devices, nodes=nodes,
                                   context=8192, batch=1)
        stamp(report, stage_fingerprint(4, options(devices, nodes), load_gates()))
        run.write(report)
    return run


def test_refuses_without_gates_and_names_the_command(tmp_path):
    run = RunDir(tmp_path / "reports", "empty")
    with pytest.raises(InputError) as err:
        write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    text = err.value.line()
    for stage in REQUIRED_STAGES:
        assert f"{stage}: not run" in text
    assert "adapt validate deepseek-v3.2 --stage 4 --target h200 --devices 8 --nodes 1 --run empty" in text


def test_refuses_a_failed_gate(tmp_path):
    run = passed_run(tmp_path)
    record(run, "memory", "fail", 2)
    with pytest.raises(InputError, match="memory: fail"):
        write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)


def test_warned_gates_are_enough(tmp_path):
    run = passed_run(tmp_path)
    record(run, "kernels", "warn", 3)
    report, _ = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    assert report.metrics["forced"] is False


def test_bundle_for_one_node(tmp_path):
    run = passed_run(tmp_path)
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    plan = json.loads((run.path / "parallel.json").read_text())["metrics"]["engine_args"]
    args = json.loads(files["handoff/engine_args.json"])
    assert args["engine_args"] == plan and args["forced"] is False
    serve = files["handoff/serve.sh"].splitlines()[-1]
    assert shlex.split(serve)[1:] == report.metrics["serve_command"]
    assert "--tensor-parallel-size" in serve
    assert "handoff/ray.sh" not in files
    readme = files["handoff/README.md"]
    assert "| parallel | pass |" in readme and "precision" in readme
    run.write(report, extra=files)
    assert (run.path / "handoff" / "serve.sh").is_file()
    assert run.verdict_of("handoff") == "pass"


def test_bundle_for_two_nodes_has_ray_steps(tmp_path):
    run = passed_run(tmp_path, devices=16, nodes=2)
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=16, nodes=2, run=run)
    ray = files["handoff/ray.sh"]
    assert "ray start --head" in ray and "ray start --address=${HEAD_IP:?set HEAD_IP (head-ip)}:6379" in ray
    assert report.metrics["ray_steps"][-1].startswith("vllm serve")
    assert "Ray" in files["handoff/README.md"]


def test_force_is_recorded(tmp_path):
    run = RunDir(tmp_path / "reports", "forced")
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run, force=True)
    assert report.metrics["forced"] is True
    assert json.loads(files["handoff/engine_args.json"])["forced"] is True
    assert "**Forced:**" in files["handoff/README.md"]
    assert any(f.code == "forced" for f in report.findings)
    assert report.metrics["engine_args"] == {"tensor_parallel_size": 8, "pipeline_parallel_size": 1}


def test_device_count_must_match_the_plan(tmp_path):
    run = passed_run(tmp_path)
    with pytest.raises(InputError, match="options.devices: recorded 8, now 16"):
        write_bundle("deepseek-v3.2", target="h200", devices=16, nodes=2, run=run)


def test_missing_vllm_is_input_error(tmp_path):
    with pytest.raises(InputError, match="no vllm executable"):
        find_vllm(str(tmp_path / "nope"))


def test_cli_refusal_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["handoff", "deepseek-v3.2", "--target", "h200", "--devices", "8",
                                      "--run", "r1", "--output", str(tmp_path)])
    assert result.exit_code == 2
    assert "hand-off refused" in result.output and "Traceback" not in result.output


def test_cli_writes_bundle_after_gates(tmp_path):
    run = passed_run(tmp_path)
    result = CliRunner().invoke(app, ["handoff", "deepseek-v3.2", "--target", "h200", "--devices", "8",
                                      "--run", "r1", "--output", str(tmp_path / "reports"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["stage"] == "handoff"
    assert (run.path / "handoff" / "README.md").is_file()


def test_preflight_checks_travel_with_the_bundle(tmp_path):
    run = passed_run(tmp_path)
    preflight = StageReport("preflight", 0, "preflight", fingerprint=fingerprint(target="h200", model="deepseek-v3.2"))
    preflight.add("warn", "driver", "driver older than recommended")
    run.write(preflight)
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    checks = json.loads(files["handoff/preflight.json"])
    assert checks["verdict"] == "warn" and checks["findings"][0]["code"] == "driver"
    assert "preflight verdict: warn" in files["handoff/README.md"]
    assert not any(f.code == "no-preflight" for f in report.findings)
