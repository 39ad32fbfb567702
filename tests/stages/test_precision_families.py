"""Stage 5 and stage 6 for the families the decoder engine does not build (qwen3_next, llama4: adapt.runtime.families).

Stage 5 measures the logits-level and per-layer metrics of bf16 compute against the float32 reference,
reports what the family runtime cannot measure as "not measured here" warnings, and fails when an
expert's weights are scaled (ADAPT_TEST_FAULTS expert_scale). Stage 6 runs `adapt validate --stage 6
--url` for a qwen3_next model against the stand-in OpenAI server of tests/bench."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.model.tiny_hybrid import build_tiny_qwen3_next
from adapt.model.tiny_multimodal import build_tiny_llama4
from adapt.report import load_gates
from adapt.runtime.variants import Faults
from adapt.stages.precision import run_precision
from tests.bench.test_detectors import FAKE

BUILDERS = {"qwen3_next": build_tiny_qwen3_next, "llama4": build_tiny_llama4}
LOGIT_METRICS = ("kl_mean", "top1_agreement", "top5_overlap", "perplexity_reference", "perplexity_adapted",
                 "max_rel_error_layer", "greedy_min_matched")


# These models are random, not trained (adapt.model.tiny_hybrid / tiny_multimodal), so their greedy continuations
# rest on small logit margins, and whether bf16 compute flips one depends on the CPU's vector kernels. On an AVX2-only
# EPYC (2026-12-01), tiny qwen3_next's second prompt flips at its first token by 0.43 nats, above the 0.25-nat tie gap,
# where the AVX-512 machines before kept all 8 tokens. The greedy gate is covered on the trained tiny models
# (tests/stages/test_precision.py); here it is off, and the stage's other gates and warnings are what is checked.
NO_GREEDY_GATE = {"min_greedy_match_tokens": 0}


def _gates():
    gates = load_gates()
    gates["precision"]["greedy_tokens"] = 8
    gates["precision"].update(NO_GREEDY_GATE)
    return gates


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build(root / family) for family, build in BUILDERS.items()}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_bf16_compute_passes_and_unmeasured_groups_are_warnings(models, family, tmp_path):
    report = run_precision(str(models[family]), "cpu", gates=_gates(), report_dir=tmp_path, faults=Faults())
    errors = [f.message for f in report.findings if f.severity == "error"]
    assert not errors and report.decide() == "warn", errors
    m = report.metrics
    assert m["family"] == family and m["adapted"]["dtype"] == "bf16" and all(k in m for k in LOGIT_METRICS)
    assert 0 < m["kl_mean"] < 0.05 and m["top1_agreement"] > 0.9 and m["perplexity_adapted"] > 1
    layers = report.tables["per-layer hidden-state error"]
    assert [r["layer"] for r in layers] == list(range(4)) and all(0 < r["rel_error"] < 0.1 for r in layers)
    warned = {f.code for f in report.findings if f.severity == "warn"}
    assert {"not-measured-routing", "not-measured-experts", "not-measured-kernels"} <= warned
    assert all("not measured here" in f.message for f in report.findings if f.severity == "warn")
    assert ("not-measured-image-input" in warned) == (family == "llama4")
    assert (tmp_path / "precision_layers.png").stat().st_size > 1000


@pytest.mark.parametrize("family", list(BUILDERS))
def test_a_scaled_expert_fails(models, family):
    report = run_precision(str(models[family]), "cpu", gates=_gates(), faults=Faults.parse("expert_scale=1:0:3"))
    assert report.decide() == "fail"
    assert {"layer-error"} <= {f.code for f in report.findings if f.severity == "error"}
    assert report.metrics["injected_faults"].startswith("expert_scale=1:0:3")


def test_engine_faults_are_refused_for_these_families(models):
    with pytest.raises(InputError, match="decoder engine"):
        run_precision(str(models["qwen3_next"]), "cpu", gates=_gates(), faults=Faults.parse("kv_scale=1.5"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stage6_with_url_takes_a_qwen3_next_model(models, tmp_path, vllm_exe):
    from adapt.handoff.vllm import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port)])
    try:
        from adapt.bench.probes import healthy

        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 30
        while not healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.1)
        gates = tmp_path / "gates.yaml"
        gates.write_text("precision:\n" + "".join(f"  {k}: {v}\n" for k, v in NO_GREEDY_GATE.items()))
        out = tmp_path / "runs"
        result = CliRunner().invoke(app, ["validate", str(models["qwen3_next"]), "--stage", "6", "--target", "cpu",
                                          "--devices", "1", "--context", "256", "--url", url, "--soak-s", "1",
                                          "--gates", str(gates), "--output", str(out), "--json"],
                                    env={"ADAPT_TEST_FAULTS": ""})
    finally:
        proc.kill()
        proc.wait()
    assert result.exit_code in (0, 1), result.output  # a gate verdict, never refused input
    run = next(out.iterdir())
    verdicts = {name: json.loads((run / f"{name}.json").read_text())["verdict"]
                for name in ("inventory", "kernels", "memory", "parallel", "precision", "bench")}
    assert verdicts["precision"] == "warn" and all(v != "fail" for k, v in verdicts.items() if k != "bench")
    bench = json.loads((run / "bench.json").read_text())
    assert not [f for f in bench["findings"] if "architecture" in f["message"] or "family" in f["message"]]
