"""The multimodal reference path (adapt.runtime.multimodal) against transformers'
Llama4ForConditionalGeneration on the tiny Llama 4-style multimodal MoE, float32, greedy: the same
tokens with and without an image, full and reduced depth."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adapt.model.checkpoint import Checkpoint  # noqa: E402
from adapt.model.spec import load_spec  # noqa: E402
from adapt.model.tiny_multimodal import build_tiny_llama4  # noqa: E402
from adapt.runtime.multimodal import MultimodalModel, MultimodalState, load_image_tile  # noqa: E402
from tests.runtime.run_json import adapt_run_json  # noqa: E402

NEW_TOKENS = 8
TEXT = [5, 17, 99, 3, 250, 42, 7, 11, 13, 60, 70]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama4(tmp_path_factory.mktemp("tiny") / "tiny-llama4")


def _reference(model_dir, prompt, pixel_values, layers: int | None):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if layers is not None:
        text = config.text_config
        text.num_hidden_layers = layers
        text.layer_types = text.layer_types[:layers]
        text.no_rope_layers = text.no_rope_layers[:layers]
        text.moe_layers = [i for i in text.moe_layers if i < layers]
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(model_dir, config=config,
                                                                        dtype=torch.float32).eval()
    kwargs = {} if pixel_values is None else {"pixel_values": pixel_values}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=2, eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("layers", [None, 2])
def test_text_and_image_tokens_match_transformers(tiny, layers):
    ours = MultimodalModel.from_dir(tiny, layers=None if layers is None else list(range(layers)))
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with_image = TEXT[:3] + ours.image_prompt() + TEXT[3:]
    assert len(with_image) > 16  # longer than two attention chunks of 8 tokens
    for prompt, image in ((TEXT, None), (with_image, pixels)):
        got = ours.generate(prompt, NEW_TOKENS, image)
        assert got == _reference(tiny, prompt, image, layers), (prompt, image is not None)


def test_image_changes_the_logits_and_features_match_transformers(tiny):
    ours = MultimodalModel.from_dir(tiny)
    reference = transformers.Llama4ForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        vision = reference.get_image_features(pixel_values=pixels).last_hidden_state
        want = reference.multi_modal_projector(vision.reshape(-1, vision.shape[-1]))
    got = ours.encode_images(pixels)
    assert got.shape == (4, 64)
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-5
    prompt = ours.image_prompt() + TEXT
    a = ours.forward(prompt, MultimodalState(), got)
    b = ours.forward(prompt, MultimodalState(), ours.encode_images(torch.zeros(1, 3, 56, 56)))
    assert not torch.allclose(a, b)


def test_tiny_checkpoint_matches_its_spec(tiny):
    spec, checkpoint = load_spec(tiny), Checkpoint.open(tiny)
    assert checkpoint.check_against(spec) == []
    assert checkpoint.total_bytes == sum(spec.weight_bytes().values())
    assert spec.vision.image_tokens(56, 56) == 4 + 3


def test_image_file_becomes_one_normalised_tile(tmp_path):
    from PIL import Image

    path = tmp_path / "red.png"
    Image.new("RGB", (80, 40), (255, 0, 0)).save(path)
    tile = load_image_tile(path, 56)
    assert tile.shape == (1, 3, 56, 56)
    assert torch.allclose(tile[0, 0], torch.ones(56, 56)) and torch.allclose(tile[0, 1], -torch.ones(56, 56))


def test_adapt_run_with_an_image_file(tiny, tmp_path):
    from PIL import Image
    from typer.testing import CliRunner

    from adapt.cli import app

    path = tmp_path / "picture.png"
    Image.new("RGB", (90, 50), (30, 160, 220)).save(path)
    data = adapt_run_json(tiny, "--token-ids", "5,17,99", "--image", str(path))
    ours = MultimodalModel.from_dir(tiny)
    want = ours.generate(ours.image_prompt() + [5, 17, 99], 4, load_image_tile(path, 56))
    assert data["sequences"][0]["tokens"] == want and data["image_tokens"] == 6
    missing = CliRunner().invoke(app, ["run", str(tiny), "--token-ids", "5", "--image", str(tmp_path / "no.png")])
    assert missing.exit_code == 2 and "no such image file" in missing.output
