"""The other expert formats through the same grouped MoE kernels: FP8 with 128 x 128 block scales
(DeepSeek-V3 / Kimi K2 checkpoints) and bf16 (Qwen3, Mixtral, GLM).

Each kernel against a float64 layer computed here from the formats' definitions (e4m3 bits and
block scales decoded in float64, no helper of the kernels or their twins) and against its torch
twin with the tight kernel-vs-twin tolerance of stage 3's gates. Tiny shapes under the CPU
interpreter; the same tests run compiled on a GPU.
"""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from adapt.errors import InputError
from adapt.kernels import moe_gemm as mg
from adapt.kernels import reference
from adapt.kernels import routing as rt
from adapt.kernels.moe_weights import StackedExperts
from adapt.report import load_gates

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GATES = load_gates()["kernels"]
TWIN = GATES["max_twin_rel_error_gpu" if DEV == "cuda" else "max_twin_rel_error_interpreter"]


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _e4m3_f64(bits: torch.Tensor) -> torch.Tensor:
    """float64 e4m3 values from their bits, written out per field (sign, 4-bit exponent of bias 7,
    3-bit mantissa; exponent 0 subnormal), for the test's own decode."""
    b = bits.long()
    sign = 1.0 - 2.0 * (b >> 7).double()
    exp, man = ((b >> 3) & 15).double(), (b & 7).double()
    return sign * torch.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))


