"""adapt's Kimi K2.5 path (adapt.runtime.multimodal: MoonViT for the images, the decoder engine for
the DeepSeek-V3 language model) against an independent reference on the tiny Kimi K2.5, float32.

The reference: transformers' own Kimi_K25ForConditionalGeneration (transformers 5.19 ships the
family natively: MoonViT, the patch-merger projector and its DeepseekV3 language model). Where the
image features enter the language model differs in form only: the published modeling code
(moonshotai/Kimi-K2.5 modeling_kimi_k25.py, ``_merge_input_ids_with_image_features`` at inference)
expands ONE <|media_pad|> per image into that image's feature rows; transformers (masked_scatter)
and vLLM take a prompt the processor already expanded to one placeholder per feature row. adapt
takes the published form; the reference gets the expanded prompt, which is the same sequence of
input rows, so the agreement below also checks the expansion (order, count, positions).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adapt.errors import InputError  # noqa: E402
from adapt.model.checkpoint import Checkpoint  # noqa: E402
from adapt.model.spec import load_spec  # noqa: E402
from adapt.model.tiny_multimodal import IMAGE, build_tiny_kimi_k25  # noqa: E402
from adapt.runtime.multimodal import KimiK25Model, MoonViT, load_image_patches  # noqa: E402
from tests.runtime.run_json import adapt_run_json  # noqa: E402

NEW_TOKENS = 8
TEXT = [5, 17, 99, 3, 250, 42, 7, 11, 13, 60, 70, 31, 8]
GRIDS = ((4, 6), (8, 8))  # patches per image: resampled position grid, then the native 8 x 8 one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_kimi_k25(tmp_path_factory.mktemp("kimi") / "tiny-kimi-k25")


def _images() -> list[tuple[torch.Tensor, tuple[int, int]]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(ph * pw, 3, 14, 14, generator=gen), (ph, pw)) for ph, pw in GRIDS]


def _reference(model_dir, layers: int | None):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if layers is not None:
        config.text_config.num_hidden_layers = layers
    return transformers.Kimi_K25ForConditionalGeneration.from_pretrained(model_dir, config=config,
                                                                         dtype=torch.float32).eval()


def _expanded(prompt: list[int], images) -> list[int]:
    """The prompt as transformers' processor hands it over: one placeholder per feature row."""
    rows = iter(ph * pw // 4 for _, (ph, pw) in images)
    return [t for token in prompt for t in ([token] * next(rows) if token == IMAGE else [token])]


@pytest.mark.slow
@pytest.mark.parametrize("layers", [None, 2])  # all 3 language layers; the dense layer and the first MoE one
def test_text_and_image_prompts_match_transformers(tiny, layers):
    ours = KimiK25Model.from_dir(tiny, layers=None if layers is None else list(range(layers)))
    assert ours.layer_ids == list(range(layers or 3))
    reference = _reference(tiny, layers)
    images = _images()
    with_images = TEXT[:3] + ours.image_prompt() + TEXT[3:8] + ours.image_prompt() + TEXT[8:]
    for prompt, given in ((TEXT, []), (with_images, images)):
        expanded = _expanded(prompt, given)
        kwargs = {} if not given else {"pixel_values": torch.cat([p for p, _ in given]),
                                       "image_grid_thw": torch.tensor([[1, ph, pw] for _, (ph, pw) in given])}
        with torch.no_grad():
            want = reference.generate(torch.tensor([expanded]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=2, **kwargs)[0, len(expanded):].tolist()
            want_logits = reference(torch.tensor([expanded]), **kwargs).logits[0]
        assert ours.generate(prompt, NEW_TOKENS, given) == want, (layers, len(given))
        tokens, embeddings = ours.expand(prompt, ours.encode_images(given))
        assert tokens == expanded
        seq = ours.engine.start(1)
        try:
            logits = ours.engine.step(seq, [tokens], embeddings=embeddings, all_logits=True)[0]
        finally:
            ours.engine.release(seq)
        assert torch.linalg.norm(logits - want_logits) / torch.linalg.norm(want_logits) < 1e-5


def test_images_change_the_output_and_placeholders_must_match_them(tiny):
    ours = KimiK25Model.from_dir(tiny)
    prompt = ours.image_prompt() + TEXT
    images = _images()[:1]
    blank = [(torch.zeros_like(images[0][0]), images[0][1])]
    a, b = (ours.expand(prompt, ours.encode_images(x))[1] for x in (images, blank))
    assert a.shape == (len(prompt) - 1 + 6, 64) and not torch.allclose(a, b)
    with pytest.raises(InputError, match="2 image placeholders for 1 images"):
        ours.generate(prompt + [IMAGE], 2, images)


def test_published_tensor_names_load_in_transformers_unchanged(tiny):
    spec, checkpoint = load_spec(tiny), Checkpoint.open(tiny)
    assert checkpoint.check_against(spec) == []
    assert checkpoint.total_bytes == sum(spec.weight_bytes().values())
    _, info = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("grid", [(8, 8), (6, 10), (4, 4)])  # the 8 x 8 position grid, resampled for the others
def test_moonvit_features_match_transformers(tiny, grid):
    reference = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()
    ph, pw = grid
    pixels = torch.randn(ph * pw, 3, 14, 14, generator=torch.Generator().manual_seed(ph * 100 + pw))
    with torch.no_grad():
        want = reference.model.get_image_features(pixels, torch.tensor([[1, ph, pw]])).pooler_output[0]
    vision = MoonViT.from_dir(tiny)
    assert all(name.startswith(("vision_tower.", "mm_projector.")) for name in vision.w)
    got = vision.encode_images(pixels, [grid])
    assert got.shape == (ph * pw // 4, 64)
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-5


def test_image_file_becomes_padded_row_major_patches(tiny, tmp_path):
    from PIL import Image

    path = tmp_path / "two-colours.png"
    image = Image.new("RGB", (90, 50), (255, 0, 0))
    image.paste((0, 0, 255), (14, 0, 28, 14))  # the second patch of the first row is blue
    image.save(path)
    patches, grid = load_image_patches(path, load_spec(tiny))
    assert grid == (4, 8)  # 50 x 90 pixels padded to 56 x 112: whole 28-pixel merge windows
    assert patches.shape == (32, 3, 14, 14)
    assert torch.equal(patches[0, 0], torch.ones(14, 14)) and torch.equal(patches[0, 2], -torch.ones(14, 14))
    assert torch.equal(patches[1, 2], torch.ones(14, 14)) and torch.equal(patches[1, 0], -torch.ones(14, 14))
    assert torch.equal(patches[31], -torch.ones(3, 14, 14))  # rows 42-55, columns 98-111: all padding
    red = patches[:, 0]
    assert torch.equal(red[24, :8], torch.ones(8, 14)) and torch.equal(red[24, 8:], -torch.ones(6, 14))  # rows 42-49
    assert torch.equal(red[6, :, :6], torch.ones(14, 6)) and torch.equal(red[6, :, 6:], -torch.ones(14, 8))  # 84-89
    spec = load_spec(tiny)
    small = replace(spec, vision=replace(spec.vision, max_side_patches=4))  # at most 56 pixels a side
    patches, grid = load_image_patches(path, small)  # shrunk by 56 / 90 to 55 x 31 pixels, padded to 56 x 56
    assert grid == (4, 4) and torch.equal(patches[12], -torch.ones(3, 14, 14))  # rows 42-55: padding
    assert torch.equal(patches[8, :, 3:], -torch.ones(3, 11, 14)) and (patches[8, 0, :3] > 0.9).all()  # 28-30 red


def test_adapt_run_with_an_image_file(tiny, tmp_path):
    from PIL import Image

    path = tmp_path / "picture.png"
    Image.new("RGB", (60, 40), (30, 160, 220)).save(path)
    data = adapt_run_json(tiny, "--token-ids", "5,17,99", "--image", str(path))
    ours = KimiK25Model.from_dir(tiny)
    want = ours.generate(ours.image_prompt() + [5, 17, 99], 4, [load_image_patches(path, ours.spec)])
    assert data["sequences"][0]["tokens"] == want
    # 40 x 60 pixels -> 4 x 6 patches -> 6 image rows, between the media begin and end ids
    assert data["image_tokens"] == 6 + 2 and data["sequences"][0]["prompt_tokens"] == 3 + 8
    text = adapt_run_json(tiny, "--token-ids", "5,17,99")  # text only: the decoder engine by itself
    assert text["sequences"][0]["tokens"] == ours.generate([5, 17, 99], 4)
