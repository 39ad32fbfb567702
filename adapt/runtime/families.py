"""Generation through the reference paths of the families the decoder engine does not build:
hybrid linear attention (qwen3_next, adapt.runtime.hybrid) and multimodal MoE (llama4 with a
vision tower, adapt.runtime.multimodal); and image prompts of kimi_k25 (MoonViT in front of the
decoder engine, which runs its text-only prompts by itself). Greedy, one sequence at a time,
token ids in and out."""

from __future__ import annotations

import json
import time
from pathlib import Path

from adapt.errors import InputError
from adapt.model.spec import load_spec

REFERENCE_FAMILIES = ("qwen3_next", "llama4")


def uses_reference_path(model_dir: Path) -> bool:
    """True for a model directory whose config.json names a model_type of these reference paths
    (read directly: any other directory goes on to the decoder engine untouched)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and config.get("model_type") in REFERENCE_FAMILIES


def generate_reference(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, layers: list[int] | None,
                       image: Path | None, dtype) -> dict:
    """Greedy tokens for each prompt (token ids); with ``image`` (multimodal only) the image goes
    before each prompt (llama4: one tile; kimi_k25: native resolution through MoonViT, the language
    model on the decoder engine). Returns a JSON-able summary (tokens, seconds, layers, image tokens)."""
    from adapt.runtime.hybrid import HybridModel
    from adapt.runtime.multimodal import KimiK25Model, MultimodalModel, load_image_patches, load_image_tile

    spec = load_spec(model_dir)
    if spec.model_type == "llama4":
        model = MultimodalModel.from_dir(model_dir, layers, dtype)
    elif spec.model_type == "kimi_k25":
        model = KimiK25Model.from_dir(model_dir, layers, dtype)
    elif image is not None:
        raise InputError(f"{spec.model_type} takes no images", field="--image",
                         hint="--image needs a multimodal model (llama4, kimi_k25)")
    else:
        model = HybridModel.from_dir(model_dir, layers, dtype)
    pixels, image_tokens = None, 0
    if image is not None and isinstance(model, KimiK25Model):
        pixels = [load_image_patches(image, spec)]
        (ph, pw), (kh, kw) = pixels[0][1], spec.vision.merge
        image_tokens = ph * pw // (kh * kw) + len(model.image_prompt()) - 1
    elif image is not None:
        pixels = load_image_tile(image, spec.vision.image_size)
        image_tokens = len(model.image_prompt())
    rows = []
    for prompt in prompts:
        ids = (model.image_prompt() + prompt) if pixels is not None else prompt
        started = time.perf_counter()
        if isinstance(model, HybridModel):
            tokens, _ = model.generate(ids, max_new_tokens)
        else:
            tokens = model.generate(ids, max_new_tokens, pixels)
        expanded = len(ids) + (image_tokens - len(model.image_prompt()) if pixels is not None else 0)
        rows.append({"prompt_tokens": expanded, "tokens": tokens, "seconds": time.perf_counter() - started})
    return {"model": str(model_dir), "model_type": spec.model_type, "layers": model.layer_ids,
            "path": "reference (torch)", "image": None if image is None else str(image),
            "image_tokens": image_tokens, "sequences": rows}


def load_family_model(model_dir: Path, layers: list[int] | None, dtype, expert_scale=None):
    """The reference model of ``model_dir`` (HybridModel or MultimodalModel) with every weight and the
    compute in ``dtype`` (torch.float32: the reference; torch.bfloat16: the adapted compute dtype).
    expert_scale: test hook (layer, expert, factor) multiplying that routed expert's down projection."""
    from adapt.runtime.hybrid import HybridModel
    from adapt.runtime.multimodal import MultimodalModel

    spec = load_spec(model_dir)
    model = (MultimodalModel if spec.model_type == "llama4" else HybridModel).from_dir(model_dir, layers, dtype)
    if expert_scale is not None:
        scale_expert(model, *expert_scale)
    return model


def scale_expert(model, layer: int, expert: int, factor: float) -> None:
    """Multiply routed expert ``expert`` of decoder layer ``layer`` (its down projection) by ``factor``
    (a test hook: ADAPT_TEST_FAULTS expert_scale=L:E:F), per-expert or fused [E, ...] tensors."""
    keys = [k for k in model.w if f"layers.{layer}." in k and ".experts." in k and "down_proj" in k
            and "shared" not in k]
    own = [k for k in keys if f".experts.{expert}." in k]
    if own:
        for k in own:
            model.w[k] = model.w[k] * factor
    elif keys and all(model.w[k].dim() == 3 and expert < model.w[k].shape[0] for k in keys):
        for k in keys:
            tensor = model.w[k].clone()
            tensor[expert] *= factor
            model.w[k] = tensor
    else:
        raise InputError(f"layer {layer} has no routed expert {expert}", field="ADAPT_TEST_FAULTS",
                         hint="expert_scale=L:E:F names an MoE layer and one of its experts")


def family_forward(model, tokens: list[int]):
    """One prefill of ``tokens`` from an empty state: fp32 logits [len(tokens), vocab] and each run
    layer's output hidden states (fp32 [len(tokens), hidden], in ``model.layer_ids`` order)."""
    import torch

    from adapt.runtime.hybrid import HybridModel, HybridState
    from adapt.runtime.multimodal import MultimodalState

    state = HybridState() if isinstance(model, HybridModel) else MultimodalState()
    model.captured = []
    try:
        with torch.no_grad():
            logits = model.forward(tokens, state)
        return logits.float(), model.captured
    finally:
        model.captured = None


def family_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` (token ids) through the family's own decode loop."""
    out = model.generate(list(prompt), max_new_tokens)
    return out[0] if isinstance(out, tuple) else out


def image_prompt_runs(model_dir: Path, layers: list[int] | None, dtype, kernels: str, text: list[int],
                      device: str = "cpu", grid: tuple[int, int] = (16, 16)) -> tuple[float, object, object]:
    """kimi_k25 image input for stage 5: one seeded synthetic image of ``grid`` patches (the position
    grid resampled) before ``text`` (token ids), through the float32 torch path and through the
    adapted one (``dtype``, the language model's ``kernels``), both on ``device``. Returns (relative
    error of the adapted image features, reference logits, adapted logits), logits fp32 on the CPU
    [prompt rows, vocab]."""
    import torch

    from adapt.runtime.multimodal import KimiK25Model

    ph, pw = grid
    side = load_spec(model_dir).vision.patch_size
    patches = torch.randn(ph * pw, 3, side, side, generator=torch.Generator().manual_seed(0))
    images = [(patches, grid)]
    runs = []
    for run_dtype, run_kernels in ((torch.float32, "none"), (dtype, kernels)):
        model = KimiK25Model.from_dir(model_dir, layers, run_dtype, kernels=run_kernels, device=device)
        with torch.no_grad():
            features = model.encode_images(images)[0].float().cpu()
        runs.append((features, model.prompt_logits(model.image_prompt() + list(text), images).cpu()))
        del model
    (ref_features, ref_logits), (ad_features, ad_logits) = runs
    error = float((ad_features - ref_features).norm() / ref_features.norm())
    return error, ref_logits, ad_logits
