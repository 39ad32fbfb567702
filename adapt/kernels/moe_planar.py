"""MXFP4 experts in a load-time "planar" layout for the MMA operand, and the small-T grouped GEMM on it.

Why a layout. A 32-bit word of plain MXFP4 holds 8 consecutive K elements; decoding it into a bf16
MMA operand takes a shuffle of the decoded halves (joins, reshapes, a shared-memory round trip).
The planar layout, made once at load time, arranges the nibbles so that each decoded 16-bit half
pair is already one bf16x2 register of the operand: two adjacent K columns of one K plane.

Layout (``PlanarMXFP4``), per row, per step of 128 K elements (K padded to a multiple of 128 with
zero codes): 16 int32 words, word ``h * 8 + c`` (h in {0, 1}, c in 0..7); each 16-bit half holds four
codes, one per plane ``p`` in 0..3, the low half element ``16 * (4h + p) + 2c`` and the high half
element ``16 * (4h + p) + 2c + 1`` of the step. So plane ``j = 4h + p`` is the K range
``[16j, 16j + 16)`` of the step. Inside a half, the code bits (mantissa, exponent low, exponent
high, sign) of plane p sit at ``NIBBLE_BITS[p]``: chosen so that plane 0 and 1 decode with one
shift and one mask, plane 2 with one shift and two masks, plane 3 with two shifts and two masks
(15 integer operations per word, 3.75 per bf16x2 register; the magnitude lands in bf16 bits 6..8,
the sign in bit 15, in both halves at once: the bf16 pair of value * 2**-126), then one bf16x2
multiply by ``2**(s - 1) = 2**126 * 2**(s - 127)`` (E8M0 scale s; plane j uses the step's 32-block
j // 2). That single multiply needs s <= 128 (the factor stays a finite bf16): such layers store
each scale byte pre-biased as ``s + 126``, the bf16 exponent of the factor, so two shifts and two
masks place four factors into two bf16x2 registers; layers with a larger scale keep the E8M0 bytes
and take the two-multiply decode (``TWO_MULS``). Bytes are the MXFP4 bytes (K/2 + K/32 per row).

Tiles: rows are grouped in blocks of ``ROW_BLOCK`` (N padded to a multiple with zero codes) and
stored block-major, step-major inside a block: ``words[e, n // 64, step, n % 64, 16]``, so the 64 rows
of one step are 4 KB contiguous in memory (scales likewise: 256 B), where a row-major copy puts each
row's 64 bytes of a step at the row pitch (3.5 KB on DeepSeek-V3 GEMM1).

Rows: GEMM1 (gate + up, 2I rows) is stored with gate and up rows interleaved (row 2i gate i,
row 2i + 1 up i) whatever the checkpoint's order, so one tile of BLOCK_N rows yields BLOCK_N / 2
SwiGLU outputs; GEMM2 (down, H rows) keeps its order.

Kernel (``planar_gemm``): swap-AB (weight rows in the MMA's M, tokens in N, block_m >= 16), one MMA
chain of K = 128 per step (``one_dot``: the decoded planes joined into the operand) or eight
``tl.dot`` of K = 16, one per plane, each against the 16 activation columns of the plane;
an optional split along K (``split_k``) for T = 1..16 so that every SM streams weights, the partial
sums reduced by ``_split_k_epilogue_kernel`` (bias, SwiGLU). FLOPs 2 * S * N * K per GEMM; bytes:
the active experts' MXFP4 once (per GROUP_M m-tiles), activations, bf16 outputs, and with split_k
an fp32 partial of split_k * S * N * 4 bytes written and read once. With routing weights (``gamma``)
GEMM2 runs the weighted combine in its epilogue instead: atomic fp32 adds of gamma-weighted rows into
a [T, H] sum (split-K partials added the same way, no epilogue kernel); ``planar_moe`` picks it where
``moe_configs.PLANAR_FUSED_COMBINE`` says it was measured faster.

``planar_from_mxfp4`` / ``planar_to_mxfp4_torch`` convert between the layouts (the second is the
inverse used by tests); ``planar_gemm_torch`` is the twin of ``planar_gemm``; ``planar_experts_run``
runs both GEMMs of a layer (``expert_mlp``'s planar path), ``planar_moe`` the layer with its combine
(with ``one_kernel``: GEMM1, SwiGLU, GEMM2 and the combine in one launch, ``_planar_mlp_kernel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels import pdl
from adapt.kernels.moe_configs import PlanarConfig, PlanarMLPConfig
from adapt.kernels.moe_tiles import num_sms, tile_slots
from adapt.kernels.mxfp4 import INTERPRET, dequantize_mxfp4_torch, pow2_f32, to_bf16, to_e4m3

PLANAR_STEP = 128
"""K elements per step of the planar layout (16 words per row)."""
ROW_BLOCK = 64
"""Rows per block of the tiled layout (one step of a block is 64 x 16 words, contiguous)."""
ZERO_FIRST = True
"""The fused combine's fp32 sum is set (zeros, or the shared expert's output) before the tile map, not between GEMM1
and GEMM2, so the two GEMMs are neighbours in the PDL chain. False: the former order (a probe's A/B)."""
FAST_SCALE_MAX = 128
"""Largest E8M0 byte for which 2**126 * scale is a finite bf16 (one multiply per pair)."""
SCALE_BIAS = FAST_SCALE_MAX - 2
"""Added to every scale byte of a one-multiply layer: s + 126 is the bf16 exponent of 2**(s - 1)."""
NIBBLE_BITS = ((0, 1, 2, 9), (3, 4, 5, 12), (6, 7, 8, 10), (13, 14, 15, 11))
"""Per plane p: the bit positions, inside a 16-bit half of a planar word, of the code's mantissa,
exponent low bit, exponent high bit and sign."""


@dataclass
class PlanarMXFP4:
    """One GEMM's experts in the planar layout (see the module docstring).

    words  int32 [E, Np/64, Kp/128, 64, 16] (Np = N rounded up to ROW_BLOCK, Kp = K rounded up to
           128, both with zero codes; the MXFP4 code bytes of the rows and steps)
    scales uint8 [E, Np/64, Kp/128, 64, 4]  the MXFP4 block scales, E8M0 + SCALE_BIAS unless
           two_muls, else E8M0 (a padded block: 127 before the bias)
    n, k   logical rows and K; gate_up: rows are interleaved gate/up pairs (GEMM1)
    two_muls: some scale byte exceeds FAST_SCALE_MAX (decode with two multiplies)
    """

    words: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    gate_up: bool
    two_muls: bool

    @property
    def k_padded(self) -> int:
        return self.words.shape[2] * PLANAR_STEP

    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel()


def _tiled(t: torch.Tensor, np_: int, per_step: int, fill: int) -> torch.Tensor:
    """Row-major [N, steps * per_step] -> [Np/64, steps, 64, per_step], rows N..Np set to ``fill``."""
    n, cols = t.shape
    out = torch.full((np_, cols), fill, dtype=t.dtype, device=t.device)
    out[:n] = t
    return out.reshape(np_ // ROW_BLOCK, ROW_BLOCK, cols // per_step, per_step).permute(0, 2, 1, 3).contiguous()


def _untiled(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_tiled`` over a leading expert dim: [E, Np/64, steps, 64, w] -> [E, n, steps * w]."""
    e, nb, steps, rb, w = t.shape
    return t.permute(0, 1, 3, 2, 4).reshape(e, nb * rb, steps * w)[:, :n]


def _interleave_gate_up(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[E, 2I, ...] in the checkpoint's gate/up order -> rows (gate 0, up 0, gate 1, up 1, ...)."""
    if interleaved:
        return t
    i = t.shape[1] // 2
    return torch.stack((t[:, :i], t[:, i:]), dim=2).reshape(t.shape)


def planar_from_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, *, gate_up: bool = False, interleaved: bool = False
) -> PlanarMXFP4:
    """MXFP4 packed uint8 [E, N, K/2] + scales uint8 [E, N, K/32] -> ``PlanarMXFP4`` (load time).

    gate_up: GEMM1 rows (gate and up); interleaved: the checkpoint already alternates them (gpt-oss),
    else its first I rows are gate and the next I up (DeepSeek). Torch ops on the weights' device;
    transient memory about 4x one matrix's codes.
    """
    e, n, kh = packed.shape
    k = kh * 2
    if scales.shape != (e, n, k // 32):
        raise InputError(f"scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}", field="scales")
    if gate_up:
        packed = _interleave_gate_up(packed, interleaved)
        scales = _interleave_gate_up(scales, interleaved)
    kp = -(-k // PLANAR_STEP) * PLANAR_STEP
    np_ = -(-n // ROW_BLOCK) * ROW_BLOCK
    steps = kp // PLANAR_STEP
    words = torch.empty(e, np_ // ROW_BLOCK, steps, ROW_BLOCK, 16, dtype=torch.int32, device=packed.device)
    lut = _nibble_lut(packed.device).reshape(1, 1, 4, 16, 1, 1)
    for ex in range(e):  # one expert at a time: the int64 transient is 16x one expert's codes
        codes = torch.zeros(n, kp, dtype=torch.uint8, device=packed.device)
        codes[:, 0:k:2] = packed[ex] & 0xF
        codes[:, 1:k:2] = packed[ex] >> 4
        # codes[n, step, plane j = 4h + p, col = 2c + half] -> word (step, h, c), half's bits NIBBLE_BITS[p]
        c = codes.reshape(n * steps, 2, 4, 1, 8, 2).to(torch.int64)  # h, p, -, c, half
        spread = torch.take_along_dim(lut.expand(c.shape[0], 2, 4, 16, 8, 2), c, dim=3)
        wd = (spread.squeeze(3) << (16 * torch.arange(2, device=packed.device))).sum(dim=(2, 4))  # [n*steps, 2, 8]
        wd = torch.where(wd >= 2**31, wd - 2**32, wd).to(torch.int32).reshape(n, kp // 8)
        words[ex] = _tiled(wd, np_, 16, 0)
    two = bool((scales.int().amax() > FAST_SCALE_MAX).item()) if scales.numel() else False
    pad = 127 if two else 127 + SCALE_BIAS
    sc = torch.empty(e, np_ // ROW_BLOCK, steps, ROW_BLOCK, 4, dtype=torch.uint8, device=packed.device)
    for ex in range(e):
        rows = torch.full((n, kp // 32), pad, dtype=torch.uint8, device=packed.device)
        rows[:, : k // 32] = scales[ex] if two else scales[ex] + SCALE_BIAS
        sc[ex] = _tiled(rows, np_, 4, pad)
    return PlanarMXFP4(words, sc, n, k, gate_up, two)


def _nibble_lut(device) -> torch.Tensor:
    """int64 [4, 16]: code v of plane p spread to its bits ``NIBBLE_BITS[p]`` of a 16-bit half."""
    v = torch.arange(16, device=device)
    pos = torch.tensor(NIBBLE_BITS, device=device)  # [4 planes, 4 code bits]
    return (((v[None, :, None] >> torch.arange(4, device=device)) & 1) << pos[:, None, :]).sum(-1)


def planar_to_mxfp4_torch(p: PlanarMXFP4, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``planar_from_mxfp4``: -> (packed uint8 [E, N, K/2], scales uint8 [E, N, K/32])."""
    e, n, kp = p.words.shape[0], p.n, p.k_padded
    w = _untiled(p.words, n).long().bitwise_and(0xFFFFFFFF).reshape(e, n, kp // PLANAR_STEP, 2, 1, 8, 1, 1)
    half = 16 * torch.arange(2, device=w.device).reshape(1, 1, 1, 1, 1, 1, 2, 1)
    pos = torch.tensor(NIBBLE_BITS, device=w.device).reshape(1, 1, 1, 1, 4, 1, 1, 4)
    bits = (w >> (pos + half)) & 1  # [e, n, step, h, p, c, half, code bit]
    codes = (bits << torch.arange(4, device=w.device)).sum(-1).reshape(e, n, kp)[..., : p.k].to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = _untiled(p.scales, n)[..., : p.k // 32]
    if not p.two_muls:
        scales = scales - SCALE_BIAS
    if p.gate_up and not interleaved:
        packed = torch.cat((packed[:, 0::2], packed[:, 1::2]), dim=1)
        scales = torch.cat((scales[:, 0::2], scales[:, 1::2]), dim=1)
    return packed.contiguous(), scales.contiguous()


@triton.jit
def _plane_bits(w, P: tl.constexpr):
    """Plane P of words w (int32) as uint32 pairs: in each 16-bit half the code's magnitude at bits 6..8 and its
    sign at bit 15, the bf16 of code * 2**-126 (the bit moves of ``_plane_ptx``)."""
    u = w.to(tl.uint32, bitcast=True)
    if P == 0:
        pair = (u << 6) & 0x81C081C0
    elif P == 1:
        pair = (u << 3) & 0x81C081C0
    elif P == 2:
        pair = (u & 0x01C001C0) | ((u << 5) & 0x80008000)
    else:
        pair = ((u >> 7) & 0x01C001C0) | ((u << 4) & 0x80008000)
    return pair


@triton.jit
def _plane(w, f, P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Plane p of words w int32 [BLOCK_N, 8] -> fp32 [BLOCK_N, 16] times f fp32 [BLOCK_N] (2**(s-127)):
    the bit moves of ``_plane_ptx`` in plain Triton (the interpreter's path)."""
    pair = _plane_bits(w, P)
    lo = (pair << 16).to(tl.float32, bitcast=True)
    hi = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    v = tl.reshape(tl.join(lo, hi), (BLOCK_N, 16))
    return v * 8.507059173023462e37 * f[:, None]  # 2**126


def _plane_ptx(p: int, two_muls: bool, hi: bool) -> str:
    """PTX of plane p (``NIBBLE_BITS``) on one 32-bit word ($1; $2 is its duplicate), times one bf16
    of the packed factor pair $3 (its high half when ``hi``) broadcast to both lanes. Plane 0 and 1:
    one shift and one mask put the magnitude bits at bf16 bits 6..8 and the sign at bit 15 of both
    halves; plane 2: a mask and a shifted sign; plane 3: both shifted. One select per term (LOP3)
    and one bf16x2 multiply applies 2**126 * scale (two multiplies with two_muls)."""
    bits = (
        "shl.b32 a, $1, 6; and.b32 a, a, 0x81C081C0; ",
        "shl.b32 a, $1, 3; and.b32 a, a, 0x81C081C0; ",
        "and.b32 a, $1, 0x01C001C0; shl.b32 b, $1, 5; and.b32 b, b, 0x80008000; or.b32 a, a, b; ",
        "shr.b32 a, $1, 7; and.b32 a, a, 0x01C001C0; shl.b32 b, $1, 4; and.b32 b, b, 0x80008000; "
        "or.b32 a, a, b; ",
    )[p]
    fix = "mov.b32 b, 0x7E807E80; mul.rn.bf16x2 a, a, b; " if two_muls else ""
    lane = "{h, h}" if hi else "{l, l}"
    return (
        "{ .reg .b32 a, b, f; .reg .b16 l, h; " + bits + fix + "mov.b32 {l, h}, $3; mov.b32 f, " + lane + "; "
        "mul.rn.bf16x2 $0, a, f; }"
    )


_PTX = [[[tl.constexpr(_plane_ptx(p, t, h)) for h in (False, True)] for t in (False, True)] for p in range(4)]
_PTX0L, _PTX1L, _PTX2L, _PTX3L = (_PTX[p][0][0] for p in range(4))
_PTX0H, _PTX1H, _PTX2H, _PTX3H = (_PTX[p][0][1] for p in range(4))
_PTX0LT, _PTX1LT, _PTX2LT, _PTX3LT = (_PTX[p][1][0] for p in range(4))
_PTX0HT, _PTX1HT, _PTX2HT, _PTX3HT = (_PTX[p][1][1] for p in range(4))


@triton.jit
def _plane_asm(w, fp, P: tl.constexpr, HI: tl.constexpr, TWO_MULS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_plane`` in PTX (``_plane_ptx``): each word becomes one bf16x2 register of the operand;
    fp int32 [BLOCK_N]: two bf16 factors (``_scale_pairs``), the high one when HI."""
    w2 = tl.reshape(tl.join(w, w), (BLOCK_N, 16))
    f2 = tl.broadcast_to(fp[:, None], (BLOCK_N, 16))
    if TWO_MULS:
        if HI:
            if P == 0:
                asm: tl.constexpr = _PTX0HT
            elif P == 1:
                asm: tl.constexpr = _PTX1HT
            elif P == 2:
                asm: tl.constexpr = _PTX2HT
            else:
                asm: tl.constexpr = _PTX3HT
        else:
            if P == 0:
                asm: tl.constexpr = _PTX0LT
            elif P == 1:
                asm: tl.constexpr = _PTX1LT
            elif P == 2:
                asm: tl.constexpr = _PTX2LT
            else:
                asm: tl.constexpr = _PTX3LT
    else:
        if HI:
            if P == 0:
                asm: tl.constexpr = _PTX0H
            elif P == 1:
                asm: tl.constexpr = _PTX1H
            elif P == 2:
                asm: tl.constexpr = _PTX2H
            else:
                asm: tl.constexpr = _PTX3H
        else:
            if P == 0:
                asm: tl.constexpr = _PTX0L
            elif P == 1:
                asm: tl.constexpr = _PTX1L
            elif P == 2:
                asm: tl.constexpr = _PTX2L
            else:
                asm: tl.constexpr = _PTX3L
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r", [w2, f2], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _plane_any(w, s4, P: tl.constexpr, H: tl.constexpr, TWO_MULS: tl.constexpr, DOT_F32: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Plane p of words w [BLOCK_N, 8] of half h of the step (word c, half s -> column 2c + s), with
    the step's scale word s4 int32 [BLOCK_N] (block b in byte b; plane p of half h uses block
    2h + p // 2)."""
    if DOT_F32:
        f = _scale_factor((s4 >> (8 * (2 * H + P // 2))) & 0xFF, TWO_MULS)
        return _plane(w, f, P, BLOCK_N)
    else:
        if P < 2:
            fp = _scale_pairs(s4, 0, TWO_MULS)
        else:
            fp = _scale_pairs(s4, 1, TWO_MULS)
        return _plane_asm(w, fp, P, H == 1, TWO_MULS, BLOCK_N)


@triton.jit
def _half_planes(w, s4, H: tl.constexpr, TWO_MULS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr):
    """The four planes of words w [BLOCK_N, 8] (half H of the step) joined: [BLOCK_N, 16, 2, 2]."""
    p0 = _plane_any(w, s4, 0, H, TWO_MULS, DOT_F32, BLOCK_N)
    p1 = _plane_any(w, s4, 1, H, TWO_MULS, DOT_F32, BLOCK_N)
    p2 = _plane_any(w, s4, 2, H, TWO_MULS, DOT_F32, BLOCK_N)
    p3 = _plane_any(w, s4, 3, H, TWO_MULS, DOT_F32, BLOCK_N)
    return tl.join(tl.join(p0, p1), tl.join(p2, p3))


@triton.jit
def _tile(w0, w1, s4, TWO_MULS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr):
    """The step's whole operand [BLOCK_N, 128] in natural K order from words w0 (h = 0) and w1
    (h = 1), int32 [BLOCK_N, 8], and the step's scale word s4 [BLOCK_N].

    Word (h, c = 4 * posb + t), pair p, half s holds element 16 * (4h + p) + 8 * posb + 2t + s: the
    joins below only name registers (h, p, s) and the final permute puts each name at its place in
    K, so with the MMA's register layout no data moves between threads."""
    a0 = _half_planes(w0, s4, 0, TWO_MULS, DOT_F32, BLOCK_N)
    a1 = _half_planes(w1, s4, 1, TWO_MULS, DOT_F32, BLOCK_N)
    return _natural_order(a0, a1, BLOCK_N)


@triton.jit
def _natural_order(a0, a1, BLOCK_N: tl.constexpr):
    """The joined planes of both halves of a step ([BLOCK_N, 16, 2, 2] each, ``_half_planes``) -> [BLOCK_N,
    128] in natural K order (see ``_tile``)."""
    # [BN, 16 = (c, s), q0, q1] x h -> (BN, posb, t, s, q0, q1, h) -> (BN, h, q1, q0, posb, t, s)
    a = tl.reshape(tl.join(a0, a1), (BLOCK_N, 2, 4, 2, 2, 2, 2))
    return tl.reshape(tl.permute(a, (0, 6, 5, 4, 1, 2, 3)), (BLOCK_N, 128))


@triton.jit
def _scale_factor(b, TWO_MULS: tl.constexpr):
    """One stored scale byte (int32, 0..255) -> 2**(s - 127) as fp32 (s: the E8M0 byte; stored
    biased by SCALE_BIAS unless TWO_MULS)."""
    if TWO_MULS:
        s = b
    else:
        s = b - 126
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_pairs(s4, ODD: tl.constexpr, TWO_MULS: tl.constexpr):
    """The step's scale word s4 int32 [BLOCK_N] -> int32 [BLOCK_N] holding two bf16 factors: blocks
    0 (low half) and 2 (high half), or with ODD blocks 1 and 3. One-multiply layers (bytes s + 126):
    the bf16 2**(s-1), one shift and one mask for both. TWO_MULS (E8M0 bytes): 2**(s-127), the
    subnormal 2**-127 for s = 0."""
    u = s4.to(tl.uint32, bitcast=True)
    if ODD:
        u = u >> 8
    if TWO_MULS:
        lo = u & 0xFF
        hi = (u >> 16) & 0xFF
        lo = tl.where(lo == 0, 0x40, lo << 7)
        hi = tl.where(hi == 0, 0x40, hi << 7)
        return (lo | (hi << 16)).to(tl.int32, bitcast=True)
    else:
        return ((u << 7) & 0x7F807F80).to(tl.int32, bitcast=True)


@triton.jit
def _l2_prefetch_share(base, n_words, part, parts):
    """Prefetch share ``part`` of ``parts`` of words [0, n_words) at ``base`` (int32 pointer) into L2, evict-last:
    one ``prefetch.global.L2`` a 128-byte line, no registers written, nothing waited for."""
    per = tl.cdiv(tl.cdiv(n_words, parts), 32) * 32
    lo = part * per
    hi = tl.minimum(lo + per, n_words)
    for i0 in range(lo, hi, 32 * 256):
        offs = tl.minimum(i0 + tl.arange(0, 256) * 32, hi - 1)  # clamped: a repeated line costs nothing
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [base + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _planar_gemm_kernel(
    x_ptr,
    stride_x,
    w_ptr,
    sc_ptr,
    stride_we,
    stride_se,
    bias_ptr,
    stride_be,
    out_ptr,
    stride_o,
    part_ptr,
    gamma_ptr,
    sorted_slot_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_start_ptr,
    n_experts,
    n_rows,
    k,
    k_words,
    k_steps,
    n_slots,
    alpha,
    limit,
    TOPK: tl.constexpr,
    GATHER: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TWO_MULS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr,
    ONE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr = False,
    FLATTEN: tl.constexpr = False,
    COMBINE: tl.constexpr = False,
    STREAM_K: tl.constexpr = False,
    PDL: tl.constexpr = False,
    pf_ptr=None,
    pf_words=0,
    pf_stride_e=0,
    L2_NEXT: tl.constexpr = False,
):
    """acc[n, m] = W[e, n, :] . x[m, :] for one (m-tile, n-tile) per loop iteration; K split
    SPLIT_K ways by program_id(1).

    x bf16 [rows, K] (GATHER: row = sorted_slot // TOPK, else the sorted position); W planar
    (tiled words [E, Np/64, Kp/128, 64, 16], scales the same with 4 bytes). SPLIT_K == 1: out bf16
    [S, n_out] (ACTIVATION 0: n_out = n_rows, + bias; 1 / 2: n_out = n_rows / 2, SwiGLU of the interleaved gate/up rows,
    plain / gpt-oss clamped). SPLIT_K > 1: part fp32 [SPLIT_K, S, n_rows], raw sums (no bias).
    COMBINE (ACTIVATION 0, GATHER False): the weighted combine in the epilogue: out fp32 [T, n_rows]
    (zeroed by the caller) += gamma[slot] * (acc + bias) at row slot // TOPK of each sorted position's
    slot, by atomic adds; with SPLIT_K > 1 each split adds its partial the same way (bias by split 0),
    so no partial buffer and no epilogue kernel. FLATTEN: the tile and K loops pipelined as one loop
    (persistent programs, ``programs_per_sm`` > 0), so a program's loads run ahead across tiles.
    STREAM_K (persistent programs, SPLIT_K 1): the tiles x K steps are cut into one equal run of steps a
    program, so every program ends at the same time (no last partial wave); a tile cut between programs
    gets one partial sum from each. Each tile's sum goes out by relaxed fp32 atomic adds: with COMBINE as
    above (bias by the part that holds step 0), else raw into part fp32 [S, n_rows] (zeroed by the caller),
    which ``_split_k_epilogue_kernel`` (SPLIT_K 1) finishes (bias, SwiGLU, bf16). PDL: ``pdl.enter`` first.
    L2_NEXT (``PlanarConfig.l2_next``): the programs of each expert's first m-tile prefetch n-tile nt's share of the
    first pf_words words of that expert's next-GEMM words (pf_ptr, pf_stride_e words an expert) into L2 with the
    evict-last priority (this GEMM's words, streamed once through the asynchronous copies, keep the normal one).
    """
    pdl.enter(PDL)
    n_m = tl.load(tile_start_ptr + n_experts)
    n_n = tl.cdiv(n_rows, BLOCK_N)
    total = n_m * n_n
    steps = k_words // 16
    per_split = tl.cdiv(steps, SPLIT_K)
    s_lo = tl.program_id(1) * per_split
    s_hi = tl.minimum(s_lo + per_split, steps)
    if STREAM_K:
        iters = total.to(tl.int64) * steps
        it_lo = (tl.program_id(0) * iters // tl.num_programs(0)).to(tl.int32)
        it_hi = ((tl.program_id(0) + 1) * iters // tl.num_programs(0)).to(tl.int32)
        t_lo, t_hi, t_step = it_lo // steps, tl.cdiv(it_hi, steps), 1
    else:  # it_lo / it_hi unused here, but Triton's loop analysis needs them defined
        it_lo, it_hi = 0, 0
        t_lo, t_hi, t_step = tl.program_id(0), total, tl.num_programs(0)
    for tile in tl.range(t_lo, t_hi, t_step, flatten=FLATTEN):
        if STREAM_K:
            s_lo = tl.maximum(it_lo - tile * steps, 0)
            s_hi = tl.minimum(it_hi - tile * steps, steps)
        e, nt, rows, row_ok, tok = tile_slots(
            tile, n_m, n_n, 0, tile_expert_ptr, tile_row_ptr, offsets_ptr, sorted_slot_ptr,
            TOPK, GATHER, BLOCK_M, GROUP_M,
        )
        if L2_NEXT:
            if tl.min(rows, axis=0) == tl.load(offsets_ptr + e):  # the expert's first m-tile
                _l2_prefetch_share(pf_ptr + e.to(tl.int64) * pf_stride_e, pf_words, nt, n_n)
        n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_rows
        nc = tl.minimum(n, n_rows - 1).to(tl.int64)  # clamped rows: loads need no mask
        # tiled layout: row block nc // 64 holds its steps back to back, 64 x 16 words (64 scale words) each
        rb, ri = nc // 64, nc % 64
        wrow = w_ptr + e.to(tl.int64) * stride_we + rb * (k_words * 64) + ri * 16
        srow = sc_ptr + e.to(tl.int64) * stride_se + rb * (k_steps * 64) + ri
        c8 = tl.arange(0, 8)
        c16 = tl.arange(0, 16)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for st in range(s_lo, s_hi):
            w0 = tl.load(wrow[:, None] + (st * 1024 + c8)[None, :])
            if EVEN_K:
                w1 = tl.load(wrow[:, None] + (st * 1024 + 8 + c8)[None, :])
            else:  # the second half of a last, half-padded step (K = 2880 = 22.5 steps) is not read
                w1 = tl.load(wrow[:, None] + (st * 1024 + 8 + c8)[None, :], mask=st * 128 + 64 < k, other=0)
            s4 = tl.load(srow + st * 64)  # the step's four scale bytes, block b in byte b
            xb = x_ptr + tok[:, None] * stride_x + st * 128
            if ONE_DOT:
                if EVEN_K:  # K a multiple of 128: only the tile's rows are masked
                    xs = tl.load(xb + tl.arange(0, 128)[None, :], mask=row_ok[:, None], other=0.0)
                else:
                    kk = st * 128 + tl.arange(0, 128)
                    xs = tl.load(xb + tl.arange(0, 128)[None, :], mask=row_ok[:, None] & (kk < k)[None, :], other=0.0)
                if DOT_F32:
                    xs = xs.to(tl.float32)
                v = _tile(w0, w1, s4, TWO_MULS, DOT_F32, BLOCK_N)
                acc = tl.dot(v, tl.trans(xs), acc)
            else:
                for j in tl.static_range(8):
                    # K is a multiple of 32: a plane of 16 columns is wholly inside or wholly padding
                    xj = tl.load(
                        xb + (j * 16 + c16)[None, :], mask=row_ok[:, None] & (st * 128 + j * 16 < k), other=0.0
                    )
                    if DOT_F32:
                        xj = xj.to(tl.float32)
                    if j < 4:
                        v = _plane_any(w0, s4, j % 4, 0, TWO_MULS, DOT_F32, BLOCK_N)
                    else:
                        v = _plane_any(w1, s4, j % 4, 1, TWO_MULS, DOT_F32, BLOCK_N)
                    acc = tl.dot(v, tl.trans(xj), acc)
        if COMBINE:
            slot = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
            gam = tl.load(gamma_ptr + slot, mask=row_ok, other=0.0)
            if HAS_BIAS:
                bv = tl.load(bias_ptr + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
                if SPLIT_K > 1 or STREAM_K:
                    bv = tl.where(s_lo == 0, bv, 0.0)
                acc += bv[:, None]
            optr = out_ptr + (slot // TOPK).to(tl.int64)[None, :] * stride_o + n[:, None]
            tl.atomic_add(optr, acc * gam[None, :], mask=n_ok[:, None] & row_ok[None, :] & (s_hi > s_lo),
                          sem="relaxed")
        elif STREAM_K:
            pptr = part_ptr + rows[None, :].to(tl.int64) * n_rows + n[:, None]
            tl.atomic_add(pptr, acc, mask=n_ok[:, None] & row_ok[None, :] & (s_hi > s_lo), sem="relaxed")
        elif SPLIT_K > 1:
            pptr = part_ptr + (tl.program_id(1) * n_slots + rows[None, :]).to(tl.int64) * n_rows + n[:, None]
            tl.store(pptr, acc, mask=n_ok[:, None] & row_ok[None, :])
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[
                    :, None
                ]
            if ACTIVATION == 0:
                optr = out_ptr + rows[None, :].to(tl.int64) * stride_o + n[:, None]
                tl.store(optr, to_bf16(acc), mask=n_ok[:, None] & row_ok[None, :])
            else:
                gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))
                res = _swiglu(gate, up, alpha, limit, ACTIVATION)
                no = nt * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                optr = out_ptr + rows[None, :].to(tl.int64) * stride_o + no[:, None]
                tl.store(optr, to_bf16(res), mask=(no < n_rows // 2)[:, None] & row_ok[None, :])


@triton.jit
def _swiglu(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """fp32 SwiGLU: 1 plain silu(gate) * up; 2 gpt-oss clamped (see moe_gemm.swiglu_torch)."""
    if ACTIVATION == 1:
        return gate / (1.0 + tl.exp(-gate)) * up
    else:
        gc = tl.minimum(gate, limit)
        uc = tl.minimum(tl.maximum(up, -limit), limit)
        return gc / (1.0 + tl.exp(-alpha * gc)) * (uc + 1.0)


@triton.jit
def _split_k_epilogue_kernel(
    part_ptr,
    bias_ptr,
    stride_be,
    out_ptr,
    stride_o,
    sorted_slot_ptr,
    offsets_ptr,
    n_experts,
    n_slots,
    n_rows,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (sorted position r, column block): sum the SPLIT_K partials, + bias of r's expert,
    SwiGLU of interleaved pairs (ACTIVATION 1/2) -> out bf16 [S, n_out]."""
    pdl.enter(PDL)
    r = tl.program_id(0)
    ee = tl.arange(0, E_PAD)
    offs = tl.load(offsets_ptr + 1 + ee, mask=ee < n_experts, other=2**30)
    e = tl.sum((offs <= r).to(tl.int32), axis=0)
    if ACTIVATION == 0:
        n = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = n < n_rows
        acc = tl.zeros((BLOCK_R,), tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + (s * n_slots + r).to(tl.int64) * n_rows + n, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e.to(tl.int64) * stride_be + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r.to(tl.int64) * stride_o + n, to_bf16(acc), mask=ok)
    else:
        no = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = no < n_rows // 2
        g = tl.zeros((BLOCK_R,), tl.float32)
        u = tl.zeros((BLOCK_R,), tl.float32)
        for s in tl.static_range(SPLIT_K):
            base = part_ptr + (s * n_slots + r).to(tl.int64) * n_rows
            g += tl.load(base + 2 * no, mask=ok, other=0.0)
            u += tl.load(base + 2 * no + 1, mask=ok, other=0.0)
        if HAS_BIAS:
            g += tl.load(bias_ptr + e.to(tl.int64) * stride_be + 2 * no, mask=ok, other=0.0).to(tl.float32)
            u += tl.load(bias_ptr + e.to(tl.int64) * stride_be + 2 * no + 1, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r.to(tl.int64) * stride_o + no, to_bf16(_swiglu(g, u, alpha, limit, ACTIVATION)), mask=ok)


@triton.jit
def _half_tile(w, s4, HALF, TWO_MULS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
               NATURAL: tl.constexpr = True):
    """Half HALF (runtime 0 / 1) of a step as an operand [BLOCK_N, 64] in natural K order: words w
    int32 [BLOCK_N, 8] of that half, the step's scale word s4 [BLOCK_N] (its blocks 2 * HALF and
    2 * HALF + 1 moved to bytes 0 and 1, so the half decodes as half 0); NATURAL False: the columns
    in the order the decode leaves them (no permute; the other operand takes ``_half_order``)."""
    s4h = (s4.to(tl.uint32, bitcast=True) >> (16 * HALF)).to(tl.int32, bitcast=True)
    a = _half_planes(w, s4h, 0, TWO_MULS, DOT_F32, BLOCK_N)  # [BN, 16 = (c, s), q0, q1], plane q0 + 2 q1
    if NATURAL:  # as ``_tile``: (BN, posb, t, s, q0, q1) -> (BN, q1, q0, posb, t, s), register names only
        a = tl.reshape(a, (BLOCK_N, 2, 4, 2, 2, 2))
        return tl.reshape(tl.permute(a, (0, 5, 4, 1, 2, 3)), (BLOCK_N, 64))
    return tl.reshape(a, (BLOCK_N, 64))  # column 8c + 4s + 2q0 + q1 holds K 32 q1 + 16 q0 + 2c + s


@triton.jit
def _half_order(h, BLOCK_M: tl.constexpr):
    """h [64, BLOCK_M] in K order -> the K order of ``_half_tile`` without NATURAL (row 8c + 4s + 2q0 + q1
    holds K 32 q1 + 16 q0 + 2c + s)."""
    return tl.reshape(tl.permute(tl.reshape(h, (2, 2, 8, 2, BLOCK_M)), (2, 3, 1, 0, 4)), (64, BLOCK_M))


@triton.jit
def _planar_mlp_kernel(
    x_ptr,
    stride_x,
    w1_ptr,
    s1_ptr,
    stride_w1e,
    stride_s1e,
    w2_ptr,
    s2_ptr,
    stride_w2e,
    stride_s2e,
    b1_ptr,
    stride_b1e,
    b2_ptr,
    stride_b2e,
    out_ptr,
    stride_o,
    gamma_ptr,
    sorted_slot_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_start_ptr,
    n_experts,
    hidden,
    inter,
    k1_steps,
    k2_steps,
    alpha,
    limit,
    TOPK: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TWO_MULS1: tl.constexpr,
    TWO_MULS2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K1: tl.constexpr,
    EVEN_N2: tl.constexpr,
    NATURAL_HALF: tl.constexpr = True,
    STAGES2: tl.constexpr = 4,
):
    """Both GEMMs of a work item (m-tile, intermediate tile j) in one program, no grid-wide step:
    h[i, m] = SwiGLU(W1[e, gate/up rows of i, :] . x[tok m, :]) for the BLOCK_I intermediates i of
    tile j (full K = hidden; rounded to bf16 like the two-kernel path's h), then for every n-tile of
    BLOCK_N2 output rows acc[n, m] = W2[e, n, K-slice j] . h[:, m], added times gamma[slot m] (+ the
    bias, by tile 0) into out fp32 [T, hidden] at token slot // TOPK with relaxed atomic adds.

    BLOCK_I 128: the K-slice is step j of W2's planar rows; 64: half j % 2 of step j // 2. STAGES2: the
    pipeline depth of GEMM2's n-loop (GEMM1's loop takes the launch's num_stages). Atomic
    adds: (m-tiles x inter / BLOCK_I) x hidden x BLOCK_M lanes (masked to the tile's real rows)."""
    n_m = tl.load(tile_start_ptr + n_experts)
    n_j = tl.cdiv(inter, BLOCK_I)
    n_n2 = tl.cdiv(hidden, BLOCK_N2)
    c8 = tl.arange(0, 8)
    for tile in tl.range(tl.program_id(0), n_m * n_j, tl.num_programs(0)):
        mt = tile // n_j
        j = tile % n_j
        e = tl.load(tile_expert_ptr + mt)
        rows = tl.load(tile_row_ptr + mt) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(offsets_ptr + e + 1)
        slot = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        tok = (slot // TOPK).to(tl.int64)
        # GEMM1: 2 * BLOCK_I interleaved gate/up rows of tile j, full K
        n1 = j * (2 * BLOCK_I) + tl.arange(0, 2 * BLOCK_I)
        nc = tl.minimum(n1, 2 * inter - 1).to(tl.int64)
        wrow = w1_ptr + e.to(tl.int64) * stride_w1e + (nc // 64) * (k1_steps * 1024) + (nc % 64) * 16
        srow = s1_ptr + e.to(tl.int64) * stride_s1e + (nc // 64) * (k1_steps * 64) + nc % 64
        acc = tl.zeros((2 * BLOCK_I, BLOCK_M), tl.float32)
        for st in range(0, k1_steps):
            w0 = tl.load(wrow[:, None] + (st * 1024 + c8)[None, :])
            if EVEN_K1:
                w1 = tl.load(wrow[:, None] + (st * 1024 + 8 + c8)[None, :])
            else:
                w1 = tl.load(wrow[:, None] + (st * 1024 + 8 + c8)[None, :], mask=st * 128 + 64 < hidden, other=0)
            s4 = tl.load(srow + st * 64)
            kk = st * 128 + tl.arange(0, 128)
            xb = x_ptr + tok[:, None] * stride_x + kk[None, :]
            if EVEN_K1:
                xs = tl.load(xb, mask=row_ok[:, None], other=0.0)
            else:
                xs = tl.load(xb, mask=row_ok[:, None] & (kk < hidden)[None, :], other=0.0)
            if DOT_F32:
                xs = xs.to(tl.float32)
            acc = tl.dot(_tile(w0, w1, s4, TWO_MULS1, DOT_F32, 2 * BLOCK_I), tl.trans(xs), acc)
        if HAS_BIAS:
            bv = tl.load(b1_ptr + e.to(tl.int64) * stride_b1e + n1, mask=n1 < 2 * inter, other=0.0).to(tl.float32)
            acc += bv[:, None]
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_I, 2, BLOCK_M)), (0, 2, 1)))
        i_ok = j * BLOCK_I + tl.arange(0, BLOCK_I) < inter
        h = to_bf16(tl.where(i_ok[:, None], _swiglu(gate, up, alpha, limit, ACTIVATION), 0.0))  # [BLOCK_I, BLOCK_M]
        if DOT_F32:
            h = h.to(tl.float32)
        gam = tl.load(gamma_ptr + slot, mask=row_ok, other=0.0)
        # GEMM2: every n-tile of W2's rows on K-slice j, added into the token sums. Row r of an n-tile
        # sits at block r // 64, row r % 64 of the tiled layout: a fixed offset, the tile adds a scalar
        r2 = tl.arange(0, BLOCK_N2)
        if BLOCK_I == 128:
            kofs = j * 1024
        else:
            kofs = (j // 2) * 1024 + (j % 2) * 8
            if not NATURAL_HALF:
                h = _half_order(h, BLOCK_M)
        wofs = (r2 // 64) * (k2_steps * 1024) + (r2 % 64) * 16 + kofs
        sofs = (r2 // 64) * (k2_steps * 64) + r2 % 64 + (kofs // 1024) * 64
        w2e = w2_ptr + e.to(tl.int64) * stride_w2e
        s2e = s2_ptr + e.to(tl.int64) * stride_s2e
        orow = out_ptr + tok[None, :] * stride_o
        for nt in tl.range(0, n_n2, num_stages=STAGES2):
            n2 = nt * BLOCK_N2 + r2
            wb = w2e + nt * ((BLOCK_N2 // 64) * k2_steps * 1024)
            sb = s2e + nt * ((BLOCK_N2 // 64) * k2_steps * 64)
            if EVEN_N2:
                s4 = tl.load(sb + sofs)
                v0 = tl.load(wb + wofs[:, None] + c8[None, :])
                if BLOCK_I == 128:
                    v1 = tl.load(wb + wofs[:, None] + (8 + c8)[None, :])
            else:  # rows past hidden (a last, part-filled n-tile) are not read
                s4 = tl.load(sb + sofs, mask=n2 < hidden, other=0)
                v0 = tl.load(wb + wofs[:, None] + c8[None, :], mask=(n2 < hidden)[:, None], other=0)
                if BLOCK_I == 128:
                    v1 = tl.load(wb + wofs[:, None] + (8 + c8)[None, :], mask=(n2 < hidden)[:, None], other=0)
            if BLOCK_I == 128:
                v = _tile(v0, v1, s4, TWO_MULS2, DOT_F32, BLOCK_N2)
            else:
                v = _half_tile(v0, s4, j % 2, TWO_MULS2, DOT_F32, BLOCK_N2, NATURAL_HALF)
            acc2 = tl.dot(v, h)
            if HAS_BIAS:
                b2 = tl.load(b2_ptr + e.to(tl.int64) * stride_b2e + n2, mask=n2 < hidden, other=0.0).to(tl.float32)
                acc2 += tl.where(j == 0, b2, 0.0)[:, None]
            if EVEN_N2:
                tl.atomic_add(orow + n2[:, None], acc2 * gam[None, :], mask=row_ok[None, :], sem="relaxed")
            else:
                tl.atomic_add(orow + n2[:, None], acc2 * gam[None, :], mask=(n2 < hidden)[:, None] & row_ok[None, :],
                              sem="relaxed")

def planar_gemm(
    x: torch.Tensor,
    w: PlanarMXFP4,
    bias: torch.Tensor | None,
    perm,
    tiles,
    out: torch.Tensor,
    *,
    top_k: int,
    gather: bool,
    activation: int,
    alpha: float,
    limit: float,
    cfg: PlanarConfig,
    gamma: torch.Tensor | None = None,
    next_w: PlanarMXFP4 | None = None,
) -> torch.Tensor:
    """One grouped GEMM on planar weights: x bf16 [T, K] (gather) or [S, K] (sorted) -> out bf16
    [S, n_out] in sorted order (see ``_planar_gemm_kernel``). bias: float [E, N] in the planar row
    order (GEMM1: interleaved gate/up) or None. tiles: ``moe_tiles.TileMap`` with block_m = cfg.block_m.
    gamma: fp32 [T * top_k] routing weights by slot: the weighted combine in the epilogue (activation
    0, sorted x), out then fp32 [T, N] zeroed, the sums added into it. next_w: the next GEMM's weights, whose
    words ``cfg.l2_next`` of each active expert are prefetched into L2 (compiled only, never the interpreter).
    """
    combine = gamma is not None
    if combine and (activation != 0 or gather or out.dtype != torch.float32):
        raise InputError("the fused combine takes GEMM2 (sorted x, no activation) into an fp32 output", field="gamma")
    e, n_rows, k_words = w.words.shape[0], w.n, w.k_padded // 8
    s = perm.sorted_slot.numel() if combine else out.shape[0]
    n_n = triton.cdiv(n_rows, cfg.block_n)
    n_work = tiles.max_tiles * n_n
    if cfg.programs_per_sm > 0:
        n_work = min(n_work, num_sms(x.device) * cfg.programs_per_sm)
    split = max(1, min(cfg.split_k, k_words // 16))
    stream = cfg.stream_k
    if stream:  # one equal run of tiles x K steps a persistent program
        n_work, split = num_sms(x.device) * max(1, cfg.programs_per_sm), 1
    part = out
    if split > 1 and not combine:
        part = torch.empty(split, s, n_rows, dtype=torch.float32, device=x.device)
    elif stream and not combine:
        part = torch.zeros(s, n_rows, dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else out
    interp_f32 = INTERPRET
    prefetch = {}
    if next_w is not None and cfg.l2_next > 0 and not INTERPRET and x.device.type == "cuda":
        per_e = next_w.words.stride(0)
        prefetch = dict(pf_ptr=next_w.words, pf_words=max(32, int(per_e * min(1.0, cfg.l2_next))), pf_stride_e=per_e,
                        L2_NEXT=True)
    _planar_gemm_kernel[(max(1, n_work), split)](
        x,
        x.stride(0),
        w.words,
        w.scales.view(torch.int32),
        w.words.stride(0),
        w.scales.stride(0) // 4,
        b,
        b.stride(0) if has_bias else 0,
        out,
        out.stride(0),
        part,
        gamma if combine else part,
        perm.sorted_slot,
        perm.expert_offsets,
        tiles.tile_expert,
        tiles.tile_row,
        tiles.tile_start,
        e,
        n_rows,
        w.k,
        k_words,
        k_words // 16,
        s,
        float(alpha),
        float(limit),
        TOPK=top_k,
        GATHER=gather,
        ACTIVATION=activation,
        HAS_BIAS=has_bias,
        SPLIT_K=split,
        TWO_MULS=w.two_muls,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m,
        DOT_F32=interp_f32,
        ONE_DOT=cfg.one_dot,
        EVEN_K=w.k % PLANAR_STEP == 0,
        FLATTEN=cfg.flatten and cfg.programs_per_sm > 0 and not stream,
        COMBINE=combine,
        STREAM_K=stream,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg or None,
        **pdl.launch_options(x.device),
        **prefetch,
    )
    if (split > 1 or stream) and s and not combine:
        n_out = n_rows if activation == 0 else n_rows // 2
        block_r = min(1024, triton.next_power_of_2(n_out))
        _split_k_epilogue_kernel[(s, triton.cdiv(n_out, block_r))](
            part,
            b,
            b.stride(0) if has_bias else 0,
            out,
            out.stride(0),
            perm.sorted_slot,
            perm.expert_offsets,
            e,
            s,
            n_rows,
            float(alpha),
            float(limit),
            ACTIVATION=activation,
            HAS_BIAS=has_bias,
            SPLIT_K=split,
            E_PAD=triton.next_power_of_2(e),
            BLOCK_R=block_r,
            **pdl.launch_options(x.device),
        )
    return out


def planar_gemm_torch(
    x: torch.Tensor,
    w: PlanarMXFP4,
    bias: torch.Tensor | None,
    perm,
    tiles,
    out: torch.Tensor,
    *,
    top_k: int,
    gather: bool,
    activation: int,
    alpha: float,
    limit: float,
    cfg: PlanarConfig | None = None,
    gamma: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of ``planar_gemm``: per-expert fp32 matmuls on the decoded weights (tiles, cfg unused);
    with gamma (the fused combine) each expert's fp32 rows, times their slots' weights, added into
    out fp32 [T, N] at their tokens, expert by expert."""
    packed, scales = planar_to_mxfp4_torch(w, interleaved=True)
    wf = dequantize_mxfp4_torch(packed, scales, validate=False)  # [E, N, K], planar row order
    offs = perm.expert_offsets.tolist()
    rows = perm.sorted_slot.long() // top_k if gather else torch.arange(perm.sorted_slot.numel(), device=x.device)
    xf = x.float()[rows]
    for e in range(len(offs) - 1):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        acc = xf[a:b] @ wf[e].t()
        if bias is not None:
            acc = acc + bias[e].float()
        if gamma is not None:
            slot = perm.sorted_slot[a:b].long()
            out.index_add_(0, slot // top_k, acc * gamma[slot, None])
        elif activation == 0:
            out[a:b] = acc.to(out.dtype)
        else:
            g, u = acc[:, 0::2], acc[:, 1::2]
            if activation == 1:
                res = torch.nn.functional.silu(g) * u
            else:
                gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
                res = gc * torch.sigmoid(alpha * gc) * (uc + 1.0)
            out[a:b] = res.to(out.dtype)
    return out


@dataclass
class PlanarExperts:
    """One MoE layer's experts in the planar layout: w1 (gate/up rows interleaved) and w2 (down),
    biases in the same row order (w1_bias [E, 2I] interleaved, w2_bias [E, H]) or None."""

    w1: PlanarMXFP4
    w2: PlanarMXFP4
    w1_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None

    @classmethod
    def from_weights(cls, weights) -> PlanarExperts:
        """From ``MoEWeights`` (gpt-oss tensor layout), once at load time."""
        il = weights.gate_up_interleaved
        w1 = planar_from_mxfp4(weights.w1_packed, weights.w1_scales, gate_up=True, interleaved=il)
        w2 = planar_from_mxfp4(weights.w2_packed, weights.w2_scales)
        b1 = weights.w1_bias
        if b1 is not None:
            b1 = _interleave_gate_up(b1.float(), il).contiguous()
        b2 = weights.w2_bias.float().contiguous() if weights.w2_bias is not None else None
        return cls(w1, w2, b1, b2)

    def nbytes(self) -> int:
        """Bytes held: planar codes and scales (the MXFP4 bytes, K padded to 128) and biases."""
        bias = sum(b.numel() * b.element_size() for b in (self.w1_bias, self.w2_bias) if b is not None)
        return self.w1.nbytes() + self.w2.nbytes() + bias

    # the shape attributes of ``MoEWeights``, so the FP8 workspace can take a planar layer as its source
    @property
    def n_experts(self) -> int:
        return self.w1.words.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.n

    @property
    def intermediate(self) -> int:
        return self.w2.k

    gate_up_interleaved = True
    """GEMM1's rows alternate gate and up whatever the checkpoint's order (``planar_from_mxfp4``)."""

    def expert_mxfp4(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert ``e`` back in the MXFP4 tensor layout, gate/up rows interleaved: (w1 packed uint8 [2I, H/2],
        w1 scales [2I, H/32], w2 packed [H, I/2], w2 scales [H, I/32]) (torch; for the reference path)."""
        out = []
        for p in (self.w1, self.w2):
            one = PlanarMXFP4(p.words[e : e + 1], p.scales[e : e + 1], p.n, p.k, False, p.two_muls)
            packed, scales = planar_to_mxfp4_torch(one)
            out += [packed[0], scales[0]]
        return tuple(out)


@triton.jit
def _plane_e4m3_pairs(w, f, P: tl.constexpr):
    """Plane P of words w int32 [BLOCK_N, C] as e4m3(code * f) (f fp32 [BLOCK_N], a power of two): uint32 [BLOCK_N, C],
    bytes 0 and 1 of word c the plane's elements 2c and 2c + 1 of the word."""
    pair = _plane_bits(w, P)
    # each half: the code value times 2**-126 as the high bits of an fp32 (``_plane``), then times 2**126 * f
    lo = (pair << 16).to(tl.float32, bitcast=True) * 8.507059173023462e37 * f[:, None]
    hi = (pair & 0xFFFF0000).to(tl.float32, bitcast=True) * 8.507059173023462e37 * f[:, None]
    b_lo = to_e4m3(lo).to(tl.uint8, bitcast=True).to(tl.uint32)
    return b_lo | (to_e4m3(hi).to(tl.uint8, bitcast=True).to(tl.uint32) << 8)


_BIASED_ONE = tl.constexpr(127 + SCALE_BIAS)
"""The stored byte of a one-multiply layer's scale 2**0."""


@triton.jit
def _planar_to_fp8_kernel(
    words_ptr,
    scales_ptr,
    out_ptr,
    exp_ptr,
    offsets_ptr,
    e_lo,
    slot_base,
    n_rows,
    k,
    steps,
    stride_we,
    stride_se,
    TWO_MULS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Program (i, rb): expert e_lo + i, rows rb * BLOCK_R.. of a planar GEMM operand -> slot slot_base + i of
    the FP8 workspace (skipped when the expert has no tokens), UNROLL steps of 128 K an iteration.

    words int32 [E, Np/64, steps, 64, 16], scales int32 [E, Np/64, steps, 64] (a step's four bytes) -> out e4m3
    [slots, n_rows, k] (as int32 words: K is a multiple of 32) and exp int32 [slots, n_rows]: the row exponent
    g = max block exponent - 6 and each element e4m3(code * 2**(block exponent - g)), the fold of
    ``mxfp4.mxfp4_to_fp8(group_k=None)``. The code values come from the planar bits as fp32 (as ``_plane``), times
    2**d exactly, and round once to e4m3 (exact for d >= -5; below, the same nearest-even rounding as the fold's),
    packed four to a 32-bit word for the store."""
    i = tl.program_id(0)
    e = e_lo + i
    if tl.load(offsets_ptr + e + 1) > tl.load(offsets_ptr + e):
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < n_rows
        rb = (r // 64).to(tl.int64)
        ri = r % 64
        wrow = words_ptr + e.to(tl.int64) * stride_we + rb * (steps * 1024) + ri * 16
        srow = scales_ptr + e.to(tl.int64) * stride_se + rb * (steps * 64) + ri
        if TWO_MULS:
            bias = 127  # E8M0 bytes
        else:
            bias = _BIASED_ONE  # bytes stored as s + SCALE_BIAS
        n_blocks = k // 32
        gmax = tl.full((BLOCK_R,), -127, tl.int32)
        for st in range(0, steps):
            s4 = tl.load(srow + st * 64)
            for b in tl.static_range(4):
                sb = (s4 >> (8 * b)) & 0xFF
                gmax = tl.where(st * 4 + b < n_blocks, tl.maximum(gmax, sb - bias), gmax)
        g = gmax - 6
        dst = (slot_base + i).to(tl.int64) * n_rows + r
        tl.store(exp_ptr + dst, g, mask=rm)
        orow = out_ptr + dst * (k // 4)  # the e4m3 rows as 32-bit words
        q4 = tl.arange(0, 4)
        for st0 in range(0, steps, UNROLL):
            for u in tl.static_range(UNROLL):
                st = st0 + u
                sok = st < steps
                # the even and the odd words of each half apart: word q of plane j is pairs 2q (even) and 2q + 1
                # (odd), so every output word is made in the thread that loaded both
                we = wrow[:, None] + (st * 1024 + 2 * q4)[None, :]
                w0e = tl.load(we, mask=sok, other=0)
                w0o = tl.load(we + 1, mask=sok, other=0)
                w1e = tl.load(we + 8, mask=sok, other=0)
                w1o = tl.load(we + 9, mask=sok, other=0)
                s4 = tl.load(srow + st * 64, mask=sok, other=0)
                f0 = pow2_f32((s4 & 0xFF) - bias - g)
                f1 = pow2_f32(((s4 >> 8) & 0xFF) - bias - g)
                f2 = pow2_f32(((s4 >> 16) & 0xFF) - bias - g)
                f3 = pow2_f32(((s4 >> 24) & 0xFF) - bias - g)
                # plane j = 4h + p is the step's words 4j..4j + 3; each stored apart (no data moves between threads)
                for j in tl.static_range(8):
                    if j < 2:
                        words = _plane_e4m3_pairs(w0e, f0, j) | (_plane_e4m3_pairs(w0o, f0, j) << 16)
                    elif j < 4:
                        words = _plane_e4m3_pairs(w0e, f1, j) | (_plane_e4m3_pairs(w0o, f1, j) << 16)
                    elif j < 6:
                        words = _plane_e4m3_pairs(w1e, f2, j - 4) | (_plane_e4m3_pairs(w1o, f2, j - 4) << 16)
                    else:
                        words = _plane_e4m3_pairs(w1e, f3, j - 4) | (_plane_e4m3_pairs(w1o, f3, j - 4) << 16)
                    kw = st * 32 + j * 4 + q4
                    tl.store(orow[:, None] + kw[None, :], words.to(tl.int32, bitcast=True),
                             mask=rm[:, None] & (kw * 4 < k)[None, :])


PLANAR_CONVERT_CONFIG = (8, 2, 2)
"""The planar -> e4m3 conversion's program: (rows, steps an iteration, warps). H200, every expert of a layer at
T = 16384 (benchmarks/moe/2026-12-02-s11, call 2, commit 422ab57): DeepSeek-V3 8,667 us against 9,381 for
(16, 1, 4) and 15,577-17,215 for 32 or 64 rows; gpt-oss-120b 2,647 against 2,724. The word conversion from the
MXFP4 tensors takes 5,013 / 1,566 us in the same call, so the runtime does not convert from this layout."""


def planar_to_fp8(
    p: PlanarMXFP4,
    out: torch.Tensor,
    exps: torch.Tensor,
    expert_offsets: torch.Tensor,
    experts: tuple[int, int],
    slot_base: int,
    config: tuple[int, int, int] | None = None,
) -> None:
    """Convert experts [lo, hi) of planar operand ``p`` that own tokens (``expert_offsets`` int32 [E + 1]) into
    slots slot_base + (e - lo) of ``out`` (e4m3 [slots, p.n, p.k]) and ``exps`` (int32 [slots, p.n]): the same
    bytes and row exponents as ``workspace.convert_experts`` on the MXFP4 tensors ``p`` was made from (rows in
    the planar order: gate/up interleaved for GEMM1). config: (rows, steps an iteration, warps)."""
    lo, hi = experts
    if hi <= lo:
        return
    br, unroll, warps = config or PLANAR_CONVERT_CONFIG
    if ROW_BLOCK % br:
        raise InputError(f"conversion rows {br} must divide {ROW_BLOCK}", field="config")
    if out.shape[1:] != (p.n, p.k) or exps.shape[1:] != (p.n,):
        raise InputError(f"workspace slots {tuple(out.shape)} do not hold rows of {p.n} x {p.k}", field="out")
    steps = p.words.shape[2]
    _planar_to_fp8_kernel[(hi - lo, triton.cdiv(p.n, br))](
        p.words,
        p.scales.view(torch.int32),
        out.view(torch.int32),
        exps,
        expert_offsets,
        lo,
        slot_base,
        p.n,
        p.k,
        steps,
        p.words.stride(0),
        p.scales.stride(0) // 4,
        TWO_MULS=p.two_muls,
        BLOCK_R=br,
        UNROLL=unroll,
        num_warps=warps,
    )



def planar_experts_run(
    hidden: torch.Tensor,
    perm,
    planar: PlanarExperts,
    *,
    top_k: int,
    activation: int,
    alpha: float = 1.702,
    limit: float = 7.0,
    config: tuple[PlanarConfig, PlanarConfig] | None = None,
    topw: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    twin: bool = False,
) -> torch.Tensor:
    """GEMM1 (gather + SwiGLU) then GEMM2 on planar weights, the configs from ``pick_planar_configs``
    unless given: hidden bf16 [T, H] -> y bf16 [T * top_k, H] in sorted order, or with topw (float
    [T, top_k] routing weights) the weighted combine in GEMM2's epilogue -> bf16 [T, H] in token
    order: the gamma-weighted fp32 rows added into an fp32 [T, H] sum that starts from shared (bf16
    [T, H]) or zero, rounded to bf16 once. activation: ``moe_gemm.ACTIVATIONS`` code (1 SwiGLU, 2
    gpt-oss clamped). twin: the torch twin (``planar_gemm_torch``) on the same operands."""
    from adapt.kernels.moe_configs import pick_planar_configs
    from adapt.kernels.moe_tiles import max_m_tiles, tile_map, tile_map_torch

    t, h = hidden.shape
    e, inter = planar.w1.words.shape[0], planar.w2.k
    s = t * top_k
    dev = hidden.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
    c1, c2 = config if config is not None else pick_planar_configs(s, e, name, h, inter)
    if c1.block_m != c2.block_m:
        raise InputError("GEMM1 and GEMM2 configs must share block_m", field="config")
    acc = None
    if topw is not None and ZERO_FIRST:  # the fused combine's fp32 sum, set before the tile map so that no torch
        # kernel sits between GEMM1 and GEMM2 (with PDL, GEMM2 then launches while GEMM1 finishes)
        acc = shared.float() if shared is not None else torch.zeros(t, h, dtype=torch.float32, device=dev)
    tiles = (tile_map_torch if twin else tile_map)(perm.expert_offsets, c1.block_m, max_m_tiles(s, e, c1.block_m))
    hbuf = torch.empty(s, inter, dtype=torch.bfloat16, device=dev)
    gemm = planar_gemm_torch if twin else planar_gemm
    common = dict(top_k=top_k, alpha=alpha, limit=limit)
    nxt = {} if twin else {"next_w": planar.w2}
    gemm(hidden, planar.w1, planar.w1_bias, perm, tiles, hbuf, gather=True, activation=activation, cfg=c1, **common,
         **nxt)
    if topw is None:
        y = torch.empty(s, h, dtype=torch.bfloat16, device=dev)
        return gemm(hbuf, planar.w2, planar.w2_bias, perm, tiles, y, gather=False, activation=0, cfg=c2, **common)
    if acc is None:
        acc = shared.float() if shared is not None else torch.zeros(t, h, dtype=torch.float32, device=dev)
    gamma = topw.reshape(-1).float().contiguous()
    gemm(hbuf, planar.w2, planar.w2_bias, perm, tiles, acc, gather=False, activation=0, cfg=c2, gamma=gamma,
         **common)
    return acc.to(torch.bfloat16)


def planar_moe(
    hidden: torch.Tensor,
    perm,
    planar: PlanarExperts,
    topw: torch.Tensor,
    *,
    top_k: int,
    activation: int,
    alpha: float = 1.702,
    limit: float = 7.0,
    shared: torch.Tensor | None = None,
    fused: bool | None = None,
    config: tuple[PlanarConfig, PlanarConfig] | None = None,
    twin: bool = False,
    one_kernel: bool | PlanarMLPConfig = False,
) -> torch.Tensor:
    """Routed experts + weighted combine on planar weights, the faster measured way: hidden bf16 [T, H],
    topw float [T, top_k] -> bf16 [T, H] in token order (what ``moe_gemm.expert_mlp(..., planar=...)``
    then ``routing.combine(y, topw, perm.slot_pos, shared)`` compute). fused None: the combine runs in
    GEMM2's epilogue where ``moe_configs.pick_planar_fused_combine`` says it was measured faster, else
    GEMM2 writes the [T * k, H] expert outputs and ``routing.combine`` reduces them; True / False force
    one way. Fused, the extra bytes over the expert GEMMs are the fp32 sum, set, added into and read
    once (12 * T * H) instead of the [T * k, H] bf16 outputs written and read. config, twin: as
    ``planar_experts_run``. one_kernel (True: ``pick_planar_mlp_config``'s tile, or a ``PlanarMLPConfig``):
    both GEMMs and the combine in one kernel (``_planar_mlp_one_kernel``; measured slower than the two
    kernels at DeepSeek-V3 T = 1 and 16, so never picked; its twin is the fused combine's)."""
    from adapt.kernels.moe_configs import pick_planar_fused_combine, pick_planar_mlp_config
    from adapt.kernels.routing import combine

    t, h = hidden.shape
    dev = hidden.device
    if one_kernel is not False and not twin:
        cfg = pick_planar_mlp_config() if one_kernel is True else one_kernel
        return _planar_mlp_one_kernel(hidden, perm, planar, topw, shared, top_k, activation, alpha, limit, cfg)
    fused = True if one_kernel is not False else fused
    if fused is None:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
        fused = pick_planar_fused_combine(t * top_k, planar.w1.words.shape[0], name, h, planar.w2.k)
    kw = dict(top_k=top_k, activation=activation, alpha=alpha, limit=limit, config=config, twin=twin)
    if fused:
        return planar_experts_run(hidden, perm, planar, topw=topw, shared=shared, **kw)
    return combine(planar_experts_run(hidden, perm, planar, **kw), topw, perm.slot_pos, shared)


def _planar_mlp_one_kernel(hidden, perm, planar: PlanarExperts, topw, shared, top_k: int, activation: int,
                           alpha: float, limit: float, cfg: PlanarMLPConfig) -> torch.Tensor:
    """``planar_moe(one_kernel=...)``: routed experts + weighted combine in ONE kernel
    (``_planar_mlp_kernel``): a program owns an intermediate tile of one expert's m-tile, runs GEMM1 +
    SwiGLU for it over the full hidden K, then its K-slice of GEMM2 for every output row, the
    gamma-weighted fp32 partials added atomically into the [T, H] sum (from shared or zero) -> bf16
    [T, H]; the same arithmetic as ``planar_experts_run(..., topw=...)`` but for the order of the fp32
    sums. Bytes: the active experts' MXFP4 once, x once per intermediate tile (from L2), the fp32 sum
    set, added into and read; atomics: m-tiles x ceil(I / block_i) x H x (real rows)."""
    from adapt.kernels.moe_tiles import max_m_tiles, tile_map

    t, h = hidden.shape
    w1, w2 = planar.w1, planar.w2
    e, inter = w1.words.shape[0], w2.k
    s = t * top_k
    if cfg.block_i not in (64, 128) or cfg.block_n2 % 64:
        raise InputError(f"block_i {cfg.block_i} / block_n2 {cfg.block_n2}: block_i is 64 or 128 (a half or a "
                         "whole planar step), block_n2 a multiple of 64 (whole row blocks)", field="config")
    dev = hidden.device
    tiles = tile_map(perm.expert_offsets, cfg.block_m, max_m_tiles(s, e, cfg.block_m))
    acc = shared.float() if shared is not None else torch.zeros(t, h, dtype=torch.float32, device=dev)
    gamma = topw.reshape(-1).float().contiguous()
    has_bias = planar.w1_bias is not None
    b1 = planar.w1_bias if has_bias else acc
    b2 = planar.w2_bias if planar.w2_bias is not None else acc
    n_work = tiles.max_tiles * triton.cdiv(inter, cfg.block_i)
    _planar_mlp_kernel[(max(1, n_work),)](
        hidden,
        hidden.stride(0),
        w1.words,
        w1.scales.view(torch.int32),
        w1.words.stride(0),
        w1.scales.stride(0) // 4,
        w2.words,
        w2.scales.view(torch.int32),
        w2.words.stride(0),
        w2.scales.stride(0) // 4,
        b1,
        b1.stride(0) if has_bias else 0,
        b2,
        b2.stride(0) if has_bias else 0,
        acc,
        acc.stride(0),
        gamma,
        perm.sorted_slot,
        perm.expert_offsets,
        tiles.tile_expert,
        tiles.tile_row,
        tiles.tile_start,
        e,
        h,
        inter,
        w1.k_padded // PLANAR_STEP,
        w2.k_padded // PLANAR_STEP,
        float(alpha),
        float(limit),
        TOPK=top_k,
        ACTIVATION=activation,
        HAS_BIAS=has_bias,
        TWO_MULS1=w1.two_muls,
        TWO_MULS2=w2.two_muls,
        BLOCK_M=cfg.block_m,
        BLOCK_I=cfg.block_i,
        BLOCK_N2=cfg.block_n2,
        DOT_F32=INTERPRET,
        EVEN_K1=h % PLANAR_STEP == 0,
        EVEN_N2=h % cfg.block_n2 == 0,
        NATURAL_HALF=cfg.natural_half,
        STAGES2=cfg.stages2 or cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg or None,
    )
    return acc.to(torch.bfloat16)
