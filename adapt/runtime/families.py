"""Generation through the reference paths of the families the decoder engine does not build:
hybrid linear attention (qwen3_next, adapt.runtime.hybrid) and multimodal MoE (llama4 with a
vision tower, adapt.runtime.multimodal). Greedy, one sequence at a time, token ids in and out."""

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
    """Greedy tokens for each prompt (token ids); with ``image`` (multimodal only) one tile of it
    goes before each prompt. Returns a JSON-able summary (tokens, seconds, layers, image tokens)."""
    from adapt.runtime.hybrid import HybridModel
    from adapt.runtime.multimodal import MultimodalModel, load_image_tile

    spec = load_spec(model_dir)
    if spec.model_type == "llama4":
        model = MultimodalModel.from_dir(model_dir, layers, dtype)
    elif image is not None:
        raise InputError(f"{spec.model_type} takes no images", field="--image",
                         hint="--image needs a multimodal model (llama4)")
    else:
        model = HybridModel.from_dir(model_dir, layers, dtype)
    pixels = None if image is None else load_image_tile(image, spec.vision.image_size)
    rows = []
    for prompt in prompts:
        ids = (model.image_prompt() + prompt) if pixels is not None else prompt
        started = time.perf_counter()
        if isinstance(model, MultimodalModel):
            tokens = model.generate(ids, max_new_tokens, pixels)
        else:
            tokens, _ = model.generate(ids, max_new_tokens)
        rows.append({"prompt_tokens": len(ids), "tokens": tokens, "seconds": time.perf_counter() - started})
    return {"model": str(model_dir), "model_type": spec.model_type, "layers": model.layer_ids,
            "path": "reference (torch)", "image": None if image is None else str(image),
            "image_tokens": len(model.image_prompt()) if pixels is not None else 0, "sequences": rows}
