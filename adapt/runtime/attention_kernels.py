"""Triton kernels behind ``adapt.runtime.attention``'s kernel paths (imported lazily, after
``TRITON_INTERPRET`` is settled): paged GQA attention with sliding window and sinks, RMSNorm, RoPE.

The wrappers with shapes, units and work counts are in ``adapt.runtime.attention``
(``paged_gqa_attention``, ``rms_norm_triton``, ``rope_triton``); their torch twins are that
module's reference functions. Under the interpreter bf16 dot operands are upcast to fp32
(``UPCAST``); fp32 dots use IEEE precision, never TF32. Values bound for bf16 are rounded to
nearest even in fp32 first (``round_bf16``): the interpreter's own bf16 cast truncates, and a
pre-rounded value converts exactly either way.
"""

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32 (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def paged_gqa_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    sink_ptr,
    block_table_ptr,
    seq_ptr,
    pos_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    out_ptr,
    bt_stride,
    n_heads,
    qk_scale_log2,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # one program: up to BLOCK_M consecutive query rows of one sequence x the GROUP query heads of
    # one kv head, flattened into BLOCK_M * GROUP_PAD rows of the score tile
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.load(tile_start_ptr + tile)
    count = tl.load(tile_rows_ptr + tile)
    m = tl.arange(0, BLOCK_M * GROUP_PAD)
    row_in_tile = m // GROUP_PAD
    head_in_group = m % GROUP_PAD
    valid = (row_in_tile < count) & (head_in_group < GROUP)
    rows = first + row_in_tile
    heads = kv_head * GROUP + head_in_group
    d = tl.arange(0, DIM)
    q = tl.load(
        q_ptr + (rows[:, None] * n_heads + heads[:, None]) * DIM + d[None, :], mask=valid[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + rows, mask=valid, other=0)
    seq = tl.load(seq_ptr + first)
    hi = tl.load(pos_ptr + first + count - 1) + 1
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.load(pos_ptr + first) - window + 1, 0)
    if HAS_SINK:
        m_i = tl.load(sink_ptr + heads, mask=valid, other=0.0) * 1.4426950408889634
        l_i = tl.where(valid, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM], tl.float32)
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
        visible = valid[:, None] & pmask[None, :] & (p[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (p[None, :] > pos[:, None] - window)
        s = tl.where(visible, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (rows[:, None] * n_heads + heads[:, None]) * DIM + d[None, :], out, mask=valid[:, None]
    )


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
