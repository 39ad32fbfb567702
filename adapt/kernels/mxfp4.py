"""MXFP4 codec (OCP MX v1.0) and MXFP4 -> FP8 e4m3 conversion, as Triton kernels with torch twins.

Format. An MXFP4 tensor of logical shape ``[..., K]`` (K a multiple of 32) is stored as

- ``packed`` uint8 ``[..., K/2]``: two E2M1 codes per byte, the even element in the low nibble.
  E2M1 code bits ``s e1 e0 m``: magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, bit 3 is the sign.
- ``scales`` uint8 ``[..., K/32]``: one E8M0 scale per 32 consecutive elements along K,
  ``2 ** (byte - 127)``; ``0xFF`` is NaN and is rejected with ``InputError``.

gpt-oss checkpoints hold the same bytes as ``*_blocks`` uint8 ``[E, N, K/32, 16]`` and
``*_scales`` uint8 ``[E, N, K/32]``; ``from_gpt_oss_blocks`` / ``to_gpt_oss_blocks`` are views.

Quantisation rule: per 32-block, shared exponent ``floor(log2(amax)) - 2`` (clamped to the E8M0
range), elements ``x / 2**e`` rounded to nearest even on the E2M1 grid, saturated at +-6.

MXFP4 -> FP8. Within a group of ``group_k`` elements of one row (128 by default, or the whole
row), the group exponent is ``g = max(block exponents) - 6`` and each element becomes
``e4m3(code * 2**(e_block - g))`` (round to nearest even), so the value is ``fp8 * 2**g``.
The largest block lands at most at ``6 * 2**6 = 384 <= 448`` (no saturation); an element is
exact while ``e_block >= g - 8``, i.e. while the group's exponent spread is at most 14.
Elements that lose bits are counted (``lost``), never hidden.

Public functions (``*_torch`` are the twins with the same signature and results):

- ``quantize_mxfp4(x) -> (packed, scales)``            x: float ``[..., K]``
- ``dequantize_mxfp4(packed, scales, dtype) -> [..., K]``
- ``mxfp4_to_fp8(packed, scales, group_k) -> Fp8Groups``  (values e4m3 ``[..., K]``,
  exponents int32 ``[..., K/group_k]``, lost int64 ``[1]`` on the device)
- ``check_scales(scales, name)``: raises ``InputError`` on an E8M0 NaN scale.

Word decodes (Triton building blocks for the memory-bound paths): ``e2m1_words_to_e4m3`` turns
one uint32 of 8 codes into 8 e4m3 bytes with integer ops (the workspace conversion),
``fold_words_fp8`` does the same fold inside the GEMM by byte-permute look-up in an 8-byte table per
32-block (``fold_tables``; inline PTX, bit-equal to the offline fold at every shift), and
``decode_mxfp4_words`` turns words into bf16 pairs by bit placement, in ``word_k_order`` (the
small-T fused GEMM; the other operand is loaded in the same K order).

Bytes and FLOPs: every kernel here is a streaming pass. ``quantize_mxfp4`` reads ``4*K`` bytes per
fp32 row (2*K for bf16) and writes ``K/2 + K/32``; ``dequantize_mxfp4`` reads ``K/2 + K/32`` and
writes ``K * itemsize``; ``mxfp4_to_fp8`` reads ``K/2 + K/32`` (the scales twice) and writes
``K + 4*K/group_k`` bytes per row. No FLOPs worth counting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels.formats import FP8_E4M3_MAX, interpreting

MX_BLOCK = 32
"""Elements per E8M0 scale (OCP MX v1.0)."""
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_MAX = 6.0
FP8_FOLD_HEADROOM = 6
"""Exponent headroom of the MXFP4 -> e4m3 fold: the largest block maps to at most 6 * 2**6 = 384."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit E2M1 code, indexed by the code."""

INTERPRET = interpreting()
"""True when Triton kernels run under the CPU interpreter (no bf16 arithmetic there)."""
SOFT_E4M3_ROUNDING = tl.constexpr(INTERPRET)
_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
"""The interpreter's fp32 -> e4m3 / bf16 casts mis-round; round in fp32 first there."""


@dataclass
class Fp8Groups:
    """MXFP4 converted to e4m3 with power-of-two scales.

    values:    float8_e4m3fn ``[..., K]``
    exponents: int32 ``[..., K/group_k]``; element value = ``values * 2**exponents``
    lost:      int64 ``[1]`` (device): nonzero MXFP4 elements whose e4m3 image is not exact
    """

    values: torch.Tensor
    exponents: torch.Tensor
    lost: torch.Tensor


def check_scales(scales: torch.Tensor, name: str = "scales") -> None:
    """Raise ``InputError`` if any E8M0 scale byte is 0xFF (NaN). Synchronises with the device."""
    if scales.dtype != torch.uint8:
        raise InputError(f"expected uint8 E8M0 scales, got {scales.dtype}", field=name)
    bad = int((scales == E8M0_NAN).sum().item())
    if bad:
        raise InputError(
            f"{bad} E8M0 scale byte(s) are 0xFF, which OCP MX v1.0 defines as NaN",
            field=name,
            hint="the checkpoint's MXFP4 scales are corrupt or not E8M0; re-export the weights",
        )


