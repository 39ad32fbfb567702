"""RMSNorm and rotary embeddings: Triton kernels ``rms_norm`` and ``rope`` with torch twins
``rms_norm_torch`` and ``rope_torch`` (same arguments). Values bound for bf16 are rounded to
nearest even in fp32 first (``round_bf16``): the interpreter's own bf16 cast truncates, and a
pre-rounded value converts exactly either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32 (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    dim,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (r[:, None] < n_rows) & (cols[None, :] < dim)
    offs = r[:, None].to(tl.int64) * dim + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 1) / dim + eps)[:, None]
    if not SCALE_IN_FP32:
        if ROUND_BF16:  # transformers casts the normalised row and the weight to bf16, then scales
            normed = round_bf16(normed)
            w = round_bf16(w)
    out = w[None, :] * normed
    if ROUND_BF16:
        out = round_bf16(out)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    rows_per_token,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    token = tl.program_id(0)
    r = tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK)
    mask = (r[:, None] < rows_per_token) & (i[None, :] < HALF)
    base = (token * rows_per_token + r[:, None]).to(tl.int64) * (2 * HALF)
    if PAIRS:
        a_off, b_off = base + 2 * i[None, :], base + 2 * i[None, :] + 1
    else:
        a_off, b_off = base + i[None, :], base + i[None, :] + HALF
    a = tl.load(x_ptr + a_off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + b_off, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * HALF + i, mask=i < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + token * HALF + i, mask=i < HALF, other=0.0)[None, :]
    first = a * c - b * s
    second = b * c + a * s
    if ROUND_BF16:
        first = round_bf16(first)
        second = round_bf16(second)
    kind = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + i[None, :], first.to(kind), mask=mask)
    tl.store(out_ptr + base + HALF + i[None, :], second.to(kind), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_fp32: bool = False
) -> torch.Tensor:
    """RMSNorm over the last axis (Triton): x [..., D] -> [..., D] in x's dtype; weight [D]; ``rms_norm_torch``'s
    rounding order.
    16 rows a program; reads and writes D * itemsize bytes per row."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    n, dim = rows.shape
    if n:
        rms_norm_kernel[(-(-n // 16),)](
            rows,
            weight.contiguous(),
            out,
            n,
            dim,
            eps,
            ROWS=16,
            BLOCK=1 << (dim - 1).bit_length(),
            SCALE_IN_FP32=scale_in_fp32,
            ROUND_BF16=x.dtype == torch.bfloat16,
        )
    return out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, pairs: bool) -> torch.Tensor:
    """Rotary embedding (Triton), twin ``rope_torch``: x [N, ..., D], cos/sin fp32-able [N, D/2]; pairs:
    rotate (2i, 2i + 1), output de-interleaved (rotated evens, then odds), else rotate (i, i + D/2).
    One program per token (all its heads); math in fp32, one rounding to x's dtype."""
    n, dim = x.shape[0], x.shape[-1]
    rows = x.reshape(n, -1, dim).contiguous()
    out = torch.empty_like(rows)
    if rows.numel():
        per_token = rows.shape[1]
        rope_kernel[(n,)](
            rows,
            cos.float().contiguous(),
            sin.float().contiguous(),
            out,
            per_token,
            HALF=dim // 2,
            ROWS=1 << (per_token - 1).bit_length(),
            BLOCK=1 << (dim // 2 - 1).bit_length(),
            PAIRS=pairs,
            ROUND_BF16=x.dtype == torch.bfloat16,
        )
    return out.view(x.shape)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_fp32: bool = False) -> torch.Tensor:
    """Torch twin of ``rms_norm``: RMSNorm over the last axis in fp32, result in x's dtype.

    scale_in_fp32: multiply by the weight before casting back (gpt-oss keeps its norms in fp32);
    otherwise cast then multiply (DeepSeek, Qwen3).
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_fp32:
        return (weight.float() * xf).to(x.dtype)
    return weight.to(x.dtype) * xf.to(x.dtype)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, pairs: bool) -> torch.Tensor:
    """Torch twin of ``rope``: x [N, ..., D]; cos, sin [N, D/2] (broadcast over the middle axes)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if pairs:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
