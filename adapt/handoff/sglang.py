"""SGLang hand-off: the stage-4 plan as ``python -m sglang.launch_server`` commands, checked by SGLang's parser.

The module imports without SGLang (stdlib only). SGLang's own parser
(``sglang.srt.server_args.prepare_server_args``, pinned ``SGLANG_VERSION``) runs in a separate
environment (``.venv-sglang``, ``make sglang-env``) through a subprocess, so adapt never imports it.

How the vLLM-shaped plan maps onto SGLang's server arguments (flag names of sglang 0.5.23, read from
its ``arg_groups/fields`` and ``server_args.py``):

- tensor x pipeline x data ranks with expert parallelism: one model over all ranks with data-parallel
  attention inside it, the DeepSeek layout of SGLang: ``--tp-size TP*DP --attn-dp-size DP --ep-size TP*DP``
  (``--attn-dp-size`` replaces the deprecated ``--dp-size N --enable-dp-attention`` pair in 0.5.23) and
  ``--moe-a2a-backend deepep`` when the experts' all-to-all crosses data-parallel ranks (``none`` otherwise);
- data-parallel replicas without expert parallelism: ``--dp-size DP --tp-size TP`` on one node; over
  several nodes, one independent server per replica group (a router in front balances them);
- ``--pp-size``; ``--kv-cache-dtype auto | fp8_e4m3``; ``--page-size`` (vLLM's block size);
  ``--context-length`` (max_model_len); ``--mem-fraction-static`` (vLLM's gpu_memory_utilization: in SGLang
  it bounds weights + KV pool, a close but not identical budget); ``--chunked-prefill-size``
  (max_num_batched_tokens); ``--max-running-requests`` (max_num_seqs);
- several nodes: ``--nnodes N --node-rank i --dist-init-addr <head-ip>:PORT``, one command per node.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

from adapt.errors import InputError

SGLANG_VERSION = "0.5.23"
DIST_PORT = 20000
LAUNCH = ["python", "-m", "sglang.launch_server"]
# the plan keys first, in this order, then anything else sorted
ORDER = ("model_path", "tp_size", "pp_size", "dp_size", "attn_dp_size", "ep_size", "moe_a2a_backend",
         "kv_cache_dtype", "page_size", "context_length", "mem_fraction_static", "chunked_prefill_size",
         "max_running_requests", "nnodes", "node_rank", "dist_init_addr")


def _size(engine_args: dict[str, Any], key: str) -> int:
    value = engine_args.get(key) or 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"expected a positive integer, got {value!r}", field=key)
    return value


def server_args(engine_args: dict[str, Any], *, nodes: int = 1) -> tuple[dict[str, Any], int]:
    """SGLang server arguments for a stage-4 plan's vLLM engine arguments.

    engine_args: the plan's keys (tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
    enable_expert_parallel, max_model_len, gpu_memory_utilization, kv_cache_dtype, block_size,
    max_num_batched_tokens, max_num_seqs). Returns (ServerArgs field -> value, servers): ``servers``
    is how many independent servers the plan becomes (data-parallel replicas without expert
    parallelism over several nodes: one per replica group; otherwise 1). Node flags are added by
    ``launch_commands``.
    """
    tp = _size(engine_args, "tensor_parallel_size")
    pp = _size(engine_args, "pipeline_parallel_size")
    dp = _size(engine_args, "data_parallel_size")
    ep = bool(engine_args.get("enable_expert_parallel"))
    if (tp * pp * dp) % nodes:
        raise InputError(f"{tp * pp * dp} ranks do not split evenly over {nodes} nodes", field="nodes")
    args: dict[str, Any] = {"pp_size": pp}
    servers = 1
    if ep:
        args.update(tp_size=tp * dp, ep_size=tp * dp, moe_a2a_backend="deepep" if dp > 1 else "none")
        if dp > 1:
            args["attn_dp_size"] = dp
    elif dp > 1 and nodes > 1:
        if dp % nodes:
            raise InputError(f"{dp} data-parallel replicas do not split evenly over {nodes} nodes", field="nodes")
        servers = nodes
        args.update(tp_size=tp, dp_size=dp // nodes)
    else:
        args.update(tp_size=tp, dp_size=dp)
    kv = engine_args.get("kv_cache_dtype", "auto")
    args["kv_cache_dtype"] = {"auto": "auto", "bf16": "bfloat16", "fp8": "fp8_e4m3"}.get(str(kv), str(kv))
    optional = {"block_size": "page_size", "max_model_len": "context_length",
                "gpu_memory_utilization": "mem_fraction_static", "max_num_batched_tokens": "chunked_prefill_size",
                "max_num_seqs": "max_running_requests"}
    for key, field in optional.items():
        if engine_args.get(key) is not None:
            args[field] = engine_args[key]
    return {k: v for k, v in args.items() if not (k in ("pp_size", "dp_size") and v == 1)}, servers


def argv_of(args: dict[str, Any]) -> list[str]:
    """ServerArgs fields as flags (``tp_size`` -> ``--tp-size``), in ORDER then sorted; True is a switch."""
    keys = [k for k in ORDER if k in args] + sorted(k for k in args if k not in ORDER)
    out: list[str] = []
    for key in keys:
        value = args[key]
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def launch_commands(model_path: str, engine_args: dict[str, Any], *, nodes: int = 1,
                    head_address: str = "<head-ip>") -> list[list[str]]:
    """One ``python -m sglang.launch_server`` argv per node (rank order) for the plan.

    One model over several nodes gets ``--nnodes``, ``--node-rank`` and ``--dist-init-addr
    <head-ip>:20000`` (node 0 is the head); independent replica servers get no node flags.
    """
    if not model_path:
        raise InputError("model path is empty", field="model")
    args, servers = server_args(engine_args, nodes=nodes)
    args = {"model_path": model_path, **args}
    if nodes == 1 or servers == nodes:
        return [[*LAUNCH, *argv_of(args)] for _ in range(nodes)]
    return [[*LAUNCH, *argv_of({**args, "nnodes": nodes, "node_rank": rank,
                                "dist_init_addr": f"{head_address}:{DIST_PORT}"})] for rank in range(nodes)]


# ---------------------------------------------------------------- SGLang's own parser, in .venv-sglang

_PARSE_SCRIPT = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
FIELDS = ("model_path", "tp_size", "pp_size", "dp_size", "attn_dp_size", "ep_size", "moe_a2a_backend",
          "kv_cache_dtype", "page_size", "context_length", "mem_fraction_static", "chunked_prefill_size",
          "max_running_requests", "nnodes", "node_rank", "dist_init_addr")
def parse(argv):
    try:
        args = prepare_server_args(argv)
    except BaseException as exc:  # argparse refuses with SystemExit
        if isinstance(exc, SystemExit):
            return {"ok": False, "error": "argument parser exited with %s" % exc.code}
        return {"ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}
    return {"ok": True, "args": {f: getattr(args, f, None) for f in FIELDS}}
results = [parse(argv) for argv in json.loads(sys.argv[1])]
import importlib.metadata as m
print("ADAPT-SGLANG " + json.dumps({"version": m.version("sglang"), "results": results}))
"""


