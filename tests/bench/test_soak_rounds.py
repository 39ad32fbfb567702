"""A timed soak fills its time in rounds: ``vllm bench serve`` takes a request count, and a count sized
from the sweep's rate ended a 60 s soak after 18.7 s once (the sweep point had run while the server
warmed up). The driver is run for real here, against a stand-in ``vllm`` package whose "load" lasts
10 ms per request, so the round sizes are exact; the merge is checked against hand-computed values."""

import json
import os
import sys

import pytest

from adapt.bench.loadgen import LoadPoint, request_samples, run_load, summarize_rounds
from adapt.report import load_gates, now_iso
from adapt.stages.serve import build_report

_FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/utils/__init__.py": "",
    # the stand-in reads the flags it needs and ignores the rest of vLLM's command line
    "vllm/utils/argparse_utils.py": """
import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        return self.parse_known_args(args, namespace)[0]
""",
    "vllm/benchmarks/__init__.py": "",
    "vllm/benchmarks/serve.py": '''
import json, os


def add_cli_args(parser):
    for flag in ("--num-prompts", "--seed", "--max-concurrency", "--random-output-len"):
        parser.add_argument(flag, type=int)
    for flag in ("--result-dir", "--result-filename"):
        parser.add_argument(flag)


def main(args):
    # every request: 10 ms of load, TTFT 1 ms + 1 ms per seed, output tokens = --random-output-len
    n, out = args.num_prompts, args.random_output_len
    ttft, latency = 0.001 * (1 + args.seed), 0.001 * (1 + args.seed) + 0.002 * (out - 1)
    result = {"duration": 0.01 * n, "completed": n, "failed": 0, "output_throughput": out / 0.01 if n else 0.0,
              "total_output_tokens": n * out, "output_lens": [out] * n, "ttfts": [ttft] * n,
              "itls": [[0.002] * (out - 1)] * n, "latencies": [latency] * n,
              "start_times": [100.0 + 0.01 * i for i in range(n)], "errors": [""] * n}
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(result, f)
''',
}


@pytest.fixture
def fake_vllm(tmp_path):
    """(vllm executable, result dir): a ``vllm`` beside this Python, the stand-in package importable from the
    result directory (the driver's working directory)."""
    results = tmp_path / "load"
    for name, text in _FAKE_VLLM.items():
        (results / name).parent.mkdir(parents=True, exist_ok=True)
        (results / name).write_text(text)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    (bindir / "vllm").write_text("#!/bin/sh\nexit 0\n")
    os.chmod(bindir / "vllm", 0o755)
    return str(bindir / "vllm"), results


def test_a_timed_point_runs_rounds_until_its_time_is_spent(fake_vllm):
    vllm, results = fake_vllm
    # first round 10 requests = 0.1 s; then the rest of 1.0 s at 100 req/s, 10 % over: ceil(99.0) = 99 requests
    timed = LoadPoint("soak", "mixed", 32, 4, concurrency=4, prompts=10, seed=1, min_duration_s=1.0, max_rounds=20)
    once = LoadPoint("once", "mixed", 32, 4, concurrency=4, prompts=10, seed=1)
    soak, single = run_load([timed, once], "http://127.0.0.1:1", "m", "tok", results, vllm=vllm)
    assert "error" not in soak, soak
    assert soak["rounds"] == 2 and soak["requested"] == soak["completed"] == 109
    assert soak["duration_s"] == pytest.approx(1.09) and soak["duration_s"] >= timed.min_duration_s
    assert sorted(p.name for p in results.glob("soak*.json")) == ["soak-r2.json", "soak.json"]
    # each round a new seed: TTFT 2 ms in round 1 (seed 1), 3 ms in round 2 (seed 2); p50 over all 109 requests
    assert soak["ttft_p50_ms"] == pytest.approx(3.0) and soak["ttft_p99_ms"] == pytest.approx(3.0)
    assert soak["tpot_p50_ms"] == pytest.approx(2.0) and soak["output_tokens_per_s"] == pytest.approx(400.0)
    assert single["rounds"] == 1 and single["requested"] == 10 and single["duration_s"] == pytest.approx(0.1)


