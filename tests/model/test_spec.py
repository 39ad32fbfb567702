"""ModelSpec from config.json: published parameter counts, per-layer structure, quantization
per component, a cross-check of the count formulas against transformers' own modules on the
meta device (shrunken configs of every family), and InputErrors for bad configs."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from adapt.errors import InputError
from adapt.model.spec import (
    COMPONENTS,
    SUPPORTED_MODEL_TYPES,
    ModelSpec,
    QuantFormat,
    list_presets,
    load_spec,
    spec_from_config,
)

# the shared folder beside the checkout (../shared from the repository root; CI lays a copy there)
SHARED_CONFIGS = Path(__file__).resolve().parents[2] / ".." / "shared" / "configs"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


PRESETS = Path(__file__).resolve().parents[2] / "adapt" / "model" / "presets"


def preset_config(name: str) -> dict:
    return json.loads((PRESETS / f"{name}.json").read_text())


# ----------------------------------------------------------------- published facts
# Values from ../shared/configs/README.md (public model cards and counts).


def test_gpt_oss_120b_total_and_active():
    counts = load_spec("gpt-oss-120b").param_counts()
    assert counts.total == 116_829_156_672
    assert 5.0e9 <= counts.active <= 5.2e9  # OpenAI README: 5.1B active
    assert counts.total_with_mtp == counts.total  # gpt-oss has no MTP layers


def test_gpt_oss_120b_checkpoint_bytes():
    """Experts MXFP4 (0.53125 B/param, biases bf16), everything else bf16: 65,248,815,744 B."""
    spec = load_spec("gpt-oss-120b")
    assert sum(spec.weight_bytes().values()) == 65_248_815_744


def test_qwen3_30b_a3b_total():
    assert load_spec("qwen3-30b-a3b").param_counts().total == 30_532_122_624


def test_mixtral_8x7b_total():
    assert load_spec("mixtral-8x7b").param_counts().total == 46_702_792_704


def test_deepseek_v32_as_stored():
    """61 layers + MTP layer 61 with its embed/head copies: DeepSeek-V3's 684,489,845,504 plus
    62 indexers of 13,959,424."""
    counts = load_spec("deepseek-v3.2").param_counts()
    assert counts.total_with_mtp == 685_355_329_792
    assert counts.total_with_mtp == 684_489_845_504 + 62 * 13_959_424
    assert counts.per_component["indexer"] == 61 * 13_959_424
    assert counts.per_layer[61] == counts.per_component["mtp"]
    assert 671e9 < counts.total - counts.per_component["indexer"] < 672e9  # "671B total"
    assert 36e9 < counts.active < 38e9  # "37B activated"


def test_deepseek_v3_without_indexer_matches_published():
    config = preset_config("deepseek-v3.2")
    config["model_type"] = "deepseek_v3"
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        del config[key]
    counts = spec_from_config(config, "v3").param_counts()
    assert counts.total_with_mtp == 684_489_845_504
    assert counts.per_component["indexer"] == 0


# ----------------------------------------------------------------- structure


def test_deepseek_v32_structure():
    spec = load_spec("deepseek-v3.2")
    assert spec.num_layers == 61 and len(spec.mtp_layers) == 1
    assert spec.mtp_layers[0].index == 61 and spec.mtp_layers[0].is_mtp
    assert [layer.ffn.kind for layer in spec.layers[:4]] == ["dense", "dense", "dense", "moe"]
    assert len(spec.moe_layers) == 58
    a = spec.layers[0].attention
    assert (a.kind, a.num_heads, a.head_dim, a.v_head_dim) == ("mla+dsa", 128, 192, 128)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim) == (1536, 512, 64)
    assert (a.index_n_heads, a.index_head_dim, a.index_topk) == (64, 128, 2048)
    ffn = spec.layers[3].ffn
    assert (ffn.num_experts, ffn.top_k, ffn.n_group, ffn.topk_group) == (256, 8, 8, 4)
    assert (ffn.num_shared_experts, ffn.shared_intermediate, ffn.expert_intermediate) == (1, 2048, 2048)
    assert (ffn.scoring, ffn.correction_bias, ffn.routed_scaling) == ("sigmoid", True, 2.5)
    assert spec.layers[0].ffn.intermediate == 18432
    rope = spec.rope
    assert (rope.type, rope.theta, rope.factor, rope.original_max_position) == ("yarn", 10000, 40, 4096)
    assert rope.rotary_dim == 64 and rope.interleaved
    assert rope.extra == {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    fp8 = spec.quant.format_of("routed_experts")
    assert (fp8.method, fp8.block_size, fp8.scale_format) == ("fp8_block", (128, 128), "ue8m0")
    for component in ("attention", "indexer", "shared_experts", "dense_mlp"):
        assert spec.quant.format_of(component) == fp8
    for component in ("embeddings", "lm_head", "router", "norms"):
        assert spec.quant.format_of(component).method == "bf16"


def test_gpt_oss_structure():
    spec = load_spec("gpt-oss-120b")
    kinds = [layer.attention.kind for layer in spec.layers]
    assert kinds[:2] == ["sliding", "gqa"] and kinds.count("sliding") == 18
    assert spec.layers[0].attention.window == 128 and spec.layers[1].attention.window is None
    a = spec.layers[0].attention
    assert a.sinks and a.bias and a.o_bias and (a.num_heads, a.num_kv_heads, a.head_dim) == (64, 8, 64)
    ffn = spec.layers[0].ffn
    assert (ffn.num_experts, ffn.top_k, ffn.activation, ffn.swiglu_limit, ffn.bias) == (
        128, 4, "swiglu_clamped", 7.0, True)
    assert spec.quant.format_of("routed_experts") == QuantFormat("mxfp4", (1, 32), "e8m0")
    for component in ("attention", "router", "embeddings", "lm_head"):
        assert spec.quant.format_of(component).method == "bf16"
    assert "lm_head" in spec.quant.modules_to_not_convert
    assert (spec.rope.type, spec.rope.theta, spec.rope.factor) == ("yarn", 150000, 32)
    assert not spec.tie_embeddings and spec.mtp_layers == ()


def test_qwen3_and_mixtral_structure():
    qwen = load_spec("qwen3-30b-a3b")
    a = qwen.layers[0].attention
    assert (a.kind, a.qk_norm, a.bias, a.head_dim, a.window) == ("gqa", True, False, 128, None)
    assert qwen.layers[0].ffn.norm_topk_prob and qwen.quant.source == "none"
    assert qwen.param_counts().per_component["attention"] == 48 * (2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 128)
    mixtral = load_spec("mixtral-8x7b")
    assert {layer.attention.kind for layer in mixtral.layers} == {"gqa"}
    assert mixtral.layers[0].ffn.expert_intermediate == 14336
    assert mixtral.rope.theta == 1e6


def test_active_counts_follow_top_k():
    """Active = total minus embeddings minus the unselected experts' share."""
    for name in list_presets():
        spec = load_spec(name)
        counts = spec.param_counts()
        unselected = sum(
            counts_per_layer_experts(spec, layer) // layer.ffn.num_experts
            * (layer.ffn.num_experts - layer.ffn.top_k)
            for layer in spec.moe_layers)
        assert counts.active == counts.total - counts.per_component["embeddings"] - unselected, name


