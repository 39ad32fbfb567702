"""float64 references of adapt's DSA, routing, MXFP4, FP8-block and MoE kernels, computed from the
dequantized operands on the CPU.

Shared by stage 3 (``adapt.stages.kernels``) and the kernel tests: a kernel is judged against these,
never only against its own torch twin. Tensors only (cache pools as [pages, 64, ...] with the slot
addressing of ``adapt.kernels.formats``).
"""

from __future__ import annotations

import math

import torch

from adapt.kernels.formats import slots_of


def index_scores_reference(q8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                           index_scale: torch.Tensor, block_table: torch.Tensor, token_seq: torch.Tensor,
                           limits: torch.Tensor, cols: int) -> torch.Tensor:
    """DSA index scores, float64 [N, cols]: kscale[s] * sum_h w[t, h] * relu(q8[t, h] . k8[s]) for
    key positions s < limits[t], -inf elsewhere.

    q8: e4m3 [N, H, D]; weights: fp32 [N, H] (query scales folded in); index_k: e4m3 [pages, 64, D];
    index_scale: fp32 [pages, 64]; block_table: int [B, P]; token_seq: int [N]; limits: int [N].
    """
    n, dim = q8.shape[0], q8.shape[-1]
    ref = torch.full((n, cols), -math.inf, dtype=torch.float64)
    tables = block_table.long().cpu()
    keys = index_k.reshape(-1, dim).double().cpu()
    kscale = index_scale.reshape(-1).double().cpu()
    for row in range(n):
        slots = slots_of(tables[int(token_seq[row])], torch.arange(int(limits[row])))
        logits = q8[row].double().cpu() @ keys[slots].T
        head_sum = (logits.clamp_min(0) * weights[row].double().cpu()[:, None]).sum(0)
        ref[row, : len(slots)] = head_sum * kscale[slots]
    return ref


def sparse_mla_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_rows: torch.Tensor,
                         block_table: torch.Tensor, token_seq: torch.Tensor, indices: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Sparse MLA over each query's selected positions, float64 [N, H, rank]:
    softmax(q . [nope, rope] * scale) @ nope.

    q_nope: [N, H, rank] (the query in latent space); q_rope: [N, H, rope]; kv_rows: dequantized
    cache rows [pages * 64, rank + rope] in slot order; indices: int [N, k] positions (-1 none).
    Rows with no selected position stay 0.
    """
    rank = q_nope.shape[-1]
    out = torch.zeros(q_nope.shape, dtype=torch.float64)
    tables = block_table.long().cpu()
    rows_all = kv_rows.double().cpu()
    for row in range(q_nope.shape[0]):
        idx = indices[row].long().cpu()
        idx = idx[idx >= 0]
        if idx.numel() == 0:
            continue
        kv = rows_all[slots_of(tables[int(token_seq[row])], idx)]
        q = torch.cat([q_nope[row], q_rope[row]], -1).double().cpu()
        out[row] = torch.softmax(q @ kv.T * scale, -1) @ kv[:, :rank]
    return out


def route_reference(logits: torch.Tensor, config, bias: torch.Tensor | None):
    """float64 routing of gate logits [T, E] under ``config`` (``adapt.kernels.routing.RouterConfig``:
    softmax or sigmoid scoring, correction ``bias`` [E] for the choice only, group top-k, renormalize,
    routed scaling): (weights [T, k], ids [T, k], selection scores [T, E], -inf outside kept groups)."""
    logits = logits.double().cpu()
    t, e = logits.shape
    scores = torch.sigmoid(logits) if config.scoring == "sigmoid" else torch.softmax(logits, -1)
    choice = scores + bias.double().cpu() if bias is not None else scores.clone()
    if config.n_group > 1:
        grouped = choice.view(t, config.n_group, e // config.n_group)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = best.topk(config.topk_group, dim=-1).indices
        kept = torch.zeros(t, config.n_group, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // config.n_group, dim=1), -math.inf)
    ids = choice.topk(config.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * config.routed_scaling, ids, choice


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of each 3-bit E2M1 code (OCP MX v1.0, FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6)."""


