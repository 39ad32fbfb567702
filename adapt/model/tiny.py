"""Tiny embedded models: small checkpoints that transformers itself loads, built offline.

Four models, each a directory with ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``:

  tiny-dsa    deepseek_v32: MLA + DSA indexer (index_topk 16), 3 layers (layer 0 dense,
              layers 1-2 MoE with 8 routed experts in 4 groups, top-2, one shared expert),
              YaRN RoPE with DeepSeek-V3.2's factors; bf16 weights, fp32 router bias.
  tiny-oss    gpt_oss: GQA (4 query / 2 kv heads), sliding window 16 on even layers and
              full attention on odd layers, attention sinks, clamped SwiGLU; 4 layers,
              8 experts top-2 stored MXFP4 in the gpt-oss layout (``*_blocks`` uint8
              [E, N, K/32, 16], ``*_scales`` uint8 [E, N, K/32]); everything else bf16.
  tiny-qwen3  qwen3_moe: GQA with q/k norms, 2 layers of 8 experts top-2; bf16.
  tiny-dsa-fp8  tiny-dsa with expert width 128 and its routed experts stored as DeepSeek-V3.2 ships
              them: e4m3 ``weight`` with an fp32 ``weight_scale_inv`` per 128 x 128 block (power-of-two,
              "ue8m0"), DeepSeek's fp8 ``quantization_config``; everything else bf16.

Every model is created through transformers' own model class (so the tensor names and the
config are the ones transformers expects), then every tensor is initialised from a
generator seeded by (seed, tensor name), then the model is trained briefly (``TRAINING``)
on the bundled text so that it behaves like a trained model: its greedy text follows the
text, and its router and logit choices have margins instead of the near ties of random
weights. Initial scales: embeddings N(0, 1); a linear map with fan-in f is N(0, 1/f) (outputs
that feed the residual stream are halved); norm weights 1 + N(0, 0.1^2); biases
N(0, 0.1^2); lm_head N(0, (3/sqrt(hidden))^2), giving logits of standard deviation ~3.
gpt-oss expert gate/up weights get 3x the usual scale so that the SwiGLU clamp (limit 7)
is actually reached by a few percent of the activations.

Training (``_train``): next-token cross-entropy on random windows of the training text (the
text embedded below, then ``adapt/eval/data/corpus.txt`` and ``sample.txt``, all written for
adapt), every parameter, Adam with a linear warm-up and cosine decay, in float32 on one CPU
thread (so a build is bit-identical across runs on one machine; other CPUs may round the
training differently in the last bits). Routers learn through the loss, plus a margin term
(``_router_margin_loss``) that keeps each token's k-th and (k+1)-th expert apart, as a trained
router's decisive choices are; DeepSeek's correction bias stays 0 as at initialisation. The DSA
indexer runs without gradients in transformers (DeepSeek trains it with a separate distillation
loss), so its own weights keep their initial values.
Cost and losses go to ``adapt-training.json`` in the model directory.

The tokenizer is a byte-level BPE of 512 tokens trained (``tokenizers``, offline) on the
training text; ids 0, 1, 2 are ``<|bos|>``, ``<|eos|>``, ``<|pad|>``.

API: ``TINY_MODELS``, ``build_tiny(name, out_dir, seed=0)``, ``tiny_path(name)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

from adapt.errors import InputError

BUILDER_VERSION = 3
STAMP_FILE = "adapt-tiny.json"
TRAINING_FILE = "adapt-training.json"
TEXT_DIR = Path(__file__).resolve().parents[1] / "eval" / "data"
TEXT_FILES = ("corpus.txt", "sample.txt")  # appended to _TOKENIZER_TEXT: the training text

# The training recipe (part of the cache key). Measured on 2 shared CPU cores, 2026-11-30: 200 steps of 8 windows
# of 64 tokens take 10-30 s per model (tiny-qwen3 fastest, tiny-oss slowest) and bring the loss (next-token plus
# router margin) from ~5-6 to ~0.15 nats; 120 steps left tiny-dsa's greedy text garbled after a few words.
TRAINING = {"steps": 200, "batch": 8, "window": 64, "lr": 5e-3, "warmup": 10, "clip": 1.0,
            "router_margin": 0.25, "router_margin_weight": 1.0}
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# gpt-oss-120b's quantization_config (see /work/shared/configs/gpt-oss-120b/config.json).
GPT_OSS_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}

# Config fields per model (passed to the transformers config class). RoPE factors mirror the
# real checkpoints: DeepSeek-V3.2 YaRN (factor 40 over 4096, mscale 1) and gpt-oss YaRN
# (factor 32 over 4096, beta 32/1, no truncation).
_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-dsa": {
        "model_type": "deepseek_v32",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 192,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
    },
    "tiny-oss": {
        "model_type": "gpt_oss",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
    "tiny-qwen3": {
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 192,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
}

# tiny-dsa with DeepSeek-V3's expert format: routed experts in e4m3 with one fp32 weight_scale_inv per
# 128 x 128 block (expert width 128 so gate and up each fill whole blocks); everything else as tiny-dsa.
_CONFIGS["tiny-dsa-fp8"] = {**_CONFIGS["tiny-dsa"], "moe_intermediate_size": 128}
FP8_BLOCK_EXPERTS = ("tiny-dsa-fp8",)
"""Tiny models whose routed experts are stored FP8 with 128 x 128 block scales."""

TINY_MODELS: tuple[str, ...] = tuple(_CONFIGS)

# The start of the training text (tokenizer and model), written for this file.
_TOKENIZER_TEXT = """\
The river ran past the mill and the mill wheel turned all day, slow and steady, while the
miller counted sacks of grain and wrote the numbers in a small green book. In the evening
the children came down to the water to throw stones, and the dog barked at every splash.
A model is a set of numbers that turns one list of tokens into a guess about the next one.
Experts are small networks; a router picks a few of them for every token, and the rest sleep.
Attention looks back over the tokens that came before; a sliding window looks back only a
little way, and a sink lets a head attend to nothing at all when nothing is worth reading.
The indexer scores every earlier token cheaply and keeps the best ones, so the expensive
attention reads a few thousand tokens instead of a million. Numbers are stored in four bits
with one shared exponent for every thirty-two of them, and turned back into eight bits just
before they are multiplied. Prefill reads the whole prompt at once; decode adds one token at
a time and keeps the keys and values in pages of sixty-four tokens.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096
def forward(x): return x + 1
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past nine.
"""


def training_text() -> str:
    """The text the tokenizer and the model are trained on: the text above, then the bundled files."""
    return _TOKENIZER_TEXT + "".join((TEXT_DIR / name).read_text() for name in TEXT_FILES)


def _builder_hash(name: str, seed: int) -> str:
    """Short digest of everything that determines a build's bytes (12 hex characters)."""
    payload = json.dumps(
        {
            "version": BUILDER_VERSION,
            "name": name,
            "seed": seed,
            "config": _CONFIGS[name],
            "text": training_text(),
            "vocab": VOCAB_SIZE,
            "training": TRAINING,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _check_name(name: str) -> None:
    if name not in _CONFIGS:
        raise InputError(
            f"unknown tiny model '{name}'", field="model", hint=f"choose one of {', '.join(TINY_MODELS)}"
        )


def tiny_path(name: str, *, seed: int = 0) -> Path:
    """The cached directory of tiny model ``name``, built on first use.

    Location: ``$ADAPT_CACHE_DIR/tiny/<name>-<hash>`` (default ``~/.cache/adapt``), where the
    hash covers the builder version, the config, the tokenizer text and the seed.
    """
    _check_name(name)
    root = Path(os.environ.get("ADAPT_CACHE_DIR", Path.home() / ".cache" / "adapt"))
    return build_tiny(name, root / "tiny" / f"{name}-{_builder_hash(name, seed)}", seed=seed)


def build_tiny(name: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Build tiny model ``name`` into ``out_dir`` and return ``out_dir``.

    Idempotent: a directory already built with the same name, seed and builder returns at
    once. The build happens in a temporary sibling directory that is renamed into place, so a
    reader never sees a half-written model (two concurrent builders: the first rename wins).
    A non-empty ``out_dir`` that holds something else is an ``InputError``.
    """
    _check_name(name)
    out_dir = Path(out_dir)
    stamp = {"name": name, "seed": seed, "builder": _builder_hash(name, seed)}
    if out_dir.exists():
        if _read_stamp(out_dir) == stamp:
            return out_dir
        if any(out_dir.iterdir()):
            raise InputError(
                f"directory holds something other than {name} (seed {seed})",
                file=out_dir,
                hint="pass an empty or missing directory",
            )
        out_dir.rmdir()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_tokenizer(tmp)
        _write_model(name, tmp, seed)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True) + "\n")
        try:
            tmp.rename(out_dir)
        except OSError:
            if _read_stamp(out_dir) != stamp:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _read_stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _init_std(family: str, name: str, shape: tuple[int, ...], hidden: int) -> tuple[float, float]:
    """(mean, std) of the initial values of tensor ``name`` of ``shape``."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        return 1.0, 0.1
    if leaf in ("bias", "e_score_correction_bias") or leaf.endswith("_bias"):
        return 0.0, 0.1
    if leaf == "sinks":
        return 0.0, 1.0
    if "embed_tokens" in name:
        return 0.0, 1.0
    if name.startswith("lm_head"):
        return 0.0, 3.0 / hidden**0.5
    if len(shape) == 3:  # fused experts: gpt-oss stores [E, in, out], the others [E, out, in]
        fan_in = shape[1] if family == "gpt_oss" else shape[2]
        gain = 3.0 if family == "gpt_oss" and leaf == "gate_up_proj" else 1.0
    else:
        fan_in = shape[-1]
        gain = 1.0
    if leaf in ("down_proj", "o_proj") or name.endswith(("down_proj.weight", "o_proj.weight")):
        gain *= 0.5
    return 0.0, gain / fan_in**0.5


def _write_model(name: str, out_dir: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(_CONFIGS[name])
    family = fields.pop("model_type")
    config = AutoConfig.for_model(
        family, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **fields
    )
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hidden = config.hidden_size
    with torch.no_grad():
        for tensor_name, tensor in sorted(model.state_dict(keep_vars=True).items()):
            mean, std = _init_std(family, tensor_name, tuple(tensor.shape), hidden)
            gen = torch.Generator().manual_seed(_tensor_seed(seed, tensor_name))
            tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * std + mean)
    summary = _train(model, _training_tokens(out_dir), seed)
    (out_dir / TRAINING_FILE).write_text(json.dumps({**TRAINING, **summary}, indent=1, sort_keys=True) + "\n")
    keep_fp32 = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    model.to(torch.bfloat16)
    for module in keep_fp32:
        module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    model.config.dtype = "bfloat16"
    model.save_pretrained(out_dir)
    if family == "gpt_oss":
        _store_gpt_oss_experts_mxfp4(out_dir)
    if name in FP8_BLOCK_EXPERTS:
        _store_experts_fp8_block(out_dir)


def _training_tokens(out_dir: Path) -> list[int]:
    """The training text as token ids of the tokenizer in ``out_dir``, one EOS after every line."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    ids: list[int] = []
    for line in training_text().splitlines():
        if line.strip():
            ids += tokenizer.encode(line).ids + [EOS_ID]
    return ids


def _train(model, tokens: list[int], seed: int) -> dict[str, Any]:
    """Train ``model`` (float32, in place) on windows of ``tokens`` by the ``TRAINING`` recipe.

    Every step draws ``batch`` windows of ``window`` + 1 tokens at random offsets (generator seeded by
    ``seed``); transformers shifts the labels. Runs on one thread and restores the thread count.
    Returns the mean loss of the first and last 20 steps (nats per token) and the token count.
    """
    import math

    import torch

    steps, batch, window = TRAINING["steps"], TRAINING["batch"], TRAINING["window"]
    data = torch.tensor(tokens)
    gen = torch.Generator().manual_seed(_tensor_seed(seed, "training"))
    optimizer = torch.optim.Adam(model.parameters(), lr=TRAINING["lr"], betas=(0.9, 0.95))
    top_k, family = model.config.num_experts_per_tok, model.config.model_type
    logits: list[torch.Tensor] = []  # every router's logits [tokens, experts] of the current step
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    hooks = [r.register_forward_hook(lambda _m, _i, out: logits.append(out[0])) for r in routers]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    losses: list[float] = []
    model.train()
    try:
        for step in range(steps):
            warm = min(1.0, (step + 1) / TRAINING["warmup"])
            for group in optimizer.param_groups:
                group["lr"] = TRAINING["lr"] * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
            offsets = torch.randint(0, len(data) - window - 1, (batch,), generator=gen)
            x = torch.stack([data[o : o + window + 1] for o in offsets.tolist()])
            logits.clear()
            loss = model(input_ids=x, labels=x).loss
            loss = loss + TRAINING["router_margin_weight"] * _router_margin_loss(logits, top_k, family)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING["clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
        model.eval()
        for hook in hooks:
            hook.remove()
    return {"tokens": len(tokens),
            "loss_first_20": round(sum(losses[:20]) / 20, 3), "loss_last_20": round(sum(losses[-20:]) / 20, 3)}


def _router_margin_loss(logits: list, top_k: int, family: str):
    """Mean over routers and tokens of relu(margin - gap), gap = (k-th largest score - (k+1)-th) / (max - min).

    Scores as the router ranks experts (DeepSeek: sigmoid of the logits; Qwen3: softmax; gpt-oss: the
    logits). Stage 5 calls a routing flip a near tie when the swapped experts' scores differ by a small
    fraction of the row's range; this term keeps the top-k boundary ``TRAINING['router_margin']`` of the
    range apart, as a trained router's decisive choices are.
    """
    if not logits:
        return 0.0
    import torch

    terms = []
    for row in logits:
        row = row.float()
        scores = row.sigmoid() if family.startswith("deepseek") else row.softmax(-1) if family == "qwen3_moe" else row
        ranked = scores.sort(-1, descending=True).values
        gap = (ranked[:, top_k - 1] - ranked[:, top_k]) / (ranked[:, 0] - ranked[:, -1] + 1e-6)
        terms.append(torch.relu(TRAINING["router_margin"] - gap).mean())
    return torch.stack(terms).mean()


def _store_gpt_oss_experts_mxfp4(out_dir: Path) -> None:
    """Replace the bf16 expert weights in ``out_dir`` by MXFP4 ``*_blocks`` / ``*_scales``.

    transformers keeps gpt-oss experts as ``gate_up_proj`` [E, hidden, 2 * intermediate] and
    ``down_proj`` [E, intermediate, hidden] (input dimension first); the checkpoint stores the
    transpose [E, out, in] quantized along ``in``, which is the layout transformers dequantizes.
    """
    from safetensors.torch import load_file, save_file

    from adapt.kernels.mxfp4 import quantize_mxfp4_torch, to_gpt_oss_blocks

    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    converted = {}
    for tensor_name, tensor in tensors.items():
        if tensor_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed, scales = quantize_mxfp4_torch(tensor.float().transpose(1, 2).contiguous())
            converted[tensor_name + "_blocks"] = to_gpt_oss_blocks(packed).contiguous()
            converted[tensor_name + "_scales"] = scales
        else:
            converted[tensor_name] = tensor
    save_file(converted, path, metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_QUANTIZATION
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _store_experts_fp8_block(out_dir: Path) -> None:
    """Replace the bf16 routed-expert projections in ``out_dir`` by e4m3 ``weight`` and fp32
    ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] (DeepSeek-V3's layout: weight = e4m3 value times
    the scale of its block), and add DeepSeek-V3.2's fp8 quantization_config (power-of-two "ue8m0" scales:
    the smallest 2**e with block amax <= 448 * 2**e) with every other module left unconverted. Power-of-two
    scales keep every weight exact in bf16, so transformers' CPU dequantization to bf16 loses nothing."""
    import torch
    from safetensors.torch import load_file, save_file

    from adapt.kernels.fp8 import pow2_scale

    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    converted = {}
    block = 128
    for tensor_name, tensor in tensors.items():
        if ".mlp.experts." in tensor_name and tensor_name.endswith("_proj.weight"):
            w = tensor.float()
            n, k = w.shape
            rows, cols = -(-n // block), -(-k // block)
            padded = torch.nn.functional.pad(w, (0, cols * block - k, 0, rows * block - n))
            scale = pow2_scale(padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)))
            full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
            converted[tensor_name] = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            converted[tensor_name.removesuffix("weight") + "weight_scale_inv"] = scale.contiguous()
        else:
            converted[tensor_name] = tensor
    save_file(converted, path, metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "scale_fmt": "ue8m0",
        "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.*.self_attn",
                                   "model.layers.*.mlp.gate", "model.layers.0.mlp",
                                   "model.layers.*.mlp.shared_experts"],
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text().splitlines(), trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "add_bos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
