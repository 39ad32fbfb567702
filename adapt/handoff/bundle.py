"""Deployment bundle: what a serving team needs to start the validated model under vLLM.

``write_bundle`` checks the run's gates, takes the engine arguments from the stage-4 plan and
writes ``reports/<run>/handoff/``:

  engine_args.json   model path, engine arguments, nodes, devices, target, where they came from
  serve.sh           the ``vllm serve`` command (single node) or the head node's command
  ray.sh             several nodes only: the Ray bring-up and per-node commands, in order
  preflight.json     the environment checks of the run's preflight report (when it ran)
  README.md          what was validated, what was not, and how the bundle was made

plus ``handoff.{json,md,junit.xml}`` and a manifest entry through ``RunDir.write``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from adapt.errors import InputError
from adapt.plan.launch import multi_node_args, ray_steps, serve_command, shell_script
from adapt.report import UNMEASURED, RunDir, StageReport, checkpoint_data_digest, fingerprint, markdown_table

STAGE_NUMBER = 0  # the schema numbers gate stages 1-6; 0 marks reports outside that sequence
REQUIRED_STAGES = ("inventory", "memory", "kernels", "parallel")
LATER_STAGES = ("precision", "bench")  # optional for the hand-off; one that ran in the run must not have failed
STAGE_OF = {"inventory": 1, "memory": 2, "kernels": 3, "parallel": 4, "precision": 5, "bench": 6}
BUNDLE_DIR = "handoff"


def gate_verdicts(run: RunDir) -> dict[str, str | None]:
    """Recorded verdict of every stage the hand-off needs (None: not run in this run directory)."""
    return {stage: run.verdict_of(stage) for stage in REQUIRED_STAGES}


def provenance_mismatch(run: RunDir, *, model: str, target: str, devices: int, nodes: int) -> str | None:
    """Why the run's stage reports were not made for this hand-off, or None when they were.

    Each stage report's fingerprint (stages 1-4, and 5-6 when they carry one) must name this
    model (config and checkpoint digests), this target profile, this adapt version and this adapt code
    (``code``: "written by other adapt code (digest X, now Y)" otherwise); stages
    that read ``devices``/``nodes`` must have planned for these; and the stages must agree with
    each other on every option they share (stage 2's context, batch, KV dtype and weights are
    stage 4's). A stage that ran the weights (5, 6) must have run these very files
    (``checkpoint_data``), and stage 6 must have served the plan stage 4's report holds now
    (``options.plan``). The answer names the stage and the field that differs.
    """
    from adapt.stages.pipeline import (
        PipelineOptions,
        fingerprint_mismatch,
        plan_digest,
        stage_fingerprint,
    )

    expected = stage_fingerprint(1, PipelineOptions(model=model, target=target, devices=devices, nodes=nodes), {})
    shared_fields = ("model", "checkpoint", "target", "adapt_version", "code")
    seen_options: dict[str, tuple[str, object]] = {}
    seen_stack: tuple[str, object] | None = None
    data_digest: dict[str, str | None] | None = None  # computed once, when a stage 5/6 report needs it
    for stage in REQUIRED_STAGES + LATER_STAGES:
        data = run.stage_report(stage)
        if data is None:
            continue
        recorded = data.get("fingerprint") or {}
        if stage == "bench" and untied(recorded):
            continue  # `bench serve --url` not shown to serve this checkpoint: check_gates refuses it unless forced
        if "options" not in recorded:
            return f"{stage}: its report has no provenance fingerprint (made by an older adapt); run it again"
        differs = fingerprint_mismatch(recorded, expected, shared_fields)
        if differs:
            return f"{stage}: {differs}"
        if recorded.get("env"):  # made with test hooks (injected faults) set: evidence about them, not the model
            return f"{stage}: env: recorded {json.dumps(recorded['env'])}, now {{}}"
        if stage in LATER_STAGES and "checkpoint_data" not in recorded:
            return f"{stage}: its fingerprint does not cover the weights it ran (made by an older adapt); run it again"
        if recorded.get("checkpoint_data") is not None:
            data_digest = data_digest or {"checkpoint_data": checkpoint_data_digest(model)}
            differs = fingerprint_mismatch(recorded, data_digest, ("checkpoint_data",))
            if differs:
                return f"{stage}: {differs}"
        if stage == "bench" and not isinstance(recorded.get("engine"), dict):
            return f"{stage}: its fingerprint does not name the serving engine (made by an older adapt); run it again"
        if isinstance(recorded.get("engine"), dict):
            differs = _engine_mismatch(recorded["engine"], run)
            if differs:
                return f"{stage}: {differs}; run stage {STAGE_OF[stage]} again"
        options = recorded["options"]
        if "plan" in options and options["plan"] != plan_digest(run.path):
            return (f"{stage}: options.plan: it served stage 4's plan {options['plan']}, and the run's parallel.json "
                    f"now holds {plan_digest(run.path)}; run stage {STAGE_OF[stage]} again")
        for key, want in (("devices", devices), ("nodes", nodes)):
            if key in options and options[key] != want:
                return f"{stage}: options.{key}: recorded {options[key]!r}, now {want!r}"
        for key, value in options.items():
            if key in seen_options and seen_options[key][1] != value:
                other, was = seen_options[key]
                return f"{stage}: options.{key} is {value!r} but {other} planned with {was!r}"
            if key != "plan":
                seen_options.setdefault(key, (stage, value))
        if seen_stack is not None and recorded.get("stack") != seen_stack[1]:
            return f"{stage}: stack {recorded.get('stack')} differs from {seen_stack[0]}'s {seen_stack[1]}"
        seen_stack = seen_stack or (stage, recorded.get("stack"))
    return None


def untied(recorded: dict[str, Any]) -> bool:
    """Whether a stage-6 fingerprint is not the pipeline's: ``adapt bench serve --url`` whose identity check did not
    show that the endpoint serves the checkpoint keeps only its own inputs (no ``checkpoint`` digest)."""
    return "checkpoint" not in recorded


UNTIED = ("not tied to this checkpoint: `adapt bench serve --url` measured whatever answered there, its identity "
          "check did not show this checkpoint (run it with --checkpoint DIR, or `adapt validate --stage 6 --url`)")


def stage6_engine(run: RunDir) -> dict[str, Any] | None:
    """The serving engine the run's stage-6 report measured with (its fingerprint's ``engine``), or None."""
    engine = ((run.stage_report("bench") or {}).get("fingerprint") or {}).get("engine")
    return engine if isinstance(engine, dict) else None


def engine_not_compared(run: RunDir) -> str | None:
    """The sentence saying that the stage-6 engine was not compared with this machine's (``_engine_mismatch``
    has nothing to compare with where no vLLM is installed), or None when it was or there is none."""
    from adapt.handoff.vllm import installed_version

    engine = stage6_engine(run)
    if engine is None or installed_version() is not None:
        return None
    return (f"serving engine not compared: no vLLM here (stage 6 measured with vLLM {engine.get('version') or '?'}, "
            f"launch {json.dumps(engine.get('launch'))})")


def _engine_mismatch(recorded: dict[str, Any], run: RunDir) -> str | None:
    """How the serving engine a stage-6 report measured with (its fingerprint's ``engine``) differs from this
    machine's now: the serve environment's vLLM version (when both are known) and, for a stage 6 that adapt
    launched, the engine arguments it would launch the run's plan with now; None when they agree, or when this
    machine has no vLLM (nothing here to compare with: ``engine_not_compared`` says so in the bundle)."""
    from adapt.stages.serve import serving_engine

    now = serving_engine(run.path, None)
    if now["version"] is None:
        return None
    if recorded.get("version") and recorded["version"] != now["version"]:
        return (f"engine.version: recorded {recorded['version']!r}, now {now['version']!r} (the serve environment's "
                "vLLM)")
    if recorded.get("launch") is not None and recorded["launch"] != now["launch"]:
        return f"engine.launch: recorded {json.dumps(recorded['launch'])}, now {json.dumps(now['launch'])}"
    return None


def carried_warnings(run: RunDir) -> dict[str, list[str]]:
    """Stage -> "code: message" of every warning in a stage report of the run (stages 1-6) that passed
    with warnings: WARN passes the chain, so the hand-off states what was warned about."""
    out = {}
    for stage in REQUIRED_STAGES + LATER_STAGES:
        data = run.stage_report(stage)
        if data and data["verdict"] == "warn":
            out[stage] = [f"{f.get('code')}: {f.get('message')}" for f in data.get("findings") or []
                          if isinstance(f, dict) and f.get("severity") == "warn"]
    return out


def non_default_gates(run: RunDir) -> list[str]:
    """Stages of the run whose recorded gates digest is not that of adapt's default gates (a ``--gates``
    file changed a threshold they read), in stage order."""
    from adapt.report import digest, load_gates
    from adapt.stages.pipeline import STAGES

    defaults = load_gates()
    out = []
    for _, stage in sorted(STAGES.items()):
        data = run.stage_report(stage.name)
        recorded = (data or {}).get("fingerprint") or {}
        if "gates" in recorded and recorded["gates"] != digest({s: defaults.get(s) for s in stage.gates}):
            out.append(stage.name)
    return out


def check_gates(run: RunDir, *, model: str, target: str, devices: int, nodes: int, force: bool) -> list[str]:
    """Refuse (InputError) unless stages 1-4 passed or warned in ``run`` for this model, target,
    devices and nodes, and stages 5-6, where they ran, did not fail; with ``force``, return the list of
    gates that had not passed instead (recorded in the bundle). A provenance mismatch is refused even with ``force``."""
    differs = provenance_mismatch(run, model=model, target=target, devices=devices, nodes=nodes)
    if differs:
        raise InputError(f"hand-off refused: the run's reports were made for other inputs ({differs})",
                         file=run.path, hint="validate this model, target and device count in a new --run")
    problems = []
    if run.stage_report("bench") is not None and untied(run.stage_report("bench").get("fingerprint") or {}):
        problems.append(f"bench: {UNTIED}")
    for stage, verdict in gate_verdicts(run).items():
        if verdict is None:
            problems.append(f"{stage}: not run")
        elif verdict == UNMEASURED:
            problems.append(_unmeasured(run, stage))
        elif verdict not in ("pass", "warn"):
            problems.append(f"{stage}: {verdict}")
    for stage in LATER_STAGES:
        verdict = run.verdict_of(stage)
        if verdict == UNMEASURED:
            problems.append(_unmeasured(run, stage))
        elif verdict == "fail":
            problems.append(f"{stage}: fail")
    if problems and not force:
        last = max(STAGE_OF[p.split(":")[0]] for p in problems)
        command = (f"adapt validate {shlex.quote(model)} --stage {max(last, 4)} --target {shlex.quote(target)} "
                   f"--devices {devices} --nodes {nodes} --run {run.run_id} "
                   f"--output {shlex.quote(str(run.path.parent))}")
        raise InputError(f"hand-off refused: gates up to stage {max(last, 4)} have not passed in {run.path} ("
                         + "; ".join(problems) + ")", hint=f"run `{command}`, or pass --force (recorded)")
    return problems


def _unmeasured(run: RunDir, stage: str) -> str:
    """"<stage>: unmeasured (what was not measured; how to measure it)" from the stage's ``unmeasured`` findings."""
    findings = [f for f in run.stage_report(stage).get("findings") or []
                if isinstance(f, dict) and f.get("code") == UNMEASURED]
    said = "; ".join(f"{f.get('message')}; {f.get('hint')}" for f in findings) or "nothing was measured"
    return f"{stage}: unmeasured ({said})"


