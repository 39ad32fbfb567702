"""`adapt demo`: the whole pipeline on the embedded tiny DeepSeek-V3.2 model, on this machine.

Builds tiny-dsa (deterministic, through transformers' own classes), describes it, runs the
gates 1-4 for the ``cpu`` target into ``reports/demo/``, then generates a few tokens with
adapt's runtime on the reference path and on adapt's kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapt.report import RunDir, StageReport, load_gates
from adapt.stages.pipeline import PipelineOptions, validate

DEMO_MODEL = "tiny-dsa"
DEMO_PROMPT = "the quick brown fox"


def run_demo(output: Path, say: Callable[[str], None], on_report: Callable[[StageReport], None],
             tokens: int = 8) -> dict[str, Any]:
    """Run the demo; returns a summary (model dir, gate verdicts, generated tokens)."""
    from adapt.model.tiny import tiny_path
    from adapt.stages.info import describe_model

    say(f"building {DEMO_MODEL} (cached after the first run)")
    model_dir = str(tiny_path(DEMO_MODEL))
    facts = describe_model(model_dir)
    say(f"{DEMO_MODEL}: {facts['model_type']}, {facts['layers']} layers, "
        f"{facts['parameters']['total']:,} parameters, checkpoint {facts['checkpoint']['total_bytes']:,} bytes")
    run = RunDir(output, "demo")
    options = PipelineOptions(model=model_dir, target="cpu", devices=1, nodes=1, context=256, batch=2)
    reports = validate(4, options, run, load_gates(), on_report=on_report)
    summary: dict[str, Any] = {"model": model_dir, "run": str(run.path),
                               "gates": {r.stage: r.verdict for r in reports}}
    if any(r.verdict == "fail" for r in reports):
        return summary
    from adapt.runtime.engine import Engine

    generations = {}
    for kernels in ("reference", "adapt"):
        say(f"generating {tokens} tokens with the runtime, kernels={kernels}")
        engine = Engine.load(model_dir, kernels=kernels)
        generations[kernels] = engine.generate_text(DEMO_PROMPT, max_new_tokens=tokens)
    summary["generations"] = generations
    summary["runtime_paths_agree"] = generations["reference"] == generations["adapt"]
    return summary
