"""The runtime against transformers' own implementation of the same tiny checkpoints (reference paths)."""

import json

import pytest
import torch

from adapt.errors import InputError
from adapt.model.tiny import tiny_path
from adapt.runtime.engine import Engine, parse_kernels, parse_layers
from adapt.runtime.kv_cache import OutOfPagesError

MODELS = ("tiny-dsa", "tiny-oss", "tiny-qwen3")
PROMPT_LENGTHS = (40, 23, 7)  # longer than index_topk (16) and the sliding window (16)


def _prompts(lengths=PROMPT_LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def hf_models():
    from transformers import AutoModelForCausalLM

    loaded = {}
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            tiny_path(name), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
        loaded[name] = model.float().eval()  # gpt-oss experts are dequantized to bf16: compare in fp32
    return loaded


@pytest.fixture(scope="module")
def engines():
    return {name: Engine.load(tiny_path(name), dtype=torch.float32, max_tokens=1024) for name in MODELS}


@torch.no_grad()
def _hf_logits(model, prompt):
    return model(torch.tensor([prompt]), use_cache=False).logits[0].float()


@torch.no_grad()
def _hf_greedy(model, prompt, steps):
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
    return tokens


@pytest.mark.parametrize("name", MODELS)
def test_batched_prefill_logits_match_transformers_in_fp32(engines, hf_models, name):
    engine, prompts = engines[name], _prompts()
    seq_ids = engine.start(len(prompts))
    try:
        logits = engine.step(seq_ids, prompts, all_logits=True)
    finally:
        engine.release(seq_ids)
    for prompt, ours in zip(prompts, logits, strict=True):
        ref = _hf_logits(hf_models[name], prompt)
        assert ours.shape == ref.shape
        assert _rel(ours, ref) < 1e-5
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", MODELS)
def test_32_greedy_tokens_match_transformers(engines, hf_models, name):
    prompts = _prompts((30, 9), seed=1)  # 30 + 32 tokens crosses the first 64-token page
    result = engines[name].generate(prompts, 32, stop_ids=())
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        assert tokens == _hf_greedy(hf_models[name], prompt, 32)
    assert result.timing.decode_tokens == 64 and result.timing.prefill_tokens == 39


@pytest.mark.parametrize("name", ["tiny-dsa", "tiny-oss"])
def test_bf16_compute_is_as_accurate_as_transformers_bf16(hf_models, name):
    from transformers import AutoModelForCausalLM

    engine = Engine.load(tiny_path(name), dtype=torch.bfloat16, max_tokens=256)
    prompt = _prompts((40,), seed=2)[0]
    ours = engine.step(engine.start(1), [prompt], all_logits=True)[0]
    hf_bf16 = AutoModelForCausalLM.from_pretrained(
        tiny_path(name), dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ref = _hf_logits(hf_models[name], prompt)
    theirs = _hf_logits(hf_bf16, prompt)
    # both bf16 paths are measured against the fp32 reference; ours may not be worse than theirs
    assert _rel(ours, ref) < max(1.5 * _rel(theirs, ref), 1e-2)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("name", MODELS)
def test_captured_layers_and_router_choices_match_transformers(engines, hf_models, name):
    hf, prompt = hf_models[name], _prompts((33,), seed=3)[0]
    layer_out, router_ids = {}, {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: layer_out.__setitem__(i, o[0])))
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None and hasattr(router, "top_k"):
            hooks.append(router.register_forward_hook(lambda m, a, o, i=i: router_ids.__setitem__(i, o[2])))
    try:
        _hf_logits(hf, prompt)
    finally:
        for hook in hooks:
            hook.remove()
    engine = engines[name]
    seq = engine.start(1)
    try:
        with engine.capture(hidden_states=True, router=True) as cap:
            engine.step(seq, [prompt])
    finally:
        engine.release(seq)
    assert sorted(cap.hidden_states) == sorted(layer_out)
    for i, ref in layer_out.items():
        assert _rel(cap.hidden_states[i][0], ref) < 1e-5
    assert router_ids and sorted(cap.router) == sorted(router_ids)
    for i, ref in router_ids.items():
        ours = cap.router[i][0][0]
        assert torch.equal(ours.sort(-1).values, ref.long().sort(-1).values)


def test_dsa_selects_sparse_keys_once_the_context_exceeds_topk(engines):
    engine = engines["tiny-dsa"]
    seq = engine.start(1)
    try:
        with engine.capture(hidden_states=False, router=False, dsa_indices=True) as cap:
            engine.step(seq, _prompts((40,), seed=4))
    finally:
        engine.release(seq)
    picks = cap.dsa_indices[0][0]  # [40, 16]
    assert (picks[:16] >= 0).sum(1).tolist() == list(range(1, 17))  # early queries see every key
    late = picks[39]
    assert (late >= 0).all() and late.max() <= 39 and len(set(late.tolist())) == 16


def test_reduced_depth_matches_transformers_on_the_same_layers(hf_models):
    hf = hf_models["tiny-dsa"]
    engine = Engine.load(tiny_path("tiny-dsa"), layers="0,2", dtype=torch.float32, max_tokens=256)
    assert [layer.index for layer in engine.model.layers] == [0, 2]
    assert [layer.spec.ffn.kind for layer in engine.model.layers] == ["dense", "moe"]
    full = Engine.load(tiny_path("tiny-dsa"), dtype=torch.float32, max_tokens=256)
    assert engine.bytes_read < full.bytes_read
    prompt = _prompts((37,), seed=5)[0]
    ours = engine.step(engine.start(1), [prompt], all_logits=True)[0]
    original = hf.model.layers
    hf.model.layers = torch.nn.ModuleList([original[0], original[2]])
    hf.config.num_hidden_layers = 2
    try:
        ref = _hf_logits(hf, prompt)
    finally:
        hf.model.layers, hf.config.num_hidden_layers = original, 3
    assert _rel(ours, ref) < 1e-5


def test_temperature_sampling_is_seeded(engines):
    engine, prompts = engines["tiny-qwen3"], _prompts((12, 5), seed=6)
    a = engine.generate(prompts, 10, temperature=1.0, seed=7, stop_ids=()).tokens
    b = engine.generate(prompts, 10, temperature=1.0, seed=7, stop_ids=()).tokens
    c = engine.generate(prompts, 10, temperature=1.0, seed=8, stop_ids=()).tokens
    greedy = engine.generate(prompts, 10, stop_ids=()).tokens
    assert a == b and a != c and a != greedy
    assert all(0 <= t < 512 for seq in a for t in seq)


def test_generation_stops_at_a_stop_id(engines):
    engine = engines["tiny-qwen3"]
    prompt = _prompts((8,), seed=9)[0]
    first = engine.generate([prompt], 1, stop_ids=()).tokens[0][0]
    result = engine.generate([prompt, prompt[:5]], 6, stop_ids=[first])
    assert result.tokens[0] == [first] and result.finished[0]
    assert result.finished[1] == (first in result.tokens[1])
    assert len(result.tokens[1]) == 6 or result.tokens[1][-1] == first


def test_cache_pages_are_returned_and_a_full_cache_refuses_the_step():
    engine = Engine.load(tiny_path("tiny-qwen3"), dtype=torch.float32, max_tokens=128)  # 2 pages
    free = engine.cache.free_pages
    engine.generate(_prompts((70,)), 3, stop_ids=())
    assert engine.cache.free_pages == free
    seq = engine.start(1)
    with pytest.raises(OutOfPagesError):
        engine.step(seq, _prompts((130,)))
    assert engine.cache.free_pages == free and engine.cache.seq_len(seq[0]) == 0


def test_bad_inputs_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="unknown op family"):
        parse_kernels("attention,flash")
    assert parse_kernels("moe,indexer") == {
        "attention": "torch",
        "indexer": "kernel",
        "moe": "kernel",
        "norm_rope": "torch",
    }
    assert parse_layers("2", 3) == [0, 1] and parse_layers("2,0", 61) == [0, 2]
    with pytest.raises(InputError, match="outside"):
        parse_layers("0,61", 61)
    with pytest.raises(InputError, match="count or a comma list"):
        parse_layers("first", 61)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(InputError, match="field 'model_type': expected one of deepseek_v3"):
        Engine.load(tmp_path)  # the ModelSpec's own refusal: the runtime has no second parser
    with pytest.raises(InputError, match="no config.json"):
        Engine.load(tmp_path / "missing")