def plan_engine_args(run: RunDir, *, devices: int, nodes: int, forced: bool) -> tuple[dict[str, Any], str]:
    """Engine arguments from the run's stage-4 report (``parallel.json`` metrics ``engine_args``).

    Returns (engine_args, source). Without a stage-4 report (only reachable with ``--force``), the
    arguments are tensor parallel over each node's devices and pipeline parallel over nodes.
    The plan's world size (tensor x pipeline x data) must equal ``devices`` (devices in total).
    """
    path = run.path / "parallel.json"
    if path.is_file():
        try:
            metrics = json.loads(path.read_text()).get("metrics", {})
        except json.JSONDecodeError:
            raise InputError("stage-4 report is not valid JSON", file=path) from None
        engine_args = metrics.get("engine_args")
        if not isinstance(engine_args, dict) or not engine_args:
            raise InputError("stage-4 report has no engine_args in its metrics", file=path,
                             hint="re-run stage 4 with this adapt version")
        engine_args = {**engine_args, **(metrics.get("extra_engine_args") or {})}
        source = f"stage-4 plan ({path.name})"
    elif forced:
        if devices % nodes:
            raise InputError(f"{devices} devices do not split evenly over {nodes} nodes", field="--devices")
        engine_args = {"tensor_parallel_size": devices // nodes, "pipeline_parallel_size": nodes}
        source = "no stage-4 plan (forced): tensor parallel within a node, pipeline parallel across nodes"
    else:
        raise InputError("no stage-4 report in the run directory", file=path)
    world = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        world *= int(engine_args.get(key) or 1)
    if world != devices:
        raise InputError(f"the plan uses {world} devices but --devices is {devices}", field="--devices",
                         hint="pass the device count the stage-4 plan was made for, or re-plan")
    return dict(engine_args), source


def planned_weights(run: RunDir) -> str:
    """The ``--weights`` format the run's stage-4 plan assumed ("as-stored" without a plan)."""
    data = run.stage_report("parallel")
    if data is None:
        return "as-stored"
    options = data["fingerprint"].get("options") or {}
    return str(options.get("weights") or (data["fingerprint"].get("stage_inputs") or {}).get("weights")
               or "as-stored")


def weights_for_vllm(model: str, weights: str) -> tuple[dict[str, Any], str]:
    """vLLM quantization engine arguments for the plan's weight format and a sentence on how, or an
    InputError saying why vLLM cannot hold the weights as planned (``adapt.handoff.vllm.vllm_quantization``)."""
    from adapt.handoff.vllm import vllm_quantization
    from adapt.model.spec import load_spec

    if weights == "as-stored":  # nothing to convert: no need to read the spec (the model may be one adapt only serves)
        return {}, "as stored; vLLM reads the checkpoint's own format"
    spec = load_spec(model)
    experts = spec.quant.format_of("routed_experts").method
    experts = "fp8" if experts.startswith("fp8") else experts
    try:
        return vllm_quantization(spec.quant.source, experts, weights)
    except InputError as exc:
        raise InputError(f"hand-off refused: {exc.message}", field=exc.field, hint=exc.hint) from None


def model_reference(model: str) -> str:
    """The path ``vllm serve`` gets: an existing directory as an absolute path, else the name as given."""
    path = Path(model)
    if path.is_dir():
        return str(path.resolve())
    if path.name == "config.json" and path.is_file():
        return str(path.parent.resolve())
    return model


def write_bundle(model: str, *, target: str, devices: int, nodes: int, run: RunDir, force: bool = False,
                 export_note: str | None = None,
                 served_model: str | None = None) -> tuple[StageReport, dict[str, str]]:
    """Check gates and compose the bundle: returns the hand-off report and the bundle's files
    (run-relative name -> text); ``RunDir.write(report, extra=files)`` writes both.

    export_note: a sentence about a converted checkpoint the bundle serves instead of ``model``
    (e.g. experts dequantized for the CPU backend); served_model: that checkpoint's path.
    """
    from adapt.targets.target import load_target

    resolved_target = load_target(target)
    if devices < 1 or nodes < 1:
        raise InputError("--devices and --nodes must be positive", field="--devices")
    overridden = check_gates(run, model=model, target=target, devices=devices, nodes=nodes, force=force)
    engine_args, source = plan_engine_args(run, devices=devices, nodes=nodes, forced=force)
    weights = planned_weights(run)
    quantization, how = weights_for_vllm(model, weights)
    engine_args.update(quantization)
    model_path = served_model or model_reference(model)
    args = multi_node_args(engine_args, nodes)
    argv = serve_command(model_path, args)
    steps = ray_steps(model_path, engine_args, nodes)

    from adapt.handoff.vllm import installed_version

    vllm_version = installed_version()
    report = StageReport("handoff", STAGE_NUMBER, "Hand-off to vLLM",
                         fingerprint=fingerprint(model=model, target=resolved_target.name, devices=devices,
                                                 nodes=nodes, engine={"name": "vllm", "version": vllm_version,
                                                                      "serve_command": argv}))
    report.metrics.update({"engine_args": args, "serve_command": argv, "ray_steps": steps, "nodes": nodes,
                           "devices": devices, "forced": bool(force and overridden),
                           "overridden_gates": overridden, "engine_args_source": source,
                           "weights": {"plan": weights, "vllm": how, "engine_args": quantization},
                           "warnings": carried_warnings(run), "non_default_gates": non_default_gates(run)})
    if not Path(model_path).is_dir():
        report.add("info", "model-name",
                   f"'{model_path}' is not a directory here: the serve command names it as given",
                   hint="replace it with the checkpoint directory or hub id on the serving machine")
    not_compared = engine_not_compared(run)
    if not_compared:
        report.add("info", "engine-not-compared", not_compared,
                   hint="run `adapt handoff` where the serving vLLM is installed, or compare engine_args.json's "
                        "stage6_engine on the serving machine")
    if overridden:
        report.add("warn", "forced",
                   "hand-off forced past gates that had not passed: " + "; ".join(overridden))
    verdicts = gate_verdicts(run)
    preflight, foreign = _preflight_checks(run, model, resolved_target.name)
    files = {
        f"{BUNDLE_DIR}/engine_args.json": json.dumps({
            "model": model_path, "source_model": model, "target": resolved_target.name, "devices": devices,
            "nodes": nodes, "engine_args": args, "engine_args_source": source, "vllm_version": vllm_version,
            "stage6_engine": stage6_engine(run),
            "weights_format": {"plan": weights, "vllm": how}, "forced": bool(overridden),
            "overridden_gates": overridden, "export_note": export_note}, indent=2) + "\n",
        f"{BUNDLE_DIR}/serve.sh": "#!/bin/sh\n# vllm serve for "
        + (f"the head node of a {nodes}-node Ray cluster (see ray.sh)" if nodes > 1 else "one node")
        + "\nexec " + shlex.join(argv) + "\n",
        f"{BUNDLE_DIR}/README.md": _readme(model, model_path, resolved_target.name, devices, nodes, verdicts,
                                          source, overridden, preflight, export_note, run,
                                          report.metrics["weights"], foreign, not_compared),
    }
    if steps:
        files[f"{BUNDLE_DIR}/ray.sh"] = shell_script(
            steps, f"Ray bring-up for vLLM over {nodes} nodes; run each line where its comment says, in order.")
    if preflight is not None:
        files[f"{BUNDLE_DIR}/preflight.json"] = json.dumps(preflight, indent=2) + "\n"
    else:
        report.add("info", "no-preflight", foreign or "the run has no preflight report; the bundle lists no "
                   "environment checks", hint="run `adapt preflight` for this model and target in this run directory")
    report.metrics["bundle_files"] = sorted(files)
    if export_note:
        report.add("warn", "dequantized-export", export_note)
    report.summary = (f"vLLM bundle for {model} on {devices} x {resolved_target.name}"
                      + (f" over {nodes} nodes" if nodes > 1 else "") + f" in {run.path / BUNDLE_DIR}")
    report.tables["gates"] = [{"stage": s, "verdict": v or "not run"} for s, v in verdicts.items()]
    return report, files


def _preflight_checks(run: RunDir, model: str, target: str) -> tuple[dict[str, Any] | None, str | None]:
    """The run's preflight report (``preflight.json``): its verdict, findings and tables, or None; and,
    when the report was made for another target or model, for no model, or by other adapt code (its
    fingerprint), None with the reason."""
    from adapt.stages.pipeline import code_digest, code_mismatch

    path = run.path / "preflight.json"
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise InputError("preflight report is not valid JSON", file=path) from None
    made = (data.get("fingerprint") or {}) if isinstance(data, dict) else {}
    if made.get("model") is None:
        return None, ("preflight.json in the run names no model (`adapt preflight` without one checks the "
                      "environment for no model), not this hand-off's: not included")
    if made.get("target") != target or made.get("model") != model:
        return None, (f"preflight.json in the run was made for target {made.get('target')} and model "
                      f"{made.get('model')}, not for this hand-off: not included")
    if made.get("code") != code_digest():
        return None, f"preflight.json in the run was {code_mismatch(made.get('code'), code_digest())}: not included"
    return {key: data.get(key) for key in ("verdict", "summary", "metrics", "findings", "tables", "finished")}, None


def _scope(recorded: dict[str, Any]) -> str:
    """What narrows a stage 5/6 verdict, for the bundle's table: no pipeline fingerprint (``bench serve
    --url``), reduced depth (``--layers``), adapt's kernels left out, another server (``--url``)."""
    if untied(recorded):
        return " (forced: not tied to this checkpoint; `bench serve --url` measured whatever answered)"
    options = recorded["options"]
    notes = []
    if options.get("layers"):
        notes.append(f"layers {options['layers']} only")
    if options.get("kernels") not in (None, "all"):
        notes.append(f"kernels {options['kernels']}")
    if options.get("url"):
        notes.append(f"server at {options['url']}")
    return f" ({'; '.join(notes)})" if notes else ""


def _readme(model: str, model_path: str, target: str, devices: int, nodes: int,
            verdicts: dict[str, str | None],
            source: str, overridden: list[str], preflight: dict[str, Any] | None, export_note: str | None,
            run: RunDir, weights: dict[str, Any], foreign_preflight: str | None = None,
            not_compared: str | None = None) -> str:
    manifest = run.manifest()["stages"]
    lines = [f"# vLLM hand-off: {model}", "",
             f"Target: {devices} x {target}" + (f" over {nodes} nodes (Ray)" if nodes > 1 else "") + ".",
             f"Model path served: `{model_path}`.", f"Engine arguments: {source}.",
             f"Weights: {weights['plan']} in the plan; vLLM holds them {weights['vllm']}.", ""]
    if export_note:
        lines += [f"Checkpoint: {export_note}", ""]
    lines += ["## Validated", ""]
    rows = [{"stage": s, "verdict": v or "not run", "finished": manifest.get(s, {}).get("finished", "-")}
            for s, v in verdicts.items()]
    rows += [{"stage": s, "verdict": manifest[s]["verdict"] + _scope(manifest[s].get("fingerprint") or {}),
              "finished": manifest[s].get("finished", "-")} for s in LATER_STAGES if s in manifest]
    lines += markdown_table(rows) + [""]
    loosened = non_default_gates(run)
    if loosened:
        lines += ["Judged under a `--gates` file, not adapt's default gates: " + ", ".join(loosened)
                  + " (each report's `fingerprint.gates`; compare the thresholds with adapt/gates.yaml).", ""]
    warned = carried_warnings(run)
    if warned:
        lines += ["## Warnings", "", "WARN passes a gate; these are what the passing stages warned about "
                  "(a \"not measured\" warning means that part was not checked):", ""]
        lines += [f"- {stage}: {item}" for stage, items in warned.items() for item in items] + [""]
    if overridden:
        lines += ["**Forced:** the hand-off was made with `--force` past: " + "; ".join(overridden) + ".", ""]
    lines += ["## Not validated", ""]
    later = [s for s in LATER_STAGES if s not in manifest]
    if later:
        lines.append(f"- stages not run in this run directory: {', '.join(later)}")
    lines.append("- the engine arguments are checked by vLLM's own parser only when `adapt handoff "
                 "--validate` or `--launch` ran; the smoke-test result, if any, is in smoke.json")
    if not_compared:
        lines.append(f"- {not_compared}: compare it with the serving machine's vLLM (engine_args.json, stage6_engine)")
    if nodes > 1:
        lines.append("- the Ray bring-up (ray.sh) follows vLLM's multi-node guide; adapt has not run it")
    if preflight is None:
        lines.append(f"- {foreign_preflight or 'no preflight report'}: driver, library and interconnect checks "
                     "were not recorded")
    else:
        lines.append(f"- preflight verdict: {preflight.get('verdict')} (preflight.json)")
    start = "sh serve.sh" if nodes == 1 else "# run ray.sh's lines first; then on the head node: sh serve.sh"
    lines += ["", "## Start", "", "```sh", start, "```", ""]
    return "\n".join(lines)


def run_handoff(model: str, *, target: str, devices: int, nodes: int, run: RunDir, gates: dict[str, Any],
                force: bool = False, validate: bool = False, launch: bool = False, vllm: str | None = None,
                port: int | None = None, max_tokens: int = 16, dtype: str = "float32",
                memory_fraction: float = 0.1, health_timeout_s: float = 600.0
                ) -> tuple[StageReport, dict[str, str], list[str]]:
    """The ``adapt handoff`` command: bundle, then optionally vLLM's parser check and a local launch.

    Returns (report, bundle files for ``RunDir.write``, the server's last log lines if it failed).
    """
    from adapt.targets.target import load_target

    export_note = served = None
    source_dir = Path(model_reference(model))
    if needs_dequantized_experts(source_dir, load_target(target).compute_capability):
        check_gates(run, model=model, target=target, devices=devices, nodes=nodes, force=force)
        served = str(export_dequantized(source_dir, run.path / BUNDLE_DIR / "model-bf16"))
        export_note = (f"`{served}` is {source_dir} with its MXFP4 experts dequantized to bf16 by "
                       "transformers (vLLM's CPU MoE cannot run MXFP4 without AMX); it is not the stored "
                       "checkpoint.")
    report, files = write_bundle(model, target=target, devices=devices, nodes=nodes, run=run, force=force,
                                 export_note=export_note, served_model=served)
    argv = report.metrics["serve_command"]
    if validate:
        from adapt.handoff.vllm import validate_with_vllm

        (checked,) = validate_with_vllm([argv], vllm)
        report.metrics["vllm_parser"] = "accepted" if checked["ok"] else checked["error"]
        if checked["ok"]:
            report.add("info", "vllm-parser", "vLLM's own argument parser accepts the serve command")
        else:
            report.add("error", "vllm-parser", f"vLLM rejects the serve command: {checked['error']}")
    log_tail: list[str] = []
    if launch:
        from adapt.handoff.smoke import launch_and_compare

        smoke = launch_and_compare(served or model_reference(model), report.metrics["engine_args"], vllm=vllm,
                                   log_path=run.path / BUNDLE_DIR / "server.log", gates=gates["handoff"],
                                   port=port, max_tokens=max_tokens, dtype=dtype,
                                   memory_fraction=memory_fraction, health_timeout_s=health_timeout_s)
        for severity, code, message in smoke.findings:
            report.add(severity, code, message)
        report.metrics["smoke"] = smoke.metrics
        report.tables.update(smoke.tables)
        log_tail = smoke.log_tail
        files[f"{BUNDLE_DIR}/smoke.json"] = json.dumps({"metrics": smoke.metrics, "findings": smoke.findings,
                                                        "log_tail": log_tail}, indent=2, default=str) + "\n"
    files[f"{BUNDLE_DIR}/README.md"] += _checks_section(report, validate, launch)
    report.decide()
    return report, files, log_tail


def _checks_section(report: StageReport, validate: bool, launch: bool) -> str:
    """README lines for what this hand-off checked with vLLM itself."""
    lines = ["", "## vLLM checks in this hand-off", ""]
    if validate:
        lines.append(f"- vLLM's argument parser on serve.sh: {report.metrics['vllm_parser']}")
    if launch:
        smoke = report.metrics.get("smoke", {})
        rows = smoke.get("vllm_vs_transformers")
        if rows:
            diverged = [r["prompt"] for r in rows if r["first_divergence"] is not None]
            lines.append(f"- served here and compared with transformers over {len(rows)} prompts x "
                         f"{smoke['max_tokens']} greedy tokens ({smoke['dtype']}): "
                         + (f"diverged on {len(diverged)}" if diverged else "every token identical")
                         + f"; min top-5 overlap {min(r['min_overlap'] for r in rows):.2f}"
                         + "; max chosen-token |dlogprob| "
                         + f"{max(r['max_logprob_diff'] for r in rows):.3g} nats")
            lines.append(f"- launch overrides for this machine: {smoke.get('launch_overrides')}")
        else:
            lines.append("- launch attempted; the server did not answer (see smoke.json and server.log)")
    if not (validate or launch):
        lines.append("- none (run `adapt handoff ... --validate` or `--launch`)")
    return "\n".join(lines) + "\n"


def needs_dequantized_experts(model_dir: Path, target_compute: str) -> bool:
    """Whether the CPU backend needs this checkpoint re-exported: MXFP4 experts on a ``cpu`` target.

    vLLM's CPU MoE has no MXFP4 path on processors without AMX, so the CPU smoke test serves a
    copy whose experts are bf16.
    """
    config_path = Path(model_dir) / "config.json"
    if target_compute != "cpu" or not config_path.is_file():
        return False
    quant = json.loads(config_path.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"


def export_dequantized(model_dir: Path, out_dir: Path) -> Path:
    """Write ``model_dir`` with MXFP4 experts dequantized to bf16 into ``out_dir`` (transformers layout).

    transformers does the conversion (``Mxfp4Config(dequantize=True)``); its state dict is written
    as one safetensors file (``save_pretrained`` of a dequantized model leaves the experts out,
    transformers 5.19), the config without ``quantization_config``; tokenizer and generation
    files are copied unchanged.
    """
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "chat_template.jinja"):
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out_dir / name)
    return out_dir
