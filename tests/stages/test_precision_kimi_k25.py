"""Stage 5 on the tiny Kimi K2.5: its language model runs on the decoder engine (every stage 5 metric:
routing flips, per-expert gain, the transformers anchor through Kimi_K25ForConditionalGeneration), and
an image prompt goes through MoonViT and the adapted language model beside the float32 path."""

from __future__ import annotations

import pytest

from adapt.model.tiny_multimodal import build_tiny_kimi_k25
from adapt.report import load_gates
from adapt.runtime.variants import Faults
from adapt.stages.precision import run_precision

pytestmark = pytest.mark.slow  # two stage 5 runs of about 15 s each on one CPU core


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_kimi_k25(tmp_path_factory.mktemp("kimi") / "tiny-kimi-k25")


def _gates():
    gates = load_gates()
    gates["precision"]["greedy_tokens"] = 8
    return gates


def test_bf16_text_and_image_pass_every_gate(tiny):
    report = run_precision(str(tiny), "cpu", gates=_gates(), kernels="none", faults=Faults())
    assert report.decide() == "pass", [(f.code, f.message) for f in report.findings]
    m = report.metrics
    assert m["reference_vs_transformers_logit_error"] < 1e-5
    assert 0 < m["image_feature_rel_error"] < 0.05 and m["image_prompt_top1_agreement"] > 0.9
    assert 0 < m["kl_mean"] < 0.05 and m["expert_gain_error_max"] < 0.01 and m["real_flips"] == 0


def test_a_scaled_expert_fails(tiny):
    # the fault lives in the online FP8 expert conversion (adapt.runtime.variants), so experts go to fp8
    report = run_precision(str(tiny), "cpu", gates=_gates(), kernels="none", weights="fp8", attribute=False,
                           faults=Faults.parse("expert_scale=1:0:3"))
    assert report.decide() == "fail"
    assert "expert-gain" in {f.code for f in report.findings if f.severity == "error"}


def test_image_prompt_top1_counts_near_ties_apart():
    """A top-1 change the reference ranks within logit_tie_gap is a near tie; a wider one is a real flip."""
    import torch

    from adapt.stages.precision import compare_logits

    pad = [0.0] * 4  # top-5 overlap needs five tokens
    ref = torch.tensor([[[2.0, 1.9, *pad], [3.0, 0.0, *pad], [2.0, 0.5, *pad]]])
    ad = torch.tensor([[[1.9, 2.0, *pad], [3.0, 0.0, *pad], [0.5, 2.0, *pad]]])  # position 0: near tie, 2: real
    out = compare_logits([ref], [ad], tie_gap=0.25)
    assert out["top1_agreement"] == pytest.approx(1 / 3)
    assert out["top1_near_ties"] == 1 and out["top1_agreement_beyond_ties"] == pytest.approx(2 / 3)
    assert "top1_near_ties" not in compare_logits([ref], [ad])
