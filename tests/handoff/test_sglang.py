"""SGLang hand-off: stage-4 plans as `python -m sglang.launch_server` commands, checked by SGLang's own parser.

The parser runs in .venv-sglang (`make sglang-env`, which `make test` sets up)."""

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adapt.cli import app
from adapt.handoff.sglang import LAUNCH, launch_commands, server_args, validate_with_sglang
from adapt.plan.layout import load_model
from adapt.report import load_gates
from adapt.stages.parallel import plan_parallel
from adapt.targets.target import load_target

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
needs_sglang = pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .venv-sglang: run `make sglang-env`")


def _plan(devices, nodes, context=8192, batch=1, kv_dtype="bf16"):
    spec, checkpoint = load_model("deepseek-v3.2")
    return plan_parallel(spec, load_target("h200"), devices=devices, nodes=nodes, context=context, batch=batch,
                         kv_dtype=kv_dtype, checkpoint=checkpoint,
                         headroom=load_gates()["memory"]["headroom_fraction"])


@pytest.fixture(scope="module")
def commands():
    """DeepSeek-V3.2 on 8x H200 (stage-4 best plan, and its DP8 + EP layout) and on two 8x H200 nodes."""
    one = _plan(8, 1)
    ep_layouts = [p.layout for p in one.feasible if p.layout.expert_parallel and p.layout.dp == 8]
    assert ep_layouts, "stage 4 lists a DP8 x EP layout as feasible"
    dp8_ep = dict(one.engine_args, tensor_parallel_size=1, data_parallel_size=8, enable_expert_parallel=True,
                  kv_cache_dtype="fp8")
    replicas = _plan(16, 2)
    assert replicas.engine_args["data_parallel_size"] == 2 and not replicas.engine_args["enable_expert_parallel"]
    # 128 sequences of 128K tokens do not fit one node: stage 4 spreads DP x EP over both
    two = _plan(16, 2, context=131072, batch=128, kv_dtype="fp8")
    assert not two.single_node_fits and two.best.label == "TP1 x DP16 x EP16"
    return {
        "8xH200 stage-4 best": launch_commands("/models/DeepSeek-V3.2", one.engine_args),
        "8xH200 DP8+EP": launch_commands("/models/DeepSeek-V3.2", dp8_ep),
        "2 nodes replicas": launch_commands("/models/DeepSeek-V3.2", replicas.engine_args, nodes=2),
        "2 nodes DP16+EP16": launch_commands("/models/DeepSeek-V3.2", two.engine_args, nodes=2,
                                              head_address="10.0.0.1"),
    }


def test_plan_maps_to_sglang_fields(commands):
    best = commands["8xH200 stage-4 best"]
    assert len(best) == 1 and best[0][:3] == LAUNCH
    text = shlex.join(best[0])
    assert "--tp-size 8" in text and "--page-size 64" in text and "--context-length 8192" in text
    ep = shlex.join(commands["8xH200 DP8+EP"][0])
    for flag in ("--tp-size 8", "--attn-dp-size 8", "--ep-size 8", "--moe-a2a-backend deepep",
                 "--kv-cache-dtype fp8_e4m3"):
        assert flag in ep, flag
    nodes = commands["2 nodes DP16+EP16"]
    assert [c[c.index("--node-rank") + 1] for c in nodes] == ["0", "1"]
    for flag in ("--nnodes 2", "--dist-init-addr 10.0.0.1:20000", "--tp-size 16", "--attn-dp-size 16",
                 "--ep-size 16", "--moe-a2a-backend deepep", "--kv-cache-dtype fp8_e4m3", "--context-length 131072"):
        assert all(flag in shlex.join(c) for c in nodes), flag
    replicas = commands["2 nodes replicas"]
    assert len(replicas) == 2 and "--nnodes" not in replicas[0], "DP replicas without EP: one server per node"


def test_pipeline_and_uneven_split():
    args, servers = server_args({"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "kv_cache_dtype": "auto"})
    assert args["pp_size"] == 2 and args["tp_size"] == 4 and servers == 1
    with pytest.raises(Exception, match="split evenly"):
        server_args({"tensor_parallel_size": 3}, nodes=2)


@needs_sglang
def test_sglang_parser_accepts_every_command_and_reads_back_the_plan(commands):
    flat = [argv for group in commands.values() for argv in group]
    parsed = validate_with_sglang(flat + [flat[0] + ["--kv-cache-dtype", "fp9"]], str(SGLANG_PYTHON))
    assert parsed["version"] == "0.5.23"
    *good, bad = parsed["results"]
    assert all(r["ok"] for r in good), [r for r in good if not r["ok"]]
    assert not bad["ok"] and "fp9" in bad["error"], "the parser can refuse"
    by_name = dict(zip([n for n, g in commands.items() for _ in g], good, strict=True))
    ep = by_name["8xH200 DP8+EP"]["args"]
    assert (ep["tp_size"], ep["attn_dp_size"], ep["ep_size"], ep["moe_a2a_backend"]) == (8, 8, 8, "deepep")
    node1 = good[len(flat) - 1]["args"]
    assert (node1["nnodes"], node1["node_rank"], node1["dist_init_addr"]) == (2, 1, "10.0.0.1:20000")


@needs_sglang
def test_cli_handoff_engine_sglang_validates(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["plan-parallel", "deepseek-v3.2", "-t", "h200", "-d", "8", "--context", "8192",
                                 "-o", str(tmp_path), "--run", "r1", "--json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["handoff", "deepseek-v3.2", "--engine", "sglang", "--validate", "--force",
                                 "-o", str(tmp_path), "--run", "r1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert any(f["code"] == "sglang-parser" and f["severity"] == "info" for f in report["findings"])
    script = (tmp_path / "r1" / "handoff" / "sglang_launch.sh").read_text()
    assert "python -m sglang.launch_server --model-path deepseek-v3.2 --tp-size 8" in script
    bad = runner.invoke(app, ["handoff", "deepseek-v3.2", "--engine", "tgi", "-o", str(tmp_path), "--run", "r1"])
    assert bad.exit_code == 2 and "--engine" in bad.output
