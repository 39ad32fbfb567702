"""The runtime's kernel paths: each Triton kernel against its torch twin, then each op family in the
engine against the torch reference path (CPU: Triton interpreter; GPU variants marked ``gpu``)."""

import pytest
import torch

from adapt.kernels.attention import paged_gqa_attention, paged_gqa_attention_torch
from adapt.kernels.norm_rope import rms_norm, rms_norm_torch, rope, rope_torch
from adapt.model.tiny import tiny_path
from adapt.runtime.attention import GQAAttention, GQAWeights, write_rows
from adapt.runtime.engine import Engine
from adapt.runtime.kv_cache import PagedKVCache
from adapt.runtime.model import compare_captures
from adapt.runtime.weights import Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _filled_cache(lengths, heads, kv_heads, dim, dtype, seed=0):
    """A paged cache holding random k/v for sequences of ``lengths``, and queries for the last
    ``min(len, 5)`` tokens of each (a mixed prefill/decode step)."""
    gen = torch.Generator().manual_seed(seed)
    layout = {"k": ((kv_heads, dim), dtype), "v": ((kv_heads, dim), dtype)}
    cache = PagedKVCache(16, {0: layout}, DEVICE)
    seqs = [cache.add_sequence() for _ in lengths]
    history = [n - min(n, 5) for n in lengths]
    if any(history):
        batch = cache.append_tokens(
            [s for s, h in zip(seqs, history, strict=True) if h], [h for h in history if h]
        )
        rows = batch.num_tokens
        write_rows(
            cache.pools[0]["k"], batch.slots, torch.randn(rows, kv_heads, dim, generator=gen).to(DEVICE)
        )
        write_rows(
            cache.pools[0]["v"], batch.slots, torch.randn(rows, kv_heads, dim, generator=gen).to(DEVICE)
        )
    batch = cache.append_tokens(seqs, [n - h for n, h in zip(lengths, history, strict=True)])
    rows = batch.num_tokens
    write_rows(cache.pools[0]["k"], batch.slots, torch.randn(rows, kv_heads, dim, generator=gen).to(DEVICE))
    write_rows(cache.pools[0]["v"], batch.slots, torch.randn(rows, kv_heads, dim, generator=gen).to(DEVICE))
    q = torch.randn(rows, heads, dim, generator=gen).to(DEVICE, dtype)
    return cache, batch, q


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("window,sinks", [(None, False), (16, True), (7, False), (None, True)])
def test_paged_gqa_kernel_matches_torch_twin(heads, kv_heads, window, sinks):
    cache, batch, q = _filled_cache([70, 3, 33], heads, kv_heads, 32, torch.float32)
    sink = torch.randn(heads, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 2 if sinks else None
    unused = Linear(torch.zeros(1, 1))
    layer = GQAAttention(
        GQAWeights(unused, unused, unused, unused, sinks=sink),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=32,
        norm_eps=1e-6,
        window=window,
    )
    args = (cache.pools[0]["k"], cache.pools[0]["v"], batch.block_table, batch.token_seq, batch.positions,
            batch.query_starts, layer.scale, window, sink)
    ref = paged_gqa_attention_torch(q, *args)
    out = paged_gqa_attention(q, *args)
    assert _rel(out, ref) < 1e-5


def test_paged_gqa_kernel_in_bf16_stays_within_bf16_tolerance():
    cache, batch, q = _filled_cache([66, 12], 8, 2, 64, torch.bfloat16)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    unused = Linear(torch.zeros(1, 1))
    layer = GQAAttention(
        GQAWeights(unused, unused, unused, unused, sinks=sink),
        heads=8,
        kv_heads=2,
        head_dim=64,
        norm_eps=1e-6,
        window=16,
    )
    tables = (batch.block_table, batch.token_seq, batch.positions, batch.query_starts, layer.scale, 16, sink)
    ref = paged_gqa_attention_torch(q.float(), cache.pools[0]["k"].float(), cache.pools[0]["v"].float(), *tables)
    out = paged_gqa_attention(q, cache.pools[0]["k"], cache.pools[0]["v"], *tables)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_in_fp32", [False, True])
def test_rms_norm_kernel_matches_torch_twin(dtype, scale_in_fp32):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 96, generator=gen) * 3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE, torch.bfloat16)
    ref = rms_norm_torch(x, w, 1e-6, scale_in_fp32=scale_in_fp32)
    out = rms_norm(x, w, 1e-6, scale_in_fp32=scale_in_fp32)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _rel(out, ref) < 1e-6
    else:  # same rounding order: at most one bf16 ulp apart
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-30).all()


