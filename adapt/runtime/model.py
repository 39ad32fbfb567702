"""The runtime's model: the decoder stack of a checkpoint, built from its ModelSpec (the one parser
of config.json, ``adapt.model.spec``).

Families (``model_type``): deepseek_v32 (MLA + DSA indexer), deepseek_v3 / kimi_k2 (MLA, with or
without q_lora_rank), gpt_oss (GQA, sliding window on the layers ``layer_types`` marks, sinks,
clamped SwiGLU, router bias), qwen3_moe (GQA with q/k norms), mixtral (GQA, softmax top-k
router), glm4_moe (GQA with q/k/v biases, optional q/k norms, partial RoPE; DeepSeek-style router
and shared experts). Each decoder layer: ``h = x + attn(norm(x))``,
``out = h + ffn(norm(h))``; then the final norm and the head.

Reduced depth: ``layers`` picks decoder layers (a count N for 0..N-1, or explicit indices such as
[0, 3, 60]); each keeps its own index, so its attention kind, window and dense/MoE choice are the
ones it has in the full model; embeddings, final norm and head are always loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from adapt.errors import InputError
from adapt.model.spec import AttentionSpec, FFNSpec, LayerSpec, ModelSpec, RopeSpec
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

OP_FAMILIES = ("attention", "indexer", "moe", "norm_rope")
GPT_OSS_SWIGLU_ALPHA = 1.702
"""gpt-oss SwiGLU slope: gate * sigmoid(1.702 * gate) (openai/gpt-oss ``swiglu``; transformers GptOssExperts)."""


def check_runtime_support(spec: ModelSpec) -> None:
    """Raise InputError for what the runtime cannot execute although ModelSpec describes it."""
    from adapt.runtime.families import REFERENCE_FAMILIES

    if spec.model_type in REFERENCE_FAMILIES:
        raise InputError(f"{spec.model_type} runs on the reference path (adapt.runtime.families), not this engine",
                         file=spec.source, field="model_type", hint="`adapt run` picks that path by itself")
    if spec.rope.type not in ("default", "yarn"):
        raise InputError(f"rope type {spec.rope.type!r} is not supported by adapt's runtime (default, yarn)",
                         file=spec.source, field="rope_scaling")
    if spec.rope.interleaved and any(layer.attention.kind not in ("mla", "mla+dsa") for layer in spec.layers):
        raise InputError("interleaved RoPE on GQA layers is not supported by adapt's runtime",
                         file=spec.source, field="rope_interleave")


def rope_frequencies(rope: RopeSpec, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies fp32 [dim / 2], factor on cos and sin) as transformers computes them.

    rope: the ModelSpec's RoPE (default or yarn; yarn reads beta_fast, beta_slow, mscale,
    mscale_all_dim, attention_factor and truncate from ``rope.extra``); dim: rotated dims per head.
    """
    base = float(rope.theta)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    extra = rope.extra
    original = rope.original_max_position
    factor = rope.factor or max_positions / original
    attention = extra.get("attention_factor")
    mscale, mscale_all = extra.get("mscale"), extra.get("mscale_all_dim")
    if attention is None:
        attention = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else _yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(extra.get("beta_fast") or 32), correction_dim(extra.get("beta_slow") or 1)
    if extra.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_cos_sin(inv_freq: torch.Tensor, factor: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, dim / 2] in ``dtype`` of angles positions x inv_freq, times ``factor`` (YaRN)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)


def mla_scale(spec: ModelSpec, attention: AttentionSpec) -> float:
    """Attention scale of MLA: (nope + rope)**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN."""
    scale = attention.head_dim**-0.5
    mscale_all = spec.rope.extra.get("mscale_all_dim")
    if spec.rope.type != "default" and mscale_all:
        m = _yarn_mscale(spec.rope.factor, mscale_all)
        scale *= m * m
    return scale


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def eos_ids(spec: ModelSpec) -> tuple[int, ...]:
    """The end-of-sequence token ids of config.json's ``eos_token_id`` (an int or a list)."""
    eos = spec.config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


