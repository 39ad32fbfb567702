"""Tiny models: transformers loads and runs them; builds are deterministic and atomic."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from adapt.errors import InputError
from adapt.model.tiny import TINY_MODELS, build_tiny, tiny_path

# the published gpt-oss-120b config, as this repository keeps it (a copy of ../shared/configs/gpt-oss-120b)
REAL_GPT_OSS = Path(__file__).resolve().parents[2] / "adapt" / "model" / "presets" / "gpt-oss-120b.json"


@pytest.fixture(scope="module")
def built():
    """The cached builds (a build trains the model: 5-30 s each, so the tests below rebuild only tiny-qwen3)."""
    return {name: tiny_path(name) for name in TINY_MODELS}


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_transformers_loads_every_tensor_and_generates(built, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(
        built[name], dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(built[name])
    ids = tokenizer("Experts are small networks; a router picks", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.isfinite(logits).all()
    assert logits.std() > 1.0  # initialised so that the head's logits are not flat
    generated = out[0, ids.shape[1] :].tolist()
    assert len(generated) == 12 and len(set(generated)) > 1


def test_builds_are_bit_identical_idempotent_and_cached_under_adapt_cache_dir(built, monkeypatch, tmp_path):
    name = "tiny-qwen3"  # the cheapest to train; the others share the builder
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path))
    again = tiny_path(name)
    assert again.parent == tmp_path / "tiny" and again.name.startswith(f"{name}-")
    assert _digests(again) == _digests(built[name])
    before = {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    assert tiny_path(name) == again and build_tiny(name, again) == again
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before
    assert not [p for p in (tmp_path / "tiny").iterdir() if p.name.startswith(".")]  # no temp dirs left


@pytest.mark.parametrize("name", TINY_MODELS)
def test_trained_model_continues_the_bundled_text(built, name):
    """The build trains the model on the bundled text: its greedy continuation of a corpus sentence is the
    corpus's own, and the training loss fell from near ln(512) = 6.2 nats to well under 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    training = json.loads((built[name] / "adapt-training.json").read_text())
    assert training["loss_first_20"] > 4 and training["loss_last_20"] < 1
    tokenizer = AutoTokenizer.from_pretrained(built[name])
    model = AutoModelForCausalLM.from_pretrained(built[name], dtype=torch.float32).float()
    ids = tokenizer("In the village the baker", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).startswith(" opened his door at six")


def test_other_seed_gives_other_weights(built, tmp_path):
    other = build_tiny("tiny-qwen3", tmp_path / "q", seed=1)
    assert _digests(other)["model.safetensors"] != _digests(built["tiny-qwen3"])["model.safetensors"]
    assert _digests(other)["tokenizer.json"] == _digests(built["tiny-qwen3"])["tokenizer.json"]


def test_refuses_foreign_directory_and_unknown_name(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="something other than"):
        build_tiny("tiny-dsa", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(InputError, match="unknown tiny model"):
        build_tiny("tiny-llama", tmp_path / "x")


def test_tiny_oss_stores_experts_in_gpt_oss_mxfp4_layout(built):
    directory = built["tiny-oss"]
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"] == json.loads(REAL_GPT_OSS.read_text())["quantization_config"]
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    experts, hidden, inter = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = set(f.keys())
        layer = "model.layers.0.mlp.experts."
        assert f.get_tensor(layer + "gate_up_proj_blocks").shape == (experts, 2 * inter, hidden // 32, 16)
        assert f.get_tensor(layer + "gate_up_proj_scales").shape == (experts, 2 * inter, hidden // 32)
        assert f.get_tensor(layer + "down_proj_blocks").shape == (experts, hidden, inter // 32, 16)
        assert f.get_tensor(layer + "down_proj_blocks").dtype == torch.uint8
        assert f.get_tensor("model.layers.0.self_attn.sinks").dtype == torch.bfloat16
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)


def test_tiny_dsa_has_dense_then_moe_layers_and_small_topk(built):
    config = json.loads((built["tiny-dsa"] / "config.json").read_text())
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert config["index_topk"] == 16
    with safe_open(built["tiny-dsa"] / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert "model.layers.2.self_attn.indexer.weights_proj.weight" in names


def test_tokenizer_round_trips_text(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["tiny-dsa"])
    text = "Prefill reads the whole prompt; décodé 42 ✓"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert max(ids) < json.loads((built["tiny-dsa"] / "config.json").read_text())["vocab_size"]
    assert tokenizer.eos_token_id == 1 and tokenizer.bos_token_id == 0


def test_tiny_oss_experts_decode_to_the_weights_transformers_runs(built):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = AutoModelForCausalLM.from_pretrained(built["tiny-oss"], dtype=torch.float32)
    with safe_open(built["tiny-oss"] / "model.safetensors", "pt") as f:
        blocks = f.get_tensor("model.layers.1.mlp.experts.down_proj_blocks")
        scales = f.get_tensor("model.layers.1.mlp.experts.down_proj_scales")
    decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    torch.testing.assert_close(model.model.layers[1].mlp.experts.down_proj.float(), decoded, rtol=0, atol=0)
    # gpt-oss expert weights of std ~1/sqrt(128): E8M0 scales sit well inside the normal range
    assert 100 < scales.min() and scales.max() < 127