def test_a_point_that_completes_nothing_stops_its_rounds(fake_vllm):
    vllm, results = fake_vllm
    # --num-prompts 0: no request, no load; the round loop must end rather than size rounds from nothing
    point = LoadPoint("soak", "mixed", 32, 4, concurrency=4, prompts=0, seed=1, min_duration_s=1.0, max_rounds=20)
    (soak,) = run_load([point], "http://127.0.0.1:1", "m", "tok", results, vllm=vllm)
    assert soak["rounds"] == 1 and soak["completed"] == 0


def _round(ttfts, latencies, output_lens, starts, duration):
    return {"completed": sum(1 for t in output_lens if t), "failed": sum(1 for t in output_lens if not t),
            "duration": duration, "output_throughput": sum(output_lens) / duration,
            "total_output_tokens": sum(output_lens), "output_lens": output_lens, "ttfts": ttfts,
            "itls": [[0.001] * max(0, t - 1) for t in output_lens], "latencies": latencies, "start_times": starts,
            "errors": ["" if t else "Internal Server Error" for t in output_lens], "p50_ttft_ms": -1.0}


def test_rounds_are_merged_over_every_request():
    a = _round([0.010, 0.020], [0.110, 0.020], [11, 1], [5.0, 5.5], 2.0)
    b = _round([0.030, 0.0], [0.230, 0.0], [21, 0], [9.0, 9.1], 3.0)   # the second request failed
    assert request_samples(b) == {"ttft": [0.030], "e2el": [0.230], "itl": [0.001] * 20,
                                  "tpot": [pytest.approx(0.01)]}
    out = summarize_rounds([(a, 2), (b, 2)])
    assert (out["requested"], out["completed"], out["failed"], out["rounds"]) == (4, 3, 1, 2)
    assert out["duration_s"] == 5.0 and out["output_tokens_per_s"] == pytest.approx(33 / 5.0)
    assert out["ttft_p50_ms"] == pytest.approx(20.0)                 # median of 10, 20, 30 ms; failures left out
    assert out["tpot_p50_ms"] == pytest.approx(10.0)                 # (110-10)/10 and (230-30)/20: both 10 ms
    # sorted 20, 110, 230 ms: p90 sits 0.8 of the way from the second to the third (numpy's linear rule)
    assert out["e2el_p90_ms"] == pytest.approx(1000 * (0.110 + 0.8 * (0.230 - 0.110)))
    assert out["load_window"] == (5.0, pytest.approx(9.23)) and out["errors"] == ["Internal Server Error"]
    # one round keeps vLLM's own numbers (here a marker value nothing could compute)
    assert summarize_rounds([(a, 2)])["ttft_p50_ms"] == -1.0


def _measured(duration_s, asked_s):
    soak = {"name": "soak", "argv": ["vllm", "bench", "serve"], "requested": 50, "completed": 50, "failed": 0,
            "duration_s": duration_s, "errors": [], "rounds": 20,
            "asked_s": asked_s, "length": "x"}
    return {"sweep": [], "soak": soak, "memory": None, "healthy_after": True}


@pytest.mark.parametrize("duration_s, asked_s, short", [(18.7, 60.0, True), (61.0, 60.0, False),
                                                        (3.0, None, False)])
def test_a_soak_shorter_than_asked_fails_the_gate(tmp_path, duration_s, asked_s, short):
    report = build_report(_measured(duration_s, asked_s), load_gates(), tmp_path, started=now_iso(), predicted=None,
                          inputs={})
    errors = {f.code for f in report.findings if f.severity == "error"}
    assert ("bench.soak.short" in errors) == short
    assert report.metrics["soak"]["asked_s"] == asked_s
    if short:
        assert report.decide() == "fail"
    json.dumps(report.metrics)
