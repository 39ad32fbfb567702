"""Stage 2 memory planner: published facts (shared/configs/README.md), vLLM accounting, layouts, CLI."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.model.spec import spec_from_config
from adapt.plan.layout import (
    GiB,
    Layout,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    plan_memory,
    pp_stages,
)
from adapt.report import load_gates
from adapt.stages.memory import run_plan_memory

runner = CliRunner()


# ----------------------------------------------------------------- published facts


def test_gpt_oss_weights_as_stored_are_the_published_bytes(specs, h100):
    plan = plan_memory(specs["gpt-oss-120b"], h100, devices=1, context=8192, batch=1)
    assert plan.terms["weights"] == 65_248_815_744
    assert plan.weights_source == "model spec"


def test_gpt_oss_on_one_h100_needs_utilization_near_095(specs, h100):
    spec = specs["gpt-oss-120b"]
    default = plan_memory(spec, h100, devices=1, context=8192, batch=1)
    assert default.gpu_memory_utilization == 0.9
    assert default.verdict == "does-not-fit"
    assert default.kv_pool_bytes < default.kv_bytes_per_sequence
    assert 0.9 < default.min_gpu_memory_utilization <= 0.95
    raised = plan_memory(spec, h100, devices=1, context=8192, batch=1, gpu_memory_utilization=0.95)
    assert raised.verdict == "fits"
    assert raised.kv_pool_bytes > 0


def test_gpt_oss_full_context_kv_does_not_fit_one_h100_with_defaults(specs, h100):
    plan = plan_memory(specs["gpt-oss-120b"], h100, devices=1, context=131_072, batch=1)
    assert plan.verdict == "does-not-fit"
    assert plan.longest_context == 0
    # 18 full-attention layers x 8 KV heads x (64 + 64) x 2 B, sliding layers bounded by 128 tokens
    assert plan.kv_bytes_per_token["full"] == 18 * 8 * 128 * 2
    assert plan.kv_bytes_per_sequence < 131_072 * 36_864 + 18 * 8 * 128 * 2 * 256


def test_qwen3_kv_for_262144_tokens_is_24_gib(specs):
    spec = specs["qwen3-30b-a3b"]
    per_token = kv_bytes_per_token(spec, Layout(), "bf16")
    assert per_token["full"] == 48 * 4 * 128 * 2 * 2 == 98_304
    assert kv_bytes_per_sequence(spec, Layout(), "bf16", 262_144, 64) == 24 * GiB
    assert kv_bytes_per_sequence(spec, Layout(), "fp8", 262_144, 64) == 12 * GiB


def test_deepseek_v32_kv_and_indexer_bytes(specs):
    spec = specs["deepseek-v3.2"]
    bf16 = kv_bytes_per_token(spec, Layout(tp=8), "bf16")
    fp8 = kv_bytes_per_token(spec, Layout(tp=8), "fp8")
    assert bf16["mla_latent"] == 70_272  # (512 + 64) x 61 x 2, replicated on every TP rank
    assert fp8["mla_latent"] == 656 * 61
    assert bf16["dsa_indexer"] == fp8["dsa_indexer"] == 8_052
    assert bf16["full"] == bf16["sliding"] == 0


def test_deepseek_v32_fits_8_h200_not_8_h100(specs, h100, h200):
    spec = specs["deepseek-v3.2"]
    for layout in (dict(tp=8), dict(tp=1, dp=8, ep=8)):
        assert plan_memory(spec, h200, devices=8, context=32_768, batch=8, **layout).fits
        plan = plan_memory(spec, h100, devices=8, context=8192, batch=1, **layout)
        assert plan.verdict == "does-not-fit"
        assert plan.binding_term == "weights"
    assert plan_memory(spec, h100, devices=8, context=8192, batch=1).fewest_devices == 16


# ----------------------------------------------------------------- sharding


def test_tp_shards_matrices_and_replicates_the_rest(specs, h200):
    spec = specs["qwen3-30b-a3b"]
    one = plan_memory(spec, h200, devices=1, context=4096, batch=1, search=False)
    four = plan_memory(spec, h200, devices=4, context=4096, batch=1, search=False)
    assert four.weights_by_component["norms"] == one.weights_by_component["norms"]
    assert four.weights_by_component["router"] == one.weights_by_component["router"]
    assert four.weights_by_component["routed_experts"] * 4 == one.weights_by_component["routed_experts"]
    assert four.weights_by_component["attention"] < one.weights_by_component["attention"] / 3


def test_kv_heads_replicate_when_tp_exceeds_them(specs):
    spec = specs["qwen3-30b-a3b"]  # 4 KV heads
    assert kv_bytes_per_token(spec, Layout(tp=4), "bf16")["full"] == 98_304 // 4
    assert kv_bytes_per_token(spec, Layout(tp=8), "bf16")["full"] == 98_304 // 4


def test_expert_parallel_splits_experts_and_dp_copies_attention(specs, h200):
    spec = specs["deepseek-v3.2"]
    tp8 = plan_memory(spec, h200, devices=8, context=4096, batch=8, tp=8, search=False)
    dp8 = plan_memory(spec, h200, devices=8, context=4096, batch=8, tp=1, dp=8, ep=8, search=False)
    assert dp8.weights_by_component["routed_experts"] == pytest.approx(
        tp8.weights_by_component["routed_experts"], rel=1e-6
    )
    whole = spec.weight_bytes()["attention"]
    assert dp8.weights_by_component["attention"] == whole  # DP attention: a full copy per device
    # TP splits q_b, kv_b and o; q_a and kv_a (and their norms) stay whole on every rank
    assert whole / 8 < tp8.weights_by_component["attention"] < whole / 4
    assert dp8.sequences_per_replica == 1 and tp8.sequences_per_replica == 8
    assert dp8.terms["moe_dispatch_buffers"] > 0 == tp8.terms["moe_dispatch_buffers"]


def test_pipeline_stages_follow_vllm_split():
    assert [len(r) for r in pp_stages(61, 4)] == [15, 15, 16, 15]
    assert [len(r) for r in pp_stages(36, 2)] == [18, 18]
    pp2 = [len(r) for r in pp_stages(61, 2)]
    assert sum(pp2) == 61 and pp2[-1] == 30


def test_sliding_window_layers_are_bounded_by_their_window(specs):
    spec = specs["gpt-oss-120b"]
    short = kv_bytes_per_sequence(spec, Layout(), "bf16", 1024, 64)
    long = kv_bytes_per_sequence(spec, Layout(), "bf16", 131_072, 64)
    full_growth = (131_072 - 1024) * kv_bytes_per_token(spec, Layout(), "bf16")["full"]
    assert long - short == full_growth


def test_mxfp4_online_workspace_beside_offline_fp8(specs, h200):
    plan = plan_memory(specs["deepseek-v3.2"], h200, devices=8, context=8192, batch=1, weights="mxfp4-online")
    comparison = plan.mxfp4_comparison
    assert plan.terms["mxfp4_fp8_workspace"] == comparison["online_fp8_workspace_bytes"] > 0
    assert comparison["online_expert_bytes"] < comparison["offline_fp8_expert_bytes"]
    # the workspace holds one layer's local experts, far less than an fp8 copy of all layers
    assert comparison["online_fp8_workspace_bytes"] < comparison["offline_fp8_expert_bytes"] / 10


def test_headroom_grows_only_estimated_terms(specs, h200):
    spec = specs["mixtral-8x7b"]
    none = plan_memory(spec, h200, devices=2, context=8192, batch=1, headroom=0.0, search=False)
    some = plan_memory(spec, h200, devices=2, context=8192, batch=1, headroom=0.5, search=False)
    assert none.terms["headroom"] == 0
    assert some.terms["weights"] == none.terms["weights"]
    estimated = sum(none.terms[k] for k in none.estimated_terms)
    assert some.terms["headroom"] == pytest.approx(0.5 * estimated, abs=2)
    assert some.kv_pool_bytes < none.kv_pool_bytes


def test_longest_context_is_the_boundary(specs, h100):
    spec = specs["qwen3-30b-a3b"]
    plan = plan_memory(spec, h100, devices=1, context=4096, batch=8)
    longest = plan.longest_context
    assert 4096 < longest < spec.max_position
    assert plan_memory(spec, h100, devices=1, context=longest, batch=8, search=False).fits
    assert not plan_memory(spec, h100, devices=1, context=longest + 64, batch=8, search=False).fits


# ----------------------------------------------------------------- checkpoint headers


def _tiny_qwen3_dir(tmp_path: Path) -> Path:
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "norm_topk_prob": True,
    }
    spec = spec_from_config(config, "tiny")
    tensors = {}
    for t in spec.tensors():
        if "*" in t.name:
            for e in range(t.shape[0]):
                tensors[t.name.replace("*", str(e))] = torch.zeros(t.shape[1:], dtype=torch.bfloat16)
        else:
            tensors[t.name] = torch.zeros(t.shape, dtype=torch.bfloat16)
    tensors["model.extra_buffer"] = torch.zeros(1000, dtype=torch.float32)  # an unrecognised tensor
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_directory_weights_come_from_checkpoint_headers(tmp_path):
    from adapt.model.checkpoint import Checkpoint

    model = _tiny_qwen3_dir(tmp_path)
    report = run_plan_memory(str(model), "h200", gates=load_gates(), devices=1, context=1024, batch=1)
    metrics = report.metrics
    assert metrics["weights_source"] == "checkpoint headers"
    assert metrics["terms"]["weights"] == Checkpoint.open(model).total_bytes
    assert metrics["weights_by_component"]["other"] == 4000


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(devices=6), "--devices"),
        (dict(devices=8, tp=3, dp=2), "--devices"),
        (dict(devices=8, tp=4, dp=2, ep=4), "--ep"),
        (dict(devices=16, nodes=1), "--devices"),
        (dict(devices=8, nodes=3), "--devices"),
        (dict(devices=8, context=200_000), "--context"),
        (dict(devices=8, kv_dtype="int4"), "--kv-dtype"),
        (dict(devices=8, weights="nf4"), "--weights"),
        (dict(devices=8, headroom=1.5), "--headroom"),
    ],
)
def test_bad_flags_raise_input_error(specs, h100, kwargs, flag):
    args = dict(context=4096, batch=1) | kwargs
    with pytest.raises(InputError) as err:
        plan_memory(specs["gpt-oss-120b"], h100, **args)
    assert err.value.field == flag


def test_devices_that_do_not_divide_heads_name_the_fix(specs, h100):
    with pytest.raises(InputError) as err:
        plan_memory(specs["gpt-oss-120b"], h100, devices=6, context=4096, batch=1)
    assert "does not divide 64 attention heads; use 1, 2, 4, 8" in str(err.value)


def test_rope_factor_allows_a_longer_context(specs, h200):
    spec = specs["qwen3-30b-a3b"]
    with pytest.raises(InputError):
        plan_memory(spec, h200, devices=1, context=131_072, batch=1)
    plan = plan_memory(spec, h200, devices=1, context=131_072, batch=1, rope_factor=4.0, search=False)
    assert plan.context == 131_072


# ----------------------------------------------------------------- CLI


def test_cli_json_report_and_exit_codes(tmp_path):
    result = runner.invoke(
        app,
        [
            "plan-memory",
            "qwen3-30b-a3b",
            "--target",
            "h100-sxm",
            "--devices",
            "1",
            "--context",
            "262144",
            "--rope-factor",
            "8",
            "--kv-dtype",
            "bf16",
            "--json",
            "--output",
            str(tmp_path),
            "--run",
            "r1",
        ],
    )
    data = json.loads(result.stdout)
    assert data["stage"] == "memory" and data["number"] == 2
    assert data["metrics"]["kv_bytes_per_sequence"] == 24 * GiB
    assert result.exit_code == (1 if data["verdict"] == "fail" else 0)
    assert (tmp_path / "r1" / "memory.json").is_file()


def test_cli_gpt_oss_h100_fails_at_default_and_passes_at_095(tmp_path):
    base = [
        "plan-memory",
        "gpt-oss-120b",
        "--target",
        "h100-sxm",
        "--devices",
        "1",
        "--context",
        "8192",
        "--output",
        str(tmp_path),
    ]
    assert runner.invoke(app, base).exit_code == 1
    assert runner.invoke(app, base + ["--gpu-memory-utilization", "0.95"]).exit_code == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--devices", "6"],
        ["--devices", "8", "--context", "999999"],
        ["--devices", "8", "--target", "no-such-gpu"],
    ],
)
def test_cli_bad_flags_exit_2(tmp_path, args):
    base = ["plan-memory", "gpt-oss-120b", "--context", "4096", "--output", str(tmp_path)]
    if "--target" not in args:
        base += ["--target", "h100-sxm"]
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output
