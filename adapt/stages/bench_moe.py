"""MoE kernel benchmark (``adapt bench kernels --moe``): one MoE layer at real expert shapes on a GPU.

``run_moe_bench(out_dir, tokens, shapes) -> dict`` times, as CUDA-graph replays (median of the
replays), for each shape and token count T with uniform random routing:

- ``bf16``:        fused MXFP4 -> bf16 decode, bf16 MMA (GEMM1 + SwiGLU + GEMM2)
- ``fp8``:         fused MXFP4 -> e4m3 fold per row, fp8 MMA, activations per token
- ``fp8_offline``: the same fp8 GEMMs on weights converted to e4m3 ahead of time
- ``fp8_ws``:      online conversion of the active experts into the shared workspace + fp8 GEMMs
- ``torch_grouped_bf16``: torch ``_grouped_mm`` over dequantized bf16 weights (the baseline)
- ``layer_*``:     the whole ``moe_forward`` (gating, routing, permutation, shared expert, combine)

and in the same run the ceilings: device-to-device copy bandwidth (bytes read + written), torch
bf16 matmul and fp8 ``_scaled_mm`` at 8192^3. Rates: TB/s on the MXFP4 bytes of the active experts
(3*H*I*17/32 each), TFLOP/s on 6*T*k*H*I. Every timed row carries its error against the torch twin
of the same signature on the same operands (``twin_rel_error``: ``expert_mlp_torch`` /
``moe_forward_torch``; the torch grouped baseline against the bf16 twin). Writes ``moe_bench.json``
and ``moe_bench.md`` to out_dir, and the run as a StageReport (``moe_report.json`` / ``.md``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fnmatch
import json
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import triton

from adapt.bench.acceptance import Criterion, benchmark_report, evaluate, find_row
from adapt.bench.ceilings import measure_ceilings
from adapt.bench.provenance import commit as _git_commit
from adapt.bench.timer import graph_time_us, time_cuda
from adapt.errors import InputError
from adapt.kernels.moe_configs import GemmConfig
from adapt.kernels.mxfp4 import to_sign_split_words
from adapt.model.spec import load_spec
from adapt.report import StageReport, load_gates

# Rows of at most STEADY_TOKENS tokens are timed as CUDA-graph replays STEADY_BATCH back to back a sample (the
# layer's device time with the host ahead, as a serving loop replays its graph; ``time_cuda``'s batch), their
# per-replay time with a sync after each replay kept beside it as ``time_us_synced`` (it adds the host's launch
# latency to graphs of tens of microseconds: 2026-12-02, H100, a 7.4 us graph read 10-20 us that way). Above, one
# replay a sample (graphs of milliseconds).
STEADY_TOKENS = 1024
STEADY_BATCH = 10


def _time_row(fn, t: int):
    """(timing, synced us or None) of a row at ``t`` tokens (see STEADY_TOKENS)."""
    reps = 10 if t >= 4096 else 20
    if t > STEADY_TOKENS:
        return time_cuda(fn, reps=reps), None
    return time_cuda(fn, reps=reps, batch=STEADY_BATCH), time_cuda(fn, reps=reps).median_us


def moe_shape(model: str) -> dict:
    """The routed-expert shape of a model's first MoE layer, from its ModelSpec (preset or config)."""
    spec = load_spec(model)
    ffn = spec.moe_layers[0].ffn
    return dict(experts=ffn.num_experts, top_k=ffn.top_k, hidden=spec.hidden, intermediate=ffn.expert_intermediate,
                scoring=ffn.scoring, n_group=ffn.n_group, topk_group=ffn.topk_group,
                routed_scaling=ffn.routed_scaling, shared=ffn.num_shared_experts, activation=ffn.activation,
                interleaved=spec.model_type == "gpt_oss", bias=ffn.bias, moe_layers=len(spec.moe_layers))


# DeepSeek-V3's experts are DeepSeek-V3.2's (same MoE fields in config.json)
SHAPES = {"deepseek-v3": moe_shape("deepseek-v3.2"), "gpt-oss-120b": moe_shape("gpt-oss-120b")}
DEFAULT_TOKENS = [1, 16, 64, 256, 1024, 4096, 16384]
DEVICE = "cuda"
"""Device of the benchmark (a smoke test of the code paths sets "cpu" under the interpreter)."""
WORKSPACE_CHUNK = 32
"""Experts per workspace chunk (the workspace holds two chunks)."""


