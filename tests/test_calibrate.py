"""`adapt calibrate` on this machine's CPU (quick sizes), and its refusals."""

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from adapt.cli import app
from adapt.targets.calibrate import Calibration, write_target
from adapt.targets.target import load_target


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "cpu-cal.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--target", "cpu", "--quick", "-o", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return path, json.loads(result.stdout)


def test_cpu_calibration_writes_a_loadable_target_with_measured_sources(cpu_run):
    path, out = cpu_run
    target = load_target(str(path))
    base = load_target("cpu")
    assert target.name == "cpu-calibrated" and target.devices_per_node == base.devices_per_node
    measured = set(target.calibration["measured"])
    assert {"memory_gib", "hbm_bandwidth_tbs", "peak_tflops.bf16", "peak_tflops.fp32"} <= measured
    for key in ("memory_gib", "hbm_bandwidth_tbs", "peak_tflops"):
        assert target.sources[key].startswith("measured 20"), target.sources[key]
        assert "CPU" in target.sources[key]
    for key in target.calibration["datasheet"]:
        assert target.sources[key].startswith("datasheet (cpu.yaml)")
    # the numbers in the YAML are the timed points' best, not the datasheet's
    best_read = max(p["tbs"] for p in target.calibration["points"]["read_bandwidth"])
    assert target.hbm_bandwidth == pytest.approx(best_read * 1e12, rel=1e-3)
    best_bf16 = max(p["tflops"] for p in target.calibration["points"]["matmul_bf16"])
    assert target.peak_flops["bf16"] == pytest.approx(best_bf16 * 1e12, rel=1e-3)
    assert out["target"]["name"] == "cpu-calibrated"


def test_cpu_refuses_gpu_only_parts_with_reasons(cpu_run):
    path, _ = cpu_run
    refused = load_target(str(path)).calibration["refused"]
    assert "fp8 matrix units" in refused["matmul fp8"]
    assert "NCCL" in refused["collectives"] and "inter-node links" in refused


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_gpu_target_on_a_cpu_machine_is_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "--target", "h200", "-o", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2
    assert "no CUDA device is visible" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.yaml").exists()


def test_measured_fields_replace_the_datasheet_ones(tmp_path):
    """A hand-made Calibration (no timing): the YAML keeps datasheet fields and swaps measured ones."""
    cal = Calibration(base=load_target("h200"), device="NVIDIA H200", date="2026-11-30", devices=2,
                      environment={"torch": "x"})
    cal.measured = {"hbm_bandwidth_tbs": 4.1, "peak_tflops.bf16": 780.0, "intra_node_bandwidth_gbs": 300.0}
    cal.sources = {k: f"measured 2026-11-30 on NVIDIA H200: {k}" for k in cal.measured}
    target = write_target(cal, tmp_path / "h200-cal.yaml")
    assert target.hbm_bandwidth == pytest.approx(4.1e12) and target.peak_flops["bf16"] == pytest.approx(780e12)
    assert target.peak_flops["fp8"] == load_target("h200").peak_flops["fp8"]
    assert target.intra_node_bandwidth == pytest.approx(300e9) and target.inter_node_bandwidth == pytest.approx(50e9)
    assert "measured" in target.sources["peak_tflops"] and "datasheet (h200.yaml): fp16, fp32" in \
        target.sources["peak_tflops"]
    data = yaml.safe_load((tmp_path / "h200-cal.yaml").read_text())
    assert "peak_tflops.fp8" in data["calibration"]["datasheet"]
    assert "inter_node_bandwidth_gbs" in data["calibration"]["datasheet"]


@pytest.mark.parametrize("target, words", [("gaudi3", "habana_frameworks"), ("ascend-910b", "torch_npu")])
def test_accelerators_without_a_torch_backend_here_are_refused_with_the_reason(tmp_path, target, words):
    result = CliRunner().invoke(app, ["calibrate", "--target", target, "-o", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