@dataclass
class DecoderLayer:
    """One decoder layer: index in the full model, its kind, norms [hidden], attention and FFN."""

    index: int
    spec: LayerSpec
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attention: GQAAttention | MLAAttention
    ffn: DenseMLP | MoE


class Capture:
    """Per-layer records of the steps run while capturing.

    hidden_states: layer index -> list of [N, hidden] outputs (one per step, compute dtype)
    router: layer index -> list of (expert ids int64 [N, k], weights fp32 [N, k])
    router_scores: layer index -> list of fp32 [N, E] scores experts are ranked by (torch path
        only: ``MoE.last_scores``); router_groups: layer index -> (n_group, topk_group)
    dsa_indices: layer index -> list of int32 [N, index_topk] indexer selections
    """

    def __init__(self, hidden_states: bool = True, router: bool = True, dsa_indices: bool = False):
        self.want_hidden, self.want_router, self.want_indices = hidden_states, router, dsa_indices
        self.hidden_states: dict[int, list[torch.Tensor]] = {}
        self.router: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.router_scores: dict[int, list[torch.Tensor]] = {}
        self.router_groups: dict[int, tuple[int, int]] = {}
        self.dsa_indices: dict[int, list[torch.Tensor]] = {}

    def record(self, layer: DecoderLayer, out: torch.Tensor) -> None:
        if self.want_hidden:
            self.hidden_states.setdefault(layer.index, []).append(out.detach().clone())
        if self.want_router and isinstance(layer.ffn, MoE) and layer.ffn.last_topk is not None:
            ids, weights = layer.ffn.last_topk
            self.router.setdefault(layer.index, []).append((ids.clone(), weights.clone()))
            if layer.ffn.last_scores is not None:
                self.router_scores.setdefault(layer.index, []).append(layer.ffn.last_scores.clone())
            self.router_groups[layer.index] = (layer.ffn.router.n_group, layer.ffn.router.topk_group)
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
    near_tie_flips / routing_flips: MoE layer -> rows (summed over steps), among those whose routing
        agreed in every earlier MoE layer, whose top-k set differs here only in experts whose
        reference score lies within the tie tolerance of the reference's k-th score (a near tie: a
        small drift of the layer input legitimately reorders them) / in some expert beyond it (a
        routing difference no near tie explains; every flip counts here when the reference
        recorded no scores)
    dsa_flips: DSA layer -> rows (summed over steps), among those that agreed so far, whose indexer
        selection differs here as a set (both captures with ``dsa_indices``). Like a routing difference,
        such a row is left out of the value error from this layer on: attending other positions moves
        its activations legitimately, and one flipped row would otherwise stand for the whole layer.
    """

    layer_error: dict[int, float]
    agreeing_rows: dict[int, float]
    router_agreement: dict[int, float]
    dsa_overlap: dict[int, float]
    near_tie_flips: dict[int, int] = field(default_factory=dict)
    routing_flips: dict[int, int] = field(default_factory=dict)
    dsa_flips: dict[int, int] = field(default_factory=dict)


def compare_captures(reference: Capture, other: Capture, steps: int | None = None,
                     tie_tol: float = 0.0, sequences: list[torch.Tensor] | None = None) -> CaptureComparison:
    """Compare two captures of the same layers over their first ``steps`` steps (default: all).

    A row whose top-k differs is a routing difference, reported in ``router_agreement``, and is
    left out of the value error from that layer on (its activations legitimately diverge). Where
    it first differs it is classified by the reference's gate scores (``_near_tie``), with the
    slack stage 3 gives top-k ties: ``tie_tol`` x the row's largest |score|.
    ``sequences`` (one int tensor [N] per step: each row's sequence, a sequence's rows in position order):
    a row left out at some layer also takes out, from the next layer on, the later rows of its sequence
    (this step's and every later step's), which attend to its diverged keys and values.
    """
    layers = sorted(reference.hidden_states)
    count = min(len(reference.hidden_states[layers[0]]), len(other.hidden_states[layers[0]]))
    count = count if steps is None else min(count, steps)
    error = dict.fromkeys(layers, 0.0)
    agreeing = dict.fromkeys(layers, 1.0)
    router: dict[int, float] = {}
    ties: dict[int, int] = {}
    flips: dict[int, int] = {}
    dsa_flips: dict[int, int] = {}
    left: dict[int, set[tuple[int, int, int]]] = {}  # sequence -> (step, layer, row) where its rows were left out
    for step in range(count):
        agree = None
        for layer in layers:
            if sequences is not None and left:
                agree = _attending_left_rows(sequences[step], left, step, layer, agree,
                                             reference.hidden_states[layer][step].device)
            if layer in reference.router:
                ref_ids = reference.router[layer][step][0].sort(-1).values
                other_ids = other.router[layer][step][0].long().to(ref_ids.device).sort(-1).values
                same = (ref_ids == other_ids).all(-1)
                router[layer] = min(router.get(layer, 1.0), float(same.float().mean()))
                scores = reference.router_scores.get(layer, [])
                ties.setdefault(layer, 0)
                flips.setdefault(layer, 0)
                for row in torch.nonzero(~same & (True if agree is None else agree)).flatten().tolist():
                    near_tie = step < len(scores) and _near_tie(
                        set(ref_ids[row].tolist()), set(other_ids[row].tolist()), scores[step][row],
                        reference.router_groups.get(layer, (1, 1)), tie_tol)
                    if near_tie:
                        ties[layer] += 1
                    else:
                        flips[layer] += 1
                agree = same if agree is None else agree & same
            if layer in reference.dsa_indices and layer in other.dsa_indices:
                same = _same_selection(reference.dsa_indices[layer][step], other.dsa_indices[layer][step]).to(
                    reference.hidden_states[layer][step].device)
                dsa_flips[layer] = dsa_flips.get(layer, 0) + int((~same & (True if agree is None else agree)).sum())
                agree = same if agree is None else agree & same
            ref = reference.hidden_states[layer][step].float()
            out = other.hidden_states[layer][step].float().to(ref.device)
            rows = torch.ones(ref.shape[0], dtype=torch.bool, device=ref.device) if agree is None else agree
            if sequences is not None:
                for row in torch.nonzero(~rows.cpu()).flatten().tolist():
                    left.setdefault(int(sequences[step][row]), set()).add((step, layer, row))
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
    return CaptureComparison(error, agreeing, router, overlap, near_tie_flips=ties, routing_flips=flips,
                             dsa_flips=dsa_flips)


def _attending_left_rows(seqs: torch.Tensor, left: dict[int, set[tuple[int, int, int]]], step: int, layer: int,
                         agree: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``agree`` (None: every row) without the rows that at ``layer`` attend to a row of their sequence left out
    at an earlier layer (of an earlier step, or earlier in this step's rows), on ``device``."""
    seqs = seqs.cpu()
    out = torch.ones(len(seqs), dtype=torch.bool) if agree is None else agree.cpu().clone()
    order = torch.arange(len(seqs))
    for seq, places in left.items():
        for at_step, at_layer, at_row in places:
            if layer > at_layer:
                out &= ~((seqs == seq) & ((step > at_step) | (order > at_row)))
    return out.to(device)


