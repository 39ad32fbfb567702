"""A tiny Llama 4-style multimodal MoE, built through transformers' Llama4ForConditionalGeneration
(so names and config are transformers' own), for the multimodal reference path
(adapt.runtime.multimodal): 4 language layers (MoE on layers 1 and 3, every second layer as in
Maverick; NoPE on layer 3, chunked attention of 8 tokens on the others, q/k L2 norm), 4 experts
top-1 plus a shared expert; a 2-block ViT on 56-pixel tiles of 14-pixel patches (16 patches, 4
language tokens after the 2x2 pixel shuffle); float32 weights.

Weights are re-drawn from a generator seeded by ``seed``: matrices N(0, 1/fan_in), norm weights
1 + N(0, 0.1^2), biases, class and position embeddings N(0, 0.1^2), the token embedding N(0, 1),
the head 3x the matrix scale (logits near 3 standard deviations: greedy choices far from ties).
Token ids 252, 253, 254 are begin-of-image, end-of-image and the image placeholder.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 256
BOI, EOI, IMAGE = 252, 253, 254

TINY_LLAMA4_TEXT = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 96,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
    "attention_chunk_size": 8, "use_qk_norm": True, "rope_theta": 10000.0, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}
TINY_LLAMA4_VISION = {
    "hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "image_size": 56, "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 64,
    "projector_output_dim": 64, "vision_output_dim": 64, "norm_eps": 1e-5, "rope_theta": 10000,
}


def build_tiny_llama4(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write config.json and model.safetensors of the tiny multimodal model into ``out_dir``."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    config = Llama4Config(text_config=dict(TINY_LLAMA4_TEXT), vision_config=dict(TINY_LLAMA4_VISION),
                          boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
                          tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    model = Llama4ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1 and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1 or "class_embedding" in name or "positional_embedding" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                # experts are [E, in, out] in transformers' Llama 4 layout, every other matrix [out, in]
                fan_in = p.shape[-2] if ".experts." in name else p.shape[-1]
                scale = 3.0 if name.endswith("lm_head.weight") else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


TINY_KIMI_K25_TEXT = {
    "model_type": "kimi_k2", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "topk_method": "noaux_tc",  # as published: vLLM builds the router's correction bias from it
    "num_nextn_predict_layers": 0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    # YaRN as the published config has it (factor 64 over 4096 there), scaled down to these positions
    "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
}
TINY_KIMI_K25_VISION = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 14,
    "pos_emb_height": 8, "pos_emb_width": 8, "merge_kernel_size": [2, 2],
}


def build_tiny_kimi_k25(out_dir: str | Path, *, seed: int = 0, **text_overrides) -> Path:
    """A tiny Kimi K2.5 (MoonViT on an 8 x 8 position grid, 2 blocks; DeepSeek-V3 text of 3 layers,
    the first dense, then MoE with 4 experts top-2 and a shared expert; MLA with q_lora_rank, YaRN)
    through transformers' Kimi_K25ForConditionalGeneration, weights drawn as above (matrices
    N(0, 1/fan_in), the head 3x; norms 1 + N(0, 0.1^2); other vectors, the router's correction bias
    among them, N(0, 0.1^2)); ids 252, 253, 254 begin an image, end it and stand for it. Tensors are
    stored under the published checkpoint's names (``_published_name``). ``text_overrides`` replace
    entries of the language model's config (e.g. the published MLA widths, kv_lora_rank 512 and
    qk_rope_head_dim 64)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = {**TINY_KIMI_K25_TEXT, **text_overrides}
    config = Kimi_K25Config(text_config=text, vision_config=dict(TINY_KIMI_K25_VISION),
                            projection_hidden_size=TINY_KIMI_K25_VISION["hidden_size"], image_token_id=IMAGE,
                            vision_start_token_id=BOI, vision_end_token_id=EOI, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                scale = 3.0 if name.endswith("lm_head.weight") else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    out = Path(out_dir)
    model.save_pretrained(out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({_published_name(k): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    config_path = out / "config.json"
    written = json.loads(config_path.read_text())
    # as published (tests/fixtures/configs/kimi-k2.5.json): the architecture name vLLM's registry knows, and
    # images and videos as one "vision_chunk" modality (vLLM's chat renderer reads it)
    written.update(architectures=["KimiK25ForConditionalGeneration"], use_unified_vision_chunk=True)
    config_path.write_text(json.dumps(written, indent=2) + "\n")
    return out


KIMI_CHAT_IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
"""One image in a Kimi K2.5 prompt (vLLM's KimiK25ForConditionalGeneration.get_placeholder_str)."""


def write_kimi_serving_files(out_dir: str | Path, *, patch_limit: int = 256, side_limit: int = 16) -> None:
    """What vLLM needs beside a tiny Kimi K2.5's weights to serve it: a tokenizer (one token per
    printable ASCII character at ids 3-97, <s> </s> <pad> at 0-2, <|media_begin|> <|media_end|>
    <|media_pad|> <|media_content|> at 252-255), a chat template that writes ``KIMI_CHAT_IMAGE`` for
    each image part, and ``preprocessor_config.json`` with the ``media_proc_cfg`` keys vLLM's
    KimiK25FusedVisionProcessor reads (0.5 / 0.5 normalisation; at most ``patch_limit`` patches,
    ``side_limit`` a side, tiny limits: transformers' Kimi_K25ImageProcessor allows 16384 and 512)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    out = Path(out_dir)
    special = {"<s>": 0, "</s>": 1, "<pad>": 2, "<|media_begin|>": BOI, "<|media_end|>": EOI, "<|media_pad|>": IMAGE,
               "<|media_content|>": VOCAB - 1}
    vocab = {chr(c): 3 + i for i, c in enumerate(range(32, 127))}
    vocab.update({f"<unused_{i}>": i for i in range(3 + len(vocab), BOI)})
    vocab.update(special)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in special])
    tokenizer.save(str(out / "tokenizer.json"))
    template = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}"
                + KIMI_CHAT_IMAGE + "{% endif %}{% endfor %}{% endif %}{% endfor %}")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<pad>", "model_max_length": 512, "chat_template": template}, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "patch_size": TINY_KIMI_K25_VISION["patch_size"],
        "merge_kernel_size": TINY_KIMI_K25_VISION["merge_kernel_size"],
        "in_patch_limit": patch_limit, "patch_limit_on_one_side": side_limit, "fixed_output_tokens": None,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "temporal_merge_kernel_size": 4,
        "in_patch_limit_each_frame": patch_limit, "in_patch_limit_video": 4 * patch_limit}}, indent=2) + "\n")


def _published_name(name: str) -> str:
    """transformers 5.19 saves three kinds of Kimi K2.5 tensor under other names than the published
    checkpoints use (adapt.model.spec's Kimi K2.5 names; vLLM's loader reads them):
    ``language_model.model.blocks.N`` (its reverse of the vision tower's blocks -> layers renaming),
    ``model.mm_projector.pre_norm``, ``vision_tower.encoder.patch_embed``. transformers loads the
    published names back to the same weights (tests/runtime/test_kimi_k25_vs_transformers.py)."""
    if name.startswith("model.mm_projector."):
        return name[len("model."):]
    name = name.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
    return name.replace("language_model.model.blocks.", "language_model.model.layers.")
