"""The `adapt` command line: parse, call a stage, render. No logic lives here.

Exit codes: 0 pass (warnings allowed), 1 gate failed, 2 bad input or usage.
Every command takes ``--json`` for machine output on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from adapt import __version__
from adapt.errors import InputError
from adapt.report import EXIT_BAD_INPUT, RunDir, StageReport

console = Console()
err_console = Console(stderr=True)


class _Group(TyperGroup):
    """Turns InputError from any command into one line on stderr and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as exc:
            err_console.print(f"[red]error:[/red] {escape(exc.line())}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Bring a giant MoE model up on a new accelerator, gate by gate, and hand it to vLLM.")
bench_app = typer.Typer(cls=_Group, no_args_is_help=True, help="Stage 6: kernels against the roofline.")
app.add_typer(bench_app, name="bench")


def _version_callback(value: bool) -> None:
    if value:
        sys.stdout.write(f"adapt {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_version_callback, is_eager=True, help="Print adapt's version and exit.")] = False,
          ) -> None:
    """Bring a giant MoE model up on a new accelerator, gate by gate, and hand it to vLLM."""

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
TargetOpt = Annotated[str, typer.Option(
    "--target", "-t", help="Target name (see `adapt targets`) or a YAML path (required).")]
RunOpt = Annotated[str | None, typer.Option("--run", help="Run id: reports go to <output>/<run>/.")]
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Reports root directory.")]
GatesOpt = Annotated[Path | None, typer.Option("--gates", help="YAML file overriding gate thresholds.")]


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def render_report(report: StageReport) -> None:
    """A stage report in the terminal: verdict, metrics, tables, findings."""
    verdict = report.decide()
    color = {"pass": "green", "warn": "yellow", "unmeasured": "red", "fail": "red"}[verdict]
    console.print(f"[bold]Stage {report.number}: {escape(report.title)}[/bold]  [{color}]{verdict.upper()}[/{color}]")
    if report.summary:
        console.print(report.summary, markup=False)
    for name, rows in report.tables.items():
        if not rows:
            continue
        table = Table(title=name, title_justify="left")
        columns = list(rows[0])
        for column in columns:
            table.add_column(str(column))
        for row in rows:
            table.add_row(*(_cell(row.get(c, "")) for c in columns))
        console.print(table)
    for f in report.findings:
        style = {"error": "red", "warn": "yellow", "info": "dim"}[f.severity]
        hint = f"  [dim]({escape(f.hint)})[/dim]" if f.hint else ""
        console.print(f"[{style}]{f.severity:5}[/{style}] {escape(f.code)}: {escape(f.message)}{hint}")


def _cell(value) -> str:
    """A table cell as text with rich markup escaped (source tags such as ``[fp8-doc]`` stay visible)."""
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return escape(str(value))


def finish(report: StageReport, as_json: bool, run: RunDir | None = None,
           extra: dict[str, str] | None = None) -> None:
    """Write the report into the run directory (if any), render it, exit with the gate's code."""
    if run is not None:
        paths = run.write(report, extra=extra)
        report.artifacts.update({name: str(path) for name, path in paths.items()})
    if as_json:
        print_json(report.to_dict())
    else:
        render_report(report)
        if run is not None:
            console.print(f"[dim]reports: {escape(str(run.path))}[/dim]")
    raise typer.Exit(report.exit_code)


@app.command()
def targets(as_json: JsonOpt = False) -> None:
    """List the built-in targets and stack tables."""
    from adapt.targets.target import load_target, stack_names, target_names

    loaded = [load_target(name) for name in target_names()]
    if as_json:
        print_json({"targets": [t.to_dict() for t in loaded], "stacks": stack_names()})
        return
    table = Table(title="targets")
    for column in ("name", "vendor", "devices/node", "memory GiB", "HBM TB/s", "bf16 TFLOP/s", "fp8 TFLOP/s",
                   "native dtypes", "stack"):
        table.add_column(column)
    for t in loaded:
        fp8 = t.peak_flops.get("fp8")
        table.add_row(t.name, t.vendor, str(t.devices_per_node), f"{t.memory_bytes / 2**30:.1f}",
                      f"{t.hbm_bandwidth / 1e12:.2f}", f"{t.peak_flops['bf16'] / 1e12:,.1f}",
                      f"{fp8 / 1e12:,.1f}" if fp8 else "-", ", ".join(t.native_dtypes), t.default_stack)
    console.print(table)
    console.print(f"stacks: {', '.join(stack_names())}")