def _same_selection(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """bool [N]: whether each row of two indexer selections (int [N, k], -1 for none) holds the same positions."""
    ref = ref.long().cpu().sort(-1).values
    other = other.long().cpu().sort(-1).values
    return (ref == other).all(-1)


def _near_tie(ref: set[int], other: set[int], scores: torch.Tensor, groups: tuple[int, int],
              tie_tol: float) -> bool:
    """Whether top-k sets ``ref`` and ``other`` (expert ids) differ only at near ties of the
    reference's ranking ``scores`` ([E]; slack = ``tie_tol`` x the largest |score|).

    Each differing expert must either score within the slack of the k-th score among the
    reference's kept groups, or (grouped routing, ``groups`` = (n_group, topk_group)) sit in a
    group kept by one side only whose group score (sum of its two best) is within twice the
    slack of the topk_group-th group score.
    """
    scores = scores.double().cpu()
    if len(ref) != len(other) or not all(0 <= e < scores.numel() for e in ref | other):
        return False
    slack = tie_tol * float(scores.abs().max())
    n_group, topk_group = groups
    size = scores.numel() // n_group
    tied_groups: set[int] = set()
    kept = scores
    if n_group > 1:
        group_scores = scores.view(n_group, size).topk(min(2, size), dim=-1).values.sum(-1)
        boundary = float(group_scores.topk(topk_group).values[-1])
        for g in {e // size for e in ref} ^ {e // size for e in other}:
            if abs(float(group_scores[g]) - boundary) <= 2 * slack:
                tied_groups.add(g)
        keep = group_scores.topk(topk_group).indices
        mask = torch.zeros(n_group, dtype=torch.bool).scatter_(0, keep, True).repeat_interleave(size)
        kept = scores.masked_fill(~mask, -math.inf)
    kth = float(kept.topk(len(ref)).values[-1])
    return all(
        e // size in tied_groups or abs(float(scores[e]) - kth) <= slack for e in ref ^ other)


class DecoderModel:
    """Embeddings, the chosen decoder layers, final norm and head, built from a ``WeightStore``.

    paths: op family -> 'torch' | 'kernel' (families ``OP_FAMILIES``). dtype: compute dtype.
    latent_fp8: MLA layers cache their latent as e4m3 with fp32 scales (FlashMLA's fp8 format).
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: WeightStore,
        layer_ids: Iterable[int],
        *,
        paths: dict[str, str],
        dtype: torch.dtype,
        workspace=None,
        latent_fp8: bool = False,
    ):
        check_runtime_support(spec)
        self.latent_fp8 = latent_fp8
        self.spec = spec
        self.eos_ids = eos_ids(spec)
        self.dtype = dtype
        self.device = store.device
        self.paths = paths
        text = spec.text_prefix  # "model." (Kimi K2.5: the language model under "language_model.model.")
        self.embed = store.get(text + "embed_tokens.weight")
        self.norm = store.get(text + "norm.weight")
        head = spec.head_prefix + "lm_head"
        self.head = Linear(self.embed) if spec.tie_embeddings else store.linear(head, bias=False)
        self.layers = [self._layer(store, i, workspace) for i in layer_ids]
        self.inv_freq, self.rope_factor = rope_frequencies(spec.rope, spec.rope.rotary_dim, spec.max_position)
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
        spec = self.spec
        layer = spec.layers[i]
        at, ffn = layer.attention, layer.ffn
        p = f"{spec.text_prefix}layers.{i}."
        fused = self.paths["norm_rope"] == "kernel"
        if at.kind in ("gqa", "mha", "sliding"):
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
                heads=at.num_heads,
                kv_heads=at.num_kv_heads,
                head_dim=at.head_dim,
                norm_eps=spec.norm_eps,
                window=at.window,
                path=self.paths["attention"],
                norm_rope_kernel=fused,
                rotary_dim=spec.rope.rotary_dim,
            )
        else:
            a = p + "self_attn."
            dsa = at.kind == "mla+dsa"
            low_rank_q = bool(at.q_lora_rank)
            weights = MLAWeights(
                kv_a=store.linear(a + "kv_a_proj_with_mqa"),
                kv_a_norm=store.get(a + "kv_a_layernorm.weight"),
                kv_b=store.linear(a + "kv_b_proj"),
                o=store.linear(a + "o_proj"),
                q_a=store.linear(a + "q_a_proj") if low_rank_q else None,
                q_a_norm=store.get(a + "q_a_layernorm.weight") if low_rank_q else None,
                q_b=store.linear(a + "q_b_proj") if low_rank_q else None,
                q=None if low_rank_q else store.linear(a + "q_proj"),
                index_wq_b=store.linear(a + "indexer.wq_b") if dsa else None,
                index_wk=store.linear(a + "indexer.wk") if dsa else None,
                index_k_norm_weight=store.get(a + "indexer.k_norm.weight") if dsa else None,
                index_k_norm_bias=store.get(a + "indexer.k_norm.bias") if dsa else None,
                index_weights_proj=store.linear(a + "indexer.weights_proj") if dsa else None,
            )
            shape = MLAShape(
                heads=at.num_heads,
                qk_nope=at.qk_nope_head_dim,
                qk_rope=at.qk_rope_head_dim,
                v_head=at.v_head_dim,
                kv_lora=at.kv_lora_rank,
                scale=mla_scale(spec, at),
                index_heads=at.index_n_heads,
                index_dim=at.index_head_dim,
                index_topk=at.index_topk,
                rope_pairs=spec.rope.interleaved or dsa,
            )
            attention = MLAAttention(
                weights,
                shape,
                attention_path=self.paths["attention"],
                indexer_path=self.paths["indexer"],
                norm_rope_kernel=fused,
                latent_fp8=self.latent_fp8,
            )
        return DecoderLayer(
            i,
            layer,
            store.get(p + "input_layernorm.weight"),
            store.get(p + "post_attention_layernorm.weight"),
            attention,
            self._ffn(store, p, ffn, workspace),
        )

    def _ffn(self, store: WeightStore, p: str, ffn: FFNSpec, workspace) -> DenseMLP | MoE:
        """The layer's FFN: a dense SwiGLU MLP, or routed experts (+ shared experts) behind a router.

        Routers: gpt_oss (softmax over the top-k logits, ``mlp.router`` with a bias); sigmoid scoring
        with a correction bias, groups and scaling (DeepSeek-V3, Kimi K2, GLM-4.5: ``mlp.gate``);
        softmax then top-k (Qwen3 ``mlp.gate``, Mixtral ``block_sparse_moe.gate``), renormalized
        when ``norm_topk_prob``.
        """
        if ffn.kind == "dense":
            return DenseMLP(
                store.linear(p + "mlp.gate_proj"), store.linear(p + "mlp.up_proj"), store.linear(p + "mlp.down_proj")
            )
        common = dict(path=self.paths["moe"], workspace=workspace)
        if self.spec.model_type == "gpt_oss":
            return MoE(
                RouterSpec("gpt_oss", ffn.top_k),
                store.linear(p + "mlp.router", bias=True),
                store.experts(p + "mlp.experts", ffn.num_experts, interleaved=True),
                clamped=True,
                alpha=GPT_OSS_SWIGLU_ALPHA,
                limit=ffn.swiglu_limit,
                **common,
            )
        block = p + ("block_sparse_moe." if store.has(p + "block_sparse_moe.gate.weight") else "mlp.")
        experts = store.experts(block + "experts", ffn.num_experts, interleaved=False)
        if ffn.scoring == "sigmoid":
            shared = None
            if ffn.num_shared_experts:
                s = block + "shared_experts."
                shared = DenseMLP(
                    store.linear(s + "gate_proj"), store.linear(s + "up_proj"), store.linear(s + "down_proj")
                )
            return MoE(
                RouterSpec("deepseek", ffn.top_k, ffn.n_group, ffn.topk_group, ffn.norm_topk_prob,
                           ffn.routed_scaling),
                store.linear(block + "gate", bias=False),
                experts,
                correction_bias=store.optional(block + "gate.e_score_correction_bias"),
                shared=shared,
                **common,
            )
        return MoE(
            RouterSpec("qwen3", ffn.top_k, norm_topk_prob=ffn.norm_topk_prob),
            store.linear(block + "gate", bias=False),
            experts,
            **common,
        )

    def cache_layouts(self, cache_dtype: torch.dtype) -> dict[int, dict]:
        return {layer.index: layer.attention.cache_layout(cache_dtype) for layer in self.layers}

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        eps = self.spec.norm_eps if eps is None else eps
        return rms_norm(
            x,
            weight,
            eps,
            scale_in_fp32=self.spec.model_type == "gpt_oss",
            kernel=self.paths["norm_rope"] == "kernel",
        )

    def forward(
        self, tokens: torch.Tensor, batch: DSABatch, pools: dict[int, dict[str, torch.Tensor]],
        embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens int64 [N] (ordered as ``batch``) -> final-normed hidden states [N, hidden].

        embeddings: [N, hidden] inputs in place of the token embeddings (a multimodal prompt whose
        image placeholders already hold the image features), or None."""
        x = (self.embed[tokens] if embeddings is None else embeddings).to(self.dtype)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_factor, batch.positions, self.dtype)
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
