"""CPU hand-off of an MXFP4 checkpoint: experts dequantized to bf16, same outputs as transformers' own."""

import json

import torch

from adapt.handoff.bundle import export_dequantized, needs_dequantized_experts
from adapt.model.tiny import build_tiny


def test_mxfp4_experts_are_exported_as_bf16(tmp_path):
    source = build_tiny("tiny-oss", tmp_path / "tiny-oss")
    assert needs_dequantized_experts(source, "cpu")
    assert not needs_dequantized_experts(source, "9.0")
    out = export_dequantized(source, tmp_path / "bf16")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert (out / "tokenizer.json").is_file()
    assert not needs_dequantized_experts(out, "cpu")

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Mxfp4Config

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert not [n for n in names if n.endswith("_blocks") or n.endswith("_scales")]
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").dtype == torch.bfloat16

    ids = torch.tensor([[5, 17, 33, 90, 4]])
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    original = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16,
                                                    quantization_config=Mxfp4Config(dequantize=True))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, original(ids).logits)