def counts_per_layer_experts(spec: ModelSpec, layer) -> int:
    return sum(t.numel for t in spec.tensors() if t.layer == layer.index and t.component == "routed_experts")


def test_per_component_sums_to_total():
    for name in list_presets():
        counts = load_spec(name).param_counts()
        assert set(counts.per_component) == set(COMPONENTS)
        main = sum(n for c, n in counts.per_component.items() if c != "mtp")
        assert main == counts.total
        assert counts.total_with_mtp == counts.total + counts.per_component["mtp"]
        assert sum(counts.per_layer.values()) == counts.total_with_mtp - sum(
            counts.per_component[c] for c in ("embeddings", "lm_head")) - load_spec(name).hidden


# ----------------------------------------------------------------- transformers cross-check


def shrink(config: dict) -> dict:
    """The same architecture at toy widths: few layers, small dims, same flags and patterns."""
    c = copy.deepcopy(config)
    for key in ("quantization_config", "pad_token_id", "bos_token_id", "eos_token_id"):
        c.pop(key, None)
    mt = c["model_type"]
    mla = mt in ("deepseek_v3", "deepseek_v32", "kimi_k2")
    small = {
        "hidden_size": 64, "vocab_size": 320, "intermediate_size": 96, "moe_intermediate_size": 24,
        "num_attention_heads": 8, "num_key_value_heads": 8 if mla else 2,
    }
    c.update(small)
    c["num_hidden_layers"] = 4
    if "head_dim" in c or mt in ("gpt_oss", "glm4_moe"):
        c["head_dim"] = 16
    if mla:
        c.update({"kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12})
        if c.get("q_lora_rank") is not None:
            c["q_lora_rank"] = 32
    if mt == "deepseek_v32":
        c.update({"index_n_heads": 4, "index_head_dim": 16, "index_topk": 8})
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if key in c:
            c[key] = 8
    for key in ("num_experts_per_tok", "experts_per_token"):
        if key in c:
            c[key] = 2
    if c.get("n_group", 1) > 1:
        c["n_group"], c["topk_group"] = 4, 2
    if "first_k_dense_replace" in c:
        c["first_k_dense_replace"] = min(c["first_k_dense_replace"], 1)
    if "layer_types" in c:
        c["layer_types"] = c["layer_types"][:4]
    if c.get("sliding_window"):
        c["sliding_window"] = 16
    if "max_window_layers" in c:
        c["max_window_layers"] = 4
    return c


def transformers_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor transformers' *ForCausalLM stores for ``config``, built on
    the meta device; tied weights once; persistent buffers (DeepSeek/GLM e_score_correction_bias)
    included, as the checkpoints store them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(config)
    model_type = config.pop("model_type")
    if model_type == "kimi_k2":  # DeepSeek-V3 architecture under another name
        model_type = "deepseek_v3"
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    every_param = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    unique_params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    buffers = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in every_param}
    return unique_params | buffers


def is_expert_tensor(name: str) -> bool:
    return ".experts." in name


def glm4_moe_config(**overrides) -> dict:
    return json.loads((FIXTURES / "glm4_moe_tiny.json").read_text()) | overrides


CROSS_CHECK = {
    "deepseek-v3.2": lambda: shrink(preset_config("deepseek-v3.2")),
    "deepseek-v3": lambda: shrink(preset_config("deepseek-v3.2") | {"model_type": "deepseek_v3"}),
    "kimi_k2-no-q-lora-bias": lambda: shrink(preset_config("deepseek-v3.2") | {
        "model_type": "kimi_k2", "q_lora_rank": None, "attention_bias": True, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 2, "n_shared_experts": 2}),
    "gpt-oss-120b": lambda: shrink(preset_config("gpt-oss-120b")),
    "gpt-oss-no-bias": lambda: shrink(preset_config("gpt-oss-120b") | {"attention_bias": False}),
    "qwen3-30b-a3b": lambda: shrink(preset_config("qwen3-30b-a3b")),
    "qwen3-dense-layers": lambda: shrink(preset_config("qwen3-30b-a3b")) | {
        "mlp_only_layers": [0], "decoder_sparse_step": 2, "attention_bias": True},
    "mixtral-8x7b": lambda: shrink(preset_config("mixtral-8x7b")),
    "glm4_moe": lambda: glm4_moe_config(),
    "glm4_moe-qk-norm": lambda: glm4_moe_config(use_qk_norm=True, attention_bias=False,
                                                first_k_dense_replace=0, n_shared_experts=2),
}


@pytest.mark.parametrize("case", sorted(CROSS_CHECK))
def test_counts_match_transformers_on_meta(case):
    """Totals and per-layer counts equal transformers' modules; every tensor but the routed
    experts (which transformers 5 fuses into gate_up_proj) has the same name and shape."""
    config = CROSS_CHECK[case]()
    spec = spec_from_config(config, case)
    counts = spec.param_counts()
    theirs = transformers_tensors(config)
    assert counts.total == sum(math.prod(shape) for shape in theirs.values())
    their_layers: dict[int, int] = {}
    for name, shape in theirs.items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            their_layers[index] = their_layers.get(index, 0) + math.prod(shape)
    assert {i: n for i, n in counts.per_layer.items() if i < spec.num_layers} == their_layers
    ours = {t.name.replace("block_sparse_moe.gate", "mlp.gate"): t.shape
            for t in spec.tensors(include_mtp=False) if not is_expert_tensor(t.name)}
    assert ours == {name: shape for name, shape in theirs.items() if not is_expert_tensor(name)}


def test_tied_embeddings_drop_lm_head():
    config = CROSS_CHECK["qwen3-30b-a3b"]() | {"tie_word_embeddings": True}
    spec = spec_from_config(config, "tied")
    counts = spec.param_counts()
    assert counts.per_component["lm_head"] == 0
    assert counts.total == sum(math.prod(shape) for shape in transformers_tensors(config).values())
    # the tied table is the output projection: active, unlike a lookup-only embedding table
    assert counts.active == counts.total - sum(
        t.numel - t.active for t in spec.tensors() if t.component == "routed_experts")


def test_shrunk_configs_keep_their_structure():
    """The cross-check exercises what it claims: dense and MoE layers, sliding windows, MTP."""
    ds = spec_from_config(CROSS_CHECK["deepseek-v3.2"](), "ds")
    assert [layer.ffn.kind for layer in ds.layers] == ["dense", "moe", "moe", "moe"]
    assert ds.layers[0].attention.kind == "mla+dsa" and len(ds.mtp_layers) == 1
    oss = spec_from_config(CROSS_CHECK["gpt-oss-120b"](), "oss")
    assert [layer.attention.kind for layer in oss.layers] == ["sliding", "gqa"] * 2
    qwen = spec_from_config(CROSS_CHECK["qwen3-dense-layers"](), "qwen")
    assert [layer.ffn.kind for layer in qwen.layers] == ["dense", "moe", "dense", "moe"]
    glm = spec_from_config(CROSS_CHECK["glm4_moe"](), "glm")
    assert [layer.ffn.kind for layer in glm.layers][:2] == ["dense", "moe"] and len(glm.mtp_layers) == 1


# ----------------------------------------------------------------- glm4_moe and MTP


def test_glm4_moe_spec():
    spec = spec_from_config(glm4_moe_config(), "glm")
    a = spec.layers[0].attention
    assert (a.kind, a.bias, a.o_bias, a.qk_norm) == ("gqa", True, False, False)
    assert spec.rope.partial_rotary_factor == 0.5 and spec.rope.rotary_dim == a.head_dim // 2
    assert not spec.rope.interleaved
    ffn = spec.layers[1].ffn
    assert (ffn.scoring, ffn.correction_bias, ffn.num_shared_experts) == ("sigmoid", True, 1)
    mtp = spec.mtp_layers[0]
    assert mtp.index == spec.num_layers and mtp.ffn.kind == "moe"


def test_mtp_layer_holds_decoder_layer_plus_its_extras():
    spec = spec_from_config(glm4_moe_config(), "glm")
    h, v = spec.hidden, spec.vocab
    counts = spec.param_counts()
    decoder_layer = counts.per_layer[spec.num_layers - 1]  # last main layer: MoE like the MTP layer
    extras = 3 * h + 2 * h * h + 2 * v * h  # enorm, hnorm, shared_head.norm; eh_proj; embed + head copies
    assert counts.per_component["mtp"] == decoder_layer + extras
    mtp_names = {t.name for t in spec.tensors() if t.mtp}
    assert f"model.layers.{spec.num_layers}.eh_proj.weight" in mtp_names
    assert f"model.layers.{spec.num_layers}.shared_head.head.weight" in mtp_names


# ----------------------------------------------------------------- quantization formats


def test_bytes_per_param():
    assert QuantFormat("bf16").bytes_per_param == 2
    assert QuantFormat("fp32").bytes_per_param == 4
    assert QuantFormat("fp8_block", (128, 128), "ue8m0").bytes_per_param == 1 + 4 / (128 * 128)
    assert QuantFormat("fp8_block", (128, 128), "fp32").bytes_per_param == 1 + 4 / (128 * 128)
    assert QuantFormat("mxfp4", (1, 32), "e8m0").bytes_per_param == 0.5 + 1 / 32
    assert QuantFormat("int4", (1, 32), "bf16").bytes_per_param == 0.5 + 2 / 32


def test_tensor_bytes_counts_edge_blocks():
    fp8 = QuantFormat("fp8_block", (128, 128), "fp32")
    assert fp8.tensor_bytes((256, 256)) == 256 * 256 + 4 * 4
    assert fp8.tensor_bytes((2, 129, 128)) == 2 * 129 * 128 + 2 * 2 * 1 * 4  # partial row block
    assert QuantFormat("mxfp4", (1, 32), "e8m0").tensor_bytes((4, 8, 64)) == 4 * 8 * (32 + 2)
    # int4 pack-quantized: packed values, bf16 group scales, and the I64 [2] weight_shape tensor
    assert QuantFormat("int4", (1, 32), "bf16").tensor_bytes((16, 64)) == 16 * 64 // 2 + 16 * 2 * 2 + 16
    assert QuantFormat("bf16").tensor_bytes((3, 5)) == 30


def kimi_thinking_style(ignore: list[str]) -> dict:
    """A shrunk DeepSeek-V3-architecture config with a Kimi K2 Thinking style int4 block."""
    config = shrink(preset_config("deepseek-v3.2") | {"model_type": "kimi_k2"})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": 32,
                                                  "dynamic": False}}},
        "ignore": ignore,
    }
    return config


