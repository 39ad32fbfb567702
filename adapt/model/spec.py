"""ModelSpec: the normalized architecture facts of a MoE model, built from its config.json.

Supported ``model_type``: deepseek_v3, deepseek_v32, kimi_k2, gpt_oss, qwen3_moe,
mixtral, glm4_moe. Everything downstream (memory planner, parallel solver, inventory,
runtime) reads a ModelSpec, never a raw config dict.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPONENTS = (
    "embeddings", "lm_head", "attention", "indexer", "router",
    "routed_experts", "shared_experts", "dense_mlp", "norms", "mtp",
)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding.

    type: "default" | "yarn" | "llama3" | "linear" | "dynamic"
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
    bias: q/k/v/o projections carry biases
    index_n_heads, index_head_dim, index_topk: DSA indexer (kind "mla+dsa" only)
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


@dataclass(frozen=True)
class LayerSpec:
    """A decoder layer: its index in the checkpoint, attention and FFN."""

    index: int
    attention: AttentionSpec
    ffn: FFNSpec
    is_mtp: bool = False


@dataclass(frozen=True)
class QuantFormat:
    """Storage format of one component's matrices.

    method: "bf16" | "fp16" | "fp32" | "fp8_block" | "mxfp4" | "int4"
    block_size: fp8 block [rows, cols] (e.g. (128, 128)); int4 group size in (1, g)
    scale_format: "fp32" | "ue8m0" (fp8); "e8m0" (mxfp4); "bf16"/"fp16" (int4)
    """

    method: str
    block_size: tuple[int, int] | None = None
    scale_format: str | None = None

    @property
    def bytes_per_param(self) -> float:
        """Storage bytes per logical parameter, scales included."""
        raise NotImplementedError


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
    """

    total: int
    active: int
    total_with_mtp: int
    active_with_mtp: int
    per_component: dict[str, int]
    per_layer: dict[int, int]


@dataclass(frozen=True)
class ModelSpec:
    """Normalized architecture facts of one model.

    source: the config.json it came from (or the preset name)
    layers: the main decoder layers, in order; mtp_layers: multi-token-prediction layers
    hidden: model width; vocab: vocabulary size; tie_embeddings: lm_head shares embeddings
    max_position: max_position_embeddings (tokens)
    norm_eps: RMSNorm epsilon; dtype: torch_dtype of the unquantized parts
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

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.ffn.kind == "moe")

    def param_counts(self) -> ParamCounts:
        raise NotImplementedError

    def spec_hash(self) -> str:
        """sha256 (hex, 16 chars) of the normalized spec: identifies it in report fingerprints."""
        raise NotImplementedError


def load_spec(model: str) -> ModelSpec:
    """ModelSpec from a model directory, a config.json path, or a preset name
    (adapt/model/presets/<name>.json, e.g. "deepseek-v3.2", "gpt-oss-120b").

    Raises InputError naming the file, the field and what was expected for an unknown
    model_type, a missing or ill-typed field, or fields that contradict each other.
    """
    raise NotImplementedError


def spec_from_config(config: dict, source: str) -> ModelSpec:
    """ModelSpec from a parsed config dict; ``source`` names it in errors."""
    raise NotImplementedError
