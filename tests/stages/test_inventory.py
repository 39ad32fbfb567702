"""Stage 1: meta-device trace, semantic lifting, classification against stack tables, the gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.model.operators import FUSIONS, OP_KINDS, SemanticOp, ops_from_spec
from adapt.model.spec import PRESETS_DIR, load_spec, spec_from_config
from adapt.stages.inventory import (
    TraceUnavailable,
    build_inventory,
    lift_trace,
    run_inventory,
    trace_model,
)
from adapt.targets.support import classify, format_layers, unmet_requirements
from adapt.targets.target import load_stack, load_target, stack_names

# presets: the public config.json files of deepseek-ai/DeepSeek-V3.2 and openai/gpt-oss-120b
DSV32 = "deepseek-v3.2"
GPT_OSS = "gpt-oss-120b"
DSV32_CONFIG = PRESETS_DIR / "deepseek-v3.2.json"


@pytest.fixture(scope="module")
def dsv32_h200():
    """One full-width DeepSeek-V3.2 inventory on h200 / vllm-cuda, shared by the tests below."""
    return build_inventory(DSV32, "h200")


@pytest.fixture(scope="module")
def gpt_oss_h200():
    return build_inventory(GPT_OSS, "h200")


def _rows(inventory) -> dict:
    return {r.op.name: r for r in inventory.rows}


def _no_fp8_target(tmp_path: Path) -> str:
    data = yaml.safe_load(Path(load_target("h200").path).read_text())
    data["name"] = "h200-no-fp8"
    data["native_dtypes"] = [d for d in data["native_dtypes"] if d != "fp8"]
    data["peak_tflops"].pop("fp8")
    path = tmp_path / "h200-no-fp8.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_dsv32_lists_dsa_mla_fp8_routing_and_yarn(dsv32_h200):
    rows = _rows(dsv32_h200)
    for name in ("dsa_indexer", "attention_mla_sparse", "fp8_block_dequant", "routing_sigmoid_group_topk",
                 "rope_yarn", "moe_grouped_gemm_fp8_block", "kv_cache_indexer"):
        assert name in rows, name
        assert rows[name].status == "native", (name, rows[name].provided)
    assert dsv32_h200.report.stage == "inventory" and dsv32_h200.report.number == 1
    assert dsv32_h200.report.verdict == "pass"
    assert dsv32_h200.report.metrics["origin"] == "trace"
    # traced operators carry the aten ops they were lifted from; quantization ops come from the spec
    assert {"aten.relu.default", "aten.topk.default"} <= rows["dsa_indexer"].op.aten
    assert rows["dsa_indexer"].op.origin == "trace"
    assert rows["fp8_block_dequant"].op.origin.startswith("spec")
    routing = rows["routing_sigmoid_group_topk"].op
    assert "8 groups -> best 4" in routing.detail and "top-8 of 256" in routing.detail
    # YaRN: interleaved pairs in MLA, half-split in the indexer, both seen in the trace
    rope = rows["rope_yarn"].op.detail
    assert "attention: interleaved pairs" in rope and "indexer: half-split" in rope and "factor 40" in rope


def test_dsv32_counts_scale_by_layer_structure(dsv32_h200):
    rows = _rows(dsv32_h200)
    spec = load_spec(DSV32)
    moe = len(spec.moe_layers)
    assert rows["routing_sigmoid_group_topk"].op.count == moe == 58
    assert rows["routing_sigmoid_group_topk"].op.layers == set(range(3, 61))
    assert rows["dsa_indexer"].op.count == 61
    # input + post-attention + q_a + kv_a norms per layer, plus the final norm
    assert rows["rmsnorm"].op.count == 4 * 61 + 1
    assert sorted(dsv32_h200.trace.layer_groups) == [0, 3]
    assert dsv32_h200.trace.layer_groups[3] == tuple(range(3, 61))


def test_dsv32_trace_allocates_no_weight_memory(dsv32_h200):
    trace = dsv32_h200.report.metrics["trace"]
    # the parameters (bf16 in the unquantized graph) would take > 1 TB; the trace grew RSS by far less
    assert trace["meta_parameter_bytes"] > 1e12
    assert trace["rss_growth_bytes"] < 2 * 2**30
    assert trace["peak_rss_bytes"] > 0 and trace["seconds"] > 0
    print(f"DeepSeek-V3.2 meta trace: {trace['seconds']:.2f} s (+{trace['import_seconds']:.2f} s imports), "
          f"peak RSS {trace['peak_rss_bytes'] / 2**30:.2f} GiB")


def test_dsv32_spec_and_trace_agree(dsv32_h200):
    codes = {f.code for f in dsv32_h200.report.findings}
    assert "inventory.not_traced" not in codes
    traced = {r.op.name for r in dsv32_h200.rows}
    assert {op.name for op in ops_from_spec(load_spec(DSV32))[0]} == traced


def test_dsv32_fusion_candidates(dsv32_h200):
    fusions = {f["candidate"]: f for f in dsv32_h200.fusions}
    assert {"fuse_qkv_projection", "fuse_gate_up_projection", "fuse_mask_softmax", "fuse_routing_permute",
            "fuse_dequant_matmul", "fuse_residual_rmsnorm"} <= set(fusions)
    assert "q_a_proj + kv_a_proj_with_mqa" in fusions["fuse_qkv_projection"]["evidence"]


def test_fp8_items_become_gaps_without_fp8(tmp_path):
    inventory = build_inventory(DSV32, _no_fp8_target(tmp_path), stack="vllm-cuda")
    rows = _rows(inventory)
    for name in ("fp8_block_dequant", "linear_fp8_block", "moe_grouped_gemm_fp8_block", "fp8_act_quant",
                 "dsa_indexer", "kv_cache_indexer"):
        assert rows[name].status == "missing", name
        assert "needs native fp8" in rows[name].provided and "h200-no-fp8" in rows[name].provided
        assert rows[name].plan, name
    assert rows["attention_mla_sparse"].status == "native"   # needs sm90, which the profile keeps
    assert inventory.report.verdict == "warn"                  # every gap has a plan
    assert {f.code for f in inventory.report.findings} >= {"inventory.gap_with_plan"}


def test_gap_without_plan_fails_the_gate(tmp_path):
    data = yaml.safe_load(Path(load_stack("vllm-cuda").path).read_text())
    del data["ops"]["linear_fp8_block"]["plan"]
    del data["ops"]["swiglu"]
    stack = tmp_path / "no-plan.yaml"
    stack.write_text(yaml.safe_dump(data))
    report = run_inventory(DSV32, _no_fp8_target(tmp_path), stack=str(stack))
    assert report.verdict == "fail" and report.exit_code == 1
    missing = [f.message for f in report.findings if f.code == "inventory.missing"]
    assert any(m.startswith("linear_fp8_block") and "needs native fp8" in m for m in missing)
    assert any(m.startswith("swiglu") and "has no entry" in m for m in missing)
    assert report.metrics["missing_without_plan"] == 2
    # a gate that allows two unplanned gaps passes them as warnings
    allowing = run_inventory(DSV32, _no_fp8_target(tmp_path), stack=str(stack),
                             gates={"inventory": {"max_missing": 2}})
    assert allowing.verdict == "warn"


def test_gpt_oss_sinks_mxfp4_and_clamped_swiglu(gpt_oss_h200):
    rows = _rows(gpt_oss_h200)
    for name in ("attention_sliding_window_sinks", "attention_gqa_sinks", "mxfp4_decode",
                 "moe_grouped_gemm_mxfp4", "swiglu_clamped", "routing_topk_softmax", "rope_yarn"):
        assert name in rows, name
        assert rows[name].status == "native"
    assert rows["attention_sliding_window_sinks"].op.layers == set(range(0, 36, 2))
    assert "window 128" in rows["attention_sliding_window_sinks"].op.detail
    assert "clamp 7.0" in rows["swiglu_clamped"].op.detail
    assert "aten.clamp.default" in rows["swiglu_clamped"].op.aten
    assert format_layers(rows["attention_gqa_sinks"].op.layers) == "1-35 every 2"
    assert "swiglu" not in rows    # gpt-oss experts use only the clamped variant
    assert gpt_oss_h200.report.verdict == "pass"


def test_gpt_oss_on_cpu_stack_has_a_planned_gap():
    inventory = build_inventory(GPT_OSS, "cpu")
    rows = _rows(inventory)
    assert rows["moe_grouped_gemm_mxfp4"].status == "missing"
    assert "AMX" in rows["moe_grouped_gemm_mxfp4"].provided and rows["moe_grouped_gemm_mxfp4"].plan
    assert rows["mxfp4_decode"].status == "composable"
    assert inventory.report.verdict == "warn"


def test_dsv32_on_cpu_uses_adapt_kernels(dsv32_h200):
    cpu, stack = load_target("cpu"), load_stack("vllm-cpu")
    ops = {r.op.name: r.op for r in dsv32_h200.rows}
    indexer = classify(ops["dsa_indexer"], stack, cpu)
    assert indexer.status == "adapt_kernel"
    assert indexer.kernel == "adapt.kernels.dsa.index_topk" and indexer.test == "tests/kernels/test_dsa.py"
    assert classify(ops["linear_fp8_block"], stack, cpu).status == "composable"


def test_adapt_kernel_that_does_not_import_is_missing(tmp_path):
    stack = tmp_path / "stack.yaml"
    stack.write_text(yaml.safe_dump({"name": "t", "ops": {"dsa_indexer": {
        "status": "adapt_kernel", "reason": "r", "kernel": "adapt.kernels.no_such_module.index",
        "test": "tests/kernels/test_dsa.py"}}}))
    row = classify(SemanticOp("dsa_indexer", "attention"), load_stack(str(stack)), load_target("h200"))
    assert row.status == "missing" and "does not import" in row.provided and not row.plan


def test_config_transformers_cannot_build_falls_back_to_spec(tmp_path):
    config = json.loads(DSV32_CONFIG.read_text())
    config["model_type"] = "kimi_k2"   # ModelSpec parses it; transformers has no such model_type
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    inventory = build_inventory(str(tmp_path), "h200")
    assert inventory.trace is None and inventory.report.metrics["origin"] == "spec"
    notes = [f.message for f in inventory.report.findings if f.code == "inventory.spec_only"]
    assert notes and "not a trace" in notes[0] and "kimi_k2" in notes[0]
    rows = _rows(inventory)
    assert {"attention_mla", "routing_sigmoid_group_topk", "fp8_block_dequant", "rope_yarn"} <= set(rows)
    assert all(r.op.origin.startswith("spec") for r in rows.values())
    assert "dsa_indexer" not in rows


def test_build_failure_falls_back_to_spec(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("simulated: architecture not buildable")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    inventory = build_inventory("mixtral-8x7b", "h200")
    note = next(f for f in inventory.report.findings if f.code == "inventory.spec_only")
    assert "cannot build" in note.message and "simulated" in note.message
    assert {"attention_gqa", "routing_softmax_topk", "moe_grouped_gemm_bf16"} <= set(_rows(inventory))


def test_module_failing_on_meta_is_named(monkeypatch):
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def data_dependent(self, hidden_states):
        raise RuntimeError("cannot call .tolist() on a meta tensor")

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", data_dependent)
    spec = load_spec("qwen3-30b-a3b")
    with pytest.raises(TraceUnavailable, match=r"prefill failed in model\.layers\.0\.mlp\.gate.*tolist"):
        trace_model(spec.config)
    report = run_inventory("qwen3-30b-a3b", "h200")
    assert report.metrics["origin"] == "spec"
    assert any("mlp.gate" in f.message for f in report.findings if f.code == "inventory.spec_only")


def test_representative_layers_count_like_all_layers():
    config = json.loads(DSV32_CONFIG.read_text())
    config["num_hidden_layers"] = 5
    spec = spec_from_config(config, "dsv32-5-layers")
    few = {op.name: op.count for op in lift_trace(trace_model(spec.config), spec)[0]}
    every = trace_model(spec.config, all_layers=True)
    assert sorted(every.layer_groups) == [0, 1, 2, 3, 4]
    assert few == {op.name: op.count for op in lift_trace(every, spec)[0]}


def test_unmet_requirements():
    h200, cpu, mi300x = load_target("h200"), load_target("cpu"), load_target("mi300x")
    assert unmet_requirements(("fp8", "sm90"), h200) == []
    assert unmet_requirements(("sm100",), h200) == ["needs compute capability >= 10; h200 has 9"]
    assert "needs native fp8" in unmet_requirements(("fp8",), cpu)[0]
    assert "gfx942" in unmet_requirements(("sm90",), mi300x)[0]


def test_stack_tables_are_complete_and_well_formed():
    assert {"vllm-cuda", "vllm-cpu", "vllm-rocm"} <= set(stack_names())
    for name in ("vllm-cuda", "vllm-cpu", "vllm-rocm"):
        ops = load_stack(name).ops
        assert set(ops) == set(OP_KINDS) | set(FUSIONS), name
        for entry in ops.values():
            if entry.status == "adapt_kernel":
                assert entry.kernel.startswith("adapt.") and entry.test.startswith("tests/")


def test_adapt_kernel_entry_needs_kernel_and_test(tmp_path):
    stack = tmp_path / "bad.yaml"
    stack.write_text(yaml.safe_dump({"ops": {"dsa_indexer": {"status": "adapt_kernel", "reason": "r",
                                                             "kernel": "adapt.kernels.dsa.index_topk"}}}))
    with pytest.raises(InputError, match="ops.dsa_indexer.test"):
        load_stack(str(stack))


def test_format_layers():
    assert format_layers([]) == "model"
    assert format_layers([0, 1, 2, 3, 5]) == "0-3, 5"
    assert format_layers([0, 2, 4]) == "0-4 every 2"
    assert format_layers([7]) == "7"


def test_cli_inventory_writes_reports(tmp_path):
    result = CliRunner().invoke(app, ["inventory", GPT_OSS, "--target", "h200", "--output", str(tmp_path),
                                      "--run", "r1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["stage"] == "inventory" and data["verdict"] == "pass"
    run = tmp_path / "r1"
    assert {"inventory.json", "inventory.md", "inventory.junit.xml", "inventory.detail.json"} <= {
        p.name for p in run.iterdir()}
    header = "| op | kind | status | provided by / reason | count | layers |"
    assert header in (run / "inventory.md").read_text()
    detail = json.loads((run / "inventory.detail.json").read_text())
    assert any(a["op"] == "aten._grouped_mm.default" for a in detail["aten"])


def test_cli_inventory_bad_stack_is_input_error(tmp_path):
    result = CliRunner().invoke(app, ["inventory", "mixtral-8x7b", "--target", "h200", "--stack", "no-such-stack",
                                      "--output", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown stack 'no-such-stack'" in result.output and "Traceback" not in result.output


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def test_glm_one_group_sigmoid_routing_and_partial_rope():
    inventory = build_inventory(str(FIXTURES / "glm-4.5-air.json"), "h200")
    rows = _rows(inventory)
    assert "routing_sigmoid_topk" in rows and "routing_sigmoid_group_topk" not in rows
    assert "partial: 64 of 128 dims" in rows["rope_plain"].op.detail
    assert not [f for f in inventory.report.findings if f.code == "inventory.not_traced"]


def test_real_kimi_k2_config_gets_the_spec_inventory():
    inventory = build_inventory(str(FIXTURES / "kimi-k2-instruct.aiconfigurator.json"), "h200")
    assert inventory.report.metrics["origin"] == "spec"
    assert any(f.code == "inventory.spec_only" for f in inventory.report.findings)
    assert {"attention_mla", "routing_sigmoid_topk", "moe_grouped_gemm_bf16"} <= set(_rows(inventory))