@pytest.mark.parametrize("pairs", [False, True])
def test_rope_kernel_matches_torch_twin(pairs):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 3, 16, generator=gen).to(DEVICE)
    angles = torch.rand(9, 8, generator=gen).to(DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    ref = rope_torch(x, cos, sin, pairs=pairs)
    assert _rel(rope(x, cos, sin, pairs=pairs), ref) < 1e-6


def _run(name, kernels, prompts, tokens, **load):
    """Greedy ``tokens`` per prompt on the torch reference path; then the reference and the ``kernels``
    engine are both fed those tokens (teacher forcing). Returns (reference capture, kernel capture,
    reference tokens, reference Followed, kernel Followed, kernel engine)."""
    reference = Engine.load(tiny_path(name), dtype=torch.float32, device=DEVICE, max_tokens=512)
    ref_tokens = reference.generate(prompts, tokens, stop_ids=()).tokens
    with reference.capture(hidden_states=True, router=True, dsa_indices=True) as ref_cap:
        ref_run = reference.follow(prompts, ref_tokens, keep_logits=True)
    engine = Engine.load(
        tiny_path(name), dtype=torch.float32, kernels=kernels, device=DEVICE, max_tokens=512, **load
    )
    with engine.capture(hidden_states=True, router=True, dsa_indices=True) as ker_cap:
        ker_run = engine.follow(prompts, ref_tokens, keep_logits=True)
    return ref_cap, ker_cap, ref_tokens, ref_run, ker_run, engine


def _median_logit_error(ref_run, ker_run):
    """Median over positions of ||kernel logits - reference logits|| / ||reference logits||."""
    errors = [
        _rel(ker_row, ref_row)
        for ref_logits, ker_logits in zip(ref_run.logits, ker_run.logits, strict=True)
        for ref_row, ker_row in zip(ref_logits, ker_logits, strict=True)
    ]
    return sorted(errors)[len(errors) // 2]


def _prompts(lengths):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def _sequences(ref_cap, lengths):
    """Each captured step's row -> prompt index: the prefill step holds every prompt's rows in order, each decode
    step one row per prompt (what ``follow`` runs here; another layout fails loudly)."""
    first = ref_cap.hidden_states[min(ref_cap.hidden_states)]
    prefill = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    decode = torch.arange(len(lengths))
    out = [prefill] + [decode] * (len(first) - 1)
    assert [len(s) for s in out] == [len(h) for h in first], "unexpected step layout"
    return out


def _layer_errors(ref_cap, ker_cap, tie_tol, max_near_ties=0.1, lengths=None):
    """Per-layer error on rows whose routing and indexer selection agreed (see ``compare_captures``).
    Every routing difference must be a near tie of the reference's gate scores (within ``tie_tol`` of
    the row's largest |score|: the drift this path is allowed reorders those); near ties and rows whose
    DSA selection differs may together take at most ``max_near_ties`` of all rows out of the comparison.
    ``lengths`` (the prompts'): the later rows of a left-out row's sequence, which attend to it, are left out too."""
    sequences = None if lengths is None else _sequences(ref_cap, lengths)
    comparison = compare_captures(ref_cap, ker_cap, tie_tol=tie_tol, sequences=sequences)
    assert not any(comparison.routing_flips.values()), comparison
    rows = sum(len(h) for h in ref_cap.hidden_states[min(ref_cap.hidden_states)])
    left_out = sum(comparison.near_tie_flips.values()) + sum(comparison.dsa_flips.values())
    assert left_out <= max_near_ties * rows, comparison
    return comparison.layer_error


@pytest.mark.parametrize(
    "name,kernels,tolerance",
    [
        ("tiny-oss", "attention,norm_rope", 1e-5),  # fp32 kernels: fp32 tolerance
        ("tiny-qwen3", "attention,norm_rope", 1e-5),
        ("tiny-dsa", "norm_rope", 1e-5),
        ("tiny-dsa", "attention", 2e-2),  # sparse MLA reads the bf16 latent cache: bf16 tolerance
    ],
)
def test_op_family_kernels_track_the_reference(name, kernels, tolerance):
    lengths = (22, 6)
    ref_cap, ker_cap, ref_tokens, ref_run, ker_run, engine = _run(name, kernels, _prompts(lengths), 5)
    assert all(engine.model.paths[f] == "kernel" for f in kernels.split(","))
    assert ref_run.predictions == ref_tokens
    assert max(_layer_errors(ref_cap, ker_cap, tolerance, lengths=lengths).values()) < tolerance
    assert _median_logit_error(ref_run, ker_run) < tolerance
    if tolerance <= 1e-5:
        assert ker_run.predictions == ref_tokens  # fp32 kernels: greedy tokens identical


def test_fp8_indexer_kernel_keeps_most_of_the_reference_selection():
    prompts = _prompts((40,))
    ref_cap, ker_cap, ref_tokens, ref_run, ker_run, _ = _run("tiny-dsa", "indexer", prompts, 3)
    overlaps = []
    for layer, steps in ref_cap.dsa_indices.items():
        for ref, ker in zip(steps, ker_cap.dsa_indices[layer], strict=True):
            for a, b in zip(ref.tolist(), ker.tolist(), strict=True):
                a, b = {i for i in a if i >= 0}, {i for i in b if i >= 0}
                assert len(a) == len(b)
                overlaps.append(len(a & b) / len(a))
    # FP8 q/k scores reorder near-ties at the top-k boundary; the selections stay nearly the same
    assert sum(overlaps) / len(overlaps) > 0.95


@pytest.mark.slow
@pytest.mark.parametrize("workspace", [0, pytest.param(4, marks=pytest.mark.gpu)])  # interpreter: minutes
def test_mxfp4_moe_kernel_tracks_the_reference(workspace):
    # tolerances of one MoE layer from tests/kernels/test_moe.py: bf16 2e-2, fp8 6e-2; deeper layers
    # add the drift of the layers before them; that drift may reorder experts whose gate scores
    # nearly tie (within `deeper` of the row's largest score) and those rows are left out
    one_layer, deeper, near_ties = (6e-2, 1.2e-1, 0.4) if workspace else (2e-2, 2e-2, 0.1)
    prompts = _prompts((8, 3))
    ref_cap, ker_cap, ref_tokens, ref_run, ker_run, engine = _run(
        "tiny-oss", "moe", prompts, 2, moe_workspace=workspace
    )
    assert not engine.model.kernel_refusals
    ffn = engine.model.layers[0].ffn
    # one MXFP4 copy either way: without a workspace the planar copy made at load replaces the checkpoint's
    # tensors; with one the layer keeps those and converts from them
    assert (ffn.planar is None) == bool(workspace) and (ffn.experts.mxfp4 is None) == (not workspace)
    if workspace:
        assert ffn.workspace.w1.shape[0] == 2 * workspace  # two chunks, not all experts
    errors = _layer_errors(ref_cap, ker_cap, deeper, max_near_ties=near_ties)
    assert errors[0] < one_layer and max(errors.values()) < deeper
    assert _median_logit_error(ref_run, ker_run) < deeper


def test_moe_kernel_takes_bf16_experts_too():
    # tiny-dsa's experts are bf16: they run adapt's grouped kernels, no torch fallback
    engine = Engine.load(
        tiny_path("tiny-dsa"), dtype=torch.float32, kernels="moe", device=DEVICE, max_tokens=128
    )
    assert not engine.model.kernel_refusals and engine.model.paths["moe"] == "kernel"
    assert {layer.ffn.experts.kernel_format for layer in engine.model.layers[1:]} == {"bf16"}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,tolerance,identical",
    [
        ("tiny-qwen3", 2e-2, True),  # GQA + norm/rope kernels in fp32; bf16 experts, bf16 activations
        ("tiny-oss", 2e-2, False),  # + MXFP4 MoE kernel (bf16 activations)
        ("tiny-dsa", 2e-2, False),  # + sparse MLA (bf16 latent), the FP8 indexer, bf16 experts
        ("tiny-dsa-fp8", 6e-2, False),  # FP8-block experts, W8A8 (e4m3 activations per 1x128 group)
    ],
)
def test_all_kernels_compiled_track_the_reference_for_32_tokens(name, tolerance, identical):
    prompts = _prompts((30, 9))
    ref_cap, ker_cap, ref_tokens, ref_run, ker_run, engine = _run(name, "all", prompts, 32)
    comparison = compare_captures(ref_cap, ker_cap)
    print(
        name,
        "layer errors",
        comparison.layer_error,
        "router",
        comparison.router_agreement,
        "dsa overlap",
        comparison.dsa_overlap,
        "predictions equal",
        ker_run.predictions == ref_tokens,
    )
    assert _median_logit_error(ref_run, ker_run) < tolerance
    if identical:
        assert ker_run.predictions == ref_tokens
