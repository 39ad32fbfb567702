"""MXFP4 codec and MXFP4 -> e4m3 conversion: Triton kernels against their torch twins and exact math."""

import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels import mxfp4 as mx

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def e2m1_f64(code):
    """E2M1 value of a 4-bit code, from OCP MX v1.0's definition (sign, 2-bit exponent with bias 1,
    1-bit mantissa; exponent 0 is subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def mxfp4_f64(packed, scales):
    """float64 [.., K] from packed codes (even element in the low nibble) and E8M0 scales, written
    from the format's definition (no helper of adapt's codec)."""
    lut = torch.tensor([e2m1_f64(c) for c in range(16)], dtype=torch.float64)
    p = packed.cpu().long()
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], -1)
    scale = torch.pow(2.0, scales.cpu().double() - 127).repeat_interleave(32, dim=-1)
    return lut[codes] * scale


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades so blocks get different exponents
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 6, shape, generator=g).float() / 3)
    return x.to(DEV)


@pytest.mark.parametrize("shape", [(3, 32), (5, 7, 96), (2, 160)])
def test_quantize_matches_twin_and_rules(shape):
    x = _rand(shape, 1)
    packed, scales = mx.quantize_mxfp4(x)
    p_t, s_t = mx.quantize_mxfp4_torch(x)
    assert torch.equal(packed, p_t) and torch.equal(scales, s_t)
    deq = mxfp4_f64(packed, scales).to(DEV)
    xb = x.double().reshape(*shape[:-1], -1, 32)
    # OCP rule: scale = 2**(floor(log2(amax)) - 2); every element within half a grid step or saturated at 6
    amax = xb.abs().amax(-1)
    e = torch.floor(torch.log2(amax)) - 2
    assert torch.equal(scales.double(), (e + 127).clamp(0, 254))
    scaled = xb / torch.exp2(e).unsqueeze(-1)
    q = deq.reshape_as(xb) / torch.exp2(e).unsqueeze(-1)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64, device=DEV)
    nearest = (scaled.abs().unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.all((q.abs() - scaled.abs()).abs() <= nearest + 1e-12)


def test_round_to_nearest_even_ties():
    # ties of the E2M1 grid at block scale 1 (amax 6 -> exponent 0): 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    # 2.5->2, 3.5->4, 5->4; 7 saturates... but amax fixes the scale, so put 6 in the block
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 6.0] + [0.0] * 22
    x = torch.tensor([vals], device=DEV)
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, 6.0] + [0.0] * 22
    for fn in (mx.quantize_mxfp4, mx.quantize_mxfp4_torch):
        p, s = fn(x)
        assert s.item() == 127
        assert mx.dequantize_mxfp4_torch(p, s).tolist() == [want]


def test_dequantize_every_code_and_scale_from_definition():
    # all 16 codes in both nibbles at E8M0 bytes from the smallest (2**-127) to the largest (2**127)
    scales_u8 = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254], dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8)
    byte = (codes[:, None] | (codes[None, :] << 4)).reshape(1, 256)  # every (low, high) pair
    packed = byte.repeat(len(scales_u8), 1).to(DEV)  # [8, 256]: 16 blocks of 32 elements a row
    scales = scales_u8[:, None].repeat(1, 16).to(DEV)
    want = mxfp4_f64(packed, scales)
    # every value is exact in fp32 and bf16 (denormals included) except 2 * 2**127 and up, which
    # overflow both to inf: the float64 value converted is the expected result
    for got in (mx.dequantize_mxfp4(packed, scales), mx.dequantize_mxfp4_torch(packed, scales)):
        assert torch.equal(got.cpu(), want.float())
    bf = mx.dequantize_mxfp4(packed, scales, torch.bfloat16).cpu()
    rows = slice(2, None) if mx.INTERPRET else slice(None)  # the interpreter's bf16 cast flushes denormals
    assert torch.equal(bf[rows], want.to(torch.bfloat16)[rows])
    assert torch.isinf(want.float()).sum() == 2 * 16 * 4 * 2  # codes 2..4, 6 (+ signs), both nibbles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_twin(dtype):
    p, s = mx.quantize_mxfp4_torch(_rand((6, 5, 64), 2))
    got = mx.dequantize_mxfp4(p, s, dtype)
    assert torch.equal(got, mx.dequantize_mxfp4_torch(p, s, dtype))


def test_gpt_oss_layout_round_trip():
    p, s = mx.quantize_mxfp4_torch(_rand((4, 6, 96), 3))
    blocks = mx.to_gpt_oss_blocks(p)
    assert blocks.shape == (4, 6, 3, 16)
    assert torch.equal(mx.from_gpt_oss_blocks(blocks), p)
    # even element in the low nibble
    x = torch.zeros(1, 32, device=DEV)
    x[0, 0], x[0, 1] = 1.0, -6.0
    p1, s1 = mx.quantize_mxfp4_torch(x)
    assert p1[0, 0].item() == (0x2 | (0xF << 4))


@pytest.mark.parametrize("group_k", [32, 128, None])
def test_fp8_conversion_exact_and_matches_twin(group_k):
    p, s = mx.quantize_mxfp4_torch(_rand((5, 256), 4))
    got = mx.mxfp4_to_fp8(p, s, group_k)
    ref = mx.mxfp4_to_fp8_torch(p, s, group_k)
    assert torch.equal(got.values.float(), ref.values.float())
    assert torch.equal(got.exponents, ref.exponents)
    assert got.lost.item() == ref.lost.item() == 0
    g = 256 if group_k is None else group_k
    back = got.values.float().reshape(5, 256 // g, g) * torch.exp2(got.exponents.float()).unsqueeze(-1)
    assert torch.equal(back.reshape(5, 256), mx.dequantize_mxfp4_torch(p, s))


def test_fp8_conversion_counts_lost_bits():
    # one block 2**-20 below the others in the same row: its elements fall under e4m3's range
    x = torch.randn(2, 128, device=DEV)
    x[0, 32:64] *= 2.0**-20
    p, s = mx.quantize_mxfp4_torch(x)
    got = mx.mxfp4_to_fp8(p, s, None)
    ref = mx.mxfp4_to_fp8_torch(p, s, None)
    nonzero_small = int((mx.dequantize_mxfp4_torch(p, s)[0, 32:64] != 0).sum())
    assert got.lost.item() == ref.lost.item() == nonzero_small > 0
    # with groups of 32 nothing is lost
    assert mx.mxfp4_to_fp8(p, s, 32).lost.item() == 0


def test_nan_scale_rejected():
    p, s = mx.quantize_mxfp4_torch(_rand((2, 128), 5))
    s[1, 1] = 0xFF
    for fn in (mx.dequantize_mxfp4, mx.dequantize_mxfp4_torch, mx.mxfp4_to_fp8, mx.mxfp4_to_fp8_torch):
        with pytest.raises(InputError, match="0xFF"):
            fn(p, s)


def test_non_finite_input_gets_nan_scale():
    x = _rand((1, 64), 6)
    x[0, 40] = float("nan")
    for fn in (mx.quantize_mxfp4, mx.quantize_mxfp4_torch):
        _, s = fn(x)
        assert s[0, 1].item() == 0xFF and s[0, 0].item() != 0xFF


def test_bad_shapes_rejected():
    with pytest.raises(InputError):
        mx.quantize_mxfp4_torch(torch.zeros(2, 40))
    p, s = mx.quantize_mxfp4_torch(torch.randn(2, 64))
    with pytest.raises(InputError):
        mx.dequantize_mxfp4(p, s[:, :1])
    with pytest.raises(InputError):
        mx.mxfp4_to_fp8(p, s, 48)


@pytest.mark.gpu
def test_codec_real_shapes_gpu():
    x = torch.randn(2880, 2880, device="cuda") * 0.02
    p, s = mx.quantize_mxfp4(x)
    p_t, s_t = mx.quantize_mxfp4_torch(x)
    assert torch.equal(p, p_t) and torch.equal(s, s_t)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(mx.dequantize_mxfp4(p, s, dtype), mx.dequantize_mxfp4_torch(p, s, dtype))
    for g in (32, 96, None):  # 2880 = 30 * 96
        a, b = mx.mxfp4_to_fp8(p, s, g), mx.mxfp4_to_fp8_torch(p, s, g)
        assert torch.equal(a.values.float(), b.values.float()) and torch.equal(a.exponents, b.exponents)
        assert a.lost.item() == b.lost.item()


@triton.jit
def _words_decode_kernel(
    w_ptr, s_ptr, out_ptr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TO_BF16: tl.constexpr
):
    """Decode one [BLOCK_R, BLOCK_K] tile with decode_mxfp4_words; scatter it back to natural K order."""
    r = tl.arange(0, BLOCK_R)
    w = tl.load(w_ptr + r[:, None] * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)[None, :])
    s = tl.load(s_ptr + r[:, None] * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)[None, :])
    v = mx.decode_mxfp4_words(w.to(tl.uint32, bitcast=True), s, BLOCK_R, BLOCK_K, TO_BF16)
    kk = mx.word_k_order(BLOCK_K)
    tl.store(out_ptr + r[:, None] * BLOCK_K + kk[None, :], v.to(tl.float32))


def test_word_decode_exhaustive():
    # every byte value (all 16 x 16 code pairs) under scales 2**-127 .. 2**127 (E8M0 0..254)
    rows, k = 16, 512
    packed = (torch.arange(rows * k // 2) % 256).to(torch.uint8).reshape(rows, k // 2)
    scales = torch.linspace(0, 254, rows * k // 32).round().to(torch.uint8).reshape(rows, k // 32)
    scales[0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    packed, scales = packed.to(DEV), scales.to(DEV)
    out = torch.empty(rows, k, dtype=torch.float32, device=DEV)
    _words_decode_kernel[(1,)](packed.view(torch.int32), scales, out, rows, k, not mx.INTERPRET)
    ref = mx.dequantize_mxfp4_torch(packed, scales)
    # results inside the normal range (bf16 and fp32 share it); 0 included
    ok = (ref.abs() < 3.0e38) & ((ref.abs() >= 2.0**-126) | (ref == 0))
    assert torch.equal(out[ok], ref[ok])
    assert torch.equal(torch.signbit(out), torch.signbit(ref))
