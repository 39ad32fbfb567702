"""Stage 4 parallel solver: enumeration, divisibility, memory filter, node placement, ranking, hand-off."""

import json
import shlex

import pytest
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.plan.layout import Layout, layout_problems
from adapt.report import load_gates
from adapt.stages.parallel import (
    crosses_nodes,
    enumerate_layouts,
    plan_parallel,
    run_plan_parallel,
)
from adapt.targets.target import load_target

runner = CliRunner()
ENGINE_KEYS = {
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
}


def _is_recipe(plan) -> bool:
    """The vLLM DeepSeek-V3.2 recipe's layouts: `-tp 8`, or `-dp 8 --enable-expert-parallel`."""
    layout = plan.layout
    return layout.pp == 1 and (layout.tp == 8 or (layout.dp == 8 and layout.expert_parallel))


@pytest.mark.parametrize("context, batch", [(4096, 1), (32_768, 8), (131_072, 4)])
def test_deepseek_v32_on_8_h200_picks_a_recipe_layout(specs, h200, context, batch):
    result = plan_parallel(specs["deepseek-v3.2"], h200, devices=8, context=context, batch=batch)
    assert _is_recipe(result.best)
    labels = {p.label for p in result.feasible}
    assert {"TP8", "TP1 x DP8 x EP8"} <= labels
    assert set(result.engine_args) == ENGINE_KEYS
    assert result.engine_args["max_model_len"] == context


@pytest.mark.parametrize("context, batch", [(8192, 64), (32_768, 32), (163_840, 8), (2048, 256)])
def test_deepseek_v32_first_choice_is_a_recipe_across_batches(specs, h200, context, batch):
    # hybrids (TP4 x DP2 x EP8 ...) come within a few percent here; the simpler recipe wins the tie
    assert _is_recipe(plan_parallel(specs["deepseek-v3.2"], h200, devices=8, context=context, batch=batch).best)


def test_deepseek_v32_does_not_fit_8_h100(specs, h100):
    result = plan_parallel(specs["deepseek-v3.2"], h100, devices=8, context=8192, batch=1)
    assert result.feasible == [] and result.engine_args == {}
    assert all(p.reason for p in result.rejected)
    assert any("memory" in p.reason for p in result.rejected)


def test_every_rejection_has_a_reason_and_every_layout_is_considered(specs, h200):
    result = plan_parallel(specs["gpt-oss-120b"], h200, devices=8, context=8192, batch=4)
    considered = {p.label for p in result.feasible} | {p.label for p in result.rejected}
    assert considered == {layout.label() for layout in enumerate_layouts(specs["gpt-oss-120b"], 8)}
    assert all(p.reason for p in result.rejected)
    assert all(p.cost is not None and p.memory.fits for p in result.feasible)


def test_divisibility_rules(specs):
    deepseek, qwen = specs["deepseek-v3.2"], specs["qwen3-30b-a3b"]
    assert layout_problems(deepseek, Layout(tp=8)) == []
    # fp8 block 128: the 2048-wide expert splits into 64 at TP32
    assert any("fp8 weight block" in p for p in layout_problems(deepseek, Layout(tp=32)))
    with_ep = layout_problems(deepseek, Layout(tp=32, expert_parallel=True))
    assert not any("the expert intermediate" in p for p in with_ep)  # EP keeps experts whole
    assert any("dense FFN intermediate size 18432 into 576" in p for p in with_ep)
    assert any("attention heads" in p for p in layout_problems(qwen, Layout(tp=3)))
    assert any("routed experts" in p for p in layout_problems(qwen, Layout(tp=1, dp=3, expert_parallel=True)))
    assert any("layers" in p for p in layout_problems(qwen, Layout(pp=64)))


def test_cross_node_plans_only_when_one_node_cannot_hold_the_model(specs, h100, h200):
    small = plan_parallel(specs["qwen3-30b-a3b"], h200, devices=16, nodes=2, context=8192, batch=16)
    assert small.single_node_fits
    assert all(not crosses_nodes(p.layout, 8, 2) for p in small.feasible)
    assert any("spans nodes" in p.reason for p in small.rejected)
    big = plan_parallel(specs["deepseek-v3.2"], h100, devices=16, nodes=2, context=8192, batch=1)
    assert not big.single_node_fits
    assert big.feasible and crosses_nodes(big.best.layout, 8, 2)
    # the cheapest cross-node traffic wins: TP inside the node, pipeline hand-off across it
    assert big.best.layout.tp == 8 and big.best.layout.pp == 2


def test_ranking_prefers_less_traffic_when_memory_allows(specs, h200):
    result = plan_parallel(specs["mixtral-8x7b"], h200, devices=8, context=4096, batch=1)
    steps = [p.cost.decode_step_s for p in result.feasible]
    assert steps == sorted(steps)
    slow_links = load_target("h200")
    assert result.best.cost.decode_step_s <= min(p.cost.decode_step_s for p in result.feasible)
    assert slow_links.intra_node_bandwidth > slow_links.inter_node_bandwidth


def test_gpt_oss_one_h100_raises_utilization_with_a_warning(specs, h100):
    result = plan_parallel(specs["gpt-oss-120b"], h100, devices=1, context=8192, batch=1)
    assert result.raised_utilization
    assert 0.9 < result.engine_args["gpu_memory_utilization"] <= 0.95
    pinned = plan_parallel(
        specs["gpt-oss-120b"], h100, devices=1, context=8192, batch=1, gpu_memory_utilization=0.9
    )
    assert pinned.feasible == []


