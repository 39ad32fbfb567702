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
``adapt.kernels.sparse_mla`` latent attention over bf16 pages, and ``paged_gqa_attention`` below
for GQA). The kernel path stores what its kernel reads (bf16 latent, e4m3 indexer keys).

Cache: ``PagedKVCache`` pages of 64 tokens shared by all layers (one block table per sequence);
token p of a sequence lives at slot ``block_table[p // 64] * 64 + p % 64``. Each layer keeps named
pools [pages, 64, *width] whose dtypes the layer chooses (``cache_layout``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapt.runtime.kv_cache import PAGE_SIZE, DSABatch, OutOfPagesError
from adapt.runtime.weights import Linear, apply_linear

PoolLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]


# ----------------------------------------------------------------------------------------------
# norms and rotary embeddings (the "norm_rope" op family, torch path)
# ----------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_fp32: bool = False, kernel: bool = False
) -> torch.Tensor:
    """RMSNorm over the last axis in fp32, result in x's dtype.

    scale_in_fp32: multiply by the weight before casting back (gpt-oss keeps its norms in fp32);
    otherwise cast then multiply (DeepSeek, Qwen3). kernel: run ``rms_norm_triton``.
    """
    if kernel:
        return rms_norm_triton(x, weight, eps, scale_in_fp32=scale_in_fp32)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_fp32:
        return (weight.float() * xf).to(x.dtype)
    return weight.to(x.dtype) * xf.to(x.dtype)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate dims i and i + D/2 by angle i. x [N, ..., D]; cos, sin [N, D/2] (broadcast over the middle)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i + 1) by angle i; output de-interleaved (rotated evens, then odds)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, pairs: bool, kernel: bool
) -> torch.Tensor:
    """``rope_pairs`` (pairs) or ``rope_halves``; ``kernel`` runs ``rope_triton`` instead."""
    if kernel:
        return rope_triton(x, cos, sin, pairs=pairs)
    return rope_pairs(x, cos, sin) if pairs else rope_halves(x, cos, sin)


# ----------------------------------------------------------------------------------------------
# paged cache
# ----------------------------------------------------------------------------------------------


