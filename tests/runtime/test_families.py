"""Every family ModelSpec accepts runs in the runtime: tiny mixtral, glm4_moe and DeepSeek-style MLA
without q_lora_rank, built through transformers' own classes, match transformers' greedy tokens in
float32 at full and at reduced depth."""

import pytest
import torch

from adapt.runtime.engine import Engine

COMMON = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "mixtral": dict(intermediate_size=96, num_hidden_layers=3, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=10000.0),
    # GLM-4.5 style: q/k/v biases, q/k norms, half the head dims rotated, a dense first layer, a shared expert
    "glm4_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2,
                     head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                     partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0),
    # DeepSeek-V2-Lite style MLA: queries through one q_proj (no q_lora_rank)
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}
PROMPTS = ([5, 17, 33, 9, 60, 71, 12, 88, 3, 40, 41, 7, 19], [11, 23, 5, 80])
NEW_TOKENS = 8
pytestmark = pytest.mark.slow  # about a minute on one CPU core: three models, full and reduced depth


def _build(family: str, directory):
    """A float32 checkpoint of transformers' own model class for ``family`` with seeded weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **COMMON, **CONFIGS[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for i, (name, tensor) in enumerate(sorted(model.state_dict(keep_vars=True).items())):
            gen = torch.Generator().manual_seed(1000 + i)
            noise = torch.randn(tensor.shape, generator=gen)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                tensor.copy_(1 + 0.1 * noise)
            elif tensor.dim() == 1:
                tensor.copy_(0.1 * noise)
            else:
                tensor.copy_(noise / tensor.shape[-1] ** 0.5)
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def built(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, _build(request.param, directory)


@torch.no_grad()
def _hf_greedy(model, prompt, steps):
    """Greedy tokens recomputing the whole sequence each step (no cache: layer subsets stay valid)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        out.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


def test_full_depth_greedy_matches_transformers(built):
    family, directory, hf = built
    engine = Engine.load(directory, dtype=torch.float32, max_tokens=512)
    ours = engine.generate(list(PROMPTS), NEW_TOKENS, stop_ids=()).tokens
    assert ours == [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS], family
    logits = engine.step(engine.start(1), [PROMPTS[0]], all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]]), use_cache=False).logits[0]
    assert float((logits - ref).norm() / ref.norm()) < 1e-5


def test_reduced_depth_greedy_matches_transformers_on_the_same_layers(built):
    family, directory, hf = built
    engine = Engine.load(directory, layers="0,2", dtype=torch.float32, max_tokens=512)
    assert [layer.index for layer in engine.model.layers] == [0, 2]
    ours = engine.generate(list(PROMPTS), NEW_TOKENS, stop_ids=()).tokens
    original = hf.model.layers
    hf.model.layers = torch.nn.ModuleList([original[0], original[2]])
    try:
        ref = [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    finally:
        hf.model.layers = original
    assert ours == ref, family
