"""The recorded prediction-vs-measurement table is what stage 4's cost model gives today on the recorded inputs."""

import importlib.util
import json
from pathlib import Path

import pytest

from adapt.plan.layout import load_model
from adapt.stages.parallel import moe_layer_cost
from adapt.targets.target import load_target

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "predict" / "predict_vs_measured.py"


def _module():
    spec = importlib.util.spec_from_file_location("predict_vs_measured", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recorded_table_matches_the_cost_model():
    module = _module()
    fresh = module.compare()
    recorded = json.loads((SCRIPT.parent / "predict_vs_measured.json").read_text())
    assert len(fresh["rows"]) == len(recorded["rows"]) == 17
    for new, old in zip(fresh["rows"], recorded["rows"], strict=True):
        assert (new["kernel"], new["shape"], new["variant"]) == (old["kernel"], old["shape"], old["variant"])
        assert new["ratio"] == pytest.approx(old["ratio"], rel=1e-9)
        assert new["within_25pct"] == (0.8 <= new["ratio"] <= 1.25)
    assert (SCRIPT.parent / "predict_vs_measured.md").read_text() == module.markdown(fresh)


def test_moe_prediction_counts_bytes_and_flops():
    spec, _ = load_model("deepseek-v3.2")
    target = load_target(str(ROOT / "benchmarks" / "calibrate" / "h200-x1.yaml"))
    one = moe_layer_cost(spec, target, tokens=1, weights="mxfp4-offline-fp8")
    expert = 3 * 7168 * 2048  # gate, up, down of one expert, fp8 bytes before scales
    assert 8 * expert < one.bytes < 8 * expert * 1.01 and one.flops == 2 * 8 * expert
    big = moe_layer_cost(spec, target, tokens=16384, weights="mxfp4-offline-fp8")
    assert big.compute_s > big.memory_s and big.dtype == "fp8"
    assert big.compute_s == pytest.approx(big.flops / target.peak_flops["fp8"])
