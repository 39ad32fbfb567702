"""Stage 0: the preflight checklist (checked here where possible, listed where not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.stages import preflight
from adapt.stages.preflight import run_preflight
from adapt.targets.target import load_target

H200_GPU = [{"name": "NVIDIA H200", "driver_version": "570.124.06", "memory.total": "143771 MiB",
             "compute_cap": "9.0"}]


def _checks(report) -> dict[str, dict]:
    return {row["check"]: row for row in report.tables["checklist"]}


def _target(tmp_path: Path, name: str, **changes) -> str:
    data = yaml.safe_load(Path(load_target("h200").path).read_text())
    data.update(name=name, **changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_without_gpu_lists_instead_of_failing(tmp_path):
    report = run_preflight("h200", "deepseek-v3.2", tmp_path, gpus=None)
    checks = _checks(report)
    assert report.stage == "preflight" and report.number == 0
    assert checks["driver"]["status"] == "cannot check here"
    assert checks["local GPU vs target"]["status"] == "cannot check here"
    assert checks["memory headroom"]["status"] == "not run"
    assert checks["fp8 weights"]["status"] == "ok"
    dsa = checks["sparse attention (DSA)"]
    assert dsa["status"] == "ok" and "sm90" in dsa["detail"]
    assert report.verdict == "warn"          # only the missing --eval-data warns
    assert not [f for f in report.findings if f.severity == "error"]


def test_gpu_rows_are_checked_against_the_target():
    report = run_preflight("h200", None, None, gpus=H200_GPU)
    checks = _checks(report)
    assert checks["driver"]["status"] == "ok" and "570.124.06" in checks["driver"]["detail"]
    assert checks["local GPU vs target"]["status"] == "ok"
    other = _checks(run_preflight("b200", None, None, gpus=H200_GPU))
    assert other["local GPU vs target"]["status"] == "warn"


def test_fp8_model_on_target_without_fp8_fails(tmp_path):
    target = _target(tmp_path, "no-fp8", native_dtypes=["fp32", "bf16"])
    report = run_preflight(target, "deepseek-v3.2", None, gpus=None)
    assert _checks(report)["fp8 weights"]["status"] == "fail"
    assert report.verdict == "fail"


def test_dsa_needs_sm90(tmp_path):
    target = _target(tmp_path, "ampere", compute_capability="8.0", native_dtypes=["fp32", "bf16", "fp8"])
    checks = _checks(run_preflight(target, "deepseek-v3.2", None, gpus=None))
    assert checks["sparse attention (DSA)"]["status"] == "fail"
    assert checks["fp8 weights"]["status"] == "fail"   # fp8 compute needs sm89


def test_mxfp4_native_only_on_blackwell():
    hopper = _checks(run_preflight("h200", "gpt-oss-120b", None, gpus=None))["mxfp4 experts"]
    assert "no native MXFP4 MMA" in hopper["detail"] and "mxfp4_to_fp8" in hopper["detail"]
    blackwell = _checks(run_preflight("b200", "gpt-oss-120b", None, gpus=None))["mxfp4 experts"]
    assert "has native MXFP4 MMA" in blackwell["detail"]


@pytest.mark.parametrize(("installed", "status"),
                         [("0.10.2", "fail"), ("0.11.0", "ok"), ("0.12.1.dev4+gabc", "ok")])
def test_vllm_version_against_model_features(monkeypatch, installed, status):
    real = preflight._version
    monkeypatch.setattr(preflight, "_version", lambda pkg: installed if pkg == "vllm" else real(pkg))
    check = _checks(run_preflight("h200", "deepseek-v3.2", None, gpus=None))["vllm"]
    assert check["status"] == status
    if status == "fail":
        assert "mla+dsa needs vLLM >= 0.11.0" in check["detail"]


def _memory_report(run_dir: Path, weights_gib: float, sequences: int) -> None:
    """A stage-2 report: budget 126 GiB, weights + 4 GiB margin, 10 GiB of KV per sequence."""
    gib = 2**30
    metrics = {"budget_bytes": 126 * gib, "kv_bytes_per_sequence": 10 * gib, "sequences_per_replica": sequences,
               "terms": {"weights": int(weights_gib * gib), "headroom": 4 * gib, "kv_cache": sequences * 10 * gib}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "memory.json").write_text(json.dumps({"verdict": "pass", "metrics": metrics}))


def test_memory_headroom_is_the_rule_of_stage_2(tmp_path):
    _memory_report(tmp_path / "ok", weights_gib=100, sequences=2)     # 126 - 104 = 22 GiB >= 2 x 10
    check = _checks(run_preflight("h200", None, tmp_path / "ok", gpus=None))["memory headroom"]
    assert check["status"] == "ok" and "2 of 2 requested sequence(s) fit" in check["detail"]
    _memory_report(tmp_path / "tight", weights_gib=100, sequences=3)  # 22 GiB < 3 x 10
    tight = _checks(run_preflight("h200", None, tmp_path / "tight", gpus=None))["memory headroom"]
    assert tight["status"] == "fail" and "fits-fewer-sequences" in tight["detail"]


@pytest.mark.parametrize("batch", [1, 64])
def test_memory_headroom_agrees_with_a_real_stage_2_report(tmp_path, batch):
    from adapt.report import RunDir, load_gates
    from adapt.stages.memory import run_plan_memory

    run = RunDir(tmp_path, "r")
    report = run_plan_memory("gpt-oss-120b", "h200", gates=load_gates(), devices=1, context=32768, batch=batch)
    run.write(report)
    check = _checks(run_preflight("h200", "gpt-oss-120b", run.path, gpus=None))["memory headroom"]
    assert (check["status"] == "ok") == (report.verdict != "fail")
    assert report.verdict == ("pass" if batch == 1 else "fail")


def test_eval_data(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "2+2="}\n')
    status = lambda path: _checks(run_preflight("h200", None, None, eval_data=path, gpus=None))[  # noqa: E731
        "evaluation data (stage 5)"]["status"]
    with pytest.raises(InputError, match="--eval-data"):
        status(tmp_path / "absent")
    assert status(empty) == "fail"
    assert status(data) == "ok"
    assert status(None) == "warn"


def test_cli_preflight(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "x"}\n')
    result = CliRunner().invoke(app, ["preflight", "--target", "h200", "--model", "gpt-oss-120b",
                                      "--eval-data", str(data), "--output", str(tmp_path), "--run", "p",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stage"] == "preflight"
    assert (tmp_path / "p" / "preflight.json").is_file()
    bad = CliRunner().invoke(app, ["preflight", "--target", "no-such-target", "--output", str(tmp_path)])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


NVFP4_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "kimi-k2.6-nvfp4.json"


@pytest.fixture
def nvfp4_model(tmp_path):
    """Kimi K2.6 NVFP4's published config.json (ModelOpt NVFP4 experts) as a model directory."""
    model = tmp_path / "kimi-nvfp4"
    model.mkdir()
    (model / "config.json").write_text(NVFP4_CONFIG.read_text())
    return str(model)


@pytest.mark.parametrize("target, status, words", [
    ("b200", "ok", "native fp4"),
    ("h200", "warn", "Marlin"),
    ("gaudi3", "fail", "no native fp4"),
    ("ascend-910b", "fail", "no native fp4"),
])
def test_nvfp4_experts_need_native_fp4(nvfp4_model, target, status, words):
    report = run_preflight(target, nvfp4_model, None, gpus=None)
    check = _checks(report)["nvfp4 experts"]
    assert check["status"] == status and words in check["detail"], check
    if status == "fail":
        assert report.verdict == "fail" and "re-plan stage 2" in check["detail"]


def test_nvfp4_check_reads_the_profiles_native_dtypes(nvfp4_model, tmp_path):
    """A Blackwell-class profile that does not list fp4 among its native dtypes does not pass."""
    target = _target(tmp_path, "sm100-no-fp4", compute_capability="10.0",
                     native_dtypes=["fp32", "bf16", "fp16", "fp8"])
    assert _checks(run_preflight(target, nvfp4_model, None, gpus=None))["nvfp4 experts"]["status"] == "warn"
    assert "nvfp4 experts" not in _checks(run_preflight("h200", "deepseek-v3.2", None, gpus=None))
