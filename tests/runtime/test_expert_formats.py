"""Every expert format through adapt's grouped MoE kernels in the runtime (``--kernels moe``): bf16
experts (tiny-qwen3) keep the float32 reference's greedy tokens, FP8-block experts (tiny-dsa-fp8, the
DeepSeek-V3.2 checkpoint format) stay within stage 5's gates. CPU: Triton interpreter."""

import pytest
import torch

from adapt.model.tiny import tiny_path
from adapt.report import load_gates
from adapt.runtime.engine import Engine
from adapt.runtime.model import compare_captures
from adapt.runtime.moe import MoE, RouterSpec
from adapt.runtime.weights import Experts, Linear
from tests.runtime.test_kernel_paths import _median_logit_error, _prompts, _rel, _run

PRECISION = load_gates()["precision"]


def test_fp8_block_checkpoint_is_read_as_transformers_reads_it():
    # the float32 reference path on the FP8 experts (dequantized per block) against transformers
    from transformers import AutoModelForCausalLM

    path = tiny_path("tiny-dsa-fp8")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              experts_implementation="eager").float().eval()
    engine = Engine.load(path, dtype=torch.float32, max_tokens=256)
    experts = engine.model.layers[1].ffn.experts
    assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.kernel_format == "fp8_block"
    prompt = _prompts((23,))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), use_cache=False).logits[0, -4:-1].float()
    got = engine.follow([prompt[:-3]], [prompt[-3:]], keep_logits=True).logits[0]
    assert _rel(got, ref) < 1e-5


@pytest.mark.slow
def test_bf16_experts_through_the_moe_kernel_keep_the_greedy_tokens():
    prompts = _prompts((8, 3))
    ref_cap, ker_cap, ref_tokens, ref_run, ker_run, engine = _run("tiny-qwen3", "moe", prompts, 4)
    assert engine.model.paths["moe"] == "kernel" and not engine.model.kernel_refusals
    comparison = compare_captures(ref_cap, ker_cap)
    assert not any(comparison.routing_flips.values())
    assert max(comparison.layer_error.values()) < 1e-2  # bf16 activations: bf16 tolerance
    assert ker_run.predictions == ref_tokens  # lossless weights: the float32 reference's greedy tokens


@pytest.mark.slow
def test_fp8_block_experts_through_the_moe_kernel_stay_within_stage5_gates():
    prompts = _prompts((8, 3))
    ref_cap, ker_cap, ref_tokens, ref_run, ker_run, engine = _run("tiny-dsa-fp8", "moe", prompts, 4)
    assert engine.model.paths["moe"] == "kernel" and not engine.model.kernel_refusals
    comparison = compare_captures(ref_cap, ker_cap, tie_tol=PRECISION["router_tie_gap"])
    rows = sum(len(h) for h in ref_cap.hidden_states[min(ref_cap.hidden_states)])
    for layer, flips in comparison.routing_flips.items():
        assert flips <= PRECISION["max_real_flip_rate"] * rows, (layer, comparison)
    assert max(comparison.layer_error.values()) < PRECISION["max_rel_error_layer"]
    assert _median_logit_error(ref_run, ker_run) < 6e-2  # kernels max_rel_error_fp8
    top1 = [p == r for ps, rs in zip(ker_run.predictions, ref_tokens, strict=True)
            for p, r in zip(ps, rs, strict=True)]
    assert sum(top1) / len(top1) >= PRECISION["min_top1_agreement"]


def test_only_fp16_or_fp32_experts_fall_back_to_torch():
    e, h, i = 2, 8, 4
    experts = Experts(count=e, interleaved=False, gate_up=torch.zeros(e, 2 * i, h), down=torch.zeros(e, h, i))
    layer = MoE(RouterSpec("qwen3", 1), Linear(torch.zeros(e, h)), experts, path="kernel")
    assert layer.path == "torch" and "float32" in layer.kernel_refusal
    experts.gate_up, experts.down = experts.gate_up.bfloat16(), experts.down.bfloat16()
    layer = MoE(RouterSpec("qwen3", 1), Linear(torch.zeros(e, h)), experts, path="kernel")
    assert layer.path == "kernel" and layer.kernel_experts.format == "bf16"


