"""Engine arguments -> `vllm serve` argv and Ray steps (pure string work, no vLLM needed)."""

import shlex

import pytest

from adapt.errors import InputError
from adapt.plan.launch import PLAN_KEYS, engine_argv, multi_node_args, ray_steps, serve_command

PLAN = {
    "tensor_parallel_size": 8, "pipeline_parallel_size": 1, "data_parallel_size": 1,
    "enable_expert_parallel": True, "max_model_len": 8192, "gpu_memory_utilization": 0.9,
    "kv_cache_dtype": "fp8", "block_size": 64, "max_num_batched_tokens": 8192, "max_num_seqs": 64,
}


def test_every_plan_key_becomes_its_vllm_flag_with_value():
    argv = serve_command("/models/ds", PLAN)
    assert argv[:3] == ["vllm", "serve", "/models/ds"]
    flags = argv[3:]
    assert flags == [
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1", "--data-parallel-size", "1",
        "--enable-expert-parallel", "--max-model-len", "8192", "--gpu-memory-utilization", "0.9",
        "--kv-cache-dtype", "fp8", "--block-size", "64", "--max-num-batched-tokens", "8192",
        "--max-num-seqs", "64",
    ]
    assert len(PLAN_KEYS) == 10


def test_false_and_none_are_left_to_vllm_defaults_and_extras_follow_sorted():
    argv = engine_argv({"enable_expert_parallel": False, "max_model_len": None, "served_model_name": "m",
                        "enforce_eager": True, "tensor_parallel_size": 2, "hf_overrides": {"a": 1}})
    assert argv == ["--tensor-parallel-size", "2", "--enforce-eager", "--hf-overrides", '{"a":1}',
                    "--served-model-name", "m"]


@pytest.mark.parametrize("key", ["Tensor", "--tp", "tensor-parallel", ""])
def test_bad_key_is_input_error(key):
    with pytest.raises(InputError):
        engine_argv({key: 1})


def test_empty_model_path_is_input_error():
    with pytest.raises(InputError):
        serve_command("", PLAN)


def test_single_node_needs_no_ray():
    assert ray_steps("/m", PLAN, 1) == []
    assert "distributed_executor_backend" not in multi_node_args(PLAN, 1)


def test_replica_wider_than_a_node_runs_on_ray_executor():
    plan = {**PLAN, "pipeline_parallel_size": 2}
    steps = ray_steps("/models/ds", plan, 2, head_address="10.0.0.1")
    assert steps[1].startswith("ray start --head --port=6379")
    assert steps[2].startswith("ray start --address=10.0.0.1:6379 --block")
    assert "expect 2 nodes and 16 GPUs (8 per node)" in steps[3]
    serve = shlex.split(steps[-1].split("#")[0])
    assert serve[:3] == ["vllm", "serve", "/models/ds"]
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    assert "--data-parallel-backend" not in serve
    assert steps[-1].endswith("# on the head node only")


def test_data_parallel_over_nodes_uses_ray_dp_backend():
    plan = {**PLAN, "data_parallel_size": 2}
    args = multi_node_args(plan, 2)
    assert args["data_parallel_backend"] == "ray"
    assert "distributed_executor_backend" not in args


def test_world_must_split_over_nodes():
    with pytest.raises(InputError, match="do not split evenly"):
        ray_steps("/m", {**PLAN, "tensor_parallel_size": 3}, 2)
    with pytest.raises(InputError):
        ray_steps("/m", PLAN, 0)
    with pytest.raises(InputError):
        multi_node_args({**PLAN, "tensor_parallel_size": 0}, 1)
