"""The DSA block against transformers' DeepseekV32Attention at tiny sizes.

Selected sets: the FP8 indexer must pick the transformers (fp32) indexer's set, except
positions whose fp32 scores lie within FP8 rounding of the k-th score (ties and near-ties).
Outputs: with the selected sets fixed to ours (transformers' indexer patched to return them),
attention outputs agree within bf16 tolerance, so MLA, RoPE, masks and the absorbed form
are checked apart from FP8 selection noise.
"""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

hf = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers import DeepseekV32Config  # noqa: E402

from adapt.runtime.dsa_attention import DSAAttention, DSAConfig, DSAWeights, _rope_half  # noqa: E402
from adapt.runtime.kv_cache import PagedDSACache  # noqa: E402

TOPK = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BACKENDS = ["torch", "triton"]
LENGTHS = (12, 64, 65)  # shorter than top-k, ending on a page boundary, one past it


def tiny_config():
    return DeepseekV32Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=TOPK, index_head_dim=32, index_n_heads=4,
        first_k_dense_replace=1, max_position_embeddings=512)


@pytest.fixture(scope="module")
def hf_layer():
    torch.manual_seed(0)
    config = tiny_config()
    config._attn_implementation = "eager"
    attn = hf.DeepseekV32Attention(config, 0).eval()
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    hidden = [torch.randn(n, 64) for n in LENGTHS]
    return config, attn, hf.DeepseekV32RotaryEmbedding(config), hidden


def hf_forward(config, attn, rotary, x, indices=None):
    """transformers' attention over one sequence [T, hidden]; returns (output, its top-k indices).
    With ``indices`` ([T, TOPK], -1 = none) the indexer's choice is replaced by them."""
    t = x.shape[0]
    pe = rotary(x[None], torch.arange(t)[None])
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
    captured = {}

    def keep_indices(module, inputs, output):
        captured["idx"] = output[0]

    handle = attn.indexer.register_forward_hook(keep_indices)
    saved = attn.indexer.forward
    if indices is not None:
        own = torch.arange(t)[:, None].expand_as(indices)
        fixed = torch.where(indices < 0, own, indices.long()).int()[None]
        attn.indexer.forward = lambda *args, **kwargs: fixed
    try:
        with torch.no_grad():
            out, _ = attn(x[None], pe, mask)
    finally:
        attn.indexer.forward = saved
        handle.remove()
    return out[0], captured["idx"]


def hf_index_scores(attn, rotary, x):
    """fp32 indexer scores [T, T] computed with transformers' modules (-inf above the diagonal)."""
    t = x.shape[0]
    cos, sin = rotary(x[None], torch.arange(t)[None])
    cos, sin = cos[0, :, :8], sin[0, :, :8]
    ix = attn.indexer
    with torch.no_grad():
        q = ix.wq_b(attn.q_a_layernorm(attn.q_a_proj(x))).view(t, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(x))
        q = torch.cat([_rope_half(q[..., :16], cos, sin), q[..., 16:]], -1)
        k = torch.cat([_rope_half(k[..., :16], cos, sin), k[..., 16:]], -1)
        logits = torch.einsum("thd,sd->ths", q, k) * ix.softmax_scale
        weights = ix.weights_proj(x) * ix.n_heads ** -0.5
        scores = (logits.relu() * weights[..., None]).sum(1)
    return scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))


def check_selection(ours, theirs, scores):
    """Same sets except near-ties at the k-th score (within FP8 rounding, 3% of the row's range)."""
    swapped = 0
    for row in range(scores.shape[0]):
        visible = row + 1
        mine = set(ours[row].tolist()) - {-1}
        ref = {i for i in theirs[row].tolist() if i < visible}
        assert len(mine) == min(TOPK, visible) == len(ref)
        assert int((ours[row] == -1).sum()) == max(0, TOPK - visible)
        if mine != ref:
            kth = scores[row].topk(min(TOPK, visible)).values[-1]
            band = 0.03 * scores[row, :visible].abs().max()
            for pos in mine ^ ref:
                assert abs(scores[row, pos] - kth) <= band, f"row {row}: position {pos} is not a near-tie"
            swapped += len(mine - ref)
    assert swapped <= 0.05 * sum(min(TOPK, r + 1) for r in range(scores.shape[0]))


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def our_layer(config, attn, backend, device):
    cfg = DSAConfig.from_hf(config)
    state = {k: v.to(device) for k, v in attn.state_dict().items()}
    return DSAAttention(cfg, DSAWeights.from_state_dict(state, cfg), backend=backend)


def new_cache(device, num_pages=8):
    return PagedDSACache(num_pages=num_pages, num_layers=1, kv_lora_rank=32, rope_dim=16, index_head_dim=32,
                         device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_prefill_matches_transformers(hf_layer, backend, device):
    config, attn, rotary, hidden = hf_layer
    layer = our_layer(config, attn, backend, device)
    cache = new_cache(device)
    seqs = [cache.add_sequence() for _ in LENGTHS]
    batch = cache.append_tokens(seqs, list(LENGTHS))
    out, details = layer.forward_with_details(torch.cat(hidden).to(device), batch, cache.layer(0))
    assert details.index_stats.peak_score_bytes <= layer.max_score_bytes
    for b, x in enumerate(hidden):
        rows = slice(int(batch.query_starts[b]), int(batch.query_starts[b + 1]))
        ours = details.indices[rows].cpu()
        _, their_indices = hf_forward(config, attn, rotary, x)
        check_selection(ours, their_indices, hf_index_scores(attn, rotary, x))
        want, _ = hf_forward(config, attn, rotary, x, indices=ours)
        assert rel(out[rows], want) < 1e-2, f"sequence of {x.shape[0]} tokens"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_after_prefill_equals_longer_prefill(hf_layer, backend, device):
    config, attn, rotary, hidden = hf_layer
    x = hidden[2].to(device)
    layer = our_layer(config, attn, backend, device)
    cache = new_cache(device)
    seq = cache.add_sequence()
    layer.forward(x[:-1], cache.append_tokens([seq], [x.shape[0] - 1]), cache.layer(0))
    step, details = layer.forward_with_details(x[-1:], cache.append_tokens([seq], [1]), cache.layer(0))
    whole_cache = new_cache(device)
    whole_seq = whole_cache.add_sequence()
    whole, whole_details = layer.forward_with_details(
        x, whole_cache.append_tokens([whole_seq], [x.shape[0]]), whole_cache.layer(0))
    assert set(details.indices[0].tolist()) == set(whole_details.indices[-1].tolist())
    assert rel(step[0], whole[-1]) < 1e-3
    want, _ = hf_forward(config, attn, rotary, x.cpu(), indices=whole_details.indices.cpu())
    assert rel(step[0], want[-1]) < 1e-2


def test_yarn_frequencies_and_scale_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0}
    config = tiny_config()
    config.rope_parameters = rope
    config.max_position_embeddings = 163840
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = DSAConfig.from_hf(config)
    freq, factor = ours.rope_frequencies()
    torch.testing.assert_close(freq, want_freq)
    assert factor == pytest.approx(want_factor)
    assert ours.softmax_scale == pytest.approx(hf.yarn_apply_mscale(rope, 32 ** -0.5))
