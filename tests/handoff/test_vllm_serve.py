"""vLLM for real: its argument parser on generated commands, and `adapt handoff --launch` end to end.

Needs the serve environment (`make serve-env`, which `make test` runs first). Under CI a missing
vLLM is a failure, elsewhere these tests skip.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adapt.cli import app
from adapt.handoff.vllm import validate_with_vllm
from adapt.model.tiny import build_tiny
from adapt.plan.launch import multi_node_args, serve_command
from adapt.report import RunDir, StageReport, load_gates
from adapt.stages.parallel import run_plan_parallel
from adapt.stages.pipeline import PipelineOptions, stage_fingerprint, stamp

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return build_tiny("tiny-qwen3", tmp_path_factory.mktemp("models") / "tiny-qwen3")


def plan(devices, nodes):
    report = run_plan_parallel("deepseek-v3.2", "h200", gates=load_gates(), devices=devices, nodes=nodes,
                               context=8192, batch=1)
    return report.metrics["engine_args"]


@pytest.mark.timeout(300)
def test_vllm_parser_accepts_generated_commands(vllm_exe):
    one_node = plan(8, 1)
    two_node_dp = multi_node_args(plan(16, 2), 2)
    two_node_pp = multi_node_args({**one_node, "pipeline_parallel_size": 2}, 2)
    plans = (one_node, two_node_dp, two_node_pp)
    commands = [serve_command("deepseek-ai/DeepSeek-V3.2", args) for args in plans]
    commands.append(serve_command("/m", {**one_node, "kv_cache_dtype": "fp7"}))
    results = validate_with_vllm(commands, vllm_exe)
    for args, result in zip(plans, results[:3], strict=True):
        assert result["ok"], result
        parsed = result["engine_args"]
        assert parsed["model"] == "deepseek-ai/DeepSeek-V3.2"
        for key, value in args.items():
            assert parsed[key] == value, key
    assert results[1]["engine_args"]["data_parallel_backend"] == "ray"
    assert results[2]["engine_args"]["distributed_executor_backend"] == "ray"
    assert not results[3]["ok"] and "kv-cache-dtype" in results[3]["error"]


def forced_run(tmp_path, engine_args=None, model=None):
    """A run directory holding only a stage-4 report with these engine arguments, made for ``model``
    on one cpu device (hand-off needs --force)."""
    run = RunDir(tmp_path / "reports", "smoke")
    if engine_args is not None:
        report = StageReport("parallel", 4, "parallel", metrics={"engine_args": engine_args})
        options = PipelineOptions(model=str(model), target="cpu", devices=1, nodes=1)
        stamp(report, stage_fingerprint(4, options, load_gates()))
        run.write(report)
    return run


def processes_mentioning(text):
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-oss"])
def test_launch_serves_compares_and_tears_down(tmp_path, name, vllm_exe):
    model = build_tiny(name, tmp_path / name)
    run = forced_run(tmp_path)
    result = CliRunner().invoke(app, ["handoff", str(model), "--target", "cpu", "--devices", "1",
                                      "--run", "smoke", "--output", str(tmp_path / "reports"), "--force",
                                      "--launch", "--vllm", str(vllm_exe), "--json"])
    report = json.loads((run.path / "handoff.json").read_text())
    smoke = report["metrics"]["smoke"]
    print(json.dumps({k: smoke.get(k) for k in ("health_s", "requests_s", "transformers_s")}))
    for title, rows in report["tables"].items():
        print(title)
        for row in rows:
            print(row)
    assert result.exit_code == 0, result.output
    assert report["metrics"]["forced"] is True
    assert smoke["leftover_processes"] == []
    assert processes_mentioning(str(model)) == []
    assert processes_mentioning(str(run.path)) == []
    served = smoke["vllm_vs_transformers"]
    assert len(served) == 4 and all(c["generated"] == 16 for c in served)
    assert all(c["top5_overlap"] for c in served)
    assert len(smoke["vllm_vs_adapt"]) == 4
    assert not [f for f in report["findings"] if f["severity"] == "error"]
    assert (run.path / "handoff" / "server.log").stat().st_size > 0
    assert "served here and compared with transformers over 4 prompts" in \
        (run.path / "handoff" / "README.md").read_text()
    exported = [f for f in report["findings"] if f["code"] == "dequantized-export"]
    if name == "tiny-oss":   # stored MXFP4: the CPU backend serves a bf16 export, and the bundle says so
        assert exported and "model-bf16" in smoke["serve_argv"][2]
        assert "dequantized to bf16" in (run.path / "handoff" / "README.md").read_text()
    else:
        assert not exported and smoke["serve_argv"][2] == str(model.resolve())


@pytest.mark.timeout(300)
def test_bad_argument_fails_with_log_tail_and_no_process_left(tmp_path, tiny_qwen3, vllm_exe):
    forced_run(tmp_path, {"tensor_parallel_size": 1, "no_such_engine_flag": 3}, tiny_qwen3)
    result = CliRunner().invoke(app, ["handoff", str(tiny_qwen3), "--target", "cpu", "--devices", "1",
                                      "--run", "smoke", "--output", str(tmp_path / "reports"), "--force",
                                      "--launch", "--vllm", str(vllm_exe), "--max-tokens", "2"])
    assert result.exit_code == 1, result.output
    assert "last log lines" in result.output
    assert "no-such-engine-flag" in result.output
    assert processes_mentioning(str(tiny_qwen3)) == []


def test_port_taken_is_bad_input(tmp_path, tiny_qwen3, vllm_exe):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        forced_run(tmp_path, {"tensor_parallel_size": 1})
        result = CliRunner().invoke(app, ["handoff", str(tiny_qwen3), "--target", "cpu", "--devices", "1",
                                          "--run", "smoke", "--output", str(tmp_path / "reports"), "--force",
                                          "--launch", "--vllm", str(vllm_exe), "--port", str(port),
                                          "--max-tokens", "2"])
    assert result.exit_code == 2, result.output
    assert "already in use" in result.output
    assert processes_mentioning(str(tiny_qwen3)) == []


def test_missing_model_is_bad_input(tmp_path, vllm_exe):
    forced_run(tmp_path, {"tensor_parallel_size": 1})
    reports = str(tmp_path / "reports")
    result = CliRunner().invoke(app, ["handoff", str(tmp_path / "no-model"), "--target", "cpu",
                                      "--devices", "1", "--run", "smoke", "--output", reports,
                                      "--force", "--launch", "--vllm", str(vllm_exe)])
    assert result.exit_code == 2, result.output
    assert "not a model directory" in result.output


# A stand-in `vllm` that starts, leaves a child in its session, writes both pids and never turns healthy:
# the hand-off is certain to be waiting on /health when the test's SIGINT lands (a real server could
# finish the smoke run first).
NEVER_HEALTHY = """import os, subprocess, sys, time
print("stand-in vllm", *sys.argv[1:], flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["ADAPT_TEST_PIDS"] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
os.replace(os.environ["ADAPT_TEST_PIDS"] + ".tmp", os.environ["ADAPT_TEST_PIDS"])
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_server(tmp_path, tiny_qwen3):
    forced_run(tmp_path, {"tensor_parallel_size": 1}, tiny_qwen3)
    stand_in = tmp_path / "bin" / "vllm"
    stand_in.parent.mkdir()
    stand_in.write_text(f"#!{sys.executable}\n{NEVER_HEALTHY}")
    stand_in.chmod(0o755)
    pids_file = tmp_path / "server.pids"
    proc = subprocess.Popen([sys.executable, "-m", "adapt.cli", "handoff", str(tiny_qwen3), "--target",
                             "cpu", "--devices", "1", "--run", "smoke", "--output", str(tmp_path / "reports"),
                             "--force", "--launch", "--vllm", str(stand_in)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ADAPT_TEST_PIDS": str(pids_file)})
    try:
        deadline = time.monotonic() + 240
        while not pids_file.is_file() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        server_pids = [int(p) for p in pids_file.read_text().split()]
        assert all(_alive(pid) for pid in server_pids)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output
    assert not any(_alive(pid) for pid in server_pids)