def test_cli_run_generates_and_reports_bad_input_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from adapt.cli import app

    runner = CliRunner()
    args = ["run", "tiny-qwen3", "--prompt", "The river ran", "--max-new-tokens", "5", "--dtype", "float32", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_path("tiny-qwen3"))(
        "The river ran", add_special_tokens=False
    ).input_ids
    expected = Engine.load(tiny_path("tiny-qwen3"), dtype=torch.float32, max_tokens=128).generate([prompt], 5)
    assert report["sequences"][0]["tokens"] == expected.tokens[0]
    assert report["kernels"]["attention"] == "torch" and report["layers"] == [0, 1]

    bad = runner.invoke(app, ["run", "tiny-qwen3", "--prompt", "x", "--kernels", "flash"])
    assert bad.exit_code == 2 and "unknown op family" in bad.output and "Traceback" not in bad.output
    missing = runner.invoke(app, ["run", str(tmp_path), "--prompt", "x"])
    assert missing.exit_code == 2 and "no config.json" in missing.output
    layers = runner.invoke(app, ["run", "tiny-qwen3", "--token-ids", "5,6", "--layers", "0,9"])
    assert layers.exit_code == 2 and "outside" in layers.output


def test_reference_mxfp4_decode_equals_the_codec():
    from adapt.kernels.mxfp4 import dequantize_mxfp4_torch
    from adapt.runtime.weights import dequantize_mxfp4

    gen = torch.Generator().manual_seed(12)
    packed = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (3, 40, 3), dtype=torch.uint8, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(packed, scales, dtype)
        assert ours.shape == (3, 40, 96)
        assert torch.equal(ours, dequantize_mxfp4_torch(packed, scales, dtype))


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_mla_without_indexer_matches_transformers(tmp_path, interleave):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        rope_interleave=interleave,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.normal_(
                1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else tensor.shape[-1] ** -0.5
            )
    model.save_pretrained(tmp_path)
    prompt = _prompts((21,), seed=13)[0]
    prompt = [t % 256 for t in prompt]
    ref = _hf_logits(model.eval(), prompt)
    engine = Engine.load(tmp_path, dtype=torch.float32, max_tokens=128)
    assert [layer.attention.has_indexer for layer in engine.model.layers] == [False, False]
    assert _rel(engine.step(engine.start(1), [prompt], all_logits=True)[0], ref) < 1e-5


