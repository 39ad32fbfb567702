"""FP8 (e4m3) quantisation of MoE activations with power-of-two scales, per row or per 1x128 group.

``quantize_fp8_rows(x, group) -> (e4m3 [R, K], fp32 scales [R] or [R, K/group])`` and its twin
``quantize_fp8_rows_torch``. The scale rule is ``adapt.kernels.fp8.pow2_scale``: 2**e with the
smallest integer e such that amax <= 448 * 2**e (448: the largest e4m3 normal), so x * 2**-e is
exact before the single rounding to e4m3; e is clamped to [-126, 127] (all-zero rows get 2**-126).
The Triton kernel computes the same e from the fp32 bits of amax: 448 = 1.75 * 2**E4M3_MAX_EXP, so
e = exponent(amax) - E4M3_MAX_EXP, plus one when amax's mantissa exceeds 1.75.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels.formats import FP8_DTYPE, FP8_E4M3_MAX
from adapt.kernels.fp8 import pow2_scale, quantize_fp8_groups
from adapt.kernels.moe_tiles import num_sms
from adapt.kernels.mxfp4 import pow2_f32, to_e4m3

FP8_GROUP = 128
"""Elements per activation scale group with act_quant='group128' (DeepSeek's 1x128)."""


_E4M3_MAX_EXP = tl.constexpr(int(FP8_E4M3_MAX).bit_length() - 1)
"""8: 448 = 1.75 * 2**8 (formats.FP8_E4M3_MAX)."""
_E4M3_MAX_MANTISSA = tl.constexpr(int((FP8_E4M3_MAX / 2 ** _E4M3_MAX_EXP.value - 1) * (1 << 23)))
"""0x600000: the fp32 mantissa bits of 1.75."""


def quantize_fp8_rows_torch(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``quantize_fp8_rows``: x [R, K] -> (e4m3 [R, K], fp32 pow2 scales [R] or [R, K/group])."""
    r, k = x.shape
    q, scale = quantize_fp8_groups(x, k if group is None else group, pow2_scale)
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
            # fp8.pow2_scale, from the bits of amax
            e = ((bits >> 23) & 0xFF) - 127 - _E4M3_MAX_EXP + ((bits & 0x7FFFFF) > _E4M3_MAX_MANTISSA).to(tl.int32)
            e = tl.minimum(tl.maximum(e, -126), 127)
            inv = pow2_f32(-e)
            for k0 in range(0, GROUP, BLOCK_K):
                kk = g0 + k0 + tl.arange(0, BLOCK_K)
                m = (kk < k) & (k0 + tl.arange(0, BLOCK_K) < GROUP)
                v = tl.load(x_ptr + r * k + kk, mask=m, other=0.0).to(tl.float32) * inv
                tl.store(q_ptr + r * k + kk, to_e4m3(v), mask=m)
            tl.store(s_ptr + r * stride_s + g0 // GROUP, pow2_f32(e))


def quantize_fp8_rows(
    x: torch.Tensor,
    group: int | None = None,
    row_range: tuple[torch.Tensor, int, int] | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [R, K] -> (e4m3 [R, K], fp32 power-of-two scales [R] (group None) or [R, K/group]).

    Scale by ``fp8.pow2_scale`` (2**e, smallest e with amax <= 448 * 2**e), so x * 2**-e is exact
    before the one e4m3 rounding. row_range: int32 [2] on the device, rows [lo, hi) to quantise (others are
    left untouched in ``out``). Bytes: reads 2*K (twice), writes K + 4*K/group per row.
    """
    r, k = x.shape
    g = k if group is None else group
    if k % g:
        raise InputError(f"activation group {group} does not divide K={k}", field="act_quant")
    if out is None:
        q = torch.empty(r, k, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty((r,) if group is None else (r, k // g), dtype=torch.float32, device=x.device)
    else:
        q, s = out
    rng, i, j = row_range if row_range is not None else (x, 0, 0)
    if r:
        grid = (max(1, min(r, num_sms(x.device) * 8)),)
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
