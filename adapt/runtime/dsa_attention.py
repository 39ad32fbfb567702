"""The DeepSeek Sparse Attention block (DeepSeek-V3.2 ``self_attn``), from hidden states to output.

Semantics follow transformers' ``deepseek_v32`` (``DeepseekV32Attention`` and
``DeepseekV32Indexer``):

- MLA: q = q_b_proj(RMSNorm(q_a_proj(x))) split into nope (qk_nope_head_dim) and rope
  (qk_rope_head_dim) parts; latent c = RMSNorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) and a
  shared rope key; RoPE on q_rope and the shared key in DeepSeek's interleaved-pair form,
  stored de-interleaved (evens then odds, as transformers writes them; q and k use the same
  layout, so q.k is unchanged).
- Indexer: q_i = wq_b(q_resid) as index_n_heads x index_head_dim; k_i = LayerNorm(wk(x));
  RoPE on the first qk_rope_head_dim dims of each in the non-interleaved (rotate-half) form;
  per-head weights weights_proj(x) * H**-0.5; scale index_head_dim**-0.5.
- Attention: the absorbed latent form over the indexer's top-k positions (see
  ``adapt.kernels.sparse_mla``); W_UK and W_UV come from kv_b_proj.

Before FP8 quantization the indexer q and k are rotated by the same orthonormal Hadamard
matrix when index_head_dim is a power of two, as DeepSeek's reference inference code does
(transformers skips it: H q . H k = q . k, so it changes FP8 rounding only, spreading
outliers over all dimensions before the per-token scale is taken).

Weights are taken by their Hugging Face checkpoint names relative to ``self_attn.``
(``q_a_proj.weight``, ..., ``indexer.k_norm.bias``), already dequantized to a float dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from adapt.errors import InputError
from adapt.kernels import dsa, sparse_mla
from adapt.runtime.kv_cache import DSABatch, DSALayerCache

WEIGHT_NAMES = (
    "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight",
    "indexer.k_norm.weight", "indexer.k_norm.bias", "indexer.weights_proj.weight",
)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DSAConfig:
    """Shapes and constants of one DSA attention layer (fields named as in config.json).

    rope_scaling: the checkpoint's ``rope_scaling``/``rope_parameters`` dict (``type`` or
    ``rope_type`` 'yarn' with factor, original_max_position_embeddings, beta_fast, beta_slow,
    mscale, mscale_all_dim), or None for plain RoPE.
    """

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> DSAConfig:
        """Build from a config.json dict or a transformers config object."""
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        rope = get("rope_parameters") or get("rope_scaling")
        theta = get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        if kind not in ("default", "yarn"):
            raise InputError(f"rope type {kind!r} is not supported by the DSA block "
                             "(supported: default, yarn)",
                             file="config.json", field="rope_scaling")
        names = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk")
        values = {}
        for name in names:
            value = get(name)
            if not isinstance(value, int) or value <= 0:
                raise InputError(f"expected a positive integer, got {value!r}", file="config.json",
                                 field=name)
            values[name] = value
        return cls(**values, rms_norm_eps=float(get("rms_norm_eps") or 1e-6), rope_theta=float(theta),
                   rope_scaling=dict(rope) if rope and kind == "yarn" else None)

    @property
    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)**-0.5, times mscale_all_dim**2 under YaRN (as transformers)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope_scaling and self.rope_scaling.get("mscale_all_dim"):
            m = _yarn_mscale(self.rope_scaling["factor"], self.rope_scaling["mscale_all_dim"])
            scale *= m * m
        return scale

    def rope_frequencies(self) -> tuple[torch.Tensor, float]:
        """(inverse frequencies fp32 [qk_rope_head_dim / 2], factor on cos and sin)."""
        dim = self.qk_rope_head_dim
        pos_freqs = self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        if not self.rope_scaling:
            return 1.0 / pos_freqs, 1.0
        rs = self.rope_scaling
        factor = rs["factor"]
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = rs.get("attention_factor")
        if attention is None:
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                         if mscale and mscale_all else _yarn_mscale(factor))
        fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
        original = rs["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.rope_theta))

        low, high = correction_dim(fast), correction_dim(slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attention)


@dataclass(frozen=True)
class DSAWeights:
    """One layer's attention weights (HF names, float dtypes), plus the split kv_b_proj.

    w_uk: [H, qk_nope_head_dim, kv_lora_rank]; w_uv: [H, v_head_dim, kv_lora_rank].
    """

    tensors: Mapping[str, torch.Tensor]
    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor], config: DSAConfig,
                        prefix: str = "") -> DSAWeights:
        """Pick ``prefix + name`` for every name in ``WEIGHT_NAMES`` (prefix e.g.
        'model.layers.3.self_attn.'); a missing tensor is an ``InputError``."""
        tensors = {}
        for name in WEIGHT_NAMES:
            key = prefix + name
            if key not in state:
                raise InputError("tensor missing from the DSA layer's weights", field=key,
                                 hint="pass the layer's self_attn tensors with their checkpoint names")
            tensors[name] = state[key]
        kv_b = tensors["kv_b_proj.weight"].view(
            config.num_attention_heads, config.qk_nope_head_dim + config.v_head_dim, config.kv_lora_rank)
        return cls(tensors=tensors, w_uk=kv_b[:, : config.qk_nope_head_dim],
                   w_uv=kv_b[:, config.qk_nope_head_dim:])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x0, x1), (x2, x3), ...; output de-interleaved (evens, then odds).
    x: [N, ..., D]; cos, sin: [N, D / 2] broadcast over the middle axes."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def _rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved (rotate-half) RoPE: dims i and i + D/2 form a pair."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def hadamard_matrix(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix, fp32 [dim, dim]; dim a power of two."""
    if dim & (dim - 1):
        raise ValueError(f"Hadamard size {dim} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(device)


@dataclass(frozen=True)
class DSAStepDetails:
    """What one forward selected: indices int32 [N, index_topk] (absolute positions, -1 none)
    and how the indexer bounded its score memory."""

    indices: torch.Tensor
    index_stats: dsa.IndexStats


class DSAAttention:
    """One DSA attention layer over a paged cache.

    backend: 'triton' runs ``adapt.kernels`` Triton kernels, 'torch' their torch twins (same
    results within rounding). max_score_bytes bounds the indexer's fp32 score chunk.
    """

    def __init__(self, config: DSAConfig, weights: DSAWeights, *, backend: str = "triton",
                 hadamard: bool = True, max_score_bytes: int = dsa.DEFAULT_MAX_SCORE_BYTES):
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
        self.config = config
        self.weights = weights
        self.backend = backend
        self.max_score_bytes = max_score_bytes
        self.inv_freq, self.rope_factor = config.rope_frequencies()
        d = config.index_head_dim
        self.hadamard = hadamard_matrix(d) if hadamard and not d & (d - 1) else None

    def _w(self, name: str) -> torch.Tensor:
        return self.weights.tensors[name]

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (freqs.cos() * self.rope_factor).to(dtype), (freqs.sin() * self.rope_factor).to(dtype)

    def forward(self, hidden: torch.Tensor, batch: DSABatch, cache: DSALayerCache) -> torch.Tensor:
        """hidden: [N, hidden_size] new tokens (ordered as ``batch``); writes them into ``cache``
        and returns the attention output [N, hidden_size] in hidden's dtype."""
        return self.forward_with_details(hidden, batch, cache)[0]

    def forward_with_details(self, hidden: torch.Tensor, batch: DSABatch,
                             cache: DSALayerCache) -> tuple[torch.Tensor, DSAStepDetails]:
        """``forward`` plus the indexer's selections."""
        cfg = self.config
        n = hidden.shape[0]
        if n != batch.num_tokens:
            raise ValueError(f"{n} hidden rows but the batch holds {batch.num_tokens} new tokens")
        dtype = hidden.dtype
        cos, sin = self._cos_sin(batch.positions, dtype)

        q_resid = _rms_norm(F.linear(hidden, self._w("q_a_proj.weight")), self._w("q_a_layernorm.weight"),
                            1e-6)
        q = F.linear(q_resid, self._w("q_b_proj.weight")).view(n, cfg.num_attention_heads, -1)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_rope = _rope_interleaved(q_rope, cos, sin)
        kv = F.linear(hidden, self._w("kv_a_proj_with_mqa.weight"))
        latent, k_rope = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = _rms_norm(latent, self._w("kv_a_layernorm.weight"), 1e-6)
        k_rope = _rope_interleaved(k_rope, cos, sin)

        index_q, index_w, index_k8, index_ks = self._indexer_inputs(hidden, q_resid, cos, sin)
        cache.write(batch.slots, latent, k_rope, index_k8, index_ks)

        limits = (batch.positions + 1).to(torch.int32)
        select = dsa.index_topk if self.backend == "triton" else dsa.index_topk_torch
        indices, stats = select(index_q, index_w, cache.index_k, cache.index_scale, batch.block_table,
                                batch.token_seq, limits, cfg.index_topk, max_score_bytes=self.max_score_bytes)

        q_latent = torch.einsum("nhd,hdc->nhc", q_nope.float(), self.weights.w_uk.float()).to(torch.bfloat16)
        attend = sparse_mla.sparse_mla if self.backend == "triton" else sparse_mla.sparse_mla_torch
        o_latent = attend(q_latent, q_rope.to(torch.bfloat16), cache.latent_nope, cache.latent_scale,
                          cache.latent_rope, batch.block_table, batch.token_seq, indices, cfg.softmax_scale)
        o = torch.einsum("nhc,hvc->nhv", o_latent.float(), self.weights.w_uv.float()).to(dtype)
        out = F.linear(o.reshape(n, -1), self._w("o_proj.weight"))
        return out, DSAStepDetails(indices=indices, index_stats=stats)

    def _indexer_inputs(self, hidden, q_resid, cos, sin):
        """FP8 indexer queries [N, Hi, Di] with folded weights [N, Hi], and FP8 keys [N, Di] + scales [N]."""
        cfg = self.config
        n = hidden.shape[0]
        rope = cfg.qk_rope_head_dim
        q = F.linear(q_resid, self._w("indexer.wq_b.weight")).view(n, cfg.index_n_heads, cfg.index_head_dim)
        q = torch.cat([_rope_half(q[..., :rope], cos, sin), q[..., rope:]], dim=-1)
        k = F.layer_norm(F.linear(hidden, self._w("indexer.wk.weight")), (cfg.index_head_dim,),
                         self._w("indexer.k_norm.weight"), self._w("indexer.k_norm.bias"), 1e-6)
        k = torch.cat([_rope_half(k[..., :rope], cos, sin), k[..., rope:]], dim=-1)
        if self.hadamard is not None:
            h = self.hadamard.to(hidden.device)
            q, k = q.float() @ h, k.float() @ h
        quantize = dsa.quantize_fp8_rows if self.backend == "triton" else dsa.quantize_fp8_rows_torch
        q8, q_scale = quantize(q)
        k8, k_scale = quantize(k)
        weights = F.linear(hidden.to(self._w("indexer.weights_proj.weight").dtype),
                           self._w("indexer.weights_proj.weight"))
        return q8, dsa.fold_index_weights(weights, q_scale, cfg.index_head_dim), k8, k_scale
