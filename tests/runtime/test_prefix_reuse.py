"""Prefix reuse in the paged cache (vLLM-style): full blocks keyed by their tokens and their prefix,
shared by reference count, kept after their sequence ends until a page is needed, and the same
logits whether a prompt's prefix is computed or reused."""

import pytest
import torch

from adapt.kernels.formats import PAGE_SIZE
from adapt.model.tiny import tiny_path
from adapt.runtime.engine import Engine
from adapt.runtime.kv_cache import OutOfPagesError, PagedKVCache, block_hash

LAYOUT = {0: {"k": ((1,), torch.float32)}}


def _prompt(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_block_keys_depend_on_the_whole_prefix():
    a, b = _prompt(64, 1), _prompt(64, 2)
    assert block_hash(block_hash(b"", a), b) != block_hash(block_hash(b"", b), b)
    assert block_hash(b"", a) == block_hash(b"", list(a))


def test_full_blocks_are_shared_by_reference_count():
    cache = PagedKVCache(8, LAYOUT)
    prompt = _prompt(150)
    first = cache.add_sequence()
    cache.append_tokens([first], [150], [prompt])          # 3 pages, blocks 0 and 1 full
    assert cache.cached_blocks == 2 and cache.free_pages == 5
    second = cache.add_sequence()
    assert cache.reuse_prefix(second, prompt) == 2 * PAGE_SIZE
    assert cache._pages[second] == cache._pages[first][:2]  # the same pages, not copies
    assert cache.free_pages == 5                            # sharing took no page
    batch = cache.append_tokens([second], [150 - 128], [prompt[128:]])
    assert batch.positions.tolist() == list(range(128, 150))
    assert set(batch.slots.tolist()).isdisjoint(range(cache._pages[first][0] * 64, cache._pages[first][0] * 64 + 64))
    cache.free_sequence(first)
    assert cache.free_pages == 5                            # its third page back; the shared two still used
    cache.free_sequence(second)
    assert cache.free_pages == 8 and cache.cached_blocks == 2  # freed but kept for reuse
    third = cache.add_sequence()
    assert cache.reuse_prefix(third, prompt[:100]) == PAGE_SIZE  # one full block of this shorter prompt
    other = cache.add_sequence()
    assert cache.reuse_prefix(other, _prompt(150, 9)) == 0


def test_the_last_prompt_token_is_always_computed():
    cache = PagedKVCache(4, LAYOUT)
    prompt = _prompt(128)
    seq = cache.add_sequence()
    cache.append_tokens([seq], [128], [prompt])
    cache.free_sequence(seq)
    again = cache.add_sequence()
    assert cache.reuse_prefix(again, prompt) == PAGE_SIZE   # not 128: the last token needs logits


def test_cached_blocks_are_evicted_oldest_first_when_pages_run_out():
    cache = PagedKVCache(4, LAYOUT)
    old, new = _prompt(128, 3), _prompt(128, 4)
    for prompt in (old, new):
        seq = cache.add_sequence()
        cache.append_tokens([seq], [128], [prompt])
        cache.free_sequence(seq)
    assert cache.cached_blocks == 4 and cache.free_pages == 4
    seq = cache.add_sequence()
    cache.append_tokens([seq], [64], [_prompt(64, 5)])      # needs one page: the oldest cached block goes
    assert cache.cached_blocks == 4                         # one evicted, the new full block registered
    # a sequence's blocks are freed tail first (as vLLM does), so old's last block went, its first stays
    probe = cache.add_sequence()
    assert cache.reuse_prefix(probe, old + [1]) == PAGE_SIZE
    cache.free_sequence(probe)
    probe = cache.add_sequence()
    assert cache.reuse_prefix(probe, new + [1]) == 128
    with pytest.raises(OutOfPagesError):
        cache.append_tokens([probe], [3 * PAGE_SIZE], [_prompt(3 * PAGE_SIZE, 6)])


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-dsa"])
def test_a_reused_prefix_gives_the_same_logits_and_tokens(name):
    engine = Engine.load(tiny_path(name), dtype=torch.float32, max_tokens=1024)
    prompt = _prompt(150, 7)
    fresh = engine.generate([prompt], 6, stop_ids=(), reuse_prefix=False)
    seq = engine.start(1)
    computed = engine.step(seq, [prompt], all_logits=True)[0][128:]
    engine.release(seq)
    assert engine.cache.cached_blocks >= 2
    ids, cached = engine.start_with_prefixes([prompt])
    assert cached == [128]
    reused = engine.step(ids, [prompt[128:]], all_logits=True)[0]
    engine.release(ids)
    assert float((reused - computed).norm() / computed.norm()) < 1e-5
    again = engine.generate([prompt], 6, stop_ids=())
    assert again.timing.prefill_tokens == 150 - 128 and again.tokens == fresh.tokens
