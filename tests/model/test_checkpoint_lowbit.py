"""INT4 (compressed-tensors pack-quantized) and NVFP4 (ModelOpt) expert formats: bytes exact
against checkpoints built from safetensors headers (sparse data areas), at the published widths
of Kimi K2.5 (int4, group 32) and Kimi K2.6 NVFP4, reduced to two decoder layers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from adapt.errors import InputError
from adapt.model.checkpoint import Checkpoint, expected_tensors
from adapt.model.spec import QuantFormat, load_spec

from .test_checkpoint import write_model

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def _two_layers(config: dict) -> dict:
    """The same model at two decoder layers (layer 0 dense, layer 1 MoE) and two ViT blocks."""
    config = json.loads(json.dumps(config))
    config["text_config"]["num_hidden_layers"] = 2
    config["vision_config"]["vt_num_hidden_layers"] = 2
    return config


def _write(directory: Path, config: dict, hf_quant: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    spec = load_spec(directory)
    files = {name: (e.dtype or "BF16", e.shape) for name, e in expected_tensors(spec).items()}
    write_model(directory, files, shards=3)
    return directory


def test_nvfp4_format_bytes_from_definition():
    nvfp4 = QuantFormat("nvfp4", (1, 16), "e4m3")
    # [out 32, in 64]: 32*64/2 packed bytes, 32*4 e4m3 scales, fp32 weight_scale_2 + input_scale
    assert nvfp4.tensor_bytes((32, 64)) == 1024 + 128 + 8
    assert nvfp4.tensor_bytes((3, 32, 64)) == 3 * (1024 + 128 + 8)
    assert nvfp4.bytes_per_param == 0.5 + 1 / 16


def test_kimi_k26_nvfp4_from_hf_quant_config_is_planned_at_its_bytes(tmp_path):
    config = _two_layers(json.loads((CONFIGS / "kimi-k2.6-nvfp4.json").read_text()))
    config.pop("quantization_config")  # only hf_quant_config.json says NVFP4
    hf_quant = json.loads((CONFIGS / "kimi-k2.6-nvfp4.hf_quant_config.json").read_text())
    directory = _write(tmp_path / "k26", config, hf_quant)
    spec = load_spec(directory)
    assert spec.quant.source == "modelopt NVFP4"
    assert {c: f.method for c, f in spec.quant.per_component.items()} == {"routed_experts": "nvfp4"}
    checkpoint = Checkpoint.open(directory)
    assert checkpoint.check_against(spec) == []
    have = checkpoint.bytes_by_component()
    want = spec.weight_bytes()
    assert checkpoint.total_bytes == sum(want.values())
    assert have["routed_experts"] + have["scales"] == want["routed_experts"]
    experts = 384 * 3 * 2048 * 7168
    assert want["routed_experts"] == experts // 2 + experts // 16 + 384 * 3 * 8
    for component in ("vision", "projector", "attention", "dense_mlp", "shared_experts"):
        assert have[component] == want[component] > 0  # excluded modules stay bf16
    assert checkpoint.tensors["language_model.model.layers.1.mlp.experts.7.up_proj.weight"].dtype == "U8"


def test_kimi_k25_int4_pack_quantized_bytes(tmp_path):
    config = _two_layers(json.loads((CONFIGS / "kimi-k2.5.json").read_text()))
    directory = _write(tmp_path / "k25", config)
    spec = load_spec(directory)
    assert spec.quant.format_of("routed_experts") == QuantFormat("int4", (1, 32), "bf16")
    checkpoint = Checkpoint.open(directory)
    assert checkpoint.check_against(spec) == []
    assert checkpoint.total_bytes == sum(spec.weight_bytes().values())
    matrices = 384 * 3
    experts = matrices * 2048 * 7168
    # int32-packed values, bf16 scales per 32, and an I64 [2] weight_shape per matrix
    assert spec.weight_bytes()["routed_experts"] == experts // 2 + experts // 32 * 2 + matrices * 16
    name = "language_model.model.layers.1.mlp.experts.0.down_proj"
    assert checkpoint.tensors[name + ".weight_packed"].shape == (7168, 2048 // 8)
    assert checkpoint.tensors[name + ".weight_scale"].shape == (7168, 2048 // 32)


def test_nvfp4_checkpoint_headers_do_not_pass_as_bf16(tmp_path):
    """Without any quantization config the spec says bf16, and the NVFP4 headers say otherwise."""
    config = _two_layers(json.loads((CONFIGS / "kimi-k2.6-nvfp4.json").read_text()))
    config["text_config"]["n_routed_experts"] = 8
    directory = _write(tmp_path / "k26", config)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                        if k != "quantization_config"}))
    findings = Checkpoint.open(directory).check_against(load_spec(directory))
    assert any(f.code == "checkpoint.shape_mismatch" and f.severity == "error" for f in findings)


def test_hf_quant_config_that_contradicts_config_json_is_input_error(tmp_path):
    config = json.loads((CONFIGS / "kimi-k2.5.json").read_text())  # compressed-tensors int4
    hf_quant = json.loads((CONFIGS / "kimi-k2.6-nvfp4.hf_quant_config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    with pytest.raises(InputError) as err:
        load_spec(tmp_path)
    assert err.value.field == "quantization.quant_algo" and "hf_quant_config.json" in str(err.value.file)


def test_unsupported_modelopt_algorithm_names_the_field(tmp_path):
    config = json.loads((CONFIGS / "kimi-k2.6-nvfp4.json").read_text())
    config["quantization_config"]["quant_algo"] = "W4A8_AWQ"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as err:
        load_spec(tmp_path)
    assert err.value.field == "quantization_config.quant_algo"
    assert math.isclose(QuantFormat("nvfp4", (1, 16), "e4m3").bytes_per_param, 0.5625)
