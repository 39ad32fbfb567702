"""A tiny Qwen3-Next-style hybrid model, built through transformers' own class (so names and
config are the ones transformers and the published checkpoints use), for the hybrid reference
path (adapt.runtime.hybrid): 4 decoder layers alternating Gated DeltaNet (layers 0, 2) and gated
full attention (layers 1, 3), layer 0 a dense SwiGLU, layers 1-3 MoE with 4 experts top-2 and
a gated shared expert; float32 weights.

Weights are re-drawn from a generator seeded by ``seed``: matrices N(0, 1/fan_in), norm weights
(zero-centred: the model multiplies by 1 + w) N(0, 0.1^2), conv taps N(0, 1/kernel), dt_bias 1 and
A_log log(U[1, 8]) as transformers initialises them, the embedding N(0, 1); the head is scaled
so that logits have a standard deviation near 3, which keeps greedy choices far from ties.
"""

from __future__ import annotations

from pathlib import Path

TINY_QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_tiny_qwen3_next(out_dir: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Write config.json and model.safetensors of the tiny hybrid model into ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {**TINY_QWEN3_NEXT, **overrides}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                fan_in = p.shape[-1]
                scale = 3.0 if name == "lm_head.weight" else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