@app.command()
def calibrate(
    target: TargetOpt,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Target YAML to write (default: <target>-calibrated.yaml here).")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Name inside the YAML.")] = None,
    devices: Annotated[int | None, typer.Option(
        "--devices", "-d", help="GPUs for the collectives (default: all visible).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: a smoke run, not a profile.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Measure this machine (bandwidth, matmul rates, launch cost, collectives); write a target YAML."""
    from rich.progress import Progress

    from adapt.targets.calibrate import calibrate as measure
    from adapt.targets.calibrate import write_target

    with Progress(console=err_console, transient=True, disable=as_json) as progress:
        task = progress.add_task("calibrating", total=None)

        def tick(step: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=step)

        result = measure(target, devices=devices, quick=quick, progress=tick)
    path = output or Path(f"{result.base.name}-calibrated.yaml")
    written = write_target(result, path, name)
    if as_json:
        print_json({"path": str(path), "target": written.to_dict(), "calibration": result.to_dict()})
        return
    table = Table(title=f"measured {result.date} on {result.device}", title_justify="left")
    for column in ("field", "measured", "datasheet"):
        table.add_column(column)
    base = result.base.to_dict()
    for key, value in written.to_dict().items():
        if key in ("sources", "name", "description", "native_dtypes", "default_stack", "vendor"):
            continue
        measured = key in written.calibration["measured"] or (
            key == "peak_tflops" and any(m.startswith("peak_tflops.") for m in written.calibration["measured"]))
        table.add_row(key, _cell(value) if measured else "-", _cell(base.get(key)))
    console.print(table, soft_wrap=True)
    for what, why in result.refused.items():
        console.print(f"[yellow]not measured[/yellow] {what}: {why}", highlight=False)
    for note in result.notes:
        console.print(f"[dim]{note}[/dim]", highlight=False)
    console.print(f"target written: {path}")


@app.command()
def info(
    model: Annotated[str, typer.Argument(help="Model directory, config.json, or preset name.")],
    as_json: JsonOpt = False,
) -> None:
    """Show a model's spec, parameters, bytes by component and quantization (headers only, no weights)."""
    from rich.progress import Progress

    from adapt.stages.info import describe_model

    with Progress(console=err_console, transient=True, disable=as_json) as progress:
        task = progress.add_task("reading safetensors headers", total=None)

        def tick(done: int, total: int, shard: str) -> None:
            progress.update(task, completed=done, total=total, description=f"headers: {shard}")

        facts = describe_model(model, progress=tick)
    if as_json:
        print_json(facts)
        return
    params = facts["parameters"]
    console.print(f"[bold]{escape(model)}[/bold]  model_type={facts['model_type']}  layers={facts['layers']} "
                  f"(MoE {facts['moe_layers']}, MTP {facts['mtp_layers']})  attention={', '.join(facts['attention'])}")
    console.print(f"parameters: total {params['total']:,}  active {params['active']:,}  "
                  f"with MTP {params['total_with_mtp']:,}")
    table = Table(title="components", title_justify="left")
    stored = facts.get("checkpoint", {}).get("bytes_by_component", {})
    bytes_column = "checkpoint bytes" if stored else "bytes from spec"
    for column in ("component", "parameters", "stored as", bytes_column):
        table.add_column(column, justify="right" if column != "component" else "left")
    sizes = stored or facts["estimated_bytes"]
    for component, count in params["per_component"].items():
        if count or sizes.get(component):
            table.add_row(component, f"{count:,}", facts["quantization"].get(component, "-"),
                          f"{sizes[component]:,}" if component in sizes else "-")
    for component in sorted(c for c in set(sizes) - set(params["per_component"]) if sizes[c]):
        table.add_row(component, "-", "-", f"{sizes[component]:,}")
    console.print(table)
    if "checkpoint" in facts:
        ck = facts["checkpoint"]
        console.print(f"checkpoint: {ck['shards']} shards, {ck['tensors']:,} tensors, {ck['total_bytes']:,} bytes")
        for f in ck["findings"]:
            console.print(f"[yellow]{f['severity']}[/yellow] {escape(f['code'])}: {escape(f['message'])}")


@app.command()
def validate(
    model: Annotated[str, typer.Argument(help="Model directory, config.json, or preset name.")],
    stage: Annotated[int, typer.Option("--stage", "-s", help="Run the gates up to this stage (1-6).")],
    target: TargetOpt,
    devices: Annotated[int, typer.Option("--devices", "-d", help="Devices in total.")] = 8,
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="Nodes.")] = 1,
    context: Annotated[int, typer.Option("--context", help="Tokens per sequence.")] = 8192,
    batch: Annotated[int, typer.Option("--batch", help="Concurrent sequences.")] = 1,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="bf16 or fp8.")] = "bf16",
    weights: Annotated[str, typer.Option("--weights", help="Weight format (see plan-memory).")] = "as-stored",
    stack: Annotated[str | None, typer.Option("--stack", help="Stack table name or YAML path.")] = None,
    layers: Annotated[str | None, typer.Option(
        "--layers", help="Stage 5: decoder layers to run (a count or a comma list, e.g. 0,3).")] = None,
    kernels: Annotated[str, typer.Option(
        "--kernels", help="Stage 5: op families on adapt's kernels: all, none, or a comma list.")] = "all",
    indexer_dtype: Annotated[str, typer.Option("--indexer-dtype", help="Stage 5: DSA indexer fp8 or bf16.")] = "fp8",
    compute_dtype: Annotated[str, typer.Option(
        "--compute-dtype", help="Stage 5: adapted path's compute dtype, bf16 or fp32.")] = "bf16",
    url: Annotated[str | None, typer.Option(
        "--url", help="Stage 6: load this OpenAI-compatible server instead of launching the model.")] = None,
    served_model: Annotated[str | None, typer.Option(
        "--served-model", help="Stage 6 with --url: the name the server serves MODEL under (default: MODEL).")] = None,
    soak_s: Annotated[float, typer.Option("--soak-s", help="Stage 6: soak length in seconds.")] = 60.0,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="Stage 6: tokenizer path or id for the load (default: the model's; a byte-level "
                            "stand-in when the model directory has none).")] = None,
    output: OutputOpt = Path("reports"),
    run_id: RunOpt = None,
    gates: GatesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run stage N as a gate, after the stages before it (those not yet passed in the run directory)."""
    from adapt.report import load_gates
    from adapt.stages.pipeline import PipelineOptions
    from adapt.stages.pipeline import validate as run_gates

    thresholds = load_gates(gates)
    run = RunDir(output, run_id)
    options = PipelineOptions(model=model, target=target, devices=devices, nodes=nodes, context=context,
                              batch=batch, kv_dtype=kv_dtype, weights=weights, stack=stack,
                              run_path=str(run.path), url=url, soak_s=soak_s, tokenizer=tokenizer,
                              served_model=served_model,
                              layers=layers, kernels=kernels,
                              indexer_dtype=indexer_dtype, compute_dtype=compute_dtype,
                              gates_file=str(gates) if gates else None)

    heard: dict[str, list[dict[str, str]]] = {"reused": [], "reran": []}

    def reused(name: str, why: str) -> None:
        heard["reused"].append({"stage": name, "reason": why})
        if not as_json:
            console.print(f"[dim]{escape(name)}: reused ({escape(why)})[/dim]", soft_wrap=True)

    def reran(name: str, why: str) -> None:
        heard["reran"].append({"stage": name, "reason": why})
        if not as_json:
            console.print(f"[yellow]{escape(name)}: runs again[/yellow] ({escape(why)})", soft_wrap=True)

    reports = run_gates(stage, options, run, thresholds, on_report=None if as_json else render_report,
                        on_reuse=reused, on_rerun=reran)
    code = max((r.exit_code for r in reports), default=0)
    if as_json:
        from adapt.report import VERDICTS

        worst = max((r.decide() for r in reports), key=VERDICTS.index, default="pass")
        print_json({"run": str(run.path), "verdict": worst, "exit_code": code, **heard,
                    "reports": [r.to_dict() for r in reports]})
    else:
        console.print(f"[dim]reports: {escape(str(run.path))}[/dim]")
    raise typer.Exit(code)


ModelArg = Annotated[str, typer.Argument(help="Model directory, config.json, or preset name.")]
DevicesOpt = Annotated[int, typer.Option("--devices", "-d", help="Devices in total (over all nodes).")]
NodesOpt = Annotated[int, typer.Option("--nodes", "-n", help="Nodes the devices are spread over.")]
ContextOpt = Annotated[int, typer.Option("--context", help="Tokens per sequence (vLLM max_model_len).")]
BatchOpt = Annotated[int, typer.Option("--batch", help="Concurrent sequences over all replicas.")]
KvDtypeOpt = Annotated[str, typer.Option("--kv-dtype", help="KV cache dtype: bf16 or fp8.")]
WeightsOpt = Annotated[str, typer.Option(
    "--weights", help="Weight format: as-stored, bf16, fp8, mxfp4-online, mxfp4-offline-fp8.")]
HeadroomOpt = Annotated[float | None, typer.Option(
    "--headroom", help="Margin on the estimated terms (default: gates memory.headroom_fraction).")]
UtilOpt = Annotated[float | None, typer.Option(
    "--gpu-memory-utilization", help="vLLM's fraction of device memory (default 0.9).")]
BatchedTokensOpt = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", help="Prefill chunk in tokens (default: vLLM's for the target).")]
MaxSeqsOpt = Annotated[int | None, typer.Option(
    "--max-num-seqs", help="vLLM max_num_seqs (default: vLLM's for the target).")]
BlockOpt = Annotated[int, typer.Option("--block-size", help="Tokens per KV page.")]
ImagesOpt = Annotated[int, typer.Option("--images", help="Images per request (multimodal models).")]
ImageSizeOpt = Annotated[str, typer.Option("--image-size", help="Image HEIGHTxWIDTH in pixels, e.g. 1024x1024.")]


def parse_image_size(text: str) -> tuple[int, int]:
    """"1080x1920" -> (1080, 1920); InputError naming --image-size otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"expected HEIGHTxWIDTH in pixels, got {text!r}", field="--image-size",
                         hint="e.g. --image-size 1024x1024")
    return int(parts[0]), int(parts[1])