@pytest.mark.parametrize("ignore", [
    ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    ["lm_head"] + [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in
                   ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
    + [f"model.layers.{i}.mlp.shared_experts.{p}" for i in range(1, 4)
       for p in ("gate_proj", "up_proj", "down_proj")]
    + [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")],
])
def test_compressed_tensors_int4_routed_experts_only(ignore):
    spec = spec_from_config(kimi_thinking_style(ignore), "kimi")
    assert spec.quant.source == "compressed-tensors"
    assert spec.quant.format_of("routed_experts") == QuantFormat("int4", (1, 32), "bf16")
    for component in ("attention", "shared_experts", "dense_mlp", "lm_head", "router", "embeddings"):
        assert spec.quant.format_of(component).method == "bf16", component


def test_compressed_tensors_without_ignore_quantizes_every_linear():
    spec = spec_from_config(kimi_thinking_style([]), "kimi")
    for component in ("attention", "shared_experts", "dense_mlp", "routed_experts", "lm_head"):
        assert spec.quant.format_of(component).method == "int4", component
    assert spec.quant.format_of("router").method == "bf16"


def test_fp8_modules_to_not_convert():
    config = preset_config("deepseek-v3.2")
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.*.self_attn"]
    spec = spec_from_config(config, "ds")
    assert spec.quant.format_of("attention").method == "bf16"
    assert spec.quant.format_of("indexer").method == "bf16"  # the indexer lives under self_attn
    assert spec.quant.format_of("routed_experts").method == "fp8_block"


# ----------------------------------------------------------------- hash, dict, loading


def test_spec_hash_is_of_the_normalized_spec():
    config = preset_config("mixtral-8x7b")
    base = spec_from_config(config, "a").spec_hash()
    reordered = dict(reversed(list(config.items())))
    assert spec_from_config(reordered, "b").spec_hash() == base
    assert spec_from_config(config | {"initializer_range": 0.5}, "c").spec_hash() == base
    assert spec_from_config(config | {"num_hidden_layers": 31}, "d").spec_hash() != base
    assert spec_from_config(config | {"rope_theta": 10000.0}, "e").spec_hash() != base
    assert len(base) == 16 and int(base, 16) >= 0


def test_to_dict_is_json():
    for name in list_presets():
        spec = load_spec(name)
        data = json.loads(json.dumps(spec.to_dict()))
        assert data["params"]["total"] == spec.param_counts().total
        assert data["spec_hash"] == spec.spec_hash()
        assert len(data["layers"]) == spec.num_layers
        assert data["layers"][0]["attention"]["kind"] == spec.layers[0].attention.kind


def test_load_spec_from_directory_file_and_preset(tmp_path):
    (tmp_path / "config.json").write_text((PRESETS / "qwen3-30b-a3b.json").read_text())
    by_dir = load_spec(tmp_path)
    by_file = load_spec(str(tmp_path / "config.json"))
    by_preset = load_spec("qwen3-30b-a3b")
    assert by_dir.source == str(tmp_path / "config.json")
    assert by_preset.source == "qwen3-30b-a3b"
    assert by_dir == by_file == ModelSpec(**{**by_preset.__dict__, "source": by_dir.source})
    assert by_dir.spec_hash() == by_preset.spec_hash()


def test_list_presets():
    assert set(list_presets()) >= {"deepseek-v3.2", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b"}


def test_presets_are_the_shared_configs():
    pairs = {"deepseek-v3.2": "DeepSeek-V3.2", "gpt-oss-120b": "gpt-oss-120b",
             "qwen3-30b-a3b": "Qwen3-30B-A3B", "mixtral-8x7b": "Mixtral-8x7B"}
    assert SHARED_CONFIGS.is_dir(), f"{SHARED_CONFIGS}: the shared folder must sit beside the checkout"
    for preset, folder in pairs.items():
        assert preset_config(preset) == json.loads((SHARED_CONFIGS / folder / "config.json").read_text())


def test_load_spec_bad_paths(tmp_path):
    with pytest.raises(InputError, match="no such model directory, config file or preset") as err:
        load_spec("no-such-model")
    assert "gpt-oss-120b" in err.value.hint
    with pytest.raises(InputError, match="no config.json"):
        load_spec(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON") as err:
        load_spec(bad)
    assert err.value.file == str(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(InputError, match="expected a JSON object"):
        load_spec(bad)


# ----------------------------------------------------------------- bad configs


def with_changes(name: str, **changes) -> dict:
    config = preset_config(name)
    for key, value in changes.items():
        if value is DELETE:
            del config[key]
        else:
            config[key] = value
    return config


DELETE = object()

BAD_CONFIGS = [
    # (preset, changes, field named in the error, words in the message)
    ("mixtral-8x7b", {"model_type": "llama"}, "model_type", "expected one of"),
    ("mixtral-8x7b", {"model_type": DELETE}, "model_type", "missing required field"),
    ("mixtral-8x7b", {"num_key_value_heads": 5}, "num_key_value_heads", "divisor of num_attention_heads"),
    ("mixtral-8x7b", {"num_experts_per_tok": 9}, "num_experts_per_tok", "at most num_local_experts (8)"),
    ("mixtral-8x7b", {"hidden_size": 0}, "hidden_size", "positive integer, got 0"),
    ("mixtral-8x7b", {"hidden_size": -4096}, "hidden_size", "positive integer, got -4096"),
    ("mixtral-8x7b", {"hidden_size": "4096"}, "hidden_size", "positive integer, got '4096'"),
    ("mixtral-8x7b", {"hidden_size": 4096.0}, "hidden_size", "positive integer"),
    ("mixtral-8x7b", {"num_hidden_layers": True}, "num_hidden_layers", "positive integer"),
    ("mixtral-8x7b", {"vocab_size": DELETE}, "vocab_size", "missing required field"),
    ("mixtral-8x7b", {"tie_word_embeddings": "no"}, "tie_word_embeddings", "true or false"),
    ("mixtral-8x7b", {"torch_dtype": "int8"}, "torch_dtype", "one of bfloat16"),
    ("mixtral-8x7b", {"rope_theta": -1}, "rope_theta", "positive number"),
    ("deepseek-v3.2", {"num_experts_per_tok": 300}, "num_experts_per_tok", "at most n_routed_experts"),
    ("deepseek-v3.2", {"topk_group": 9}, "topk_group", "at most n_group (8)"),
    ("deepseek-v3.2", {"n_routed_experts": 250}, "n_routed_experts", "multiple of n_group (8)"),
    ("deepseek-v3.2", {"topk_group": 1, "num_experts_per_tok": 40}, "num_experts_per_tok",
     "topk_group x experts per group (32)"),
    ("deepseek-v3.2", {"first_k_dense_replace": 62}, "first_k_dense_replace",
     "at most num_hidden_layers (61)"),
    ("deepseek-v3.2", {"kv_lora_rank": DELETE}, "kv_lora_rank", "missing required field"),
    ("deepseek-v3.2", {"index_topk": DELETE}, "index_topk", "missing required field"),
    ("deepseek-v3.2", {"q_lora_rank": None}, "q_lora_rank", "DSA indexer"),
    ("deepseek-v3.2", {"scoring_func": "relu"}, "scoring_func", "one of sigmoid, softmax"),
    ("deepseek-v3.2", {"num_nextn_predict_layers": -1}, "num_nextn_predict_layers", "integer >= 0"),
    ("deepseek-v3.2", {"rope_scaling": {"type": "yarn"}}, "rope_scaling.factor", "missing required field"),
    ("deepseek-v3.2", {"rope_scaling": {"type": "ntk", "factor": 4}}, "rope_scaling.type", "one of default"),
    ("deepseek-v3.2", {"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method",
     "one of fp8, mxfp4, compressed-tensors"),
    ("deepseek-v3.2", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "quantization_config.weight_block_size", "[rows, cols]"),
    ("gpt-oss-120b", {"layer_types": ["full_attention"] * 35}, "layer_types", "36 entries"),
    ("gpt-oss-120b", {"layer_types": ["global"] * 36}, "layer_types",
     "'sliding_attention' or 'full_attention'"),
    ("gpt-oss-120b", {"sliding_window": None}, "sliding_window", "missing required field"),
    ("gpt-oss-120b", {"experts_per_token": 8}, "experts_per_token", "equal to num_experts_per_tok (4)"),
    ("gpt-oss-120b", {"quantization_config": {"quant_method": "mxfp4",
                                              "modules_to_not_convert": ["model.layers.*.mlp"]}},
     "quantization_config.modules_to_not_convert", "leave the routed experts in mxfp4"),
    ("qwen3-30b-a3b", {"mlp_only_layers": [48]}, "mlp_only_layers", "layer indices in [0, 48)"),
    ("qwen3-30b-a3b", {"num_experts": DELETE}, "num_experts", "missing required field"),
]


@pytest.mark.parametrize("preset,changes,field,words", BAD_CONFIGS,
                         ids=[f"{p}:{f}:{i}" for i, (p, _, f, _) in enumerate(BAD_CONFIGS)])
def test_bad_config_names_file_field_and_expectation(preset, changes, field, words):
    config = with_changes(preset, **changes)
    with pytest.raises(InputError) as err:
        spec_from_config(config, f"/models/{preset}/config.json")
    assert err.value.file == f"/models/{preset}/config.json"
    assert err.value.field == field
    assert words in err.value.message
    line = str(err.value)
    assert line.startswith(f"/models/{preset}/config.json: field '{field}': ") and "\n" not in line


def test_compressed_tensors_unsupported_scheme():
    config = kimi_thinking_style([])
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    with pytest.raises(InputError) as err:
        spec_from_config(config, "kimi")
    assert err.value.field == "quantization_config.config_groups.group_0.weights.num_bits"


def test_every_supported_model_type_builds():
    configs = {
        "deepseek_v3": CROSS_CHECK["deepseek-v3"](), "deepseek_v32": CROSS_CHECK["deepseek-v3.2"](),
        "kimi_k2": CROSS_CHECK["kimi_k2-no-q-lora-bias"](), "gpt_oss": CROSS_CHECK["gpt-oss-120b"](),
        "qwen3_moe": CROSS_CHECK["qwen3-30b-a3b"](), "mixtral": CROSS_CHECK["mixtral-8x7b"](),
        "glm4_moe": CROSS_CHECK["glm4_moe"](),
        "kimi_k25": json.loads((FIXTURES / "kimi-k2.5.json").read_text()),
        "llama4": json.loads((FIXTURES / "llama-4-scout-17b-16e-instruct.json").read_text()),
        "qwen3_next": json.loads((FIXTURES / "qwen3-next-80b-a3b-thinking.json").read_text()),
    }
    assert set(configs) == set(SUPPORTED_MODEL_TYPES)
    for model_type, config in configs.items():
        assert spec_from_config(config, model_type).model_type == model_type


# ----------------------------------------------------------------- more published counts
# Sources of these totals (Hub counts, independent copies): tests/fixtures/configs/README.md. They were
# not used to build the formulas: a wrong term for MLA width, qk-norm, MTP copies or shared experts breaks them.


def test_kimi_k2_instruct_total():
    spec = load_spec(FIXTURES / "kimi-k2-instruct.aiconfigurator.json")
    assert spec.model_type == "kimi_k2" and spec.layers[0].attention.kind == "mla"
    assert [layer.ffn.kind for layer in spec.layers[:2]] == ["dense", "moe"]
    assert spec.param_counts().total == 1_026_408_232_448


def test_glm_4_5_air_total_with_mtp():
    counts = load_spec(FIXTURES / "glm-4.5-air.json").param_counts()
    assert counts.total_with_mtp == 110_468_824_832


def test_glm_4_5_total_with_and_without_mtp():
    config = json.loads((FIXTURES / "glm-4.5-air.json").read_text()) | {
        "hidden_size": 5120, "num_hidden_layers": 92, "first_k_dense_replace": 3,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_routed_experts": 160,
        "use_qk_norm": True, "routed_scaling_factor": 2.5}
    counts = spec_from_config(config, "glm-4.5").param_counts()
    assert counts.total == 352_797_829_024
    assert counts.total_with_mtp == 358_337_791_296


def test_qwen3_235b_a22b_total():
    config = preset_config("qwen3-30b-a3b") | {
        "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
        "moe_intermediate_size": 1536, "intermediate_size": 12288, "max_window_layers": 94}
    assert spec_from_config(config, "qwen3-235b").param_counts().total == 235_093_634_560


# ----------------------------------------------------------------- config dialects


def test_transformers5_rope_parameters_and_dtype_keys():
    """transformers 5 writes rope_parameters (theta inside) and dtype instead of torch_dtype."""
    old = preset_config("gpt-oss-120b")
    new = dict(old)
    scaling = new.pop("rope_scaling")
    new["rope_parameters"] = scaling | {"rope_theta": new.pop("rope_theta")}
    new["dtype"] = "bfloat16"
    assert spec_from_config(new, "new").rope == spec_from_config(old, "old").rope
    glm = glm4_moe_config()
    glm["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    spec = spec_from_config(glm, "glm")
    assert (spec.rope.partial_rotary_factor, spec.rope.rotary_dim, spec.rope.theta) == (0.25, 4, 1e6)


def compressed_tensors_fp8(strategy: str, **weights) -> dict:
    config = glm4_moe_config()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, **weights}}},
    }
    return config


def test_compressed_tensors_fp8_schemes():
    channel = spec_from_config(compressed_tensors_fp8("channel"), "glm")
    fmt = channel.quant.format_of("attention")
    assert (fmt.method, fmt.scale_format) == ("fp8_channel", "bf16")
    assert fmt.tensor_bytes((3, 64, 32)) == 3 * 64 * 32 + 3 * 64 * 2
    assert channel.quant.format_of("lm_head").method == "bf16"
    block = spec_from_config(compressed_tensors_fp8("block", block_structure=[128, 128]), "glm")
    assert block.quant.format_of("routed_experts") == QuantFormat("fp8_block", (128, 128), "bf16")
    tensor = spec_from_config(compressed_tensors_fp8("tensor", scale_dtype="float32"), "glm")
    assert tensor.quant.format_of("dense_mlp") == QuantFormat("fp8_tensor", None, "fp32")
    assert tensor.quant.format_of("router").method == "bf16"


def test_fp8_without_block_size_is_per_tensor():
    config = preset_config("deepseek-v3.2")
    del config["quantization_config"]["weight_block_size"]
    del config["quantization_config"]["scale_fmt"]
    spec = spec_from_config(config, "ds")
    assert spec.quant.format_of("routed_experts") == QuantFormat("fp8_tensor", None, "fp32")


def test_tensor_inventory_agrees_with_counts_and_formats():
    spec = load_spec("deepseek-v3.2")
    tensors = spec.tensors()
    assert sum(t.numel for t in tensors) == spec.param_counts().total_with_mtp
    assert sum(t.active for t in tensors if not t.mtp) == spec.param_counts().active
    by_name = {t.name: t for t in tensors}
    assert by_name["model.layers.61.eh_proj.weight"].shape == (7168, 14336)
    def method(name: str) -> str:
        return spec.tensor_format(by_name[f"model.layers.5.{name}"]).method

    assert method("self_attn.indexer.wk.weight") == "fp8_block"
    assert method("self_attn.indexer.weights_proj.weight") == "bf16"
    assert method("mlp.gate.weight") == "bf16"
    experts = by_name["model.layers.5.mlp.experts.*.down_proj.weight"]
    assert experts.shape == (256, 7168, 2048) and experts.active == experts.numel // 256 * 8
