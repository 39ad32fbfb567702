"""Fused MoE expert path: grouped GEMMs over expert-sorted tokens with MXFP4 weights decoded in-kernel.

Entry point (the runtime calls this once per MoE layer)::

    moe_forward(hidden, gate_weight, weights, router, *, correction_bias=None, shared=None,
                activation="swiglu", alpha=1.702, limit=7.0, compute="bf16", act_quant="token",
                fp8_weights=None, workspace=None, config=None) -> bf16 [T, H]

    hidden        bf16 [T, H]
    gate_weight   [E, H] (any float dtype; gating runs in fp32)
    weights       MoEWeights: w1 (gate+up) blocks uint8 [E, 2I, H/32, 16], scales uint8 [E, 2I, H/32];
                  w2 (down) blocks uint8 [E, H, I/32, 16], scales [E, H, I/32]; optional biases
                  w1_bias [E, 2I], w2_bias [E, H]; gate_up_interleaved (gpt-oss: rows alternate
                  gate/up; DeepSeek: gate rows then up rows)
    router        RouterConfig (softmax or DeepSeek sigmoid group-limited, k, scaling)
    correction_bias fp32 [E] | None (DeepSeek-V3 e_score_correction_bias)
    shared        MoEWeights | None: shared experts, every token, weight 1
    activation    "swiglu" (silu(gate) * up) or "swiglu_clamped" (gpt-oss: gate clamped above at
                  ``limit``, up clamped to +-limit, gate * sigmoid(alpha * gate) * (up + 1))
    compute       "bf16": MXFP4 decoded to bf16 in registers, bf16 MMA
                  "fp8":  activations quantised to e4m3 (power-of-two scale per token, or per
                          1x128 group with ``act_quant="group128"``), MXFP4 folded into e4m3 with a
                          per-row exponent (no rescaling inside the K loop), fp8 MMA
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

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels.mxfp4 import (
    INTERPRET,
    check_scales,
    decode_mxfp4_tile_fp8,
    decode_mxfp4_words,
    dequantize_mxfp4_torch,
    from_gpt_oss_blocks,
    mxfp4_to_fp8,
    mxfp4_to_fp8_torch,
    pow2_f32,
    to_bf16,
    to_e4m3,
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

ACTIVATIONS = {"swiglu": 1, "swiglu_clamped": 2}
FP8_GROUP = 128
"""Elements per activation scale group with act_quant='group128' (DeepSeek's 1x128)."""


# ----------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------


@dataclass
class MoEWeights:
    """One MoE layer's expert weights in MXFP4 (gpt-oss tensor layout).

    w1_blocks uint8 [E, 2I, H/32, 16], w1_scales uint8 [E, 2I, H/32]  (gate and up rows)
    w2_blocks uint8 [E, H, I/32, 16],  w2_scales uint8 [E, H, I/32]   (down)
    w1_bias [E, 2I] | None, w2_bias [E, H] | None (float)
    gate_up_interleaved: True for gpt-oss (row 2i gate, 2i+1 up), False for gate rows then up rows.
    """

    w1_blocks: torch.Tensor
    w1_scales: torch.Tensor
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor
    w1_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    gate_up_interleaved: bool = False

    def __post_init__(self):
        e, n1, kb1, _ = self.w1_blocks.shape
        e2, h, kb2, _ = self.w2_blocks.shape
        if e2 != e or n1 % 2 or kb2 * 32 * 2 != n1 or kb1 * 32 != h:
            raise InputError(
                f"w1 blocks {tuple(self.w1_blocks.shape)} and w2 blocks {tuple(self.w2_blocks.shape)} do not "
                "form an MoE layer",
                field="w2_blocks",
                hint="expect w1 [E, 2I, H/32, 16] and w2 [E, H, I/32, 16]",
            )
        if tuple(self.w1_scales.shape) != (e, n1, kb1) or tuple(self.w2_scales.shape) != (e, h, kb2):
            raise InputError("MXFP4 scales do not match their blocks", field="w1_scales")

    @property
    def n_experts(self) -> int:
        return self.w1_blocks.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2_blocks.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1_blocks.shape[1] // 2

    @property
    def w1_packed(self) -> torch.Tensor:
        return from_gpt_oss_blocks(self.w1_blocks)

    @property
    def w2_packed(self) -> torch.Tensor:
        return from_gpt_oss_blocks(self.w2_blocks)

    def nbytes(self) -> int:
        """Bytes of the expert weights as stored (blocks, scales, biases)."""
        ts = [self.w1_blocks, self.w1_scales, self.w2_blocks, self.w2_scales, self.w1_bias, self.w2_bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def validate(self) -> None:
        """Reject NaN (0xFF) E8M0 scales with ``InputError``. Synchronises; call at load time."""
        check_scales(self.w1_scales, "w1_scales")
        check_scales(self.w2_scales, "w2_scales")


@dataclass
class FP8Weights:
    """One layer's experts converted to e4m3 ahead of time (the offline path).

    w1 e4m3 [E, 2I, H], w1_exp int32 [E, 2I]; w2 e4m3 [E, H, I], w2_exp int32 [E, H]:
    weight = w * 2**exp per row. lost: int64 [1], elements that lost bits in the conversion.
    """

    w1: torch.Tensor
    w1_exp: torch.Tensor
    w2: torch.Tensor
    w2_exp: torch.Tensor
    w1_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    gate_up_interleaved: bool
    lost: torch.Tensor

    @classmethod
    def from_mxfp4(cls, weights: MoEWeights, validate: bool = True) -> FP8Weights:
        """Convert every expert (per-row exponent fold, the same rule as the fused fp8 path)."""
        a = mxfp4_to_fp8(weights.w1_packed, weights.w1_scales, group_k=None, validate=validate)
        b = mxfp4_to_fp8(weights.w2_packed, weights.w2_scales, group_k=None, validate=validate)
        return cls(
            a.values,
            a.exponents[..., 0].contiguous(),
            b.values,
            b.exponents[..., 0].contiguous(),
            weights.w1_bias,
            weights.w2_bias,
            weights.gate_up_interleaved,
            a.lost + b.lost,
        )

    def nbytes(self) -> int:
        ts = [self.w1, self.w1_exp, self.w2, self.w2_exp, self.w1_bias, self.w2_bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


# ----------------------------------------------------------------------------------------------
# configs and tile maps
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape of one grouped GEMM: tokens per tile (block_m), weight rows per tile (block_n;
    gate and up rows each for GEMM1), K per step, L2 grouping, warps, pipeline depth, programs per SM
    (0: one program per work item, so kernels on other streams can take SMs as programs retire),
    and the MMA orientation: swap_ab True puts weight rows in the MMA's M (small T), False puts
    tokens in M and the weight tile in the B operand (large T: the decoded tile goes through shared
    memory the way wgmma wants it)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 4
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4
    swap_ab: bool = True


def pick_configs(slots: int, n_experts: int, compute: str) -> tuple[GemmConfig, GemmConfig]:
    """Configs for (GEMM1, GEMM2) from the mean slots per expert (same block_m for both).

    compute: "bf16" (MXFP4 decoded to bf16), "fp8" (MXFP4 decoded to e4m3 in the GEMM) or
    "fp8_stored" (e4m3 weights read from memory: offline copy or workspace).
    """
    if INTERPRET:
        c = GemmConfig(
            block_m=16, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1, programs_per_sm=1
        )
        return c, c
    per_expert = slots / max(1, n_experts)
    bk_small = 256
    if per_expert <= 16 and compute == "bf16":
        # word decode: K steps of 128 and 6 stages keep registers at <= 168 (3-4 programs per SM)
        return (GemmConfig(16, 32, 128, 4, 4, 6, 4), GemmConfig(16, 64, 128, 4, 4, 6, 4))
    if per_expert <= 16:
        return (GemmConfig(16, 32, bk_small, 4, 4, 4, 4), GemmConfig(16, 64, bk_small, 4, 4, 4, 4))
    if per_expert <= 48:
        return (GemmConfig(32, 32, bk_small, 4, 4, 4, 4), GemmConfig(32, 64, bk_small, 4, 4, 4, 4))
    if compute == "bf16":
        if per_expert <= 160:
            return (GemmConfig(64, 64, 128, 4, 4, 3, 2), GemmConfig(64, 128, 128, 4, 8, 3, 2))
        return (GemmConfig(128, 64, 64, 8, 8, 3, 1), GemmConfig(128, 128, 64, 8, 8, 3, 1))
    # fp8 MMA with 64+ tokens per expert: tokens in M, weight tile as the B operand
    if per_expert <= 160:
        return (
            GemmConfig(64, 64, 128, 4, 4, 3, 2, swap_ab=False),
            GemmConfig(64, 128, 128, 4, 4, 3, 2, swap_ab=False),
        )
    if compute == "fp8_stored":
        return (
            GemmConfig(128, 128, 128, 8, 8, 3, 1, swap_ab=False),
            GemmConfig(128, 256, 128, 8, 8, 3, 1, swap_ab=False),
        )
    return (
        GemmConfig(128, 64, 128, 8, 8, 3, 1, swap_ab=False),
        GemmConfig(128, 128, 128, 8, 8, 3, 1, swap_ab=False),
    )


@dataclass
class TileMap:
    """Work items of a grouped GEMM: m-tiles of block_m sorted positions, expert-major.

    tile_expert int32 [max_tiles], tile_row int32 [max_tiles] (first sorted position),
    tile_start int32 [E+1] (first m-tile of each expert; tile_start[E] = number of m-tiles).
    """

    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    tile_start: torch.Tensor
    block_m: int
    max_tiles: int


def max_m_tiles(slots: int, n_experts: int, block_m: int) -> int:
    """Upper bound on m-tiles: sum_e ceil(c_e / bm) <= ceil(S / bm) + min(E, S)."""
    return triton.cdiv(slots, block_m) + min(n_experts, slots) + 1


def tile_map_torch(expert_offsets: torch.Tensor, block_m: int, max_tiles: int) -> TileMap:
    """Twin of ``tile_map``."""
    e = expert_offsets.numel() - 1
    counts = (expert_offsets[1:] - expert_offsets[:-1]).long()
    nt = (counts + block_m - 1) // block_m
    start = torch.zeros(e + 1, dtype=torch.int64, device=counts.device)
    start[1:] = torch.cumsum(nt, 0)
    i = torch.arange(max_tiles, device=counts.device)
    ex = torch.searchsorted(start[1:], i, right=True).clamp(max=e - 1)
    row = expert_offsets.long()[ex] + (i - start[ex]) * block_m
    return TileMap(ex.int(), row.int(), start.int(), block_m, max_tiles)


@triton.jit
def _tile_map_kernel(
    offsets_ptr,
    expert_ptr,
    row_ptr,
    start_ptr,
    n_experts,
    max_tiles,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: tiles per expert, their exclusive prefix, then expert and row of every tile."""
    e = tl.arange(0, E_PAD)
    em = e < n_experts
    lo = tl.load(offsets_ptr + e, mask=em, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=em, other=0)
    nt = (hi - lo + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(nt, axis=0)
    start = end - nt
    tl.store(start_ptr + e, start, mask=em)
    tl.store(start_ptr + n_experts + e * 0, tl.sum(nt, axis=0), mask=e == 0)
    for i0 in range(0, max_tiles, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        ex = tl.sum(((end[None, :] <= i[:, None]) & em[None, :]).to(tl.int32), axis=1)
        ex = tl.minimum(ex, n_experts - 1)
        st = tl.sum(tl.where(e[None, :] == ex[:, None], start[None, :], 0), axis=1)
        base = tl.sum(tl.where(e[None, :] == ex[:, None], lo[None, :], 0), axis=1)
        ok = i < max_tiles
        tl.store(expert_ptr + i, ex, mask=ok)
        tl.store(row_ptr + i, base + (i - st) * BLOCK_M, mask=ok)


def tile_map(expert_offsets: torch.Tensor, block_m: int, max_tiles: int) -> TileMap:
    """m-tiles of each expert's sorted positions (Triton, one program)."""
    e = expert_offsets.numel() - 1
    dev = expert_offsets.device
    ex = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    row = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    start = torch.empty(e + 1, dtype=torch.int32, device=dev)
    _tile_map_kernel[(1,)](
        expert_offsets,
        ex,
        row,
        start,
        e,
        max_tiles,
        BLOCK_M=block_m,
        E_PAD=triton.next_power_of_2(e),
        CHUNK=32,
    )
    return TileMap(ex, row, start, block_m, max_tiles)


# ----------------------------------------------------------------------------------------------
# fp8 activation quantisation
# ----------------------------------------------------------------------------------------------


def _pow2_scale_exponent_torch(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax <= 448 * 2**e, from fp32 bits (clamped to [-126, 127])."""
    bits = amax.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).int()
    return e.clamp(-126, 127)


def quantize_fp8_rows_torch(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``quantize_fp8_rows``: x [R, K] -> (e4m3 [R, K], fp32 pow2 scales [R] or [R, K/group])."""
    r, k = x.shape
    g = k if group is None else group
    xf = x.float().reshape(r, k // g, g)
    e = _pow2_scale_exponent_torch(xf.abs().amax(dim=-1))
    q = (xf * torch.pow(2.0, -e.float()).unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(r, k)
    scale = torch.pow(2.0, e.float())
    return q, (scale[:, 0].contiguous() if group is None else scale)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    range_ptr,
    lo_idx,
    hi_idx,
    n_rows,
    k,
    stride_s,
    USE_RANGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Persistent over rows in [range[lo_idx], range[hi_idx]) (USE_RANGE) or [0, n_rows)."""
    lo = 0
    hi = n_rows
    if USE_RANGE:
        lo = tl.load(range_ptr + lo_idx)
        hi = tl.load(range_ptr + hi_idx)
    for row in range(lo + tl.program_id(0), hi, tl.num_programs(0)):
        r = row + tl.zeros((), tl.int64)
        for g0 in range(0, k, GROUP):
            amax = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, GROUP, BLOCK_K):
                kk = g0 + k0 + tl.arange(0, BLOCK_K)
                m = (kk < k) & (k0 + tl.arange(0, BLOCK_K) < GROUP)
                amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + r * k + kk, mask=m, other=0.0).to(tl.float32)))
            a = tl.max(amax, axis=0)
            bits = a.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
            e = tl.minimum(tl.maximum(e, -126), 127)
            inv = pow2_f32(-e)
            for k0 in range(0, GROUP, BLOCK_K):
                kk = g0 + k0 + tl.arange(0, BLOCK_K)
                m = (kk < k) & (k0 + tl.arange(0, BLOCK_K) < GROUP)
                v = tl.load(x_ptr + r * k + kk, mask=m, other=0.0).to(tl.float32) * inv
                tl.store(q_ptr + r * k + kk, to_e4m3(v), mask=m)
            tl.store(s_ptr + r * stride_s + g0 // GROUP, pow2_f32(e))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def quantize_fp8_rows(
    x: torch.Tensor,
    group: int | None = None,
    row_range: tuple[torch.Tensor, int, int] | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [R, K] -> (e4m3 [R, K], fp32 power-of-two scales [R] (group None) or [R, K/group]).

    Scale 2**e with the smallest e such that amax <= 448 * 2**e, so x * 2**-e is exact before the
    one e4m3 rounding. row_range: int32 [2] on the device, rows [lo, hi) to quantise (others are
    left untouched in ``out``). Bytes: reads 2*K (twice), writes K + 4*K/group per row.
    """
    r, k = x.shape
    g = k if group is None else group
    if k % g:
        raise InputError(f"activation group {group} does not divide K={k}", field="act_quant")
    if out is None:
        q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty((r,) if group is None else (r, k // g), dtype=torch.float32, device=x.device)
    else:
        q, s = out
    rng, i, j = row_range if row_range is not None else (x, 0, 0)
    if r:
        grid = (max(1, min(r, _num_sms(x.device) * 8)),)
        _quantize_fp8_rows_kernel[grid](
            x,
            q,
            s,
            rng,
            i,
            j,
            r,
            k,
            1 if group is None else k // g,
            USE_RANGE=row_range is not None,
            GROUP=g,
            BLOCK_K=min(1024, triton.next_power_of_2(g)),
        )
    return q, s


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
):
    """One weight tile [BLOCK_N, BLOCK_K] in the MMA's operand type.

    W_MODE 0: MXFP4 read as int32 words (8 codes each) -> bf16 (fp32 under the interpreter), columns
    in ``word_k_order`` (k_words = K/8, passed so its divisibility gives 16-byte loads);
    1: MXFP4 bytes -> e4m3 folded relative to g_row; 2: e4m3 weights read as they are.
    w_ptr / sc_ptr already point at the expert (or slot).
    """
    if W_MODE == 2:
        kk = k0 + tl.arange(0, BLOCK_K)
        return tl.load(
            w_ptr + wrow[:, None] * k + kk[None, :], mask=n_ok[:, None] & (kk < k)[None, :], other=0.0
        )
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
):
    """Grouped GEMM over expert-sorted slots: acc[n, m] = W[e, n, :] . x[m, :].

    SWAP: the MMA computes W x^T (weight rows in M); otherwise x W^T (tokens in M, the weight
    tile as B operand), transposed once before the epilogue.

    x: bf16 [rows, K] (or e4m3 with scales xs) gathered by token (GATHER: row = sorted_slot // TOPK)
    or read in sorted order; W: see _load_w_tile; out bf16 [S, n_out] in sorted order.
    ACTIVATION 0: out = acc (+bias); 1/2: gate rows n*gate_mult, up rows n*gate_mult + up_off,
    out = swiglu(gate, up) (plain / gpt-oss clamped). Experts [e_lo, e_hi) only; weight slot of
    expert e is e - e_lo + slot_base (W_MODE 2) or e (MXFP4).
    """
    m_lo = tl.load(tile_start_ptr + e_lo)
    n_m = tl.load(tile_start_ptr + e_hi) - m_lo
    n_n = tl.cdiv(n_out, BLOCK_N)
    total = n_m * n_n
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        width = GROUP_M * n_n
        first_m = (tile // width) * GROUP_M
        gsz = tl.minimum(n_m - first_m, GROUP_M)
        mt = m_lo + first_m + (tile % width) % gsz
        nt = (tile % width) // gsz
        e = tl.load(tile_expert_ptr + mt)
        row0 = tl.load(tile_row_ptr + mt)
        row_end = tl.load(offsets_ptr + e + 1)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        if GATHER:
            tok = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0) // TOPK
        else:
            tok = rows
        tok = tok.to(tl.int64)
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
        if W_MODE != 0:
            g_g = _row_exponent(sbase, rg, n_ok, k, W_MODE, BLOCK_N)
            if ACTIVATION != 0:
                g_u = _row_exponent(sbase, ru, n_ok, k, W_MODE, BLOCK_N)
        if SWAP:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + tok[:, None] * stride_x + kk[None, :],
                mask=row_ok[:, None] & (kk < k)[None, :],
                other=0.0,
            )
            if DOT_F32:
                x = x.to(tl.float32)
            wg = _load_w_tile(wbase, sbase, rg, n_ok, k0, k, k_words, g_g, W_MODE, BLOCK_N, BLOCK_K, DOT_F32)
            if ACT_GROUP:
                xs = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=row_ok, other=0.0)
            if SWAP:
                xt = tl.trans(x)
                if ACT_GROUP:
                    acc_g += tl.dot(wg, xt) * xs[None, :]
                else:
                    acc_g = tl.dot(wg, xt, acc_g)
            else:
                if ACT_GROUP:
                    acc_g += tl.dot(x, tl.trans(wg)) * xs[:, None]
                else:
                    acc_g = tl.dot(x, tl.trans(wg), acc_g)
            if ACTIVATION != 0:
                wu = _load_w_tile(
                    wbase, sbase, ru, n_ok, k0, k, k_words, g_u, W_MODE, BLOCK_N, BLOCK_K, DOT_F32
                )
                if SWAP:
                    if ACT_GROUP:
                        acc_u += tl.dot(wu, xt) * xs[None, :]
                    else:
                        acc_u = tl.dot(wu, xt, acc_u)
                else:
                    if ACT_GROUP:
                        acc_u += tl.dot(x, tl.trans(wu)) * xs[:, None]
                    else:
                        acc_u = tl.dot(x, tl.trans(wu), acc_u)
        if not SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        if W_MODE != 0:
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


def _mxfp4_operand(packed: torch.Tensor, scales: torch.Tensor, bias, fp8: bool) -> _WeightOperand:
    """fp8: bytes for the e4m3 decode (W_MODE 1); bf16: the same memory as int32 words (W_MODE 0)."""
    k = packed.shape[-1] * 2
    w = packed if fp8 else packed.view(torch.int32)
    return _WeightOperand(w, scales, w.stride(0), scales.stride(0), bias, 1 if fp8 else 0, k)


def fp8_operand(w: torch.Tensor, exps: torch.Tensor, bias) -> _WeightOperand:
    return _WeightOperand(w, exps, w.stride(0), exps.stride(0), bias, 2, w.shape[-1])


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
    if act_group and cfg.block_k != FP8_GROUP:
        cfg = GemmConfig(
            cfg.block_m,
            cfg.block_n,
            FP8_GROUP,
            cfg.group_m,
            cfg.num_warps,
            cfg.num_stages,
            cfg.programs_per_sm,
            cfg.swap_ab,
        )
    n_work = min(tiles.max_tiles, max_m_tiles(out.shape[0], e_hi - e_lo, cfg.block_m)) * triton.cdiv(
        n_out, cfg.block_n
    )
    if cfg.programs_per_sm > 0:
        n_work = min(n_work, _num_sms(x.device) * cfg.programs_per_sm)
    grid = (max(1, n_work),)
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
        op.k // 8,
        gate_mult,
        up_off,
        float(alpha),
        float(limit),
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
        DOT_F32=INTERPRET and op.mode == 0,
        SWAP=cfg.swap_ab,
        WORD_ORDER_OUT=op.mode == 0 and activation != 0,
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
    if compute not in ("bf16", "fp8"):
        raise InputError(f"unknown compute path {compute!r}", field="compute", hint="use 'bf16' or 'fp8'")
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
    config: tuple[GemmConfig, GemmConfig] | None = None,
) -> torch.Tensor:
    """GEMM1 + SwiGLU + GEMM2 over expert-sorted slots: hidden bf16 [T, H] -> y bf16 [T*k, H] (sorted).

    FLOPs 6 * S * H * I; bytes: see the module docstring.
    """
    e, h, inter = weights.n_experts, weights.hidden, weights.intermediate
    s = hidden.shape[0] * top_k
    act = ACTIVATIONS[activation]
    use_fp8 = compute == "fp8" or fp8_weights is not None or workspace is not None
    stored = fp8_weights is not None or workspace is not None
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


def swiglu_torch(
    gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float
) -> torch.Tensor:
    """fp32 SwiGLU: plain silu(gate) * up, or gpt-oss's clamped form."""
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


def _split_gate_up(w1: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
) -> torch.Tensor:
    """Twin of ``expert_mlp``: per-expert fp32 loops on the same quantised operands -> bf16 [S, H]."""
    use_fp8 = compute == "fp8" or fp8_weights is not None or workspace is not None
    if use_fp8:
        w1 = _fp8_row_weights_torch(weights.w1_packed, weights.w1_scales)
        w2 = _fp8_row_weights_torch(weights.w2_packed, weights.w2_scales)
    else:
        w1 = dequantize_mxfp4_torch(weights.w1_packed, weights.w1_scales, validate=False)
        w2 = dequantize_mxfp4_torch(weights.w2_packed, weights.w2_scales, validate=False)
    wg, wu = _split_gate_up(w1, weights.gate_up_interleaved)
    bg = bu = None
    if weights.w1_bias is not None:
        bg, bu = _split_gate_up(weights.w1_bias.float().unsqueeze(-1), weights.gate_up_interleaved)
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


def moe_flops(tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """FLOPs of the routed expert GEMMs: 6 * T * k * H * I."""
    return 6 * tokens * top_k * hidden * intermediate


def mxfp4_expert_bytes(hidden: int, intermediate: int) -> int:
    """Bytes of one expert's three matrices in MXFP4 (codes + E8M0 scales): 3*H*I*17/32."""
    return math.ceil(3 * hidden * intermediate * 17 / 32)
