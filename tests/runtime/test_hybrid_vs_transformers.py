"""The hybrid reference path (adapt.runtime.hybrid) against transformers' Qwen3NextForCausalLM on
the tiny hybrid model, float32, greedy: the same tokens, full and reduced depth."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adapt.model.spec import load_spec  # noqa: E402
from adapt.model.tiny_hybrid import TINY_QWEN3_NEXT, build_tiny_qwen3_next  # noqa: E402
from adapt.runtime.hybrid import HybridModel, gated_delta_rule  # noqa: E402

PROMPTS = ([5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny") / "tiny-qwen3-next")


def _reference(model_dir, prompt, layers: int | None):
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **overrides).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("layers", [None, 2])
def test_greedy_tokens_match_transformers(tiny, layers):
    ours = HybridModel.from_dir(tiny, layers=None if layers is None else list(range(layers)))
    for prompt in PROMPTS:
        tokens, state = ours.generate(list(prompt), NEW_TOKENS)
        assert tokens == _reference(tiny, list(prompt), layers), prompt
    spec = load_spec(tiny)
    assert [layer.attention.kind for layer in spec.layers] == ["linear", "gqa", "linear", "gqa"]


def test_logits_match_transformers_closely(tiny):
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    prompt = list(PROMPTS[1])
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0]
    from adapt.runtime.hybrid import HybridState

    got = HybridModel.from_dir(tiny).forward(prompt, HybridState())
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-5


def test_state_is_constant_in_sequence_length(tiny):
    model = HybridModel.from_dir(tiny)
    _, short = model.generate([1, 2, 3], 2)
    _, long = model.generate(list(range(40)), 2)
    assert short.state_bytes() == long.state_bytes()
    c = TINY_QWEN3_NEXT
    conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + c["linear_num_value_heads"] * 16
    per_layer = (conv_dim * 3 + c["linear_num_value_heads"] * 16 * 16) * 4
    assert short.state_bytes() == 2 * per_layer
    assert long.keys[1].shape[1] == 42 and short.keys[1].shape[1] == 5


def test_tiny_checkpoint_matches_its_spec(tiny):
    from adapt.model.checkpoint import Checkpoint

    spec, checkpoint = load_spec(tiny), Checkpoint.open(tiny)
    assert checkpoint.check_against(spec) == []
    assert checkpoint.total_bytes == sum(spec.weight_bytes().values())


def test_delta_rule_recovers_a_stored_value():
    """No decay, beta 1, empty memory: writing (k, v) and reading with q = k (|k| = 1) returns
    v / sqrt(dk) (the query scale), and the memory holds k v^T."""
    k = torch.nn.functional.normalize(torch.randn(1, 1, 8), dim=-1)
    v = torch.randn(1, 1, 4)
    out, state = gated_delta_rule(k.clone(), k, v, torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 8, 4))
    assert torch.allclose(out[0, 0], v[0, 0] / 8 ** 0.5, atol=1e-6)
    assert torch.allclose(state[0], k[0, 0][:, None] * v[0, 0][None, :], atol=1e-6)
