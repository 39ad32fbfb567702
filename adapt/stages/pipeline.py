"""The gate pipeline: run stage N after the stages before it, in one run directory, with provenance.

API (small on purpose):

- ``STAGES``: stage number -> ``Stage(name, run, reads, gates)``. ``reads`` names the
  ``PipelineOptions`` fields the stage's runner reads; ``gates`` the gates.yaml sections it
  reads. Both are declarative: a stage (5 precision, 6 bench) is registered by adding one entry,
  and its fingerprint follows from the entry.
- ``check_options(options)``: every flag checked (InputError, exit 2) before any stage runs.
- ``stage_fingerprint(stage, options, gates)``: what a stage's report depends on (below).
- ``validate(n, options, run, gates)``: runs stages 1..n; a stage below n whose report in the
  run directory passed (or warned) *and* whose recorded fingerprint equals the current one is
  reused, every other one runs again; stops at the first failed gate.
- ``fingerprint_mismatch(recorded, expected)``: the first differing field, for the hand-off.

A fingerprint (``report.fingerprint``) holds:

  model          sha256 of the model's config.json (preset file, config path or directory's)
  checkpoint     digest of every safetensors header of a model directory (None without shards)
  checkpoint_data  stages that run the weights (5, 6: ``Stage.reads_data``): digest of the model
                 directory's files themselves (tensor bytes, tokenizer; ``checkpoint_data_digest``),
                 so a rebuilt or retrained model with the same config and header is not taken for
                 the old one; None for the other stages
  target         target name and sha256 of its profile YAML
  stack          the stack table in force (``--stack`` or the target's default) and its YAML's sha256
  options        the ``PipelineOptions`` fields the stage reads (``Stage.reads``), by value; a stage
                 that serves stage 4's plan from the run directory (6: ``Stage.reads_plan``) adds
                 ``plan``, the digest of that plan (``plan_digest``)
  env            the environment variables the stage reads (``Stage.reads_env``) that are set, by value
                 (None when none is):
                 stage 5's ``ADAPT_TEST_FAULTS`` (a report made with injected faults is not the model's
                 evidence; the hand-off refuses one)
  packages       stages that measure numerics (3, 5: ``Stage.reads_packages``): the installed versions of
                 ``NUMERIC_PACKAGES`` (torch, triton, transformers); None for the other stages
  device         the same stages: the target's device as this machine offers it (``kernels.target_device``:
                 e.g. "cuda: NVIDIA H200 (9.0)", or "absent"), so a "not run here" made without the GPU
                 runs again where it is; None for the other stages
  engine         stage 6 (``Stage.reads_engine``): the serving engine it measures with
                 (``adapt.stages.serve.serving_engine``): vLLM's version (the serve environment's, or what the
                 ``--url`` server reports) and the engine arguments adapt launches it with on this machine, so
                 a report measured with another vLLM or other arguments is stale; None for the other stages
  gates          sha256 of the effective (defaults + ``--gates``) sections the stage reads
  adapt_version  ``adapt.__version__``
  code           every stage: the digest of the whole adapt package's files (``adapt.report.code_digest``:
                 sources and package data, no git needed), so a report written by other adapt code (another
                 kernel, gate rule, runtime, planner) is stale. The whole package, not the subpackages a stage
                 imports: the stages import lazily and share the report, model, plan and gates code, and stages
                 1, 2 and 4 take seconds to run again

plus ``git_commit`` (recorded, not compared: the code digest is what is compared).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import adapt
from adapt.errors import InputError, check_interrupt
from adapt.report import (
    MAX_HEADER_BYTES,
    RunDir,
    StageReport,
    checkpoint_data_digest,
    code_digest,
    digest,
    git_commit,
    pause_for_test,
)

COMPARED_FIELDS = ("model", "checkpoint", "checkpoint_data", "target", "stack", "options", "env", "packages",
                   "device", "engine", "gates", "adapt_version", "code")


@dataclass
class PipelineOptions:
    """What every stage may need; each stage reads its own subset (``Stage.reads``).

    model: preset name, config.json or model directory; target: name or YAML path
    devices / nodes: devices in total / nodes; context: tokens per sequence; batch: sequences
    kv_dtype: bf16 | fp8; weights: see ``adapt.plan.layout.WEIGHT_FORMATS``
    stack: stack table name or YAML path (None: the target's default)
    run_path: the run directory (stage 6 reads stage 4's prediction there and writes its artifacts)
    url: stage 6 loads this OpenAI-compatible server instead of launching the model; soak_s: soak seconds
    tokenizer: stage 6's tokenizer path or id (None: the model directory's; a byte-level stand-in
    when it has none)
    """

    model: str
    target: str
    devices: int = 8
    nodes: int = 1
    context: int = 8192
    batch: int = 1
    kv_dtype: str = "bf16"
    weights: str = "as-stored"
    stack: str | None = None
    layers: str | None = None  # stage 5: decoder layers (count or comma list) for reduced depth
    kernels: str = "all"  # stage 5: op families on adapt's kernels
    indexer_dtype: str = "fp8"  # stage 5: DSA indexer format
    compute_dtype: str = "bf16"  # stage 5: the adapted path's compute dtype
    run_path: str | None = None
    gates_file: str | None = None  # the --gates file of the invocation (repeated in stage 5's advised commands)
    url: str | None = None
    soak_s: float = 60.0
    tokenizer: str | None = None  # stage 6: the load generator's tokenizer (None: the model's, else a stand-in)
    served_model: str | None = None  # stage 6 with url: the name the server serves the checkpoint under (None: model)


@dataclass(frozen=True)
class Stage:
    """One gate stage: its report name, its runner and what it reads (options and gates sections;
    reads_data: the checkpoint's tensors and tokenizer; reads_plan: stage 4's plan in the run directory)."""

    name: str
    run: Callable[[PipelineOptions, dict], StageReport]
    reads: tuple[str, ...]
    gates: tuple[str, ...]
    reads_data: bool = False
    reads_plan: bool = False
    reads_env: tuple[str, ...] = ()
    reads_packages: bool = False  # numerics measured here: torch/triton/transformers versions and the device
    reads_engine: bool = False  # serves the model: the serving engine's version and launch arguments


def _inventory(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.inventory import run_inventory

    return run_inventory(o.model, o.target, stack=o.stack, gates=gates)


def _memory(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.memory import run_plan_memory

    return run_plan_memory(o.model, o.target, devices=o.devices, nodes=o.nodes, context=o.context,
                           batch=o.batch, kv_dtype=o.kv_dtype, weights=o.weights, gates=gates)


def _kernels(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.kernels import run_kernel_tests

    return run_kernel_tests(o.model, o.target, stack=o.stack, gates=gates)


def _parallel(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.parallel import run_plan_parallel

    return run_plan_parallel(o.model, o.target, devices=o.devices, nodes=o.nodes, context=o.context,
                             batch=o.batch, kv_dtype=o.kv_dtype, weights=o.weights, gates=gates)


def precision_unmeasured_formats(model: str, weights: str) -> list[str]:
    """The plan's conversions (``adapt.plan.layout.tensor_format`` under ``weights``) that stage 5's runtime
    does not run: it converts routed experts to FP8 e4m3 (``adapt.runtime.variants``) and runs every other
    matrix as stored. Routed experts to FP8 and anything to bf16 (from a coarser format) count as run;
    e.g. ``["attention as fp8_block", "routed_experts as mxfp4"]``."""
    from adapt.model.spec import load_spec
    from adapt.plan.layout import tensor_format

    spec = load_spec(model)
    out = set()
    for tensor in spec.tensors(include_mtp=False):
        planned = tensor_format(spec, tensor, weights)
        if planned == spec.tensor_format(tensor) or planned.method == "bf16":
            continue
        if tensor.component == "routed_experts" and planned.method.startswith("fp8"):
            continue
        out.add(f"{tensor.component} as {planned.method}")
    return sorted(out)


def _precision(o: PipelineOptions, gates: dict) -> StageReport:
    """Reads model, target, layers, kernels, weights, indexer_dtype, kv_dtype, compute_dtype, run_path (its plot).

    Measured on another device than the target's (an H200 target on this CPU), the report gets stage 3's
    "not run here" rule: a warning naming both devices, never a plain pass; so does a planned weight format
    the runtime cannot run (``precision_unmeasured_formats``)."""
    from adapt.stages.kernels import target_device
    from adapt.stages.precision import run_precision
    from adapt.targets.target import load_target

    report = run_precision(o.model, o.target, gates=gates, layers=o.layers, kernels=o.kernels, weights=o.weights,
                           indexer_dtype=o.indexer_dtype, kv_dtype=o.kv_dtype, compute_dtype=o.compute_dtype,
                           report_dir=o.run_path, invocation=[
                               "--devices", str(o.devices), "--nodes", str(o.nodes), "--context", str(o.context),
                               "--batch", str(o.batch), *(["--stack", o.stack] if o.stack else []),
                               *(["--gates", o.gates_file] if o.gates_file else [])])
    wanted, why = target_device(load_target(o.target))
    measured = report.metrics.get("device")
    if wanted is None or measured != wanted:
        report.verdict = "" if report.verdict == "pass" else report.verdict
        report.add("warn", "not-on-target-device",
                   f"measured on {measured}, not on the target's device ({why if wanted is None else wanted}); "
                   "kernel rounding on the target can differ", hint="run stage 5 on a machine with the target")
    unmeasured = precision_unmeasured_formats(o.model, o.weights)
    if unmeasured:
        report.verdict = "" if report.verdict == "pass" else report.verdict
        report.add("warn", "not-measured-weights", f"--weights {o.weights} plans {', '.join(unmeasured)}: not "
                   "measured here; stage 5's runtime converts routed experts to FP8 e4m3 only and runs the rest "
                   "as stored (an MXFP4 error is larger: gates.yaml kernels max_rel_error_mxfp4)")
    return report


def _serve(o: PipelineOptions, gates: dict) -> StageReport:
    from adapt.stages.serve import STAGE_LAUNCH, ServeOptions, run_serve_stage

    return run_serve_stage(o.model, target=o.target, run_path=Path(o.run_path) if o.run_path else None,
                           gates=gates, options=ServeOptions(soak_s=o.soak_s), url=o.url, tokenizer=o.tokenizer,
                           served_model=o.served_model, **STAGE_LAUNCH)


_PLAN_OPTIONS = ("devices", "nodes", "context", "batch", "kv_dtype", "weights")
_PRECISION_OPTIONS = ("layers", "kernels", "weights", "indexer_dtype", "kv_dtype", "compute_dtype",
                      "devices", "nodes", "context", "batch")  # the last four only enter the advised commands
STAGES: dict[int, Stage] = {
    1: Stage("inventory", _inventory, reads=(), gates=("inventory",)),
    2: Stage("memory", _memory, reads=_PLAN_OPTIONS, gates=("memory",)),
    3: Stage("kernels", _kernels, reads=(), gates=("kernels",), reads_packages=True),
    4: Stage("parallel", _parallel, reads=_PLAN_OPTIONS, gates=("memory", "parallel")),
    5: Stage("precision", _precision, reads=_PRECISION_OPTIONS, gates=("precision",), reads_data=True,
             reads_env=("ADAPT_TEST_FAULTS",), reads_packages=True),  # adapt.runtime.variants.FAULTS_ENV
    # stage 6 also serves the plan in stage 4's report of the same run directory (run_path)
    6: Stage("bench", _serve, reads=("url", "served_model", "soak_s", "tokenizer"), gates=("bench",), reads_data=True,
             reads_plan=True, reads_engine=True),
}
STAGE_NAMES = {n: s.name for n, s in STAGES.items()}


# ---------------------------------------------------------------- identity of the inputs


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def config_path(model: str) -> Path:
    """The config.json a model argument resolves to (as ``adapt.model.spec.load_spec`` does)."""
    from adapt.model.spec import PRESETS_DIR, list_presets

    path = Path(model)
    if path.is_dir():
        return path / "config.json"
    if path.is_file():
        return path
    if "/" not in model and (PRESETS_DIR / f"{model}.json").is_file():
        return PRESETS_DIR / f"{model}.json"
    raise InputError("no such model directory, config file or preset", file=model,
                     hint="presets: " + ", ".join(list_presets()))


def checkpoint_digest(model: str) -> str | None:
    """sha256 over every shard's name and safetensors header (JSON) of a model directory, or None
    when it has no shards. Reads 8 bytes + the header of each shard, never the weights."""
    directory = Path(model)
    if not directory.is_dir():
        return None
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        return None
    h = hashlib.sha256()
    for shard in shards:
        with open(shard, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if size > MAX_HEADER_BYTES:
                raise InputError(f"safetensors header of {size:,} bytes is implausible", file=shard)
            h.update(shard.name.encode() + b"\0" + handle.read(size))
    return h.hexdigest()[:16]


def plan_digest(run_path: str | Path | None) -> str | None:
    """Digest of what stage 6 takes from stage 4's report (``parallel.json`` in the run directory): its
    engine arguments, best plan, batch and context; None when the run has no stage-4 report."""
    path = None if run_path is None else Path(run_path) / "parallel.json"
    if path is None or not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text()).get("metrics") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return "unreadable"
    return digest({key: metrics.get(key) for key in ("engine_args", "batch", "context")}
                  | {"plan": (metrics.get("top_plans") or [None])[0]})


NUMERIC_PACKAGES = ("torch", "triton", "transformers")  # what stages 3 and 5 compute with or anchor to


def package_versions() -> dict[str, str | None]:
    """Installed version of each of ``NUMERIC_PACKAGES`` (None: not installed)."""
    import importlib.metadata

    out: dict[str, str | None] = {}
    for name in NUMERIC_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _device_here(target) -> str:
    """The target's device on this machine, as stages 3 and 5 would measure on it."""
    from adapt.stages import kernels

    device, description = kernels.target_device(target)
    return f"{device}: {description}" if device else "absent"


def _engine(options: PipelineOptions) -> dict[str, Any]:
    """Stage 6's serving engine for these options (``adapt.stages.serve.serving_engine``)."""
    from adapt.stages.serve import serving_engine

    return serving_engine(options.run_path, options.url)


def _file_digest(path: str | Path) -> str:
    try:
        return _sha(Path(path).read_bytes())
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", file=path) from None


def stage_fingerprint(number: int, options: PipelineOptions, gates: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint of stage ``number`` for these options and effective gates (module docstring)."""
    from adapt.targets.target import load_stack, load_target

    stage = STAGES[number]
    target = load_target(options.target)
    stack = load_stack(options.stack or target.default_stack)
    read = {name: getattr(options, name) for name in stage.reads}
    if stage.reads_plan:
        read["plan"] = plan_digest(options.run_path)
    return {
        "model": _file_digest(config_path(options.model)),
        "checkpoint": checkpoint_digest(options.model),
        "checkpoint_data": checkpoint_data_digest(options.model) if stage.reads_data else None,
        "target": {"name": target.name, "profile": _file_digest(target.path)},
        "stack": {"name": stack.name, "table": _file_digest(stack.path)},
        "options": read,
        "env": {name: os.environ[name] for name in stage.reads_env if os.environ.get(name)} or None,
        "packages": package_versions() if stage.reads_packages else None,
        "device": _device_here(target) if stage.reads_packages else None,
        "engine": _engine(options) if stage.reads_engine else None,
        "gates": digest({section: gates.get(section) for section in stage.gates}),
        "adapt_version": adapt.__version__,
        "code": code_digest(),
        "git_commit": git_commit(),
    }


def fingerprint_mismatch(recorded: dict[str, Any], expected: dict[str, Any],
                         fields: tuple[str, ...] = COMPARED_FIELDS) -> str | None:
    """The first field (``options.context``, ``target``, ...) where ``recorded`` differs from
    ``expected``, with both values, or None when they agree on every field in ``fields``."""
    for name in fields:
        got, want = recorded.get(name), expected.get(name)
        if name == "options" and isinstance(got, dict) and isinstance(want, dict):
            for key in sorted(set(got) | set(want)):
                if got.get(key) != want.get(key):
                    return f"options.{key}: recorded {got.get(key)!r}, now {want.get(key)!r}"
        elif name == "code" and got != want:
            return code_mismatch(got, want)
        elif got != want:
            return f"{name}: recorded {json.dumps(got, default=str)}, now {json.dumps(want, default=str)}"
    return None


def code_mismatch(recorded: str | None, now: str) -> str:
    """The words for a report written by other adapt code (``code`` digests differ; None: none recorded)."""
    return f"written by other adapt code (digest {recorded or 'not recorded'}, now {now})"


# ---------------------------------------------------------------- the pipeline


def _positive(value: Any, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"expected a positive integer, got {value!r}", field=flag)


def check_options(options: PipelineOptions, stage: int = max(STAGES)) -> None:
    """Check every flag of a ``validate`` invocation (InputError naming the flag) before any stage runs:
    counts, dtypes, weight format, the model, the target, the stack, and, when a stage up to
    ``stage`` reads them, devices per node and the context limit."""
    from adapt.model.spec import load_spec
    from adapt.plan.layout import KV_DTYPES, WEIGHT_FORMATS, context_limit, devices_per_node
    from adapt.targets.target import load_stack, load_target

    for flag, value in (("--devices", options.devices), ("--nodes", options.nodes),
                        ("--context", options.context), ("--batch", options.batch)):
        _positive(value, flag)
    if options.kv_dtype not in KV_DTYPES:
        raise InputError(f"unknown KV dtype {options.kv_dtype!r}; expected one of {', '.join(KV_DTYPES)}",
                         field="--kv-dtype")
    if options.weights not in WEIGHT_FORMATS:
        raise InputError(f"unknown weights format {options.weights!r}; expected one of "
                         f"{', '.join(WEIGHT_FORMATS)}", field="--weights")
    spec = load_spec(options.model)
    target = load_target(options.target)
    load_stack(options.stack or target.default_stack)
    if not any("devices" in STAGES[n].reads for n in STAGES if n <= stage):
        return
    devices_per_node(target, options.devices, options.nodes)
    limit = context_limit(spec)
    if options.context > limit:
        raise InputError(f"--context {options.context:,} exceeds the model's limit of {limit:,} tokens",
                         field="--context", hint="lower --context (plan-memory --rope-factor plans a longer one)")
    if options.weights.startswith("mxfp4") and not spec.moe_layers:
        raise InputError(f"--weights {options.weights} converts routed experts, and this model has none",
                         field="--weights")


def validate(stage: int, options: PipelineOptions, run: RunDir, gates: dict[str, Any],
             on_report: Callable[[StageReport], None] | None = None,
             on_reuse: Callable[[str, str], None] | None = None,
             on_rerun: Callable[[str, str], None] | None = None) -> list[StageReport]:
    """Run stages 1..stage in ``run``; stop at the first failed gate. Returns the reports produced.

    Stage ``stage`` itself always runs. A stage before it is reused (not run) only when its report
    in the run directory passed or warned and its fingerprint equals ``stage_fingerprint`` for
    this invocation; ``on_reuse(name, why)`` hears about each reuse, ``on_rerun(name, why)`` about each
    stage before ``stage`` whose earlier report exists but runs again (``rerun_reason``). Every report carries its
    fingerprint, is written as soon as it exists and is passed to ``on_report``.
    """
    if stage not in STAGES:
        raise InputError(f"no stage {stage}; stages that run as gates: "
                         + ", ".join(f"{n} {s.name}" for n, s in STAGES.items()), field="--stage")
    check_options(options, stage)
    numbers = [n for n in sorted(STAGES) if n <= stage]
    prints = {n: stage_fingerprint(n, options, gates) for n in numbers}
    reports = []
    if options.run_path is None:
        options.run_path = str(run.path)
    for number in numbers:
        name = STAGES[number].name
        if number < stage:
            recorded = run.stage_report(name)
            why = rerun_reason(recorded, prints[number]) if recorded else None
            if recorded and why is None:
                if on_reuse:
                    on_reuse(name, f"{recorded['verdict']} at {recorded.get('finished')}, same fingerprint")
                continue
            if why and on_rerun:
                on_rerun(name, why)
        check_interrupt()
        if STAGES[number].reads_plan:  # stage 4 may have run again just now
            prints[number] = stage_fingerprint(number, options, gates)
        report = STAGES[number].run(options, gates)
        stamp(report, prints[number])
        pause_for_test(f"before-write-{name}")
        run.write(report)
        reports.append(report)
        if on_report:
            on_report(report)
        if report.decide() == "fail":
            break
    return reports


def rerun_reason(recorded: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why an earlier stage report (``RunDir.stage_report``) is not reused: its verdict, or the first
    fingerprint field that changed (``fingerprint_mismatch``); None when it is reused."""
    if recorded["verdict"] not in ("pass", "warn"):
        return f"earlier verdict {recorded['verdict']}"
    return fingerprint_mismatch(recorded.get("fingerprint") or {}, expected)


def stamp(report: StageReport, fingerprint: dict[str, Any], extra_options: dict[str, Any] | None = None) -> None:
    """Put ``fingerprint`` on ``report``, keeping the stage's own record under ``stage_inputs``.

    extra_options: options a standalone command read beyond ``PipelineOptions`` (``--tp``,
    ``--headroom``, ...); those that are set join ``options``, so a plan made with them is not
    taken for the pipeline's default plan.
    """
    extra = {k: v for k, v in (extra_options or {}).items() if v is not None}
    report.fingerprint = {**fingerprint, "options": {**fingerprint["options"], **extra},
                          "stage_inputs": report.fingerprint}


def stamp_standalone(report: StageReport, options: PipelineOptions, gates: dict[str, Any],
                     extra_options: dict[str, Any] | None = None) -> None:
    """``stamp`` for a stage run by its own command (``adapt inventory``, ``plan-memory``, ...)."""
    number = next(n for n, s in STAGES.items() if s.name == report.stage)
    stamp(report, stage_fingerprint(number, options, gates), extra_options)


def stamp_bench_serve(report: StageReport, model: str, *, target: str, run_path: Path, gates: dict[str, Any],
                      soak_s: float, url: str | None = None, served_model: str | None = None,
                      checkpoint: str | None = None, extra_options: dict[str, Any] | None = None) -> None:
    """Put stage 6's pipeline fingerprint on a report of ``adapt bench serve`` (the engine as launched or as the
    server reported it), tying it to a checkpoint: without ``url``, ``model``, the directory it launched; with
    ``url``, ``checkpoint`` (default ``model``) only when ``serve.check_identity`` showed the endpoint serves it (its
    info finding ``bench.identity``: served name and greedy tokens agree), so the fingerprint records that
    checkpoint's digests (``checkpoint_data`` included) and the hand-off compares them like validate's stage 6.
    A ``url`` not shown to serve it keeps only its own inputs: the hand-off refuses it unless forced."""
    if url is not None and not any(f.code == "bench.identity" and f.severity == "info" for f in report.findings):
        return
    checked = model if url is None else (checkpoint or model)
    name = None if url is None else (served_model or (model if model != checked else None))
    stamp_standalone(report, PipelineOptions(checked, target, run_path=str(run_path), soak_s=soak_s, url=url,
                                             served_model=name), gates, extra_options)
    report.fingerprint["engine"] = report.metrics.get("engine")  # as launched (--max-model-len, ...) or reported
