"""A stage-4 plan as a vLLM launch: engine arguments -> ``vllm serve`` argv, Ray multi-node steps,
and the launch lines a plan report shows. Shared by stage 4 (its report) and the hand-off (its bundle
and launch); stdlib only.

Flag spelling: vLLM derives every ``vllm serve`` flag from an ``EngineArgs`` field name by
replacing ``_`` with ``-`` (``tensor_parallel_size`` -> ``--tensor-parallel-size``); booleans
are switches (``enable_expert_parallel`` -> ``--enable-expert-parallel``).
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from adapt.errors import InputError

# The engine-argument keys the stage-4 plan produces, in the order they appear on the command line.
PLAN_KEYS = (
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
)
RAY_PORT = 6379
_KEY = re.compile(r"^[a-z][a-z0-9_]*$")


def flag_of(key: str) -> str:
    """The ``vllm serve`` flag for an EngineArgs field name (``max_model_len`` -> ``--max-model-len``)."""
    if not _KEY.match(key):
        raise InputError(f"not an engine-argument name: {key!r}", field=key,
                         hint="use vLLM EngineArgs field names such as tensor_parallel_size")
    return "--" + key.replace("_", "-")


def engine_argv(engine_args: dict[str, Any]) -> list[str]:
    """Engine arguments as ``vllm serve`` flags: plan keys first (in PLAN_KEYS order), then the rest sorted.

    ``None`` and ``False`` values are left out (vLLM's default applies); ``True`` is a bare switch;
    dicts and lists are passed as JSON, which is how vLLM reads structured arguments.
    """
    rest = sorted(k for k in engine_args if k not in PLAN_KEYS)
    ordered = [k for k in PLAN_KEYS if k in engine_args] + rest
    argv: list[str] = []
    for key in ordered:
        value = engine_args[key]
        flag = flag_of(key)
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, (int, float, str)):
            argv += [flag, str(value)]
        else:
            raise InputError(f"engine argument has unsupported type {type(value).__name__}", field=key)
    return argv


def serve_command(model_path: str, engine_args: dict[str, Any]) -> list[str]:
    """The ``vllm serve`` argv for one model directory (or hub id) and a dict of engine arguments.

    engine_args: EngineArgs field names -> values, e.g. ``{"tensor_parallel_size": 8,
    "enable_expert_parallel": True, "max_model_len": 8192, "gpu_memory_utilization": 0.9}``.
    Returns e.g. ``["vllm", "serve", "/models/ds", "--tensor-parallel-size", "8", ...]``.
    """
    if not model_path:
        raise InputError("model path is empty", field="model")
    return ["vllm", "serve", str(model_path), *engine_argv(engine_args)]


def _positive_int(engine_args: dict[str, Any], key: str) -> int:
    value = engine_args.get(key, 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"expected a positive integer, got {value!r}", field=key)
    return value


def multi_node_args(engine_args: dict[str, Any], nodes: int) -> dict[str, Any]:
    """Engine arguments for a plan spread over ``nodes`` hosts joined by Ray.

    A model replica (tensor x pipeline ranks) wider than one node runs on Ray workers
    (``distributed_executor_backend="ray"``); data-parallel ranks on several nodes are placed
    by Ray (``data_parallel_backend="ray"``), so one launch on the head node starts them all.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise InputError(f"expected a positive number of nodes, got {nodes!r}", field="nodes")
    tp = _positive_int(engine_args, "tensor_parallel_size")
    pp = _positive_int(engine_args, "pipeline_parallel_size")
    dp = _positive_int(engine_args, "data_parallel_size")
    world = tp * pp * dp
    if world % nodes:
        raise InputError(f"{world} ranks (tensor {tp} x pipeline {pp} x data {dp}) do not split evenly "
                         f"over {nodes} nodes", field="nodes")
    args = dict(engine_args)
    if nodes == 1:
        return args
    per_node = world // nodes
    if tp * pp > per_node:
        args.setdefault("distributed_executor_backend", "ray")
    if dp > 1:
        args.setdefault("data_parallel_backend", "ray")
    return args


def ray_steps(model_path: str, engine_args: dict[str, Any], nodes: int,
              head_address: str = "<head-ip>") -> list[str]:
    """Shell lines that bring up a Ray cluster over ``nodes`` hosts and start ``vllm serve`` on its head.

    Follows vLLM's multi-node serving guide: every node exports ``VLLM_HOST_IP`` (its own
    address), the head runs ``ray start --head``, each worker joins with ``ray start --address``,
    ``ray status`` confirms the cluster, and only the head runs ``vllm serve``. Every node must see
    the model at the same path. Each line ends with a ``#`` comment naming where it runs.
    Returns [] for one node (no Ray needed).
    """
    args = multi_node_args(engine_args, nodes)
    if nodes == 1:
        return []
    world = (_positive_int(args, "tensor_parallel_size") * _positive_int(args, "pipeline_parallel_size")
             * _positive_int(args, "data_parallel_size"))
    per_node = world // nodes
    workers = nodes - 1
    return [
        f"export VLLM_HOST_IP=<this-node-ip>  # on all {nodes} nodes, before starting Ray",
        f"ray start --head --port={RAY_PORT}  # on the head node ({head_address})",
        f"ray start --address={head_address}:{RAY_PORT} --block  # on each of the {workers} worker node(s)",
        f"ray status  # on the head node: expect {nodes} nodes and {world} GPUs ({per_node} per node)",
        shlex.join(serve_command(model_path, args)) + "  # on the head node only",
    ]


def rope_override(rope_scaling: dict[str, Any] | None, *, theta: float, base: int, factor: float) -> dict[str, Any]:
    """``hf_overrides`` that extend the context by ``factor`` over ``base`` tokens, changing only the factor.

    vLLM applies ``hf_overrides`` with ``PretrainedConfig.update``, which replaces the
    ``rope_scaling`` dict whole; under transformers 5 that dict is also where ``rope_theta`` lives.
    So the override carries every field of the model's own ``rope_scaling`` (DeepSeek's mscale,
    mscale_all_dim, beta_fast, beta_slow, ...) and its ``rope_theta``, with only ``factor``
    changed; a model without rope scaling gets YaRN over ``base`` tokens. ``max_position_embeddings``
    becomes ``base x factor``. rope_scaling: the config's dict (None: none); theta: rope_theta;
    base: the pre-scaling length (tokens).
    """
    scaling = dict(rope_scaling) if rope_scaling else {"rope_type": "yarn", "original_max_position_embeddings": base}
    scaling["factor"] = factor
    scaling.setdefault("original_max_position_embeddings", base)
    scaling.setdefault("rope_theta", theta)
    return {"rope_scaling": scaling, "max_position_embeddings": int(base * factor)}


def launch_lines(metrics: dict[str, Any]) -> list[str]:
    """The shell lines that launch a stage-4 plan: its Ray steps on several nodes, else the one
    ``vllm serve`` command; [] when no plan fits. ``metrics``: a stage-4 report's metrics."""
    if metrics.get("ray_steps"):
        return list(metrics["ray_steps"])
    return [shlex.join(metrics["serve_command"])] if metrics.get("serve_command") else []


def shell_script(lines: list[str], comment: str = "") -> str:
    """A POSIX ``sh`` script of shell lines (``set -e``). Placeholders such as ``<head-ip>`` (a
    redirection to ``sh``) become required variables, ``${HEAD_IP:?set HEAD_IP (head-ip)}``,
    so the script parses under ``sh`` and stops with that message until the user sets them."""

    def variable(match: re.Match) -> str:
        name = match.group(1).upper().replace("-", "_")
        return f"${{{name}:?set {name} ({match.group(1)})}}"

    body = [re.sub(r"<([a-z][a-z-]*)>", variable, line) for line in lines]
    head = "#!/bin/sh\n" + (f"# {comment}\n" if comment else "") + "set -e\n"
    return head + "\n".join(body) + "\n"


def launch_script(metrics: dict[str, Any]) -> str | None:
    """``shell_script`` of ``launch_lines(metrics)``; None when no plan fits."""
    lines = launch_lines(metrics)
    return shell_script(lines) if lines else None
