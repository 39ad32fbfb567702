"""The runtime's model: architecture facts from config.json and the decoder stack built from a checkpoint.

Families (``model_type``): deepseek_v32 (MLA + DSA indexer), deepseek_v3 / kimi_k2 (MLA),
gpt_oss (GQA, sliding window on the layers ``layer_types`` marks, sinks, clamped SwiGLU, router
bias), qwen3_moe (GQA with q/k norms). Each decoder layer: ``h = x + attn(norm(x))``,
``out = h + ffn(norm(h))``; then the final norm and the head.

Reduced depth: ``layers`` picks decoder layers (a count N for 0..N-1, or explicit indices such as
[0, 3, 60]); each keeps its own index, so its attention kind, window and dense/MoE choice are the
ones it has in the full model; embeddings, final norm and head are always loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adapt.errors import InputError
from adapt.runtime.attention import (
    GQAAttention,
    GQAWeights,
    MLAAttention,
    MLAShape,
    MLAWeights,
    rms_norm,
)
from adapt.runtime.kv_cache import DSABatch
from adapt.runtime.moe import DenseMLP, MoE, RouterSpec
from adapt.runtime.weights import Linear, WeightStore, apply_linear

FAMILIES = {
    "deepseek_v32": "deepseek",
    "deepseek_v3": "deepseek",
    "kimi_k2": "deepseek",
    "gpt_oss": "gpt_oss",
    "qwen3_moe": "qwen3",
}
OP_FAMILIES = ("attention", "indexer", "moe", "norm_rope")


@dataclass(frozen=True)
class LayerKind:
    """attention: 'gqa' | 'mla' | 'mla+dsa'; window: sliding window (tokens) or None; ffn: 'dense' | 'moe'."""

    attention: str
    window: int | None
    ffn: str


@dataclass(frozen=True)
class ArchConfig:
    """What the runtime needs from config.json (sizes in elements, windows in tokens)."""

    model_type: str
    family: str
    vocab: int
    hidden: int
    num_layers: int
    rms_eps: float
    kinds: tuple[LayerKind, ...]
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int
    rope: dict[str, Any]
    max_positions: int
    attention_bias: bool = False
    dense_intermediate: int = 0
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    v_head: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    mla_rope_pairs: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_embeddings: bool = False
    eos_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "config.json") -> ArchConfig:
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise InputError(
                f"model_type {model_type!r} is not supported by adapt's runtime",
                file=where,
                field="model_type",
                hint=f"supported: {', '.join(FAMILIES)}",
            )
        family = FAMILIES[model_type]

        def need(key: str, kind=int):
            value = cfg.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value <= 0):
                raise InputError(f"expected a positive {kind.__name__}, got {value!r}", file=where, field=key)
            return value

        hidden, layers = need("hidden_size"), need("num_hidden_layers")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        if rope["rope_type"] not in ("default", "yarn"):
            raise InputError(
                f"rope type {rope['rope_type']!r} is not supported (default, yarn)",
                file=where,
                field="rope_scaling",
            )
        eos = cfg.get("eos_token_id")
        common = dict(
            model_type=model_type,
            family=family,
            vocab=need("vocab_size"),
            hidden=hidden,
            num_layers=layers,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )
        if family == "deepseek":
            dsa = model_type == "deepseek_v32"
            moe_types = cfg.get("mlp_layer_types")
            if moe_types is None:
                first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
                moe_types = [
                    "sparse" if cfg.get("n_routed_experts") and i >= first and i % freq == 0 else "dense"
                    for i in range(layers)
                ]
            kinds = tuple(
                LayerKind("mla+dsa" if dsa else "mla", None, "moe" if t == "sparse" else "dense")
                for t in moe_types
            )
            if not cfg.get("q_lora_rank"):
                raise InputError(
                    "MLA without q_lora_rank (DeepSeek-V2-Lite style) is not supported",
                    file=where,
                    field="q_lora_rank",
                )
            heads = need("num_attention_heads")
            return cls(
                **common,
                kinds=kinds,
                heads=heads,
                kv_heads=heads,
                head_dim=need("qk_nope_head_dim") + need("qk_rope_head_dim"),
                rope_dim=need("qk_rope_head_dim"),
                dense_intermediate=need("intermediate_size"),
                experts=int(cfg.get("n_routed_experts") or 0),
                top_k=int(cfg.get("num_experts_per_tok") or 0),
                expert_intermediate=int(cfg.get("moe_intermediate_size") or 0),
                shared_experts=int(cfg.get("n_shared_experts") or 0),
                n_group=int(cfg.get("n_group") or 1),
                topk_group=int(cfg.get("topk_group") or 1),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                q_lora=need("q_lora_rank"),
                kv_lora=need("kv_lora_rank"),
                qk_nope=need("qk_nope_head_dim"),
                v_head=need("v_head_dim"),
                index_heads=need("index_n_heads") if dsa else 0,
                index_dim=need("index_head_dim") if dsa else 0,
                index_topk=need("index_topk") if dsa else 0,
                mla_rope_pairs=dsa or bool(cfg.get("rope_interleave", True)),
            )
        heads = need("num_attention_heads")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if family == "gpt_oss":
            types = cfg.get("layer_types") or [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]
            window = cfg.get("sliding_window")
            kinds = tuple(
                LayerKind("gqa", window if t == "sliding_attention" else None, "moe") for t in types
            )
            return cls(
                **common,
                kinds=kinds,
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rope_dim=head_dim,
                attention_bias=bool(cfg.get("attention_bias", True)),
                experts=need("num_local_experts"),
                top_k=need("num_experts_per_tok"),
                expert_intermediate=need("intermediate_size"),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            )
        if cfg.get("use_sliding_window"):
            raise InputError(
                "qwen3_moe with use_sliding_window is not supported", file=where, field="use_sliding_window"
            )
        dense_layers = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        kinds = tuple(
            LayerKind(
                "gqa", None, "moe" if experts and i not in dense_layers and (i + 1) % step == 0 else "dense"
            )
            for i in range(layers)
        )
        return cls(
            **common,
            kinds=kinds,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_dim=head_dim,
            attention_bias=bool(cfg.get("attention_bias", False)),
            dense_intermediate=int(cfg.get("intermediate_size") or 0),
            experts=experts,
            top_k=int(cfg.get("num_experts_per_tok") or 0),
            expert_intermediate=int(cfg.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> ArchConfig:
        path = Path(directory) / "config.json"
        try:
            return cls.from_dict(json.loads(path.read_text()), where=str(path))
        except FileNotFoundError:
            raise InputError("no config.json", file=directory, hint="is this a model directory?") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON: {exc.msg} at line {exc.lineno}", file=path) from None

    @property
    def mla_scale(self) -> float:
        """Attention scale of MLA: (nope + rope)**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN."""
        scale = self.head_dim**-0.5
        if self.rope["rope_type"] != "default" and self.rope.get("mscale_all_dim"):
            m = _yarn_mscale(self.rope["factor"], self.rope["mscale_all_dim"])
            scale *= m * m
        return scale


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: dict[str, Any], dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies fp32 [dim / 2], factor on cos and sin) as transformers computes them."""
    base = float(rope["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.get("factor") or max_positions / rope["original_max_position_embeddings"]
    attention = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None:
        attention = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else _yarn_mscale(factor)
        )
    original = rope["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


@dataclass
class DecoderLayer:
    """One decoder layer: index in the full model, its kind, norms [hidden], attention and FFN."""

    index: int
    kind: LayerKind
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attention: GQAAttention | MLAAttention
    ffn: DenseMLP | MoE


class Capture:
    """Per-layer records of the steps run while capturing.

    hidden_states: layer index -> list of [N, hidden] outputs (one per step, compute dtype)
    router: layer index -> list of (expert ids int64 [N, k], weights fp32 [N, k])
    router_scores: layer index -> list of fp32 [N, E] selection scores (torch router path only)
    dsa_indices: layer index -> list of int32 [N, index_topk] indexer selections
    """

    def __init__(self, hidden_states: bool = True, router: bool = True, dsa_indices: bool = False):
        self.want_hidden, self.want_router, self.want_indices = hidden_states, router, dsa_indices
        self.hidden_states: dict[int, list[torch.Tensor]] = {}
        self.router: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.router_scores: dict[int, list[torch.Tensor]] = {}
        self.dsa_indices: dict[int, list[torch.Tensor]] = {}

    def record(self, layer: DecoderLayer, out: torch.Tensor) -> None:
        if self.want_hidden:
            self.hidden_states.setdefault(layer.index, []).append(out.detach().clone())
        if self.want_router and isinstance(layer.ffn, MoE) and layer.ffn.last_topk is not None:
            ids, weights = layer.ffn.last_topk
            self.router.setdefault(layer.index, []).append((ids.clone(), weights.clone()))
            if layer.ffn.path == "torch" and layer.ffn.last_scores is not None:
                self.router_scores.setdefault(layer.index, []).append(layer.ffn.last_scores.clone())
        if (
            self.want_indices
            and isinstance(layer.attention, MLAAttention)
            and layer.attention.last_indices is not None
        ):
            self.dsa_indices.setdefault(layer.index, []).append(layer.attention.last_indices.clone())


@dataclass
class CaptureComparison:
    """How a run (e.g. kernels on) tracks a reference run fed the same tokens, layer by layer.

    layer_error: layer -> max over steps of ||other - ref|| / ||ref|| over the token rows whose
        router choices agreed in every MoE layer up to and including this one
    agreeing_rows: layer -> min over steps of the fraction of rows counted in layer_error
    router_agreement: MoE layer -> min over steps of the fraction of rows with the same top-k set
    dsa_overlap: DSA layer -> mean over rows and steps of |selected_ref & selected_other| / |selected_ref|
    """

    layer_error: dict[int, float]
    agreeing_rows: dict[int, float]
    router_agreement: dict[int, float]
    dsa_overlap: dict[int, float]


def compare_captures(reference: Capture, other: Capture, steps: int | None = None) -> CaptureComparison:
    """Compare two captures of the same layers over their first ``steps`` steps (default: all).

    A row whose top-k differs is a routing difference, reported in ``router_agreement``, and is
    left out of the value error from that layer on (its activations legitimately diverge).
    """
    layers = sorted(reference.hidden_states)
    count = min(len(reference.hidden_states[layers[0]]), len(other.hidden_states[layers[0]]))
    count = count if steps is None else min(count, steps)
    error = dict.fromkeys(layers, 0.0)
    agreeing = dict.fromkeys(layers, 1.0)
    router: dict[int, float] = {}
    for step in range(count):
        agree = None
        for layer in layers:
            if layer in reference.router:
                ref_ids = reference.router[layer][step][0].sort(-1).values
                other_ids = other.router[layer][step][0].long().to(ref_ids.device).sort(-1).values
                same = (ref_ids == other_ids).all(-1)
                router[layer] = min(router.get(layer, 1.0), float(same.float().mean()))
                agree = same if agree is None else agree & same
            ref = reference.hidden_states[layer][step].float()
            out = other.hidden_states[layer][step].float().to(ref.device)
            rows = torch.ones(ref.shape[0], dtype=torch.bool, device=ref.device) if agree is None else agree
            agreeing[layer] = min(agreeing[layer], float(rows.float().mean()))
            if rows.any():
                diff = float((out[rows] - ref[rows]).norm() / ref[rows].norm())
                error[layer] = max(error[layer], diff)
    overlap = {}
    for layer, selections in reference.dsa_indices.items():
        shares = []
        for ref, out in zip(selections[:count], other.dsa_indices.get(layer, [])[:count], strict=False):
            for a, b in zip(ref.tolist(), out.tolist(), strict=True):
                chosen = {i for i in a if i >= 0}
                shares.append(len(chosen & {i for i in b if i >= 0}) / max(len(chosen), 1))
        if shares:
            overlap[layer] = sum(shares) / len(shares)
    return CaptureComparison(error, agreeing, router, overlap)


class DecoderModel:
    """Embeddings, the chosen decoder layers, final norm and head, built from a ``WeightStore``.

    paths: op family -> 'torch' | 'kernel' (families ``OP_FAMILIES``). dtype: compute dtype.
    """

    def __init__(
        self,
        config: ArchConfig,
        store: WeightStore,
        layer_ids: Iterable[int],
        *,
        paths: dict[str, str],
        dtype: torch.dtype,
        workspace=None,
    ):
        self.config = config
        self.dtype = dtype
        self.device = store.device
        self.paths = paths
        self.embed = store.get("model.embed_tokens.weight")
        self.norm = store.get("model.norm.weight")
        self.head = Linear(self.embed) if config.tie_embeddings else store.linear("lm_head", bias=False)
        self.layers = [self._layer(store, i, workspace) for i in layer_ids]
        self.inv_freq, self.rope_factor = rope_frequencies(config.rope, config.rope_dim, config.max_positions)
        self.inv_freq = self.inv_freq.to(self.device)
        self.capture: Capture | None = None

    @property
    def kernel_refusals(self) -> dict[str, str]:
        """Layer 'L<i>.moe' -> why that layer runs the torch path although its family asked for kernels."""
        out = {}
        for layer in self.layers:
            if isinstance(layer.ffn, MoE) and self.paths["moe"] == "kernel" and layer.ffn.path != "kernel":
                out[f"L{layer.index}.moe"] = layer.ffn.kernel_refusal
        return out

    def _layer(self, store: WeightStore, i: int, workspace) -> DecoderLayer:
        c = self.config
        kind = c.kinds[i]
        p = f"model.layers.{i}."
        if kind.attention == "gqa":
            weights = GQAWeights(
                q=store.linear(p + "self_attn.q_proj"),
                k=store.linear(p + "self_attn.k_proj"),
                v=store.linear(p + "self_attn.v_proj"),
                o=store.linear(p + "self_attn.o_proj"),
                q_norm=store.optional(p + "self_attn.q_norm.weight"),
                k_norm=store.optional(p + "self_attn.k_norm.weight"),
                sinks=store.optional(p + "self_attn.sinks"),
            )
            attention = GQAAttention(
                weights,
                heads=c.heads,
                kv_heads=c.kv_heads,
                head_dim=c.head_dim,
                norm_eps=c.rms_eps,
                window=kind.window,
                path=self.paths["attention"],
                norm_rope_kernel=self.paths["norm_rope"] == "kernel",
            )
        else:
            a = p + "self_attn."
            dsa = kind.attention == "mla+dsa"
            weights = MLAWeights(
                q_a=store.linear(a + "q_a_proj"),
                q_a_norm=store.get(a + "q_a_layernorm.weight"),
                q_b=store.linear(a + "q_b_proj"),
                kv_a=store.linear(a + "kv_a_proj_with_mqa"),
                kv_a_norm=store.get(a + "kv_a_layernorm.weight"),
                kv_b=store.linear(a + "kv_b_proj"),
                o=store.linear(a + "o_proj"),
                index_wq_b=store.linear(a + "indexer.wq_b") if dsa else None,
                index_wk=store.linear(a + "indexer.wk") if dsa else None,
                index_k_norm_weight=store.get(a + "indexer.k_norm.weight") if dsa else None,
                index_k_norm_bias=store.get(a + "indexer.k_norm.bias") if dsa else None,
                index_weights_proj=store.linear(a + "indexer.weights_proj") if dsa else None,
            )
            shape = MLAShape(
                heads=c.heads,
                qk_nope=c.qk_nope,
                qk_rope=c.rope_dim,
                v_head=c.v_head,
                kv_lora=c.kv_lora,
                scale=c.mla_scale,
                index_heads=c.index_heads,
                index_dim=c.index_dim,
                index_topk=c.index_topk,
                rope_pairs=c.mla_rope_pairs,
            )
            attention = MLAAttention(
                weights,
                shape,
                attention_path=self.paths["attention"],
                indexer_path=self.paths["indexer"],
                norm_rope_kernel=self.paths["norm_rope"] == "kernel",
            )
        if kind.ffn == "dense":
            ffn = DenseMLP(
                store.linear(p + "mlp.gate_proj"),
                store.linear(p + "mlp.up_proj"),
                store.linear(p + "mlp.down_proj"),
            )
        elif c.family == "gpt_oss":
            ffn = MoE(
                RouterSpec("gpt_oss", c.top_k),
                store.linear(p + "mlp.router", bias=True),
                store.experts(p + "mlp.experts", c.experts, interleaved=True),
                clamped=True,
                alpha=c.swiglu_alpha,
                limit=c.swiglu_limit,
                path=self.paths["moe"],
                workspace=workspace,
            )
        elif c.family == "deepseek":
            shared = None
            if c.shared_experts:
                s = p + "mlp.shared_experts."
                shared = DenseMLP(
                    store.linear(s + "gate_proj"), store.linear(s + "up_proj"), store.linear(s + "down_proj")
                )
            ffn = MoE(
                RouterSpec("deepseek", c.top_k, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling),
                store.linear(p + "mlp.gate", bias=False),
                store.experts(p + "mlp.experts", c.experts, interleaved=False),
                correction_bias=store.optional(p + "mlp.gate.e_score_correction_bias"),
                shared=shared,
                path=self.paths["moe"],
                workspace=workspace,
            )
        else:
            ffn = MoE(
                RouterSpec("qwen3", c.top_k, norm_topk_prob=c.norm_topk_prob),
                store.linear(p + "mlp.gate", bias=False),
                store.experts(p + "mlp.experts", c.experts, interleaved=False),
                path=self.paths["moe"],
                workspace=workspace,
            )
        return DecoderLayer(
            i,
            kind,
            store.get(p + "input_layernorm.weight"),
            store.get(p + "post_attention_layernorm.weight"),
            attention,
            ffn,
        )

    def cache_layouts(self, cache_dtype: torch.dtype) -> dict[int, dict]:
        return {layer.index: layer.attention.cache_layout(cache_dtype) for layer in self.layers}

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        eps = self.config.rms_eps if eps is None else eps
        return rms_norm(
            x,
            weight,
            eps,
            scale_in_fp32=self.config.family == "gpt_oss",
            kernel=self.paths["norm_rope"] == "kernel",
        )

    def forward(
        self, tokens: torch.Tensor, batch: DSABatch, pools: dict[int, dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        """tokens int64 [N] (ordered as ``batch``) -> final-normed hidden states [N, hidden]."""
        x = self.embed[tokens].to(self.dtype)
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.rope_factor).to(self.dtype)
        sin = (freqs.sin() * self.rope_factor).to(self.dtype)
        for layer in self.layers:
            h = x + layer.attention.forward(
                self._norm(x, layer.input_norm), cos, sin, batch, pools[layer.index]
            )
            x = h + layer.ffn.forward(self._norm(h, layer.post_norm))
            if self.capture is not None:
                self.capture.record(layer, x)
        return self._norm(x, self.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        return apply_linear(hidden, self.head).float()
