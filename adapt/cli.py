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

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Target name (see `adapt targets`) or a YAML path.")]
RunOpt = Annotated[str | None, typer.Option("--run", help="Run id: reports go to <output>/<run>/.")]
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Reports root directory.")]
GatesOpt = Annotated[Path | None, typer.Option("--gates", help="YAML file overriding gate thresholds.")]


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def render_report(report: StageReport) -> None:
    """A stage report in the terminal: verdict, metrics, tables, findings."""
    verdict = report.decide()
    color = {"pass": "green", "warn": "yellow", "fail": "red"}[verdict]
    console.print(f"[bold]Stage {report.number}: {report.title}[/bold]  [{color}]{verdict.upper()}[/{color}]")
    if report.summary:
        console.print(report.summary)
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
        hint = f"  [dim]({f.hint})[/dim]" if f.hint else ""
        console.print(f"[{style}]{f.severity:5}[/{style}] {f.code}: {f.message}{hint}")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


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
            console.print(f"[dim]reports: {run.path}[/dim]")
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


def main() -> None:
    """Console entry point (exit codes: 0 pass, 1 gate failed, 2 bad input or usage)."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
