"""Paged caches for DeepSeek Sparse Attention: the MLA latent cache and the indexer key cache.

Both caches share one page geometry (64 tokens a page) and one block table per sequence:
token ``p`` of a sequence lives in page ``block_table[p // 64]`` at offset ``p % 64``; its
slot is ``page * 64 + offset``. Per layer and token the caches hold

- MLA latent, ``latent_format="bf16"``: ``kv_lora_rank`` + ``rope_dim`` bf16 values
  (DeepSeek-V3.2: 512 + 64 -> 1152 B);
- MLA latent, ``latent_format="fp8"``: ``kv_lora_rank`` e4m3 values, one fp32 scale per
  ``latent_scale_group`` of them, and ``rope_dim`` bf16 values (DeepSeek-V3.2 with groups of
  128: 512 + 16 + 128 = 656 B, the size of FlashMLA's fp8 decode format);
- indexer keys: ``index_head_dim`` e4m3 values and one fp32 scale (DeepSeek-V3.2: 132 B).

Pages are handed out by one allocator for all layers: ``append_tokens`` reserves the pages
that the new tokens need for every sequence of the step before anything is written, and
raises ``OutOfPagesError`` when the free list cannot cover them, so a full cache never
overwrites a page that another sequence owns. ``free_sequence`` returns a sequence's pages;
freed pages are reused by later sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from adapt.kernels.formats import FP8_DTYPE, PAGE_SIZE
from adapt.kernels.fp8 import quantize_fp8_groups


class OutOfPagesError(RuntimeError):
    """The page pool cannot hold the tokens asked for; nothing was allocated or written."""


def _rows_of(pool: torch.Tensor) -> torch.Tensor:
    """[pages * 64, width] view of a cache pool; e4m3 pools as uint8 (index_copy_ has no fp8 CPU kernel)."""
    rows = pool.view(-1, pool.shape[-1]) if pool.dim() > 2 else pool.view(-1, 1)
    return rows.view(torch.uint8) if rows.dtype == FP8_DTYPE else rows


def _as_rows(values: torch.Tensor) -> torch.Tensor:
    values = values.reshape(values.shape[0], -1)
    return values.view(torch.uint8) if values.dtype == FP8_DTYPE else values


@dataclass(frozen=True)
class DSALayerCache:
    """One layer's cache tensors (views into the pools of ``PagedDSACache``).

    latent_nope: [pages, 64, kv_lora_rank], bf16 or e4m3.
    latent_scale: [pages, 64, kv_lora_rank // latent_scale_group] fp32, or None for bf16.
    latent_rope: [pages, 64, rope_dim] bf16 (the rotated shared key part).
    index_k: [pages, 64, index_head_dim] e4m3.
    index_scale: [pages, 64] fp32.
    """

    latent_nope: torch.Tensor
    latent_scale: torch.Tensor | None
    latent_rope: torch.Tensor
    index_k: torch.Tensor
    index_scale: torch.Tensor

    @property
    def latent_fp8(self) -> bool:
        return self.latent_scale is not None

    @property
    def latent_scale_group(self) -> int:
        if self.latent_scale is None:
            return self.latent_nope.shape[-1]
        return self.latent_nope.shape[-1] // self.latent_scale.shape[-1]

    def write(self, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
              index_k: torch.Tensor, index_scale: torch.Tensor) -> None:
        """Store new tokens at ``slots`` (int64 [N], page * 64 + offset).

        latent: [N, kv_lora_rank] (normalised kv latent, any float dtype; quantized here for
        an fp8 cache); rope: [N, rope_dim] rotated shared key; index_k: [N, index_head_dim]
        e4m3; index_scale: [N] fp32.
        """
        if self.latent_scale is not None:
            values, scales = quantize_fp8_groups(latent, self.latent_scale_group)
            _rows_of(self.latent_nope).index_copy_(0, slots, _as_rows(values))
            _rows_of(self.latent_scale).index_copy_(0, slots, scales)
        else:
            _rows_of(self.latent_nope).index_copy_(0, slots, latent.to(self.latent_nope.dtype))
        _rows_of(self.latent_rope).index_copy_(0, slots, rope.to(self.latent_rope.dtype))
        _rows_of(self.index_k).index_copy_(0, slots, _as_rows(index_k.to(FP8_DTYPE)))
        _rows_of(self.index_scale).index_copy_(0, slots, index_scale.float().reshape(-1, 1))

    def latent_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized latent rows at ``slots``: fp32 [N, kv_lora_rank + rope_dim]."""
        nope = self.latent_nope.view(-1, self.latent_nope.shape[-1])[slots].float()
        if self.latent_scale is not None:
            scale = self.latent_scale.view(-1, self.latent_scale.shape[-1])[slots]
            nope = (nope.view(len(slots), scale.shape[-1], -1) * scale.unsqueeze(-1)).view(len(slots), -1)
        rope = self.latent_rope.view(-1, self.latent_rope.shape[-1])[slots].float()
        return torch.cat([nope, rope], dim=-1)

    def index_key_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized indexer keys at ``slots``: fp32 [N, index_head_dim]."""
        keys = self.index_k.view(-1, self.index_k.shape[-1])[slots].float()
        return keys * self.index_scale.view(-1)[slots].unsqueeze(-1)


@dataclass(frozen=True)
class DSABatch:
    """Where a step's new tokens go and what each one may see; made by ``append_tokens``.

    Tokens are flattened sequence by sequence (sequence ``b`` owns rows
    ``query_starts[b]:query_starts[b + 1]``); N new tokens, B sequences.

    slots: int64 [N], cache slot of each new token.
    positions: int64 [N], absolute position of each new token in its sequence.
    token_seq: int32 [N], batch index (0..B-1) of each token's sequence.
    query_starts: int64 [B + 1], cumulative new-token counts.
    block_table: int32 [B, max_pages], page ids, -1 past a sequence's last page.
    seq_lens: int32 [B], tokens cached per sequence after this step.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    token_seq: torch.Tensor
    query_starts: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class PagedDSACache:
    """Paged MLA latent + indexer key caches for ``num_layers`` layers, 64 tokens a page.

    Memory per page and layer: 64 x (latent bytes + indexer bytes), see the module docstring;
    ``bytes_per_token`` gives the per-token, per-layer total.
    """

    def __init__(self, *, num_pages: int, num_layers: int, kv_lora_rank: int, rope_dim: int,
                 index_head_dim: int, latent_format: str = "bf16", latent_scale_group: int = 128,
                 device: torch.device | str = "cpu"):
        if num_pages <= 0 or num_layers <= 0:
            raise ValueError(f"num_pages ({num_pages}) and num_layers ({num_layers}) must be positive")
        if latent_format not in ("bf16", "fp8"):
            raise ValueError(f"latent_format must be 'bf16' or 'fp8', got {latent_format!r}")
        if latent_format == "fp8" and kv_lora_rank % latent_scale_group:
            raise ValueError(f"kv_lora_rank {kv_lora_rank} is not a multiple of latent_scale_group "
                             f"{latent_scale_group}")
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.index_head_dim = index_head_dim
        self.latent_format = latent_format
        self.device = torch.device(device)
        shape = (num_layers, num_pages, PAGE_SIZE)
        fp8 = latent_format == "fp8"
        self.latent_nope = torch.empty(*shape, kv_lora_rank, dtype=FP8_DTYPE if fp8 else torch.bfloat16,
                                       device=self.device)
        self.latent_scale = (torch.empty(*shape, kv_lora_rank // latent_scale_group, dtype=torch.float32,
                                         device=self.device) if fp8 else None)
        self.latent_rope = torch.empty(*shape, rope_dim, dtype=torch.bfloat16, device=self.device)
        self.index_k = torch.empty(*shape, index_head_dim, dtype=FP8_DTYPE, device=self.device)
        self.index_scale = torch.empty(*shape, dtype=torch.float32, device=self.device)
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_seq_id = 0

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token and layer (latent + indexer)."""
        per = self.latent_nope.element_size() * self.kv_lora_rank + 2 * self.rope_dim
        if self.latent_scale is not None:
            per += 4 * self.latent_scale.shape[-1]
        return per + self.index_head_dim + 4

    @property
    def free_page_count(self) -> int:
        return len(self._free_pages)

    def layer(self, index: int) -> DSALayerCache:
        """The cache tensors of layer ``index``."""
        return DSALayerCache(
            latent_nope=self.latent_nope[index],
            latent_scale=None if self.latent_scale is None else self.latent_scale[index],
            latent_rope=self.latent_rope[index],
            index_k=self.index_k[index],
            index_scale=self.index_scale[index],
        )

    def add_sequence(self) -> int:
        """Register an empty sequence; returns its id."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._pages[seq_id] = []
        self._lens[seq_id] = 0
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        """Return the pages of ``seq_id`` to the pool and forget the sequence."""
        self._check_seq(seq_id)
        self._free_pages.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    def seq_len(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self._lens[seq_id]

    def pages_of(self, seq_id: int) -> list[int]:
        self._check_seq(seq_id)
        return list(self._pages[seq_id])

    def append_tokens(self, seq_ids: Sequence[int], new_tokens: Sequence[int]) -> DSABatch:
        """Reserve cache slots for ``new_tokens[i]`` more tokens of sequence ``seq_ids[i]``.

        All-or-nothing: when the free pages cannot hold every sequence's new tokens,
        ``OutOfPagesError`` is raised and no page or length changes. Prefill passes the
        prompt length, decode passes 1 per sequence.
        """
        if len(seq_ids) != len(new_tokens):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(new_tokens)} token counts")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {list(seq_ids)}")
        needed = []
        for seq_id, count in zip(seq_ids, new_tokens, strict=True):
            self._check_seq(seq_id)
            if count < 0:
                raise ValueError(f"sequence {seq_id}: negative token count {count}")
            total_pages = -(-(self._lens[seq_id] + count) // PAGE_SIZE)
            needed.append(total_pages - len(self._pages[seq_id]))
        if sum(needed) > len(self._free_pages):
            raise OutOfPagesError(
                f"KV cache full: this step needs {sum(needed)} new pages of {PAGE_SIZE} tokens but only "
                f"{len(self._free_pages)} of {self.num_pages} are free; finish or free sequences, or build "
                f"the cache with more pages")
        slots, positions, token_seq, starts = [], [], [], [0]
        for b, (seq_id, count, extra) in enumerate(zip(seq_ids, new_tokens, needed, strict=True)):
            pages = self._pages[seq_id]
            pages.extend(self._free_pages.pop() for _ in range(extra))
            start = self._lens[seq_id]
            pos = torch.arange(start, start + count, dtype=torch.int64)
            page_ids = torch.tensor(pages, dtype=torch.int64)
            slots.append(page_ids[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE if count else pos)
            positions.append(pos)
            token_seq.append(torch.full((count,), b, dtype=torch.int32))
            starts.append(starts[-1] + count)
            self._lens[seq_id] = start + count
        return DSABatch(
            slots=torch.cat(slots).to(self.device),
            positions=torch.cat(positions).to(self.device),
            token_seq=torch.cat(token_seq).to(self.device),
            query_starts=torch.tensor(starts, dtype=torch.int64, device=self.device),
            block_table=self.block_table(seq_ids),
            seq_lens=torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32, device=self.device),
        )

    def block_table(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """int32 [B, max_pages] page ids of ``seq_ids``; -1 past each sequence's last page."""
        width = max([len(self._pages[s]) for s in seq_ids] + [1])
        table = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, seq_id in enumerate(seq_ids):
            self._check_seq(seq_id)
            pages = self._pages[seq_id]
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(self.device)

    def _check_seq(self, seq_id: int) -> None:
        if seq_id not in self._pages:
            raise KeyError(f"unknown or freed sequence id {seq_id}")