def test_report_has_serve_command_and_ray_steps(tmp_path):
    report = run_plan_parallel(
        "deepseek-v3.2", "h100-sxm", gates=load_gates(), devices=16, nodes=2, context=8192, batch=1
    )
    metrics = report.metrics
    args = metrics["engine_args"]
    assert set(args) == ENGINE_KEYS
    argv = metrics["serve_command"]
    assert argv[:3] == ["vllm", "serve", "deepseek-v3.2"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == str(args["tensor_parallel_size"])
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    steps = metrics["ray_steps"]
    assert any(s.startswith("ray start --head --port=6379") for s in steps)
    assert any(s.startswith("ray start --address=<head-ip>:6379") for s in steps)
    serve = [s for s in steps if s.startswith("vllm serve")]
    assert len(serve) == 1 and "--distributed-executor-backend ray" in serve[0]
    assert report.decide() == "pass"


def test_single_node_report_has_no_ray_steps():
    report = run_plan_parallel("qwen3-30b-a3b", "h200", gates=load_gates(), devices=8, context=8192, batch=8)
    assert "ray_steps" not in report.metrics
    assert shlex.join(report.metrics["serve_command"]).startswith("vllm serve qwen3-30b-a3b")


def test_no_plan_fails_the_gate():
    report = run_plan_parallel(
        "deepseek-v3.2", "h100-sxm", gates=load_gates(), devices=8, context=8192, batch=1
    )
    assert report.decide() == "fail"
    assert report.metrics["engine_args"] == {} and report.metrics["serve_command"] == []


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(devices=12, nodes=1), "--devices"),
        (dict(devices=9, nodes=2), "--devices"),
        (dict(devices=8, context=10**6), "--context"),
    ],
)
def test_bad_flags(specs, h200, kwargs, flag):
    args = dict(context=4096, batch=1) | kwargs
    with pytest.raises(InputError) as err:
        plan_parallel(specs["qwen3-30b-a3b"], h200, **args)
    assert err.value.field == flag


def test_cli_json_and_exit_codes(tmp_path):
    ok = runner.invoke(
        app,
        [
            "plan-parallel",
            "deepseek-v3.2",
            "--target",
            "h200",
            "--devices",
            "8",
            "--context",
            "32768",
            "--batch",
            "8",
            "--json",
            "--output",
            str(tmp_path),
            "--run",
            "p",
        ],
    )
    assert ok.exit_code == 0
    data = json.loads(ok.stdout)
    assert data["stage"] == "parallel" and data["number"] == 4
    assert set(data["metrics"]["engine_args"]) == ENGINE_KEYS
    assert (tmp_path / "p" / "parallel.json").is_file() and (tmp_path / "p" / "parallel.launch.sh").is_file()
    failed = runner.invoke(
        app,
        [
            "plan-parallel",
            "deepseek-v3.2",
            "--target",
            "h100-sxm",
            "--devices",
            "8",
            "--context",
            "8192",
            "--output",
            str(tmp_path),
        ],
    )
    assert failed.exit_code == 1
    for bad in (
        ["--target", "nope", "--devices", "8"],
        ["--target", "h200", "--devices", "12"],
        ["--target", "h200", "--devices", "8", "--context", "9999999"],
    ):
        result = runner.invoke(
            app, ["plan-parallel", "deepseek-v3.2", "--context", "4096", "--output", str(tmp_path), *bad]
        )
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output


def test_decode_context_parallel_for_long_contexts(specs, h100):
    qwen = specs["qwen3-30b-a3b"]  # 4 KV heads: TP8 holds every KV head twice
    assert not any(layout.dcp > 1 for layout in enumerate_layouts(qwen, 8, context=8192))
    long = [layout for layout in enumerate_layouts(qwen, 8, context=40_960) if layout.dcp > 1]
    assert long and all(layout.tp == 8 and layout.dcp == 2 for layout in long)
    assert any("DSA" in p for p in layout_problems(specs["deepseek-v3.2"], Layout(tp=8, dcp=2)))
    assert layout_problems(qwen, Layout(tp=8, dcp=4)) != []
    result = plan_parallel(qwen, h100, devices=8, context=40_960, batch=64)
    plain = next(p for p in result.feasible + result.rejected if p.label == "TP8")
    striped = next(p for p in result.feasible if p.label == "TP8 x DCP2")
    assert striped.memory.kv_bytes_per_sequence * 2 == plain.memory.kv_bytes_per_sequence
    assert striped.memory.concurrent_sequences > plain.memory.concurrent_sequences


def test_extra_engine_args_reach_the_serve_command():
    report = run_plan_parallel(
        "qwen3-30b-a3b", "h200", gates=load_gates(), devices=8, context=131_072, batch=1, rope_factor=4.0
    )
    extra = report.metrics["extra_engine_args"]
    assert extra["hf_overrides"]["rope_scaling"]["factor"] == 4.0
    assert set(report.metrics["engine_args"]) == ENGINE_KEYS
    argv = report.metrics["serve_command"]
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == extra["hf_overrides"]
