"""`adapt demo`: the whole pipeline on the embedded tiny DeepSeek-V3.2 model, on this machine.

Builds tiny-dsa (deterministic, through transformers' own classes), describes it, runs the
gates 1-5 for the ``cpu`` target into ``reports/demo/`` (stage 5: adapt's kernels, FP8 experts,
indexer and KV cache in bf16 against the float32 reference, with its per-layer error plot), then
generates a few greedy tokens with
adapt's runtime twice: on the torch reference paths and on adapt's kernels (the Triton
interpreter on a CPU), and says whether the two agree.
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
    options = PipelineOptions(model=model_dir, target="cpu", devices=1, nodes=1, context=256, batch=2,
                              kv_dtype="fp8", weights="fp8", kernels="all", indexer_dtype="fp8",
                              compute_dtype="bf16", run_path=str(run.path))
    say("stage 5 runs adapt's Triton kernels under the CPU interpreter: about a minute")
    reports = validate(5, options, run, load_gates(), on_report=on_report)
    summary: dict[str, Any] = {"model": model_dir, "run": str(run.path),
                               "gates": {r.stage: r.verdict for r in reports}}
    plot = next((r.metrics.get("layer_error_plot") for r in reports if r.stage == "precision"), None)
    if plot:
        summary["precision_plot"] = plot
        say(f"precision plot (per-layer error growth): {plot}")
    if any(r.verdict in ("fail", "unmeasured") for r in reports):
        return summary
    import torch

    from adapt.runtime.engine import Engine, encode_prompts

    prompts, tokenizer = encode_prompts(Path(model_dir), [DEMO_PROMPT], [])
    generations = {}
    for kernels in ("none", "all"):
        label = "torch reference" if kernels == "none" else "adapt kernels"
        say(f"generating {tokens} tokens with adapt's runtime ({label})")
        engine = Engine.load(model_dir, kernels=kernels, dtype=torch.float32,
                             max_tokens=len(prompts[0]) + tokens + 64)
        result = engine.generate(prompts, tokens)
        generations[label] = {"tokens": result.tokens[0], "text": tokenizer.decode(result.tokens[0])}
    summary["generations"] = generations
    summary["runtime_paths_agree"] = len({tuple(g["tokens"]) for g in generations.values()}) == 1
    return summary