RopeOpt = Annotated[float | None, typer.Option(
    "--rope-factor", help="Rope-scaling factor over the pre-scaling length, to plan a longer --context.")]


@app.command("plan-memory")
def plan_memory_command(
    model: ModelArg, target: TargetOpt, devices: DevicesOpt, context: ContextOpt, batch: BatchOpt = 1,
    nodes: NodesOpt = 1, kv_dtype: KvDtypeOpt = "bf16", weights: WeightsOpt = "as-stored",
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel size.")] = None,
    ep: Annotated[int | None, typer.Option("--ep", help="Expert-parallel size (1 or TP x DP).")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Pipeline-parallel size.")] = None,
    dp: Annotated[int | None, typer.Option("--dp", help="Data-parallel size.")] = None,
    dcp: Annotated[int | None, typer.Option("--dcp", help="Decode context-parallel size (divides TP).")] = None,
    headroom: HeadroomOpt = None, gpu_memory_utilization: UtilOpt = None,
    max_num_batched_tokens: BatchedTokensOpt = None, max_num_seqs: MaxSeqsOpt = None,
    block_size: BlockOpt = 64, rope_factor: RopeOpt = None, output: OutputOpt = Path("reports"),
    run_id: RunOpt = None, gates: GatesOpt = None, as_json: JsonOpt = False,
    images: ImagesOpt = 0, image_size: ImageSizeOpt = "1024x1024",
) -> None:
    """Stage 2: bytes per device (weights, KV cache, activations, buffers) and whether it fits."""
    from adapt.report import load_gates
    from adapt.stages.memory import run_plan_memory
    from adapt.stages.pipeline import PipelineOptions, stamp_standalone

    run, thresholds = RunDir(output, run_id), load_gates(gates)
    extra = dict(tp=tp, ep=ep, pp=pp, dp=dp, dcp=dcp, headroom=headroom,
                 gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
                 max_num_seqs=max_num_seqs, block_size=block_size if block_size != 64 else None,
                 rope_factor=rope_factor)
    report = run_plan_memory(model, target, gates=thresholds, devices=devices, nodes=nodes,
                             context=context, batch=batch, kv_dtype=kv_dtype, weights=weights,
                             tp=tp, ep=ep, pp=pp, dp=dp, dcp=dcp,
                             headroom=headroom, gpu_memory_utilization=gpu_memory_utilization,
                             max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             block_size=block_size, rope_factor=rope_factor,
                             images=images, image_size=parse_image_size(image_size))
    if images:
        extra.update(images=images, image_size=image_size)
    stamp_standalone(report, PipelineOptions(model, target, devices, nodes, context, batch, kv_dtype, weights),
                     thresholds, extra)
    finish(report, as_json, run)


@app.command("plan-parallel")
def plan_parallel_command(
    model: ModelArg, target: TargetOpt, devices: DevicesOpt, context: ContextOpt, batch: BatchOpt = 1,
    nodes: NodesOpt = 1, kv_dtype: KvDtypeOpt = "bf16", weights: WeightsOpt = "as-stored",
    headroom: HeadroomOpt = None, gpu_memory_utilization: UtilOpt = None,
    max_num_batched_tokens: BatchedTokensOpt = None, max_num_seqs: MaxSeqsOpt = None,
    block_size: BlockOpt = 64, rope_factor: RopeOpt = None, output: OutputOpt = Path("reports"),
    run_id: RunOpt = None, gates: GatesOpt = None, as_json: JsonOpt = False,
) -> None:
    """Stage 4: rank TP x EP x PP x DP plans; print vLLM engine arguments, `vllm serve` and Ray steps."""
    from adapt.plan.launch import launch_script
    from adapt.report import load_gates
    from adapt.stages.parallel import run_plan_parallel
    from adapt.stages.pipeline import PipelineOptions, stamp_standalone

    run, thresholds = RunDir(output, run_id), load_gates(gates)
    report = run_plan_parallel(model, target, gates=thresholds, devices=devices, nodes=nodes,
                               context=context, batch=batch, kv_dtype=kv_dtype, weights=weights,
                               headroom=headroom, gpu_memory_utilization=gpu_memory_utilization,
                               max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                               block_size=block_size, rope_factor=rope_factor)
    stamp_standalone(report, PipelineOptions(model, target, devices, nodes, context, batch, kv_dtype, weights),
                     thresholds, dict(headroom=headroom, gpu_memory_utilization=gpu_memory_utilization,
                                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      block_size=block_size if block_size != 64 else None,
                                      rope_factor=rope_factor))
    script = launch_script(report.metrics)
    extra = {"parallel.launch.sh": script} if script else None
    finish(report, as_json, run, extra=extra)


@app.command("inventory")
def inventory_command(
    model: ModelArg, target: TargetOpt,
    stack: Annotated[str | None, typer.Option(
        "--stack", help="Stack table (vllm-cuda, vllm-cpu, vllm-rocm) or YAML; default: target's.")] = None,
    all_layers: Annotated[bool, typer.Option(
        "--all-layers", help="Trace every decoder layer, not one per distinct structure.")] = False,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Prefill tokens in the traced step.")] = 16,
    output: OutputOpt = Path("reports"), run_id: RunOpt = None, gates: GatesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stage 1: every operator the model needs and how the target's stack provides it (gaps fail the gate)."""
    from adapt.report import load_gates
    from adapt.stages.inventory import build_inventory
    from adapt.stages.pipeline import PipelineOptions, stamp_standalone

    run, thresholds = RunDir(output, run_id), load_gates(gates)
    status = console.status("tracing the model on the meta device ...") if not as_json else None
    with status or _no_status():
        inventory = build_inventory(model, target, stack=stack, gates=thresholds,
                                    all_layers=all_layers, prefill_tokens=tokens)
    stamp_standalone(inventory.report, PipelineOptions(model, target, stack=stack), thresholds,
                     dict(all_layers=all_layers or None, tokens=tokens if tokens != 16 else None))
    detail = {"operators": [r.to_dict() for r in inventory.rows], "fusions": inventory.fusions,
              "aten": inventory.aten}
    finish(inventory.report, as_json, run,
           extra={"inventory.detail.json": json.dumps(detail, indent=1, default=str) + "\n"})


@app.command("preflight")
def preflight_command(
    target: TargetOpt,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (to check its formats).")] = None,
    eval_data: Annotated[Path | None, typer.Option(
        "--eval-data", help="Evaluation data file or directory stage 5 will read.")] = None,
    output: OutputOpt = Path("reports"), run_id: RunOpt = None, gates: GatesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stage 0: the pre-adaptation checklist, checked where this machine can, listed where it cannot."""
    from adapt.report import load_gates
    from adapt.stages.preflight import run_preflight

    run = RunDir(output, run_id)
    report = run_preflight(target, model, run.path, eval_data=eval_data, gates=load_gates(gates))
    finish(report, as_json, run)


@app.command("handoff")
def handoff_command(
    model: Annotated[str, typer.Argument(help="Model directory (or preset name for a bundle only).")],
    target: TargetOpt,
    devices: Annotated[int, typer.Option("--devices", "-d", help="Devices in total.")] = 8,
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="Nodes.")] = 1,
    force: Annotated[bool, typer.Option(
        "--force", help="Hand off although gates 1-4 did not pass (recorded).")] = False,
    engine: Annotated[str, typer.Option(
        "--engine", help="Serving engine: vllm (bundle, --launch) or sglang (launch commands).")] = "vllm",
    validate_args: Annotated[bool, typer.Option(
        "--validate", help="Check the commands with the engine's own argument parser.")] = False,
    launch: Annotated[bool, typer.Option(
        "--launch", help="Start vllm serve here and run the smoke test.")] = False,
    vllm: Annotated[str | None, typer.Option("--vllm", help="vllm executable (default: found).")] = None,
    port: Annotated[int | None, typer.Option(
        "--port", help="Server port for --launch (default: a free one).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Greedy tokens per prompt.")] = 16,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16 for --launch.")] = "float32",
    memory_fraction: Annotated[float, typer.Option(
        "--memory-fraction", help="--gpu-memory-utilization on a CPU launch (host memory).")] = 0.1,
    output: OutputOpt = Path("reports"), run_id: RunOpt = None, gates: GatesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Hand-off: vLLM bundle (--launch serves it here and compares tokens), or SGLang launch commands."""
    from adapt.handoff.bundle import run_handoff
    from adapt.report import load_gates

    if dtype not in ("float32", "bfloat16"):
        raise InputError(f"expected float32 or bfloat16, got {dtype!r}", field="--dtype")
    if run_id is None:
        raise InputError("--run is required: the hand-off reads the run's gate reports", field="--run")
    if engine not in ("vllm", "sglang"):
        raise InputError(f"expected vllm or sglang, got {engine!r}", field="--engine")
    run = RunDir(output, run_id)
    if engine == "sglang":
        from adapt.handoff.sglang import write_sglang_bundle

        if launch:
            raise InputError("--launch starts vLLM only", field="--launch", hint="drop --launch with --engine sglang")
        report, files = write_sglang_bundle(model, target=target, devices=devices, nodes=nodes, run=run,
                                            force=force, validate=validate_args)
        finish(report, as_json, run, extra=files)
    report, files, log_tail = run_handoff(
        model, target=target, devices=devices, nodes=nodes, run=run, gates=load_gates(gates), force=force,
        validate=validate_args, launch=launch, vllm=vllm, port=port, max_tokens=max_tokens, dtype=dtype,
        memory_fraction=memory_fraction)
    if log_tail:
        err_console.print("[red]vllm serve, last log lines:[/red]")
        err_console.print("\n".join(log_tail), markup=False, highlight=False)
    finish(report, as_json, run, extra=files)


@app.command("run")
def run_command(
    model: Annotated[str, typer.Argument(
        help="Checkpoint directory or a tiny model (tiny-dsa, tiny-oss, tiny-qwen3, tiny-dsa-fp8).")],
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", help="Prompt text (repeat for a batch).")] = None,
    token_ids: Annotated[list[str] | None, typer.Option(
        "--token-ids", help="Prompt as comma-separated token ids (repeat for a batch).")] = None,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", min=1, help="Tokens to generate.")] = 32,
    layers: Annotated[str | None, typer.Option(
        "--layers", help="Decoder layers: a count N or a list such as 0,3,60 (default: all).")] = None,
    kernels: Annotated[str, typer.Option(
        "--kernels", help="none, all, or a comma list of attention, indexer, moe, norm_rope.")] = "none",
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype: bfloat16 or float32.")] = "bfloat16",
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    moe_workspace: Annotated[int, typer.Option(
        "--moe-workspace", min=0, help="With the moe kernel: experts per chunk of the shared FP8 workspace "
        "(online MXFP4 -> FP8 of active experts, fp8 GEMMs); 0 runs the planar MXFP4 GEMMs, bf16 activations. "
        "Either way the expert bytes are held once.")] = 0,
    as_json: JsonOpt = False,
    image: Annotated[Path | None, typer.Option(
        "--image", help="Image file for a multimodal model (llama4: one tile; kimi_k25: native resolution), "
        "placed before each prompt.")] = None,
) -> None:
    """Generate with adapt's runtime (torch reference or adapt kernels per op family), any depth."""
    if image is not None or _reference_family(model):
        _run_reference(model, token_ids, prompt, max_new_tokens, layers, dtype, image, as_json)
        return
    from adapt.runtime.engine import prepare_triton

    prepare_triton()
    from rich.progress import Progress

    from adapt.runtime.engine import run_prompts

    with Progress(console=err_console, disable=as_json) as progress:
        tasks = {phase: progress.add_task(phase, total=None) for phase in ("prefill", "decode")}

        def tick(phase: str, done: int, total: int, seconds: float) -> None:
            rate = done / seconds if seconds > 0 else 0.0
            progress.update(tasks[phase], completed=done, total=total,
                            description=f"{phase} {done}/{total} tokens, {rate:,.1f} tok/s")

        summary = run_prompts(model, prompt or [], token_ids or [], max_new_tokens=max_new_tokens, layers=layers,
                              kernels=kernels, dtype=dtype, device=device, temperature=temperature, seed=seed,
                              moe_workspace=moe_workspace, progress=tick)
    rows = summary["sequences"]
    if as_json:
        print_json(summary)
        return
    for reason_key, reason in summary["kernel_refusals"].items():
        err_console.print(f"[yellow]{escape(reason_key)} runs the torch path:[/yellow] {escape(str(reason))}")
    for index, row in enumerate(rows):
        console.print(f"[bold]sequence {index}[/bold] ({row['prompt_tokens']} prompt tokens): "
                      f"{row['tokens']}")
        if row["text"] is not None:
            console.print(repr(row["text"]), markup=False, highlight=False)


def _reference_family(model: str) -> bool:
    from adapt.runtime.families import uses_reference_path

    path = Path(model)
    return path.is_dir() and uses_reference_path(path)


def _run_reference(model, token_ids, prompt, max_new_tokens, layers, dtype, image, as_json) -> None:
    """`adapt run` for qwen3_next, llama4 and image prompts of kimi_k25 (adapt.runtime.families): token ids
    in, tokens out."""
    import torch

    from adapt.runtime.engine import parse_layers
    from adapt.runtime.families import generate_reference

    if prompt or not token_ids:
        raise InputError("this model runs on the tokenizer-free reference path: give --token-ids",
                         field="--prompt", hint="e.g. --token-ids 5,17,99")
    if image is not None and not image.is_file():
        raise InputError("no such image file", file=str(image), field="--image")
    try:
        prompts = [[int(x) for x in ids.split(",")] for ids in token_ids]
    except ValueError:
        raise InputError("expected comma-separated integers", field="--token-ids") from None
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in dtypes:
        raise InputError(f"expected bfloat16 or float32, got {dtype!r}", field="--dtype")
    from adapt.model.spec import load_spec

    chosen = parse_layers(layers, load_spec(Path(model)).num_layers) if layers else None
    summary = generate_reference(Path(model), prompts, max_new_tokens, chosen, image, dtypes[dtype])
    if as_json:
        print_json(summary)
        return
    for index, row in enumerate(summary["sequences"]):
        console.print(f"[bold]sequence {index}[/bold] ({row['prompt_tokens']} prompt tokens"
                      + (f", {summary['image_tokens']} of them the image" if summary["image_tokens"] else "")
                      + f"): {row['tokens']}")


def _no_status():
    import contextlib

    return contextlib.nullcontext()


@bench_app.command("kernels")
def bench_kernels(
    moe: Annotated[bool, typer.Option(
        "--moe", help="MXFP4 MoE expert kernels (DeepSeek-V3 and gpt-oss shapes).")] = False,
    dsa: Annotated[bool, typer.Option("--dsa", help="DeepSeek Sparse Attention (indexer, top-k, sparse MLA).")] = False,
    tokens: Annotated[list[int] | None, typer.Option("--tokens", help="MoE token counts (repeatable).")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the results.")] = Path("benchmarks"),
    as_json: JsonOpt = False,
) -> None:
    """Time adapt's kernels on this GPU beside same-run ceilings and torch baselines (needs CUDA)."""
    import torch

    if not (moe or dsa):
        raise InputError("choose what to benchmark", field="--moe/--dsa", hint="pass --moe, --dsa or both")
    if not torch.cuda.is_available():
        raise InputError("kernel benchmarks need a CUDA GPU; none is visible here",
                         hint="run `make bench-gpu` on the target machine")
    reports = {}
    if moe:
        from adapt.stages.bench_moe import moe_report, run_moe_bench

        reports["moe"] = moe_report(run_moe_bench(output / "moe", tokens or None))
    if dsa:
        from adapt.stages.bench_dsa import dsa_report, run_dsa_bench

        reports["dsa"] = dsa_report(run_dsa_bench(output / "dsa"))
    if as_json:
        print_json({name: report.to_dict() for name, report in reports.items()})
    else:
        for report in reports.values():
            render_report(report)
        console.print(f"results and reports written under {output}")
    raise typer.Exit(max(report.exit_code for report in reports.values()))


@bench_app.command("serve")
def bench_serve(
    model: Annotated[str, typer.Argument(
        help="Model directory to serve here, or (with --url) the served model's name.")],
    target: TargetOpt,
    url: Annotated[str | None, typer.Option(
        "--url", help="An OpenAI-compatible server to load instead of launching the model.")] = None,
    served_model: Annotated[str | None, typer.Option(
        "--served-model", help="With --url: the model name the server answers to (default: MODEL).")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="Tokenizer path or id for the load generator (default: MODEL's; a byte-level "
                            "stand-in when MODEL is a directory without one).")] = None,
    server_pid: Annotated[int | None, typer.Option(
        "--server-pid", help="With --url: the server's root process id, to sample its memory.")] = None,
    checkpoint: Annotated[str | None, typer.Option(
        "--checkpoint", help="With --url: the checkpoint directory the server should serve (checked through "
                             "/v1/models and greedy tokens against adapt's runtime).")] = None,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens of long-in workloads.")] = 256,
    output_len: Annotated[int, typer.Option("--output-len", help="Output tokens of long-out workloads.")] = 64,
    concurrency: Annotated[list[int] | None, typer.Option(
        "--concurrency", "-c", help="Concurrency sweep (repeatable; default 1, 4, 16).")] = None,
    prompts: Annotated[int, typer.Option("--prompts", help="Requests per sweep point.")] = 16,
    soak_s: Annotated[float | None, typer.Option("--soak-s", help="Soak seconds (default 60).")] = 60.0,
    soak_requests: Annotated[int, typer.Option(
        "--soak-requests", help="Soak length in requests when --soak-s is 0.")] = 200,
    soak_concurrency: Annotated[int, typer.Option("--soak-concurrency", help="Requests in flight in the soak.")] = 4,
    sample_interval: Annotated[float, typer.Option(
        "--sample-interval", help="Seconds between memory samples.")] = 1.0,
    max_model_len: Annotated[int, typer.Option("--max-model-len", help="Context of the launched server.")] = 2048,
    kv_cache_mib: Annotated[int | None, typer.Option(
        "--kv-cache-mib", help="KV pool of the launched server (MiB); default: vLLM's.")] = None,
    vllm: Annotated[str | None, typer.Option("--vllm", help="vllm executable (default: found).")] = None,
    output: OutputOpt = Path("reports"), run_id: RunOpt = None, gates: GatesOpt = None, as_json: JsonOpt = False,
) -> None:
    """Stage 6: load (vllm bench serve), soak with leak detection, edge probes, prediction vs measurement."""
    from adapt.report import load_gates
    from adapt.stages.pipeline import stamp_bench_serve
    from adapt.stages.serve import ServeOptions, run_serve_stage

    run = RunDir(output, run_id)
    options = ServeOptions(input_len=input_len, output_len=output_len, concurrencies=concurrency or [1, 4, 16],
                           prompts=prompts, soak_s=soak_s or None, soak_requests=soak_requests,
                           soak_concurrency=soak_concurrency, sample_interval_s=sample_interval)
    thresholds = load_gates(gates)
    report = run_serve_stage(model, target=target, run_path=run.path, gates=thresholds, options=options,
                             url=url, served_model=served_model, tokenizer=tokenizer, server_pid=server_pid,
                             checkpoint=checkpoint,
                             max_model_len=max_model_len, vllm=vllm,
                             kv_cache_bytes=kv_cache_mib * 2**20 if kv_cache_mib else None)
    # tied to the checkpoint launched, or (--url) to the one the identity check showed the server serves
    stamp_bench_serve(report, model, target=target, run_path=run.path, gates=thresholds, soak_s=soak_s or 0.0,
                      url=url, served_model=served_model, checkpoint=checkpoint,
                      extra_options=dict(input_len=input_len, output_len=output_len, concurrency=concurrency,
                                         prompts=prompts, soak_requests=soak_requests,
                                         soak_concurrency=soak_concurrency, max_model_len=max_model_len,
                                         kv_cache_mib=kv_cache_mib))
    finish(report, as_json, run)


@bench_app.command("runtime")
def bench_runtime(
    model: Annotated[list[str] | None, typer.Option(
        "--model", "-m", help="deepseek-v3.2 (layers 0, 3) and/or gpt-oss-120b (layers 0, 1); default both.")] = None,
    batch: Annotated[list[int] | None, typer.Option("--batch", "-b", help="Batch sizes (default 1, 16, 64).")] = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=1, help="Prompt tokens per sequence.")] = 128,
    decode_steps: Annotated[int, typer.Option("--decode-steps", min=1, help="Timed decode steps.")] = 16,
    kernels: Annotated[str, typer.Option("--kernels", help="none, all, or a comma list of op families.")] = "all",
    device: Annotated[str, typer.Option("--device", help="cuda, or cpu with --tiny for a dry run.")] = "cuda",
    tiny: Annotated[bool, typer.Option("--tiny", help="Reduced width (dry run of the same code path).")] = False,
    budget_s: Annotated[float, typer.Option("--budget-s", help="Seconds after which points are skipped.")] = 150.0,
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the results.")] = Path("benchmarks"),
    gates: GatesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Runtime at real width and reduced depth: prefill and decode tokens/s beside the layers' roofline."""
    from adapt.bench.runtime import LAYERS, run_runtime_bench
    from adapt.report import load_gates
    from adapt.runtime.engine import parse_kernels

    models = model or list(LAYERS)
    unknown = [m for m in models if m not in LAYERS]
    if unknown:
        raise InputError(f"unknown model {unknown[0]!r}", field="--model", hint=f"choose from {', '.join(LAYERS)}")
    if device not in ("cuda", "cpu"):
        raise InputError(f"expected cuda or cpu, got {device!r}", field="--device")
    parse_kernels(kernels)
    report = run_runtime_bench(models, batches=batch or [1, 16, 64], prompt_tokens=prompt_tokens,
                               decode_steps=decode_steps, kernels=kernels, device=device, tiny=tiny,
                               budget_s=budget_s, gates=load_gates(gates), out_dir=output,
                               progress=lambda message: typer.echo(f"bench runtime: {message}", err=True))
    finish(report, as_json)


@app.command()
def demo(
    output: OutputOpt = Path("reports"),
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Tokens to generate.")] = 8,
    as_json: JsonOpt = False,
) -> None:
    """Run stages 1-5 on the embedded tiny DeepSeek-V3.2 model (tiny-dsa) into <output>/demo/."""
    from adapt.stages.demo import run_demo

    say = (lambda text: None) if as_json else (lambda text: console.print(f"[cyan]demo:[/cyan] {escape(text)}"))
    summary = run_demo(output, say, on_report=(lambda r: None) if as_json else render_report, tokens=tokens)
    if as_json:
        print_json(summary)
    else:
        for label, generation in summary.get("generations", {}).items():
            console.print(f"{label}: {generation['tokens']} {generation['text']!r}", markup=False, highlight=False)
        if "generations" in summary:
            agree = "agree" if summary["runtime_paths_agree"] else "DIFFER"
            console.print(f"reference and kernel paths {agree}; reports in {summary['run']}", markup=False)
        if "precision_plot" in summary:
            console.print(f"precision plot: {summary['precision_plot']}", markup=False, highlight=False)
    failed = any(v in ("fail", "unmeasured") for v in summary["gates"].values())
    failed = failed or not summary.get("runtime_paths_agree", False)
    raise typer.Exit(1 if failed else 0)


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Argument(help="Model directory or tiny model name.")],
    tasks: Annotated[str, typer.Option("--tasks", help="Comma list: adapt_mc, adapt_cloze, adapt_text, "
                                                         "adapt_completion, adapt_humaneval, or lm-eval task "
                                                         "names.")] = "adapt_mc,adapt_cloze,adapt_text",
    kernels: Annotated[str, typer.Option("--kernels", help="Adapted path: op families on adapt's kernels.")] = "all",
    compute_dtype: Annotated[str, typer.Option("--compute-dtype", help="Adapted path: bf16 or fp32.")] = "bf16",
    weights: WeightsOpt = "as-stored",
    indexer_dtype: Annotated[str, typer.Option("--indexer-dtype", help="Adapted path: fp8 or bf16.")] = "fp8",
    kv_dtype: KvDtypeOpt = "bf16",
    endpoint: Annotated[str | None, typer.Option(
        "--endpoint", help="Evaluate a served OpenAI-compatible endpoint (http://host:port) instead.")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Start vLLM here for the model and evaluate it.")] = False,
    limit: Annotated[int | None, typer.Option("--limit", help="Documents per task.")] = None,
    max_drop: Annotated[list[str] | None, typer.Option(
        "--max-drop", help="TASK=VALUE: allowed drop (points, or relative for perplexity) for one task.")] = None,
    allow_code_execution: Annotated[bool, typer.Option(
        "--allow-code-execution", help="Run the code that code tasks (adapt_humaneval) generate.")] = False,
    gates: GatesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run lm-eval tasks on the float32 reference and on the adapted path (or an endpoint); apply the drop rule."""
    from adapt.eval.compare import run_eval
    from adapt.report import load_gates

    overrides = {}
    for item in max_drop or []:
        task, _, value = item.partition("=")
        try:
            overrides[task] = float(value)
        except ValueError:
            raise InputError(f"expected TASK=NUMBER, got {item!r}", field="--max-drop") from None
    report = run_eval(model, [t.strip() for t in tasks.split(",") if t.strip()], gates=load_gates(gates),
                      kernels=kernels, dtype=compute_dtype, weights=weights, indexer_dtype=indexer_dtype,
                      kv_dtype=kv_dtype, endpoint=endpoint, serve=serve, limit=limit, overrides=overrides,
                      allow_code_execution=allow_code_execution)
    if as_json:
        print_json(report.to_dict())
    else:
        render_report(report)
    raise typer.Exit(report.exit_code)


def main() -> None:
    """Console entry point (exit codes: 0 pass, 1 gate failed, 2 bad input or usage,
    130/143 interrupted by SIGINT/SIGTERM).

    Usage errors are one line on stderr. SIGINT and SIGTERM print one "interrupted" line at any
    moment and exit 128 + the signal; no report is written after the signal (``RunDir.write``
    checks for it), even when the signal's exception was swallowed somewhere inside a stage.
    """
    import os
    import shutil

    from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer 0.29 vendors click here

    from adapt.errors import Interrupted, install_interrupt_handlers, interrupt_received

    install_interrupt_handlers()
    if not shutil.which("nvidia-smi"):
        # no GPU: adapt's Triton kernels run under the interpreter; triton reads this once, at import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        code = app(standalone_mode=False)
    except Interrupted as exc:
        code = exc.exit_code
    except NoArgsIsHelpError as exc:
        sys.stdout.write(exc.ctx.get_help() + "\n" if exc.ctx else "")
        code = EXIT_BAD_INPUT
    except UsageError as exc:
        where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
        sys.stderr.write(f"error: {' '.join(exc.format_message().split())}{where}\n")
        code = EXIT_BAD_INPUT
    except typer.Abort:
        code = 1
    signum = interrupt_received()
    if signum is not None:
        sys.stderr.write("interrupted\n")
        code = 128 + signum
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
