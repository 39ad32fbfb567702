"""Attention for the runtime: the paged cache, GQA (gpt-oss, qwen3_moe) and MLA + DSA (DeepSeek).

Semantics follow transformers 5.19's eager implementations:

- GQA (``GQAAttention``): q/k/v projections (biases for gpt-oss), per-head RMSNorm on q and k
  (qwen3_moe), RoPE on halves (dims i and i + D/2 pair), causal mask, optional sliding window
  (key position > query position - window, gpt-oss's even layers), optional per-head sinks
  (an extra logit per head in the softmax, dropped afterwards), scale head_dim**-0.5.
- MLA (``MLAAttention``): q = q_b_proj(RMSNorm(q_a_proj(x))) -> nope | rope; latent =
  RMSNorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) and a shared rope key; DeepSeek's interleaved
  RoPE written de-interleaved; keys and values from kv_b_proj(latent); scale
  qk_head_dim**-0.5 x mscale(factor, mscale_all_dim)**2 under YaRN.
- DSA indexer (deepseek_v32): q_i = wq_b(q_resid) [Hi, Di], k_i = LayerNorm(wk(x)), rotate-half
  RoPE on their first qk_rope_head_dim dims, score I[t, s] = sum_h w[t, h] ReLU(q_i . k_i[s]) Di**-0.5
  with w = weights_proj(x) Hi**-0.5 in fp32; each query keeps its top ``index_topk`` visible keys.

Every op family has two paths: ``torch`` (the reference above, in the engine's compute dtype) and
``kernel`` (adapt's Triton kernels: ``adapt.kernels.dsa`` FP8 indexer with a Hadamard rotation,
``adapt.kernels.sparse_mla`` latent attention over bf16 pages, and ``adapt.kernels.attention``
for GQA). The kernel path stores what its kernel reads (bf16 latent, e4m3 indexer keys).

Cache: ``adapt.runtime.kv_cache.PagedKVCache``, pages of 64 tokens shared by all layers (one block
table per sequence, prefix reuse); each layer keeps named pools [pages, 64, *width] whose dtypes the
layer chooses (``cache_layout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapt.kernels.formats import PAGE_SIZE
from adapt.kernels.fp8 import quantize_fp8_groups
from adapt.runtime.kv_cache import DSABatch, PoolLayout, mla_layout
from adapt.runtime.weights import Linear, apply_linear

# ----------------------------------------------------------------------------------------------
# norms and rotary embeddings (the "norm_rope" op family, torch path)
# ----------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_fp32: bool = False, kernel: bool = False
) -> torch.Tensor:
    """``adapt.kernels.norm_rope.rms_norm`` (kernel) or its torch twin ``rms_norm_torch``."""
    from adapt.kernels import norm_rope  # after TRITON_INTERPRET is settled (adapt.runtime.engine)

    return (norm_rope.rms_norm if kernel else norm_rope.rms_norm_torch)(x, weight, eps, scale_in_fp32=scale_in_fp32)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, pairs: bool, kernel: bool
) -> torch.Tensor:
    """``adapt.kernels.norm_rope.rope`` (kernel) or its torch twin ``rope_torch``."""
    from adapt.kernels import norm_rope

    return (norm_rope.rope if kernel else norm_rope.rope_torch)(x, cos, sin, pairs=pairs)


# ----------------------------------------------------------------------------------------------
# paged cache
# ----------------------------------------------------------------------------------------------


def write_rows(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Store values [N, *shape] at ``slots`` of pool [pages, 64, *shape] (e4m3 pools via uint8)."""
    flat = pool.view(pool.shape[0] * PAGE_SIZE, -1) if pool.dim() > 2 else pool.view(-1, 1)
    rows = values.to(pool.dtype).reshape(values.shape[0], -1)
    if pool.dtype == torch.float8_e4m3fn:
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def sequence_slots(batch: DSABatch, b: int) -> torch.Tensor:
    """Cache slots of positions 0..seq_lens[b]-1 of sequence b: int64 [L]."""
    length = int(batch.seq_lens[b])
    pos = torch.arange(length, device=batch.block_table.device)
    return batch.block_table[b].long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE


def read_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [L, *shape] of pool [pages, 64, *shape] at ``slots``."""
    return pool.view(-1, *pool.shape[2:])[slots]


def _visible(batch: DSABatch, b: int, window: int | None) -> tuple[slice, torch.Tensor]:
    """(row range of sequence b's queries, bool [n, L] keys each query may see)."""
    start, end = int(batch.query_starts[b]), int(batch.query_starts[b + 1])
    qpos = batch.positions[start:end]
    kpos = torch.arange(int(batch.seq_lens[b]), device=qpos.device)
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    return slice(start, end), mask


# ----------------------------------------------------------------------------------------------
# GQA
# ----------------------------------------------------------------------------------------------


@dataclass
class GQAWeights:
    """One GQA layer: q [H*D, hidden], k/v [KV*D, hidden], o [hidden, H*D] (optional biases),
    q_norm/k_norm [D] (qwen3_moe) and sinks [H] (gpt-oss) or None."""

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None


class GQAAttention:
    """Grouped-query attention over the paged cache (pools 'k', 'v': [KV, D]).

    kv_round: None, or a function applied to k and v rows before they are cached (the FP8 KV
    format of ``adapt.runtime.variants``).
    """

    kv_round = None

    def __init__(
        self,
        weights: GQAWeights,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        norm_eps: float,
        window: int | None,
        path: str = "torch",
        norm_rope_kernel: bool = False,
        rotary_dim: int | None = None,
    ):
        self.w = weights
        self.norm_rope_kernel = norm_rope_kernel
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rotary_dim = rotary_dim or head_dim  # partial rotary (glm4_moe): the first rotary_dim dims
        self.norm_eps = norm_eps
        self.window = window
        self.path = path
        self.scale = head_dim**-0.5

    def cache_layout(self, dtype: torch.dtype) -> PoolLayout:
        return {"k": ((self.kv_heads, self.head_dim), dtype), "v": ((self.kv_heads, self.head_dim), dtype)}

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: DSABatch,
        pools: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """x [N, hidden] new tokens -> [N, hidden]; writes their k, v into ``pools``."""
        n = x.shape[0]
        q = apply_linear(x, self.w.q).view(n, self.heads, self.head_dim)
        k = apply_linear(x, self.w.k).view(n, self.kv_heads, self.head_dim)
        v = apply_linear(x, self.w.v).view(n, self.kv_heads, self.head_dim)
        fused = self.norm_rope_kernel
        if self.w.q_norm is not None:
            q = rms_norm(q, self.w.q_norm, self.norm_eps, kernel=fused)
            k = rms_norm(k, self.w.k_norm, self.norm_eps, kernel=fused)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if self.kv_round is not None:
            k, v = self.kv_round(k), self.kv_round(v)
        write_rows(pools["k"], batch.slots, k)
        write_rows(pools["v"], batch.slots, v)
        from adapt.kernels import attention as gqa_kernels

        attend = gqa_kernels.paged_gqa_attention if self.path == "kernel" else gqa_kernels.paged_gqa_attention_torch
        out = attend(q, pools["k"], pools["v"], batch.block_table, batch.token_seq, batch.positions,
                     batch.query_starts, self.scale, self.window, self.w.sinks)
        return apply_linear(out.reshape(n, -1).to(x.dtype), self.w.o)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on halves of the first ``rotary_dim`` dims of x [N, heads, D]; the rest pass through."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin, pairs=False, kernel=self.norm_rope_kernel)
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        rot = apply_rope(rot.contiguous(), cos, sin, pairs=False, kernel=self.norm_rope_kernel)
        return torch.cat([rot, rest], dim=-1)

# ----------------------------------------------------------------------------------------------
# MLA + DSA
# ----------------------------------------------------------------------------------------------


FP8_LATENT_GROUP = 128
"""Latent values per fp32 scale in the fp8 MLA cache (FlashMLA's fp8 format: 512 = 4 x 128)."""


def hadamard_matrix(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix, fp32 [dim, dim]; dim a power of two. Rotating the
    indexer's q and k by it spreads outliers before FP8 (DeepSeek-V3.2's indexer does the same)."""
    if dim & (dim - 1):
        raise ValueError(f"Hadamard size {dim} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(device)


@dataclass
class MLAWeights:
    """One MLA layer (DeepSeek-V3 names): kv_a [kv_lora+rope, hidden], kv_a_norm [kv_lora], kv_b
    [H*(nope+v), kv_lora], o [hidden, H*v]; queries through a low-rank pair q_a [q_lora, hidden],
    q_a_norm [q_lora], q_b [H*(nope+rope), q_lora], or (no q_lora_rank, DeepSeek-V2-Lite style)
    one q [H*(nope+rope), hidden]; indexer (deepseek_v32): wq_b [Hi*Di, q_lora], wk [Di, hidden],
    k_norm_weight / k_norm_bias [Di], weights_proj [Hi, hidden]."""

    kv_a: Linear
    kv_a_norm: torch.Tensor
    kv_b: Linear
    o: Linear
    q_a: Linear | None = None
    q_a_norm: torch.Tensor | None = None
    q_b: Linear | None = None
    q: Linear | None = None
    index_wq_b: Linear | None = None
    index_wk: Linear | None = None
    index_k_norm_weight: torch.Tensor | None = None
    index_k_norm_bias: torch.Tensor | None = None
    index_weights_proj: Linear | None = None


@dataclass(frozen=True)
class MLAShape:
    heads: int
    qk_nope: int
    qk_rope: int
    v_head: int
    kv_lora: int
    scale: float
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    rope_pairs: bool = True  # DeepSeek's interleaved-pair RoPE (rope_interleave); False: halves


class MLAAttention:
    """MLA attention with an optional DSA indexer over the paged cache.

    Pools (``mla_layout``): 'latent_nope' [kv_lora] and 'latent_rope' [qk_rope] (compute dtype on the
    torch path, bf16 for the sparse MLA kernel; e4m3 + 'latent_scale' with ``latent_fp8``); indexer
    keys 'index_k' [Di] (torch path) or e4m3 [Di] + 'index_scale' fp32 [] (kernel path).
    ``last_indices`` keeps the latest top-k selection
    (int32 [N, index_topk], absolute positions, -1 none) for inspection.

    Precision variants (``adapt.runtime.variants.configure``): kv_round (applied to latent and rope
    rows before caching), index_fp8 (the torch indexer rounds Hadamard-rotated q and k to e4m3
    rows, as the kernel does), qk_fp8 (the sparse MLA kernel takes q.k in e4m3: q quantized per head
    and 128 columns; needs the e4m3 latent of four scale groups); test hooks fault_index_head (the
    indexer kernel flips that head's weight) and fault_plain_scale (the sparse MLA kernel drops YaRN's
    mscale**2).
    """

    kv_round = None
    index_fp8 = False
    fault_index_head: int | None = None
    fault_plain_scale = False
    qk_fp8 = False

    def __init__(
        self,
        weights: MLAWeights,
        shape: MLAShape,
        *,
        attention_path: str = "torch",
        indexer_path: str = "torch",
        norm_rope_kernel: bool = False,
        latent_fp8: bool = False,
    ):
        self.w = weights
        self.norm_rope_kernel = norm_rope_kernel
        self.latent_fp8 = latent_fp8  # cache the latent as e4m3 with one fp32 scale per 128 values
        self.s = shape
        self.attention_path = attention_path
        self.indexer_path = indexer_path
        self.has_indexer = weights.index_wq_b is not None
        self.last_indices: torch.Tensor | None = None
        self._hadamard: torch.Tensor | None = None

    def cache_layout(self, dtype: torch.dtype) -> PoolLayout:
        """``mla_layout`` pools: the latent in ``dtype`` (bf16 for the sparse MLA kernel, e4m3 +
        scales with ``latent_fp8``), indexer keys e4m3 + scale on the kernel path, else in ``dtype``."""
        s = self.s
        return mla_layout(s.kv_lora, s.qk_rope, s.index_dim if self.has_indexer else 0,
                          latent_format="fp8" if self.latent_fp8 else "bf16",
                          latent_scale_group=min(FP8_LATENT_GROUP, s.kv_lora),
                          latent_dtype=torch.bfloat16 if self.attention_path == "kernel" else dtype,
                          index_fp8=self.indexer_path == "kernel")

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: DSABatch,
        pools: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """x [N, hidden] new tokens -> [N, hidden]; writes their latent (and indexer key) into ``pools``."""
        s, n, fused = self.s, x.shape[0], self.norm_rope_kernel
        if self.w.q is not None:
            q_resid = None
            q = apply_linear(x, self.w.q).view(n, s.heads, s.qk_nope + s.qk_rope)
        else:
            q_resid = rms_norm(apply_linear(x, self.w.q_a), self.w.q_a_norm, 1e-6, kernel=fused)
            q = apply_linear(q_resid, self.w.q_b).view(n, s.heads, s.qk_nope + s.qk_rope)
        q_nope, q_rope = q.split([s.qk_nope, s.qk_rope], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, pairs=s.rope_pairs, kernel=fused)
        latent, k_rope = apply_linear(x, self.w.kv_a).split([s.kv_lora, s.qk_rope], dim=-1)
        latent = rms_norm(latent, self.w.kv_a_norm, 1e-6, kernel=fused)
        k_rope = apply_rope(k_rope, cos, sin, pairs=s.rope_pairs, kernel=fused)
        if self.kv_round is not None:
            latent, k_rope = self.kv_round(latent), self.kv_round(k_rope)
        if "latent_scale" in pools:
            values, scales = quantize_fp8_groups(latent, s.kv_lora // pools["latent_scale"].shape[-1])
            write_rows(pools["latent_nope"], batch.slots, values)
            write_rows(pools["latent_scale"], batch.slots, scales)
        else:
            write_rows(pools["latent_nope"], batch.slots, latent)
        write_rows(pools["latent_rope"], batch.slots, k_rope)
        indices = self._select(x, q_resid, cos, sin, batch, pools) if self.has_indexer else None
        self.last_indices = indices
        if self.attention_path == "kernel":
            out = self._attend_kernel(q_nope, q_rope, batch, pools, indices)
        else:
            out = self._attend_torch(q_nope, q_rope, batch, pools, indices)
        return apply_linear(out.reshape(n, -1).to(x.dtype), self.w.o)

    # -- indexer ---------------------------------------------------------------------------------

    def _index_qk(self, x, q_resid, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        s, n = self.s, x.shape[0]
        q = apply_linear(q_resid, self.w.index_wq_b).view(n, s.index_heads, s.index_dim)
        fused = self.norm_rope_kernel
        q = torch.cat(
            [apply_rope(q[..., : s.qk_rope], cos, sin, pairs=False, kernel=fused), q[..., s.qk_rope :]],
            dim=-1,
        )
        k = F.layer_norm(
            apply_linear(x, self.w.index_wk),
            (s.index_dim,),
            self.w.index_k_norm_weight.to(x.dtype),
            self.w.index_k_norm_bias.to(x.dtype),
            1e-6,
        )
        k = torch.cat(
            [apply_rope(k[..., : s.qk_rope], cos, sin, pairs=False, kernel=fused), k[..., s.qk_rope :]],
            dim=-1,
        )
        return q, k

    def _head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [N, Hi]: weights_proj(x) in fp32 (transformers keeps it there) times Hi**-0.5."""
        return apply_linear(x.float(), self.w.index_weights_proj) * self.s.index_heads**-0.5

    def _select(self, x, q_resid, cos, sin, batch, pools) -> torch.Tensor:
        q, k = self._index_qk(x, q_resid, cos, sin)
        if self.indexer_path == "kernel":
            return self._select_kernel(x, q, k, batch, pools)
        if self.index_fp8:
            q, k = self._round_index_fp8(q, k)
        write_rows(pools["index_k"], batch.slots, k)
        s = self.s
        weights = self._head_weights(x)
        out = torch.full((x.shape[0], s.index_topk), -1, dtype=torch.int32, device=x.device)
        for b in range(batch.num_seqs):
            rows, mask = _visible(batch, b, None)
            keys = read_rows(pools["index_k"], sequence_slots(batch, b)).float()  # [L, Di]
            scores = torch.relu(torch.einsum("nhd,ld->nhl", q[rows].float(), keys) * s.index_dim**-0.5)
            index = torch.einsum("nh,nhl->nl", weights[rows], scores).masked_fill(~mask, float("-inf"))
            count = min(s.index_topk, index.shape[-1])
            values, chosen = index.topk(count, dim=-1)
            out[rows, :count] = torch.where(values == float("-inf"), -1, chosen).to(torch.int32)
        return out

    def _rotation(self, device) -> torch.Tensor | None:
        """The orthonormal Hadamard matrix [Di, Di] the FP8 indexer rotates q and k by (None: Di not a power of 2)."""
        if self._hadamard is None and not self.s.index_dim & (self.s.index_dim - 1):
            self._hadamard = hadamard_matrix(self.s.index_dim, device)
        return self._hadamard

    def _round_index_fp8(self, q, k) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hi, Di], k [N, Di] -> fp32 values of their rotated e4m3 rows (q . k is rotation invariant)."""
        from adapt.runtime.variants import round_fp8_rows

        rotation = self._rotation(q.device)
        if rotation is not None:
            q, k = q.float() @ rotation, k.float() @ rotation
        return round_fp8_rows(q.float()), round_fp8_rows(k.float())

    def _select_kernel(self, x, q, k, batch, pools) -> torch.Tensor:
        from adapt.kernels import dsa

        s = self.s
        self._rotation(x.device)
        if self._hadamard is not None:
            q, k = q.float() @ self._hadamard, k.float() @ self._hadamard
        q8, q_scale = dsa.quantize_fp8_rows(q.float().contiguous())
        k8, k_scale = dsa.quantize_fp8_rows(k.float().contiguous())
        write_rows(pools["index_k"], batch.slots, k8)
        write_rows(pools["index_scale"], batch.slots, k_scale)
        raw = apply_linear(x.float(), self.w.index_weights_proj)
        if self.fault_index_head is not None:
            raw[:, self.fault_index_head] = -raw[:, self.fault_index_head]
        weights = dsa.fold_index_weights(raw, q_scale, s.index_dim)
        limits = (batch.positions + 1).to(torch.int32)
        indices, _ = dsa.index_topk(
            q8,
            weights,
            pools["index_k"],
            pools["index_scale"],
            batch.block_table,
            batch.token_seq,
            limits,
            s.index_topk,
        )
        return indices

    # -- attention -------------------------------------------------------------------------------

    def _attend_torch(self, q_nope, q_rope, batch, pools, indices) -> torch.Tensor:
        s = self.s
        dtype = q_nope.dtype
        out = torch.empty(q_nope.shape[0], s.heads, s.v_head, dtype=dtype, device=q_nope.device)
        for b in range(batch.num_seqs):
            rows, mask = _visible(batch, b, None)
            slots = sequence_slots(batch, b)
            latent = read_rows(pools["latent_nope"], slots).float()
            if "latent_scale" in pools:
                scale = read_rows(pools["latent_scale"], slots)
                latent = (latent.view(len(slots), scale.shape[-1], -1) * scale.unsqueeze(-1)).view(len(slots), -1)
            latent = latent.to(dtype)
            k_rope = read_rows(pools["latent_rope"], slots).to(dtype)
            kv = apply_linear(latent, self.w.kv_b).view(len(slots), s.heads, s.qk_nope + s.v_head)
            k_nope, values = kv.split([s.qk_nope, s.v_head], dim=-1)
            logits = (
                torch.einsum("nhd,lhd->hnl", q_nope[rows], k_nope)
                + torch.einsum("nhd,ld->hnl", q_rope[rows], k_rope)
            ) * s.scale
            if indices is not None:
                chosen = indices[rows].long()
                length = mask.shape[1]
                selected = torch.zeros(mask.shape[0], length + 1, dtype=torch.bool, device=mask.device)
                selected.scatter_(1, torch.where(chosen >= 0, chosen, length), True)  # -1 -> spare column
                mask = mask & selected[:, :length]
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
            probs = torch.softmax(logits.float(), dim=-1).to(dtype)
            out[rows] = torch.einsum("hnl,lhv->nhv", probs, values)
        return out

    def _attend_kernel(self, q_nope, q_rope, batch, pools, indices) -> torch.Tensor:
        from adapt.kernels.sparse_mla import sparse_mla

        s = self.s
        kv_b = self.w.kv_b.dense(torch.float32).view(s.heads, s.qk_nope + s.v_head, s.kv_lora)
        w_uk, w_uv = kv_b[:, : s.qk_nope], kv_b[:, s.qk_nope :]
        if indices is None:  # MLA without an indexer: every visible key, as dense positions
            indices = _dense_indices(batch)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope.float(), w_uk).to(torch.bfloat16)
        o_latent = sparse_mla(
            q_latent,
            q_rope.to(torch.bfloat16),
            pools["latent_nope"],
            pools.get("latent_scale"),
            pools["latent_rope"],
            batch.block_table,
            batch.token_seq,
            indices,
            (s.qk_nope + s.qk_rope) ** -0.5 if self.fault_plain_scale else s.scale,
            qk_fp8=self.qk_fp8 or None,
        )
        return torch.einsum("nhc,hvc->nhv", o_latent.float(), w_uv).to(q_nope.dtype)


def _dense_indices(batch: DSABatch) -> torch.Tensor:
    """int32 [N, max_len]: positions 0..p of each query (p its position), -1 after."""
    width = int(batch.seq_lens.max())
    pos = torch.arange(width, device=batch.positions.device)
    return torch.where(pos[None, :] <= batch.positions[:, None], pos[None, :], -1).to(torch.int32)