def find_sglang_python(explicit: str | None = None) -> Path:
    """The Python of the SGLang environment: ``explicit``, else ``.venv-sglang/bin/python`` in the current
    directory or beside this checkout."""
    candidates = [Path(explicit)] if explicit else [
        Path.cwd() / ".venv-sglang" / "bin" / "python",
        Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise InputError("no SGLang environment: .venv-sglang/bin/python not found", file=str(candidates[0]),
                     hint="run `make sglang-env`")


def validate_with_sglang(commands: list[list[str]], python: str | None = None,
                         timeout_s: float = 300.0) -> dict[str, Any]:
    """Parse each launch argv with SGLang's ``prepare_server_args`` in the SGLang environment.

    Loads no model and starts nothing. Returns {"version": sglang version, "results": [{"ok": True,
    "args": {field: parsed value}} or {"ok": False, "error": "..."}]} with argparse's message from
    the subprocess' stderr appended to a refusal.
    """
    exe = find_sglang_python(python)
    argvs = [argv[len(LAUNCH):] if argv[:len(LAUNCH)] == LAUNCH else argv for argv in commands]
    proc = subprocess.run([str(exe), "-c", _PARSE_SCRIPT, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    marker = [line for line in proc.stdout.splitlines() if line.startswith("ADAPT-SGLANG ")]
    if not marker:
        raise RuntimeError(f"SGLang's parser did not run (exit {proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(marker[-1][len("ADAPT-SGLANG "):])
    errors = [line.strip() for line in proc.stderr.splitlines() if "error:" in line]
    for result in out["results"]:
        if not result["ok"] and errors:
            result["error"] += "; " + errors.pop(0)
    return out


def launch_script(commands: list[list[str]], nodes: int) -> str:
    """The launch commands as a shell script, each line saying where it runs."""
    lines = ["#!/bin/sh", f"# SGLang {SGLANG_VERSION} launch for the stage-4 plan"]
    if len(commands) == 1:
        lines.append("exec " + shlex.join(commands[0]))
        return "\n".join(lines) + "\n"
    together = "--nnodes" in commands[0]
    lines.append("# one model over all nodes: start every line at the same time, each on its node"
                 if together else "# independent servers, one per node; put sglang-router in front of them")
    for rank, argv in enumerate(commands):
        lines.append(f"{shlex.join(argv)}  # on node {rank}" + (" (head: <head-ip>)" if rank == 0 else ""))
    return "\n".join(lines) + "\n"


def write_sglang_bundle(model: str, *, target: str, devices: int, nodes: int, run, force: bool = False,
                        validate: bool = False, python: str | None = None,
                        head_address: str = "<head-ip>"):
    """``adapt handoff --engine sglang``: check the run's gates, take the stage-4 plan, write
    ``handoff/sglang_args.json`` and ``handoff/sglang_launch.sh``; with ``validate``, parse every
    command with SGLang's own parser (a refusal is an error finding: exit 1).

    Returns (report, files) for ``RunDir.write``.
    """
    from adapt.handoff.bundle import BUNDLE_DIR, STAGE_NUMBER, check_gates, model_reference, plan_engine_args
    from adapt.report import StageReport, fingerprint
    from adapt.targets.target import load_target

    resolved = load_target(target)
    overridden = check_gates(run, model=model, target=target, devices=devices, nodes=nodes, force=force)
    engine_args, source = plan_engine_args(run, devices=devices, nodes=nodes, forced=force)
    model_path = model_reference(model)
    commands = launch_commands(model_path, engine_args, nodes=nodes, head_address=head_address)
    args, servers = server_args(engine_args, nodes=nodes)
    report = StageReport("handoff_sglang", STAGE_NUMBER, "Hand-off to SGLang",
                         fingerprint=fingerprint(model=model, target=resolved.name, devices=devices, nodes=nodes,
                                                 engine="sglang", sglang=SGLANG_VERSION))
    report.metrics.update({"server_args": args, "launch_commands": commands, "servers": servers, "nodes": nodes,
                           "devices": devices, "engine_args": engine_args, "engine_args_source": source,
                           "sglang_version": SGLANG_VERSION, "overridden_gates": overridden})
    if overridden:
        report.add("warn", "forced", "hand-off forced past gates that had not passed: " + "; ".join(overridden))
    if validate:
        parsed = validate_with_sglang(commands, python)
        report.metrics["sglang_parser"] = parsed
        bad = [(i, r["error"]) for i, r in enumerate(parsed["results"]) if not r["ok"]]
        if parsed["version"] != SGLANG_VERSION:
            report.add("warn", "sglang-version", f"the SGLang environment has {parsed['version']}, "
                       f"the commands were written for {SGLANG_VERSION}")
        for index, error in bad:
            report.add("error", "sglang-parser", f"SGLang rejects launch command {index}: {error}")
        if not bad:
            report.add("info", "sglang-parser", f"SGLang {parsed['version']}'s own parser (prepare_server_args) "
                       f"accepts all {len(commands)} launch command(s)")
    report.tables["launch"] = [{"node": i, "command": shlex.join(c)} for i, c in enumerate(commands)]
    report.summary = (f"SGLang launch for {model} on {devices} x {resolved.name}"
                      + (f" over {nodes} nodes" if nodes > 1 else "") + f" from the {source}")
    files = {
        f"{BUNDLE_DIR}/sglang_args.json": json.dumps({
            "model": model_path, "target": resolved.name, "devices": devices, "nodes": nodes,
            "sglang_version": SGLANG_VERSION, "server_args": args, "servers": servers,
            "engine_args": engine_args, "engine_args_source": source}, indent=2) + "\n",
        f"{BUNDLE_DIR}/sglang_launch.sh": launch_script(commands, nodes),
    }
    report.decide()
    return report, files