class PagedKVCache:
    """Pages of 64 tokens for every layer, handed out by one allocator.

    layouts: layer index -> {pool name: (per-token shape, dtype)}; pools are [pages, 64, *shape].
    ``append_tokens`` reserves pages for a whole step or raises ``OutOfPagesError`` before
    changing anything; ``free_sequence`` returns a sequence's pages.
    """

    def __init__(self, num_pages: int, layouts: dict[int, PoolLayout], device: torch.device | str = "cpu"):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.pools = {
            layer: {
                name: torch.zeros(num_pages, PAGE_SIZE, *shape, dtype=dtype, device=self.device)
                for name, (shape, dtype) in layout.items()
            }
            for layer, layout in layouts.items()
        }
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pools in self.pools.values() for t in pools.values())

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._pages[seq_id], self._lens[seq_id] = [], 0
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    def seq_len(self, seq_id: int) -> int:
        return self._lens[seq_id]

    def append_tokens(self, seq_ids: Sequence[int], counts: Sequence[int]) -> DSABatch:
        """Reserve slots for ``counts[i]`` new tokens of ``seq_ids[i]``; returns the step's batch."""
        needed = [
            -(-(self._lens[s] + c) // PAGE_SIZE) - len(self._pages[s])
            for s, c in zip(seq_ids, counts, strict=True)
        ]
        if sum(needed) > len(self._free):
            raise OutOfPagesError(
                f"KV cache full: this step needs {sum(needed)} more pages of {PAGE_SIZE} "
                f"tokens, {len(self._free)} of {self.num_pages} are free"
            )
        slots, positions, token_seq, starts = [], [], [], [0]
        for b, (seq_id, count, extra) in enumerate(zip(seq_ids, counts, needed, strict=True)):
            pages = self._pages[seq_id]
            pages.extend(self._free.pop() for _ in range(extra))
            start = self._lens[seq_id]
            pos = torch.arange(start, start + count, dtype=torch.int64)
            table = torch.tensor(pages, dtype=torch.int64)
            slots.append(table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
            positions.append(pos)
            token_seq.append(torch.full((count,), b, dtype=torch.int32))
            starts.append(starts[-1] + count)
            self._lens[seq_id] = start + count
        width = max(len(self._pages[s]) for s in seq_ids)
        block_table = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, seq_id in enumerate(seq_ids):
            block_table[row, : len(self._pages[seq_id])] = torch.tensor(
                self._pages[seq_id], dtype=torch.int32
            )
        dev = self.device
        return DSABatch(
            slots=torch.cat(slots).to(dev),
            positions=torch.cat(positions).to(dev),
            token_seq=torch.cat(token_seq).to(dev),
            query_starts=torch.tensor(starts, dtype=torch.int64, device=dev),
            block_table=block_table.to(dev),
            seq_lens=torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32, device=dev),
        )


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
    ):
        self.w = weights
        self.norm_rope_kernel = norm_rope_kernel
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
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
        q = apply_rope(q, cos, sin, pairs=False, kernel=fused)
        k = apply_rope(k, cos, sin, pairs=False, kernel=fused)
        if self.kv_round is not None:
            k, v = self.kv_round(k), self.kv_round(v)
        write_rows(pools["k"], batch.slots, k)
        write_rows(pools["v"], batch.slots, v)
        if self.path == "kernel":
            out = paged_gqa_attention(q, pools["k"], pools["v"], batch, self.scale, self.window, self.w.sinks)
        else:
            out = self._attend_torch(q, batch, pools)
        return apply_linear(out.reshape(n, -1).to(x.dtype), self.w.o)

    def _attend_torch(self, q: torch.Tensor, batch: DSABatch, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.empty_like(q)
        group = self.heads // self.kv_heads
        for b in range(batch.num_seqs):
            rows, mask = _visible(batch, b, self.window)
            slots = sequence_slots(batch, b)
            keys = read_rows(pools["k"], slots).to(q.dtype).repeat_interleave(group, dim=1)  # [L, H, D]
            values = read_rows(pools["v"], slots).to(q.dtype).repeat_interleave(group, dim=1)
            logits = torch.einsum("nhd,lhd->hnl", q[rows], keys) * self.scale
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
            if self.w.sinks is not None:
                sink = self.w.sinks.to(logits.dtype).view(-1, 1, 1).expand(-1, logits.shape[1], 1)
                full = torch.cat([logits, sink], dim=-1)
                full = full - full.amax(dim=-1, keepdim=True)
                probs = torch.softmax(full.float(), dim=-1)[..., :-1].to(q.dtype)
            else:
                probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
            out[rows] = torch.einsum("hnl,lhd->nhd", probs, values)
        return out


# ----------------------------------------------------------------------------------------------
# MLA + DSA
# ----------------------------------------------------------------------------------------------


@dataclass
class MLAWeights:
    """One MLA layer (DeepSeek-V3 names): q_a [q_lora, hidden], q_a_norm [q_lora], q_b
    [H*(nope+rope), q_lora], kv_a [kv_lora+rope, hidden], kv_a_norm [kv_lora], kv_b
    [H*(nope+v), kv_lora], o [hidden, H*v]; indexer (deepseek_v32): wq_b [Hi*Di, q_lora],
    wk [Di, hidden], k_norm_weight / k_norm_bias [Di], weights_proj [Hi, hidden]."""

    q_a: Linear
    q_a_norm: torch.Tensor
    q_b: Linear
    kv_a: Linear
    kv_a_norm: torch.Tensor
    kv_b: Linear
    o: Linear
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

    Pools: 'latent' [kv_lora] and 'rope' [qk_rope] (compute dtype on the torch path, bf16 for the
    sparse MLA kernel); indexer keys 'index_k' [Di] (torch path) or 'index_k8' e4m3 [Di] +
    'index_scale' fp32 [] (kernel path). ``last_indices`` keeps the latest top-k selection
    (int32 [N, index_topk], absolute positions, -1 none) for inspection.

    Precision variants (``adapt.runtime.variants.configure``): kv_round (applied to latent and rope
    rows before caching), index_fp8 (the torch indexer rounds Hadamard-rotated q and k to e4m3
    rows, as the kernel does); test hooks fault_index_head (the indexer kernel flips that head's
    weight) and fault_plain_scale (the sparse MLA kernel drops YaRN's mscale**2).
    """

    kv_round = None
    index_fp8 = False
    fault_index_head: int | None = None
    fault_plain_scale = False

    def __init__(
        self,
        weights: MLAWeights,
        shape: MLAShape,
        *,
        attention_path: str = "torch",
        indexer_path: str = "torch",
        norm_rope_kernel: bool = False,
    ):
        self.w = weights
        self.norm_rope_kernel = norm_rope_kernel
        self.s = shape
        self.attention_path = attention_path
        self.indexer_path = indexer_path
        self.has_indexer = weights.index_wq_b is not None
        self.last_indices: torch.Tensor | None = None
        self._hadamard: torch.Tensor | None = None

    def cache_layout(self, dtype: torch.dtype) -> PoolLayout:
        latent_dtype = torch.bfloat16 if self.attention_path == "kernel" else dtype
        layout: PoolLayout = {
            "latent": ((self.s.kv_lora,), latent_dtype),
            "rope": ((self.s.qk_rope,), latent_dtype),
        }
        if self.has_indexer:
            if self.indexer_path == "kernel":
                layout["index_k8"] = ((self.s.index_dim,), torch.float8_e4m3fn)
                layout["index_scale"] = ((), torch.float32)
            else:
                layout["index_k"] = ((self.s.index_dim,), dtype)
        return layout

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
        q_resid = rms_norm(apply_linear(x, self.w.q_a), self.w.q_a_norm, 1e-6, kernel=fused)
        q = apply_linear(q_resid, self.w.q_b).view(n, s.heads, s.qk_nope + s.qk_rope)
        q_nope, q_rope = q.split([s.qk_nope, s.qk_rope], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, pairs=s.rope_pairs, kernel=fused)
        latent, k_rope = apply_linear(x, self.w.kv_a).split([s.kv_lora, s.qk_rope], dim=-1)
        latent = rms_norm(latent, self.w.kv_a_norm, 1e-6, kernel=fused)
        k_rope = apply_rope(k_rope, cos, sin, pairs=s.rope_pairs, kernel=fused)
        if self.kv_round is not None:
            latent, k_rope = self.kv_round(latent), self.kv_round(k_rope)
        write_rows(pools["latent"], batch.slots, latent)
        write_rows(pools["rope"], batch.slots, k_rope)
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
            from adapt.runtime.dsa_attention import hadamard_matrix

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
        write_rows(pools["index_k8"], batch.slots, k8)
        write_rows(pools["index_scale"], batch.slots, k_scale)
        raw = apply_linear(x.float(), self.w.index_weights_proj)
        if self.fault_index_head is not None:
            raw[:, self.fault_index_head] = -raw[:, self.fault_index_head]
        weights = dsa.fold_index_weights(raw, q_scale, s.index_dim)
        limits = (batch.positions + 1).to(torch.int32)
        indices, _ = dsa.index_topk(
            q8,
            weights,
            pools["index_k8"],
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
            latent = read_rows(pools["latent"], slots).to(dtype)
            k_rope = read_rows(pools["rope"], slots).to(dtype)
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
            pools["latent"],
            None,
            pools["rope"],
            batch.block_table,
            batch.token_seq,
            indices,
            (s.qk_nope + s.qk_rope) ** -0.5 if self.fault_plain_scale else s.scale,
        )
        return torch.einsum("nhc,hvc->nhv", o_latent.float(), w_uv).to(q_nope.dtype)


def _dense_indices(batch: DSABatch) -> torch.Tensor:
    """int32 [N, max_len]: positions 0..p of each query (p its position), -1 after."""
    width = int(batch.seq_lens.max())
    pos = torch.arange(width, device=batch.positions.device)
    return torch.where(pos[None, :] <= batch.positions[:, None], pos[None, :], -1).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# kernels: paged GQA attention, RMSNorm, RoPE (Triton; interpreter on CPU)
# ----------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def paged_gqa_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: DSABatch,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal GQA over the paged cache with an optional sliding window and sinks (Triton).

    q: [N, H, D] (the N new tokens of ``batch``, D a power of two >= 16); k_pool, v_pool:
    [pages, 64, KV, D] (fp32 or bf16); sinks: [H] or None; window: keys with position > query
    position - window are visible. Returns fp32 [N, H, D].

    A program takes up to BLOCK_M consecutive query rows of one sequence times the H/KV query
    heads of one kv head (BLOCK_M * pow2(H/KV) rows of the score tile, at least 16), walks the
    keys the tile can see in blocks of 64 with an online softmax (base 2), and starts each row's
    softmax at its sink (running max = sink, sum = 1) when there are sinks. FLOPs:
    4 * D per (query head, visible key); bytes: 2 * D * itemsize per (kv head, key in the tile's
    span) and tile.
    """
    from adapt.runtime import attention_kernels as kernels

    n, heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    out = torch.empty(n, heads, dim, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    group = heads // kv_heads
    group_pad = 1 << (group - 1).bit_length()
    block_m = max(1, max(16, min(128, 16 * group_pad)) // group_pad)
    starts, counts = [], []
    bounds = batch.query_starts.tolist()
    for b in range(len(bounds) - 1):
        for first in range(bounds[b], bounds[b + 1], block_m):
            starts.append(first)
            counts.append(min(block_m, bounds[b + 1] - first))
    device = q.device
    sink = (sinks if sinks is not None else torch.zeros(heads, device=device)).float().contiguous()
    kernels.paged_gqa_kernel[(len(starts), kv_heads)](
        q.contiguous(),
        k_pool,
        v_pool,
        sink,
        batch.block_table,
        batch.token_seq.to(torch.int32).contiguous(),
        batch.positions.contiguous(),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(counts, dtype=torch.int32, device=device),
        out,
        batch.block_table.stride(0),
        heads,
        scale * math.log2(math.e),
        window or 0,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        KV_HEADS=kv_heads,
        DIM=dim,
        BLOCK_N=PAGE_SIZE,
        PAGE=PAGE_SIZE,
        HAS_SINK=sinks is not None,
        HAS_WINDOW=window is not None,
        UPCAST=_interpreting() or q.dtype == torch.float32,
        num_warps=4,
    )
    return out


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_fp32: bool = False
) -> torch.Tensor:
    """Triton twin of ``rms_norm`` (same rounding order): x [..., D] -> [..., D] in x's dtype.
    16 rows a program; reads and writes D * itemsize bytes per row."""
    from adapt.runtime import attention_kernels as kernels

    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    n, dim = rows.shape
    if n:
        kernels.rms_norm_kernel[(-(-n // 16),)](
            rows,
            weight.contiguous(),
            out,
            n,
            dim,
            eps,
            ROWS=16,
            BLOCK=1 << (dim - 1).bit_length(),
            SCALE_IN_FP32=scale_in_fp32,
            ROUND_BF16=x.dtype == torch.bfloat16,
        )
    return out.view(x.shape)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, pairs: bool) -> torch.Tensor:
    """Triton twin of ``rope_pairs`` (pairs) / ``rope_halves``: x [N, ..., D], cos/sin fp32-able [N, D/2].
    One program per token (all its heads); math in fp32, one rounding to x's dtype."""
    from adapt.runtime import attention_kernels as kernels

    n, dim = x.shape[0], x.shape[-1]
    rows = x.reshape(n, -1, dim).contiguous()
    out = torch.empty_like(rows)
    if rows.numel():
        per_token = rows.shape[1]
        kernels.rope_kernel[(n,)](
            rows,
            cos.float().contiguous(),
            sin.float().contiguous(),
            out,
            per_token,
            HALF=dim // 2,
            ROWS=1 << (per_token - 1).bit_length(),
            BLOCK=1 << (dim // 2 - 1).bit_length(),
            PAIRS=pairs,
            ROUND_BF16=x.dtype == torch.bfloat16,
        )
    return out.view(x.shape)