def test_fp8_expert_format_on_bf16_experts_runs_an_fp8_block_copy():
    # Formats(experts="fp8") on bf16 experts: the kernel path quantizes an FP8-block copy once and runs W8A8.
    # Against the as-stored torch path it must show the quantization (well above the bf16 kernel's own
    # error) and stay within stage 5's per-expert FP8 tolerance (the torch path's per-row FP8 numerics
    # measure 0.069 on these weights, the kernel 0.069)
    g = torch.Generator().manual_seed(3)
    e, h, i, t = 4, 128, 64, 6
    experts = Experts(count=e, interleaved=False, gate_up=(torch.randn(e, 2 * i, h, generator=g) * h**-0.5).bfloat16(),
                      down=(torch.randn(e, h, i, generator=g) * i**-0.5).bfloat16())
    gate = Linear(torch.randn(e, h, generator=g))
    x = torch.randn(t, h, generator=g)
    out = {}
    for path, fp8 in (("torch", False), ("kernel", False), ("kernel", True)):
        layer = MoE(RouterSpec("qwen3", 2), gate, experts, path=path)
        layer.expert_fp8 = fp8
        out[path, fp8] = layer.forward(x)
    assert layer._fp8_copy is not None and layer._fp8_copy.format == "fp8_block"
    ref = out["torch", False]
    assert 5 * _rel(out["kernel", False], ref) < _rel(out["kernel", True], ref) < PRECISION["max_rel_error_expert"]


@pytest.mark.parametrize("interleaved", [False, True])
def test_mxfp4_kernel_layer_holds_one_planar_copy(interleaved):
    # the kernel path moves MXFP4 experts into the planar layout at load and drops the checkpoint's tensors;
    # the torch path and the FP8 fold still read every expert as stored
    import dataclasses

    from tests.kernels.test_moe import DEV, make_layer

    e, h, i, t = 5, 64, 32, 7
    w = make_layer(e, h, i, bias=True, interleaved=interleaved, seed=5)
    g = torch.Generator(device=DEV).manual_seed(5)
    gate = Linear(torch.randn(e, h, generator=g, device=DEV))
    x = torch.randn(t, h, generator=g, device=DEV).bfloat16()
    stored = Experts(count=e, interleaved=interleaved, mxfp4=w)
    ref = MoE(RouterSpec("qwen3", 2), gate, stored, path="torch")
    planar = Experts(count=e, interleaved=interleaved, mxfp4=dataclasses.replace(w))
    layer = MoE(RouterSpec("qwen3", 2), gate, planar, path="kernel")
    assert planar.mxfp4 is None and layer.planar is planar.planar is layer.kernel_experts
    assert planar.kernel_format == "mxfp4" and planar.nbytes == layer.planar.nbytes()
    for ex in range(e):
        for a, b in zip(stored.expert(ex, torch.float32), planar.expert(ex, torch.float32), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(stored.expert_mxfp4(ex), planar.expert_mxfp4(ex), strict=True):
            assert torch.equal(a, b)
    on_planar = MoE(RouterSpec("qwen3", 2), gate, planar, path="torch")
    assert torch.equal(on_planar.forward(x), ref.forward(x))
    on_planar.expert_fp8 = ref.expert_fp8 = True  # the workspace's fold, from either copy
    assert torch.equal(on_planar.forward(x), ref.forward(x))
    assert (layer.forward(x) - ref.forward(x)).abs().max() < 0.05  # bf16 activations, as the kernels tests bound
    # with a workspace the layer keeps the checkpoint's tensors (the faster conversion's source) and no planar copy
    from adapt.kernels.workspace import FP8Workspace

    kept = Experts(count=e, interleaved=interleaved, mxfp4=dataclasses.replace(w))
    with_ws = MoE(RouterSpec("qwen3", 2), gate, kept, path="kernel", workspace=FP8Workspace(2, h, i, DEV))
    assert with_ws.planar is None and kept.mxfp4 is not None and kept.planar is None