def make_stacked(e, h, i, fmt, *, bias=False, interleaved=False, seed=0):
    """Random experts in ``fmt`` ('fp8_block': e4m3 values with one scale per 128 x 128 block, scales
    spread over 2**-9..2**-5 so a missing or misplaced block scale shows; 'bf16')."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(e, 2 * i, h, generator=g) * 0.1
    w2 = torch.randn(e, h, i, generator=g) * 0.1
    b1 = torch.randn(e, 2 * i, generator=g) * 0.1 if bias else None
    b2 = torch.randn(e, h, generator=g) * 0.1 if bias else None
    if fmt == "bf16":
        return StackedExperts(w1.bfloat16().to(DEV), w2.bfloat16().to(DEV), None, None,
                              _dev(b1), _dev(b2), interleaved)

    def blocks(w):
        n, k = w.shape[1:]
        s = torch.pow(2.0, torch.randint(-9, -4, (e, -(-n // 128), -(-k // 128)), generator=g).float())
        full = s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
        return (w / full * 2**-6).clamp(-448, 448).to(torch.float8_e4m3fn), s

    q1, s1 = blocks(w1)
    q2, s2 = blocks(w2)
    return StackedExperts(q1.to(DEV), q2.to(DEV), s1.to(DEV), s2.to(DEV), _dev(b1), _dev(b2), interleaved)


def _dev(t):
    return None if t is None else t.to(DEV)


def _weights_f64(w: StackedExperts):
    """float64 (w1, w2) from the test's own decode."""
    if w.w1_scale is None:
        return w.w1.double().cpu(), w.w2.double().cpu()
    out = []
    for q, s in ((w.w1, w.w1_scale), (w.w2, w.w2_scale)):
        n, k = q.shape[1:]
        vals = _e4m3_f64(q.cpu().view(torch.uint8))
        full = s.double().cpu()[:, torch.arange(n) // 128][:, :, torch.arange(k) // 128]
        out.append(vals * full)
    return tuple(out)


def ref_layer_f64(x, ids, topw, w: StackedExperts, activation="swiglu", alpha=1.702, limit=7.0):
    """float64 MoE output [T, H]: per token, the weighted sum of its experts' SwiGLU MLPs."""
    w1, w2 = _weights_f64(w)
    i = w.intermediate
    il = w.gate_up_interleaved
    wg, wu = (w1[:, 0::2], w1[:, 1::2]) if il else (w1[:, :i], w1[:, i:])
    xd = x.double().cpu()
    out = torch.zeros(x.shape[0], w.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = wg[e] @ xd[t], wu[e] @ xd[t]
            if w.w1_bias is not None:
                b = w.w1_bias[e].double().cpu()
                gate, up = (gate + b[0::2], up + b[1::2]) if il else (gate + b[:i], up + b[i:])
            if activation == "swiglu":
                hv = gate / (1 + torch.exp(-gate)) * up
            else:
                gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
                hv = gc / (1 + torch.exp(-alpha * gc)) * (uc + 1)
            o = w2[e] @ hv
            if w.w2_bias is not None:
                o = o + w.w2_bias[e].double().cpu()
            out[t] += float(topw[t, j]) * o
    return out


def _routing(t, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int().to(DEV)
    topw = torch.rand(t, k, generator=g).to(DEV)
    return ids, topw / topw.sum(-1, keepdim=True)


def _run(x, ids, topw, w, mlp, perm_fn, comb, **kw):
    perm = perm_fn(ids, w.n_experts)
    y = mlp(x, perm, w, top_k=ids.shape[1], **kw)
    return comb(y, topw, perm.slot_pos, None)


@pytest.mark.parametrize(
    "fmt,compute,act_quant,tol_key",
    [
        ("bf16", "bf16", "token", "max_rel_error_bf16"),
        ("fp8_block", "bf16", "token", "max_rel_error_bf16"),  # W8A16: exact weights, bf16 hidden
        ("fp8_block", "fp8", "group128", "max_rel_error_fp8"),  # W8A8, DeepSeek's 1x128 activations
        ("fp8_block", "fp8", "token", "max_rel_error_fp8"),
    ],
)
def test_stacked_experts_match_float64_and_twin(fmt, compute, act_quant, tol_key):
    # H = 256 and I = 128: two K blocks in GEMM1, gate and up in separate 128-row blocks, so a scale
    # read from the wrong block (row or column) changes the result far beyond the tolerance
    e, h, i, t, k = 4, 256, 128, 6, 2
    w = make_stacked(e, h, i, fmt, seed=1)
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(2))).bfloat16().to(DEV)
    ids, topw = _routing(t, e, k, 3)
    kw = dict(compute=compute, act_quant=act_quant)
    got = _run(x, ids, topw, w, mg.expert_mlp, rt.permute_by_expert, rt.combine, **kw)
    twin = _run(x, ids, topw, w, mg.expert_mlp_torch, rt.permute_by_expert_torch, rt.combine_torch, **kw)
    ref = ref_layer_f64(x, ids, topw, w)
    assert torch.isfinite(got).all()
    assert _rel(got, ref) < GATES[tol_key]
    assert _rel(got, twin) < TWIN


def test_fp8_block_scales_are_applied_per_block():
    # a single block's scale multiplied by 4: the kernel must follow that block only
    e, h, i, t, k = 2, 256, 128, 4, 2
    w = make_stacked(e, h, i, "fp8_block", seed=4)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    ids, topw = _routing(t, e, k, 6)
    base = _run(x, ids, topw, w, mg.expert_mlp, rt.permute_by_expert, rt.combine)
    w.w1_scale[1, 1, 1] *= 4  # expert 1, up rows 0..127 (block row 1), K columns 128..255
    moved = _run(x, ids, topw, w, mg.expert_mlp, rt.permute_by_expert, rt.combine)
    ref = ref_layer_f64(x, ids, topw, w)
    assert _rel(moved, ref) < GATES["max_rel_error_bf16"]
    assert _rel(base, ref) > 5 * GATES["max_rel_error_bf16"]


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
def test_moe_forward_routes_stacked_experts_like_the_float64_layer(fmt):
    # the whole layer (DeepSeek sigmoid group routing, correction bias, shared expert) on these formats
    e, h, i, t = 8, 128, 128, 5
    w = make_stacked(e, h, i, fmt, seed=7)
    shared = make_stacked(1, h, i, fmt, seed=8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    gate = (torch.randn(e, h, generator=g) * h**-0.5).to(DEV)
    bias = (torch.randn(e, generator=g) * 0.1).to(DEV)
    config = rt.RouterConfig(top_k=2, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling=2.5)
    got = mg.moe_forward(x, gate, w, config, correction_bias=bias, shared=shared)
    twin = mg.moe_forward_torch(x, gate, w, config, correction_bias=bias, shared=shared)
    logits = rt.gate_logits(x, gate)
    ref = reference.moe_reference(x, logits, w, config, bias, "swiglu", None)
    ref = ref + reference.moe_reference(x, torch.zeros(t, 1, device=DEV), shared,
                                        rt.RouterConfig(top_k=1, scoring="softmax"), None, "swiglu", None)
    assert _rel(got, ref) < GATES["max_rel_error_bf16"]
    assert _rel(got, twin) < TWIN


def test_interleaved_gate_up_and_biases_on_bf16_experts():
    e, h, i, t, k = 4, 64, 32, 5, 2
    w = make_stacked(e, h, i, "bf16", bias=True, interleaved=True, seed=10)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(11)).bfloat16().to(DEV)
    ids, topw = _routing(t, e, k, 12)
    kw = dict(activation="swiglu_clamped", limit=0.5)  # clamp reached by most entries
    got = _run(x, ids, topw, w, mg.expert_mlp, rt.permute_by_expert, rt.combine, **kw)
    twin = _run(x, ids, topw, w, mg.expert_mlp_torch, rt.permute_by_expert_torch, rt.combine_torch, **kw)
    ref = ref_layer_f64(x, ids, topw, w, "swiglu_clamped", limit=0.5)
    assert _rel(got, ref) < GATES["max_rel_error_bf16"]
    assert _rel(got, twin) < TWIN


def test_reference_decodes_e4m3_from_its_definition():
    bits = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    ref = reference.e4m3_decode_reference(bits.view(torch.float8_e4m3fn))
    nan = (bits.long() & 0x7F) == 0x7F
    assert nan.sum() == 2 and torch.isnan(ref[nan]).all()
    assert torch.equal(ref[~nan], _e4m3_f64(bits)[~nan])
    assert ref[0x7E] == 448 and ref[0x01] == 2.0**-9 and ref[0xB8] == -1.0


def test_stacked_experts_reject_bad_input():
    w = make_stacked(2, 128, 128, "fp8_block")
    with pytest.raises(InputError):
        StackedExperts(w.w1, w.w2, None, None)  # FP8 without scales
    with pytest.raises(InputError):
        StackedExperts(w.w1, w.w2, w.w1_scale[:, :1], w.w2_scale)
    with pytest.raises(InputError):
        StackedExperts(w.w1.float(), w.w2.float())
    b = make_stacked(2, 64, 32, "bf16")
    x = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEV)
    perm = rt.permute_by_expert(torch.zeros(3, 1, dtype=torch.int32, device=DEV), 2)
    with pytest.raises(InputError):
        mg.expert_mlp(x, perm, b, top_k=1, compute="fp8")


def test_format_bench_variants_compute_the_same_layer():
    # the benchmark's callables (adapt on both formats, torch grouped bf16) at a tiny shape, and its byte count
    from adapt.stages import bench_moe as bm

    shape = dict(experts=4, top_k=2, hidden=256, intermediate=128, activation="swiglu", interleaved=False)
    torch.manual_seed(0)
    bf, fp8w = bm._format_layer(shape, DEV)
    x, perm, active, _ = bm._point(3, 4, 2, 256, DEV)
    variants = bm._format_variants(x, perm, bf, fp8w, shape, layout="not timed here")
    assert "torch_fp8_block_scaled_mm" not in variants
    assert _rel(variants["bf16_experts"](), variants["torch_grouped_bf16"]()) < GATES["max_rel_error_bf16"]
    twin = mg.expert_mlp_torch(x, perm, fp8w, top_k=2, compute="fp8", act_quant="group128")
    assert _rel(variants["fp8_block_w8a8"](), twin) < TWIN
    assert bm.format_bytes("bf16_experts", active, 256, 128) == active * 6 * 256 * 128
    assert bm.format_bytes("fp8_block_w8a8", 1, 256, 128) == 3 * 256 * 128 + 4 * (2 * 2 + 2 * 1)
