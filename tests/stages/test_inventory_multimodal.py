"""Stage 1 for the multimodal and hybrid families and the NVFP4 / int4 expert GEMMs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapt.model.operators import OP_KINDS
from adapt.stages.inventory import build_inventory
from adapt.targets.target import load_stack, stack_names

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
NEW_OPS = ("patch_embedding", "attention_vision", "rope_2d_vision", "gelu", "patch_merge", "attention_chunked",
           "l2norm_qk", "attention_output_gate", "causal_conv1d_prefill", "causal_conv1d_update",
           "gated_delta_rule_chunked", "gated_delta_rule_recurrent", "rmsnorm_gated", "recurrent_state_cache",
           "routing_topk_sigmoid", "linear_nvfp4", "moe_grouped_gemm_nvfp4", "nvfp4_decode")


def _rows(model: str, target: str = "h200", stack: str | None = None) -> dict:
    inventory = build_inventory(str(model), target, stack)
    return {r.op.name: r for r in inventory.rows}, inventory.report


@pytest.mark.parametrize("stack", ["vllm-cuda", "vllm-cpu", "vllm-rocm"])
def test_every_stack_lists_the_new_operators_with_a_reason(stack):
    table = load_stack(stack)
    for name in NEW_OPS:
        entry = table.lookup(name)
        assert entry is not None and entry.reason, (stack, name)
        assert name in OP_KINDS
    assert set(stack_names()) >= {"vllm-cuda", "vllm-cpu", "vllm-rocm"}


def test_qwen3_next_linear_attention_ops_and_state():
    rows, report = _rows(CONFIGS / "qwen3-next-80b-a3b-thinking.json")
    for name in ("causal_conv1d_prefill", "causal_conv1d_update", "gated_delta_rule_chunked",
                 "gated_delta_rule_recurrent", "recurrent_state_cache", "attention_output_gate", "rmsnorm_gated"):
        assert rows[name].status == "native", name
        assert rows[name].op.layers == {i for i in range(48) if (i + 1) % 4} or name == "attention_output_gate"
    assert rows["attention_output_gate"].op.layers == set(range(3, 48, 4))
    assert "32 x 128 x 128" in rows["recurrent_state_cache"].op.detail
    assert report.metrics["origin"] == "spec"
    assert any(f.code == "inventory.spec_only" and "Gated DeltaNet" in f.message for f in report.findings)


def test_llama4_vision_chunked_nope_and_routing():
    rows, _ = _rows(CONFIGS / "llama-4-scout-17b-16e-instruct.json")
    for name in ("patch_embedding", "attention_vision", "patch_merge", "attention_chunked", "l2norm_qk",
                 "routing_topk_sigmoid"):
        assert rows[name].status == "native", name
    assert rows["attention_chunked"].op.layers == {i for i in range(48) if (i + 1) % 4}
    assert rows["attention_gqa"].op.layers == set(range(3, 48, 4)) and "NoPE" in rows["attention_gqa"].op.detail
    assert rows["rope_llama3"].op.layers == {i for i in range(48) if (i + 1) % 4}
    assert "bidirectional, variable length" in rows["attention_vision"].op.detail
    assert rows["attention_vision"].op.count == 34


def test_kimi_k25_int4_experts_and_vision():
    rows, _ = _rows(CONFIGS / "kimi-k2.5.json")
    assert rows["moe_grouped_gemm_int4"].status == "native"
    assert rows["int4_dequant"].op.layers == set(range(1, 61))
    assert rows["attention_vision"].op.count == 27


@pytest.mark.parametrize("target, stack, status", [("b200", None, "native"), ("h200", None, "missing"),
                                                    ("cpu", None, "missing"), ("mi300x", None, "missing")])
def test_nvfp4_expert_gemm_per_target(tmp_path, target, stack, status):
    config = json.loads((CONFIGS / "kimi-k2.6-nvfp4.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    rows, _ = _rows(tmp_path, target, stack)
    row = rows["moe_grouped_gemm_nvfp4"]
    assert row.status == status
    if status == "missing":
        assert row.plan  # every refusal carries what to do
    if target == "h200":
        assert "fp4" in row.provided and "Marlin" in row.plan
    assert rows["nvfp4_decode"].op.layers == set(range(1, 61))
