"""Stage 2 for the multimodal and hybrid families: image tokens in the KV budget, the
linear-attention state per sequence beside the growing KV, vision weights and activations,
NVFP4 experts at their stored size; stage 4 accepts the published configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adapt.cli import app
from adapt.errors import InputError
from adapt.model.spec import load_spec
from adapt.plan.layout import (
    Layout,
    _stage_weights,
    kv_bytes_per_sequence,
    layout_problems,
    plan_memory,
    pp_stages,
    recurrent_state_bytes,
)
from adapt.stages.parallel import run_plan_parallel
from adapt.targets.target import load_target

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
QWEN3_NEXT = CONFIGS / "qwen3-next-80b-a3b-thinking.json"
SCOUT = CONFIGS / "llama-4-scout-17b-16e-instruct.json"
KIMI = CONFIGS / "kimi-k2.5.json"


def test_qwen3_next_state_is_constant_per_sequence_beside_growing_kv():
    spec = load_spec(QWEN3_NEXT)
    layout = Layout(tp=4)
    # 36 Gated DeltaNet layers: conv (2*16*128 + 32*128) / 4 channels x 3 taps, state 32/4 x 128 x 128, bf16
    state = 36 * ((8192 // 4) * 3 + 8 * 128 * 128) * 2
    assert recurrent_state_bytes(spec, layout) == state == 9_879_552
    # 12 full-attention layers: K and V, 2 KV heads (one per TP rank when TP exceeds them... here 2 // 4 -> 1)
    per_token = 12 * 1 * (256 + 256) * 2
    for tokens in (64, 4096, 65536):
        assert kv_bytes_per_sequence(spec, layout, "bf16", tokens, 64) == per_token * tokens + state


def test_image_tokens_join_the_kv_budget():
    spec, h200 = load_spec(SCOUT), load_target("h200")
    text = plan_memory(spec, h200, devices=8, context=8192, batch=4, search=False)
    with_images = plan_memory(spec, h200, devices=8, context=8192, batch=4, search=False,
                              images=2, image_size=(672, 672))
    assert with_images.image_tokens_per_request == 2 * 727  # 4 tiles + global tile, separators, 3 markers
    grown = kv_bytes_per_sequence(spec, with_images.layout, "bf16", 8192 + 2 * 727, 64)
    assert with_images.kv_bytes_per_sequence == grown > text.kv_bytes_per_sequence
    assert with_images.activation_detail["vision_encoder"] > 0
    assert text.weights_by_component["vision"] == with_images.weights_by_component["vision"] > 0


def test_vision_weights_live_on_the_first_pipeline_stage():
    spec, h200 = load_spec(KIMI), load_target("h200")
    layout = Layout(tp=8, pp=2)
    first, last = pp_stages(spec.num_layers, 2)
    stage0 = _stage_weights(spec, layout, "as-stored", 0, first, h200, None).by_component
    stage1 = _stage_weights(spec, layout, "as-stored", 1, last, h200, None).by_component
    assert stage0["vision"] == spec.weight_bytes()["vision"]  # replicated, with the embeddings
    assert "vision" not in stage1 and "projector" not in stage1


def test_images_on_a_text_only_model_name_the_flag():
    with pytest.raises(InputError) as err:
        plan_memory(load_spec(QWEN3_NEXT), load_target("h200"), devices=4, context=4096, batch=1, images=1)
    assert err.value.field == "--images"


def test_hybrid_head_splits_are_checked():
    spec = load_spec(QWEN3_NEXT)
    assert layout_problems(spec, Layout(tp=8)) == []
    assert any("linear-attention key heads" in p for p in layout_problems(spec, Layout(tp=32)))
    assert any("linear-attention state" in p for p in layout_problems(spec, Layout(tp=8, dcp=4)))


def test_nvfp4_experts_planned_at_their_stored_size(tmp_path):
    config = json.loads((CONFIGS / "kimi-k2.6-nvfp4.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text((CONFIGS / "kimi-k2.6-nvfp4.hf_quant_config.json").read_text())
    spec = load_spec(tmp_path)
    plan = plan_memory(spec, load_target("b200"), devices=8, context=8192, batch=1, search=False)
    experts = 60 * 384 * 3 * 2048 * 7168
    stored = experts // 2 + experts // 16 + 60 * 384 * 3 * 8
    assert plan.weights_by_component["routed_experts"] == round(stored / 8)  # TP8 splits the experts
    assert stored < 0.3 * experts * 2  # never the bf16 size


@pytest.mark.parametrize("name", ["kimi-k2.5", "llama-4-scout-17b-16e-instruct",
                                  "llama-4-maverick-17b-128e-instruct", "qwen3-next-80b-a3b-thinking"])
def test_plan_memory_and_parallel_accept_the_published_configs(name, tmp_path):
    path = str(CONFIGS / f"{name}.json")
    args = ["plan-memory", path, "-t", "h200", "-d", "8", "--context", "16384", "--json", "-o", str(tmp_path)]
    if name != "qwen3-next-80b-a3b-thinking":
        args += ["--images", "1", "--image-size", "768x1024"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["metrics"]["image_tokens_per_request"] == (0 if "qwen" in name else
                                                           load_spec(path).vision.image_tokens(768, 1024))
    report = run_plan_parallel(path, "h200", gates={}, devices=8, nodes=1, context=16384, batch=4)
    assert report.verdict in ("pass", "warn") and report.metrics["serve_command"]


@pytest.mark.parametrize("args, field", [(["--image-size", "1024"], "--image-size"),
                                         (["--images", "-1"], "--images"),
                                         (["--images", "5000", "--image-size", "4000x4000"], "--context")])
def test_bad_image_flags_exit_2_with_one_line(args, field, tmp_path):
    result = CliRunner().invoke(app, ["plan-memory", str(SCOUT), "-t", "h200", "-d", "8", "--context", "8192",
                                      "-o", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert f"field '{field}'" in result.output and "Traceback" not in result.output
