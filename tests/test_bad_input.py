"""Bad input: exit 2 and one line naming file, field and fix, never a traceback or exit 1, and the
run directory left as it was; and the small things a user trips on (issue 11, items 4 and 6)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from adapt.report import RunDir, StageReport
from tests.cli_run import REPO, snapshot
from tests.cli_run import adapt as run_adapt

H200 = (REPO / "adapt" / "targets" / "h200.yaml").read_text()
QWEN = json.loads((REPO / "adapt" / "model" / "presets" / "qwen3-30b-a3b.json").read_text())


def one_line(result, *needles: str) -> str:
    assert result.code == 2, (result.code, result.stderr)
    assert len(result.lines) == 1, result.stderr
    line = result.lines[0]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def plan(tmp_path, *extra: str, target: str = "h200") -> list[str]:
    return ["plan-memory", "qwen3-30b-a3b", "--target", str(target), "--devices", "1", "--context", "8192",
            "--output", str(tmp_path / "reports"), "--run", "r", *extra]


# ---------------------------------------------------------------- --output and --run


def test_output_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    result = run_adapt(capsys, *plan(tmp_path)[:-4], "--output", tmp_path / "file", "--run", "r")
    one_line(result, "file", "--output", "not a directory")
    assert (tmp_path / "file").read_text() == "x"


def test_output_that_is_read_only(tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        result = run_adapt(capsys, *plan(tmp_path)[:-4], "--output", out, "--run", "r")
        one_line(result, str(out), "--output", "not writable")
        assert list(out.iterdir()) == []
    finally:
        out.chmod(0o755)


@pytest.mark.parametrize("name", ["x" * 300, "../escape", ".hidden", "a b", ""])
def test_bad_run_names(tmp_path, capsys, name):
    result = run_adapt(capsys, *plan(tmp_path)[:-2], "--run", name)
    one_line(result, "--run")
    assert not (tmp_path / "reports").exists()


# ---------------------------------------------------------------- target, stack and gates files


@pytest.mark.parametrize("field, value", [
    ("hbm_bandwidth_tbs", ".nan"), ("hbm_bandwidth_tbs", ".inf"), ("memory_gib", "0"), ("memory_gib", "-141"),
    ("intra_node_bandwidth_gbs", "0"), ("inter_node_latency_us", "-1"), ("devices_per_node", "0"),
])
def test_target_yaml_numbers(tmp_path, capsys, field, value):
    lines = [f"{field}: {value}" if line.startswith(f"{field}:") else line for line in H200.splitlines()]
    path = tmp_path / "t.yaml"
    path.write_text("\n".join(lines) + "\n")
    result = run_adapt(capsys, *plan(tmp_path, target=path))
    one_line(result, "t.yaml", f"field '{field}'", "finite number > 0")
    assert not (tmp_path / "reports").exists()


def test_duplicate_keys_in_a_target_yaml(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(H200 + "memory_gib: 999\n")
    result = run_adapt(capsys, *plan(tmp_path, target=path))
    one_line(result, "t.yaml", "duplicate key 'memory_gib'")


@pytest.mark.parametrize("args", [
    ["validate", "qwen3-30b-a3b", "--stage", "1", "--target", "h200", "--stack", "no-such-stack"],
    ["inventory", "qwen3-30b-a3b", "--target", "h200", "--stack", "no-such-stack"],
])
def test_unknown_stack_in_any_command(tmp_path, capsys, args):
    result = run_adapt(capsys, *args, "--output", tmp_path, "--run", "r")
    one_line(result, "unknown stack 'no-such-stack'")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text, field", [
    ("memory:\n  headroom_fraction: 1.5\n", "memory.headroom_fraction"),
    ("memory:\n  headroom_fraction: -0.1\n", "memory.headroom_fraction"),
    ("memory:\n  headroom_fraction: .nan\n", "memory.headroom_fraction"),
    ("parallel:\n  min_plans: 1.5\n", "parallel.min_plans"),
    ("memory:\n  headroom_fraction: 0.1\n  headroom_fraction: 0.3\n", ""),
])
def test_bad_values_in_a_gates_file_are_named_as_such(tmp_path, capsys, text, field):
    path = tmp_path / "gates.yaml"
    path.write_text(text)
    line = one_line(run_adapt(capsys, *plan(tmp_path, "--gates", str(path))), "gates.yaml", field)
    assert "--headroom" not in line
    assert not (tmp_path / "reports").exists()


# ---------------------------------------------------------------- preflight data


def test_preflight_eval_data_missing_path(tmp_path, capsys):
    result = run_adapt(capsys, "preflight", "--target", "h200", "--eval-data", tmp_path / "absent",
                       "--output", tmp_path, "--run", "p")
    one_line(result, "absent", "--eval-data")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("name, text, code, detail", [
    ("two.jsonl", "{}", 1, "expected a non-empty JSON object"),
    ("two.txt", "\n\n", 1, "no evaluation items"),
    ("tasks.json", '{"gsm8k": [{"q": 1}, {"q": 2}], "mmlu": [{"q": 3}]}', 0, "3 items (gsm8k 2, mmlu 1)"),
])
def test_preflight_eval_data_is_parsed_and_counted(tmp_path, capsys, name, text, code, detail):
    data = tmp_path / name
    data.write_text(text)
    result = run_adapt(capsys, "preflight", "--target", "h200", "--eval-data", data, "--output", tmp_path,
                       "--run", "p", "--json")
    assert result.code == code
    rows = {r["check"]: r for r in json.loads((tmp_path / "p" / "preflight.json").read_text())["tables"]["checklist"]}
    assert detail in rows["evaluation data (stage 5)"]["detail"]


# ---------------------------------------------------------------- implausible configs


@pytest.mark.parametrize("field, value, command", [
    ("num_hidden_layers", 10**12, ["info"]),
    ("hidden_size", 10**30, ["plan-memory", "--target", "h200", "--devices", "1", "--context", "4096"]),
    ("rope_theta", float("nan"), ["info"]),
])
def test_implausible_configs_are_refused_before_allocation(tmp_path, capsys, field, value, command):
    config = dict(QWEN, **{field: value})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run_adapt(capsys, command[0], path, *command[1:], "--output", tmp_path / "reports") \
        if command[0] != "info" else run_adapt(capsys, "info", path)
    one_line(result, "config.json", f"field '{field}'")
    assert not (tmp_path / "reports").exists()


# ---------------------------------------------------------------- validate checks every flag first


@pytest.mark.parametrize("flag, value, field", [
    ("--weights", "bogus", "--weights"), ("--kv-dtype", "fp4", "--kv-dtype"), ("--devices", "0", "--devices"),
    ("--batch", "0", "--batch"), ("--context", str(10**9), "--context"), ("--stack", "bogus", "stack"),
    ("--devices", "16", "--devices"),
])
def test_validate_checks_every_flag_before_any_stage(tmp_path, capsys, flag, value, field):
    result = run_adapt(capsys, "validate", "qwen3-30b-a3b", "--stage", "4", "--target", "h200", flag, value,
                       "--output", tmp_path, "--run", "v")
    one_line(result, field)
    assert snapshot(tmp_path / "v") == {}


# ---------------------------------------------------------------- item 6


def test_usage_errors_are_one_line(capsys):
    result = run_adapt(capsys, "validate", "qwen3-30b-a3b")
    one_line(result, "Missing option '--stage'", "validate --help")
    result = run_adapt(capsys, "plan-memory", "qwen3-30b-a3b", "--target", "h200", "--devices", "two",
                       "--context", "1")
    one_line(result, "'--devices'")


def test_version(capsys):
    import adapt

    result = run_adapt(capsys, "--version")
    assert result.code == 0 and result.stdout.strip() == f"adapt {adapt.__version__}"


def _commands():
    import typer

    from adapt.cli import app

    root = typer.main.get_command(app)
    stack = [(name, cmd) for name, cmd in root.commands.items()]
    while stack:
        name, cmd = stack.pop()
        if hasattr(cmd, "commands"):
            stack += [(f"{name} {n}", c) for n, c in cmd.commands.items()]
        else:
            yield name, cmd


def test_short_flags_mean_one_thing_and_target_is_required_everywhere():
    meaning: dict[str, tuple[str, str]] = {}
    for name, cmd in _commands():
        for param in cmd.params:
            longs = [o for o in param.opts if o.startswith("--")]
            for short in (o for o in param.opts if len(o) == 2 and o.startswith("-")):
                first = meaning.setdefault(short, (longs[0], name))
                assert first[0] == longs[0], f"{short} is {first[0]} in {first[1]} but {longs[0]} in {name}"
            if "--target" in param.opts:
                assert param.required, f"--target is optional in `adapt {name}`"


def test_source_tags_survive_the_terminal(capsys):
    from adapt import cli

    report = StageReport("memory", 2, "memory [plan]", summary="rate 4.8 TB/s [fp8-doc]")
    report.add("warn", "x", "bandwidth from [h200-datasheet]", hint="see [fp8-doc]")
    report.tables["t"] = [{"source": "[fp8-doc]"}]
    cli.render_report(report)
    out = capsys.readouterr().out
    assert out.count("[fp8-doc]") == 3 and "[h200-datasheet]" in out and "memory [plan]" in out


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_reports_honor_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        written = RunDir(tmp_path, "r").write(StageReport("memory", 2, "m"),
                                              extra={"parallel.launch.sh": "#!/bin/sh\n"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(written["memory.json"].stat().st_mode) == mode
    assert stat.S_IMODE(written["parallel.launch.sh"].stat().st_mode) == 0o777 & ~mask


def test_launch_scripts_are_executable_and_run_under_sh(tmp_path, capsys):
    result = run_adapt(capsys, "plan-parallel", "deepseek-v3.2", "--target", "h200", "--devices", "16",
                       "--nodes", "2", "--context", "8192", "--output", tmp_path, "--run", "p")
    assert result.code == 0, result.stderr
    script = tmp_path / "p" / "parallel.launch.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["sh", "-n", str(script)], capture_output=True).returncode == 0
    ran = subprocess.run(["sh", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert ran.returncode != 0 and "set THIS_NODE_IP (this-node-ip)" in ran.stderr
    assert "syntax error" not in ran.stderr and "No such file" not in ran.stderr


def test_serve_script_in_the_bundle_is_executable(tmp_path):
    from adapt.handoff.bundle import write_bundle

    run = RunDir(tmp_path, "forced")
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run, force=True)
    written = run.write(report, extra=files)
    serve = written["handoff/serve.sh"]
    assert os.access(serve, os.X_OK)
    assert subprocess.run(["sh", "-n", str(serve)], capture_output=True).returncode == 0
    assert Path(serve).read_text().startswith("#!/bin/sh\n")


def _refused_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("extra, file, field, text", [
    (("--checkpoint", "/nonexistent/ckpt"), "/nonexistent/ckpt", "--checkpoint", "no config.json"),
    ((), None, "--url", "no server answers"),
])
def test_bench_serve_url_inputs_are_refused_before_anything_is_written(tmp_path, capsys, extra, file, field, text):
    """`bench serve --url` to a port nothing listens on, or with a --checkpoint that is no model directory: one
    line, exit 2, no run directory (before, the load generator tried every request against nothing)."""
    result = run_adapt(capsys, "bench", "serve", "m", "--target", "h200", "--url", f"http://127.0.0.1:{_refused_port()}",
                       *extra, "--output", tmp_path / "out", "--run", "r")
    one_line(result, *([file] if file else []), field, text)
    assert not (tmp_path / "out").exists()