def _check_mx_shapes(packed: torch.Tensor, scales: torch.Tensor) -> int:
    """Validate packed/scales shapes; return K (elements per row)."""
    if packed.dtype != torch.uint8:
        raise InputError(f"expected uint8 packed MXFP4 codes, got {packed.dtype}", field="packed")
    k = packed.shape[-1] * 2
    if k % MX_BLOCK or tuple(scales.shape) != (*packed.shape[:-1], k // MX_BLOCK):
        raise InputError(
            f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not form an MXFP4 tensor",
            field="scales",
            hint="expect packed [..., K/2] and scales [..., K/32] with K a multiple of 32",
        )
    return k


def from_gpt_oss_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss ``*_blocks`` uint8 ``[E, N, K/32, 16]`` -> packed ``[E, N, K/2]`` (a view)."""
    if blocks.dim() < 2 or blocks.shape[-1] != MX_BLOCK // 2:
        raise InputError(
            f"gpt-oss blocks must end in 16 bytes per 32-block, got {tuple(blocks.shape)}", field="blocks"
        )
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])


def to_gpt_oss_blocks(packed: torch.Tensor) -> torch.Tensor:
    """Packed ``[E, N, K/2]`` -> gpt-oss ``*_blocks`` ``[E, N, K/32, 16]`` (a view)."""
    return packed.reshape(*packed.shape[:-1], packed.shape[-1] // (MX_BLOCK // 2), MX_BLOCK // 2)


# ----------------------------------------------------------------------------------------------
# torch twins
# ----------------------------------------------------------------------------------------------


def _floor_log2_bits(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of fp32 ``a`` >= 0 read from its exponent bits (-127 for 0 and denormals)."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """Round |y| to nearest even on the E2M1 grid (saturating at 6) -> 3-bit magnitude code."""
    a = y.abs()
    code = (
        (a > 0.25).int()
        + (a >= 0.75).int()
        + (a > 1.25).int()
        + (a >= 1.75).int()
        + (a > 2.5).int()
        + (a >= 3.5).int()
        + (a > 5.0).int()
    )
    return code | ((y < 0).int() << 3)


def quantize_mxfp4_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[..., K]`` -> (packed uint8 ``[..., K/2]``, scales uint8 ``[..., K/32]``).

    Non-finite blocks get the NaN scale 0xFF.
    """
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise InputError(f"MXFP4 needs the last dimension to be a multiple of 32, got {k}", field="x")
    xb = x.float().reshape(*x.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    amax = xb.abs().amax(dim=-1)
    e = (_floor_log2_bits(amax) - 2).clamp(-127, 127)
    finite = torch.isfinite(amax)
    scale = torch.where(finite, e + E8M0_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)
    y = xb * torch.pow(2.0, -e.float()).unsqueeze(-1)
    code = _e2m1_code(torch.where(torch.isfinite(y), y, torch.zeros_like(y))).reshape(*x.shape[:-1], k)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, scale


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> int64 codes ``[..., K]``."""
    p = packed.long()
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 ``2**(s-127)`` (NaN for 0xFF)."""
    v = torch.pow(2.0, scales.float() - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, torch.full_like(v, float("nan")), v)


def dequantize_mxfp4_torch(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, validate: bool = True
) -> torch.Tensor:
    """packed ``[..., K/2]`` + scales ``[..., K/32]`` -> ``dtype`` ``[..., K]``."""
    k = _check_mx_shapes(packed, scales)
    if validate:
        check_scales(scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    vals = lut[_unpack_codes(packed)].reshape(*packed.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    return (vals * _scale_values(scales).unsqueeze(-1)).reshape(*packed.shape[:-1], k).to(dtype)


def _check_group(k: int, group_k: int | None) -> int:
    g = k if group_k is None else group_k
    if g % MX_BLOCK or k % g:
        raise InputError(f"group_k={group_k} must be a multiple of 32 that divides K={k}", field="group_k")
    return g


def mxfp4_to_fp8_torch(
    packed: torch.Tensor, scales: torch.Tensor, group_k: int | None = 128, validate: bool = True
) -> Fp8Groups:
    """Twin of ``mxfp4_to_fp8``: fold block exponents into e4m3 relative to a group exponent.

    group_k: elements per group along K (a multiple of 32 dividing K), or None for the whole row.
    """
    k = _check_mx_shapes(packed, scales)
    g = _check_group(k, group_k)
    if validate:
        check_scales(scales)
    lead = packed.shape[:-1]
    e_blk = scales.int() - E8M0_BIAS  # [..., K/32]
    e_grp = e_blk.reshape(*lead, k // g, g // MX_BLOCK).amax(dim=-1) - FP8_FOLD_HEADROOM
    d = e_blk - e_grp.repeat_interleave(g // MX_BLOCK, dim=-1)  # [..., K/32], <= 6
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = _unpack_codes(packed)
    c = lut[codes].reshape(*lead, k // MX_BLOCK, MX_BLOCK)
    exact = c * torch.pow(2.0, d.float()).unsqueeze(-1)
    fp8 = exact.to(torch.float8_e4m3fn)
    lost = ((fp8.float() != exact) & (c != 0)).sum().reshape(1)
    return Fp8Groups(fp8.reshape(*lead, k), e_grp.int(), lost)


# ----------------------------------------------------------------------------------------------
# Triton building blocks (used by moe_gemm too)
# ----------------------------------------------------------------------------------------------


@triton.jit
def pow2_f32(e):
    """2**e as fp32 from an int32 exponent, built from its bits (e clamped to [-126, 127])."""
    ec = tl.minimum(tl.maximum(e, -126), 127)
    return ((ec + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(v):
    """Round to e4m3 (nearest even, saturating at +-448). Compiled: the hardware conversion;
    interpreter: round onto the e4m3 grid in fp32 first, so the cast itself is exact."""
    if SOFT_E4M3_ROUNDING:
        f = v.to(tl.float32)
        e = tl.maximum(((f.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        ulp = pow2_f32(e - 3)
        q = ((f / ulp + 12582912.0) - 12582912.0) * ulp
        q = tl.where(q == 0, f * 0.0, q)  # a zero keeps the input's sign, as in hardware
        return tl.minimum(tl.maximum(q, -_E4M3_MAX), _E4M3_MAX).to(tl.float8e4nv)
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def to_bf16(v):
    """fp32 -> bf16, nearest even. The interpreter's cast truncates, so round the bits first there."""
    if SOFT_E4M3_ROUNDING:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return v.to(tl.bfloat16)


@triton.jit
def e2m1_to_f16(code):
    """E2M1 codes (uint8, low 4 bits) -> exact fp16 values (integer ops + one multiply)."""
    c = code.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    # the code's 3 magnitude bits sit at fp16 exponent/mantissa positions of 2**-14 * value
    # (0.5 lands on the fp16 denormal 2**-15), so one multiply by 2**14 gives the value
    two14 = tl.full(bits.shape, 0x7400, tl.uint16).to(tl.float16, bitcast=True)
    return bits.to(tl.float16, bitcast=True) * two14


@triton.jit
def e2m1_to_bf16_scaled(code, scale_bits):
    """E2M1 codes (uint8) times bf16 block scales (given as uint16 bf16 bits, broadcastable) -> bf16.

    bf16 path: code bits at bf16 exponent/mantissa positions of 2**-126 * value (0.5 is a bf16
    denormal), then two bf16 multiplies: by 2**126 and by the block scale.
    """
    c = code.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 6)
    two126 = tl.full(bits.shape, (126 + 127) << 7, tl.uint16).to(tl.bfloat16, bitcast=True)
    return bits.to(tl.bfloat16, bitcast=True) * two126 * scale_bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_to_bf16_bits(s):
    """E8M0 bytes -> bf16 bit patterns of 2**(s-127) (0x0040 denormal for s = 0, NaN for 0xFF)."""
    s16 = s.to(tl.uint16)
    bits = tl.where(s16 == 0, 0x0040, s16 << 7)
    return tl.where(s16 == 255, 0x7FC0, bits).to(tl.uint16)


@triton.jit
def e8m0_to_f32(s):
    """E8M0 bytes -> fp32 2**(s-127) (exact, including 2**-127; NaN for 0xFF)."""
    s32 = s.to(tl.int32)
    v = tl.where(s32 == 0, 0x00400000, s32 << 23).to(tl.float32, bitcast=True)
    return tl.where(s32 == 255, float("nan"), v)


@triton.jit
def decode_mxfp4_tile(packed, scales, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TO_BF16: tl.constexpr):
    """Decode an MXFP4 tile: packed uint8 [BLOCK_R, BLOCK_K/2], scales uint8 [BLOCK_R, BLOCK_K/32].

    Returns [BLOCK_R, BLOCK_K]: bf16 when TO_BF16 (compiled GPU path), else fp32 (interpreter).
    """
    lo = packed & 0xF
    hi = packed >> 4
    if TO_BF16:
        sb = tl.reshape(e8m0_to_bf16_bits(scales), (BLOCK_R, BLOCK_K // 32, 1))
        vlo = e2m1_to_bf16_scaled(tl.reshape(lo, (BLOCK_R, BLOCK_K // 32, 16)), sb)
        vhi = e2m1_to_bf16_scaled(tl.reshape(hi, (BLOCK_R, BLOCK_K // 32, 16)), sb)
    else:
        sf = tl.reshape(e8m0_to_f32(scales), (BLOCK_R, BLOCK_K // 32, 1))
        vlo = e2m1_to_f16(tl.reshape(lo, (BLOCK_R, BLOCK_K // 32, 16))).to(tl.float32) * sf
        vhi = e2m1_to_f16(tl.reshape(hi, (BLOCK_R, BLOCK_K // 32, 16))).to(tl.float32) * sf
    return tl.reshape(tl.join(vlo, vhi), (BLOCK_R, BLOCK_K))


@triton.jit
def word_k_order(BLOCK_K: tl.constexpr):
    """K index (within a BLOCK_K step) of each column of ``decode_mxfp4_words``'s tile: int32 [BLOCK_K].

    Within each 8-element word, column c holds element (c//4)%2 + 2*((c//2)%2) + 4*(c%2); load the
    other GEMM operand through these indices so the dot runs over the same K permutation.
    """
    c = tl.arange(0, BLOCK_K)
    return (c // 8) * 8 + (c // 4) % 2 + 2 * ((c // 2) % 2) + 4 * (c % 2)


@triton.jit
def decode_mxfp4_words(words, scales, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TO_BF16: tl.constexpr):
    """Decode an MXFP4 tile from 32-bit words: words uint32 [BLOCK_R, BLOCK_K/8] (8 codes each,
    element 2j in the low nibble of byte j), scales uint8 [BLOCK_R, BLOCK_K/32].

    Returns [BLOCK_R, BLOCK_K] in ``word_k_order`` (bf16 when TO_BF16, else fp32, exact). Each word
    yields four bf16 pairs with 4-5 integer ops per pair: the code's sign goes to bit 15 and its
    magnitude bits to bits 6..8 of a 16-bit half, which is the bf16 of value * 2**-126 (0.5: a
    denormal); then times 2**126 and the block scale.
    """
    w = words
    sign3 = tl.full(w.shape, 0x80008000, tl.uint32)
    p0 = ((w & 0x00070007) << 6) | ((w & 0x00080008) << 12)  # elements 0 and 4
    p1 = ((w & 0x00700070) << 2) | ((w & 0x00800080) << 8)  # 1 and 5
    p2 = ((w & 0x07000700) >> 2) | ((w & 0x08000800) << 4)  # 2 and 6
    p3 = ((w & 0x70007000) >> 6) | (w & sign3)  # 3 and 7
    q01 = tl.reshape(tl.join(p0, p1), (BLOCK_R, BLOCK_K // 4))
    q23 = tl.reshape(tl.join(p2, p3), (BLOCK_R, BLOCK_K // 4))
    q = tl.reshape(tl.join(q01, q23), (BLOCK_R, BLOCK_K // 2))
    if TO_BF16:
        bits = tl.reshape(tl.join(q & 0xFFFF, q >> 16), (BLOCK_R, BLOCK_K // 32, 32)).to(tl.uint16)
        sb = tl.reshape(e8m0_to_bf16_bits(scales), (BLOCK_R, BLOCK_K // 32, 1)).to(tl.bfloat16, bitcast=True)
        two126 = tl.full(bits.shape, (126 + 127) << 7, tl.uint16).to(tl.bfloat16, bitcast=True)
        v = bits.to(tl.bfloat16, bitcast=True) * two126 * sb
    else:
        mask_hi = tl.full(q.shape, 0xFFFF0000, tl.uint32)
        bits = tl.reshape(tl.join(q << 16, q & mask_hi), (BLOCK_R, BLOCK_K // 32, 32))
        sf = tl.reshape(e8m0_to_f32(scales), (BLOCK_R, BLOCK_K // 32, 1))
        v = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37 * sf  # 2**126
    return tl.reshape(v, (BLOCK_R, BLOCK_K))


@triton.jit
def decode_mxfp4_tile_fp8(packed, scales, g_row, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode an MXFP4 tile to e4m3 relative to per-row exponents ``g_row`` int32 [BLOCK_R].

    Each element becomes e4m3(code * 2**(e_block - g_row)) with round-to-nearest-even, computed
    as an exact fp16 value times two powers of two, then one fp16 -> e4m3 conversion.
    """
    d = scales.to(tl.int32) - 127 - g_row[:, None]  # [R, K/32], <= 6
    step = tl.reshape(pow2_f32(tl.maximum(d, -40)).to(tl.float16), (BLOCK_R, BLOCK_K // 32, 1))
    lo = tl.reshape(packed & 0xF, (BLOCK_R, BLOCK_K // 32, 16))
    hi = tl.reshape(packed >> 4, (BLOCK_R, BLOCK_K // 32, 16))
    vlo = to_e4m3(e2m1_to_f16(lo) * step)
    vhi = to_e4m3(e2m1_to_f16(hi) * step)
    return tl.reshape(tl.join(vlo, vhi), (BLOCK_R, BLOCK_K))


FOLD_WORD_MIN_SHIFT = -5
"""Smallest fold shift ``d = e_block - g`` the word decode handles: below it 0.5 * 2**d is an e4m3
denormal, and tiles holding such blocks take the per-byte decode instead."""


@triton.jit
def _e2m1_bytes_to_e4m3(c, bias8):
    """Four E2M1 codes, one per byte of uint32 ``c`` (low 4 bits), -> four e4m3 bytes of code * 2**d.

    bias8 = ((d + 6) << 3) in every byte (d in [-5, 6]). Magnitude code m = e1e0m0: for m >= 2 the
    e4m3 byte is (m << 2) + ((d + 6) << 3) (exponent field e + d + 6, mantissa bit moved to bit 2);
    m = 1 (0.5) is (d + 6) << 3; m = 0 stays 0. No byte carries into the next (max 0x7C).
    """
    m = c & 0x07070707
    sgn = (c & 0x08080808) << 4
    ge2 = (m + 0x06060606) & 0x08080808  # bit 3 set where m >= 2
    keep = ge2 - (ge2 >> 3)  # 0x07 where m >= 2
    nz = (m + 0x07070707) & 0x08080808  # bit 3 set where m != 0
    return (((m & keep) << 2) + (bias8 & (nz * 0x0F))) | sgn


@triton.jit
def e2m1_words_to_e4m3(w, bias8):
    """Eight E2M1 codes per uint32 word -> their e4m3 bytes as two uint32 words (integer ops only).

    w: uint32, byte j holds element 2j (low nibble) and 2j+1 (high nibble). bias8: uint32,
    ``((d + 6) << 3) * 0x01010101`` for the word's fold shift d in [FOLD_WORD_MIN_SHIFT, 6],
    broadcastable to w. Returns (lo, hi): e4m3(code * 2**d) of elements 0-3 and 4-7, byte i of a
    word holding element i (little-endian), exact (every value is an e4m3 normal or zero).
    """
    ev = _e2m1_bytes_to_e4m3(w & 0x0F0F0F0F, bias8)
    od = _e2m1_bytes_to_e4m3((w >> 4) & 0x0F0F0F0F, bias8)
    a = ev & 0xFFFF
    b = od & 0xFFFF
    lo = ((a | (a << 8)) & 0x00FF00FF) | (((b | (b << 8)) & 0x00FF00FF) << 8)
    a = ev >> 16
    b = od >> 16
    hi = ((a | (a << 8)) & 0x00FF00FF) | (((b | (b << 8)) & 0x00FF00FF) << 8)
    return lo, hi


@triton.jit
def e2m1_code_of(y):
    """fp32 ``y`` (already divided by the block scale) -> 4-bit E2M1 code, RNE, saturating."""
    a = tl.abs(y)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return code | ((y < 0).to(tl.int32) << 3)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _quantize_mxfp4_kernel(
    x_ptr, packed_ptr, scales_ptr, n_rows, n_blocks, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr
):
    """One program: BLOCK_R rows x BLOCK_B 32-blocks. x fp32/bf16 [rows, K] contiguous."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = (r < n_rows)[:, None, None] & (b < n_blocks)[None, :, None]
    j = tl.arange(0, 32)
    k = b[None, :, None] * 32 + j[None, None, :]
    x = tl.load(x_ptr + r[:, None, None].to(tl.int64) * (n_blocks * 32) + k, mask=ok, other=0.0).to(
        tl.float32
    )
    amax = tl.max(tl.abs(x), axis=2)  # [R, B]
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 2
    e = tl.minimum(tl.maximum(e, -127), 127)
    has_nan = tl.max((x != x).to(tl.int32), axis=2)
    finite = (amax < float("inf")) & (has_nan == 0)
    s = tl.where(finite, e + 127, 255)
    y = x * pow2_f32(-e)[:, :, None]
    y = tl.where(finite[:, :, None], y, 0.0)
    code = e2m1_code_of(y)  # [R, B, 32]
    pair = tl.reshape(code, (BLOCK_R, BLOCK_B, 16, 2))
    lo, hi = tl.split(pair)
    byte = (lo | (hi << 4)).to(tl.uint8)
    jb = tl.arange(0, 16)
    tl.store(
        packed_ptr
        + r[:, None, None].to(tl.int64) * (n_blocks * 16)
        + b[None, :, None] * 16
        + jb[None, None, :],
        byte,
        mask=ok,
    )
    tl.store(
        scales_ptr + r[:, None].to(tl.int64) * n_blocks + b[None, :],
        s.to(tl.uint8),
        mask=(r < n_rows)[:, None] & (b < n_blocks)[None, :],
    )


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[..., K]`` -> (packed uint8 ``[..., K/2]``, scales uint8 ``[..., K/32]``). Triton."""
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise InputError(f"MXFP4 needs the last dimension to be a multiple of 32, got {k}", field="x")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    rows, nb = x2.shape[0], k // MX_BLOCK
    packed = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
    br, bb = 16, 8
    _quantize_mxfp4_kernel[(triton.cdiv(rows, br), triton.cdiv(nb, bb))](
        x2, packed, scales, rows, nb, BLOCK_R=br, BLOCK_B=bb
    )
    return packed.reshape(*lead, k // 2), scales.reshape(*lead, nb)


@triton.jit
def _dequantize_mxfp4_kernel(
    packed_ptr,
    scales_ptr,
    out_ptr,
    n_rows,
    k,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TO_BF16: tl.constexpr,
):
    """One program: BLOCK_R rows x BLOCK_K elements; out [rows, K] (bf16 or fp32)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    ks = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    rm = (r < n_rows)[:, None]
    p = tl.load(
        packed_ptr + r[:, None].to(tl.int64) * (k // 2) + kb[None, :],
        mask=rm & (kb < k // 2)[None, :],
        other=0,
    )
    s = tl.load(
        scales_ptr + r[:, None].to(tl.int64) * (k // 32) + ks[None, :],
        mask=rm & (ks < k // 32)[None, :],
        other=127,
    )
    v = decode_mxfp4_tile(p, s, BLOCK_R, BLOCK_K, TO_BF16)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + r[:, None].to(tl.int64) * k + kk[None, :],
        v.to(out_ptr.dtype.element_ty),
        mask=rm & (kk < k)[None, :],
    )


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, validate: bool = True
) -> torch.Tensor:
    """packed ``[..., K/2]`` + scales ``[..., K/32]`` -> ``dtype`` (bf16 or fp32) ``[..., K]``. Triton."""
    k = _check_mx_shapes(packed, scales)
    if validate:
        check_scales(scales)
    if dtype not in (torch.float32, torch.bfloat16):
        raise InputError(f"dequantize_mxfp4 writes float32 or bfloat16, not {dtype}", field="dtype")
    lead = packed.shape[:-1]
    p2 = packed.reshape(-1, k // 2).contiguous()
    s2 = scales.reshape(-1, k // 32).contiguous()
    out = torch.empty(p2.shape[0], k, dtype=dtype, device=packed.device)
    br, bk = 16, 128
    _dequantize_mxfp4_kernel[(triton.cdiv(p2.shape[0], br), triton.cdiv(k, bk))](
        p2, s2, out, p2.shape[0], k, BLOCK_R=br, BLOCK_K=bk, TO_BF16=not INTERPRET
    )
    return out.reshape(*lead, k)


@triton.jit
def group_fold_exponent(
    scales_ptr,
    row_off,
    n_blocks,
    rmask,
    blk0,
    GROUP_BLOCKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Group exponent g = max(e_block) - 6 over GROUP_BLOCKS scales starting at ``blk0``.

    scales_ptr + row_off[:, None] + block: uint8 E8M0; returns int32 [BLOCK_R].
    """
    gmax = tl.full((BLOCK_R,), -127, tl.int32)
    for c0 in range(0, GROUP_BLOCKS, CHUNK):
        cb = blk0 + c0 + tl.arange(0, CHUNK)
        ok = rmask[:, None] & (cb < n_blocks)[None, :] & ((c0 + tl.arange(0, CHUNK)) < GROUP_BLOCKS)[None, :]
        s = tl.load(scales_ptr + row_off[:, None] + cb[None, :], mask=ok, other=0)
        gmax = tl.maximum(gmax, tl.max(s.to(tl.int32), axis=1) - 127)
    return gmax - 6


@triton.jit
def fold_loss(p, s, g, v, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per row of a tile: nonzero MXFP4 elements whose e4m3 image ``v`` differs from the exact value.

    p uint8 [R, K/2], s uint8 [R, K/32], g int32 [R] (group exponent), v e4m3 [R, K] -> int32 [R].
    """
    d = s.to(tl.int32) - 127 - g[:, None]
    step = tl.reshape(pow2_f32(tl.maximum(d, -126)), (BLOCK_R, BLOCK_K // 32, 1))
    lo = tl.reshape(p & 0xF, (BLOCK_R, BLOCK_K // 32, 16))
    hi = tl.reshape(p >> 4, (BLOCK_R, BLOCK_K // 32, 16))
    exact = tl.reshape(
        tl.join(e2m1_to_f16(lo).to(tl.float32) * step, e2m1_to_f16(hi).to(tl.float32) * step),
        (BLOCK_R, BLOCK_K),
    )
    nonzero = tl.reshape(tl.join((lo & 7).to(tl.int32), (hi & 7).to(tl.int32)), (BLOCK_R, BLOCK_K)) != 0
    bad = ((v.to(tl.float32) != exact) | (exact == 0.0)) & nonzero
    return tl.sum(bad.to(tl.int32), axis=1)


@triton.jit
def _mxfp4_to_fp8_kernel(
    packed_ptr,
    scales_ptr,
    out_ptr,
    exp_ptr,
    lost_ptr,
    n_rows,
    k,
    GROUP_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: BLOCK_R rows x one group of GROUP_K elements, in BLOCK_K steps."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    grp = tl.program_id(1)
    rm = r < n_rows
    rr = r.to(tl.int64)
    g = group_fold_exponent(
        scales_ptr, rr * (k // 32), k // 32, rm, grp * (GROUP_K // 32), GROUP_K // 32, BLOCK_R, CHUNK
    )
    tl.store(exp_ptr + rr * (k // GROUP_K) + grp, g, mask=rm)
    lost = tl.zeros((BLOCK_R,), tl.int32)
    for k0 in range(0, GROUP_K, BLOCK_K):
        kb = grp * (GROUP_K // 2) + k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = grp * (GROUP_K // 32) + k0 // 32 + tl.arange(0, BLOCK_K // 32)
        p = tl.load(packed_ptr + rr[:, None] * (k // 2) + kb[None, :], mask=rm[:, None], other=0)
        s = tl.load(scales_ptr + rr[:, None] * (k // 32) + ks[None, :], mask=rm[:, None], other=127)
        v = decode_mxfp4_tile_fp8(p, s, g, BLOCK_R, BLOCK_K)
        kk = grp * GROUP_K + k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rr[:, None] * k + kk[None, :], v, mask=rm[:, None])
        lost += fold_loss(p, s, g, v, BLOCK_R, BLOCK_K)
    tl.atomic_add(lost_ptr, tl.sum(tl.where(rm, lost, 0), axis=0).to(tl.int64))


def mxfp4_to_fp8(
    packed: torch.Tensor, scales: torch.Tensor, group_k: int | None = 128, validate: bool = True
) -> Fp8Groups:
    """MXFP4 ``[..., K]`` -> e4m3 values + power-of-two exponents per (row, group_k). Triton.

    group_k: elements per group along K (multiple of 32 dividing K), None for the whole row.
    """
    k = _check_mx_shapes(packed, scales)
    g = _check_group(k, group_k)
    if validate:
        check_scales(scales)
    lead = packed.shape[:-1]
    p2 = packed.reshape(-1, k // 2).contiguous()
    s2 = scales.reshape(-1, k // 32).contiguous()
    rows = p2.shape[0]
    out = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=packed.device)
    exps = torch.empty(rows, k // g, dtype=torch.int32, device=packed.device)
    lost = torch.zeros(1, dtype=torch.int64, device=packed.device)
    bk = 32 if g % 64 else (64 if g % 128 else 128)
    br = 16
    _mxfp4_to_fp8_kernel[(triton.cdiv(rows, br), k // g)](
        p2, s2, out, exps, lost, rows, k, GROUP_K=g, BLOCK_R=br, BLOCK_K=bk, CHUNK=32
    )
    return Fp8Groups(out.reshape(*lead, k), exps.reshape(*lead, k // g), lost)


# ----------------------------------------------------------------------------------------------
# In-GEMM MXFP4 -> e4m3 fold: an 8-entry byte table per 32-block, looked up with byte permutes
# ----------------------------------------------------------------------------------------------

_FOLD_PAIRS = (0x38000000, 0x3E003C00, 0x42004000, 0x46004400)
"""fp16 pairs (low half, high half) of the E2M1 magnitudes (0, 0.5), (1, 1.5), (2, 3), (4, 6)."""


def _fold_table_ptx() -> str:
    """PTX: fp32 2**d ($1) -> $0: the e4m3 bytes of E2M1 magnitudes 0..7 times 2**d (byte j), computed
    as the offline fold computes every element (fp16 code times the fp16 step, one fp16 -> e4m3 conversion),
    so a table entry is bit-equal to ``decode_mxfp4_tile_fp8``'s byte for that code and shift."""
    body = [".reg .b16 h, e0, e1, e2, e3;", ".reg .b32 s, c, p;", "cvt.rn.f16.f32 h, $1;", "mov.b32 s, {h, h};"]
    for j, pair in enumerate(_FOLD_PAIRS):
        body += [f"mov.b32 c, {pair:#010x};", "mul.rn.f16x2 p, s, c;", f"cvt.rn.satfinite.e4m3x2.f16x2 e{j}, p;"]
    return "{\n" + "\n".join(body + ["mov.b64 $0, {e0, e1, e2, e3};"]) + "\n}"


FOLD_TABLE_ASM = tl.constexpr(_fold_table_ptx())


@triton.jit
def _fold_entry(step16, v: tl.constexpr, sh: tl.constexpr):
    """One table byte (interpreter): e4m3(v * step) as uint32 shifted left by ``sh``."""
    return to_e4m3(step16 * v).to(tl.uint8, bitcast=True).to(tl.uint32) << sh


@triton.jit
def fold_tables(d):
    """Fold shifts d (int32, <= 6; any tensor shape) -> uint64 of the same shape: byte j is e4m3(E2M1
    magnitude j times 2**d), exact as the offline fold rounds it (d below -40 gives zeros, as there).
    The word decode looks codes up in these 8 bytes."""
    step = pow2_f32(tl.maximum(d, -40))
    if SOFT_E4M3_ROUNDING:
        s16 = step.to(tl.float16)
        t0 = _fold_entry(s16, 0.5, 8) | _fold_entry(s16, 1.0, 16) | _fold_entry(s16, 1.5, 24)
        t1 = _fold_entry(s16, 2.0, 0) | _fold_entry(s16, 3.0, 8) | _fold_entry(s16, 4.0, 16)
        t1 = t1 | _fold_entry(s16, 6.0, 24)
        return t0.to(tl.uint64) | (t1.to(tl.uint64) << 32)
    else:
        return tl.inline_asm_elementwise(FOLD_TABLE_ASM, "=l,r", [step], dtype=tl.uint64, is_pure=True, pack=1)


_LOOKUP_PTX = """
mov.b32 a, $2;
mov.b64 {t0, t1}, $3;
and.b32 m, a, 0x77777777;
prmt.b32 $0, t0, t1, m;
shr.u32 sb, m, 16;
prmt.b32 $1, t0, t1, sb;
"""
"""PTX shared by the word folds: 4 packed bytes ($2, 8 codes) and the block's table ($3) -> the e4m3
magnitudes of elements 0..3 ($0) and 4..7 ($1), one byte permute each."""

WORD_FOLD_ASM = tl.constexpr("{\n.reg .b32 m, sb, r, x, a, t0, t1;" + _LOOKUP_PTX + """
prmt.b32 r, a, 0, 0x1100;
shl.b32 x, r, 4;
lop3.b32 x, x, r, 0x00800080, 0xE4;
lop3.b32 $0, x, 0x80808080, $0, 0xEA;
prmt.b32 r, a, 0, 0x3322;
shl.b32 x, r, 4;
lop3.b32 x, x, r, 0x00800080, 0xE4;
lop3.b32 $1, x, 0x80808080, $1, 0xEA;
}
""")
"""PTX on the stored bytes (element i in nibble i): the look-up, then each nibble's bit 3 moved to its
byte's bit 7 (one permute, shift and two 3-input logic ops per 4 elements): 13 instructions per 8 codes."""

WORD_FOLD_SPLIT_ASM = tl.constexpr("{\n.reg .b32 m, sb, x, a, t0, t1;" + _LOOKUP_PTX + """
lop3.b32 $0, a, 0x80808080, $0, 0xEA;
shl.b32 x, a, 4;
lop3.b32 $1, x, 0x80808080, $1, 0xEA;
}
""")
"""PTX for the sign-split word layout (``to_sign_split_words``): 7 instructions per 8 codes."""

SIGN_SPLIT_MAG = (0, 4, 8, 12, 16, 20, 24, 28)
"""Bit position of element i's 3 magnitude bits in a sign-split word (element i of the 8 it holds)."""
SIGN_SPLIT_SIGN = (7, 15, 23, 31, 3, 11, 19, 27)
"""Bit position of element i's sign in a sign-split word: elements 0..3 at each byte's bit 7, elements
4..7 at bit 3, so one AND / one shift + AND puts four signs where the e4m3 bytes want them."""


def to_sign_split_words(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 packed uint8 [..., K/2] -> uint8 [..., K/2] of the same bits re-placed per 32-bit word
    (``SIGN_SPLIT_MAG`` / ``SIGN_SPLIT_SIGN``): the layout the 7-instruction word fold reads."""
    w = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for i in range(8):
        out |= ((w >> (4 * i)) & 7) << SIGN_SPLIT_MAG[i]
        out |= ((w >> (4 * i + 3)) & 1) << SIGN_SPLIT_SIGN[i]
    return out.to(torch.uint32).view(torch.int32).view(torch.uint8).reshape(packed.shape)


@triton.jit
def _lookup4(sel, t0, t1):
    """Interpreter: the byte permute of 4 magnitude nibbles of ``sel`` through tables t0/t1 (uint32)."""
    t = t0.to(tl.uint64) | (t1.to(tl.uint64) << 32)
    out = tl.zeros(sel.shape, tl.uint32)
    for j in tl.static_range(4):
        m = (sel >> (4 * j)) & 7
        out |= ((t >> (8 * m).to(tl.uint64)) & 0xFF).to(tl.uint32) << (8 * j)
    return out


@triton.jit
def fold_words_fp8(packed, scales, g_row, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """MXFP4 -> e4m3 fold relative to per-row exponents g_row int32 [BLOCK_R], by table look-up.

    packed uint8 [BLOCK_R, BLOCK_K/32, 16] (the stored bytes of each 32-block, or ``to_sign_split_words``
    bytes when SPLIT), scales uint8 [BLOCK_R, BLOCK_K/32] -> e4m3 [BLOCK_R, BLOCK_K] in natural K order,
    bit-equal to ``decode_mxfp4_tile_fp8`` (the offline conversion). Per 32-block one table
    (``fold_tables``); per 32-bit word of 8 codes one inline-asm call (13 instructions, 7 when SPLIT); the
    interpreter runs the same look-up with integer ops.
    """
    d = scales.to(tl.int32) - 127 - g_row[:, None]
    t = fold_tables(d)  # [R, K/32]
    if SOFT_E4M3_ROUNDING:
        t0 = (t & 0xFFFFFFFF).to(tl.uint32)
        t1 = (t >> 32).to(tl.uint32)
        b4 = tl.reshape(packed, (BLOCK_R, BLOCK_K // 32, 4, 4)).to(tl.uint32)
        sh = (tl.arange(0, 4) * 8).to(tl.uint32)
        w = tl.sum(b4 << sh[None, None, None, :], axis=3)  # [R, K/32, 4] little-endian words
        tw0 = t0[:, :, None]
        tw1 = t1[:, :, None]
        if SPLIT:
            a = _lookup4(w, tw0, tw1) | (w & 0x80808080)
            b = _lookup4(w >> 16, tw0, tw1) | ((w << 4) & 0x80808080)
        else:
            a = _lookup4(w, tw0, tw1)
            b = _lookup4(w >> 16, tw0, tw1)
            for j in tl.static_range(4):
                a |= ((w >> (4 * j + 3)) & 1) << (8 * j + 7)
                b |= ((w >> (4 * j + 19)) & 1) << (8 * j + 7)
        av = ((a[:, :, :, None] >> sh[None, None, None, :]) & 0xFF).to(tl.uint8)
        bv = ((b[:, :, :, None] >> sh[None, None, None, :]) & 0xFF).to(tl.uint8)
    else:
        if SPLIT:
            av, bv = tl.inline_asm_elementwise(
                WORD_FOLD_SPLIT_ASM, "=r,=r,r,l,l,l,l", [packed, t[:, :, None]],
                dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4,
            )
        else:
            av, bv = tl.inline_asm_elementwise(
                WORD_FOLD_ASM, "=r,=r,r,l,l,l,l", [packed, t[:, :, None]],
                dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4,
            )
        av = tl.reshape(av, (BLOCK_R, BLOCK_K // 32, 4, 4))
        bv = tl.reshape(bv, (BLOCK_R, BLOCK_K // 32, 4, 4))
    v = tl.permute(tl.join(av, bv), (0, 1, 2, 4, 3))  # [R, K/32, word, 2, 4]: elements 0..3, then 4..7
    return tl.reshape(v, (BLOCK_R, BLOCK_K)).to(tl.float8e4nv, bitcast=True)
