"""The runtime's one paged cache (``PagedKVCache``) and the layouts its layers use.

One page geometry (64 tokens a page) and one block table per sequence for every layer
(slot addressing: ``adapt.kernels.formats``). Each layer names its pools: GQA layers 'k' and 'v';
MLA (+ DSA) layers the ``mla_layout`` pools, per token and layer

- MLA latent, ``latent_format="bf16"``: ``kv_lora_rank`` + ``rope_dim`` bf16 values
  (DeepSeek-V3.2: 512 + 64 -> 1152 B);
- MLA latent, ``latent_format="fp8"``: ``kv_lora_rank`` e4m3 values, one fp32 scale per
  ``latent_scale_group`` of them, and ``rope_dim`` bf16 values (DeepSeek-V3.2 with groups of
  128: 512 + 16 + 128 = 656 B, the size of FlashMLA's fp8 decode format);
- indexer keys: ``index_head_dim`` e4m3 values and one fp32 scale (DeepSeek-V3.2: 132 B).

Pages are handed out by one allocator for all layers: ``append_tokens`` reserves the pages
that the new tokens need for every sequence of the step before anything is written, and
raises ``OutOfPagesError`` when the free pages cannot cover them, so a full cache never
overwrites a page that another sequence owns. Full blocks are reused across sequences by
their tokens (prefix reuse, see ``PagedKVCache``).
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from adapt.kernels.formats import FP8_DTYPE, PAGE_SIZE, slots_of
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
    """One MLA + DSA layer's cache tensors (views of its ``mla_layout`` pools in ``PagedKVCache``).

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

    @classmethod
    def of(cls, pools: dict[str, torch.Tensor]) -> DSALayerCache:
        """The view of one layer's pools laid out by ``mla_layout`` (``PagedKVCache.pools[layer]``)."""
        return cls(pools["latent_nope"], pools.get("latent_scale"), pools["latent_rope"], pools["index_k"],
                   pools["index_scale"])

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


PoolLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""A layer's cache pools: name -> (per-token shape, dtype); each pool is [pages, 64, *shape]."""


