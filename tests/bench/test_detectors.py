"""Stage 6's detectors: a served process that leaks memory fails the leak gate, one that fails 5 %
of its requests fails the error gate (each is the other's control); the fits and summaries on
fixed inputs."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adapt.bench.loadgen import summarize, workload_points
from adapt.bench.probes import healthy
from adapt.bench.soak import growth_slope, judge_leak, process_tree, rss_bytes
from adapt.errors import InputError
from adapt.handoff.vllm import free_port
from adapt.model.tiny import build_tiny
from adapt.report import load_gates, now_iso
from adapt.stages.serve import Endpoint, ServeOptions, build_report, measure_endpoint, prediction_rows

FAKE = Path(__file__).with_name("fake_openai_server.py")


def test_growth_slope_is_least_squares():
    assert growth_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert growth_slope([0, 1, 2], [5, 5, 5]) == 0.0
    assert growth_slope([1.0], [3.0]) == 0.0


def test_process_tree_finds_children_and_their_memory(tmp_path):
    ready = tmp_path / "ready"
    child = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        assert rss_bytes(tree) > rss_bytes(tree[:1]) > 0
    finally:
        for pid in reversed(process_tree(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_judge_leak_uses_the_load_window_after_warmup():
    mib = 2**20
    # flat before the load, +60 MiB/min (1 MiB/s) while it runs
    samples = [(float(t), 100 * mib, None) for t in range(10)]
    samples += [(float(t), 100 * mib + (t - 10) * mib, None) for t in range(10, 41)]
    judged = judge_leak(samples, max_slope_mib_per_min=30, load_window=(10.0, 40.0))
    assert judged.rss_slope_mib_per_min == pytest.approx(60.0)
    assert judged.leak and judged.samples == 23
    assert not judge_leak(samples, max_slope_mib_per_min=90, load_window=(10.0, 40.0)).leak
    flat = [(float(t), 100 * mib, 5 * mib) for t in range(30)]
    assert not judge_leak(flat, max_slope_mib_per_min=1).leak
    gpu = [(float(t), 100 * mib, t * mib) for t in range(30)]
    assert judge_leak(gpu, max_slope_mib_per_min=30).leak


def test_summarize_counts_failures_and_window():
    result = {"completed": 19, "failed": 1, "output_throughput": 10.0, "duration": 2.0, "p50_ttft_ms": 3.0,
              "start_times": [5.0, 6.0], "latencies": [0.5, 2.0], "errors": ["", "Internal Server Error"]}
    out = summarize(result, 20)
    assert out["success_rate"] == 0.95 and out["failed"] == 1
    assert out["load_window"] == (5.0, 8.0) and out["ttft_p50_ms"] == 3.0 and out["tpot_p99_ms"] is None
    assert out["errors"] == ["Internal Server Error"]


def test_workloads_and_prediction_ratios():
    points = workload_points(256, 64, [1, 4], 8)
    assert [(p.workload, p.input_len, p.output_len, p.concurrency) for p in points[:3:2]] == [
        ("long-in/short-out", 256, 8, 1), ("short-in/long-out", 32, 64, 1)]
    sweep = [{"workload": "short-in/long-out", "concurrency": c, "tpot_p50_ms": t, "e2el_p50_ms": 64 * t,
              "output_len": 64} for c, t in ((1, 2.0), (4, 3.0))]
    sweep.append({"workload": "long-in/short-out", "concurrency": 1, "ttft_p50_ms": 40.0, "input_len": 256})
    predicted = {"batch": 4, "decode_step_s": 0.0015, "prefill_chunk_s": 0.16, "prefill_chunk_tokens": 2048}
    rows = prediction_rows(predicted, sweep)
    assert rows[0]["ratio"] == pytest.approx(2.0) and "concurrency 4" in rows[0]["measured_as"]
    assert rows[0]["measured_ms"] == pytest.approx(3.0)
    assert rows[1]["predicted_ms"] == pytest.approx(20.0) and rows[1]["ratio"] == pytest.approx(2.0)


@pytest.mark.parametrize("tpot_ms, warns", [(3.0, False), (30.0, True), (0.2, True)])
def test_a_prediction_far_off_the_measurement_warns(tmp_path, tpot_ms, warns):
    """Measured / predicted beyond bench.max_prediction_ratio (3x) either way is a warning naming the quantity;
    within it, an info line."""
    row = {f"{m}_p{q}_ms": 1.0 for m in ("ttft", "tpot", "itl", "e2el") for q in (50, 90, 99)}
    sweep = [{**row, "name": "s", "workload": "short-in/long-out", "concurrency": 4, "tpot_p50_ms": tpot_ms,
              "e2el_p50_ms": 64 * tpot_ms, "output_len": 64, "output_tokens_per_s": 1.0, "success_rate": 1.0,
              "argv": []}]
    predicted = {"batch": 4, "decode_step_s": 0.0015, "prefill_chunk_s": 0.16, "prefill_chunk_tokens": 2048}
    measured = {"sweep": sweep, "soak": None, "memory": None, "healthy_after": True}
    report = build_report(measured, load_gates(), tmp_path, started=now_iso(), predicted=predicted, inputs={})
    off = [f for f in report.findings if f.code == "bench.prediction.off"]
    assert [f.severity for f in off] == (["warn"] if warns else [])
    assert all("decode step (batch 4)" in f.message for f in off)


def test_bad_options_are_input_errors():
    with pytest.raises(InputError, match="--concurrency"):
        ServeOptions(concurrencies=[0]).check()
    with pytest.raises(InputError, match="--soak-s"):
        ServeOptions(soak_s=-1).check()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, vllm_exe):
    return build_tiny("tiny-qwen3", tmp_path_factory.mktemp("tok") / "tiny-qwen3")


def soak_fake(tmp_path, tokenizer, *fault):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), *fault])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.1)
        options = ServeOptions(input_len=32, output_len=16, soak_s=None, soak_requests=400, soak_concurrency=4,
                               sample_interval_s=0.2, sweep=False, probes=False)
        endpoint = Endpoint(url, "fake", str(tokenizer), proc.pid, 2048)
        measured = measure_endpoint(endpoint, options, load_gates(), tmp_path)
    finally:
        proc.kill()
        proc.wait()
    report = build_report(measured, load_gates(), tmp_path, started=now_iso(), predicted=None, inputs={})
    return report, {f.code for f in report.findings if f.severity == "error"}


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault, gate", [(("--leak-kib", "2048"), "bench.leak"),
                                         (("--fail-every", "20"), "bench.errors")])
def test_faulty_server_fails_its_gate_only(tmp_path, tokenizer, fault, gate):
    """A server that keeps 2 MiB per request fails the leak gate; one that fails every 20th request
    (5 %) fails the error gate; each passes the other's gate."""
    report, errors = soak_fake(tmp_path, tokenizer, *fault)
    print(report.metrics["leak"], report.metrics["soak"])
    assert errors == {gate} and report.decide() == "fail"
    leak, soak = report.metrics["leak"], report.metrics["soak"]
    if gate == "bench.leak":
        assert leak["rss_slope_mib_per_min"] > load_gates()["bench"]["max_rss_slope_mib_per_min"]
        assert soak["failed"] == 0
    else:
        assert soak["failed"] == 20 and soak["completed"] == 380 and not leak["leak"]


def test_stage6_is_a_gate_stage_reading_its_options(monkeypatch, tmp_path):
    from adapt.report import StageReport
    from adapt.stages import pipeline, serve

    seen = {}

    def fake_stage(model, **kwargs):
        seen.update(kwargs, model=model)
        return StageReport("bench", 6, "stand-in")

    monkeypatch.setattr(serve, "run_serve_stage", fake_stage)
    stage = pipeline.STAGES[6]
    assert stage.name == "bench" and stage.gates == ("bench",)
    assert set(stage.reads) == {"url", "served_model", "soak_s", "tokenizer"}
    options = pipeline.PipelineOptions("m", "cpu", run_path=str(tmp_path), url="http://127.0.0.1:1", soak_s=5.0,
                                       tokenizer="org/tok", served_model="served-name")
    stage.run(options, {"bench": {}})
    assert seen["model"] == "m" and seen["url"] == "http://127.0.0.1:1" and seen["run_path"] == tmp_path
    assert seen["tokenizer"] == "org/tok"
    assert seen["options"].soak_s == 5.0 and seen["served_model"] == "served-name"
