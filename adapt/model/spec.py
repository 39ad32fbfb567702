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
)

SUPPORTED_MODEL_TYPES = (
    "deepseek_v3", "deepseek_v32", "kimi_k2", "gpt_oss", "qwen3_moe", "mixtral", "glm4_moe",
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


# Bytes of one stored scale, by scale_format. DeepSeek checkpoints store their ue8m0 (power
# of two) block scales as float32 ``weight_scale_inv`` tensors, so ue8m0 costs 4 bytes here;
# MXFP4 stores e8m0 as one byte; compressed-tensors int4 stores bf16/fp16 group scales.
_SCALE_BYTES = {"fp32": 4, "ue8m0": 4, "e8m0": 1, "bf16": 2, "fp16": 2}
_PLAIN_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class QuantFormat:
    """Storage format of one component's matrices.

    method: "bf16" | "fp16" | "fp32" | "fp8_block" | "mxfp4" | "int4"
        | "fp8_channel" (e4m3, one scale per output row) | "fp8_tensor" (e4m3, one scale per tensor)
    block_size: fp8 block [rows, cols] (e.g. (128, 128)); int4 group size in (1, g)
    scale_format: "fp32" | "ue8m0" (fp8); "e8m0" (mxfp4); "bf16"/"fp16" (int4, compressed-tensors)
    """

    method: str
    block_size: tuple[int, int] | None = None
    scale_format: str | None = None

    @property
    def quantized(self) -> bool:
        """True for fp8_block, mxfp4 and int4; False for plain bf16/fp16/fp32."""
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
        ue8m0 scales: 1 + 4/16384); mxfp4 0.5 + 1/32; int4 0.5 + scale_bytes / group.
        fp8_channel and fp8_tensor: 1 (their one scale per row or per tensor depends on the
        shape; ``tensor_bytes`` counts it). Exact for matrices whose dims are multiples of the
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
        if self.method == "int4":
            return 0.5 + self.scale_bytes / cols
        raise ValueError(f"unknown quantization method {self.method!r}")

    def tensor_bytes(self, shape: tuple[int, ...]) -> int:
        """Exact stored bytes of one tensor of logical ``shape`` ([..., out, in]) in this format.

        Scales are laid out per block of the last two dims (fp8: ceil(out/r) x ceil(in/c);
        mxfp4 and int4: out x ceil(in/g)); leading dims (stacked experts) multiply. int4 values
        are packed eight to an int32 along ``in``.
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
            return packed + lead * out_dim * -(-in_dim // cols) * self.scale_bytes
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

    def _layer_groups(self) -> list[tuple[str, int | None, bool, tuple[_Row, ...]]]:
        """(name prefix, layer index, is MTP, rows) for every group of tensors, model order:
        embeddings, decoder layers, MTP layers, final norm, lm_head. Rows are shared between
        layers of the same kind (cached), so counting never walks every tensor."""
        h, v = self.hidden, self.vocab
        # the table is active only as the tied output projection; a lookup reads one row
        embed_active = v * h if self.tie_embeddings else 0
        groups: list[tuple[str, int | None, bool, tuple[_Row, ...]]] = [
            ("model.", None, False, (("embed_tokens.weight", (v, h), "embeddings", False, embed_active),))]
        for layer in self.layers + self.mtp_layers:
            rows = _layer_rows(self.model_type, layer.attention, layer.ffn, layer.is_mtp, h, v)
            groups.append((f"model.layers.{layer.index}.", layer.index, layer.is_mtp, rows))
        groups.append(("model.", None, False, (("norm.weight", (h,), "norms", False, h),)))
        if not self.tie_embeddings:
            groups.append(("", None, False, (("lm_head.weight", (v, h), "lm_head", True, v * h),)))
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
    return spec_from_config(config, source)


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
    dtype_field = "torch_dtype" if f.has("torch_dtype") else "dtype"
    return _Common(
        hidden=hidden,
        num_layers=f.integer("num_hidden_layers"),
        vocab=f.integer("vocab_size"),
        heads=heads,
        kv_heads=kv_heads,
        tie=f.boolean("tie_word_embeddings", False),
        max_position=f.integer("max_position_embeddings"),
        norm_eps=f.number("rms_norm_eps", norm_eps_default),
        dtype=f.string(dtype_field, "bfloat16", tuple(_TORCH_DTYPES)),
    )


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
    experts = f.integer("num_experts")
    top_k = f.integer("num_experts_per_tok")
    _check_routing(f, "num_experts", experts, top_k, "num_experts_per_tok")
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
    else:
        q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
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

    if ffn.kind == "dense":
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
    raise q.error("quant_method", "one of fp8, mxfp4, compressed-tensors", method,
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
        schemes.append((targets, _compressed_tensors_scheme(weights, default)))
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


def _compressed_tensors_scheme(weights: _Fields, default: QuantFormat) -> QuantFormat:
    """QuantFormat of one compressed-tensors weight scheme (num_bits, type, strategy, ...)."""
    bits = weights.integer("num_bits")
    kind = weights.string("type", "int")
    strategy = weights.string("strategy", "group")
    scale = weights.string("scale_dtype", _SCALE_NAMES.get(default.method, "bf16"),
                           ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"))
    scale = _SCALE_NAMES.get(scale, scale)
    if bits == 4 and kind == "int" and strategy == "group":
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


_SCALE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16",
                "fp16": "fp16"}
