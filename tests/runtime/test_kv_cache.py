"""The paged cache with MLA + DSA layouts: page geometry, allocation, out-of-pages errors, writes and reads."""

import pytest
import torch

from adapt.kernels.formats import PAGE_SIZE
from adapt.kernels.fp8 import quantize_fp8_groups
from adapt.runtime.kv_cache import OutOfPagesError, PagedKVCache, layout_bytes_per_token, mla_layout


def make_cache(num_pages=6, latent_format="bf16", device="cpu"):
    layout = mla_layout(32, 16, 32, latent_format=latent_format, latent_scale_group=16)
    return PagedKVCache(num_pages, {0: layout, 1: layout}, device)


def test_pages_follow_64_token_boundaries():
    cache = make_cache()
    a, b = cache.add_sequence(), cache.add_sequence()
    batch = cache.append_tokens([a, b], [PAGE_SIZE, PAGE_SIZE + 1])
    assert len(cache.pages_of(a)) == 1 and len(cache.pages_of(b)) == 2
    assert batch.block_table.shape == (2, 2)
    assert batch.block_table[0, 1].item() == -1
    assert batch.seq_lens.tolist() == [PAGE_SIZE, PAGE_SIZE + 1]
    assert batch.positions[-1].item() == PAGE_SIZE and batch.token_seq.tolist().count(1) == PAGE_SIZE + 1
    page_b = cache.pages_of(b)
    assert batch.slots[-1].item() == page_b[1] * PAGE_SIZE
    assert batch.slots[PAGE_SIZE].item() == page_b[0] * PAGE_SIZE
    decode = cache.append_tokens([a, b], [1, 1])
    assert len(cache.pages_of(a)) == 2 and len(cache.pages_of(b)) == 2
    assert decode.positions.tolist() == [PAGE_SIZE, PAGE_SIZE + 1]
    assert decode.slots.tolist() == [cache.pages_of(a)[1] * PAGE_SIZE, page_b[1] * PAGE_SIZE + 1]
    assert decode.query_starts.tolist() == [0, 1, 2]


def test_out_of_pages_is_an_error_and_changes_nothing():
    cache = make_cache(num_pages=3)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append_tokens([a], [2 * PAGE_SIZE])
    with pytest.raises(OutOfPagesError, match="needs 2 new pages .* only 1 of 3 are free"):
        cache.append_tokens([a, b], [1, PAGE_SIZE])
    assert cache.seq_len(a) == 2 * PAGE_SIZE and cache.seq_len(b) == 0
    assert cache.free_pages == 1 and cache.pages_of(b) == []


def test_freed_pages_are_reused_and_unknown_sequences_refused():
    cache = make_cache(num_pages=2)
    a = cache.add_sequence()
    cache.append_tokens([a], [2 * PAGE_SIZE])
    pages = set(cache.pages_of(a))
    cache.free_sequence(a)
    assert cache.free_pages == 2
    b = cache.add_sequence()
    cache.append_tokens([b], [2 * PAGE_SIZE])
    assert set(cache.pages_of(b)) == pages
    with pytest.raises(KeyError, match="unknown or freed"):
        cache.append_tokens([a], [1])


@pytest.mark.parametrize("latent_format", ["bf16", "fp8"])
def test_write_then_read_back(latent_format):
    cache = make_cache(latent_format=latent_format)
    a, b = cache.add_sequence(), cache.add_sequence()
    batch = cache.append_tokens([a, b], [5, 70])
    layer = cache.dsa_layer(1)
    n = batch.num_tokens
    latent, rope = torch.randn(n, 32), torch.randn(n, 16)
    keys, key_scale = quantize_fp8_groups(torch.randn(n, 32), 32)
    layer.write(batch.slots, latent, rope, keys, key_scale[:, 0])
    rows = layer.latent_rows(batch.slots)
    tol = 0.07 if latent_format == "fp8" else 0.01
    assert (rows[:, :32] - latent).norm() / latent.norm() < tol
    assert (rows[:, 32:] - rope).norm() / rope.norm() < 0.01
    back = layer.index_key_rows(batch.slots)
    assert torch.equal(back, keys.float() * key_scale)
    assert cache.dsa_layer(0).index_scale.view(-1)[batch.slots].ne(key_scale[:, 0]).any()


def test_bytes_per_token_match_deepseek_v32_formats():
    assert layout_bytes_per_token(mla_layout(512, 64, 128, latent_format="fp8")) == 656 + 132
    assert layout_bytes_per_token(mla_layout(512, 64, 128)) == 1152 + 132


def test_quantize_fp8_groups_bounds_error():
    x = torch.randn(7, 64) * torch.logspace(-3, 3, 7)[:, None]
    values, scales = quantize_fp8_groups(x, 16)
    back = (values.float().view(7, 4, 16) * scales.unsqueeze(-1)).view(7, 64)
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scales.repeat_interleave(16, 1) * 2 ** -9).all()


def test_engine_fp8_latent_cache_is_smaller_and_tracks_the_exact_one():
    from adapt.model.tiny import tiny_path
    from adapt.runtime.engine import Engine
    from adapt.runtime.model import compare_captures

    prompt = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for fp8 in (False, True):
        engine = Engine.load(tiny_path("tiny-dsa"), dtype=torch.float32, max_tokens=256, latent_fp8=fp8)
        pools = engine.cache.pools[0]
        assert ("latent_scale" in pools) == fp8 and (pools["latent_nope"].dtype == torch.float8_e4m3fn) == fp8
        with engine.capture(hidden_states=True, router=True) as cap:
            engine.step(engine.start(1), [prompt])
        runs[fp8] = (engine.cache.nbytes, cap)
    (exact_bytes, exact), (fp8_bytes, approx) = runs[False], runs[True]
    assert fp8_bytes < exact_bytes
    first = compare_captures(exact, approx).layer_error[0]
    assert 0 < first < 0.03  # e4m3 latent (3 mantissa bits): about 1% at the first layer, never exact