def test_fp8_block_weights_stay_fp8_and_dequantize_per_block(tmp_path):
    from safetensors.torch import save_file

    from adapt.runtime.weights import WeightStore, apply_linear

    gen = torch.Generator().manual_seed(14)
    weight = torch.randn(200, 300, generator=gen).to(torch.float8_e4m3fn)  # not multiples of 128
    scale = torch.rand(2, 3, generator=gen) + 0.5
    tensors = {"proj.weight": weight, "proj.weight_scale_inv": scale}
    for e in range(2):
        for name in ("gate_proj", "up_proj", "down_proj"):
            shape = (256, 128) if name != "down_proj" else (128, 256)
            tensors[f"experts.{e}.{name}.weight"] = torch.randn(*shape, generator=gen).to(torch.float8_e4m3fn)
            blocks = (shape[0] // 128, shape[1] // 128)
            tensors[f"experts.{e}.{name}.weight_scale_inv"] = torch.full(blocks, 0.25 * (e + 1))
    save_file(tensors, tmp_path / "model.safetensors")
    store = WeightStore(tmp_path)
    linear = store.linear("proj")
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.scale.shape == (2, 3)
    expanded = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    x = torch.randn(5, 300, generator=gen)
    torch.testing.assert_close(apply_linear(x, linear), x @ (weight.float() * expanded).T)
    experts = store.experts("experts", 2, interleaved=False)
    assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.gate_up.shape == (2, 512, 128)
    gate_up, down, _, _ = experts.expert(1, torch.float32)
    up = tensors["experts.1.up_proj.weight"].float() * 0.5
    torch.testing.assert_close(gate_up[256:], up)
    torch.testing.assert_close(down, tensors["experts.1.down_proj.weight"].float() * 0.5)
    assert store.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