def mla_layout(kv_lora_rank: int, rope_dim: int, index_head_dim: int = 0, *, latent_format: str = "bf16",
               latent_scale_group: int = 128, latent_dtype: torch.dtype = torch.bfloat16,
               index_fp8: bool = True) -> PoolLayout:
    """One MLA (+ DSA indexer) layer's pools: 'latent_nope' [rank] (``latent_dtype``, or e4m3 with
    'latent_scale' fp32 [rank / group] when ``latent_format`` is "fp8"), 'latent_rope' [rope]
    (``latent_dtype``), and with an indexer 'index_k' [Di] (e4m3 with 'index_scale' fp32 [] when
    ``index_fp8``, else ``latent_dtype``). DeepSeek-V3.2 per token and layer: bf16 1152 + 132 B,
    fp8 656 + 132 B (``layout_bytes_per_token``)."""
    if latent_format not in ("bf16", "fp8"):
        raise ValueError(f"latent_format must be 'bf16' or 'fp8', got {latent_format!r}")
    if latent_format == "fp8" and kv_lora_rank % latent_scale_group:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} is not a multiple of latent_scale_group {latent_scale_group}")
    fp8 = latent_format == "fp8"
    layout: PoolLayout = {"latent_nope": ((kv_lora_rank,), FP8_DTYPE if fp8 else latent_dtype),
                          "latent_rope": ((rope_dim,), latent_dtype)}
    if fp8:
        layout["latent_scale"] = ((kv_lora_rank // latent_scale_group,), torch.float32)
    if index_head_dim:
        layout["index_k"] = ((index_head_dim,), FP8_DTYPE if index_fp8 else latent_dtype)
        if index_fp8:
            layout["index_scale"] = ((), torch.float32)
    return layout


def layout_bytes_per_token(layout: PoolLayout) -> int:
    """Cache bytes one token takes in a layer with this layout."""
    total = 0
    for shape, dtype in layout.values():
        total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return total


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of one full block of 64 tokens: sha256 of its parent's key and its token ids, so a
    block matches only when every earlier token matches too (vLLM's prefix-caching key)."""
    digest = hashlib.sha256(parent)
    digest.update(b",".join(str(int(t)).encode() for t in tokens))
    return digest.digest()


class PagedKVCache:
    """Pages of 64 tokens for every layer, handed out by one allocator, with prefix reuse.

    layouts: layer index -> {pool name: (per-token shape, dtype)}; pools are [pages, 64, *shape].
    ``append_tokens`` reserves pages for a whole step or raises ``OutOfPagesError`` before
    changing anything; ``free_sequence`` returns a sequence's pages.

    Prefix reuse (as vLLM's automatic prefix caching): when the token ids are given, every block
    that becomes full is keyed by ``block_hash`` (its tokens and its prefix's key). ``reuse_prefix``
    attaches a new sequence to the cached full blocks of its prompt (reference counted, never
    written again: new tokens always go to later pages). Blocks of freed sequences stay cached
    until their page is needed: the least recently freed cached block is evicted first.
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
        self._free = list(range(num_pages - 1, -1, -1))  # pages holding nothing
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, oldest first
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # page -> key of the full block it holds
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._tokens: dict[int, list[int] | None] = {}  # token ids so far, None once unknown
        self._keys: dict[int, list[bytes]] = {}  # keys of the sequence's full blocks, in order
        self._next_id = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pools in self.pools.values() for t in pools.values())

    @property
    def free_pages(self) -> int:
        """Pages a step can take: empty ones plus cached blocks no sequence uses."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self._page_of)

    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._pages[seq_id], self._lens[seq_id], self._tokens[seq_id], self._keys[seq_id] = [], 0, [], []
        return seq_id

    def _check_seq(self, seq_id: int) -> None:
        if seq_id not in self._lens:
            raise KeyError(f"sequence {seq_id} is unknown or freed")

    def pages_of(self, seq_id: int) -> list[int]:
        self._check_seq(seq_id)
        return list(self._pages[seq_id])

    def dsa_layer(self, index: int) -> DSALayerCache:
        """The typed view of layer ``index``'s pools (laid out by ``mla_layout``)."""
        return DSALayerCache.of(self.pools[index])

    def reuse_prefix(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Attach an empty sequence to the cached full blocks that start ``prompt``; returns how many
        tokens are already cached (a multiple of 64, at most len(prompt) - 1 so that the last prompt
        token is always computed and gives logits)."""
        if self._lens[seq_id]:
            raise ValueError(f"sequence {seq_id} already holds tokens")
        keys, pages = [], []
        for start in range(0, len(prompt) - 1 - (len(prompt) - 1) % PAGE_SIZE, PAGE_SIZE):
            key = block_hash(keys[-1] if keys else b"", prompt[start:start + PAGE_SIZE])
            page = self._page_of.get(key)
            if page is None:
                break
            keys.append(key)
            pages.append(page)
        for page in pages:
            self._evictable.pop(page, None)
            self._refs[page] += 1
        self._pages[seq_id] = pages
        self._lens[seq_id] = len(pages) * PAGE_SIZE
        self._tokens[seq_id] = list(prompt[: self._lens[seq_id]])
        self._keys[seq_id] = keys
        return self._lens[seq_id]

    def free_sequence(self, seq_id: int) -> None:
        self._check_seq(seq_id)
        for page in reversed(self._pages.pop(seq_id)):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        del self._lens[seq_id], self._tokens[seq_id], self._keys[seq_id]

    def seq_len(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self._lens[seq_id]

    def _take_page(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self._refs[page] = 1
        return page

    def _register_full_blocks(self, seq_id: int) -> None:
        """Key the sequence's blocks that became full; a key seen for the first time points to its page."""
        tokens, keys, pages = self._tokens[seq_id], self._keys[seq_id], self._pages[seq_id]
        for block in range(len(keys), len(tokens) // PAGE_SIZE):
            key = block_hash(keys[-1] if keys else b"", tokens[block * PAGE_SIZE:(block + 1) * PAGE_SIZE])
            keys.append(key)
            if key not in self._page_of and pages[block] not in self._key_of:
                self._page_of[key], self._key_of[pages[block]] = pages[block], key

    def append_tokens(self, seq_ids: Sequence[int], counts: Sequence[int],
                      tokens: Sequence[Sequence[int]] | None = None) -> DSABatch:
        """Reserve slots for ``counts[i]`` new tokens of ``seq_ids[i]``; returns the step's batch.
        ``tokens``: the new token ids per sequence (their full blocks become reusable); without
        them the sequence's later blocks are not cached."""
        if len(seq_ids) != len(counts):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(counts)} token counts")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {list(seq_ids)}")
        for seq_id, count in zip(seq_ids, counts, strict=True):
            self._check_seq(seq_id)
            if count < 0:
                raise ValueError(f"sequence {seq_id}: negative token count {count}")
        needed = [
            -(-(self._lens[s] + c) // PAGE_SIZE) - len(self._pages[s])
            for s, c in zip(seq_ids, counts, strict=True)
        ]
        if sum(needed) > self.free_pages:
            raise OutOfPagesError(
                f"KV cache full: this step needs {sum(needed)} new pages of {PAGE_SIZE} tokens but only "
                f"{self.free_pages} of {self.num_pages} are free; finish or free sequences, or build "
                f"the cache with more pages")
        slots, positions, token_seq, starts = [], [], [], [0]
        for b, (seq_id, count, extra) in enumerate(zip(seq_ids, counts, needed, strict=True)):
            pages = self._pages[seq_id]
            pages.extend(self._take_page() for _ in range(extra))
            start = self._lens[seq_id]
            pos = torch.arange(start, start + count, dtype=torch.int64)
            slots.append(slots_of(torch.tensor(pages, dtype=torch.int64), pos))
            positions.append(pos)
            token_seq.append(torch.full((count,), b, dtype=torch.int32))
            starts.append(starts[-1] + count)
            self._lens[seq_id] = start + count
            known = self._tokens[seq_id]
            if tokens is None or known is None:
                self._tokens[seq_id] = None
            else:
                known.extend(int(t) for t in tokens[b])
                self._register_full_blocks(seq_id)
        width = max(len(self._pages[s]) for s in seq_ids)
        block_table = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, seq_id in enumerate(seq_ids):
            block_table[row, : len(self._pages[seq_id])] = torch.tensor(self._pages[seq_id], dtype=torch.int32)
        dev = self.device
        return DSABatch(
            slots=torch.cat(slots).to(dev),
            positions=torch.cat(positions).to(dev),
            token_seq=torch.cat(token_seq).to(dev),
            query_starts=torch.tensor(starts, dtype=torch.int64, device=dev),
            block_table=block_table.to(dev),
            seq_lens=torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32, device=dev),
        )
