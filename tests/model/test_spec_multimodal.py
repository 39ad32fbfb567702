"""ModelSpec for the multimodal and hybrid families: Kimi K2.5, Llama 4 Scout / Maverick, Qwen3-Next.

Exact parameter counts per component are checked against transformers' own model built on the
meta device (transformers >= 5.16 implements kimi_k25, llama4 and qwen3_next). The published
totals quoted beside them are rounded marketing numbers from the model cards:
  Kimi K2.5          moonshotai/Kimi-K2.5 model card: "1T total parameters, 32B activated",
                     vision encoder MoonViT "400M"
  Llama 4 Scout      meta-llama/Llama-4-Scout-17B-16E-Instruct model card: "17B active, 109B total"
  Llama 4 Maverick   meta-llama/Llama-4-Maverick-17B-128E-Instruct model card: "17B active, 400B total"
  Qwen3-Next-80B-A3B Qwen/Qwen3-Next-80B-A3B-Thinking model card: "80B in total and 3B activated"
The config files and where they come from: tests/fixtures/configs/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapt.errors import InputError
from adapt.model.spec import load_spec, spec_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"

# exact counts (transformers 5.19 on the meta device, 2026-11-30; the spec adds the 60 x 384
# e_score_correction_bias values Kimi stores, which transformers keeps as a buffer)
EXACT = {
    "kimi-k2.5": dict(total=1_026_879_376_368, vision=416_866_032, projector=54_277_888,
                      routed_experts=1_014_686_023_680, active=31_687_095_808),
    "llama-4-scout-17b-16e-instruct": dict(total=108_641_793_536, vision=811_115_008, projector=60_817_408,
                                           routed_experts=96_636_764_160, active=16_138_408_960),
    "llama-4-maverick-17b-128e-instruct": dict(total=401_583_781_376, vision=811_115_008, projector=60_817_408,
                                               routed_experts=386_547_056_640, active=16_150_205_440),
    "qwen3-next-80b-a3b-thinking": dict(total=79_674_391_296, vision=0, projector=0,
                                        routed_experts=77_309_411_328, active=3_563_764_480),
}
PUBLISHED_TOTAL = {"kimi-k2.5": 1.0e12, "llama-4-scout-17b-16e-instruct": 109e9,
                   "llama-4-maverick-17b-128e-instruct": 400e9, "qwen3-next-80b-a3b-thinking": 80e9}


def _spec(name: str):
    return load_spec(CONFIGS / f"{name}.json")


@pytest.mark.parametrize("name", sorted(EXACT))
def test_counts_per_component(name):
    counts = _spec(name).param_counts()
    want = EXACT[name]
    assert counts.total == want["total"]
    assert counts.vision == want["vision"]
    assert counts.projector == want["projector"]
    assert counts.language == want["total"] - want["vision"] - want["projector"]
    assert counts.per_component["routed_experts"] == want["routed_experts"]
    assert counts.active == want["active"]
    assert abs(counts.total - PUBLISHED_TOTAL[name]) / PUBLISHED_TOTAL[name] < 0.03


def _component_of_hf(name: str) -> str:
    if "vision_adapter" in name or "mm_projector" in name or "multi_modal_projector" in name:
        return "projector"
    if "vision_tower" in name or "vision_model" in name:
        return "vision"
    if ".experts." in name:
        return "routed_experts"
    return "language"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXACT))
def test_counts_equal_transformers_on_meta(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    config.pop("quantization_config", None)
    config.get("text_config", {}).pop("quantization_config", None)
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    auto = (transformers.AutoModelForImageTextToText if "vision_config" in config
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    theirs = dict.fromkeys(("vision", "projector", "routed_experts", "language"), 0)
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for tensor_name, tensor in tensors:
        theirs[_component_of_hf(tensor_name)] += tensor.numel()
    counts = _spec(name).param_counts()
    assert theirs["vision"] == counts.vision
    assert theirs["projector"] == counts.projector
    assert theirs["routed_experts"] == counts.per_component["routed_experts"]
    assert sum(theirs.values()) == counts.total


def test_kimi_k25_language_model_is_kimi_k2():
    # Kimi-K2-Instruct's published total (tests/fixtures/configs/README.md)
    assert _spec("kimi-k2.5").param_counts().language == 1_026_408_232_448


def test_llama4_layouts():
    scout, maverick = _spec("llama-4-scout-17b-16e-instruct"), _spec("llama-4-maverick-17b-128e-instruct")
    assert all(layer.ffn.kind == "moe" for layer in scout.layers)
    assert [layer.index for layer in maverick.moe_layers] == list(range(1, 48, 2))
    nope = [layer.index for layer in scout.layers if not layer.attention.rope]
    assert nope == list(range(3, 48, 4))
    chunked = scout.layers[0].attention
    assert (chunked.kind, chunked.chunk, chunked.window, chunked.qk_l2norm) == ("chunked", 8192, 8192, True)
    assert scout.layers[3].attention.kind == "gqa" and scout.layers[3].attention.chunk is None
    assert not maverick.layers[0].attention.qk_l2norm  # Maverick: use_qk_norm false
    assert scout.layers[0].ffn.score_after_topk and scout.layers[0].ffn.num_shared_experts == 1


def test_qwen3_next_hybrid_layout():
    spec = _spec("qwen3-next-80b-a3b-thinking")
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds.count("linear") == 36 and kinds.count("gqa") == 12
    assert [i for i, k in enumerate(kinds) if k == "gqa"] == list(range(3, 48, 4))
    linear = spec.layers[0].attention
    assert (linear.linear_key_heads, linear.linear_value_heads, linear.linear_key_dim, linear.conv_kernel) == (
        16, 32, 128, 4)
    assert spec.layers[3].attention.output_gate and spec.rope.rotary_dim == 64
    assert spec.param_counts().per_component["linear_attention"] == 36 * 33_718_464


def test_image_tokens_by_resolution():
    kimi = _spec("kimi-k2.5").vision
    # MoonViT: 14-pixel patches merged 2x2; 448x448 -> 32x32 patches -> 256 tokens
    assert kimi.encoder_tokens(448, 448) == 1024 and kimi.image_tokens(448, 448) == 256
    assert kimi.image_tokens(1080, 1920) == 39 * 69  # padded to 28-pixel windows: 1092 x 1932
    scout = _spec("llama-4-scout-17b-16e-instruct").vision
    # aiconfigurator's Llama 4 tests: one 336 tile -> 147 tokens; 672x672 -> 4 tiles + global -> 727
    assert scout.image_tokens(336, 336) == 147 and scout.encoder_tokens(336, 336) == 577
    assert scout.image_tokens(672, 672) == 727 and scout.encoder_tokens(672, 672) == 5 * 577
    assert scout.image_tokens(10_000, 10_000) == 17 * 144 + 16 + 3  # at most 16 local tiles


def test_bad_multimodal_fields_name_the_field():
    config = json.loads((CONFIGS / "llama-4-scout-17b-16e-instruct.json").read_text())
    config["text_config"]["no_rope_layers"] = [1, 0]
    with pytest.raises(InputError, match="no_rope_layers"):
        spec_from_config(config, "scout.json")
    kimi = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    del kimi["vision_config"]
    with pytest.raises(InputError, match="vision_config"):
        spec_from_config(kimi, "kimi.json")
    qwen = json.loads((CONFIGS / "qwen3-next-80b-a3b-thinking.json").read_text())
    qwen["linear_num_value_heads"] = 24
    with pytest.raises(InputError, match="linear_num_value_heads"):
        spec_from_config(qwen, "qwen.json")
