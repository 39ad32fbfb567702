"""Triton kernels behind ``adapt.runtime.attention``'s kernel paths (imported lazily, after
``TRITON_INTERPRET`` is settled): paged GQA attention with sliding window and sinks, RMSNorm, RoPE.

The wrappers with shapes, units and work counts are in ``adapt.runtime.attention``
(``paged_gqa_attention``, ``rms_norm_triton``, ``rope_triton``); their torch twins are that
module's reference functions. Under the interpreter bf16 dot operands are upcast to fp32
(``UPCAST``); fp32 dots use IEEE precision, never TF32.
"""

import triton
import triton.language as tl


@triton.jit
def paged_gqa_kernel(q_ptr, k_ptr, v_ptr, sink_ptr, block_table_ptr, seq_ptr, pos_ptr, out_ptr, bt_stride,
                     n_heads, qk_scale_log2, window,
                     GROUP: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HAS_SINK: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < GROUP
    heads = kv_head * GROUP + hs
    d = tl.arange(0, DIM)
    q = tl.load(q_ptr + (row * n_heads + heads[:, None]) * DIM + d[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    seq = tl.load(seq_ptr + row)
    pos = tl.load(pos_ptr + row)
    hi = pos + 1
    lo = pos * 0
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    if HAS_SINK:
        m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        pmask = p < hi
        page = tl.load(block_table_ptr + seq * bt_stride + p // PAGE, mask=pmask, other=0)
        slot = page.to(tl.int64) * PAGE + p % PAGE
        offs = (slot[:, None] * KV_HEADS + kv_head) * DIM + d[None, :]
        k = tl.load(k_ptr + offs, mask=pmask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=pmask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(pmask[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (row * n_heads + heads[:, None]) * DIM + d[None, :], out, mask=hmask[:, None])


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr, SCALE_IN_FP32: tl.constexpr,
                    ROUND_BF16: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / dim + eps)
    if not SCALE_IN_FP32:
        if ROUND_BF16:  # transformers casts the normalised row and the weight to bf16, then scales
            normed = normed.to(tl.bfloat16).to(tl.float32)
            w = w.to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows_per_token, HALF: tl.constexpr, BLOCK: tl.constexpr,
                PAIRS: tl.constexpr):
    token = tl.program_id(0)
    row = token * rows_per_token + tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    if PAIRS:
        a_off, b_off = 2 * i, 2 * i + 1
    else:
        a_off, b_off = i, i + HALF
    base = x_ptr + row * 2 * HALF
    a = tl.load(base + a_off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + b_off, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * HALF + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * HALF + i, mask=mask, other=0.0)
    dst = out_ptr + row * 2 * HALF
    kind = out_ptr.dtype.element_ty
    tl.store(dst + i, (a * c - b * s).to(kind), mask=mask)
    tl.store(dst + HALF + i, (b * c + a * s).to(kind), mask=mask)
