"""Fused MoE expert path: grouped GEMMs over expert-sorted tokens with MXFP4 weights decoded in-kernel,
and the same GEMMs on bf16 or FP8-block experts (``StackedExperts``: the weight-load step of the kernel
switches on the format, W_MODE 3 / 4; tile map, routing and epilogues are shared).

Entry point (the runtime calls this once per MoE layer)::

    moe_forward(hidden, gate_weight, weights, router, *, correction_bias=None, shared=None,
                activation="swiglu", alpha=1.702, limit=7.0, compute="bf16", act_quant="token",
                fp8_weights=None, workspace=None, config=None) -> bf16 [T, H]

    hidden        bf16 [T, H]
    gate_weight   [E, H] (any float dtype; gating runs in fp32)
    weights       MoEWeights: w1 (gate+up) blocks uint8 [E, 2I, H/32, 16], scales uint8 [E, 2I, H/32];
                  w2 (down) blocks uint8 [E, H, I/32, 16], scales [E, H, I/32]; optional biases
                  w1_bias [E, 2I], w2_bias [E, H]; gate_up_interleaved (gpt-oss: rows alternate
                  gate/up; DeepSeek: gate rows then up rows); or StackedExperts: w1 [E, 2I, H], w2 [E, H, I]
                  bf16, or e4m3 with fp32 128 x 128 block scales (compute "fp8": e4m3 activations per
                  token or 1x128 group, W8A8; "bf16": FP8 weights widened to bf16 in registers, W8A16)
    router        RouterConfig (softmax or DeepSeek sigmoid group-limited, k, scaling)
    correction_bias fp32 [E] | None (DeepSeek-V3 e_score_correction_bias)
    shared        MoEWeights | None: shared experts, every token, weight 1
    activation    "swiglu" (silu(gate) * up) or "swiglu_clamped" (gpt-oss: gate clamped above at
                  ``limit``, up clamped to +-limit, gate * sigmoid(alpha * gate) * (up + 1))
    compute       "bf16": MXFP4 decoded to bf16 in registers, bf16 MMA
                  "fp8":  activations quantised to e4m3 (power-of-two scale per token, or per
                          1x128 group with ``act_quant="group128"``), MXFP4 folded into e4m3 with a
                          per-row exponent (no rescaling inside the K loop), fp8 MMA
                  "fp8_fold": the same numerics, the fold by table look-up per 32-bit word
                          (``mxfp4.fold_words_fp8``, W_MODE 5 / 6): the offline path's output bit for
                          bit without an FP8 copy (H200, T = 16384: 1.4x the workspace path's time,
                          benchmarks/moe/2026-11-30-s3-prefill); a config with ``gluon=True`` runs the
                          Gluon kernel (``moe_gluon``, MMAs in flight across the decode) on sm_90
    fp8_weights   FP8Weights | None: the offline path (all experts converted ahead of time)
    workspace     FP8Workspace | None: online conversion of the active experts of this layer into
                  a shared FP8 buffer, chunk by chunk, converting chunk c+1 while chunk c computes

``moe_forward_torch`` is the twin with the same signature (per-expert loops, fp32 math on the same
quantised operands).

Work of one layer for T tokens, k experts each, S = T*k slots, hidden H, expert width I:
FLOPs = 2 * S * (H * 2I + I * H) = 6 * S * H * I; weight bytes (MXFP4, each active expert read
once) = E_active * 3 * H * I * 17/32; activations: S * H (gather) + S * 2I * 2 + S * H * 2 bytes.
GEMM1 ``moe_gemm`` with SwiGLU: per slot 2 * H * 2I FLOPs, reads H * 2I * 17/32 bytes per active
expert; GEMM2: 2 * I * H FLOPs per slot, reads I * H * 17/32 bytes per active expert.

Kernel design (shared/KERNELS.md): swap AB, the weight's rows fill the MMA's M and tokens its N,
so a few tokens per expert still stream the weight at full width; for bf16 the weight tile is
read as 32-bit words (8 codes) and decoded by bit placement into bf16 pairs (4-5 integer ops per
pair, two bf16x2 multiplies) in a permuted K order that the activations share (``to_word_order``);
a persistent grid walks (expert m-tile, n-tile) work items grouped GROUP_M m-tiles at a time so
the weight tile and the activation rows stay in L2.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels import moe_gluon
from adapt.kernels.moe_configs import GemmConfig, PlanarConfig, pick_configs
from adapt.kernels.moe_planar import PlanarExperts, planar_experts_run
from adapt.kernels.moe_quant import FP8_GROUP, quantize_fp8_rows, quantize_fp8_rows_torch
from adapt.kernels.moe_tiles import TileMap, max_m_tiles, num_sms, tile_map, tile_slots
from adapt.kernels.moe_weights import FP8Weights, MoEWeights, StackedExperts, moe_flops, mxfp4_expert_bytes
from adapt.kernels.mxfp4 import (
    INTERPRET,
    decode_mxfp4_tile_fp8,
    decode_mxfp4_words,
    dequantize_mxfp4_torch,
    fold_words_fp8,
    mxfp4_to_fp8_torch,
    pow2_f32,
    to_bf16,
)
from adapt.kernels.routing import (
    Permutation,
    RouterConfig,
    combine,
    combine_torch,
    gate_logits,
    permute_by_expert,
    permute_by_expert_torch,
    route,
    route_torch,
)

__all__ = [
    "ACTIVATIONS",
    "FP8Weights",
    "GemmConfig",
    "MoEWeights",
    "PlanarExperts",
    "StackedExperts",
    "exp_f32",
    "expert_mlp",
    "expert_mlp_torch",
    "moe_flops",
    "moe_forward",
    "moe_forward_torch",
    "moe_gemm",
    "mxfp4_expert_bytes",
    "swiglu_torch",
    "to_word_order",
]

ACTIVATIONS = {"swiglu": 1, "swiglu_clamped": 2}


# ----------------------------------------------------------------------------------------------
# the grouped GEMM
# ----------------------------------------------------------------------------------------------

WORD_ORDER8 = (0, 4, 2, 6, 1, 5, 3, 7)
"""Column c of every 8 holds element WORD_ORDER8[c]: ``mxfp4.word_k_order`` (bits 0 and 2 swapped)."""


def to_word_order(x: torch.Tensor) -> torch.Tensor:
    """[R, K] (K a multiple of 8) -> the same values with columns in ``WORD_ORDER8`` within each 8."""
    r, k = x.shape
    return x.reshape(r, k // 8, 8).index_select(2, _word_order_index(x.device)).reshape(r, k)


@functools.cache
def _word_order_index(device: torch.device) -> torch.Tensor:
    """``WORD_ORDER8`` as an index tensor on ``device``, made once (a host-to-device copy inside a
    CUDA-graph capture is an error, so captured calls must find it already there)."""
    return torch.tensor(WORD_ORDER8, device=device)


@triton.jit
def _load_w_tile(
    w_ptr,
    sc_ptr,
    wrow,
    n_ok,
    k0,
    k,
    k_words,
    g_row,
    W_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    ACT_FP8: tl.constexpr = False,
    s_pre=None,
    PREFETCH: tl.constexpr = False,
):
    """One weight tile [BLOCK_N, BLOCK_K] in the MMA's operand type.

    W_MODE 0: MXFP4 read as int32 words (8 codes each) -> bf16 (fp32 under the interpreter), columns
    in ``word_k_order`` (k_words = K/8, passed so its divisibility gives 16-byte loads);
    1: MXFP4 bytes -> e4m3 folded relative to g_row; 2: e4m3 weights read as they are;
    5 / 6: the same fold as 1 (bit-equal) by table look-up per 32-bit word (``mxfp4.fold_words_fp8``)
    on the stored bytes (5) or on ``mxfp4.to_sign_split_words`` bytes (6);
    3: e4m3 weights of 128 x 128 block scales (the scale is applied to the block's partial sum),
    as they are for e4m3 activations (ACT_FP8), else widened to bf16; 4: bf16 weights as they are.
    Widened to fp32 under the interpreter (DOT_F32). w_ptr / sc_ptr already point at the expert (or slot).
    """
    if W_MODE >= 2 and W_MODE <= 4:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + wrow[:, None] * k + kk[None, :], mask=n_ok[:, None] & (kk < k)[None, :], other=0.0)
        if W_MODE == 2 or (W_MODE == 3 and ACT_FP8):
            return w
        elif DOT_F32:
            return w.to(tl.float32)
        else:
            return w.to(tl.bfloat16)
    elif W_MODE >= 5:
        kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        jb = tl.arange(0, 16)
        bm = n_ok[:, None] & (kb < k // 32)[None, :]
        # k_words = K/32 here: row pitches formed from it are known multiples of 16 bytes (16-byte loads)
        p = tl.load(
            w_ptr + wrow[:, None, None] * (k_words * 16) + kb[None, :, None] * 16 + jb[None, None, :],
            mask=bm[:, :, None],
            other=0,
        )
        if PREFETCH:
            s = s_pre  # this step's scales, loaded one step ahead (their latency off the step's path)
        else:
            s = _fold_scales(sc_ptr, wrow, n_ok, k0, k_words, BLOCK_N, BLOCK_K)
        return fold_words_fp8(p, s, g_row, BLOCK_N, BLOCK_K, W_MODE == 6)
    elif W_MODE == 0:
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        wd = tl.load(
            w_ptr + wrow[:, None] * k_words + kw[None, :],
            mask=n_ok[:, None] & (kw < k_words)[None, :],
            other=0,
        )
        s = tl.load(
            sc_ptr + wrow[:, None] * (k // 32) + ks[None, :],
            mask=n_ok[:, None] & (ks < k // 32)[None, :],
            other=127,
        )
        return decode_mxfp4_words(wd.to(tl.uint32, bitcast=True), s, BLOCK_N, BLOCK_K, not DOT_F32)
    else:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        p = tl.load(
            w_ptr + wrow[:, None] * (k // 2) + kb[None, :],
            mask=n_ok[:, None] & (kb < k // 2)[None, :],
            other=0,
        )
        s = tl.load(
            sc_ptr + wrow[:, None] * (k // 32) + ks[None, :],
            mask=n_ok[:, None] & (ks < k // 32)[None, :],
            other=127,
        )
        return decode_mxfp4_tile_fp8(p, s, g_row, BLOCK_N, BLOCK_K)


@triton.jit
def _fold_scales(sc_ptr, wrow, n_ok, k0, k_words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 [BLOCK_N, BLOCK_K/32]: the E8M0 scales of rows ``wrow`` for the K step at k0 (k_words = K/32;
    past K: 0, whose fold table is all zeros)."""
    kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    bm = n_ok[:, None] & (kb < k_words)[None, :]
    return tl.load(sc_ptr + wrow[:, None] * k_words + kb[None, :], mask=bm, other=0)


@triton.jit
def _row_exponent(sc_ptr, wrow, n_ok, k, W_MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-row e4m3 exponent: from MXFP4 scales (max - 6, W_MODE 1) or stored (W_MODE 2)."""
    if W_MODE == 2:
        return tl.load(sc_ptr + wrow, mask=n_ok, other=0)
    else:
        gmax = tl.full((BLOCK_N,), -127, tl.int32)
        for c0 in range(0, k // 32, 64):
            cb = c0 + tl.arange(0, 64)
            s = tl.load(
                sc_ptr + wrow[:, None] * (k // 32) + cb[None, :],
                mask=n_ok[:, None] & (cb < k // 32)[None, :],
                other=0,
            )
            gmax = tl.maximum(gmax, tl.max(s.to(tl.int32), axis=1) - 127)
        return gmax - 6


@triton.jit
def _block_scale(sc_ptr, wrow, n_ok, k0, stride_sn, W_MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 [BLOCK_N]: the 128 x 128 block scale of rows ``wrow`` at K offset k0 (W_MODE 3), else ones."""
    if W_MODE == 3:
        return tl.load(sc_ptr + (wrow // 128) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
    else:
        return tl.full((BLOCK_N,), 1.0, tl.float32)


@triton.jit
def _mma(w, x, acc, ws, xs, SWAP: tl.constexpr, W_BLOCK: tl.constexpr, ACT_GROUP: tl.constexpr):
    """acc + W x^T (SWAP: acc [BLOCK_N, BLOCK_M]) or acc + x W^T ([BLOCK_M, BLOCK_N]) for one K step,
    the step's partial sum scaled by the weight rows' block scales ws [BLOCK_N] (W_BLOCK) and the
    activation rows' group scales xs [BLOCK_M] (ACT_GROUP); unscaled steps accumulate in the MMA."""
    if SWAP:
        if W_BLOCK and ACT_GROUP:
            return acc + tl.dot(w, tl.trans(x)) * (ws[:, None] * xs[None, :])
        elif W_BLOCK:
            return acc + tl.dot(w, tl.trans(x)) * ws[:, None]
        elif ACT_GROUP:
            return acc + tl.dot(w, tl.trans(x)) * xs[None, :]
        else:
            return tl.dot(w, tl.trans(x), acc)
    else:
        if W_BLOCK and ACT_GROUP:
            return acc + tl.dot(x, tl.trans(w)) * (xs[:, None] * ws[None, :])
        elif W_BLOCK:
            return acc + tl.dot(x, tl.trans(w)) * ws[None, :]
        elif ACT_GROUP:
            return acc + tl.dot(x, tl.trans(w)) * xs[:, None]
        else:
            return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _moe_gemm_kernel(
    x_ptr,
    xs_ptr,
    stride_x,
    stride_xs,
    w_ptr,
    sc_ptr,
    stride_we,
    stride_se,
    bias_ptr,
    stride_be,
    out_ptr,
    stride_o,
    sorted_slot_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_start_ptr,
    e_lo,
    e_hi,
    slot_base,
    n_out,
    k,
    k_words,
    gate_mult,
    up_off,
    alpha,
    limit,
    stride_sn,
    TOPK: tl.constexpr,
    GATHER: tl.constexpr,
    W_MODE: tl.constexpr,
    ACT_FP8: tl.constexpr,
    ACT_GROUP: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr,
    SWAP: tl.constexpr,
    WORD_ORDER_OUT: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    EARLY_UP: tl.constexpr = False,
):
    """Grouped GEMM over expert-sorted slots: acc[n, m] = W[e, n, :] . x[m, :].

    SWAP: the MMA computes W x^T (weight rows in M); otherwise x W^T (tokens in M, the weight
    tile as B operand), transposed once before the epilogue.

    x: bf16 [rows, K] (or e4m3 with scales xs) gathered by token (GATHER: row = sorted_slot // TOPK)
    or read in sorted order; W: see _load_w_tile; out bf16 [S, n_out] in sorted order.
    ACTIVATION 0: out = acc (+bias); 1/2: gate rows n*gate_mult, up rows n*gate_mult + up_off,
    out = swiglu(gate, up) (plain / gpt-oss clamped). Experts [e_lo, e_hi) only; weight slot of
    expert e is e - e_lo + slot_base (W_MODE 2) or e (MXFP4, W_MODE 3 / 4). W_MODE 3: sc_ptr holds fp32
    block scales [E, ceil(N/128), ceil(K/128)] (row stride stride_sn), BLOCK_K divides 128.
    """
    m_lo = tl.load(tile_start_ptr + e_lo)
    n_m = tl.load(tile_start_ptr + e_hi) - m_lo
    n_n = tl.cdiv(n_out, BLOCK_N)
    total = n_m * n_n
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        e, nt, rows, row_ok, tok = tile_slots(
            tile, n_m, n_n, m_lo, tile_expert_ptr, tile_row_ptr, offsets_ptr, sorted_slot_ptr,
            TOPK, GATHER, BLOCK_M, GROUP_M,
        )
        n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_out
        if W_MODE == 2:
            we = (e - e_lo + slot_base).to(tl.int64)
        else:
            we = e.to(tl.int64)
        wbase = w_ptr + we * stride_we
        sbase = sc_ptr + we * stride_se
        if ACTIVATION == 0:
            rg = n
        else:
            rg = n * gate_mult
            ru = n * gate_mult + up_off
        g_g = tl.zeros((BLOCK_N,), tl.int32)
        g_u = tl.zeros((BLOCK_N,), tl.int32)
        if W_MODE == 1 or W_MODE == 2 or W_MODE >= 5:
            g_g = _row_exponent(sbase, rg, n_ok, k, W_MODE, BLOCK_N)
            if ACTIVATION != 0:
                g_u = _row_exponent(sbase, ru, n_ok, k, W_MODE, BLOCK_N)
        if SWAP:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if PREFETCH:
            s_g = _fold_scales(sbase, rg, n_ok, 0, k_words, BLOCK_N, BLOCK_K)
            s_u = s_g
            if ACTIVATION != 0:
                s_u = _fold_scales(sbase, ru, n_ok, 0, k_words, BLOCK_N, BLOCK_K)
        else:
            s_g = g_g
            s_u = g_u
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + tok[:, None] * stride_x + kk[None, :],
                mask=row_ok[:, None] & (kk < k)[None, :],
                other=0.0,
            )
            if DOT_F32:
                x = x.to(tl.float32)
            s_g_cur = s_g
            s_u_cur = s_u
            if PREFETCH:
                s_g = _fold_scales(sbase, rg, n_ok, k0 + BLOCK_K, k_words, BLOCK_N, BLOCK_K)
                if ACTIVATION != 0:
                    s_u = _fold_scales(sbase, ru, n_ok, k0 + BLOCK_K, k_words, BLOCK_N, BLOCK_K)
            wg = _load_w_tile(
                wbase, sbase, rg, n_ok, k0, k, k_words, g_g, W_MODE, BLOCK_N, BLOCK_K, DOT_F32, ACT_FP8,
                s_g_cur, PREFETCH,
            )
            if ACT_GROUP:
                xs = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=row_ok, other=0.0)
            else:
                xs = tl.full((BLOCK_M,), 1.0, tl.float32)
            ws = _block_scale(sbase, rg, n_ok, k0, stride_sn, W_MODE, BLOCK_N)
            if EARLY_UP:
                # fold modes: both tiles decoded, then both MMAs back to back (one wait per step)
                wu = _load_w_tile(
                    wbase, sbase, ru, n_ok, k0, k, k_words, g_u, W_MODE, BLOCK_N, BLOCK_K, DOT_F32, ACT_FP8,
                    s_u_cur, PREFETCH,
                )
                acc_g = _mma(wg, x, acc_g, ws, xs, SWAP, False, ACT_GROUP)
                acc_u = _mma(wu, x, acc_u, ws, xs, SWAP, False, ACT_GROUP)
            else:
                acc_g = _mma(wg, x, acc_g, ws, xs, SWAP, W_MODE == 3, ACT_GROUP)
            if ACTIVATION != 0 and not EARLY_UP:
                wu = _load_w_tile(
                    wbase, sbase, ru, n_ok, k0, k, k_words, g_u, W_MODE, BLOCK_N, BLOCK_K, DOT_F32, ACT_FP8,
                    s_u_cur, PREFETCH,
                )
                ws = _block_scale(sbase, ru, n_ok, k0, stride_sn, W_MODE, BLOCK_N)
                acc_u = _mma(wu, x, acc_u, ws, xs, SWAP, W_MODE == 3, ACT_GROUP)
        if not SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        if W_MODE == 1 or W_MODE == 2 or W_MODE >= 5:
            acc_g = acc_g * pow2_f32(g_g)[:, None]
            acc_u = acc_u * pow2_f32(g_u)[:, None]
        if ACT_FP8 and not ACT_GROUP:
            xs_tok = tl.load(xs_ptr + tok * stride_xs, mask=row_ok, other=0.0)
            acc_g = acc_g * xs_tok[None, :]
            acc_u = acc_u * xs_tok[None, :]
        if HAS_BIAS:
            acc_g += tl.load(bias_ptr + e.to(tl.int64) * stride_be + rg, mask=n_ok, other=0.0).to(tl.float32)[
                :, None
            ]
            if ACTIVATION != 0:
                acc_u += tl.load(bias_ptr + e.to(tl.int64) * stride_be + ru, mask=n_ok, other=0.0).to(
                    tl.float32
                )[:, None]
        if ACTIVATION == 0:
            res = acc_g
        elif ACTIVATION == 1:
            res = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        else:
            gc = tl.minimum(acc_g, limit)
            uc = tl.minimum(tl.maximum(acc_u, -limit), limit)
            res = gc / (1.0 + tl.exp(-alpha * gc)) * (uc + 1.0)
        if WORD_ORDER_OUT:
            # column n goes where word_k_order reads it: swap bits 0 and 2 within each 8 columns
            n = (n & ~7) | ((n & 1) << 2) | (n & 2) | ((n >> 2) & 1)
        optr = out_ptr + rows[None, :].to(tl.int64) * stride_o + n[:, None]
        tl.store(optr, to_bf16(res), mask=n_ok[:, None] & row_ok[None, :])


@dataclass
class _WeightOperand:
    """What the kernel needs to find one GEMM's weights: tensors, strides and mode."""

    w: torch.Tensor
    sc: torch.Tensor
    stride_we: int
    stride_se: int
    bias: torch.Tensor | None
    mode: int
    k: int
    stride_sn: int = 0


def _mxfp4_operand(packed: torch.Tensor, scales: torch.Tensor, bias, fp8: bool) -> _WeightOperand:
    """fp8: bytes for the e4m3 decode (W_MODE 1); bf16: the same memory as int32 words (W_MODE 0)."""
    k = packed.shape[-1] * 2
    w = packed if fp8 else packed.view(torch.int32)
    return _WeightOperand(w, scales, w.stride(0), scales.stride(0), bias, 1 if fp8 else 0, k)


def folded_operand(packed: torch.Tensor, scales: torch.Tensor, bias, split: bool = False) -> _WeightOperand:
    """MXFP4 bytes [E, N, K/2] (stored, or ``to_sign_split_words`` when split) folded to e4m3 in the GEMM
    by table look-up (W_MODE 5 / 6): the offline path's operand values without the offline copy."""
    k = packed.shape[-1] * 2
    return _WeightOperand(packed, scales, packed.stride(0), scales.stride(0), bias, 6 if split else 5, k)


def fp8_operand(w: torch.Tensor, exps: torch.Tensor, bias) -> _WeightOperand:
    return _WeightOperand(w, exps, w.stride(0), exps.stride(0), bias, 2, w.shape[-1])


def stacked_operand(w: torch.Tensor, scale: torch.Tensor | None, bias) -> _WeightOperand:
    """bf16 weights [E, N, K] (W_MODE 4) or e4m3 with fp32 128 x 128 block scales (W_MODE 3)."""
    if scale is None:
        return _WeightOperand(w, w, w.stride(0), 0, bias, 4, w.shape[-1])
    return _WeightOperand(w, scale, w.stride(0), scale.stride(0), bias, 3, w.shape[-1], scale.stride(1))


def moe_gemm(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    op: _WeightOperand,
    perm: Permutation,
    tiles: TileMap,
    out: torch.Tensor,
    *,
    top_k: int,
    gather: bool,
    activation: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    cfg: GemmConfig,
    experts: tuple[int, int] | None = None,
    slot_base: int = 0,
) -> torch.Tensor:
    """One grouped GEMM launch (see ``_moe_gemm_kernel``). out bf16 [S, n_out], sorted order.

    x: [T, K] (gather) or [S, K] sorted; x_scale fp32 [rows] or [rows, K/128] for e4m3 x. With
    MXFP4 weights decoded to bf16 (op.mode 0) x is in word order (``to_word_order``) and a SwiGLU
    output is written in word order too, ready to be GEMM2's x.
    activation 0: n_out = weight rows; 1/2: n_out = weight rows / 2 (SwiGLU).
    Bytes: weight tiles of the active experts once per GROUP_M m-tiles (MXFP4: K*N*17/32 per
    expert), x rows once per n-tile group via L2, out S*n_out*2. FLOPs: 2 * S * N * K.
    """
    n_rows_w = op.w.shape[1]
    n_out = n_rows_w if activation == 0 else n_rows_w // 2
    e_total = perm.expert_offsets.numel() - 1
    e_lo, e_hi = experts if experts is not None else (0, e_total)
    if interleaved:
        gate_mult, up_off = 2, 1
    else:
        gate_mult, up_off = 1, n_out
    act_fp8 = x.dtype == torch.float8_e4m3fn
    act_group = act_fp8 and x_scale is not None and x_scale.dim() == 2
    if (act_group and cfg.block_k != FP8_GROUP) or (op.mode == 3 and FP8_GROUP % cfg.block_k):
        cfg = dataclasses.replace(cfg, block_k=FP8_GROUP)
    n_work = min(tiles.max_tiles, max_m_tiles(out.shape[0], e_hi - e_lo, cfg.block_m)) * triton.cdiv(
        n_out, cfg.block_n
    )
    if cfg.programs_per_sm > 0:
        n_work = min(n_work, max(1, num_sms(x.device) * cfg.programs_per_sm - cfg.reserve_sms))
    grid = (max(1, n_work),)
    if cfg.gluon and op.mode >= 5 and act_fp8 and not act_group and not cfg.swap_ab and moe_gluon.usable(x.device):
        return moe_gluon.fold_gemm(
            x.contiguous(), x_scale, op, perm, tiles, out, top_k=top_k, gather=gather, activation=activation,
            n_out=n_out, e_lo=e_lo, e_hi=e_hi, gate_mult=gate_mult, up_off=up_off, alpha=alpha, limit=limit,
            cfg=cfg, grid=grid,
        )
    xs = x_scale if x_scale is not None else x
    stride_xs = x_scale.stride(0) if x_scale is not None else 0
    bias = op.bias if op.bias is not None else xs
    _moe_gemm_kernel[grid](
        x,
        xs,
        x.stride(0),
        stride_xs,
        op.w,
        op.sc,
        op.stride_we,
        op.stride_se,
        bias,
        bias.stride(0) if op.bias is not None else 0,
        out,
        out.stride(0),
        perm.sorted_slot,
        perm.expert_offsets,
        tiles.tile_expert,
        tiles.tile_row,
        tiles.tile_start,
        e_lo,
        e_hi,
        slot_base,
        n_out,
        op.k,
        op.k // 32 if op.mode >= 5 else op.k // 8,
        gate_mult,
        up_off,
        float(alpha),
        float(limit),
        op.stride_sn,
        TOPK=top_k,
        GATHER=gather,
        W_MODE=op.mode,
        ACT_FP8=act_fp8,
        ACT_GROUP=act_group,
        ACTIVATION=activation,
        HAS_BIAS=op.bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        DOT_F32=INTERPRET and (op.mode in (0, 4) or (op.mode == 3 and not act_fp8)),
        SWAP=cfg.swap_ab,
        WORD_ORDER_OUT=op.mode == 0 and activation != 0,
        PREFETCH=op.mode >= 5 and cfg.prefetch_scales,
        EARLY_UP=op.mode >= 5 and activation != 0 and cfg.early_up,
        maxnreg=cfg.maxnreg or None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------
# the expert MLP and the layer
# ----------------------------------------------------------------------------------------------


def _check_inputs(hidden: torch.Tensor, weights: MoEWeights, activation: str, compute: str, act_quant: str):
    if hidden.dim() != 2 or hidden.shape[1] != weights.hidden:
        raise InputError(
            f"hidden {tuple(hidden.shape)} does not match the experts' hidden size {weights.hidden}",
            field="hidden",
        )
    if activation not in ACTIVATIONS:
        raise InputError(
            f"unknown activation {activation!r}", field="activation", hint=f"use one of {sorted(ACTIVATIONS)}"
        )
    if compute not in ("bf16", "fp8", "fp8_fold"):
        raise InputError(
            f"unknown compute path {compute!r}", field="compute", hint="use 'bf16', 'fp8' or 'fp8_fold'"
        )
    if act_quant not in ("token", "group128"):
        raise InputError(
            f"unknown activation quantisation {act_quant!r}",
            field="act_quant",
            hint="use 'token' or 'group128'",
        )
    if act_quant == "group128" and (weights.hidden % FP8_GROUP or weights.intermediate % FP8_GROUP):
        raise InputError(
            f"act_quant='group128' needs hidden and intermediate divisible by {FP8_GROUP}, got "
            f"{weights.hidden} and {weights.intermediate}",
            field="act_quant",
            hint="use 'token'",
        )


def expert_mlp(
    hidden: torch.Tensor,
    perm: Permutation,
    weights: MoEWeights,
    *,
    top_k: int,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    compute: str = "bf16",
    act_quant: str = "token",
    fp8_weights: FP8Weights | None = None,
    workspace=None,
    config: tuple[GemmConfig, GemmConfig] | tuple[PlanarConfig, PlanarConfig] | None = None,
    planar: PlanarExperts | None = None,
    split_words: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """GEMM1 + SwiGLU + GEMM2 over expert-sorted slots: hidden bf16 [T, H] -> y bf16 [T*k, H] (sorted).

    compute "fp8_fold": the offline FP8 path's arithmetic (e4m3 activations, the per-row e4m3 fold of the
    MXFP4 weights, fp8 MMA) with the fold done inside the GEMM by table look-up from the MXFP4 bytes
    (``folded_operand``), no FP8 copy or workspace; split_words: (w1, w2) ``to_sign_split_words`` bytes
    of the same experts, read instead of the stored bytes.

    planar: the same experts in the planar layout (``PlanarExperts.from_weights``, load time); with
    compute "bf16" the GEMMs then run ``moe_planar.planar_gemm`` (config: a ``PlanarConfig`` pair).
    FLOPs 6 * S * H * I; bytes: see the module docstring.
    """
    e, h, inter = weights.n_experts, weights.hidden, weights.intermediate
    s = hidden.shape[0] * top_k
    act = ACTIVATIONS[activation]
    if isinstance(weights, StackedExperts):
        return _stacked_mlp(hidden, perm, weights, top_k, act, alpha, limit, compute, act_quant, config)
    use_fp8 = compute in ("fp8", "fp8_fold") or fp8_weights is not None or workspace is not None
    if planar is not None and not use_fp8:
        return _planar_mlp(hidden, perm, planar, top_k, act, alpha, limit, config)
    stored = fp8_weights is not None or workspace is not None or compute == "fp8_fold"
    kind = "fp8_stored" if stored else ("fp8" if use_fp8 else "bf16")
    c1, c2 = config if config is not None else pick_configs(s, e, kind)
    if c1.block_m != c2.block_m:
        raise InputError("GEMM1 and GEMM2 configs must share block_m", field="config")
    mt = max_m_tiles(s, e, c1.block_m)
    tiles = tile_map(perm.expert_offsets, c1.block_m, mt)
    group = FP8_GROUP if act_quant == "group128" else None
    dev = hidden.device
    hbuf = torch.empty(s, inter, dtype=torch.bfloat16, device=dev)
    y = torch.empty(s, h, dtype=torch.bfloat16, device=dev)
    common = dict(top_k=top_k, alpha=alpha, limit=limit)
    if not use_fp8:
        op1 = _mxfp4_operand(weights.w1_packed, weights.w1_scales, weights.w1_bias, fp8=False)
        op2 = _mxfp4_operand(weights.w2_packed, weights.w2_scales, weights.w2_bias, fp8=False)
        moe_gemm(
            to_word_order(hidden),
            None,
            op1,
            perm,
            tiles,
            hbuf,
            gather=True,
            activation=act,
            interleaved=weights.gate_up_interleaved,
            cfg=c1,
            **common,
        )
        moe_gemm(
            hbuf, None, op2, perm, tiles, y, gather=False, activation=0, interleaved=False, cfg=c2, **common
        )
        return y
    xq, xs = quantize_fp8_rows(hidden, group)
    hq = torch.empty(s, inter, dtype=torch.float8_e4m3fn, device=dev)
    hs = torch.empty((s,) if group is None else (s, inter // group), dtype=torch.float32, device=dev)
    if compute == "fp8_fold" and fp8_weights is None and workspace is None:
        sw = split_words
        op1 = folded_operand(sw[0] if sw else weights.w1_packed, weights.w1_scales, weights.w1_bias, sw is not None)
        op2 = folded_operand(sw[1] if sw else weights.w2_packed, weights.w2_scales, weights.w2_bias, sw is not None)
        moe_gemm(
            xq, xs, op1, perm, tiles, hbuf, gather=True, activation=act, interleaved=weights.gate_up_interleaved,
            cfg=c1, **common,
        )
        quantize_fp8_rows(hbuf, group, out=(hq, hs))
        moe_gemm(hq, hs, op2, perm, tiles, y, gather=False, activation=0, interleaved=False, cfg=c2, **common)
        return y
    if workspace is not None:
        workspace.run_layer(
            weights,
            perm,
            tiles,
            xq,
            xs,
            hbuf,
            (hq, hs),
            y,
            group=group,
            activation=act,
            configs=(c1, c2),
            **common,
        )
        return y
    if fp8_weights is not None:
        op1 = fp8_operand(fp8_weights.w1, fp8_weights.w1_exp, fp8_weights.w1_bias)
        op2 = fp8_operand(fp8_weights.w2, fp8_weights.w2_exp, fp8_weights.w2_bias)
    else:
        op1 = _mxfp4_operand(weights.w1_packed, weights.w1_scales, weights.w1_bias, fp8=True)
        op2 = _mxfp4_operand(weights.w2_packed, weights.w2_scales, weights.w2_bias, fp8=True)
    moe_gemm(
        xq,
        xs,
        op1,
        perm,
        tiles,
        hbuf,
        gather=True,
        activation=act,
        interleaved=weights.gate_up_interleaved,
        cfg=c1,
        **common,
    )
    quantize_fp8_rows(hbuf, group, out=(hq, hs))
    moe_gemm(hq, hs, op2, perm, tiles, y, gather=False, activation=0, interleaved=False, cfg=c2, **common)
    return y


def _stacked_mlp(hidden, perm, weights: StackedExperts, top_k, act, alpha, limit, compute, act_quant, config):
    """``expert_mlp`` on bf16 or FP8-block experts: the same grouped GEMMs (tile map, gather, SwiGLU and
    sorted-order epilogues) with the weights read as stored (W_MODE 4 / 3). compute "bf16": bf16
    activations (FP8 weights widened to bf16 in registers, each 128 x 128 block's partial sum times its
    scale); "fp8" (FP8-block experts only): activations in e4m3 per token or per 1x128 group
    (``act_quant``), fp8 MMA, partial sums times weight block scale and activation group scale
    (DeepSeek-V3's W8A8 numerics). Weight bytes per active expert: 6*H*I (bf16) or 3*H*I (+ scales)."""
    fp8 = compute == "fp8"
    if fp8 and weights.format != "fp8_block":
        raise InputError("bf16 experts compute in bf16", field="compute", hint="use compute='bf16'")
    s = hidden.shape[0] * top_k
    e, h, inter = weights.n_experts, weights.hidden, weights.intermediate
    c1, c2 = config if config is not None else pick_configs(s, e, "fp8_block" if fp8 else "bf16_stored")
    if c1.block_m != c2.block_m:
        raise InputError("GEMM1 and GEMM2 configs must share block_m", field="config")
    tiles = tile_map(perm.expert_offsets, c1.block_m, max_m_tiles(s, e, c1.block_m))
    dev = hidden.device
    op1 = stacked_operand(weights.w1, weights.w1_scale, weights.w1_bias)
    op2 = stacked_operand(weights.w2, weights.w2_scale, weights.w2_bias)
    hbuf = torch.empty(s, inter, dtype=torch.bfloat16, device=dev)
    y = torch.empty(s, h, dtype=torch.bfloat16, device=dev)
    common = dict(top_k=top_k, alpha=alpha, limit=limit)
    il = weights.gate_up_interleaved
    if not fp8:
        moe_gemm(hidden, None, op1, perm, tiles, hbuf, gather=True, activation=act, interleaved=il, cfg=c1, **common)
        moe_gemm(hbuf, None, op2, perm, tiles, y, gather=False, activation=0, interleaved=False, cfg=c2, **common)
        return y
    group = FP8_GROUP if act_quant == "group128" else None
    xq, xs = quantize_fp8_rows(hidden, group)
    moe_gemm(xq, xs, op1, perm, tiles, hbuf, gather=True, activation=act, interleaved=il, cfg=c1, **common)
    hq, hs = quantize_fp8_rows(hbuf, group)
    moe_gemm(hq, hs, op2, perm, tiles, y, gather=False, activation=0, interleaved=False, cfg=c2, **common)
    return y


def _planar_mlp(hidden, perm, planar, top_k, act, alpha, limit, config) -> torch.Tensor:
    """``expert_mlp`` on planar weights: gather + GEMM1 + SwiGLU, then GEMM2 (+ bias), sorted order."""
    return planar_experts_run(hidden, perm, planar, top_k=top_k, activation=act, alpha=alpha, limit=limit,
                              config=config)


def _shared_forward(hidden: torch.Tensor, shared: MoEWeights, mlp, **kw) -> torch.Tensor:
    """Shared experts: every token, weight 1. -> bf16 [T, H] (or fp32 for the twin)."""
    t = hidden.shape[0]
    ns = shared.n_experts
    ids = torch.arange(ns, dtype=torch.int32, device=hidden.device).expand(t, ns).contiguous()
    perm_fn = permute_by_expert if mlp is expert_mlp else permute_by_expert_torch
    perm = perm_fn(ids, ns)
    y = mlp(hidden, perm, shared, top_k=ns, **kw)
    if ns == 1:
        return y
    ones = torch.ones(t, ns, dtype=torch.float32, device=hidden.device)
    comb = combine if mlp is expert_mlp else combine_torch
    return comb(y, ones, perm.slot_pos)


def moe_forward(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    weights: MoEWeights,
    router: RouterConfig,
    *,
    correction_bias: torch.Tensor | None = None,
    shared: MoEWeights | None = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    compute: str = "bf16",
    act_quant: str = "token",
    fp8_weights: FP8Weights | None = None,
    workspace=None,
    config: tuple[GemmConfig, GemmConfig] | None = None,
) -> torch.Tensor:
    """One MoE layer (see the module docstring): hidden bf16 [T, H] -> bf16 [T, H].

    Shared experts run the fused MXFP4 path of ``compute`` (never the workspace).
    """
    _check_inputs(hidden, weights, activation, compute, act_quant)
    hidden = hidden.contiguous()
    logits = gate_logits(hidden, gate_weight)
    topw, ids = route(logits, router, correction_bias)
    perm = permute_by_expert(ids, weights.n_experts)
    kw = dict(activation=activation, alpha=alpha, limit=limit, compute=compute, act_quant=act_quant)
    y = expert_mlp(
        hidden,
        perm,
        weights,
        top_k=router.top_k,
        fp8_weights=fp8_weights,
        workspace=workspace,
        config=config,
        **kw,
    )
    sh = _shared_forward(hidden, shared, expert_mlp, **kw) if shared is not None else None
    return combine(y, topw, perm.slot_pos, sh)


# ----------------------------------------------------------------------------------------------
# torch twins
# ----------------------------------------------------------------------------------------------


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp as the kernels compute it where their twins are compared. On the CPU the kernels run under the
    Triton interpreter, which evaluates ``tl.exp`` with numpy; numpy's and torch's fp32 exp differ in the last
    bit for many inputs (torch's also with the CPU's vector ISA), and a bf16 rounding of the result then moves
    by a whole unit. On a GPU: torch.exp (the twin tolerance there covers the last bit)."""
    if x.device.type != "cpu":
        return torch.exp(x)
    import numpy as np

    return torch.from_numpy(np.exp(x.detach().float().numpy()))


def swiglu_torch(
    gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float
) -> torch.Tensor:
    """fp32 SwiGLU in the kernels' form: plain gate / (1 + exp(-gate)) * up (silu(gate) * up), or gpt-oss's
    clamped form gate / (1 + exp(-alpha * gate)) * (up + 1) on the clamped gate and up (``exp_f32``)."""
    if activation == "swiglu":
        return gate / (1.0 + exp_f32(-gate)) * up
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    return g / (1.0 + exp_f32(-alpha * g)) * (u + 1.0)


def split_gate_up(w1: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2I, ...] rows -> (gate rows, up rows)."""
    if interleaved:
        return w1[:, 0::2], w1[:, 1::2]
    i = w1.shape[1] // 2
    return w1[:, :i], w1[:, i:]


def _fp8_row_weights_torch(packed, scales) -> torch.Tensor:
    """MXFP4 -> fp32 values of the per-row e4m3 fold (what the fp8 kernels multiply)."""
    f = mxfp4_to_fp8_torch(packed, scales, group_k=None, validate=False)
    return f.values.float() * torch.pow(2.0, f.exponents.float())


def expert_mlp_torch(
    hidden: torch.Tensor,
    perm: Permutation,
    weights: MoEWeights,
    *,
    top_k: int,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    compute: str = "bf16",
    act_quant: str = "token",
    fp8_weights: FP8Weights | None = None,
    workspace=None,
    config=None,
    planar=None,
    split_words=None,
) -> torch.Tensor:
    """Twin of ``expert_mlp``: per-expert fp32 loops on the same quantised operands -> bf16 [S, H]
    (``planar`` holds the same values as ``weights``: the twin reads ``weights``)."""
    use_fp8 = compute in ("fp8", "fp8_fold") or fp8_weights is not None or workspace is not None
    if isinstance(weights, StackedExperts):
        w1, w2 = weights.dense()  # bf16 or FP8 values times their block scales, exactly, in fp32
    elif use_fp8:
        w1 = _fp8_row_weights_torch(weights.w1_packed, weights.w1_scales)
        w2 = _fp8_row_weights_torch(weights.w2_packed, weights.w2_scales)
    else:
        w1 = dequantize_mxfp4_torch(weights.w1_packed, weights.w1_scales, validate=False)
        w2 = dequantize_mxfp4_torch(weights.w2_packed, weights.w2_scales, validate=False)
    wg, wu = split_gate_up(w1, weights.gate_up_interleaved)
    bg = bu = None
    if weights.w1_bias is not None:
        bg, bu = split_gate_up(weights.w1_bias.float().unsqueeze(-1), weights.gate_up_interleaved)
        bg, bu = bg[..., 0], bu[..., 0]
    group = FP8_GROUP if act_quant == "group128" else None
    s = hidden.shape[0] * top_k
    x = hidden.float()[perm.sorted_slot.long() // top_k]  # [S, H] sorted
    if use_fp8:
        xq, xs = quantize_fp8_rows_torch(hidden, group)
        x = _dequant_rows(xq, xs)[perm.sorted_slot.long() // top_k]
    y = torch.empty(s, weights.hidden, dtype=torch.bfloat16, device=hidden.device)
    hbuf = torch.empty(s, weights.intermediate, dtype=torch.bfloat16, device=hidden.device)
    offs = perm.expert_offsets.tolist()
    for e in range(weights.n_experts):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        g = x[a:b] @ wg[e].t()
        u = x[a:b] @ wu[e].t()
        if bg is not None:
            g, u = g + bg[e].float(), u + bu[e].float()
        hbuf[a:b] = swiglu_torch(g, u, activation, alpha, limit).to(torch.bfloat16)
    hx = hbuf.float()
    if use_fp8:
        hx = _dequant_rows(*quantize_fp8_rows_torch(hbuf, group))
    for e in range(weights.n_experts):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        o = hx[a:b] @ w2[e].t()
        if weights.w2_bias is not None:
            o = o + weights.w2_bias[e].float()
        y[a:b] = o.to(torch.bfloat16)
    return y


def _dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """e4m3 [R, K] with scales [R] or [R, K/g] -> fp32 [R, K]."""
    if s.dim() == 1:
        return q.float() * s.unsqueeze(-1)
    r, k = q.shape
    return (q.float().reshape(r, s.shape[1], -1) * s.unsqueeze(-1)).reshape(r, k)


def moe_forward_torch(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    weights: MoEWeights,
    router: RouterConfig,
    *,
    correction_bias: torch.Tensor | None = None,
    shared: MoEWeights | None = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    compute: str = "bf16",
    act_quant: str = "token",
    fp8_weights: FP8Weights | None = None,
    workspace=None,
    config=None,
) -> torch.Tensor:
    """Twin of ``moe_forward`` (same signature and result up to accumulation order)."""
    _check_inputs(hidden, weights, activation, compute, act_quant)
    logits = gate_logits(hidden, gate_weight)
    topw, ids = route_torch(logits, router, correction_bias)
    perm = permute_by_expert_torch(ids, weights.n_experts)
    kw = dict(activation=activation, alpha=alpha, limit=limit, compute=compute, act_quant=act_quant)
    y = expert_mlp_torch(
        hidden, perm, weights, top_k=router.top_k, fp8_weights=fp8_weights, workspace=workspace, **kw
    )
    sh = _shared_forward(hidden, shared, expert_mlp_torch, **kw) if shared is not None else None
    return combine_torch(y, topw, perm.slot_pos, sh)


