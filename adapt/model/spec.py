"""ModelSpec: the normalized architecture facts of a MoE model, built from its config.json.

Supported ``model_type``: deepseek_v3, deepseek_v32, kimi_k2, gpt_oss, qwen3_moe,
mixtral, glm4_moe, and (multimodal or hybrid) kimi_k25, llama4, qwen3_next. Everything
downstream (memory planner, parallel solver, inventory, runtime) reads a ModelSpec, never a raw config dict.

Parameter counts are logical parameters (a packed MXFP4 byte holds two), never storage
elements; fp8 block scales are not parameters.

Component names used across adapt (``COMPONENTS``):
  embeddings      token embedding table [vocab, hidden]
  lm_head         output projection [vocab, hidden] (0 when tied to the embeddings)
  attention       q/k/v/o projections, MLA down/up projections, their norms, sinks, biases
  indexer         DSA lightning indexer (wq_b, wk, k_norm, weights_proj)
  router          the gate [E, hidden] and its correction bias
  routed_experts  all routed experts' gate/up/down (and biases)
  shared_experts  shared experts' gate/up/down
  dense_mlp       dense FFN layers' gate/up/down
  norms           per-layer input/post-attention norms and the final norm
  mtp             everything in multi-token-prediction layers (counted separately)
  linear_attention  Gated DeltaNet layers (Qwen3-Next): in_proj_qkvz, in_proj_ba, conv1d, A_log,
                  dt_bias, gated norm, out_proj
  vision          the vision tower: patch embedding, position embedding, ViT blocks, its norms
                  (and Llama 4's pixel-shuffle adapter MLP, part of its vision_model)
  projector       the multimodal projector into the language model's width

The language model is everything but vision, projector and mtp (``ParamCounts.language``).

Multi-token-prediction (MTP) layers (DeepSeek-V3 family, GLM-4.5): each is a full decoder
layer plus enorm [hidden], hnorm [hidden], eh_proj [hidden, 2 * hidden], shared_head.norm
[hidden] and, as the checkpoints store them, its own copies of embed_tokens [vocab, hidden]
and shared_head.head [vocab, hidden]. With those copies counted, DeepSeek-V3's 61 + 1 layers
hold exactly the published 684,489,845,504 parameters.

Active parameters are those one token's forward pass multiplies: attention, norms, router,
top_k of the routed experts, shared experts, dense FFNs and lm_head. The embedding table
counts 0 (a lookup reads one row) unless it is tied to lm_head. This is the convention of
OpenAI (gpt-oss-120b: 5.1B active) and DeepSeek (37B); Mistral's "12.9B active" for
Mixtral-8x7B and Qwen's "3.3B" for Qwen3-30B-A3B also count the embedding table
(active + per_component["embeddings"]).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from adapt.errors import InputError

COMPONENTS = (
    "embeddings", "lm_head", "attention", "indexer", "router",
    "routed_experts", "shared_experts", "dense_mlp", "norms", "mtp",
    "linear_attention", "vision", "projector",
)

SUPPORTED_MODEL_TYPES = (
    "deepseek_v3", "deepseek_v32", "kimi_k2", "gpt_oss", "qwen3_moe", "mixtral", "glm4_moe",
    "kimi_k25", "llama4", "qwen3_next",
)

PRESETS_DIR = Path(__file__).parent / "presets"

_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding.

    type: "default" | "yarn" | "llama3" | "linear" | "dynamic" | "longrope"
    theta: base frequency
    factor: context scaling factor (None for plain RoPE)
    original_max_position: pre-scaling context length in tokens (None for plain RoPE)
    rotary_dim: dimensions rotated per head (partial rotary: < head dim)
    partial_rotary_factor: rotary_dim / head dim of the rotated part's head
    interleaved: pairs (2i, 2i+1) rotated (True) or halves (i, i + d/2) (False)
    extra: the rest of rope_scaling (beta_fast, beta_slow, mscale, mscale_all_dim, ...)
    """

    type: str
    theta: float
    factor: float | None = None
    original_max_position: int | None = None
    rotary_dim: int = 0
    partial_rotary_factor: float = 1.0
    interleaved: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention.

    kind: "mha" | "gqa" | "mla" | "mla+dsa" | "sliding" (sliding window, GQA heads)
    num_heads, num_kv_heads: query heads and key/value heads (MLA: num_kv_heads == num_heads
        before absorption; the cache holds one latent per token)
    head_dim: q.k dim per head (MLA: qk_nope_head_dim + qk_rope_head_dim)
    v_head_dim: value dim per head
    q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim: MLA ranks (None/0 otherwise)
    window: sliding window in tokens (None = full attention)
    sinks: learned per-head attention sinks (gpt-oss)
    qk_norm: per-head RMSNorm on q and k (Qwen3)
    bias: q/k/v projections carry biases (MLA: q_a_proj and kv_a_proj_with_mqa)
    index_n_heads, index_head_dim, index_topk: DSA indexer (kind "mla+dsa" only)
    o_bias: the output projection o_proj carries a bias [hidden] (gpt-oss; GLM has q/k/v bias only)
    chunk: chunked local attention (Llama 4 RoPE layers): a token attends only to earlier tokens
        of its own chunk of ``chunk`` tokens (kind "chunked"; ``window`` holds the same bound)
    rope: the layer rotates q and k (False: a NoPE layer, Llama 4's every fourth layer)
    qk_l2norm: parameter-free L2 norm of q and k after RoPE (Llama 4 use_qk_norm)
    output_gate: q_proj also yields a per-head sigmoid gate on the attention output (q_proj is
        [2 x heads x head_dim, hidden]; Qwen3-Next full-attention layers)
    linear_key_heads, linear_value_heads, linear_key_dim, linear_value_dim, conv_kernel: Gated
        DeltaNet (kind "linear"): key/value heads and dims, causal depthwise conv width in tokens
    """

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    window: int | None = None
    sinks: bool = False
    qk_norm: bool = False
    bias: bool = False
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    o_bias: bool = False
    chunk: int | None = None
    rope: bool = True
    qk_l2norm: bool = False
    output_gate: bool = False
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0


@dataclass(frozen=True)
class FFNSpec:
    """One layer's feed-forward block.

    kind: "dense" | "moe"
    intermediate: dense FFN width (kind "dense")
    num_experts: routed experts E; top_k: experts per token
    expert_intermediate: one routed expert's width
    num_shared_experts, shared_intermediate: shared experts (always active) and their total width
    n_group, topk_group: DeepSeek group-limited routing (1, 1 when absent)
    scoring: "softmax" | "sigmoid"
    correction_bias: router has e_score_correction_bias
    norm_topk_prob: renormalize the top-k weights to sum to 1
    routed_scaling: factor on the routed output
    activation: "swiglu" | "swiglu_clamped" (gpt-oss: clamp at swiglu_limit, alpha 1.702, (up+1))
    swiglu_limit: clamp for swiglu_clamped
    bias: expert projections and router carry biases (gpt-oss)
    score_after_topk: top-k on the raw router logits, then the score function on the chosen k
        (Llama 4: sigmoid of the top-1 logit scales the expert's input)
    shared_gate: a [1, hidden] sigmoid gate scales the shared expert's output (Qwen3-Next)
    """

    kind: str
    intermediate: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    num_shared_experts: int = 0
    shared_intermediate: int = 0
    n_group: int = 1
    topk_group: int = 1
    scoring: str = "softmax"
    correction_bias: bool = False
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    activation: str = "swiglu"
    swiglu_limit: float | None = None
    bias: bool = False
    score_after_topk: bool = False
    shared_gate: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """A decoder layer: its index in the checkpoint, attention and FFN."""

    index: int
    attention: AttentionSpec
    ffn: FFNSpec
    is_mtp: bool = False


# Bytes of one stored scale, by scale_format. DeepSeek checkpoints store their ue8m0 (power
# of two) block scales as float32 ``weight_scale_inv`` tensors, so ue8m0 costs 4 bytes here;
# MXFP4 stores e8m0 as one byte; compressed-tensors int4 stores bf16/fp16 group scales.
_SCALE_BYTES = {"fp32": 4, "ue8m0": 4, "e8m0": 1, "e4m3": 1, "bf16": 2, "fp16": 2}
# NVFP4 (NVIDIA ModelOpt): besides the e4m3 block scales, every weight matrix stores two fp32
# scalars, ``weight_scale_2`` (the global scale) and ``input_scale`` (the static activation scale).
_NVFP4_TENSOR_SCALARS_BYTES = 8
# compressed-tensors pack-quantized stores each matrix's logical shape as ``weight_shape``, I64 [2].
_INT4_SHAPE_BYTES = 16
_PLAIN_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class QuantFormat:
    """Storage format of one component's matrices.

    method: "bf16" | "fp16" | "fp32" | "fp8_block" | "mxfp4" | "int4" | "nvfp4"
        | "fp8_channel" (e4m3, one scale per output row) | "fp8_tensor" (e4m3, one scale per tensor)
    block_size: fp8 block [rows, cols] (e.g. (128, 128)); int4 group size in (1, g); nvfp4 (1, 16)
    scale_format: "fp32" | "ue8m0" (fp8); "e8m0" (mxfp4); "bf16"/"fp16" (int4, compressed-tensors);
        "e4m3" (nvfp4: one e4m3 scale per 16 elements, times an fp32 global scale per matrix)
    """

    method: str
    block_size: tuple[int, int] | None = None
    scale_format: str | None = None

    @property
    def quantized(self) -> bool:
        """True for fp8, mxfp4, int4 and nvfp4; False for plain bf16/fp16/fp32."""
        return self.method not in _PLAIN_BYTES

    @property
    def scale_bytes(self) -> int:
        """Bytes of one stored scale (0 for plain formats); ue8m0 is stored as fp32 (4 bytes)."""
        if not self.quantized:
            return 0
        return _SCALE_BYTES[self.scale_format or "fp32"]

    @property
    def bytes_per_param(self) -> float:
        """Storage bytes per logical parameter, scales included.

        bf16/fp16 2, fp32 4; fp8_block 1 + scale_bytes / (rows * cols) (128x128 with fp32 or
        ue8m0 scales: 1 + 4/16384); mxfp4 0.5 + 1/32; int4 0.5 + scale_bytes / group; nvfp4
        0.5 + 1/16. fp8_channel and fp8_tensor: 1 (their one scale per row or per tensor depends on the
        shape; ``tensor_bytes`` counts it, as it counts int4's weight_shape and nvfp4's two fp32
        scalars per matrix). Exact for matrices whose dims are multiples of the
        block; ``tensor_bytes`` also counts partial edge blocks.
        """
        if self.method in _PLAIN_BYTES:
            return float(_PLAIN_BYTES[self.method])
        if self.method in ("fp8_channel", "fp8_tensor"):
            return 1.0
        rows, cols = self.block_size or (1, 1)
        if self.method == "fp8_block":
            return 1.0 + self.scale_bytes / (rows * cols)
        if self.method == "mxfp4":
            return 0.5 + self.scale_bytes / cols
        if self.method in ("int4", "nvfp4"):
            return 0.5 + self.scale_bytes / cols
        raise ValueError(f"unknown quantization method {self.method!r}")

    def tensor_bytes(self, shape: tuple[int, ...]) -> int:
        """Exact stored bytes of one tensor of logical ``shape`` ([..., out, in]) in this format.

        Scales are laid out per block of the last two dims (fp8: ceil(out/r) x ceil(in/c);
        mxfp4, int4 and nvfp4: out x ceil(in/g)); leading dims (stacked experts) multiply. int4
        values are packed eight to an int32 along ``in`` plus an I64 [2] weight_shape per matrix;
        nvfp4 packs two E2M1 values per byte plus fp32 weight_scale_2 and input_scale per matrix.
        """
        numel = math.prod(shape)
        if self.method in _PLAIN_BYTES:
            return numel * _PLAIN_BYTES[self.method]
        out_dim, in_dim = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
        lead = numel // (out_dim * in_dim)
        rows, cols = self.block_size or (1, 1)
        if self.method == "fp8_block":
            scales = lead * -(-out_dim // rows) * -(-in_dim // cols)
            return numel + scales * self.scale_bytes
        if self.method == "fp8_channel":
            return numel + lead * out_dim * self.scale_bytes
        if self.method == "fp8_tensor":
            return numel + lead * self.scale_bytes
        if self.method == "mxfp4":
            blocks = lead * out_dim * -(-in_dim // cols)
            return blocks * (cols // 2) + blocks * self.scale_bytes
        if self.method == "int4":
            packed = lead * out_dim * -(-in_dim // 8) * 4
            scales = lead * out_dim * -(-in_dim // cols) * self.scale_bytes
            return packed + scales + lead * _INT4_SHAPE_BYTES
        if self.method == "nvfp4":
            packed = lead * out_dim * -(-in_dim // 2)
            scales = lead * out_dim * -(-in_dim // cols) * self.scale_bytes
            return packed + scales + lead * _NVFP4_TENSOR_SCALARS_BYTES
        raise ValueError(f"unknown quantization method {self.method!r}")


@dataclass(frozen=True)
class QuantSpec:
    """Quantization per component (keys from COMPONENTS), the checkpoint's dtype, and what
    quantization_config says was left unconverted."""

    default: QuantFormat
    per_component: dict[str, QuantFormat] = field(default_factory=dict)
    modules_to_not_convert: tuple[str, ...] = ()
    source: str = "none"  # quantization_config.quant_method, or "none"

    def format_of(self, component: str) -> QuantFormat:
        return self.per_component.get(component, self.default)


@dataclass(frozen=True)
class ParamCounts:
    """Logical parameter counts (not storage elements).

    total / active: the main model (no MTP layers); active = parameters touched by one token
    total_with_mtp / active_with_mtp: MTP layers included
    per_component: component -> parameters (main model; "mtp" holds the MTP layers)
    per_layer: layer index -> parameters (main model and MTP layers)
    active_per_component: component -> active parameters, keyed like per_component
    """

    total: int
    active: int
    total_with_mtp: int
    active_with_mtp: int
    per_component: dict[str, int]
    per_layer: dict[int, int]
    active_per_component: dict[str, int] = field(default_factory=dict)

    @property
    def vision(self) -> int:
        """Parameters of the vision tower (0 for a text-only model)."""
        return self.per_component.get("vision", 0)

    @property
    def projector(self) -> int:
        """Parameters of the multimodal projector / merger (0 for a text-only model)."""
        return self.per_component.get("projector", 0)

    @property
    def language(self) -> int:
        """Parameters of the language model: the main model without vision tower and projector."""
        return self.total - self.vision - self.projector


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower and projector of a multimodal model (shapes in elements, sizes in pixels).

    kind: "moonvit" (Kimi K2.5: native resolution, learned position grid interpolated to the
        image, 2D RoPE, kh x kw patches merged into one token by the projector) | "llama4"
        (Llama 4: 336-pixel tiles, a CLS token, pixel shuffle, adapter MLP, one projection)
    hidden, layers, heads, intermediate: ViT width, blocks, attention heads, MLP width
    patch_size: pixels per patch side; channels: input channels (3)
    merge: (kh, kw) patches that become one language-model token (moonvit merge_kernel_size;
        llama4 1 / pixel_shuffle_ratio per side)
    pos_grid: (rows, cols) of moonvit's learned position embedding
    image_size: llama4 tile side in pixels; max_tiles: tiles per image at most (the processor's
        max_patches); global_tile: a downscaled whole-image tile is added when an image has several
    max_side_patches: moonvit patches per side at most (its 2D RoPE table is 512 x 512)
    projector_hidden: llama4 adapter MLP width (projector_input_dim); vision_output: width the
        adapter emits (vision_output_dim); projector_bias: llama4 multi_modal_projector_bias
    text_hidden: the language model's width
    """

    kind: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    patch_size: int
    channels: int
    merge: tuple[int, int]
    text_hidden: int
    pos_grid: tuple[int, int] = (0, 0)
    image_size: int = 0
    max_tiles: int = 1
    global_tile: bool = False
    max_side_patches: int = 512
    projector_hidden: int = 0
    vision_output: int = 0
    projector_bias: bool = False

    def _tiles(self, height: int, width: int) -> int:
        """llama4: local tiles of an image (ceil per side, at most max_tiles) plus the global tile."""
        local = -(-height // self.image_size) * -(-width // self.image_size)
        local = min(local, self.max_tiles)
        return local + (1 if self.global_tile and local > 1 else 0)

    def encoder_tokens(self, height: int, width: int) -> int:
        """Tokens the ViT blocks process for one image of ``height`` x ``width`` pixels.

        moonvit: the image is padded to whole merge windows, ph x pw patches (each side at most
        ``max_side_patches``); llama4: every tile is (image_size / patch)^2 patches plus a CLS token.
        """
        if self.kind == "llama4":
            per_tile = (self.image_size // self.patch_size) ** 2 + 1
            return self._tiles(height, width) * per_tile
        kh, kw = self.merge
        ph = min(-(-height // (self.patch_size * kh)) * kh, self.max_side_patches)
        pw = min(-(-width // (self.patch_size * kw)) * kw, self.max_side_patches)
        return ph * pw

    def image_tokens(self, height: int, width: int) -> int:
        """Language-model tokens one image of ``height`` x ``width`` pixels takes in the prompt
        (and so in the KV cache).

        moonvit: merged patches, (ph / kh) x (pw / kw) (the media begin/end markers of the chat
        template are text tokens and not counted). llama4: 144 per tile at 336 px (576 patches,
        pixel shuffle 0.5), plus one separator per local tile when there are several, plus
        <|image_start|>, <|image|> and <|image_end|> (aiconfigurator's Llama 4 tests:
        336x336 -> 147 tokens, 672x672 -> 4 tiles + global = 727).
        """
        kh, kw = self.merge
        if self.kind == "llama4":
            per_tile = (self.image_size // self.patch_size) ** 2 // (kh * kw)
            tiles = self._tiles(height, width)
            local = tiles - (1 if tiles > 1 and self.global_tile else 0)
            return tiles * per_tile + (local if local > 1 else 0) + 3
        return self.encoder_tokens(height, width) // (kh * kw)


@dataclass(frozen=True)
class TensorSpec:
    """One logical weight tensor of the model.

    name: checkpoint-style name, e.g. "model.layers.3.self_attn.q_a_proj.weight"; routed
        experts are one stacked tensor per projection, "model.layers.3.mlp.experts.*.gate_proj.weight"
        of shape [E, out, in] ("*" stands for the expert index of the per-expert tensors)
    shape: logical shape, [out, in] for matrices (parameters, not storage elements)
    component: one of COMPONENTS ("mtp" only for eh_proj); an MTP layer's tensors keep the
        component of their function (attention, routed_experts, ...) and have ``mtp`` True
    layer: checkpoint layer index, None for embeddings, final norm and lm_head
    mtp: part of a multi-token-prediction layer
    quantizable: a Linear weight matrix that the checkpoint's quantization may convert
        (False for norms, biases, sinks, the router and the embedding table)
    active: parameters of this tensor that one token's forward pass multiplies
    """

    name: str
    shape: tuple[int, ...]
    component: str
    layer: int | None
    mtp: bool
    quantizable: bool
    active: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        """The owning module's name with expert index 0, as quantization configs name it."""
        return _module_of(self.name)


def _module_of(tensor_name: str) -> str:
    """"model.layers.3.mlp.experts.*.up_proj.weight" -> "model.layers.3.mlp.experts.0.up_proj"."""
    return tensor_name.rsplit(".", 1)[0].replace("*", "0")


@dataclass(frozen=True)
class ModelSpec:
    """Normalized architecture facts of one model.

    source: the config.json it came from (or the preset name)
    layers: the main decoder layers, in order; mtp_layers: multi-token-prediction layers
    hidden: model width; vocab: vocabulary size; tie_embeddings: lm_head shares embeddings
    max_position: max_position_embeddings (tokens)
    norm_eps: RMSNorm epsilon; dtype: torch_dtype of the unquantized parts ("bfloat16", ...)
    vision: the vision tower and projector (None for a text-only model)
    text_prefix, head_prefix: where the language model's tensors live in the checkpoint
        ("model." and "" for text-only models; "language_model.model." and "language_model."
        for Kimi K2.5 and Llama 4)
    """

    model_type: str
    source: str
    hidden: int
    vocab: int
    tie_embeddings: bool
    max_position: int
    norm_eps: float
    dtype: str
    rope: RopeSpec
    quant: QuantSpec
    layers: tuple[LayerSpec, ...]
    mtp_layers: tuple[LayerSpec, ...] = ()
    config: dict = field(default_factory=dict, compare=False, repr=False)
    vision: VisionSpec | None = None
    text_prefix: str = "model."
    head_prefix: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.ffn.kind == "moe")

    def _layer_groups(self) -> list[tuple[str, int | None, bool, tuple[_Row, ...]]]:
        """(name prefix, layer index, is MTP, rows) for every group of tensors, model order:
        embeddings, decoder layers, MTP layers, final norm, lm_head. Rows are shared between
        layers of the same kind (cached), so counting never walks every tensor."""
        h, v, text = self.hidden, self.vocab, self.text_prefix
        # the table is active only as the tied output projection; a lookup reads one row
        embed_active = v * h if self.tie_embeddings else 0
        groups: list[tuple[str, int | None, bool, tuple[_Row, ...]]] = [
            (text, None, False, (("embed_tokens.weight", (v, h), "embeddings", False, embed_active),))]
        for layer in self.layers + self.mtp_layers:
            rows = _layer_rows(self.model_type, layer.attention, layer.ffn, layer.is_mtp, h, v)
            groups.append((f"{text}layers.{layer.index}.", layer.index, layer.is_mtp, rows))
        groups.append((text, None, False, (("norm.weight", (h,), "norms", False, h),)))
        if not self.tie_embeddings:
            groups.append((self.head_prefix, None, False, (("lm_head.weight", (v, h), "lm_head", True, v * h),)))
        if self.vision is not None:
            groups.extend(_vision_groups(self.vision))
        return groups

    @cached_property
    def _tensors(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(prefix + name, shape, component, index, mtp, quantizable, active)
                     for prefix, index, mtp, rows in self._layer_groups()
                     for name, shape, component, quantizable, active in rows)

    def tensors(self, include_mtp: bool = True) -> tuple[TensorSpec, ...]:
        """Every logical weight tensor, main model first, then the MTP layers, final norm and
        lm_head (a few thousand for a 61-layer model; built on first use)."""
        if include_mtp:
            return self._tensors
        return tuple(t for t in self._tensors if not t.mtp)

    def tensor_format(self, tensor: TensorSpec) -> QuantFormat:
        """Storage format of one tensor: its component's format for quantizable matrices,
        the checkpoint dtype for everything else (norms, biases, sinks, router, embeddings)."""
        return self._row_format(tensor.component, tensor.quantizable)

    def _row_format(self, component: str, quantizable: bool) -> QuantFormat:
        if quantizable:
            return self.quant.format_of(component)
        return QuantFormat(_TORCH_DTYPES[self.dtype])

    @cached_property
    def _param_counts(self) -> ParamCounts:
        per_component = dict.fromkeys(COMPONENTS, 0)
        active_per_component = dict.fromkeys(COMPONENTS, 0)
        per_layer: dict[int, int] = {}
        for _, index, mtp, rows in self._layer_groups():
            layer_total = 0
            for _, shape, component, _, active in rows:
                numel = math.prod(shape)
                key = "mtp" if mtp else component
                per_component[key] += numel
                active_per_component[key] += active
                layer_total += numel
            if index is not None:
                per_layer[index] = layer_total
        total = sum(n for key, n in per_component.items() if key != "mtp")
        active = sum(n for key, n in active_per_component.items() if key != "mtp")
        return ParamCounts(
            total=total, active=active,
            total_with_mtp=total + per_component["mtp"],
            active_with_mtp=active + active_per_component["mtp"],
            per_component=per_component, per_layer=per_layer,
            active_per_component=active_per_component,
        )

    def param_counts(self) -> ParamCounts:
        """Logical parameter counts: total, active, with and without MTP, per component and layer."""
        return self._param_counts

    def weight_bytes(self) -> dict[str, int]:
        """Stored bytes of the weights per component (keys from COMPONENTS; "mtp" holds the
        MTP layers), scales included, from each tensor's format (``tensor_format``)."""
        out = dict.fromkeys(COMPONENTS, 0)
        for _, _, mtp, rows in self._layer_groups():
            for _, shape, component, quantizable, _ in rows:
                fmt = self._row_format(component, quantizable)
                out["mtp" if mtp else component] += fmt.tensor_bytes(shape)
        return out

    def _normalized(self) -> dict:
        memo: dict[int, Any] = {}
        return {f.name: _plain(getattr(self, f.name), memo) for f in fields(self)
                if f.name not in ("source", "config")}

    def spec_hash(self) -> str:
        """sha256 (hex, 16 chars) of the normalized spec: identifies it in report fingerprints.

        Covers every normalized field except ``source`` (the same model from a preset or a
        directory hashes the same); independent of the raw config's key order and extras.
        """
        return _hash_of(self._normalized())

    def to_dict(self) -> dict:
        """JSON-able dict: every field but the raw config, plus num_layers, params
        (ParamCounts, per_layer keyed by str(index)) and spec_hash."""
        out = self._normalized()
        spec_hash = _hash_of(out)
        out["source"] = self.source
        out["num_layers"] = self.num_layers
        counts = _plain(self.param_counts(), {})
        counts["per_layer"] = {str(k): v for k, v in counts["per_layer"].items()}
        out["params"] = counts
        out["spec_hash"] = spec_hash
        return out


def _hash_of(normalized: dict) -> str:
    text = json.dumps(normalized, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(value: Any, memo: dict[int, Any]) -> Any:
    """JSON-able copy of dataclasses, tuples and dicts; ``memo`` converts each dataclass
    instance once (layers share their AttentionSpec and FFNSpec objects)."""
    if is_dataclass(value):
        key = id(value)
        if key not in memo:
            memo[key] = {f.name: _plain(getattr(value, f.name), memo) for f in fields(value)
                         if f.name != "config"}
        return dict(memo[key])
    if isinstance(value, dict):
        return {k: _plain(v, memo) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v, memo) for v in value]
    return value


def list_presets() -> tuple[str, ...]:
    """Names accepted by load_spec as presets (adapt/model/presets/<name>.json)."""
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))


def load_spec(model: str | Path) -> ModelSpec:
    """ModelSpec from a model directory, a config.json path, or a preset name
    (adapt/model/presets/<name>.json, e.g. "deepseek-v3.2", "gpt-oss-120b").

    Raises InputError naming the file, the field and what was expected for an unknown
    model_type, a missing or ill-typed field, or fields that contradict each other.
    """
    path = Path(model)
    source: str
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise InputError("model directory has no config.json", file=path,
                             hint="pass a directory holding config.json, a config file or a preset name")
        source = str(config_path)
    elif path.is_file():
        config_path, source = path, str(path)
    elif (PRESETS_DIR / f"{model}.json").is_file() and "/" not in str(model):
        config_path, source = PRESETS_DIR / f"{model}.json", str(model)
    else:
        raise InputError("no such model directory, config file or preset", file=str(model),
                         hint="presets: " + ", ".join(list_presets()))
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"not valid JSON: {err.msg} at line {err.lineno}", file=source) from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read: {err}", file=source) from None
    return spec_from_config(_fold_hf_quant_config(config, config_path, source), source)


def spec_from_config(config: dict, source: str) -> ModelSpec:
    """ModelSpec from a parsed config dict; ``source`` names it in errors."""
    if not isinstance(config, dict):
        raise InputError(f"expected a JSON object, got {type(config).__name__}", file=source)
    f = _Fields(config, source)
    model_type = f.string("model_type")
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise InputError(f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}, got {model_type!r}",
                         file=source, field="model_type",
                         hint="adapt plans only these MoE architectures")
    return builder(f, model_type)


# ---------------------------------------------------------------------------------------
# Typed config reads

_MISSING: Any = object()

# Plausibility limits on config integers, checked before anything is sized from them (a
# config with 10^12 layers or a 10^30 hidden size is refused instead of exhausting memory).
# Each is >= 30x the largest public value we know of (DeepSeek-V3: 61 layers, 7168 hidden,
# 256 experts; Llama 4: 10M context; vocabularies up to ~262k).
PLAUSIBLE_MAX = {
    "num_hidden_layers": 4096, "num_nextn_predict_layers": 64, "hidden_size": 1 << 18,
    "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20, "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12, "head_dim": 1 << 12, "vocab_size": 1 << 23, "n_routed_experts": 1 << 14,
    "num_local_experts": 1 << 14, "num_experts": 1 << 14, "max_position_embeddings": 1 << 30,
}
PLAUSIBLE_MAX_DEFAULT = 1 << 32


class _Fields:
    """Typed, validated reads from one config dict; every failure is an InputError that names
    the file, the field and what was expected. JSON null counts as absent."""

    def __init__(self, config: dict, source: str, prefix: str = ""):
        self.config = config
        self.source = source
        self.prefix = prefix

    def error(self, name: str, expected: str, got: Any = _MISSING, hint: str | None = None) -> InputError:
        message = f"expected {expected}"
        if got is not _MISSING:
            message += f", got {got!r}"
        return InputError(message, file=self.source, field=self.prefix + name, hint=hint)

    def has(self, name: str) -> bool:
        return self.config.get(name) is not None

    def _raw(self, name: str, default: Any, expected: str) -> Any:
        value = self.config.get(name)
        if value is None:
            if default is _MISSING:
                raise InputError(f"missing required field; expected {expected}", file=self.source,
                                 field=self.prefix + name)
            return default
        return value

    def integer(self, name: str, default: Any = _MISSING, minimum: int = 1) -> int:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        value = self._raw(name, default, expected)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(name, expected, value)
        limit = PLAUSIBLE_MAX.get(name, PLAUSIBLE_MAX_DEFAULT)
        if value > limit:
            raise self.error(name, f"at most {limit:,} (beyond any physical model; refused before planning)",
                             value)
        return value

    def optional_integer(self, name: str, minimum: int = 1) -> int | None:
        return self.integer(name, None, minimum) if self.has(name) else None

    def number(self, name: str, default: Any = _MISSING, positive: bool = True) -> float:
        expected = "a positive number" if positive else "a number"
        value = self._raw(name, default, expected)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0) \
                or not math.isfinite(value):
            raise self.error(name, "a finite " + expected[2:], value)
        return float(value)

    def boolean(self, name: str, default: Any = _MISSING) -> bool:
        value = self._raw(name, default, "true or false")
        if not isinstance(value, bool):
            raise self.error(name, "true or false", value)
        return value

    def string(self, name: str, default: Any = _MISSING, choices: tuple[str, ...] | None = None) -> str:
        expected = "a string" if choices is None else "one of " + ", ".join(choices)
        value = self._raw(name, default, expected)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            raise self.error(name, expected, value)
        return value

    def integer_list(self, name: str, default: Any = _MISSING) -> tuple[int, ...]:
        value = self._raw(name, default, "a list of integers")
        if not isinstance(value, (list, tuple)) or any(
                isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self.error(name, "a list of integers", value)
        return tuple(value)

    def string_list(self, name: str, default: Any = _MISSING) -> tuple[str, ...]:
        value = self._raw(name, default, "a list of strings")
        if not isinstance(value, (list, tuple)) or any(not isinstance(v, str) for v in value):
            raise self.error(name, "a list of strings", value)
        return tuple(value)

    def mapping(self, name: str) -> _Fields | None:
        value = self.config.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(name, "a JSON object", value)
        return _Fields(value, self.source, f"{self.prefix}{name}.")


# ---------------------------------------------------------------------------------------
# Builders per model family


@dataclass(frozen=True)
class _Common:
    hidden: int
    num_layers: int
    vocab: int
    heads: int
    kv_heads: int
    tie: bool
    max_position: int
    norm_eps: float
    dtype: str


def _common(f: _Fields, norm_eps_default: float) -> _Common:
    hidden = f.integer("hidden_size")
    heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv_heads)
    return _Common(
        hidden=hidden,
        num_layers=f.integer("num_hidden_layers"),
        vocab=f.integer("vocab_size"),
        heads=heads,
        kv_heads=kv_heads,
        tie=f.boolean("tie_word_embeddings", False),
        max_position=f.integer("max_position_embeddings"),
        norm_eps=f.number("rms_norm_eps", norm_eps_default),
        dtype=_common_dtype(f),
    )


def _common_dtype(f: _Fields) -> str:
    dtype_field = "torch_dtype" if f.has("torch_dtype") else "dtype"
    return f.string(dtype_field, "bfloat16", tuple(_TORCH_DTYPES))


def _check_routing(f: _Fields, experts_field: str, experts: int, top_k: int, top_k_field: str,
                   n_group: int = 1, topk_group: int = 1) -> None:
    if top_k > experts:
        raise f.error(top_k_field, f"at most {experts_field} ({experts})", top_k)
    if experts % n_group:
        raise f.error(experts_field, f"a multiple of n_group ({n_group})", experts)
    if topk_group > n_group:
        raise f.error("topk_group", f"at most n_group ({n_group})", topk_group)
    reachable = topk_group * (experts // n_group)
    if top_k > reachable:
        raise f.error(top_k_field, f"at most topk_group x experts per group ({reachable})", top_k)


def _attention_kind(heads: int, kv_heads: int, window: int | None) -> str:
    if window is not None:
        return "sliding"
    return "mha" if heads == kv_heads else "gqa"


def _rope(f: _Fields, default_theta: float, rotary_dim: int, head_dim: int,
          partial_default: float, interleaved: bool) -> RopeSpec:
    """RopeSpec from rope_parameters (transformers 5) or rope_theta + rope_scaling."""
    params = f.mapping("rope_parameters")
    scaling = params if params is not None else f.mapping("rope_scaling")
    theta_src = params if params is not None and params.has("rope_theta") else f
    theta = theta_src.number("rope_theta", default_theta)
    partial_src = params if params is not None and params.has("partial_rotary_factor") else f
    partial = partial_src.number("partial_rotary_factor", partial_default)
    if partial > 1:
        raise partial_src.error("partial_rotary_factor", "a number in (0, 1]", partial)
    if rotary_dim == 0:
        rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise partial_src.error("partial_rotary_factor",
                                f"a factor giving an even rotary dim >= 2 of head_dim {head_dim}", partial)
    if scaling is None:
        return RopeSpec(type="default", theta=theta, rotary_dim=rotary_dim,
                        partial_rotary_factor=partial, interleaved=interleaved)
    type_field = "rope_type" if scaling.has("rope_type") else "type"
    rope_type = scaling.string(type_field, "default", _ROPE_TYPES)
    factor = None
    if rope_type != "default":
        factor = scaling.number("factor")
    original = scaling.optional_integer("original_max_position_embeddings")
    consumed = {"rope_type", "type", "factor", "original_max_position_embeddings", "rope_theta",
                "partial_rotary_factor"}
    extra = {k: v for k, v in scaling.config.items() if k not in consumed}
    return RopeSpec(type=rope_type, theta=theta, factor=factor, original_max_position=original,
                    rotary_dim=rotary_dim, partial_rotary_factor=partial, interleaved=interleaved,
                    extra=extra)


def _deepseek(f: _Fields, model_type: str) -> ModelSpec:
    """deepseek_v3, kimi_k2 (DeepSeek-V3 architecture) and deepseek_v32 (adds the DSA indexer)."""
    c = _common(f, 1e-6)
    q_lora = f.optional_integer("q_lora_rank")
    kv_lora = f.integer("kv_lora_rank")
    nope = f.integer("qk_nope_head_dim")
    rope_dim = f.integer("qk_rope_head_dim")
    v_dim = f.integer("v_head_dim")
    attention_bias = f.boolean("attention_bias", False)
    index = (0, 0, 0)
    if model_type == "deepseek_v32":
        if q_lora is None:
            raise f.error("q_lora_rank", "a positive integer (the DSA indexer reads the q latent)")
        index = (f.integer("index_n_heads"), f.integer("index_head_dim"), f.integer("index_topk"))
        if index[1] < rope_dim:
            raise f.error("index_head_dim", f"at least qk_rope_head_dim ({rope_dim})", index[1])
    attention = AttentionSpec(
        kind="mla+dsa" if model_type == "deepseek_v32" else "mla",
        num_heads=c.heads, num_kv_heads=c.heads, head_dim=nope + rope_dim, v_head_dim=v_dim,
        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        bias=attention_bias, o_bias=attention_bias,
        index_n_heads=index[0], index_head_dim=index[1], index_topk=index[2],
    )
    experts = f.integer("n_routed_experts")
    top_k = f.integer("num_experts_per_tok")
    n_group = f.integer("n_group", 1)
    topk_group = f.integer("topk_group", 1)
    _check_routing(f, "n_routed_experts", experts, top_k, "num_experts_per_tok", n_group, topk_group)
    first_dense = f.integer("first_k_dense_replace", 0, minimum=0)
    if first_dense > c.num_layers:
        raise f.error("first_k_dense_replace", f"at most num_hidden_layers ({c.num_layers})", first_dense)
    moe_freq = f.integer("moe_layer_freq", 1)
    moe_width = f.integer("moe_intermediate_size")
    shared = f.integer("n_shared_experts", 0, minimum=0)
    topk_method = f.string("topk_method", "noaux_tc", ("noaux_tc", "greedy", "group_limited_greedy"))
    moe = FFNSpec(
        kind="moe", num_experts=experts, top_k=top_k, expert_intermediate=moe_width,
        num_shared_experts=shared, shared_intermediate=shared * moe_width,
        n_group=n_group, topk_group=topk_group,
        scoring=f.string("scoring_func", "sigmoid", ("sigmoid", "softmax")),
        correction_bias=topk_method == "noaux_tc",
        norm_topk_prob=f.boolean("norm_topk_prob", True),
        routed_scaling=f.number("routed_scaling_factor", 1.0),
    )
    is_moe = [i >= first_dense and i % moe_freq == 0 for i in range(c.num_layers)]
    dense = FFNSpec(kind="dense", intermediate=f.integer("intermediate_size")) if not all(is_moe) else None
    layers = tuple(LayerSpec(i, attention, moe if is_moe[i] else dense) for i in range(c.num_layers))
    mtp_count = f.integer("num_nextn_predict_layers", 0, minimum=0)
    mtp_layers = tuple(LayerSpec(c.num_layers + j, attention, moe, is_mtp=True) for j in range(mtp_count))
    rope = _rope(f, 10000.0, rope_dim, rope_dim, 1.0, f.boolean("rope_interleave", True))
    return _assemble(f, model_type, c, rope, layers, mtp_layers)


def _glm4_moe(f: _Fields, model_type: str) -> ModelSpec:
    """GLM-4.5 / 4.6 / 4.7: GQA with q/k/v bias and partial rotary, DeepSeek-style MoE, MTP."""
    c = _common(f, 1e-5)
    head_dim = f.integer("head_dim", c.hidden // c.heads)
    attention = AttentionSpec(
        kind=_attention_kind(c.heads, c.kv_heads, None), num_heads=c.heads, num_kv_heads=c.kv_heads,
        head_dim=head_dim, v_head_dim=head_dim, qk_norm=f.boolean("use_qk_norm", False),
        bias=f.boolean("attention_bias", False),
    )
    experts = f.integer("n_routed_experts")
    top_k = f.integer("num_experts_per_tok")
    n_group = f.integer("n_group", 1)
    topk_group = f.integer("topk_group", 1)
    _check_routing(f, "n_routed_experts", experts, top_k, "num_experts_per_tok", n_group, topk_group)
    first_dense = f.integer("first_k_dense_replace", 1, minimum=0)
    if first_dense > c.num_layers:
        raise f.error("first_k_dense_replace", f"at most num_hidden_layers ({c.num_layers})", first_dense)
    moe_width = f.integer("moe_intermediate_size")
    shared = f.integer("n_shared_experts", 1, minimum=0)
    moe = FFNSpec(
        kind="moe", num_experts=experts, top_k=top_k, expert_intermediate=moe_width,
        num_shared_experts=shared, shared_intermediate=shared * moe_width,
        n_group=n_group, topk_group=topk_group, scoring="sigmoid", correction_bias=True,
        norm_topk_prob=f.boolean("norm_topk_prob", True),
        routed_scaling=f.number("routed_scaling_factor", 1.0),
    )
    dense = FFNSpec(kind="dense", intermediate=f.integer("intermediate_size")) if first_dense else None
    layers = tuple(LayerSpec(i, attention, moe if i >= first_dense else dense) for i in range(c.num_layers))
    mtp_count = f.integer("num_nextn_predict_layers", 0, minimum=0)
    mtp_layers = tuple(LayerSpec(c.num_layers + j, attention, moe, is_mtp=True) for j in range(mtp_count))
    rope = _rope(f, 10000.0, 0, head_dim, 0.5, False)
    return _assemble(f, model_type, c, rope, layers, mtp_layers)


def _gpt_oss(f: _Fields, model_type: str) -> ModelSpec:
    """gpt-oss: GQA with biases and sinks, sliding window on the layers layer_types names."""
    c = _common(f, 1e-5)
    head_dim = f.integer("head_dim", 64)
    default_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(c.num_layers))
    layer_types = _layer_types(f, c.num_layers, default_types)
    window = f.integer("sliding_window") if "sliding_attention" in layer_types else None
    bias = f.boolean("attention_bias", True)
    top_k_field = "num_experts_per_tok" if f.has("num_experts_per_tok") else "experts_per_token"
    experts = f.integer("num_local_experts")
    top_k = f.integer(top_k_field)
    if f.has("experts_per_token") and f.integer("experts_per_token") != top_k:
        raise f.error("experts_per_token", f"equal to num_experts_per_tok ({top_k})",
                      f.integer("experts_per_token"))
    _check_routing(f, "num_local_experts", experts, top_k, top_k_field)
    moe = FFNSpec(
        kind="moe", num_experts=experts, top_k=top_k, expert_intermediate=f.integer("intermediate_size"),
        scoring="softmax", norm_topk_prob=True, activation="swiglu_clamped",
        swiglu_limit=f.number("swiglu_limit", 7.0), bias=True,
    )
    layers = []
    for i, layer_type in enumerate(layer_types):
        layer_window = window if layer_type == "sliding_attention" else None
        attention = AttentionSpec(
            kind=_attention_kind(c.heads, c.kv_heads, layer_window), num_heads=c.heads,
            num_kv_heads=c.kv_heads, head_dim=head_dim, v_head_dim=head_dim, window=layer_window,
            sinks=True, bias=bias, o_bias=bias,
        )
        layers.append(LayerSpec(i, attention, moe))
    rope = _rope(f, 150000.0, 0, head_dim, 1.0, False)
    return _assemble(f, model_type, c, rope, tuple(layers), ())


def _layer_types(f: _Fields, num_layers: int, default: tuple[str, ...]) -> tuple[str, ...]:
    if not f.has("layer_types"):
        return default
    types = f.string_list("layer_types")
    if len(types) != num_layers:
        raise f.error("layer_types", f"{num_layers} entries (num_hidden_layers)", f"{len(types)} entries")
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise f.error("layer_types", "entries 'sliding_attention' or 'full_attention'", t)
    return types


def _qwen3_moe(f: _Fields, model_type: str) -> ModelSpec:
    """Qwen3 MoE: GQA with per-head q/k RMSNorm, softmax top-k routing, no shared experts."""
    c = _common(f, 1e-6)
    head_dim = f.integer("head_dim", c.hidden // c.heads)
    window = None
    if f.boolean("use_sliding_window", False):
        window = f.integer("sliding_window")
    max_window_layers = f.integer("max_window_layers", c.num_layers, minimum=0)
    default_types = tuple("sliding_attention" if window is not None and i >= max_window_layers
                          else "full_attention" for i in range(c.num_layers))
    layer_types = _layer_types(f, c.num_layers, default_types)
    if "sliding_attention" in layer_types and window is None:
        window = f.integer("sliding_window")
    # Qwen's config.json says num_experts; transformers >= 5 saves the same count as num_local_experts
    experts_field = "num_experts" if f.has("num_experts") or not f.has("num_local_experts") else "num_local_experts"
    experts = f.integer(experts_field)
    top_k = f.integer("num_experts_per_tok")
    _check_routing(f, experts_field, experts, top_k, "num_experts_per_tok")
    sparse_step = f.integer("decoder_sparse_step", 1)
    mlp_only = f.integer_list("mlp_only_layers", ())
    for i in mlp_only:
        if not 0 <= i < c.num_layers:
            raise f.error("mlp_only_layers", f"layer indices in [0, {c.num_layers})", i)
    moe = FFNSpec(
        kind="moe", num_experts=experts, top_k=top_k,
        expert_intermediate=f.integer("moe_intermediate_size"), scoring="softmax",
        norm_topk_prob=f.boolean("norm_topk_prob", False),
    )
    is_moe = [i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(c.num_layers)]
    dense = FFNSpec(kind="dense", intermediate=f.integer("intermediate_size")) if not all(is_moe) else None
    bias = f.boolean("attention_bias", False)
    layers = []
    for i, layer_type in enumerate(layer_types):
        layer_window = window if layer_type == "sliding_attention" else None
        attention = AttentionSpec(
            kind=_attention_kind(c.heads, c.kv_heads, layer_window), num_heads=c.heads,
            num_kv_heads=c.kv_heads, head_dim=head_dim, v_head_dim=head_dim, window=layer_window,
            qk_norm=True, bias=bias, o_bias=bias,
        )
        layers.append(LayerSpec(i, attention, moe if is_moe[i] else dense))
    rope = _rope(f, 10000.0, 0, head_dim, 1.0, False)
    return _assemble(f, model_type, c, rope, tuple(layers), ())


def _mixtral(f: _Fields, model_type: str) -> ModelSpec:
    """Mixtral: GQA without biases, every layer MoE with softmax top-k routing."""
    c = _common(f, 1e-5)
    head_dim = f.integer("head_dim", c.hidden // c.heads)
    window = f.optional_integer("sliding_window")
    experts = f.integer("num_local_experts")
    top_k = f.integer("num_experts_per_tok")
    _check_routing(f, "num_local_experts", experts, top_k, "num_experts_per_tok")
    moe = FFNSpec(kind="moe", num_experts=experts, top_k=top_k,
                  expert_intermediate=f.integer("intermediate_size"), scoring="softmax")
    attention = AttentionSpec(
        kind=_attention_kind(c.heads, c.kv_heads, window), num_heads=c.heads, num_kv_heads=c.kv_heads,
        head_dim=head_dim, v_head_dim=head_dim, window=window,
    )
    layers = tuple(LayerSpec(i, attention, moe) for i in range(c.num_layers))
    rope = _rope(f, 1000000.0, 0, head_dim, 1.0, False)
    return _assemble(f, model_type, c, rope, layers, ())


def _assemble(f: _Fields, model_type: str, c: _Common, rope: RopeSpec,
              layers: tuple[LayerSpec, ...], mtp_layers: tuple[LayerSpec, ...]) -> ModelSpec:
    spec = ModelSpec(
        model_type=model_type, source=f.source, hidden=c.hidden, vocab=c.vocab, tie_embeddings=c.tie,
        max_position=c.max_position, norm_eps=c.norm_eps, dtype=c.dtype, rope=rope,
        quant=QuantSpec(default=QuantFormat(_TORCH_DTYPES[c.dtype])), layers=layers,
        mtp_layers=mtp_layers, config=f.config,
    )
    quant = _quant(f, spec)
    return spec if quant is spec.quant else replace(spec, quant=quant)


_BUILDERS = {
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek,
    "kimi_k2": _deepseek,
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}


# ---------------------------------------------------------------------------------------
# Tensor inventory


# (name relative to its group, shape, component, quantizable, active parameters)
_Row = tuple[str, tuple[int, ...], str, bool, int]


@lru_cache(maxsize=512)
def _layer_rows(model_type: str, a: AttentionSpec, ffn: FFNSpec, is_mtp: bool, hidden: int,
                vocab: int) -> tuple[_Row, ...]:
    """The tensors of one decoder layer (and, for an MTP layer, its extras)."""
    out: list[_Row] = []

    def add(name: str, shape: tuple, component: str, quantizable: bool = False, active: int | None = None):
        out.append((name, shape, component, quantizable, math.prod(shape) if active is None else active))

    if a.kind in ("mla", "mla+dsa"):
        q_width = a.num_heads * a.head_dim
        if a.q_lora_rank is None:
            add("self_attn.q_proj.weight", (q_width, hidden), "attention", True)
        else:
            add("self_attn.q_a_proj.weight", (a.q_lora_rank, hidden), "attention", True)
            if a.bias:
                add("self_attn.q_a_proj.bias", (a.q_lora_rank,), "attention")
            add("self_attn.q_a_layernorm.weight", (a.q_lora_rank,), "attention")
            add("self_attn.q_b_proj.weight", (q_width, a.q_lora_rank), "attention", True)
        kv_a = a.kv_lora_rank + a.qk_rope_head_dim
        add("self_attn.kv_a_proj_with_mqa.weight", (kv_a, hidden), "attention", True)
        if a.bias:
            add("self_attn.kv_a_proj_with_mqa.bias", (kv_a,), "attention")
        add("self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,), "attention")
        add("self_attn.kv_b_proj.weight",
            (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), "attention", True)
        add("self_attn.o_proj.weight", (hidden, a.num_heads * a.v_head_dim), "attention", True)
        if a.o_bias:
            add("self_attn.o_proj.bias", (hidden,), "attention")
        if a.kind == "mla+dsa":
            n, d = a.index_n_heads, a.index_head_dim
            add("self_attn.indexer.wq_b.weight", (n * d, a.q_lora_rank), "indexer", True)
            add("self_attn.indexer.wk.weight", (d, hidden), "indexer", True)
            add("self_attn.indexer.k_norm.weight", (d,), "indexer")
            add("self_attn.indexer.k_norm.bias", (d,), "indexer")
            # weights_proj stays unquantized in the fp8 checkpoints (vLLM builds it without quant_config)
            add("self_attn.indexer.weights_proj.weight", (n, hidden), "indexer")
    elif a.kind == "linear":
        out.extend(_linear_attention_rows(a, hidden))
    else:
        q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        if a.output_gate:
            q_width *= 2
        for proj, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            add(f"self_attn.{proj}.weight", (width, hidden), "attention", True)
            if a.bias:
                add(f"self_attn.{proj}.bias", (width,), "attention")
        add("self_attn.o_proj.weight", (hidden, a.num_heads * a.v_head_dim), "attention", True)
        if a.o_bias:
            add("self_attn.o_proj.bias", (hidden,), "attention")
        if a.qk_norm:
            add("self_attn.q_norm.weight", (a.head_dim,), "attention")
            add("self_attn.k_norm.weight", (a.head_dim,), "attention")
        if a.sinks:
            add("self_attn.sinks", (a.num_heads,), "attention")

    if model_type in _FFN_ROWS:
        out.extend(_FFN_ROWS[model_type](ffn, hidden))
    elif ffn.kind == "dense":
        width = ffn.intermediate
        add("mlp.gate_proj.weight", (width, hidden), "dense_mlp", True)
        add("mlp.up_proj.weight", (width, hidden), "dense_mlp", True)
        add("mlp.down_proj.weight", (hidden, width), "dense_mlp", True)
    else:
        e, k, width = ffn.num_experts, ffn.top_k, ffn.expert_intermediate
        if model_type == "gpt_oss":
            add("mlp.router.weight", (e, hidden), "router")
            add("mlp.router.bias", (e,), "router")
            routed = [("mlp.experts.gate_up_proj", (e, 2 * width, hidden), True),
                      ("mlp.experts.gate_up_proj_bias", (e, 2 * width), False),
                      ("mlp.experts.down_proj", (e, hidden, width), True),
                      ("mlp.experts.down_proj_bias", (e, hidden), False)]
        elif model_type == "mixtral":
            add("block_sparse_moe.gate.weight", (e, hidden), "router")
            routed = [(f"block_sparse_moe.experts.*.{w}.weight", shape, True) for w, shape in
                      (("w1", (e, width, hidden)), ("w3", (e, width, hidden)), ("w2", (e, hidden, width)))]
        else:
            add("mlp.gate.weight", (e, hidden), "router")
            if ffn.correction_bias:
                add("mlp.gate.e_score_correction_bias", (e,), "router")
            routed = [(f"mlp.experts.*.{p}.weight", shape, True) for p, shape in
                      (("gate_proj", (e, width, hidden)), ("up_proj", (e, width, hidden)),
                       ("down_proj", (e, hidden, width)))]
        for name, shape, quantizable in routed:
            add(name, shape, "routed_experts", quantizable, math.prod(shape) // e * k)
        if ffn.num_shared_experts:
            s = ffn.shared_intermediate
            add("mlp.shared_experts.gate_proj.weight", (s, hidden), "shared_experts", True)
            add("mlp.shared_experts.up_proj.weight", (s, hidden), "shared_experts", True)
            add("mlp.shared_experts.down_proj.weight", (hidden, s), "shared_experts", True)
    add("input_layernorm.weight", (hidden,), "norms")
    add("post_attention_layernorm.weight", (hidden,), "norms")
    if is_mtp:
        add("enorm.weight", (hidden,), "norms")
        add("hnorm.weight", (hidden,), "norms")
        # eh_proj is a plain bf16 Linear in the DeepSeek-V3 and GLM checkpoints
        add("eh_proj.weight", (hidden, 2 * hidden), "mtp")
        add("shared_head.norm.weight", (hidden,), "norms")
        add("embed_tokens.weight", (vocab, hidden), "embeddings", active=0)
        add("shared_head.head.weight", (vocab, hidden), "lm_head")
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Quantization


def _matches(module: str, pattern: str) -> bool:
    """A module name against one quantization-config pattern: "re:<regex>" (re.match, as
    compressed-tensors does), a glob such as "model.layers.*.self_attn", or an exact or
    parent-module name (the pattern names the module or one of its ancestors)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")


def _component_modules(spec: ModelSpec) -> dict[str, list[str]]:
    """Component -> module names (expert index 0) of its quantizable matrices in the first
    main-model group holding it, as quantization configs name modules."""
    modules: dict[str, list[str]] = {}
    for prefix, _, mtp, rows in spec._layer_groups():
        if mtp:
            continue
        found = {component for _, _, component, quantizable, _ in rows if quantizable} - set(modules)
        for name, _, component, quantizable, _ in rows:
            if quantizable and component in found:
                modules.setdefault(component, []).append(_module_of(prefix + name))
    return modules


def _quant(f: _Fields, spec: ModelSpec) -> QuantSpec:
    q = f.mapping("quantization_config")
    if q is None:
        return spec.quant
    method = q.string("quant_method")
    default = spec.quant.default
    modules = _component_modules(spec)
    if method == "fp8":
        return _quant_fp8(q, default, modules)
    if method == "mxfp4":
        skip = q.string_list("modules_to_not_convert", ())
        expert_modules = modules.get("routed_experts", [])
        if any(_matches(m, p) for m in expert_modules for p in skip):
            raise q.error("modules_to_not_convert", "patterns that leave the routed experts in mxfp4",
                          list(skip), hint="mxfp4 checkpoints quantize only the routed experts")
        return QuantSpec(default=default,
                         per_component={"routed_experts": QuantFormat("mxfp4", (1, 32), "e8m0")},
                         modules_to_not_convert=skip, source="mxfp4")
    if method == "compressed-tensors":
        return _quant_compressed_tensors(q, default, modules)
    if method == "modelopt":
        return _quant_modelopt(q, default, modules)
    raise q.error("quant_method", "one of fp8, mxfp4, compressed-tensors, modelopt", method,
                  hint="other quantization methods are not supported yet")


def _quant_fp8(q: _Fields, default: QuantFormat, modules: dict[str, list[str]]) -> QuantSpec:
    """quant_method "fp8" (DeepSeek style): every Linear matrix but the router and lm_head in
    e4m3 with one fp32 (or ue8m0) scale per weight block (per tensor when weight_block_size is
    absent), unless modules_to_not_convert/ignored_layers name it."""
    q.string("fmt", "e4m3", ("e4m3",))
    scale = q.string("scale_fmt", "fp32", ("fp32", "ue8m0"))
    if q.has("weight_block_size"):
        block = q.integer_list("weight_block_size")
        if len(block) != 2 or min(block) < 1:
            raise q.error("weight_block_size", "[rows, cols] of positive integers", list(block))
        fp8 = QuantFormat("fp8_block", (block[0], block[1]), scale)
    else:
        fp8 = QuantFormat("fp8_tensor", None, scale)
    skip_field = "modules_to_not_convert" if q.has("modules_to_not_convert") else "ignored_layers"
    skip = q.string_list(skip_field, ())
    per_component = {}
    for component, names in modules.items():
        if component == "lm_head":
            continue
        if any(not any(_matches(m, p) for p in skip) for m in names):
            per_component[component] = fp8
    return QuantSpec(default=default, per_component=per_component, modules_to_not_convert=skip,
                     source="fp8")


def _quant_compressed_tensors(q: _Fields, default: QuantFormat, modules: dict[str, list[str]]) -> QuantSpec:
    """compressed-tensors (e.g. Kimi K2 Thinking): config_groups of weight schemes applied to the
    Linear modules their targets name, minus the ignore list. Supports symmetric int4 with group
    scales and 8-bit float with block, channel or tensor scales. Scales are taken to be stored
    in ``scale_dtype`` when the scheme names it, else in the model dtype."""
    groups = q.mapping("config_groups")
    if groups is None:
        raise q.error("config_groups", "an object of quantization groups")
    ignore = q.string_list("ignore", ())
    schemes: list[tuple[tuple[str, ...], QuantFormat]] = []
    for name in groups.config:
        group = groups.mapping(name)
        if group is None:
            raise groups.error(name, "a quantization group object")
        targets = group.string_list("targets", ("Linear",))
        weights = group.mapping("weights")
        if weights is None:
            raise group.error("weights", "a weight quantization scheme")
        fmt_name = group.string("format", None) if group.has("format") else (
            q.string("format") if q.has("format") else None)
        schemes.append((targets, _compressed_tensors_scheme(weights, default, fmt_name)))
    per_component = {}
    for component, names in modules.items():
        for module in names:
            if any(_matches(module, p) for p in ignore):
                continue
            fmt = next((fmt for targets, fmt in schemes
                        if any(t == "Linear" or _matches(module, t) for t in targets)), None)
            if fmt is not None:
                per_component[component] = fmt
                break
    return QuantSpec(default=default, per_component=per_component, modules_to_not_convert=ignore,
                     source="compressed-tensors")


def _compressed_tensors_scheme(weights: _Fields, default: QuantFormat, fmt_name: str | None = None) -> QuantFormat:
    """QuantFormat of one compressed-tensors weight scheme (num_bits, type, strategy, ...);
    ``fmt_name``: the config's storage ``format`` (int4 must be "pack-quantized")."""
    bits = weights.integer("num_bits")
    kind = weights.string("type", "int")
    strategy = weights.string("strategy", "group")
    scale = weights.string("scale_dtype", _SCALE_NAMES.get(default.method, "bf16"),
                           ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"))
    scale = _SCALE_NAMES.get(scale, scale)
    if bits == 4 and kind == "int" and strategy == "group":
        if fmt_name not in ("pack-quantized", None):
            raise weights.error("num_bits", "int4 stored pack-quantized (eight values per int32)",
                                f"int4 in format {fmt_name!r}",
                                hint="other compressed-tensors storage formats are not supported yet")
        if not weights.boolean("symmetric", True):
            raise weights.error("symmetric", "true (zero points are not supported yet)", False)
        return QuantFormat("int4", (1, weights.integer("group_size")), scale)
    if bits == 8 and kind == "float" and strategy == "block":
        block = weights.integer_list("block_structure")
        if len(block) != 2 or min(block) < 1:
            raise weights.error("block_structure", "[rows, cols] of positive integers", list(block))
        return QuantFormat("fp8_block", (block[0], block[1]), scale)
    if bits == 8 and kind == "float" and strategy in ("channel", "tensor"):
        return QuantFormat(f"fp8_{strategy}", None, scale)
    raise weights.error("num_bits", "int4 with group scales or float8 with block, channel or tensor scales",
                        f"{bits}-bit {kind} {strategy}",
                        hint="other compressed-tensors schemes are not supported yet")


def _quant_modelopt(q: _Fields, default: QuantFormat, modules: dict[str, list[str]]) -> QuantSpec:
    """NVIDIA ModelOpt (quant_method "modelopt", or an hf_quant_config.json folded in by
    load_spec): NVFP4 = E2M1 values, one e4m3 scale per 16 elements along the input dim and an
    fp32 global scale per matrix; FP8 = e4m3 with one fp32 scale per tensor. Every Linear but
    those ``exclude_modules`` (or ``ignore``) names is converted."""
    algo = q.string("quant_algo", None, ("NVFP4", "FP8"))
    if algo is None:
        raise q.error("quant_algo", "NVFP4 or FP8 (ModelOpt algorithms adapt plans)",
                      hint="other ModelOpt algorithms (W4A8_AWQ, MIXED_PRECISION) are not supported yet")
    if algo == "NVFP4":
        group = q.integer("group_size", 16)
        if group != 16:
            raise q.error("group_size", "16 (NVFP4 scales blocks of 16 elements)", group)
        fmt = QuantFormat("nvfp4", (1, 16), "e4m3")
    else:
        fmt = QuantFormat("fp8_tensor", None, "fp32")
    skip_field = "exclude_modules" if q.has("exclude_modules") else "ignore"
    skip = q.string_list(skip_field, ())
    per_component = {component: fmt for component, names in modules.items()
                     if any(not any(_matches(m, p) for p in skip) for m in names)}
    return QuantSpec(default=default, per_component=per_component, modules_to_not_convert=skip,
                     source=f"modelopt {algo}")


HF_QUANT_CONFIG = "hf_quant_config.json"


def _fold_hf_quant_config(config: dict, config_path: Path, source: str) -> dict:
    """config.json plus the ModelOpt ``hf_quant_config.json`` beside it, as a top-level
    quantization_config (quant_method "modelopt"), so that an NVFP4 checkpoint whose config.json
    says nothing about quantization is never planned as bf16. Raises InputError when the two
    files disagree."""
    path = config_path.parent / HF_QUANT_CONFIG
    if not path.is_file() or not isinstance(config, dict):
        return config
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"cannot read: {err}", file=str(path)) from None
    q = data.get("quantization") if isinstance(data, dict) else None
    if not isinstance(q, dict):
        raise InputError("expected a JSON object", file=str(path), field="quantization")
    algo = q.get("quant_algo")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    existing = config.get("quantization_config") or text.get("quantization_config")
    if existing is None:
        folded = {"quant_method": "modelopt", "quant_algo": algo,
                  "exclude_modules": q.get("exclude_modules") or []}
        if q.get("group_size") is not None:
            folded["group_size"] = q["group_size"]
        return {**config, "quantization_config": folded}
    if not isinstance(existing, dict) or existing.get("quant_method") != "modelopt" or \
            existing.get("quant_algo") != algo:
        said = existing.get("quant_method") if isinstance(existing, dict) else existing
        raise InputError(f"says quant_algo {algo!r} but {source} has quantization_config quant_method {said!r}",
                         file=str(path), field="quantization.quant_algo",
                         hint="the two files come from different checkpoints; keep the pair that matches the weights")
    return config


_SCALE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16",
                "fp16": "fp16"}


# ---------------------------------------------------------------------------------------
# Multimodal and hybrid families: kimi_k25 (MoonViT + DeepSeek-V3 text), llama4 (ViT tiles +
# interleaved dense/MoE, chunked and NoPE attention), qwen3_next (Gated DeltaNet + gated
# attention). Tensor names follow the published checkpoints (vLLM's weight loaders read them;
# Kimi's projector is stored as mm_projector.proj.0 / proj.2, which vLLM maps to linear_1 / 2).


def _rows(*entries: tuple) -> tuple[_Row, ...]:
    """Rows from (name, shape, component, quantizable[, active]); active defaults to numel."""
    return tuple((e[0], e[1], e[2], e[3], e[4] if len(e) > 4 else math.prod(e[1])) for e in entries)


def _linear_attention_rows(a: AttentionSpec, hidden: int) -> tuple[_Row, ...]:
    """Gated DeltaNet (Qwen3-Next ``linear_attn``): q, k, v, z projected together, b and a
    (beta, decay) together, a causal depthwise conv over q/k/v, per-head A_log and dt_bias, a
    gated RMSNorm over each value head, and the output projection."""
    key_dim = a.linear_key_heads * a.linear_key_dim
    value_dim = a.linear_value_heads * a.linear_value_dim
    p = "linear_attn."
    return _rows(
        (p + "in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, hidden), "linear_attention", True),
        (p + "in_proj_ba.weight", (2 * a.linear_value_heads, hidden), "linear_attention", True),
        (p + "conv1d.weight", (2 * key_dim + value_dim, 1, a.conv_kernel), "linear_attention", False),
        (p + "dt_bias", (a.linear_value_heads,), "linear_attention", False),
        (p + "A_log", (a.linear_value_heads,), "linear_attention", False),
        (p + "norm.weight", (a.linear_value_dim,), "linear_attention", False),
        (p + "out_proj.weight", (hidden, value_dim), "linear_attention", True),
    )


def _llama4_ffn_rows(ffn: FFNSpec, hidden: int) -> tuple[_Row, ...]:
    """Llama 4 ``feed_forward``: a dense SwiGLU, or a router, fused experts ([E, hidden, 2 x width]
    gate_up and [E, width, hidden] down, as the checkpoints store them) and one shared expert."""
    p = "feed_forward."
    if ffn.kind == "dense":
        w = ffn.intermediate
        return _rows((p + "gate_proj.weight", (w, hidden), "dense_mlp", True),
                     (p + "up_proj.weight", (w, hidden), "dense_mlp", True),
                     (p + "down_proj.weight", (hidden, w), "dense_mlp", True))
    e, k, w, s = ffn.num_experts, ffn.top_k, ffn.expert_intermediate, ffn.shared_intermediate
    return _rows(
        (p + "router.weight", (e, hidden), "router", False),
        (p + "experts.gate_up_proj", (e, hidden, 2 * w), "routed_experts", True, hidden * 2 * w * k),
        (p + "experts.down_proj", (e, w, hidden), "routed_experts", True, w * hidden * k),
        (p + "shared_expert.gate_proj.weight", (s, hidden), "shared_experts", True),
        (p + "shared_expert.up_proj.weight", (s, hidden), "shared_experts", True),
        (p + "shared_expert.down_proj.weight", (hidden, s), "shared_experts", True),
    )


def _qwen3_next_ffn_rows(ffn: FFNSpec, hidden: int) -> tuple[_Row, ...]:
    """Qwen3-Next ``mlp``: dense SwiGLU, or router, per-expert SwiGLU experts, one shared expert
    and its [1, hidden] sigmoid gate."""
    if ffn.kind == "dense":
        w = ffn.intermediate
        return _rows(("mlp.gate_proj.weight", (w, hidden), "dense_mlp", True),
                     ("mlp.up_proj.weight", (w, hidden), "dense_mlp", True),
                     ("mlp.down_proj.weight", (hidden, w), "dense_mlp", True))
    e, k, w, s = ffn.num_experts, ffn.top_k, ffn.expert_intermediate, ffn.shared_intermediate
    rows = [("mlp.gate.weight", (e, hidden), "router", False)]
    for proj, shape in (("gate_proj", (e, w, hidden)), ("up_proj", (e, w, hidden)), ("down_proj", (e, hidden, w))):
        rows.append((f"mlp.experts.*.{proj}.weight", shape, "routed_experts", True, math.prod(shape) // e * k))
    if ffn.num_shared_experts:
        rows += [("mlp.shared_expert.gate_proj.weight", (s, hidden), "shared_experts", True),
                 ("mlp.shared_expert.up_proj.weight", (s, hidden), "shared_experts", True),
                 ("mlp.shared_expert.down_proj.weight", (hidden, s), "shared_experts", True)]
        if ffn.shared_gate:
            rows.append(("mlp.shared_expert_gate.weight", (1, hidden), "shared_experts", False))
    return _rows(*rows)


_FFN_ROWS = {"llama4": _llama4_ffn_rows, "qwen3_next": _qwen3_next_ffn_rows}


@lru_cache(maxsize=16)
def _vision_groups(v: VisionSpec) -> tuple[tuple[str, None, bool, tuple[_Row, ...]], ...]:
    """(prefix, None, False, rows) groups of the vision tower and projector. Vision rows count 0
    active parameters: a text token's forward pass never runs the vision tower."""
    h, i = v.hidden, v.intermediate
    groups = []
    if v.kind == "moonvit":
        stem = _rows(("patch_embed.proj.weight", (h, v.channels, v.patch_size, v.patch_size), "vision", False, 0),
                     ("patch_embed.proj.bias", (h,), "vision", False, 0),
                     ("patch_embed.pos_emb.weight", (*v.pos_grid, h), "vision", False, 0))
        block = _rows(("norm0.weight", (h,), "vision", False, 0), ("norm0.bias", (h,), "vision", False, 0),
                      ("norm1.weight", (h,), "vision", False, 0), ("norm1.bias", (h,), "vision", False, 0),
                      ("wqkv.weight", (3 * h, h), "vision", True, 0), ("wqkv.bias", (3 * h,), "vision", False, 0),
                      ("wo.weight", (h, h), "vision", True, 0), ("wo.bias", (h,), "vision", False, 0),
                      ("mlp.fc0.weight", (i, h), "vision", True, 0), ("mlp.fc0.bias", (i,), "vision", False, 0),
                      ("mlp.fc1.weight", (h, i), "vision", True, 0), ("mlp.fc1.bias", (h,), "vision", False, 0))
        merged = h * v.merge[0] * v.merge[1]
        groups.append(("vision_tower.", None, False, stem))
        groups += [(f"vision_tower.encoder.blocks.{n}.", None, False, block) for n in range(v.layers)]
        groups.append(("vision_tower.encoder.", None, False,
                       _rows(("final_layernorm.weight", (h,), "vision", False, 0),
                             ("final_layernorm.bias", (h,), "vision", False, 0))))
        groups.append(("mm_projector.", None, False, _rows(
            ("pre_norm.weight", (h,), "projector", False, 0), ("pre_norm.bias", (h,), "projector", False, 0),
            ("proj.0.weight", (merged, merged), "projector", True, 0),
            ("proj.0.bias", (merged,), "projector", False, 0),
            ("proj.2.weight", (v.text_hidden, merged), "projector", True, 0),
            ("proj.2.bias", (v.text_hidden,), "projector", False, 0))))
        return tuple(groups)
    positions = (v.image_size // v.patch_size) ** 2 + 1
    patch_in = v.channels * v.patch_size * v.patch_size
    shuffled = h * v.merge[0] * v.merge[1]
    stem = _rows(("class_embedding", (h,), "vision", False, 0),
                 ("positional_embedding_vlm", (positions, h), "vision", False, 0),
                 ("patch_embedding.linear.weight", (h, patch_in), "vision", True, 0),
                 ("layernorm_pre.weight", (h,), "vision", False, 0), ("layernorm_pre.bias", (h,), "vision", False, 0),
                 ("layernorm_post.weight", (h,), "vision", False, 0), ("layernorm_post.bias", (h,), "vision", False, 0),
                 ("vision_adapter.mlp.fc1.weight", (v.projector_hidden, shuffled), "projector", True, 0),
                 ("vision_adapter.mlp.fc2.weight", (v.vision_output, v.projector_hidden), "projector", True, 0))
    block = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        block += [(f"self_attn.{proj}.weight", (h, h), "vision", True, 0), (f"self_attn.{proj}.bias", (h,), "vision",
                                                                              False, 0)]
    block += [("mlp.fc1.weight", (i, h), "vision", True, 0), ("mlp.fc1.bias", (i,), "vision", False, 0),
              ("mlp.fc2.weight", (h, i), "vision", True, 0), ("mlp.fc2.bias", (h,), "vision", False, 0)]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        block += [(f"{norm}.weight", (h,), "vision", False, 0), (f"{norm}.bias", (h,), "vision", False, 0)]
    groups.append(("vision_model.", None, False, stem))
    groups += [(f"vision_model.model.layers.{n}.", None, False, _rows(*block)) for n in range(v.layers)]
    projector = [("linear_1.weight", (v.text_hidden, v.vision_output), "projector", True, 0)]
    if v.projector_bias:
        projector.append(("linear_1.bias", (v.text_hidden,), "projector", False, 0))
    groups.append(("multi_modal_projector.", None, False, _rows(*projector)))
    return tuple(groups)


def _kimi_k25(f: _Fields, model_type: str) -> ModelSpec:
    """Kimi K2.5: a DeepSeek-V3 (kimi_k2) language model in ``text_config`` under
    ``language_model.``, and the MoonViT vision tower plus patch-merger projector in
    ``vision_config`` (vt_* names as published; plain names as vLLM's KimiK25VisionConfig)."""
    text = f.mapping("text_config")
    if text is None:
        raise f.error("text_config", "the language model's config (a DeepSeek-V3 / kimi_k2 object)")
    vc = f.mapping("vision_config")
    if vc is None:
        raise f.error("vision_config", "the MoonViT vision tower's config object")
    if not (text.has("torch_dtype") or text.has("dtype")) and (f.has("torch_dtype") or f.has("dtype")):
        # transformers 5 writes the dtype at the top level only
        text = _Fields({**text.config, "torch_dtype": _common_dtype(f)}, text.source, text.prefix)
    base = _deepseek(text, "kimi_k2")

    def pick(name: str, default: Any = _MISSING) -> int:
        return vc.integer("vt_" + name) if vc.has("vt_" + name) else vc.integer(name, default)

    merge = vc.integer_list("merge_kernel_size", (2, 2))
    if len(merge) != 2 or min(merge) < 1:
        raise vc.error("merge_kernel_size", "[rows, cols] of positive integers", list(merge))
    for name, allowed in (("merge_type", ("sd2_tpool",)), ("pos_emb_type", ("divided_fixed",)),
                          ("mm_projector_type", ("patchmerger",))):
        vc.string(name, allowed[0], allowed)
    hidden = pick("hidden_size", 1152)
    heads = pick("num_attention_heads", 16)
    if hidden % heads:
        raise vc.error("vt_num_attention_heads", f"a divisor of vt_hidden_size ({hidden})", heads)
    vision = VisionSpec(
        kind="moonvit", hidden=hidden, layers=pick("num_hidden_layers", 27), heads=heads,
        intermediate=pick("intermediate_size", 4304), patch_size=vc.integer("patch_size", 14), channels=3,
        merge=(merge[0], merge[1]), text_hidden=base.hidden,
        pos_grid=tuple(vc.integer(f"init_pos_emb_{side}") if vc.has(f"init_pos_emb_{side}")
                       else vc.integer(f"pos_emb_{side}", 64) for side in ("height", "width")),
    )
    text_hidden = vc.integer("text_hidden_size", base.hidden)
    if text_hidden != base.hidden:
        raise vc.error("text_hidden_size", f"text_config.hidden_size ({base.hidden})", text_hidden)
    spec = replace(base, model_type=model_type, source=f.source, vision=vision, config=f.config,
                   text_prefix="language_model.model.", head_prefix="language_model.")
    if f.has("quantization_config"):
        # a top-level quantization config names modules as the checkpoint does (language_model.*)
        spec = replace(spec, quant=_quant(f, replace(spec, quant=QuantSpec(default=base.quant.default))))
    return spec


def _llama4(f: _Fields, model_type: str) -> ModelSpec:
    """Llama 4 (Scout, Maverick): ``text_config`` holds a GQA decoder whose MoE layers (every
    ``interleave_moe_layer_step``-th, or ``moe_layers``) alternate with dense ones; RoPE layers use
    chunked local attention and a parameter-free q/k L2 norm, every fourth layer is NoPE with
    full attention (``no_rope_layers``: 1 = RoPE). ``vision_config`` holds the tiled ViT."""
    t = f.mapping("text_config")
    if t is None:
        raise f.error("text_config", "the language model's config (llama4_text)")
    c = _common(t, 1e-5)
    if not (t.has("torch_dtype") or t.has("dtype")) and (f.has("torch_dtype") or f.has("dtype")):
        c = replace(c, dtype=_common_dtype(f))  # transformers 5 writes the dtype at the top level only
    head_dim = t.integer("head_dim", c.hidden // c.heads)
    no_rope = t.integer_list("no_rope_layers", ()) or tuple(
        int((i + 1) % t.integer("no_rope_layer_interval", 4) != 0) for i in range(c.num_layers))
    if len(no_rope) != c.num_layers or any(x not in (0, 1) for x in no_rope):
        raise t.error("no_rope_layers", f"{c.num_layers} entries of 0 or 1", list(no_rope))
    step = t.integer("interleave_moe_layer_step", 1)
    moe_layers = set(t.integer_list("moe_layers")) if t.has("moe_layers") else set(
        range(step - 1, c.num_layers, step))
    if any(not 0 <= i < c.num_layers for i in moe_layers):
        raise t.error("moe_layers", f"layer indices in [0, {c.num_layers})", sorted(moe_layers))
    experts = t.integer("num_local_experts")
    top_k = t.integer("num_experts_per_tok")
    _check_routing(t, "num_local_experts", experts, top_k, "num_experts_per_tok")
    width = t.integer("intermediate_size")
    moe = FFNSpec(kind="moe", num_experts=experts, top_k=top_k, expert_intermediate=width,
                  num_shared_experts=1, shared_intermediate=width, scoring="sigmoid", norm_topk_prob=False,
                  score_after_topk=True)
    dense = FFNSpec(kind="dense", intermediate=t.integer("intermediate_size_mlp"))
    chunk = t.optional_integer("attention_chunk_size")
    qk_l2 = t.boolean("use_qk_norm", False)
    bias = t.boolean("attention_bias", False)
    kinds = {}
    for rope in (0, 1):
        local = chunk if rope else None
        kinds[rope] = AttentionSpec(
            kind="chunked" if local else _attention_kind(c.heads, c.kv_heads, None), num_heads=c.heads,
            num_kv_heads=c.kv_heads, head_dim=head_dim, v_head_dim=head_dim, window=local, chunk=local,
            rope=bool(rope), qk_l2norm=qk_l2 and bool(rope), bias=bias, o_bias=bias)
    layers = tuple(LayerSpec(i, kinds[no_rope[i]], moe if i in moe_layers else dense) for i in range(c.num_layers))
    rope = _rope(t, 500000.0, 0, head_dim, 1.0, True)
    vision = None
    vc = f.mapping("vision_config")
    if vc is not None:
        ratio = vc.number("pixel_shuffle_ratio", 0.5)
        if ratio > 1 or abs(1 / ratio - round(1 / ratio)) > 1e-9:
            raise vc.error("pixel_shuffle_ratio", "1 / an integer (0.5: 2x2 patches per token)", ratio)
        side = round(1 / ratio)
        processor = f.mapping("image_processor_config")
        vision = VisionSpec(
            kind="llama4", hidden=vc.integer("hidden_size"), layers=vc.integer("num_hidden_layers"),
            heads=vc.integer("num_attention_heads"), intermediate=vc.integer("intermediate_size"),
            patch_size=vc.integer("patch_size"), channels=vc.integer("num_channels", 3), merge=(side, side),
            text_hidden=c.hidden, image_size=vc.integer("image_size"),
            max_tiles=processor.integer("max_patches", 16) if processor else 16,
            global_tile=processor.boolean("add_global_tile", True) if processor else True,
            projector_hidden=vc.integer("projector_input_dim"), vision_output=vc.integer("vision_output_dim"),
            projector_bias=vc.boolean("multi_modal_projector_bias", False),
        )
    spec = ModelSpec(
        model_type=model_type, source=f.source, hidden=c.hidden, vocab=c.vocab,
        tie_embeddings=f.boolean("tie_word_embeddings", c.tie), max_position=c.max_position,
        norm_eps=c.norm_eps, dtype=c.dtype, rope=rope, quant=QuantSpec(default=QuantFormat(_TORCH_DTYPES[c.dtype])),
        layers=layers, config=f.config, vision=vision, text_prefix="language_model.model.",
        head_prefix="language_model.",
    )
    quant = _quant(f, spec)
    return spec if quant is spec.quant else replace(spec, quant=quant)


def _qwen3_next(f: _Fields, model_type: str) -> ModelSpec:
    """Qwen3-Next: Gated DeltaNet linear-attention layers with a full (gated, qk-normed, partial
    RoPE) attention layer every ``full_attention_interval`` layers; softmax top-k MoE with one
    gated shared expert. The checkpoints' MTP module (``mtp.*``) is not part of this spec."""
    c = _common(f, 1e-6)
    head_dim = f.integer("head_dim", c.hidden // c.heads)
    interval = f.integer("full_attention_interval", 4)
    default = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(c.num_layers))
    types = f.string_list("layer_types") if f.has("layer_types") else default
    if len(types) != c.num_layers or any(t not in ("full_attention", "linear_attention") for t in types):
        raise f.error("layer_types", f"{c.num_layers} entries of 'full_attention' or 'linear_attention'",
                      list(types))
    full = AttentionSpec(kind=_attention_kind(c.heads, c.kv_heads, None), num_heads=c.heads,
                         num_kv_heads=c.kv_heads, head_dim=head_dim, v_head_dim=head_dim, qk_norm=True,
                         output_gate=True, bias=f.boolean("attention_bias", False))
    kh, vh = f.integer("linear_num_key_heads"), f.integer("linear_num_value_heads")
    if vh % kh:
        raise f.error("linear_num_value_heads", f"a multiple of linear_num_key_heads ({kh})", vh)
    kd, vd = f.integer("linear_key_head_dim"), f.integer("linear_value_head_dim")
    linear = AttentionSpec(kind="linear", num_heads=vh, num_kv_heads=kh, head_dim=kd, v_head_dim=vd,
                           rope=False, linear_key_heads=kh, linear_value_heads=vh, linear_key_dim=kd,
                           linear_value_dim=vd, conv_kernel=f.integer("linear_conv_kernel_dim", 4))
    experts = f.integer("num_experts")
    top_k = f.integer("num_experts_per_tok")
    _check_routing(f, "num_experts", experts, top_k, "num_experts_per_tok")
    shared = f.integer("shared_expert_intermediate_size", 0, minimum=0)
    moe = FFNSpec(kind="moe", num_experts=experts, top_k=top_k, expert_intermediate=f.integer("moe_intermediate_size"),
                  num_shared_experts=1 if shared else 0, shared_intermediate=shared, scoring="softmax",
                  norm_topk_prob=f.boolean("norm_topk_prob", True), shared_gate=bool(shared))
    step = f.integer("decoder_sparse_step", 1)
    mlp_only = set(f.integer_list("mlp_only_layers", ()))
    dense = FFNSpec(kind="dense", intermediate=f.integer("intermediate_size"))
    layers = tuple(LayerSpec(i, full if types[i] == "full_attention" else linear,
                             moe if i not in mlp_only and (i + 1) % step == 0 else dense)
                   for i in range(c.num_layers))
    rope = _rope(f, 10000.0, 0, head_dim, 0.25, False)
    return _assemble(f, model_type, c, rope, layers, ())


_BUILDERS.update({"kimi_k25": _kimi_k25, "llama4": _llama4, "qwen3_next": _qwen3_next})