def _random_layer(shape: dict, device: str):
    """Random MXFP4 experts (random codes, block exponents 2**-9..2**-5) in the gpt-oss layout."""
    from adapt.kernels.moe_weights import MoEWeights

    def mx(e, n, k):
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device=device)
        scales = torch.randint(118, 123, (e, n, k // 32), dtype=torch.uint8, device=device)
        return blocks, scales

    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    b1, s1 = mx(e, 2 * i, h)
    b2, s2 = mx(e, h, i)
    bias1 = torch.randn(e, 2 * i, device=device) * 0.1 if shape["bias"] else None
    bias2 = torch.randn(e, h, device=device) * 0.1 if shape["bias"] else None
    routed = MoEWeights(b1, s1, b2, s2, bias1, bias2, shape["interleaved"])
    shared = None
    if shape["shared"]:
        c1, d1 = mx(shape["shared"], 2 * i, h)
        c2, d2 = mx(shape["shared"], h, i)
        shared = MoEWeights(c1, d1, c2, d2, None, None, shape["interleaved"])
    return routed, shared


def _uniform_routing(t: int, e: int, k: int, device: str):
    ids = torch.rand(t, e, device=device).topk(k, dim=-1).indices.int()
    w = torch.rand(t, k, device=device)
    return w / w.sum(-1, keepdim=True), ids


def _point(t: int, e: int, k: int, h: int, device: str):
    """One timed point's inputs: x [t, h] bf16, the permutation of uniform random routing, the
    number of experts it activates and the routing weights fp32 [t, k]."""
    from adapt.kernels.routing import permute_by_expert

    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    topw, ids = _uniform_routing(t, e, k, device)
    perm = permute_by_expert(ids, e)
    return x, perm, int(((perm.expert_offsets[1:] - perm.expert_offsets[:-1]) > 0).sum().item()), topw


def _torch_grouped(x_sorted_fn, w1t, w2t, offs, activation, interleaved, alpha=1.702, limit=7.0):
    """Baseline: torch._grouped_mm over dequantized bf16 weights (w*t: [E, K, N] views)."""
    from adapt.kernels.moe_gemm import swiglu_torch

    def run():
        xs = x_sorted_fn()
        h1 = torch._grouped_mm(xs, w1t, offs=offs)
        i = h1.shape[1] // 2
        g, u = (h1[:, 0::2], h1[:, 1::2]) if interleaved else (h1[:, :i], h1[:, i:])
        h = swiglu_torch(g.float(), u.float(), activation, alpha, limit).to(torch.bfloat16)
        return torch._grouped_mm(h, w2t, offs=offs)

    return run



TWIN_OF = {"planar": "bf16", "bf16": "bf16", "fp8": "fp8", "fp8_offline": "fp8", "fp8_ws": "fp8",
           "torch_grouped_bf16": "bf16", "layer_bf16": "layer_bf16", "layer_fp8": "layer_fp8"}
"""Variant -> its twin: the torch function of the same signature on the same quantised operands (the
planar layout holds the MXFP4 values; offline and workspace e4m3 are the fp8 path's row fold)."""
BASELINES = {"torch_grouped_bf16", "peer"}
"""Rows timed beside adapt's kernels, not adapt's: their twin checks warn instead of failing."""


def _twin_outputs(names, x, perm, routed, shared, gate, bias, router, shape) -> dict:
    """Twin name -> its fp32 output at this point, or the reason it could not be computed."""
    from adapt.kernels.moe_gemm import expert_mlp_torch, moe_forward_torch

    kw = dict(top_k=shape["top_k"], activation=shape["activation"])
    lw = dict(correction_bias=bias, shared=shared, activation=shape["activation"])
    calls = {
        "bf16": lambda: expert_mlp_torch(x, perm, routed, compute="bf16", **kw),
        "fp8": lambda: expert_mlp_torch(x, perm, routed, compute="fp8", **kw),
        "layer_bf16": lambda: moe_forward_torch(x, gate, routed, router, compute="bf16", **lw),
        "layer_fp8": lambda: moe_forward_torch(x, gate, routed, router, compute="fp8", **lw),
    }
    out = {}
    for name in sorted(set(names)):
        try:
            out[name] = calls[name]().float()
        except Exception as exc:  # noqa: BLE001 - recorded in the rows (untwinned), the timings go on
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _twin_fields(variant: str, out, twins: dict, tolerance: float) -> dict:
    """A row's twin fields: twin_rel_error (None when no twin ran), twin_tolerance, baseline, and
    twin_error (why the twin could not be compared)."""
    fields = {"baseline": variant in BASELINES}
    twin = twins.get(TWIN_OF.get(variant, ""))
    if variant == "peer":
        fields["twin_error"] = ("the peer routes by its own top-k (over logits that give adapt's draw): checked "
                                "for shape and finite values only")
    elif isinstance(twin, str) or twin is None or out is None:
        fields["twin_error"] = twin if isinstance(twin, str) else "no twin output"
    else:
        fields["twin_rel_error"] = float((out.float() - twin).norm() / twin.norm().clamp_min(1e-30))
        fields["twin_tolerance"] = tolerance
    return fields


PEER_SOURCE = "triton_kernels (triton-lang/triton python/triton_kernels), matmul_ogs"
"""The peer timed beside adapt when ``triton_kernels`` is importable (e.g. ``PYTHONPATH=.peer``, a
git-ignored copy; never part of adapt). Since 2026-12-02 the copy is the one vLLM's wheels vendor
(``vllm/third_party/triton_kernels`` of vLLM 0.26-0.33, fetched by vLLM's build from triton's tag v3.6.0);
sessions 2-3 ran a copy from triton's main after v3.6.0 (``_peer_api`` tells them apart)."""


def _peer_api() -> str | None:
    """Which triton_kernels API is importable: "v3.6.0" (``routing.routing``, ``reduction_n`` on
    ``FusedActivation``), "main" (``topk`` + ``make_ragged_tensor_metadata``), or None."""
    try:
        import triton_kernels.tensor as tk_tensor
    except ImportError:
        return None
    return "main" if hasattr(tk_tensor, "make_ragged_tensor_metadata") else "v3.6.0"


def _peer_setup(routed, shape: dict, source: str = "codes"):
    """The peer's weights for one shape, or the reason it cannot run (a string).

    Reuses adapt's random MXFP4 codes: ``w*_packed`` [E, N, K/32, 16] uint8 (K packed two codes a
    byte) viewed as the peer's [E, K/2, N] (K the MX axis) and ``w*_scales`` [E, N, K/32] E8M0 as
    [E, K/32, N], then converted to the peer's Hopper value layout and to its Hopper scale layout for
    4 and 8 warps (the peer's bench picks 4 warps up to 512 rows). source "downcast": instead, the
    peer's own quantizer (``downcast_to_mxfp`` along K) applied to adapt's weights dequantized to
    bf16 [E, K, N], as the peer's bench builds its weights. Returns a dict of the peer's inputs."""
    try:
        import triton_kernels.swiglu as tk_swiglu
        from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout
    except ImportError as exc:
        return f"triton_kernels not importable: {exc}"
    try:
        e, h, inter = shape["experts"], shape["hidden"], shape["intermediate"]

        def weights(packed, scales, n, k):
            if source == "downcast":
                from triton_kernels.numerics_details.mxfp import downcast_to_mxfp

                from adapt.kernels.mxfp4 import dequantize_mxfp4

                dense = dequantize_mxfp4(packed.view(e, n, k // 2), scales, torch.bfloat16, validate=False)
                packed_kn, scales_kn = downcast_to_mxfp(dense.transpose(1, 2), torch.uint8, axis=1)
                del dense
                packed, scales = packed_kn.transpose(1, 2), scales_kn.transpose(1, 2)
            vals = wrap_torch_tensor(packed.reshape(e, n, k // 2).transpose(1, 2), dtype=FP4)
            vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            w = convert_layout(vals, vl, **vo)
            sc = {}
            for warps in (4, 8):
                sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=warps)
                sc[warps] = convert_layout(wrap_torch_tensor(scales.transpose(1, 2)), sl, **so)
            return w, sc

        w1, s1 = weights(routed.w1_blocks, routed.w1_scales, 2 * inter, h)
        w2, s2 = weights(routed.w2_blocks, routed.w2_scales, h, inter)
        # the peer's SwiGLU is gpt-oss's (interleaved gate/up, alpha 1.702, clamp 7); the DeepSeek-V3
        # shape runs it too: same bytes and MMAs, a different elementwise function
        act = _peer_swiglu(FnSpecs, FusedActivation, tk_swiglu.swiglu_fn)
        b1 = routed.w1_bias.float() if routed.w1_bias is not None else None
        b2 = routed.w2_bias.float() if routed.w2_bias is not None else None
        return dict(matmul_ogs=matmul_ogs, PrecisionConfig=PrecisionConfig, w1=w1, s1=s1, w2=w2, s2=s2,
                    act=act, b1=b1, b2=b2)
    except Exception as exc:  # noqa: BLE001 - the peer's failure is recorded, adapt's rows go on
        return f"triton_kernels setup failed: {type(exc).__name__}: {str(exc)[:200]}"


def _peer_swiglu(fn_specs, fused_activation, swiglu_fn):
    """The peer's fused SwiGLU (alpha 1.702, clamp 7, two inputs an output). Its API moved ``reduction_n``: at tag
    v3.6.0 (the copy vLLM's wheels vendor as ``vllm.third_party.triton_kernels``) it is a field of
    ``FusedActivation``, on triton's main after it one of ``FnSpecs``."""
    if "reduction_n" in {f.name for f in dataclasses.fields(fn_specs)}:
        return fused_activation(fn_specs("swiglu", swiglu_fn, ("alpha", "limit"), reduction_n=2), (1.702, 7.0))
    return fused_activation(fn_specs("swiglu", swiglu_fn, ("alpha", "limit")), (1.702, 7.0), 2)


def _peer_routing(logits, k: int, parts: dict | None):
    """(routing data, gather, scatter) from the peer's own top-k (softmax over the k picked). At tag v3.6.0 one call,
    ``triton_kernels.routing.routing``, as vLLM's gpt-oss path calls it; on triton's main after it the sparse top-k
    and ragged metadata built apart (``topk`` + ``make_ragged_tensor_metadata``)."""
    from triton_kernels.topk import topk

    e = logits.shape[-1]
    if _peer_api() == "v3.6.0":
        from triton_kernels.routing import routing_from_bitmatrix

        # what ``routing(logits, k)`` does, with the top-k kept for the reference check
        vals, indx, bitmatrix = topk(logits, k, apply_softmax=True)
        if parts is not None:
            parts["sparse"] = SimpleNamespace(vals=vals, indx=indx)
        return routing_from_bitmatrix(bitmatrix, vals, indx, e, k)
    from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
    from triton_kernels.tensor import make_ragged_tensor_metadata

    sparse = topk(logits, k, apply_softmax=True)
    if parts is not None:
        parts["sparse"] = sparse
    dispatch = sparse.mask_metadata.row_sorted_indx
    combine = sparse.mask_metadata.col_sorted_indx
    ragged = make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, dispatch.shape[0])
    rdata = RoutingData(sparse.vals.flatten()[combine], ragged.slice_sizes, e, k, ragged)
    return rdata, GatherIndx(combine, dispatch), ScatterIndx(dispatch, combine)


def routing_logits(perm, topw: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Router logits [T, n_experts] fp32 whose top-k, softmaxed over the k picked, is adapt's routing: each token's
    experts (from ``perm``) get log(weight) (``topw`` [T, k] sums to 1 a token), every other expert -1e4. So the
    peer routes the same tokens to the same experts with the same weights, and both move the same expert bytes."""
    t, k = topw.shape
    s = perm.sorted_slot.numel()
    pos = torch.arange(s, device=topw.device)
    expert = torch.searchsorted(perm.expert_offsets[1:].long(), pos, right=True)
    ids = torch.empty(s, dtype=torch.long, device=topw.device)
    ids[perm.sorted_slot.long()] = expert
    logits = torch.full((t, n_experts), -1e4, device=topw.device)
    logits.scatter_(1, ids.view(t, k), topw.float().log())
    return logits


def _peer_variant(peer: dict, x, t: int, e: int, k: int, logits_dtype=torch.float32, parts: dict | None = None,
                  routing: tuple | None = None):
    """The peer's MoE experts at one T: gate-up matmul_ogs (gather, SwiGLU fused) then down matmul_ogs
    (routing weights as ``gammas``, scatter + reduce over the k experts), routing from the peer's own top-k, computed
    once outside the timed call (as adapt's variants get ``perm``), over ``routing_logits`` of adapt's (perm, topw)
    when ``routing`` is given (the same experts and weights as adapt's rows), else over random logits."""
    if routing is not None:
        logits = routing_logits(*routing, e).to(logits_dtype)
    else:
        logits = torch.randn(t, e, device=x.device, dtype=logits_dtype)
    rdata, gather, scatter = _peer_routing(logits, k, parts)
    warps = 4 if t <= 512 else 8
    pc1 = peer["PrecisionConfig"](weight_scale=peer["s1"][warps])
    pc2 = peer["PrecisionConfig"](weight_scale=peer["s2"][warps])
    mm = peer["matmul_ogs"]

    def run():
        y = mm(x, peer["w1"], peer["b1"], rdata, gather_indx=gather, precision_config=pc1,
               fused_activation=peer["act"])
        if parts is not None:
            parts["gemm1"] = y
        # the routing weights as its own integrations pass them: gammas scale each slot's row before
        # the scatter + reduce over the k experts
        return mm(y, peer["w2"], peer["b2"], rdata, scatter_indx=scatter, precision_config=pc2,
                  gammas=rdata.gate_scal)

    return run


PEER_CANDIDATES = (("codes", torch.float32), ("codes", torch.bfloat16), ("downcast", torch.bfloat16))
"""Peer setups tried in order until one gives finite outputs: adapt's MXFP4 codes re-laid out, with
fp32 or bf16 router logits, then the peer's own quantizer over the same weights in bf16."""


def _peer_reference_error(peer_out, parts: dict, x, routed, shape: dict) -> float:
    """||peer - reference|| / ||reference|| for the peer's own routing: float32 torch over adapt's
    dequantized experts with the peer's SwiGLU (interleaved gate/up, alpha 1.702, clamp 7, (up + 1)),
    biases added per expert, outputs weighted by the peer's top-k weights and summed."""
    from adapt.kernels.mxfp4 import dequantize_mxfp4

    idx, vals = parts["sparse"].indx.long(), parts["sparse"].vals.float()
    ref = torch.zeros(x.shape[0], shape["hidden"], device=x.device)
    for ex in idx.unique().tolist():
        rows, slot = (idx == ex).nonzero(as_tuple=True)
        w1 = dequantize_mxfp4(routed.w1_packed[ex], routed.w1_scales[ex], torch.float32, validate=False)
        w2 = dequantize_mxfp4(routed.w2_packed[ex], routed.w2_scales[ex], torch.float32, validate=False)
        h1 = x[rows].float() @ w1.T
        if routed.w1_bias is not None:
            h1 = h1 + routed.w1_bias[ex].float()
        g, u = h1[:, 0::2].clamp(max=7.0), h1[:, 1::2].clamp(-7.0, 7.0)
        h = (g * torch.sigmoid(1.702 * g) * (u + 1)).to(torch.bfloat16).float()
        y = h @ w2.T
        if routed.w2_bias is not None:
            y = y + routed.w2_bias[ex].float()
        ref.index_add_(0, rows, y * vals[rows, slot, None])
    return float((peer_out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


TWIN_CHECK_TOKENS = (1, 16, 256, 4096)
"""T at which the peer runner checks adapt's combined output against the twin's arithmetic."""


def _twin_error(out, x, perm, topw, routed, shape: dict, round_y: bool = True) -> float:
    """||out - twin|| / ||twin|| for adapt's combined output out [T, H]: per active expert the twin's
    arithmetic (``moe_gemm.expert_mlp_torch``: fp32 matmuls on the dequantized MXFP4 weights, SwiGLU,
    h and y rounded to bf16), weighted by ``topw``, summed in fp32 and rounded to bf16 as ``combine``
    does, one expert at a time. round_y False: y stays fp32 before the weighted sum (the fused
    combine of ``moe_planar.planar_moe(fused=True)``)."""
    from adapt.kernels.moe_gemm import split_gate_up, swiglu_torch
    from adapt.kernels.mxfp4 import dequantize_mxfp4

    k = topw.shape[1]
    offs = perm.expert_offsets.tolist()
    slots = perm.sorted_slot.long()
    ref = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for ex in range(len(offs) - 1):
        a, b = offs[ex], offs[ex + 1]
        if a == b:
            continue
        tok, j = slots[a:b] // k, slots[a:b] % k
        w1 = dequantize_mxfp4(routed.w1_packed[ex], routed.w1_scales[ex], torch.float32, validate=False)
        w2 = dequantize_mxfp4(routed.w2_packed[ex], routed.w2_scales[ex], torch.float32, validate=False)
        wg, wu = split_gate_up(w1[None], routed.gate_up_interleaved)
        xs = x[tok].float()
        g, u = xs @ wg[0].t(), xs @ wu[0].t()
        if routed.w1_bias is not None:
            bg, bu = split_gate_up(routed.w1_bias[ex].float()[None, :, None], routed.gate_up_interleaved)
            g, u = g + bg[0, :, 0], u + bu[0, :, 0]
        h = swiglu_torch(g, u, shape["activation"], 1.702, 7.0).to(torch.bfloat16).float()
        y = h @ w2.t()
        if routed.w2_bias is not None:
            y = y + routed.w2_bias[ex].float()
        ref.index_add_(0, tok, (y.to(torch.bfloat16).float() if round_y else y) * topw[tok, j, None])
    ref = ref.to(torch.bfloat16).float()  # the combine's bf16 output
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _warm(fn, seconds: float) -> None:
    """Call fn (synchronizing) for about ``seconds`` so the GPU leaves its idle clocks before timing."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        fn()
        torch.cuda.synchronize()


PARTS_TOKENS = (1, 64)
"""T at which the peer runner also times the planar path's two GEMMs apart (``planar_gemm1/2``)."""


def _planar_parts(x, perm, planar, shape: dict) -> dict:
    """The planar path's GEMM1 (gather + SwiGLU, tile map included) and GEMM2 as separate callables,
    with the table's configs: where the time of ``planar_combine`` goes (the rest: the combine). Their
    rows' rates count both GEMMs' bytes and FLOPs, like the whole path's."""
    from adapt.kernels.moe_configs import pick_planar_configs
    from adapt.kernels.moe_gemm import ACTIVATIONS
    from adapt.kernels.moe_planar import planar_gemm
    from adapt.kernels.moe_tiles import max_m_tiles, tile_map

    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    s = x.shape[0] * k
    c1, c2 = pick_planar_configs(s, e, torch.cuda.get_device_name(x.device) if x.is_cuda else "", h, inter)
    hbuf = torch.empty(s, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(s, h, dtype=torch.bfloat16, device=x.device)
    tiles = tile_map(perm.expert_offsets, c1.block_m, max_m_tiles(s, e, c1.block_m))
    common = dict(top_k=k, alpha=1.702, limit=7.0)
    act = ACTIVATIONS[shape["activation"]]

    def gemm1():
        t = tile_map(perm.expert_offsets, c1.block_m, max_m_tiles(s, e, c1.block_m))
        return planar_gemm(x, planar.w1, planar.w1_bias, perm, t, hbuf, gather=True, activation=act, cfg=c1, **common)

    def gemm2():
        return planar_gemm(hbuf, planar.w2, planar.w2_bias, perm, tiles, y, gather=False, activation=0, cfg=c2,
                           **common)

    return {"planar_gemm1": gemm1, "planar_gemm2": gemm2}


LARGE_MIN_TOKENS = 4096
"""With ``--large`` the FP8 paths (offline, workspace, in-GEMM fold) are timed from this T up."""

_G = GemmConfig
_M256_1 = _G(256, 64, 128, 8, 8, 3, 1, swap_ab=False)
_M256_2 = _G(256, 128, 128, 8, 8, 3, 1, swap_ab=False)
_NOPRE = dict(prefetch_scales=False)
_K64 = _G(128, 128, 64, 8, 8, 3, 1, swap_ab=False, **_NOPRE)
_SWAP64 = _G(128, 128, 64, 8, 8, 3, 1, **_NOPRE)
_N64_2P = _G(128, 64, 64, 8, 4, 3, 2, swap_ab=False, **_NOPRE), _G(128, 128, 64, 8, 4, 3, 2, swap_ab=False, **_NOPRE)
_W8_2P = (_G(128, 64, 64, 8, 8, 3, 2, swap_ab=False, early_up=True, maxnreg=128),
          _G(128, 128, 64, 8, 8, 3, 2, swap_ab=False, maxnreg=128))
_BIG_T = 1 << 30
_GL1 = _G(128, 128, 128, 8, 8, 3, 1, swap_ab=False, gluon=True)
_GL2 = _G(128, 256, 128, 8, 8, 3, 1, swap_ab=False, gluon=True)
_GLM1 = _G(256, 64, 128, 8, 8, 3, 1, swap_ab=False, gluon=True)
_GLM2 = _G(256, 128, 128, 8, 8, 3, 1, swap_ab=False, gluon=True)
_GW1, _GW2 = replace(_GL1, gluon_ws=True), replace(_GL2, gluon_ws=True)
FOLD_SWEEP = {
    # name: (lowest T, highest T, GEMM1 config, GEMM2 config, sign-split words); token-major unless "swap".
    # Call 1 (2026-11-30-s3-prefill, commit efed1d8) timed the first six without the scale prefetch.
    "fp8_fold_m256_combine": (16384, 0, replace(_M256_1, **_NOPRE), replace(_M256_2, **_NOPRE), False),
    "fp8_fold_m256_split_nopre_combine": (16384, 0, replace(_M256_1, **_NOPRE), replace(_M256_2, **_NOPRE), True),
    "fp8_fold_m128k64_combine": (4096, 0, _K64, _K64, False),
    "fp8_fold_swap_k64_combine": (4096, 0, _SWAP64, _SWAP64, False),
    "fp8_fold_swap_k64_split_combine": (16384, 0, _SWAP64, _SWAP64, True),
    "fp8_fold_m128n64_2p_combine": (16384, 0, *_N64_2P, False),
    # call 2 (commit 4bc3f72): the scale prefetch (default on), both tiles decoded before the MMAs, two 8-warp
    # programs per SM; from call 3 only the fastest (m256_split, with the prefetch) is timed
    "fp8_fold_m256_split_combine": (16384, _BIG_T, _M256_1, _M256_2, True),
    "fp8_fold_m256_split_early_combine": (16384, 0, replace(_M256_1, early_up=True), _M256_2, True),
    "fp8_fold_w8_2p_split_combine": (16384, 0, *_W8_2P, True),
    # 2026-12-01 (benchmarks/moe/2026-12-01-s4-fold): the Gluon fold (``moe_gluon``), MMAs of step k in flight
    # while step k + 1 is decoded; the offline tiles (128 x 128 gate + up, 128 x 256), 3- or 4-deep cp.async ring
    "fp8_gluon_split_combine": (4096, _BIG_T, _GL1, _GL2, True),
    "fp8_gluon_combine": (16384, _BIG_T, _GL1, _GL2, False),
    "fp8_gluon_split_s4_combine": (16384, _BIG_T, replace(_GL1, num_stages=4), replace(_GL2, num_stages=4), True),
    "fp8_gluon_split_n128_combine": (16384, _BIG_T, _GL1, replace(_GL2, block_n=128), True),
    # 256 tokens a tile: each decoded weight element feeds twice the tokens (half the decode per FLOP)
    "fp8_gluon_m256_split_combine": (16384, _BIG_T, _GLM1, _GLM2, True),
    "fp8_gluon_m256_split_s4_combine": (16384, _BIG_T, replace(_GLM1, num_stages=4), replace(_GLM2, num_stages=4),
                                        True),
    # round 2 (call 3, commit 2878dba): warp-specialized (``fold_gemm_ws_kernel``): a loader warpgroup issues
    # every global load of the K loop, the MMA warps decode, fence and multiply; bit-equal, 2-3% slower than
    # fp8_gluon_split_combine in the same run, so no longer timed by --large
    "fp8_gluon_ws_split_combine": (16384, 0, _GW1, _GW2, True),
    "fp8_gluon_ws_split_n128_combine": (16384, 0, _GW1, replace(_GW2, block_n=128), True),
    "fp8_gluon_ws_n128_combine": (16384, 0, _GW1, replace(_GW2, block_n=128), False),
    # timing probes of the round-1 kernel (wrong outputs: ``GemmConfig.probe``; only with gluon_check.py, never
    # in --large): no proxy fence; decode of a tile's first two K steps only; both (the MMA + ring floor)
    "fp8_gluon_probe_nofence_split_combine": (16384, 0, replace(_GL1, probe=1), replace(_GL2, probe=1), True),
    "fp8_gluon_probe_nodecode_split_combine": (16384, 0, replace(_GL1, probe=2), replace(_GL2, probe=2), True),
    "fp8_gluon_probe_floor_split_combine": (16384, 0, replace(_GL1, probe=3), replace(_GL2, probe=3), True),
}
"""In-GEMM fold configs timed with ``--large`` (``expert_mlp(compute="fp8_fold")``); each row's output is
checked bit-equal to the offline path's at the same T (``equal_to_offline``)."""


CONVERT_SWEEP = {
    "ws_convert_r16b16w4": (16, 16, 4), "ws_convert_r8b32w8": (8, 32, 8), "ws_convert_r16b32w8": (16, 32, 8),
    "ws_convert_r32b16w8": (32, 16, 8), "ws_convert_r8b16w4": (8, 16, 4), "ws_convert_r8b16w8": (8, 16, 8),
    "ws_convert_r2b16w1": (2, 16, 1), "ws_convert_r4b16w2": (4, 16, 2),
}
"""Word-conversion programs (rows, 32-blocks per step, warps) timed alone beside ``ws_convert_only`` (the
default ``workspace.CONVERT_CONFIG``, (4, 32, 2) from call 8 of 2026-11-30-s3; (4, 16, 2) was the default before)
with ``--large`` above PLANAR_MAX_TOKENS."""


def _convert_all(routed, ws, perm, config=None) -> torch.Tensor:
    """The workspace's conversion alone: every active expert of the layer, chunk by chunk, as
    ``run_layer`` converts them (no GEMMs). Returns one converted row (float32) for the finite check."""
    from adapt.kernels.workspace import convert_experts

    e, c = routed.n_experts, ws.chunk_experts
    for n, lo in enumerate(range(0, e, c)):
        for packed, scales, out, exps in (
            (routed.w1_packed, routed.w1_scales, ws.w1, ws.w1_exp),
            (routed.w2_packed, routed.w2_scales, ws.w2, ws.w2_exp),
        ):
            convert_experts(packed, scales, out, exps, ws.lost, perm.expert_offsets, (lo, min(e, lo + c)),
                            (n % 2) * c, count_loss=False, config=config)
    return ws.w1[0, 0].float()


def _convert_all_planar(planar, ws, perm, config=None) -> torch.Tensor:
    """``_convert_all`` from the planar copy (``moe_planar.planar_to_fp8``), as ``run_layer`` converts a layer
    that holds only that copy."""
    from adapt.kernels.moe_planar import planar_to_fp8

    e, c = planar.n_experts, ws.chunk_experts
    for n, lo in enumerate(range(0, e, c)):
        for p, out, exps in ((planar.w1, ws.w1, ws.w1_exp), (planar.w2, ws.w2, ws.w2_exp)):
            planar_to_fp8(p, out, exps, perm.expert_offsets, (lo, min(e, lo + c)), (n % 2) * c, config)
    return ws.w1[0, 0].float()


def _sliced(x, perm, planar, topw, shape: dict, slice_tokens: int):
    """``planar_moe`` on slices of ``slice_tokens`` tokens (the way to keep the planar path at the token counts its
    tables were measured at; at T = 16384 one call was faster, 2026-12-02-s11 call 1, so the runtime makes one),
    each slice's permutation made here, untimed (the runtime's routing is not in these rows) -> a function
    returning [T, H]."""
    from adapt.kernels.moe_gemm import ACTIVATIONS
    from adapt.kernels.moe_planar import planar_moe
    from adapt.kernels.routing import permute_by_expert

    t, k, e = x.shape[0], shape["top_k"], planar.n_experts
    pos = torch.arange(t * k, device=x.device)
    expert_of_pos = torch.searchsorted(perm.expert_offsets[1:].long(), pos, right=True)
    ids = torch.empty(t * k, dtype=torch.long, device=x.device)
    ids[perm.sorted_slot.long()] = expert_of_pos
    ids = ids.view(t, k)
    parts = [(a, permute_by_expert(ids[a : a + slice_tokens].int(), e)) for a in range(0, t, slice_tokens)]
    act = ACTIVATIONS[shape["activation"]]

    def run():
        return torch.cat([planar_moe(x[a : a + slice_tokens], p, planar, topw[a : a + slice_tokens], top_k=k,
                                     activation=act) for a, p in parts])

    return run


PLANAR_CONVERT_SWEEP = {
    "wsp_convert_r8_u2_w2": (8, 2, 2),
    "wsp_convert_r32_u1_w4": (32, 1, 4),
    "wsp_convert_r32_u2_w4": (32, 2, 4),
    "wsp_convert_r64_u2_w8": (64, 2, 8),
}
"""Programs (rows, steps an iteration, warps) of the conversion from the planar copy timed beside
``wsp_convert_only`` (``moe_planar.PLANAR_CONVERT_CONFIG``) with ``--large`` above PLANAR_MAX_TOKENS."""


def _fused(x, perm, planar, topw, shape: dict, config=None) -> torch.Tensor:
    """The planar experts with the weighted combine in GEMM2's epilogue (``planar_moe(fused=True)``) -> [T, H]."""
    from adapt.kernels.moe_gemm import ACTIVATIONS
    from adapt.kernels.moe_planar import planar_moe

    return planar_moe(x, perm, planar, topw, top_k=shape["top_k"], activation=ACTIVATIONS[shape["activation"]],
                      fused=True, config=config)


ONE_KERNEL_TOKENS = 16
"""Largest T at which the peer runner times the one-kernel planar MLP (``planar_onek*`` rows)."""
ONE_KERNEL_CONFIGS = {
    "planar_onek": {},
    "planar_onek_i128": {"block_i": 128},
    "planar_onek_c168": {"maxnreg": 168},
    "planar_onek_c168_s8": {"maxnreg": 168, "stages2": 8},
    "planar_onek_i128_s6": {"block_i": 128, "stages2": 6},
    "planar_onek_n256_c168": {"block_n2": 256, "stages2": 6, "maxnreg": 168},
}
"""``PlanarMLPConfig`` fields (over its defaults) of each ``planar_onek*`` row. benchmarks/moe/2026-11-30-s3 call 7
(commit 4dfeca5, DeepSeek-V3, us at T = 1 / 16): the default 100.1 / 1,084, block_i 128 105.4 / 874, the 168-register
cap 100.0 / 855; block_n2 64 125.8 / 1,433 and with block_i 128 109.2 / 1,020 (dropped). The ``_s*`` / n256 rows
(GEMM2's n-loop pipelined deeper, more W2 bytes in flight) are not timed yet."""


def _one_kernel(x, perm, planar, topw, shape: dict, fields: dict) -> torch.Tensor:
    """GEMM1 + SwiGLU + GEMM2 + the weighted combine in one kernel (``planar_moe(one_kernel=...)``) -> [T, H]."""
    from adapt.kernels.moe_configs import PlanarMLPConfig
    from adapt.kernels.moe_gemm import ACTIVATIONS
    from adapt.kernels.moe_planar import planar_moe

    return planar_moe(x, perm, planar, topw, top_k=shape["top_k"], activation=ACTIVATIONS[shape["activation"]],
                      one_kernel=PlanarMLPConfig(**fields))


def _combined(mlp, topw, perm):
    """mlp() (expert outputs in sorted slot order) then the weighted combine back to tokens [T, H]."""
    from adapt.kernels.routing import combine

    return lambda: combine(mlp(), topw, perm.slot_pos)


def _picked(name: str, patterns: list[str]) -> bool:
    """True when ``name`` matches one of the shell patterns (``fnmatch.fnmatchcase``)."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def run_peer_bench(out_dir: Path, tokens: list[int] | None = None, shapes: list[str] | None = None,
                   budget_s: float = 1e9, sweep: bool = False, large: bool = False,
                   only: list[str] | None = None) -> dict:
    """The peer beside adapt's MXFP4-storage paths only: same seed and so the same MXFP4 codes as
    ``run_moe_bench``, same CUDA-graph timer, same-run ceilings. adapt's rows include the weighted
    combine of the k expert outputs (``routing.combine``), as the peer's rows include its scatter +
    reduce: ``planar_combine`` and ``planar_fused`` (the combine in GEMM2's epilogue) up to
    PLANAR_MAX_TOKENS (at PARTS_TOKENS also the two GEMMs apart), and with ``large`` above it the online
    FP8 workspace and the offline FP8 copy (``fp8_ws_combine``, ``fp8_offline_combine``). sweep: time the
    PLANAR_SWEEP configs of each T's range too (into ``sweep``: names ending in FUSED_SUFFIX with the
    fused combine, the others the expert GEMMs alone). At the first T of
    each shape the setups of ``PEER_CANDIDATES`` are tried until one gives finite outputs (each try
    recorded, GEMM1 and GEMM2 checked apart), and at T = 16 the peer is checked against a float32
    reference of its own routing (``rel_err_vs_reference``). only: shell patterns (``fnmatch``) of the
    adapt rows and sweep configs to time (None: all; the peer is always timed). Writes moe_bench.json /
    .md to out_dir after every T."""
    from adapt.kernels.moe_gemm import expert_mlp
    from adapt.kernels.moe_planar import PlanarExperts
    from adapt.kernels.moe_weights import FP8Weights, mxfp4_expert_bytes
    from adapt.kernels.workspace import FP8Workspace

    start = time.monotonic()
    tokens, shapes = tokens or DEFAULT_TOKENS, shapes or list(SHAPES)
    ceil = measure_ceilings()
    rows, tries = [], []
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "ceilings": ceil, "rows": rows, "memory": [], "sweep": [],
        "peer": PEER_SOURCE, "peer_api": _peer_api(), "peer_tries": tries,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        (out_dir / "moe_bench.json").write_text(json.dumps(result, indent=1))
        (out_dir / "moe_bench.md").write_text(_markdown(result))

    for name in shapes:
        shape = SHAPES[name]
        torch.manual_seed(0)
        routed, _ = _random_layer(shape, DEVICE)
        e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
        planar = PlanarExperts.from_weights(routed)
        expert_bytes = mxfp4_expert_bytes(h, inter)
        peer, chosen, tried, fp8, warmed = None, None, False, None, False
        for t in tokens:
            if time.monotonic() > start + budget_s:
                rows.append({"shape": name, "tokens": t, "variant": "all", "error": "skipped: time budget"})
                continue
            x, perm, active, topw = _point(t, e, k, h, DEVICE)
            flops, wbytes = 6 * t * k * h * inter, active * expert_bytes
            floor_us = wbytes / (ceil["copy_tbps"] * 1e6)
            variants = {}
            mlp = partial(expert_mlp, x, perm, routed, top_k=k, activation=shape["activation"])
            if t <= PLANAR_MAX_TOKENS:
                variants["planar_combine"] = _combined(partial(mlp, compute="bf16", planar=planar), topw, perm)
                variants["planar_fused"] = partial(_fused, x, perm, planar, topw, shape)
                if t in PARTS_TOKENS:
                    variants |= _planar_parts(x, perm, planar, shape)
                if t <= ONE_KERNEL_TOKENS:
                    for oname, fields in ONE_KERNEL_CONFIGS.items():
                        variants[oname] = partial(_one_kernel, x, perm, planar, topw, shape, fields)
            if large and t >= LARGE_MIN_TOKENS:
                if fp8 is None:
                    fp8 = (FP8Weights.from_mxfp4(routed, validate=False),
                           FP8Workspace(WORKSPACE_CHUNK, h, inter, DEVICE), FP8Workspace(16, h, inter, DEVICE))
                    split = to_sign_split_words(routed.w1_packed), to_sign_split_words(routed.w2_packed)
                variants["fp8_ws_combine"] = _combined(partial(mlp, workspace=fp8[1]), topw, perm)
                variants["fp8_offline_combine"] = _combined(partial(mlp, fp8_weights=fp8[0]), topw, perm)
                # the workspace converting from the planar copy (two chunks of WORKSPACE_CHUNK experts, and of 16,
                # the size that keeps gpt-oss-120b within 0.55x); the runtime converts from the MXFP4 tensors
                pmlp = partial(expert_mlp, x, perm, planar, top_k=k, activation=shape["activation"])
                variants["fp8_wsp_combine"] = _combined(partial(pmlp, workspace=fp8[1]), topw, perm)
                variants["fp8_wsp16_combine"] = _combined(partial(pmlp, workspace=fp8[2]), topw, perm)
                for fname, (lo, hi, c1, c2, sw) in FOLD_SWEEP.items():
                    if lo <= t <= hi:
                        variants[fname] = _combined(partial(mlp, compute="fp8_fold", config=(c1, c2),
                                                            split_words=split if sw else None), topw, perm)
                if t > PLANAR_MAX_TOKENS:
                    variants["ws_convert_only"] = partial(_convert_all, routed, fp8[1], perm)
                    for cname, cc in CONVERT_SWEEP.items():
                        variants[cname] = partial(_convert_all, routed, fp8[1], perm, cc)
                    variants["wsp_convert_only"] = partial(_convert_all_planar, planar, fp8[1], perm)
                    for cname, cc in PLANAR_CONVERT_SWEEP.items():
                        variants[cname] = partial(_convert_all_planar, planar, fp8[1], perm, cc)
                    # without a workspace: the planar path whole (the runtime's, since 2026-12-02-s11) and in slices
                    # of PLANAR_MAX_TOKENS
                    variants["planar_sliced"] = _sliced(x, perm, planar, topw, shape, PLANAR_MAX_TOKENS)
                    variants["planar_combine"] = _combined(partial(mlp, compute="bf16", planar=planar), topw, perm)
            if chosen is None and not tried:
                tried = True
                for source, ldt in PEER_CANDIDATES:
                    if peer is None or peer.get("source") != source:
                        peer = None
                        torch.cuda.empty_cache()
                        got = _peer_setup(routed, shape, source)
                        if isinstance(got, str):
                            tries.append({"shape": name, "source": source, "error": got})
                            continue
                        peer = dict(got, source=source)
                    parts = {}
                    try:
                        out = _peer_variant(peer, x, t, e, k, ldt, parts, (perm, topw))()
                        torch.cuda.synchronize()
                        g1 = bool(torch.isfinite(parts["gemm1"]).all())
                        g2 = bool(torch.isfinite(out).all())
                        tries.append({"shape": name, "source": source, "logits": str(ldt), "tokens": t,
                                      "gemm1_finite": g1, "gemm2_finite": g2,
                                      "gemm1_absmax": float(parts["gemm1"].float().nan_to_num().abs().max())})
                    except Exception as exc:  # noqa: BLE001 - recorded
                        tries.append({"shape": name, "source": source, "logits": str(ldt),
                                      "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                        continue
                    print(f"{name} peer try {tries[-1]}", flush=True)
                    if g1 and g2:
                        chosen = (source, ldt)
                        break
                if chosen is None:
                    peer = None
            if only is not None:
                variants = {n: f for n, f in variants.items() if _picked(n, only)}
            if chosen is not None:
                parts = {}
                variants["peer"] = _peer_variant(peer, x, t, e, k, chosen[1], parts, (perm, topw))
            if not warmed and variants:
                # the first point of a shape ran ~8% slow in call 1 of 2026-11-30-s2 (T = 64 first: DeepSeek-V3
                # 2,324 us, the same kernel 2,133 us a few seconds later): a second of work first. In call 6
                # (2026-11-30-s3) the first row, planar_combine, still read 87 us above the fused row timed next
                # at DeepSeek-V3 T = 64: every adapt variant of the first point now gets its own half second
                _warm(next(iter(variants.values())), 1.0)
                for vname, fn in variants.items():
                    if vname.startswith("planar"):
                        _warm(fn, 0.5)
                warmed = True
            offline_out = ws_out = None
            for vname, fn in variants.items():
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    if not bool(torch.isfinite(out).all()):
                        raise ValueError("output not finite")
                    err = None
                    if vname == "peer" and t == 16:
                        err = _peer_reference_error(out, parts, x, routed, shape)
                    if t in TWIN_CHECK_TOKENS and (vname == "planar_combine" or vname.startswith("planar_onek")
                                                   or (vname == "planar_fused" and t <= 256)):
                        err = _twin_error(out, x, perm, topw, routed, shape, round_y=vname == "planar_combine")
                    if vname == "fp8_offline_combine":
                        offline_out = out
                    if vname == "fp8_ws_combine":
                        ws_out = out
                    same = None
                    if vname in FOLD_SWEEP and offline_out is not None:
                        same = bool(torch.equal(out, offline_out))
                    if vname.startswith("fp8_wsp") and ws_out is not None:  # same e4m3 operands as fp8_ws
                        same = bool(torch.equal(out, ws_out))
                    timing, synced = _time_row(fn, t)
                except Exception as exc:  # noqa: BLE001 - a failed variant is a recorded row
                    rows.append({"shape": name, "tokens": t, "variant": vname, "error": str(exc)[:300]})
                    print(f"{name} T={t} {vname}: FAILED {str(exc)[:200]}", flush=True)
                    continue
                us = timing.median_us
                row = {
                    "shape": name, "tokens": t, "variant": vname, "time_us": us, "active_experts": active,
                    "weight_tbps": wbytes / us / 1e6, "tflops": flops / us / 1e6, "byte_floor_us": floor_us,
                    "x_floor": us / floor_us, "copy_fraction": wbytes / us / 1e6 / ceil["copy_tbps"],
                    "rel_err_vs_reference" if vname == "peer" else "rel_err_vs_twin": err,
                    "timer": timing.mode + (f" ({timing.fallback})" if timing.fallback else "")
                    + (f", {STEADY_BATCH} back to back" if synced is not None else ""),
                    "time_us_synced": synced,
                }
                if vname == "peer":
                    row["peer_setup"] = f"{chosen[0]}, logits {chosen[1]}"
                if same is not None:
                    row["equal_to_ws" if vname.startswith("fp8_wsp") else "equal_to_offline"] = same
                rows.append(row)
                print(f"{name:13s} T={t:6d} {vname:8s} {us:10.1f} us  {row['copy_fraction']:.2f} of copy  "
                      f"{row['tflops']:7.1f} TFLOP/s" + (f"  err {err:.2e}" if err is not None else "")
                      + (f"  equal {same}" if same is not None else ""), flush=True)
            if sweep and t <= PLANAR_MAX_TOKENS:
                configs = {n: ("planar_fused" if n.endswith(FUSED_SUFFIX) else "planar", a, b)
                           for n, ((lo, hi), a, b) in PLANAR_SWEEP.items()
                           if lo <= t <= hi and (only is None or _picked(n, only))}
                result["sweep"] += _sweep(x, perm, routed, None, dict(shape, name=name), flops, start + budget_s,
                                          configs, wbytes, ceil["copy_tbps"], planar, topw)
            save()
        routed = planar = peer = fp8 = None
        torch.cuda.empty_cache()
    save()
    return result

LAYER_MAX_TOKENS = 1024
"""The whole-layer variants are timed up to this T (above it the expert GEMMs dominate)."""


def _variants(
    x, perm, routed, shared, offline, ws, w1t, w2t, gate, bias, router, shape, layer=True, planar=None
) -> dict:
    """The timed callables of one (shape, T) point (``layer``: also the whole-layer variants;
    ``planar``: the experts in the planar layout, timed as ``planar``)."""
    from adapt.kernels.moe_gemm import expert_mlp, moe_forward

    k, act = shape["top_k"], shape["activation"]
    kw = dict(top_k=k, activation=act)
    lw = dict(correction_bias=bias, shared=shared, activation=act)
    variants = {}
    if planar is not None and x.shape[0] <= PLANAR_MAX_TOKENS:
        variants["planar"] = lambda: expert_mlp(x, perm, routed, compute="bf16", planar=planar, **kw)
    variants |= {
        "bf16": lambda: expert_mlp(x, perm, routed, compute="bf16", **kw),
        "fp8": lambda: expert_mlp(x, perm, routed, compute="fp8", **kw),
        "fp8_offline": lambda: expert_mlp(x, perm, routed, fp8_weights=offline, **kw),
        "fp8_ws": lambda: expert_mlp(x, perm, routed, workspace=ws, **kw),
        "torch_grouped_bf16": _torch_grouped(
            lambda: x[perm.sorted_slot.long() // k],
            w1t,
            w2t,
            perm.expert_offsets[1:],
            act,
            shape["interleaved"],
        ),
    }
    if layer and x.shape[0] <= LAYER_MAX_TOKENS:
        variants["layer_bf16"] = lambda: moe_forward(x, gate, routed, router, compute="bf16", **lw)
        variants["layer_fp8"] = lambda: moe_forward(x, gate, routed, router, compute="fp8", **lw)
    return variants


SWEEP_CONFIGS = {
    # name: (compute kind, GEMM1 config, GEMM2 config) as GemmConfig fields
    "stored_128x128x128_s3": (
        "stored",
        (128, 128, 128, 8, 8, 3, 1, False),
        (128, 256, 128, 8, 8, 3, 1, False),
    ),
    "stored_128x128x128_s4": (
        "stored",
        (128, 128, 128, 8, 8, 4, 1, False),
        (128, 128, 128, 8, 8, 4, 1, False),
    ),
    "stored_128x64x128_s4": ("stored", (128, 64, 128, 8, 8, 4, 1, False), (128, 128, 128, 8, 8, 4, 1, False)),
    "stored_128x128x64_s4_nonpersistent": (
        "stored",
        (128, 128, 64, 8, 8, 4, 0, False),
        (128, 256, 64, 8, 8, 4, 0, False),
    ),
    "stored_swap_128x64x128": ("stored", (128, 64, 128, 8, 8, 3, 1, True), (128, 128, 128, 8, 8, 3, 1, True)),
    "fused_128x64x128": ("fused", (128, 64, 128, 8, 8, 3, 1, False), (128, 128, 128, 8, 8, 3, 1, False)),
    "fused_128x32x128": ("fused", (128, 32, 128, 8, 4, 3, 1, False), (128, 64, 128, 8, 4, 3, 1, False)),
}
"""Configs timed at the sweep point (largest T of the first shape) for the e4m3-stored and fused fp8 GEMMs."""

PLANAR_MAX_TOKENS = 4096
"""The planar rows of every T are timed up to this T (above it with ``--large``: the whole-call and sliced planar
rows beside the FP8 paths)."""

_PC = lambda bm, bn, split, stages=4, warps=4, dot1=True, cap=128, pps=0, flat=False: (  # noqa: E731
    bm, bn, split, 4, warps, stages, pps, dot1, cap, flat)
_FLAT4 = {"programs_per_sm": 4, "flatten": True}
PLANAR_SWEEP = {
    # name: (T range, GEMM1, GEMM2): each a PlanarConfig field tuple (_PC(bm, bn, split, stages, warps,
    # one_dot, register cap, programs per SM, flatten)) or a dict of fields replaced in the table's
    # config at that T ({}: the table's own, moe_configs.PLANAR_TABLES). Names ending in FUSED_SUFFIX
    # time ``planar_moe(fused=True)`` (the combine in GEMM2's epilogue: compare with the ``planar_fused``
    # row, the table's configs on the same path); the others the expert GEMMs alone.
    # Call 6 (benchmarks/moe/2026-11-30-s3), what the s2 README left untried:
    # the tile and K loops as one pipelined loop in persistent programs (loads run on across tiles;
    # sm_90 SASS: each wgmma then waits for the one before, where the plain loop keeps 7 in flight)
    "p4f+fc": ((16, 256), _FLAT4, _FLAT4),
    "p5f+fc": ((64, 64), *[{"programs_per_sm": 5, "flatten": True, "num_stages": 3}] * 2),  # 38 KB shared each
    # a 96-register cap: five 4-warp programs an SM where 128 fits four (no spills at 3 stages)
    "c96st3+fc": ((16, 256), *[{"maxnreg": 96, "num_stages": 3}] * 2),
    # gpt-oss T = 64 (GEMM1 K = 2880, 45 tiles of 128 rows an expert): GEMM1 block_n 64 with 3 stages, or
    # split in 2; GEMM2 block_n 64 (N = 2880 = 45 x 64, where 128 leaves a half-empty last tile)
    "g1n64st3+fc": ((64, 64), {"block_n": 64, "num_stages": 3}, {}),
    "g1s2+fc": ((64, 64), {"split_k": 2}, {}),
    "g2n64+fc": ((64, 64), {}, {"block_n": 64}),
    # T = 1: GEMM2 split in 2 with its halves added by the fused combine (no epilogue kernel); GEMM2
    # block_n 128 (448 programs: one wave, where 896 of 101 registers fill 1.7 waves of four an SM);
    # 6 stages for the latency-bound single wave; GEMM1 split in 2 (+ its epilogue kernel); a 64-register
    # cap with 3 stages (eight programs an SM: GEMM2's 896 and a split GEMM1's 1024 in one wave)
    "t1_g2s2+fc": ((1, 1), {}, {"split_k": 2}),
    "t1_g2n128+fc": ((1, 1), {}, {"block_n": 128}),
    "t1_st6+fc": ((1, 1), {"num_stages": 6}, {"num_stages": 6}),
    "t1_g1s2+fc": ((1, 1), {"split_k": 2}, {}),
    "t1_c64+fc": ((1, 1), *[{"maxnreg": 64, "num_stages": 3}] * 2),
    "t1_g1s2_c64+fc": ((1, 1), {"split_k": 2, "maxnreg": 64, "num_stages": 3}, {"maxnreg": 64, "num_stages": 3}),
    # Session 4 (benchmarks/moe/2026-12-01-s4-small). sm_90 SASS of one 128-K step (sass_report.py, CPU):
    # a warp's loop is about 120 instructions of loads, addresses, wgmma and barriers whatever its rows,
    # plus 14.5 of decode per packed word, so 32 rows a warp (block_n 128 with 4 warps: 406 a step,
    # 25 a word) issue 17% fewer instructions per weight byte than 16 (block_n 64: 245, 31 a word).
    # T = 1: block_n 128 with split-K keeps the table's program count (GEMM1 2 x 256, GEMM2 2 x 448)
    # where block_n 128 alone halved it (91.6 us); 8 warps on 256 rows (two warpgroups, 32 rows a
    # warp) split in 4. Call 1 of 2026-12-01-s4-small (commit f3a639c, vs the table's 88.6 / 48.6 us with the
    # combine, DeepSeek-V3 / gpt-oss): 89.2 / 48.4, GEMM1 only 86.5 / 51.0, GEMM2 only 87.2 / 46.5, split 4
    # 91.8 / 47.6, 8 warps 101.8 / 50.8: within the spread, the table stays
    "s4_t1_n128s2+fc": ((1, 1), *[{"block_n": 128, "split_k": 2}] * 2),
    "s4_t1_g1n128s2+fc": ((1, 1), {"block_n": 128, "split_k": 2}, {}),
    "s4_t1_g2n128s2+fc": ((1, 1), {}, {"block_n": 128, "split_k": 2}),
    "s4_t1_n128s4+fc": ((1, 1), *[{"block_n": 128, "split_k": 4}] * 2),
    "s4_t1_w8n256s4+fc": ((1, 1), *[{"block_n": 256, "num_warps": 8, "split_k": 4}] * 2),
    # T = 16 / 64: 256 rows a tile on 8 warps (32 rows a warp, as the table's 128 on 4; SASS 122
    # registers, no spill, 67 KB shared at 4 stages): half the tiles, so half the per-tile pipeline
    # fills and epilogues (gpt-oss GEMM1: K = 2880 is 23 steps a tile, DeepSeek-V3's 7168 is 56). Call 1
    # (vs the table's 719.8 / 1,557.4 us DeepSeek-V3 T = 16 / 64, 246.7 / 483.5 gpt-oss): 6-15% slower each
    "s4_g1w8n256+fc": ((16, 64), {"block_n": 256, "num_warps": 8}, {}),
    "s4_w8n256+fc": ((16, 64), *[{"block_n": 256, "num_warps": 8}] * 2),
    "s4_g1w8n256st3+fc": ((16, 64), {"block_n": 256, "num_warps": 8, "num_stages": 3}, {}),
    # Session 10 (benchmarks/moe/2026-12-02-s10): stream-K (``PlanarConfig.stream_k``): the table's tiles in
    # persistent programs (4 an SM where 128 registers and 42 KB of shared memory fit four), each one equal run of
    # the tiles x K steps, so no last partial wave; GEMM1's sums through an fp32 buffer and the epilogue kernel
    "s10_sk4+fc": ((1, 256), *[{"programs_per_sm": 4, "stream_k": True}] * 2),
    "s10_sk4g1+fc": ((1, 256), {"programs_per_sm": 4, "stream_k": True}, {}),
    "s10_sk4g2+fc": ((1, 256), {}, {"programs_per_sm": 4, "stream_k": True}),
    "s10_sk3+fc": ((16, 256), *[{"programs_per_sm": 3, "stream_k": True}] * 2),
    "s10_sk2+fc": ((1024, 1024), *[{"programs_per_sm": 2, "stream_k": True}] * 2),  # 64 x 128 tiles, 8 warps
}
FUSED_SUFFIX = "+fc"
"""Planar configs timed at each T in their range (``--planar-sweep``)."""

SMALL_T_SWEEP = {
    "bf16_16x32x128_s6 (default)": ("bf16", (16, 32, 128, 4, 4, 6, 4), (16, 64, 128, 4, 4, 6, 4)),
    "bf16_16x32x256_s4": ("bf16", (16, 32, 256, 4, 4, 4, 4), (16, 64, 256, 4, 4, 4, 4)),
    "bf16_16x64x128_s4_w8": ("bf16", (16, 64, 128, 4, 8, 4, 2), (16, 128, 128, 4, 8, 4, 2)),
    "bf16_16x32x128_s6_nonpersistent": ("bf16", (16, 32, 128, 4, 4, 6, 0), (16, 64, 128, 4, 4, 6, 0)),
}
"""Fused bf16 configs timed at the small-T points of ``--quick-acceptance`` (T <= 64)."""


def _planar_config(c, i: int, x, shape: dict):
    """A PLANAR_SWEEP entry's config i (0 GEMM1, 1 GEMM2): a field tuple, or a dict of fields replaced
    in the table's config at this point."""
    from adapt.kernels.moe_configs import PlanarConfig, pick_planar_configs

    if not isinstance(c, dict):
        return PlanarConfig(*c)
    table = pick_planar_configs(x.shape[0] * shape["top_k"], shape["experts"], torch.cuda.get_device_name(x.device)
                                if x.is_cuda else "", shape["hidden"], shape["intermediate"])[i]
    return dataclasses.replace(table, **c)


def _sweep(
    x, perm, routed, offline, shape, flops, deadline, configs=SWEEP_CONFIGS, wbytes=0, copy_tbps=1.0, planar=None,
    topw=None,
) -> list[dict]:
    """Time ``configs`` at one point; wbytes: MXFP4 bytes of the active experts (for the copy fraction).
    Kind "planar_fused" (with topw): the planar GEMMs with the combine in GEMM2's epilogue, output
    [T, H]. Planar rows record ``rel_err_vs_table``: their output against the same path with the
    table's configs (a config that computes something else shows here)."""
    from adapt.kernels.moe_configs import GemmConfig
    from adapt.kernels.moe_gemm import expert_mlp

    rows = []
    refs = {}
    for name, (kind, a, b) in configs.items():
        if time.monotonic() > deadline:
            break
        if kind.startswith("planar"):
            cfg = tuple(_planar_config(c, i, x, shape) for i, c in enumerate((a, b)))
        else:
            cfg = (GemmConfig(*a), GemmConfig(*b))
        extra = {
            "stored": {"fp8_weights": offline},
            "fused": {"compute": "fp8"},
            "bf16": {"compute": "bf16"},
            "planar": {"compute": "bf16", "planar": planar},
            "planar_fused": {},
        }[kind]
        if kind == "planar_fused":
            fn = partial(_fused, x, perm, planar, topw, shape, cfg)
        else:
            fn = lambda cfg=cfg, extra=extra: expert_mlp(  # noqa: E731
                x, perm, routed, top_k=shape["top_k"], activation=shape["activation"], config=cfg, **extra
            )
        err = None
        try:
            if kind.startswith("planar"):
                if kind not in refs:
                    refs[kind] = (_fused(x, perm, planar, topw, shape) if kind == "planar_fused" else
                                  expert_mlp(x, perm, routed, top_k=shape["top_k"], activation=shape["activation"],
                                             **extra)).float()
                got = fn().float()
                err = float((got - refs[kind]).norm() / refs[kind].norm().clamp_min(1e-30))
            us = graph_time_us(fn, reps=5)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or run is recorded
            rows.append({"config": name, "error": str(exc)[:300]})
            print(f"sweep {name}: FAILED {str(exc)[:200]}", flush=True)
            continue
        rows.append(
            {
                "config": name,
                "shape": shape.get("name", ""),
                "kind": kind,
                "tokens": x.shape[0],
                "time_us": us,
                "tflops": flops / us / 1e6,
                "copy_fraction": wbytes / us / 1e6 / copy_tbps,
                "rel_err_vs_table": err,
            }
        )
        print(
            f"sweep T={x.shape[0]} {name:36s} {us:10.1f} us {flops / us / 1e6:7.1f} TFLOP/s "
            f"{rows[-1]['copy_fraction']:.2f} of copy" + (f" err {err:.1e}" if err is not None else ""),
            flush=True,
        )
    return rows


def _bench_shape(
    name: str,
    shape: dict,
    tokens: list[int],
    ceil: dict,
    rows: list,
    deadline: float,
    save,
    sweep: list | None,
    layer: bool = True,
    small_sweep: list | None = None,
    planar_sweep: list | None = None,
    memory: bool = True,
    only: set | None = None,
) -> dict:
    """Time every variant of one shape, appending to ``rows`` (``save()`` after each T); runs the
    config sweep at the largest T when ``sweep`` is a list; stops timing once ``deadline`` passes.
    layer: also time the whole-layer variants (``moe_forward``). small_sweep: a list to time
    SMALL_T_SWEEP into at every T <= 64. planar_sweep: a list to time PLANAR_SWEEP into (each config
    at the T of its range). memory: also measure expert memory, peaks and the conversion rates."""
    from adapt.kernels.moe_gemm import expert_mlp
    from adapt.kernels.moe_planar import PlanarExperts
    from adapt.kernels.moe_weights import FP8Weights, mxfp4_expert_bytes
    from adapt.kernels.mxfp4 import dequantize_mxfp4
    from adapt.kernels.routing import RouterConfig, permute_by_expert
    from adapt.kernels.workspace import FP8Workspace

    dev = DEVICE
    twin_tolerance = load_gates()["kernels"]["max_twin_rel_error_gpu"]
    torch.manual_seed(0)
    routed, shared = _random_layer(shape, dev)
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    act = shape["activation"]
    offline = FP8Weights.from_mxfp4(routed, validate=False)
    ws = FP8Workspace(WORKSPACE_CHUNK, h, inter, dev)
    ws_lost = ws.record_fold_loss(routed)
    w1t = dequantize_mxfp4(routed.w1_packed, routed.w1_scales, torch.bfloat16, validate=False).transpose(1, 2)
    w2t = dequantize_mxfp4(routed.w2_packed, routed.w2_scales, torch.bfloat16, validate=False).transpose(1, 2)
    gate = torch.randn(e, h, device=dev) * 0.02
    bias = torch.randn(e, device=dev) * 0.01 if shape["scoring"] == "sigmoid" else None
    router = RouterConfig(
        top_k=k,
        scoring=shape["scoring"],
        n_group=shape["n_group"],
        topk_group=shape["topk_group"],
        routed_scaling=shape["routed_scaling"],
    )
    expert_bytes = mxfp4_expert_bytes(h, inter)
    planar = PlanarExperts.from_weights(routed)
    peer = _peer_setup(routed, shape) if only is None or "peer" in only else "not requested"
    if isinstance(peer, str):
        print(f"{name}: peer not timed: {peer}", flush=True)
        rows.append({"shape": name, "tokens": 0, "variant": "peer", "error": peer})
    shape = dict(shape, name=name)
    for t in tokens:
        if time.monotonic() > deadline:
            print(f"{name} T={t}: skipped (time budget)", flush=True)
            rows.append({"shape": name, "tokens": t, "variant": "all", "error": "skipped: time budget"})
            continue
        x, perm, active, topw = _point(t, e, k, h, dev)
        flops = 6 * t * k * h * inter
        wbytes = active * expert_bytes
        floor_us = wbytes / (ceil["copy_tbps"] * 1e6)
        variants = _variants(
            x, perm, routed, shared, offline, ws, w1t, w2t, gate, bias, router, shape, layer, planar
        )
        if not isinstance(peer, str):
            try:
                variants["peer"] = _peer_variant(peer, x, t, e, k, routing=(perm, topw))
            except Exception as exc:  # noqa: BLE001 - recorded; adapt's rows go on
                rows.append({"shape": name, "tokens": t, "variant": "peer", "error": f"routing: {exc}"[:300]})
        if only is not None:
            variants = {n: f for n, f in variants.items() if n in only or n == "bf16"}
        ref = variants["bf16"]().float()
        twins = _twin_outputs({TWIN_OF[n] for n in variants if n in TWIN_OF}, x, perm, routed, shared, gate, bias,
                              router, shape)
        if sweep is not None and t == max(tokens):
            sweep += _sweep(x, perm, routed, offline, shape, flops, deadline)
        for vname, fn in variants.items():
            try:
                err = None
                if vname == "peer":
                    # the peer routes by its own top-k, so its output is not comparable with ref:
                    # check that it is finite and of the right shape only
                    out = fn()
                    if tuple(out.shape) != tuple(ref.shape) or not bool(torch.isfinite(out).all()):
                        raise ValueError(f"peer output shape {tuple(out.shape)} or values not finite")
                else:
                    out = fn().float()
                    if not vname.startswith("layer"):
                        err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
                timing, synced = _time_row(fn, t)
                us = timing.median_us
            except Exception as exc:  # noqa: BLE001 - a failed variant is a recorded row, the others go on
                rows.append({"shape": name, "tokens": t, "variant": vname, "error": str(exc)[:300]})
                print(f"{name} T={t} {vname}: FAILED {str(exc)[:200]}", flush=True)
                continue
            row = {
                "shape": name,
                "tokens": t,
                "variant": vname,
                "time_us": us,
                "active_experts": active,
                "weight_tbps": wbytes / us / 1e6,
                "tflops": flops / us / 1e6,
                "byte_floor_us": floor_us,
                "x_floor": us / floor_us,
                "copy_fraction": wbytes / us / 1e6 / ceil["copy_tbps"],
                "rel_diff_vs_bf16": err,
                "timer": timing.mode + (f" ({timing.fallback})" if timing.fallback else "")
                + (f", {STEADY_BATCH} back to back" if synced is not None else ""),
                "time_us_synced": synced,
                **_twin_fields(vname, out, twins, twin_tolerance),
            }
            rows.append(row)
            print(
                f"{name:13s} T={t:6d} {vname:19s} {us:10.1f} us  {row['weight_tbps']:5.2f} TB/s "
                f"({row['copy_fraction']:.2f} of copy)  {row['tflops']:7.1f} TFLOP/s  "
                f"x{row['x_floor']:.2f} floor" + (f"  diff {err:.2e}" if err is not None else ""),
                flush=True,
            )
        if small_sweep is not None and t <= 64:
            small_sweep += _sweep(
                x, perm, routed, offline, shape, flops, deadline, SMALL_T_SWEEP, wbytes, ceil["copy_tbps"]
            )
        if planar_sweep is not None:
            chosen = {n: (c[1], c[2]) for n, c in PLANAR_SWEEP.items()
                      if c[0][0] <= t <= c[0][1] and not n.endswith(FUSED_SUFFIX)}
            planar_sweep += _sweep(
                x,
                perm,
                routed,
                offline,
                shape,
                flops,
                deadline,
                {n: ("planar", a, b) for n, (a, b) in chosen.items()},
                wbytes,
                ceil["copy_tbps"],
                planar,
            )
        save()
    torch.cuda.synchronize()
    mem = {
        "shape": name,
        "planar_bytes": planar.nbytes(),
        "mxfp4_expert_bytes": routed.nbytes(),
        "fp8_offline_bytes": offline.nbytes(),
        "workspace_bytes": ws.nbytes,
        "workspace_chunk_experts": WORKSPACE_CHUNK,
        "fold_lost_elements_offline": int(offline.lost.item()),
        "fold_lost_elements_ws": ws_lost,
        "moe_layers": shape["moe_layers"],
    }
    mem["layer_ratio_online_vs_offline"] = (mem["mxfp4_expert_bytes"] + mem["workspace_bytes"]) / mem[
        "fp8_offline_bytes"
    ]
    n_l = shape["moe_layers"]
    mem["model_ratio_online_vs_offline"] = (n_l * mem["mxfp4_expert_bytes"] + mem["workspace_bytes"]) / (
        n_l * mem["fp8_offline_bytes"]
    )
    mem["model_ratio_planar_online_vs_offline"] = (n_l * mem["planar_bytes"] + mem["workspace_bytes"]) / (
        n_l * mem["fp8_offline_bytes"]
    )
    if not memory:
        return mem
    # peak device memory of one layer's online and offline fp8 path at the largest T, beyond the weights
    t = max(tokens)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    _, ids = _uniform_routing(t, e, k, dev)
    perm = permute_by_expert(ids, e)
    for label, kwargs in (
        ("online_ws", {"workspace": ws}),
        ("offline", {"fp8_weights": offline}),
        ("online_fused", {"compute": "fp8"}),
    ):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        expert_mlp(x, perm, routed, top_k=k, activation=act, **kwargs)
        torch.cuda.synchronize()
        mem[f"peak_activation_bytes_{label}"] = torch.cuda.max_memory_allocated() - base
    mem["conversion"] = _conversion_rates(routed, ws)
    print(json.dumps(mem), flush=True)
    return mem


def _conversion_rates(routed, ws) -> dict:
    """Workspace conversion alone: one chunk of experts (all active) MXFP4 -> e4m3 into the
    workspace, TB/s of bytes read (codes + scales twice) + written (e4m3 + row exponents), for the
    hot-path word kernel and the load-time counting kernel."""
    from adapt.kernels.workspace import convert_experts

    c = ws.chunk_experts
    every = torch.arange(routed.n_experts + 1, dtype=torch.int32, device=ws.w1.device)
    h, i = routed.hidden, routed.intermediate
    moved = c * (3 * h * i * 17 // 32 + 3 * h * i // 16 + 3 * h * i + 4 * (2 * i + h))
    out = {"experts": c, "bytes": moved}
    for label, count in (("words", False), ("counting", True)):

        def conv(count=count):
            for packed, scales, dst, exps in (
                (routed.w1_packed, routed.w1_scales, ws.w1, ws.w1_exp),
                (routed.w2_packed, routed.w2_scales, ws.w2, ws.w2_exp),
            ):
                convert_experts(packed, scales, dst, exps, ws.lost, every, (0, c), 0, count_loss=count)

        us = graph_time_us(conv, reps=10)
        out[f"{label}_us"] = us
        out[f"{label}_tbps"] = moved / us / 1e6
    return out


QUICK = dict(shapes=["deepseek-v3"], tokens=[16384, 64, 1])
"""``--quick-acceptance``: the points the issue's acceptance lines name (largest first, so a tight
time budget cuts the small-T config sweep, timed after each small T's variants, first)."""


FUSED_MXFP4 = ("planar", "bf16", "fp8")
"""Variants that read the MXFP4 experts inside the GEMM (issue 4's "fused MXFP4" lines take the best)."""


def _best(rows: list[dict], tokens: int, names, key: str, low: bool) -> tuple[float | None, str | None]:
    """(value, variant) of the best DeepSeek-V3 row at ``tokens`` among ``names`` (lowest when ``low``)."""
    found = [(row[key], n) for n in names
             if (row := find_row(rows, shape="deepseek-v3", tokens=tokens, variant=n)) is not None]
    return (min if low else max)(found) if found else (None, None)


def _field(rows: list[dict], tokens: int, variant: str, key: str) -> float | None:
    row = find_row(rows, shape="deepseek-v3", tokens=tokens, variant=variant)
    return None if row is None else row[key]


def _time_ratio(rows: list[dict], tokens: int, num: str, den: str) -> float | None:
    a, b = _field(rows, tokens, num, "time_us"), _field(rows, tokens, den, "time_us")
    return None if a is None or b is None else a / b


def moe_criteria() -> list[tuple[Criterion, str]]:
    """Issue 4's acceptance lines on the DeepSeek-V3 rows, each with the variant(s) it reads."""
    return [
        (Criterion("T=64 fused MXFP4 >= 0.85 of copy on MXFP4 bytes",
                   lambda rows: _best(rows, 64, FUSED_MXFP4, "copy_fraction", False)[0], ">=", 0.85), "best fused"),
        (Criterion("T=1 fused within 1.6x of the byte floor",
                   lambda rows: _best(rows, 1, FUSED_MXFP4, "x_floor", True)[0], "<=", 1.6), "best fused"),
        (Criterion("T=16384 fp8 >= 800 TFLOP/s", lambda rows: _field(rows, 16384, "fp8_offline", "tflops"),
                   ">=", 800), "fp8_offline"),
        (Criterion("T=16384 >= 1.5x torch grouped bf16",
                   lambda rows: _time_ratio(rows, 16384, "torch_grouped_bf16", "fp8_offline"), ">=", 1.5),
         "fp8_offline"),
        (Criterion("T=16384 online within 5% of offline",
                   lambda rows: _time_ratio(rows, 16384, "fp8_ws", "fp8_offline"), "<=", 1.05), "fp8_ws"),
    ]


def acceptance(result: dict) -> list[dict]:
    """The acceptance lines evaluated on the measured rows (``adapt.bench.acceptance.evaluate``; a
    missing row leaves its line unmet), each with the variant that gave the value (``path``)."""
    rows = result["rows"]
    criteria = moe_criteria()
    lines = evaluate([c for c, _ in criteria], rows)
    for line, (_, path) in zip(lines, criteria, strict=True):
        if path == "best fused":
            tokens, key, low = (64, "copy_fraction", False) if line["criterion"].startswith("T=64") else (
                1, "x_floor", True)
            path = _best(rows, tokens, FUSED_MXFP4, key, low)[1]
        line["path"] = path
    return lines


def moe_report(result: dict) -> StageReport:
    """The run as a stage-6 StageReport (stage ``bench-moe``): every row, issue 4's lines, and the twin
    error of every timed row."""
    prov = {k: result[k] for k in ("date", "commit", "torch", "triton") if k in result}
    prov["device"] = result.get("gpu", "")
    return benchmark_report("moe", "MoE experts at real shapes", result["rows"], [c for c, _ in moe_criteria()],
                            provenance=prov, ceilings=result.get("ceilings"))


def _markdown(result: dict) -> str:
    c = result["ceilings"]
    lines = [
        "# MoE kernel benchmark\n",
        f"- date: {result['date']}",
        f"- commit: {result['commit']}",
        f"- GPU: {result['gpu']}, torch {result['torch']}, triton {result['triton']}",
        f"- ceilings (same run): copy {c['copy_tbps']:.2f} TB/s "
        f"(best of: torch copy_ {c['copy_torch_tbps']:.2f}, "
        f"Triton copy 4 warps {c['copy_triton_w4_tbps']:.2f}, 8 warps {c['copy_triton_w8_tbps']:.2f}; "
        f"{c['copy_bytes_each_way'] / 2**30:.0f} GiB each way, read + write counted), bf16 matmul "
        f"{c['bf16_matmul_tflops']:.0f} TFLOP/s, "
        f"fp8 _scaled_mm {c['fp8_matmul_tflops']:.0f} TFLOP/s (8192^3)",
        "",
        "Times are medians of CUDA-graph replays (us). TB/s on MXFP4 bytes of the active experts; "
        "TFLOP/s on 6*T*k*H*I; x floor = time / (MXFP4 bytes / copy bandwidth).",
        "",
        "| shape | T | variant | time us | TB/s | of copy | TFLOP/s | x floor | vs torch grouped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {
        (r["shape"], r["tokens"]): r["time_us"]
        for r in result["rows"]
        if r.get("variant") == "torch_grouped_bf16" and "time_us" in r
    }
    for r in result["rows"]:
        if "time_us" not in r:
            lines.append(
                f"| {r['shape']} | {r['tokens']} | {r['variant']} | failed: {r['error'][:80]} | | | | | |"
            )
            continue
        b = base.get((r["shape"], r["tokens"]))
        speed = f"{b / r['time_us']:.2f}x" if b else ""
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['time_us']:.1f} | "
            f"{r['weight_tbps']:.2f} | "
            f"{r['copy_fraction']:.2f} | {r['tflops']:.1f} | {r['x_floor']:.2f} | {speed} |"
        )
    lines += [
        "",
        "## Expert memory",
        "",
        "| shape | MXFP4 GB | planar GB | FP8 offline GB | workspace GB | layer ratio | "
        "model ratio (all MoE layers, one workspace) | same, planar storage | lost elements (fold) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in result["memory"]:
        if "layer_ratio_online_vs_offline" not in m:
            continue
        lines.append(
            f"| {m['shape']} | {m['mxfp4_expert_bytes'] / 1e9:.2f} | {m['planar_bytes'] / 1e9:.2f} | "
            f"{m['fp8_offline_bytes'] / 1e9:.2f} | "
            f"{m['workspace_bytes'] / 1e9:.2f} | {m['layer_ratio_online_vs_offline']:.3f} | "
            f"{m['model_ratio_online_vs_offline']:.3f} ({m['moe_layers']} layers) | "
            f"{m['model_ratio_planar_online_vs_offline']:.3f} | "
            f"{m['fold_lost_elements_offline']} |"
        )
    conv = [m for m in result["memory"] if "conversion" in m]
    if conv:
        lines += [
            "",
            "## Workspace conversion alone (one chunk, all experts active)",
            "",
            "| shape | experts | word kernel us | TB/s | counting kernel us | TB/s |",
            "|---|---|---|---|---|---|",
        ]
        for m in conv:
            c = m["conversion"]
            lines.append(
                f"| {m['shape']} | {c['experts']} | {c['words_us']:.1f} | {c['words_tbps']:.2f} | "
                f"{c['counting_us']:.1f} | {c['counting_tbps']:.2f} |"
            )
    if result.get("acceptance"):
        lines += [
            "",
            "## Acceptance (this run)",
            "",
            "| criterion | value | path | met |",
            "|---|---|---|---|",
        ]
        for a in result["acceptance"]:
            v = "" if a["value"] is None else f"{a['value']:.3f}"
            lines.append(f"| {a['criterion']} | {v} | {a['path']} | {a['met']} |")
    if result.get("sweep"):
        lines += [
            "",
            "## Config sweep (first shape)",
            "",
            "| config | shape | T | time us | TFLOP/s | of copy (MXFP4 bytes) |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["sweep"]:
            if "time_us" in r:
                frac = f"{r['copy_fraction']:.2f}" if r.get("copy_fraction") else ""
                head = f"| {r['config']} | {r.get('shape', '')} | {r.get('tokens', '')} | {r['time_us']:.1f}"
                lines.append(f"{head} | {r['tflops']:.1f} | {frac} |")
            else:
                lines.append(f"| {r['config']} | | | failed: {r['error'][:80]} | | |")
    return "\n".join(lines) + "\n"


def run_moe_bench(
    out_dir: Path,
    tokens: list[int] | None = None,
    shapes: list[str] | None = None,
    budget_s: float = 1e9,
    sweep: bool = True,
    quick: bool = False,
    planar_sweep: bool = False,
    layer: bool = True,
    memory: bool = True,
    variants: list[str] | None = None,
) -> dict:
    """Run the MoE benchmark on the current CUDA device; write moe_bench.json / .md to out_dir
    (rewritten after every T, so a run cut short keeps what it measured). budget_s: seconds after
    which remaining points are recorded as skipped. sweep: time SWEEP_CONFIGS at the largest T of
    the first shape. quick: only the acceptance points (``QUICK``; no sweep, no whole-layer
    variants). Every save also sets the ``acceptance`` lines and writes the StageReport
    (``moe_report.json`` / ``.md``, ``moe_report``). planar_sweep: time PLANAR_SWEEP at every T
    of every shape. layer / memory: time the whole-layer variants / measure expert memory.
    variants: names of the variants to time (all when None)."""
    start = time.monotonic()
    if quick:
        tokens, shapes, sweep = tokens or QUICK["tokens"], QUICK["shapes"], False
    if not torch.cuda.is_available():
        raise InputError("the MoE benchmark needs a CUDA GPU", hint="run it on the target machine")
    tokens = tokens or DEFAULT_TOKENS
    shapes = shapes or list(SHAPES)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise InputError(
            f"unknown MoE shape(s) {unknown}", field="shapes", hint=f"choose from {sorted(SHAPES)}"
        )
    ceil = measure_ceilings()
    print(json.dumps(ceil), flush=True)
    rows, mems, sweep_rows = [], [], []
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ceilings": ceil,
        "rows": rows,
        "memory": mems,
        "sweep": sweep_rows,
        "peer": PEER_SOURCE + " when importable (rows named peer); else a row with the reason",
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        result["acceptance"] = acceptance(result)
        (out_dir / "moe_bench.json").write_text(json.dumps(result, indent=1))
        (out_dir / "moe_bench.md").write_text(_markdown(result))
        report = moe_report(result)
        (out_dir / "moe_report.json").write_text(report.to_json())
        (out_dir / "moe_report.md").write_text(report.to_markdown())

    deadline = start + budget_s
    for i, s in enumerate(shapes):
        mems.append(
            _bench_shape(
                s,
                SHAPES[s],
                tokens,
                ceil,
                rows,
                deadline,
                save,
                sweep_rows if sweep and i == 0 else None,
                layer=layer and not quick,
                small_sweep=sweep_rows if quick else None,
                planar_sweep=sweep_rows if planar_sweep else None,
                memory=memory,
                only=set(variants) if variants else None,
            )
        )
        save()
    return result


# ----------------------------------------------------------------------------------------------
# expert formats: FP8-block and bf16 experts through the same grouped kernels, beside torch
# ----------------------------------------------------------------------------------------------

FORMAT_VARIANTS = ("fp8_block_w8a8", "bf16_experts", "torch_grouped_bf16", "torch_fp8_block_scaled_mm",
                   "fp8_block_w8a16", "fp8_block_w8a8_stored_tiles")
"""Timed in this order at every T (a variant the time budget cuts is recorded as skipped):
adapt's grouped GEMMs on FP8-block experts with e4m3 activations per 1x128 group (DeepSeek-V3's W8A8),
on bf16 experts, torch ``_grouped_mm`` on the same bf16 experts, torch ``_scaled_mm`` (1x128 x 128x128
block scales) per active expert on the FP8-block experts, and adapt on FP8-block experts with bf16
activations (W8A16); at T >= 4096 also W8A8 on the fp8_stored tiles (the offline FP8 path's configs) to
compare with the default's narrower n-tile."""


def format_bytes(variant: str, active: int, hidden: int, inter: int) -> int:
    """Weight bytes a variant must read: each active expert's three matrices once; bf16 2 bytes per
    weight, FP8-block 1 byte plus one fp32 scale per 128 x 128 block."""
    if variant.startswith(("fp8_block", "torch_fp8")):
        blocks = -(-2 * inter // 128) * -(-hidden // 128) + -(-hidden // 128) * -(-inter // 128)
        return active * (3 * hidden * inter + 4 * blocks)
    return active * 6 * hidden * inter


def _format_layer(shape: dict, device: str):
    """Random experts of one shape in both formats: bf16 N(0, 0.02) [E, 2I, H] / [E, H, I], and FP8 with
    128 x 128 block scales: random e4m3 bytes (NaN codes replaced by 0) times scales 2**-14..2**-10."""
    from adapt.kernels.moe_weights import StackedExperts

    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    il = shape["interleaved"]
    bf = StackedExperts(torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) * 0.02,
                        torch.randn(e, h, i, device=device, dtype=torch.bfloat16) * 0.02, gate_up_interleaved=il)

    def fp8(n, k):
        b = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, device=device)
        b[(b & 0x7F) == 0x7F] = 0
        sc = torch.pow(2.0, torch.randint(-14, -9, (e, -(-n // 128), -(-k // 128)), device=device).float())
        return b.view(torch.float8_e4m3fn), sc

    q1, s1 = fp8(2 * i, h)
    q2, s2 = fp8(h, i)
    return bf, StackedExperts(q1, q2, s1, s2, gate_up_interleaved=il)


def _scaled_mm_block(a, sa, w, sw, layout: int):
    """torch ``_scaled_mm`` with DeepSeek block scales: a e4m3 [m, K] (scales fp32 [m, K/128]) times
    w e4m3 [N, K] (scales [N/128, K/128]) -> bf16 [m, N]; m padded to a multiple of 4 (cuBLASLt).
    layout: which memory order of the scale tensors to pass (0: a's scales column-major, w's as the
    transpose of [N/128, K/128]; 1: both contiguous)."""
    m = a.shape[0]
    pad = (-m) % 4
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
        sa = torch.cat([sa, sa.new_ones(pad, sa.shape[1])])
    if layout == 0:
        sa_arg, sw_arg = sa.t().contiguous().t(), sw.t()
    else:
        sa_arg, sw_arg = sa.contiguous(), sw.t().contiguous()
    out = torch._scaled_mm(a, w.t(), scale_a=sa_arg, scale_b=sw_arg, out_dtype=torch.bfloat16)
    return out[:m]


def _torch_fp8_block(x, perm, fp8w, shape, layout: int):
    """Baseline: per active expert, torch ``_scaled_mm`` with 1x128 activation and 128x128 weight scales
    (GEMM1), SwiGLU in fp32, e4m3 1x128 again, ``_scaled_mm`` (GEMM2); expert ranges read once on the host
    (outside the timed call), so the per-expert launches are captured in the CUDA graph."""
    from adapt.kernels.fp8 import amax_scale, quantize_fp8_groups
    from adapt.kernels.moe_gemm import swiglu_torch

    k, act, il = shape["top_k"], shape["activation"], shape["interleaved"]
    offs = perm.expert_offsets.tolist()
    spans = [(e, offs[e], offs[e + 1]) for e in range(len(offs) - 1) if offs[e + 1] > offs[e]]
    rows = perm.sorted_slot.long() // k
    i = fp8w.intermediate

    def run():
        xq, xs = quantize_fp8_groups(x[rows], 128, amax_scale)
        outs = []
        for e, a, b in spans:
            h1 = _scaled_mm_block(xq[a:b], xs[a:b], fp8w.w1[e], fp8w.w1_scale[e], layout).float()
            g, u = (h1[:, 0::2], h1[:, 1::2]) if il else (h1[:, :i], h1[:, i:])
            hq, hs = quantize_fp8_groups(swiglu_torch(g, u, act, 1.702, 7.0), 128, amax_scale)
            outs.append(_scaled_mm_block(hq, hs, fp8w.w2[e], fp8w.w2_scale[e], layout))
        return torch.cat(outs)

    return run


def _scaled_mm_layout(fp8w, device) -> int | str:
    """The scale layout ``_scaled_mm`` accepts here (checked against dequantized weights on one expert),
    or why none works."""
    from adapt.kernels.fp8 import amax_scale, quantize_fp8_groups

    x = torch.randn(8, fp8w.hidden, device=device)
    xq, xs = quantize_fp8_groups(x, 128, amax_scale)
    w1 = fp8w.dense()[0][0] if fp8w.n_experts <= 8 else _dense_one(fp8w, 0)
    ref = (xq.float() * xs.repeat_interleave(128, 1)) @ w1.t()
    why = []
    for layout in (0, 1):
        try:
            got = _scaled_mm_block(xq, xs, fp8w.w1[0], fp8w.w1_scale[0], layout).float()
            err = float((got - ref).norm() / ref.norm())
            if err < 1e-2:
                return layout
            why.append(f"layout {layout}: rel error {err:.3g}")
        except Exception as exc:  # noqa: BLE001 - recorded as the reason the baseline is missing
            why.append(f"layout {layout}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return "; ".join(why)


def _dense_one(w, e: int) -> torch.Tensor:
    """fp32 w1 of expert e (FP8 values times block scales)."""
    n, k = w.w1.shape[1:]
    s = w.w1_scale[e].repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return w.w1[e].float() * s


def run_format_bench(out_dir: Path, tokens: list[int] | None = None, shape_name: str = "deepseek-v3",
                     budget_s: float = 1e9) -> dict:
    """FP8-block and bf16 experts at one shape (default DeepSeek-V3) beside torch, CUDA-graph medians,
    same-run ceilings; writes moe_formats.json / .md to out_dir after every T. Rows: time_us,
    weight bytes (``format_bytes``), TB/s and fraction of copy on them, TFLOP/s on 6*T*k*H*I, x of the
    byte floor, and the relative difference to torch on the same weights (rel_diff_vs_torch)."""
    start = time.monotonic()
    if not torch.cuda.is_available():
        raise InputError("the MoE benchmark needs a CUDA GPU", hint="run it on the target machine")
    tokens = tokens or DEFAULT_TOKENS
    shape = SHAPES[shape_name]
    e, k, h = shape["experts"], shape["top_k"], shape["hidden"]
    ceil = measure_ceilings(copy_gib=2, reps=10, matmul_reps=5)
    print(json.dumps(ceil), flush=True)
    torch.manual_seed(0)
    bf, fp8w = _format_layer(shape, DEVICE)
    layout = _scaled_mm_layout(fp8w, DEVICE)
    rows: list[dict] = []
    result = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": _git_commit(),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": dict(shape, name=shape_name), "ceilings": ceil, "scaled_mm_layout": layout, "rows": rows}
    save = _saver(Path(out_dir), "moe_formats", result, _format_markdown)
    for t in tokens:
        x, perm, active, _ = _point(t, e, k, h, DEVICE)
        variants = _format_variants(x, perm, bf, fp8w, shape, layout)
        refs = {}
        for fmt, base in (("bf16", "torch_grouped_bf16"), ("fp8", "torch_fp8_block_scaled_mm")):
            try:
                refs[fmt] = variants[base]().float() if base in variants else None
            except Exception as exc:  # noqa: BLE001 - the variant's own row records the failure
                print(f"T={t} {base}: reference failed: {str(exc)[:200]}", flush=True)
        for vname in FORMAT_VARIANTS:
            if vname == "fp8_block_w8a8_stored_tiles" and vname not in variants:
                continue
            row = _format_row(vname, variants, refs, t, active, shape, ceil, start, budget_s, layout)
            rows.append(row)
            if "time_us" in row:
                err = row["rel_diff_vs_torch"]
                print(f"T={t:6d} {vname:26s} {row['time_us']:10.1f} us {row['weight_tbps']:5.2f} TB/s "
                      f"({row['copy_fraction']:.2f} of copy) {row['tflops']:7.1f} TFLOP/s"
                      + (f" diff {err:.2e}" if err is not None else ""), flush=True)
            else:
                print(f"T={t} {vname}: {row['error'][:200]}", flush=True)
        save()
    save()
    return result


def _saver(out_dir: Path, stem: str, result: dict, markdown):
    """A function that writes ``result`` as out_dir/stem.json and its ``markdown(result)`` as stem.md."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out_dir / f"{stem}.md").write_text(markdown(result))

    return save


def _format_variants(x, perm, bf, fp8w, shape: dict, layout) -> dict:
    """The timed callables of one T (see ``FORMAT_VARIANTS``)."""
    from adapt.kernels.moe_gemm import expert_mlp

    k, act = shape["top_k"], shape["activation"]
    kw = dict(top_k=k, activation=act)
    variants = {
        "fp8_block_w8a8": lambda: expert_mlp(x, perm, fp8w, compute="fp8", act_quant="group128", **kw),
        "bf16_experts": lambda: expert_mlp(x, perm, bf, compute="bf16", **kw),
        "torch_grouped_bf16": _torch_grouped(lambda: x[perm.sorted_slot.long() // k], bf.w1.transpose(1, 2),
                                             bf.w2.transpose(1, 2), perm.expert_offsets[1:], act, shape["interleaved"]),
        "fp8_block_w8a16": lambda: expert_mlp(x, perm, fp8w, compute="bf16", **kw),
    }
    if isinstance(layout, int):
        variants["torch_fp8_block_scaled_mm"] = _torch_fp8_block(x, perm, fp8w, shape, layout)
    if x.shape[0] >= 4096:
        from adapt.kernels.moe_configs import pick_configs

        wide = pick_configs(x.shape[0] * k, fp8w.n_experts, "fp8_stored")
        variants["fp8_block_w8a8_stored_tiles"] = lambda: expert_mlp(
            x, perm, fp8w, compute="fp8", act_quant="group128", config=wide, **kw)
    return variants


def _format_row(vname, variants, refs, t, active, shape, ceil, start, budget_s, layout) -> dict:
    """One timed row (or a row with the error or the reason it was skipped)."""
    h, inter = shape["hidden"], shape["intermediate"]
    if vname not in variants:
        return {"tokens": t, "variant": vname, "error": f"no _scaled_mm block layout: {layout}"}
    if time.monotonic() - start > budget_s:
        return {"tokens": t, "variant": vname, "error": "skipped: time budget"}
    fn = variants[vname]
    try:
        out = fn().float()
        ref = refs.get("fp8" if "fp8" in vname else "bf16")
        err = None if ref is None else float((out - ref).norm() / ref.norm().clamp_min(1e-30))
        timing = time_cuda(fn, reps=10 if t >= 4096 else 20)
    except Exception as exc:  # noqa: BLE001 - a failed variant is a recorded row, the others go on
        return {"tokens": t, "variant": vname, "error": str(exc)[:300]}
    us = timing.median_us
    wbytes = format_bytes(vname, active, h, inter)
    flops = 6 * t * shape["top_k"] * h * inter
    floor_us = wbytes / (ceil["copy_tbps"] * 1e6)
    return {
        "tokens": t, "variant": vname, "time_us": us, "active_experts": active, "weight_bytes": wbytes,
        "flops": flops, "weight_tbps": wbytes / us / 1e6, "copy_fraction": wbytes / us / 1e6 / ceil["copy_tbps"],
        "tflops": flops / us / 1e6, "byte_floor_us": floor_us, "x_floor": us / floor_us, "rel_diff_vs_torch": err,
        "timer": timing.mode + (f" ({timing.fallback})" if timing.fallback else ""),
    }


def _format_markdown(result: dict) -> str:
    c = result["ceilings"]
    s = result["shape"]
    lines = [
        f"# MoE expert formats at {s['name']} (E={s['experts']}, k={s['top_k']}, {s['hidden']}, {s['intermediate']})\n",
        f"- date: {result['date']}; commit: {result['commit']}; GPU: {result['gpu']}, torch {result['torch']}, "
        f"triton {result['triton']}",
        f"- same-run ceilings: copy {c['copy_tbps']:.2f} TB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s, "
        f"fp8 _scaled_mm {c['fp8_matmul_tflops']:.0f} TFLOP/s",
        f"- torch _scaled_mm block layout: {result['scaled_mm_layout']}",
        "",
        "| T | variant | time us | weight bytes | TB/s | of copy | TFLOP/s | x floor | diff vs torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "time_us" not in r:
            lines.append(f"| {r['tokens']} | {r['variant']} | {r['error'][:90]} | | | | | | |")
            continue
        d = f"{r['rel_diff_vs_torch']:.1e}" if r["rel_diff_vs_torch"] is not None else ""
        lines.append(f"| {r['tokens']} | {r['variant']} | {r['time_us']:.1f} | {r['weight_bytes']:.3e} | "
                     f"{r['weight_tbps']:.2f} | {r['copy_fraction']:.2f} | {r['tflops']:.1f} | "
                     f"{r['x_floor']:.2f} | {d} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="MoE kernel benchmark")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tokens", type=int, nargs="*", default=None)
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--planar-sweep", action="store_true", help="time PLANAR_SWEEP at every point")
    ap.add_argument("--no-layer", action="store_true", help="skip the whole-layer variants")
    ap.add_argument("--no-memory", action="store_true", help="skip expert memory and conversion rates")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="variant names to time (default: all); with --peer-only shell patterns of adapt's rows "
                         "and sweep configs (the peer is always timed)")
    ap.add_argument(
        "--quick-acceptance",
        action="store_true",
        help="DeepSeek-V3 at T in 1, 64, 16384 only (the acceptance lines)",
    )
    ap.add_argument("--peer-only", action="store_true",
                    help="time only the peer beside adapt's MXFP4-storage paths (with --planar-sweep: the configs too)")
    ap.add_argument("--large", action="store_true", help="with --peer-only: the FP8 paths above PLANAR_MAX_TOKENS")
    ap.add_argument("--formats", action="store_true", help="FP8-block and bf16 experts beside torch (first shape)")
    args = ap.parse_args()
    if args.formats:
        run_format_bench(args.out_dir, args.tokens, (args.shapes or ["deepseek-v3"])[0], args.budget_s)
        raise SystemExit(0)
    if args.peer_only:
        run_peer_bench(args.out_dir, args.tokens, args.shapes, args.budget_s, args.planar_sweep, args.large,
                       args.variants)
        raise SystemExit(0)
    res = run_moe_bench(
        args.out_dir,
        args.tokens,
        args.shapes,
        args.budget_s,
        not args.no_sweep,
        args.quick_acceptance,
        args.planar_sweep,
        not args.no_layer,
        not args.no_memory,
        args.variants,
    )
    for line in res.get("acceptance", []):
        print(json.dumps(line), flush=True)