def mxfp4_decode_reference(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 MXFP4 decode from the format definition (OCP MX v1.0): each nibble a sign bit and a 3-bit
    E2M1 magnitude code, times 2**(s - 127) of its group of 32. packed: uint8 [..., K/2]; scales: uint8
    [..., K/32]. Returns float64 [..., K] on the CPU."""
    p = packed.long().cpu()
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], -1)
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes & 7]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    scale = torch.pow(2.0, scales.double().cpu() - 127).repeat_interleave(32, dim=-1)
    return values * scale


def e4m3_decode_reference(values: torch.Tensor) -> torch.Tensor:
    """float64 value of every float8_e4m3fn element from its bits (OCP FP8 E4M3): sign bit 7, exponent
    bits 3..6 (bias 7), mantissa bits 0..2; exponent 0 is subnormal (m/8 * 2**-6); S.1111.111 is NaN
    (no infinities). values: float8_e4m3fn (or its uint8 bits) [...]. Returns float64 [...] on the CPU."""
    bits = values.cpu().view(torch.uint8).long() if values.dtype != torch.uint8 else values.cpu().long()
    sign = torch.where(bits >= 128, -1.0, 1.0).double()
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 7).double()
    normal = (1.0 + mantissa / 8) * torch.pow(2.0, exponent.double() - 7)
    value = torch.where(exponent == 0, mantissa / 8 * 2.0**-6, normal) * sign
    return torch.where((bits & 0x7F) == 0x7F, torch.full_like(value, math.nan), value)


def fp8_block_decode_reference(values: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    """float64 FP8 block-scaled weights (DeepSeek-V3 ``weight`` e4m3 with ``weight_scale_inv``): element
    [..., n, k] times scales[..., n // block, k // block]. values e4m3 [..., N, K]; scales fp32
    [..., ceil(N / block), ceil(K / block)]. Returns float64 [..., N, K] on the CPU."""
    n, k = values.shape[-2:]
    rows = torch.arange(n) // block
    cols = torch.arange(k) // block
    s = scales.double().cpu()[..., rows, :][..., cols]
    return e4m3_decode_reference(values) * s


def expert_weights_reference(weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E, 2I, H], w2 [E, H, I]) float64 of a layer's experts from their format's definition:
    MXFP4 (``MoEWeights``), FP8 with 128 x 128 block scales or bf16 (``StackedExperts``)."""
    if hasattr(weights, "w1_packed"):
        return (mxfp4_decode_reference(weights.w1_packed, weights.w1_scales),
                mxfp4_decode_reference(weights.w2_packed, weights.w2_scales))
    if weights.w1_scale is not None:
        return (fp8_block_decode_reference(weights.w1, weights.w1_scale),
                fp8_block_decode_reference(weights.w2, weights.w2_scale))
    return weights.w1.double().cpu(), weights.w2.double().cpu()


def moe_reference(hidden: torch.Tensor, logits: torch.Tensor, weights, config, bias: torch.Tensor | None,
                  activation: str, limit: float | None, alpha: float = 1.702) -> torch.Tensor:
    """float64 MoE layer on the exactly decoded expert weights (``expert_weights_reference``: MXFP4
    ``MoEWeights``, FP8-block or bf16 ``StackedExperts``): hidden [T, H], gate logits [T, E] -> [T, H].
    activation "swiglu" or "swiglu_clamped" (gpt-oss: clamp at ``limit``, gate * sigmoid(alpha * gate) * (up + 1))."""
    w1, w2 = expert_weights_reference(weights)
    if weights.gate_up_interleaved:
        wg, wu = w1[:, 0::2], w1[:, 1::2]
    else:
        wg, wu = w1.chunk(2, dim=1)
    b1 = weights.w1_bias.double().cpu() if weights.w1_bias is not None else None
    if b1 is not None:
        bg, bu = (b1[:, 0::2], b1[:, 1::2]) if weights.gate_up_interleaved else b1.chunk(2, dim=1)
    b2 = weights.w2_bias.double().cpu() if weights.w2_bias is not None else None
    topw, ids, _ = route_reference(logits, config, bias)
    x = hidden.double().cpu()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = wg[e] @ x[t], wu[e] @ x[t]
            if b1 is not None:
                g, u = g + bg[e], u + bu[e]
            if activation == "swiglu_clamped":
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = g * torch.sigmoid(alpha * g) * (u + 1)
            else:
                h = torch.nn.functional.silu(g) * u
            y = w2[e] @ h + (b2[e] if b2 is not None else 0)
            out[t] += topw[t, j] * y
    return out
