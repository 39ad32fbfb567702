"""The in-GEMM MXFP4 -> e4m3 fold written in Gluon (Triton 3.6's lower-level language) for Hopper (sm_90).

Same arithmetic as ``moe_gemm._moe_gemm_kernel`` with W_MODE 5 / 6 and tokens in the MMA's M (the
``compute="fp8_fold"`` path, bit-equal to the offline FP8 copy): e4m3 activations with one power-of-two
scale per row, MXFP4 weights folded to e4m3 relative to a per-row exponent g = max block exponent - 6 by
the table look-up of ``mxfp4.fold_words_fp8`` (the same inline PTX), fp8 wgmma, fp32 accumulation.

What Gluon adds over the ``tl`` kernel (benchmarks/moe/2026-11-30-s3-prefill: there Triton 3.6 waits on
every wgmma whose B operand was stored from registers, so decode and MMA run one after the other):

- the packed E2M1 bytes, the E8M0 scales and the gathered e4m3 activation rows of step k + STAGES - 1 are
  copied with cp.async into a STAGES-deep shared-memory ring while step k is decoded;
- the decoded gate / up tiles go to one of two NVMMA-layout buffers; the wgmma pair of step k is issued
  asynchronously and waited with ``num_outstanding=2`` after step k + 1's pair is issued, so the decode of
  step k + 1 overlaps the MMAs of step k.

Shapes (GEMM1 with SwiGLU, per tile): x e4m3 [BLOCK_M, BLOCK_K] per step; W packed uint8
[BLOCK_N, BLOCK_K/32, 16] (gate rows and up rows), scales uint8 [BLOCK_N, BLOCK_K/32]; accumulators fp32
[BLOCK_M, BLOCK_N] (two with SwiGLU). Gluon does not run under the interpreter: the ``tl`` kernel stays the
CPU path and the fallback; ``usable`` says where this one may run.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from adapt.kernels.formats import is_sm90
from adapt.kernels.mxfp4 import FOLD_TABLE_ASM as FOLD_TABLE_PTX
from adapt.kernels.mxfp4 import WORD_FOLD_ASM as WORD_FOLD_PTX
from adapt.kernels.mxfp4 import WORD_FOLD_SPLIT_ASM as WORD_FOLD_SPLIT_PTX


def usable(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 9.x (wgmma), where this kernel compiles and was timed."""
    return is_sm90(device)


@gluon.jit
def _pow2(e):
    """2**e as fp32 from int32 e, clamped to [-126, 127] (``mxfp4.pow2_f32``'s bits)."""
    ec = gl.minimum(gl.maximum(e, -126), 127)
    return ((ec + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _row_exponent(sbase, wrow, n_ok, k_blocks, BLOCK_N: gl.constexpr, LS: gl.constexpr):
    """int32 [BLOCK_N] in SliceLayout(1, LS): max over the row's E8M0 scales minus 127, minus 6."""
    gmax = gl.full((BLOCK_N,), -127, gl.int32, gl.SliceLayout(1, LS))
    for c0 in range(0, k_blocks, 64):
        cb = c0 + gl.arange(0, 64, gl.SliceLayout(0, LS))
        s = gl.load(sbase + wrow[:, None] * k_blocks + cb[None, :], mask=n_ok[:, None] & (cb < k_blocks)[None, :],
                    other=0)
        gmax = gl.maximum(gmax, gl.max(s.to(gl.int32), axis=1) - 127)
    return gmax - 6


@gluon.jit
def _issue_step(x_ring, w_ring, slot, x_ptr, tok, row_ok, wbase, rg, ru, n_ok, k0, k, k_blocks,
                ACTIVATION: gl.constexpr, BLOCK_K: gl.constexpr, LX: gl.constexpr, LW: gl.constexpr,
                COMMIT: gl.constexpr = True):
    """cp.async of one K step (activation rows, packed bytes of the gate and up rows) into ring slot
    ``slot`` (masked past K: zeros); COMMIT: closed as one commit group (the loader partition of
    ``fold_gemm_ws_kernel`` signals an mbarrier instead)."""
    NW: gl.constexpr = 2 if ACTIVATION != 0 else 1
    kk = k0 + gl.arange(0, BLOCK_K, gl.SliceLayout(0, LX))
    xp = x_ptr + tok[:, None] * k + kk[None, :]
    async_copy.async_copy_global_to_shared(x_ring.index(slot), xp, mask=row_ok[:, None] & (kk < k)[None, :])
    kb = k0 // 32 + gl.arange(0, BLOCK_K // 32, gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    jb = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    kb3 = gl.expand_dims(gl.expand_dims(kb, 0), 2)
    jb3 = gl.expand_dims(gl.expand_dims(jb, 0), 1)
    ok3 = gl.expand_dims(gl.expand_dims(n_ok, 1), 2) & (kb3 < k_blocks)
    rg3 = gl.expand_dims(gl.expand_dims(rg, 1), 2)
    off = kb3 * 16 + jb3
    async_copy.async_copy_global_to_shared(w_ring.index(NW * slot), wbase + rg3 * (k_blocks * 16) + off, mask=ok3)
    if ACTIVATION != 0:
        ru3 = gl.expand_dims(gl.expand_dims(ru, 1), 2)
        async_copy.async_copy_global_to_shared(w_ring.index(NW * slot + 1), wbase + ru3 * (k_blocks * 16) + off,
                                               mask=ok3)
    if COMMIT:
        async_copy.commit_group()


@gluon.jit
def _scales(sbase, rows, n_ok, k0, k_blocks, BLOCK_K: gl.constexpr, LW: gl.constexpr):
    """uint8 [BLOCK_N, BLOCK_K/32] in SliceLayout(2, LW): the E8M0 scales of ``rows`` at K step k0 (past K: 0,
    whose fold table is zeros). Plain loads: 4 bytes a row a step are too narrow for cp.async at every K."""
    kb = k0 // 32 + gl.arange(0, BLOCK_K // 32, gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    return gl.load(sbase + rows[:, None] * k_blocks + kb[None, :], mask=n_ok[:, None] & (kb < k_blocks)[None, :],
                   other=0)


@gluon.jit
def _fold(p, s, g3, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """packed uint8 [BLOCK_N, BLOCK_K/32, 16], scales uint8 [BLOCK_N, BLOCK_K/32, 1] (same 3D layout),
    g3 int32 [BLOCK_N, 1, 1] -> e4m3 [BLOCK_N, BLOCK_K], bit-equal to ``mxfp4.fold_words_fp8``."""
    d = s.to(gl.int32) - 127 - g3
    step = _pow2(gl.maximum(d, -40))
    t = gl.inline_asm_elementwise(FOLD_TABLE_PTX, "=l,r", [step], dtype=gl.uint64, is_pure=True, pack=1)
    t = gl.broadcast(t, p)[0]
    if SPLIT:
        av, bv = gl.inline_asm_elementwise(WORD_FOLD_SPLIT_PTX, "=r,=r,r,l,l,l,l", [p, t],
                                           dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    else:
        av, bv = gl.inline_asm_elementwise(WORD_FOLD_PTX, "=r,=r,r,l,l,l,l", [p, t],
                                           dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    av = gl.reshape(av, (BLOCK_N, BLOCK_K // 32, 4, 4))
    bv = gl.reshape(bv, (BLOCK_N, BLOCK_K // 32, 4, 4))
    v = gl.permute(gl.join(av, bv), (0, 1, 2, 4, 3))
    return gl.reshape(v, (BLOCK_N, BLOCK_K)).to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _decode_step(w_ring, dec, slot, buf, s_g, s_u, g3_g, g3_u, ACTIVATION: gl.constexpr, SPLIT: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LD: gl.constexpr):
    """Ring slot ``slot`` with this step's scales s_g / s_u -> decoded e4m3 tiles in ``dec`` buffer ``buf``."""
    NW: gl.constexpr = 2 if ACTIVATION != 0 else 1
    p = w_ring.index(NW * slot).load(LD)
    dec.index(NW * buf).store(_fold(p, gl.expand_dims(s_g, 2), g3_g, SPLIT, BLOCK_N, BLOCK_K))
    if ACTIVATION != 0:
        p = w_ring.index(NW * slot + 1).load(LD)
        dec.index(NW * buf + 1).store(_fold(p, gl.expand_dims(s_u, 2), g3_u, SPLIT, BLOCK_N, BLOCK_K))


@gluon.jit
def _work_shape(tile_start_ptr, e_lo, e_hi, n_out, k, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """(first m tile, m tiles, n tiles, K steps) of experts [e_lo, e_hi): the persistent loop runs over
    m tiles x n tiles work items."""
    m_lo = gl.load(tile_start_ptr + e_lo)
    return m_lo, gl.load(tile_start_ptr + e_hi) - m_lo, gl.cdiv(n_out, BLOCK_N), gl.cdiv(k, BLOCK_K)


@gluon.jit
def _tile_coords(tile, m_lo, n_m, n_n, GROUP_M: gl.constexpr):
    """(m tile index into ``moe_tiles.tile_slots``' arrays, n tile) of persistent work item ``tile``: GROUP_M
    m tiles share each n tile in turn (L2 reuse of the weight tile)."""
    width = GROUP_M * n_n
    first_m = (tile // width) * GROUP_M
    gsz = gl.minimum(n_m - first_m, GROUP_M)
    return m_lo + first_m + (tile % width) % gsz, (tile % width) // gsz


@gluon.jit
def _tile_rows(mt, nt, tile_expert_ptr, tile_row_ptr, offsets_ptr, sorted_slot_ptr, n_out, gate_mult, up_off,
               TOPK: gl.constexpr, GATHER: gl.constexpr, ACTIVATION: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, LX: gl.constexpr, LW: gl.constexpr):
    """Rows of tile (mt, nt): expert e, first / end sorted row, the token of each of the BLOCK_M rows (int64,
    layout SliceLayout(1, LX)) with its mask, and the gate / up weight rows of the BLOCK_N outputs with their
    mask (layout of LW's rows: the cp.async and scale tiles)."""
    e = gl.load(tile_expert_ptr + mt)
    row0 = gl.load(tile_row_ptr + mt)
    row_end = gl.load(offsets_ptr + e + 1)
    rows_x = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, LX))
    rx_ok = rows_x < row_end
    if GATHER:
        tok = (gl.load(sorted_slot_ptr + rows_x, mask=rx_ok, other=0) // TOPK).to(gl.int64)
    else:
        tok = rows_x.to(gl.int64)
    nw = nt * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, gl.SliceLayout(2, LW)))
    nw_ok = nw < n_out
    if ACTIVATION == 0:
        rg_w = nw
        ru_w = nw
    else:
        rg_w = nw * gate_mult
        ru_w = nw * gate_mult + up_off
    return e, row0, row_end, tok, rx_ok, rg_w, ru_w, nw_ok


@gluon.jit
def _tile_exponents(sbase, nt, n_out, k_blocks, gate_mult, up_off, ACTIVATION: gl.constexpr, BLOCK_N: gl.constexpr,
                    LR: gl.constexpr):
    """Per-row exponents g (int32 [BLOCK_N], SliceLayout(1, LR)) of the gate and up rows of n tile nt."""
    nr = nt * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, LR))
    nr_ok = nr < n_out
    rg_r = nr * gate_mult if ACTIVATION != 0 else nr
    g_g = _row_exponent(sbase, rg_r, nr_ok, k_blocks, BLOCK_N, LR)
    g_u = g_g
    if ACTIVATION != 0:
        g_u = _row_exponent(sbase, nr * gate_mult + up_off, nr_ok, k_blocks, BLOCK_N, LR)
    return g_g, g_u


@gluon.jit
def _mma_step(x_ring, dec, slot, buf, acc_g, acc_u, ACTIVATION: gl.constexpr, FENCE: gl.constexpr = True):
    """After the decode into ``dec`` buffer ``buf``: proxy fence (FENCE False: a timing probe only), CTA
    barrier, the async wgmma pair (x ring slot ``slot`` times the decoded gate / up tiles) and a wait that leaves
    this pair in flight."""
    NW: gl.constexpr = 2 if ACTIVATION != 0 else 1
    if FENCE:
        fence_async_shared()
    gl.thread_barrier()
    xs_tile = x_ring.index(slot)
    acc_g = warpgroup_mma(xs_tile, dec.index(NW * buf).permute((1, 0)), acc_g, is_async=True)
    if ACTIVATION != 0:
        acc_u = warpgroup_mma(xs_tile, dec.index(NW * buf + 1).permute((1, 0)), acc_u, is_async=True)
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=NW, deps=(acc_g, acc_u))
    else:
        acc_g = warpgroup_mma_wait(num_outstanding=NW, deps=(acc_g,))
    return acc_g, acc_u


@gluon.jit
def _mma_drain(acc_g, acc_u, ACTIVATION: gl.constexpr):
    """Wait for every wgmma in flight (end of a tile's K loop)."""
    if ACTIVATION != 0:
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
    else:
        acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
    return acc_g, acc_u


@gluon.jit
def _epilogue(acc_g, acc_u, g_g, g_u, row0, row_end, nt, we, xs_ptr, sorted_slot_ptr, bias_ptr, stride_be, out_ptr,
              stride_o, n_out, gate_mult, up_off, alpha, limit, TOPK: gl.constexpr, GATHER: gl.constexpr,
              ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              ACC: gl.constexpr):
    """fp32 accumulators [BLOCK_M, BLOCK_N] (layout ACC) of one tile -> bf16 rows of ``out`` (sorted order):
    the row exponents, the token scales, the biases and the activation in the fp8 path's order."""
    n = nt * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, ACC))
    n_ok = n < n_out
    rows = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, ACC))
    row_ok = rows < row_end
    if GATHER:
        tok_e = gl.load(sorted_slot_ptr + rows, mask=row_ok, other=0) // TOPK
    else:
        tok_e = rows
    acc_g = acc_g * _pow2(gl.convert_layout(g_g, gl.SliceLayout(0, ACC)))[None, :]
    acc_u = acc_u * _pow2(gl.convert_layout(g_u, gl.SliceLayout(0, ACC)))[None, :]
    xs_tok = gl.load(xs_ptr + tok_e.to(gl.int64), mask=row_ok, other=0.0)
    acc_g = acc_g * xs_tok[:, None]
    acc_u = acc_u * xs_tok[:, None]
    if ACTIVATION == 0:
        rg = n
        ru = n
    else:
        rg = n * gate_mult
        ru = n * gate_mult + up_off
    if HAS_BIAS:
        acc_g += gl.load(bias_ptr + we * stride_be + rg, mask=n_ok, other=0.0).to(gl.float32)[None, :]
        if ACTIVATION != 0:
            acc_u += gl.load(bias_ptr + we * stride_be + ru, mask=n_ok, other=0.0).to(gl.float32)[None, :]
    if ACTIVATION == 0:
        res = acc_g
    elif ACTIVATION == 1:
        res = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
    else:
        gc = gl.minimum(acc_g, limit)
        uc = gl.minimum(gl.maximum(acc_u, -limit), limit)
        res = gc / (1.0 + gl.exp(-alpha * gc)) * (uc + 1.0)
    optr = out_ptr + rows[:, None].to(gl.int64) * stride_o + n[None, :]
    gl.store(optr, res.to(gl.bfloat16), mask=row_ok[:, None] & n_ok[None, :])


@gluon.jit
def fold_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, sc_ptr, stride_we, stride_se, bias_ptr, stride_be, out_ptr, stride_o,
    sorted_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, tile_start_ptr,
    e_lo, e_hi, n_out, k, k_blocks, gate_mult, up_off, alpha, limit,
    TOPK: gl.constexpr, GATHER: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
    SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr, PROBE: gl.constexpr = 0,
):
    """Grouped GEMM over expert-sorted slots, out[m, n] = epilogue(x[m, :] . fold(W[e, n, :])).

    x e4m3 [rows, K] (row pitch K) gathered by token (GATHER: sorted_slot // TOPK) or in sorted order,
    xs fp32 [rows] its per-row scales; W packed uint8 [E, N, K/32, 16] (stored or sign-split bytes),
    scales uint8 [E, N, K/32]; out bf16 [S, n_out] in sorted order. ACTIVATION 0: acc (+bias);
    1 / 2: SwiGLU of gate rows n * gate_mult and up rows n * gate_mult + up_off (plain / gpt-oss clamped).
    Experts [e_lo, e_hi); the tile schedule is ``moe_tiles.tile_slots``'. PROBE (timing by elimination,
    wrong results, never dispatched): bit 1 drops the proxy fence, bit 2 decodes only a tile's first two K
    steps (later MMAs read the stale decoded tiles); 0 is the kernel.
    """
    # layouts: cp.async tiles with 16-byte chunks per thread; the decode's 3D tile holds one 32-block
    # (16 bytes) per thread; the accumulators in the wgmma layout (warps stacked along tokens)
    LX: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    X_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    W_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    RAW_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    NW: gl.constexpr = 2 if ACTIVATION != 0 else 1

    x_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], X_SL)
    w_ring = gl.allocate_shared_memory(gl.uint8, [NW * STAGES, BLOCK_N, BLOCK_K // 32, 16], RAW_SL)
    dec = gl.allocate_shared_memory(gl.float8e4nv, [2 * NW, BLOCK_N, BLOCK_K], W_SL)

    m_lo, n_m, n_n, n_k = _work_shape(tile_start_ptr, e_lo, e_hi, n_out, k, BLOCK_N, BLOCK_K)
    total = n_m * n_n
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        mt, nt = _tile_coords(tile, m_lo, n_m, n_n, GROUP_M)
        e, row0, row_end, tok, rx_ok, rg_w, ru_w, nw_ok = _tile_rows(
            mt, nt, tile_expert_ptr, tile_row_ptr, offsets_ptr, sorted_slot_ptr, n_out, gate_mult, up_off, TOPK,
            GATHER, ACTIVATION, BLOCK_M, BLOCK_N, LX, LW)
        we = e.to(gl.int64)
        wbase = w_ptr + we * stride_we
        sbase = sc_ptr + we * stride_se
        # the whole ring's first STAGES - 1 steps in flight before the row exponents are formed
        for st in gl.static_range(STAGES - 1):
            _issue_step(x_ring, w_ring, st, x_ptr, tok, rx_ok, wbase, rg_w, ru_w, nw_ok, st * BLOCK_K, k, k_blocks,
                        ACTIVATION, BLOCK_K, LX, LW)
        s_g = _scales(sbase, rg_w, nw_ok, 0, k_blocks, BLOCK_K, LW)
        s_u = s_g
        if ACTIVATION != 0:
            s_u = _scales(sbase, ru_w, nw_ok, 0, k_blocks, BLOCK_K, LW)
        g_g, g_u = _tile_exponents(sbase, nt, n_out, k_blocks, gate_mult, up_off, ACTIVATION, BLOCK_N, LR)
        LG: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))
        g3_g = gl.expand_dims(gl.expand_dims(gl.convert_layout(g_g, LG), 1), 2)
        g3_u = gl.expand_dims(gl.expand_dims(gl.convert_layout(g_u, LG), 1), 2)

        acc_g = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, ACC)
        acc_u = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, ACC)
        for ki in range(0, n_k):
            slot = ki % STAGES
            buf = ki % 2
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            s_g_cur = s_g
            s_u_cur = s_u
            s_g = _scales(sbase, rg_w, nw_ok, (ki + 1) * BLOCK_K, k_blocks, BLOCK_K, LW)
            if ACTIVATION != 0:
                s_u = _scales(sbase, ru_w, nw_ok, (ki + 1) * BLOCK_K, k_blocks, BLOCK_K, LW)
            if (PROBE & 2) == 0:
                _decode_step(w_ring, dec, slot, buf, s_g_cur, s_u_cur, g3_g, g3_u, ACTIVATION, SPLIT, BLOCK_N, BLOCK_K,
                             LW)
            elif ki < 2:
                _decode_step(w_ring, dec, slot, buf, s_g_cur, s_u_cur, g3_g, g3_u, ACTIVATION, SPLIT, BLOCK_N, BLOCK_K,
                             LW)
            acc_g, acc_u = _mma_step(x_ring, dec, slot, buf, acc_g, acc_u, ACTIVATION, (PROBE & 1) == 0)
            # the MMAs of step ki - 1 are done in every warpgroup: its ring slot and decode buffer are free
            gl.thread_barrier()
            nxt = ki + STAGES - 1
            _issue_step(x_ring, w_ring, nxt % STAGES, x_ptr, tok, rx_ok, wbase, rg_w, ru_w, nw_ok, nxt * BLOCK_K, k,
                        k_blocks, ACTIVATION, BLOCK_K, LX, LW)
        acc_g, acc_u = _mma_drain(acc_g, acc_u, ACTIVATION)
        async_copy.wait_group(0)
        gl.thread_barrier()

        _epilogue(acc_g, acc_u, g_g, g_u, row0, row_end, nt, we, xs_ptr, sorted_slot_ptr, bias_ptr, stride_be, out_ptr,
                  stride_o, n_out, gate_mult, up_off, alpha, limit, TOPK, GATHER, ACTIVATION, HAS_BIAS, BLOCK_M,
                  BLOCK_N, ACC)


@gluon.jit
def _ws_load_partition(x_ring, w_ring, s_ring, ready, empty, x_ptr, w_ptr, sc_ptr, stride_we, stride_se,
                       sorted_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, tile_start_ptr, e_lo, e_hi, n_out,
                       k, k_blocks, gate_mult, up_off, TOPK: gl.constexpr, GATHER: gl.constexpr,
                       ACTIVATION: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """Loader partition (LOAD_WARPS warps, no MMA, no fence): per K step waits for the ring slot to be free
    (``empty``), issues the cp.async of the activation rows and packed bytes, copies the step's E8M0 scales
    through registers into ``s_ring``, and signals ``ready`` once the copies have landed (cp.async arrive)
    and the scales are stored (one plain arrive after a partition barrier)."""
    LX: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [LOAD_WARPS, 1], [1, 0])
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [LOAD_WARPS, 1, 1], [2, 1, 0])
    NW: gl.constexpr = 2 if ACTIVATION != 0 else 1
    m_lo, n_m, n_n, n_k = _work_shape(tile_start_ptr, e_lo, e_hi, n_out, k, BLOCK_N, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), n_m * n_n, gl.num_programs(0)):
        mt, nt = _tile_coords(tile, m_lo, n_m, n_n, GROUP_M)
        e, row0, row_end, tok, rx_ok, rg_w, ru_w, nw_ok = _tile_rows(
            mt, nt, tile_expert_ptr, tile_row_ptr, offsets_ptr, sorted_slot_ptr, n_out, gate_mult, up_off, TOPK,
            GATHER, ACTIVATION, BLOCK_M, BLOCK_N, LX, LW)
        we = e.to(gl.int64)
        wbase = w_ptr + we * stride_we
        sbase = sc_ptr + we * stride_se
        for ki in range(0, n_k):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            _issue_step(x_ring, w_ring, slot, x_ptr, tok, rx_ok, wbase, rg_w, ru_w, nw_ok, ki * BLOCK_K, k, k_blocks,
                        ACTIVATION, BLOCK_K, LX, LW, False)
            s_ring.index(NW * slot).store(_scales(sbase, rg_w, nw_ok, ki * BLOCK_K, k_blocks, BLOCK_K, LW))
            if ACTIVATION != 0:
                s_ring.index(NW * slot + 1).store(_scales(sbase, ru_w, nw_ok, ki * BLOCK_K, k_blocks, BLOCK_K, LW))
            async_copy.mbarrier_arrive(ready.index(slot))
            gl.thread_barrier()
            mbarrier.arrive(ready.index(slot), count=1)
            it += 1


@gluon.jit
def _ws_mma_partition(x_ring, w_ring, s_ring, dec, ready, empty, xs_ptr, sc_ptr, stride_se, bias_ptr, stride_be,
                      out_ptr, stride_o, sorted_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, tile_start_ptr,
                      e_lo, e_hi, n_out, k, k_blocks, gate_mult, up_off, alpha, limit, TOPK: gl.constexpr,
                      GATHER: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Default partition (the MMA warpgroups): per K step waits for ``ready``, decodes the ring slot into a
    decode buffer, fences, issues the wgmma pair asynchronously, waits for the previous step's pair and frees
    its slot (``empty``); no global loads in the K loop. Epilogue as ``fold_gemm_kernel``'s."""
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    LG: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))
    NW: gl.constexpr = 2 if ACTIVATION != 0 else 1
    m_lo, n_m, n_n, n_k = _work_shape(tile_start_ptr, e_lo, e_hi, n_out, k, BLOCK_N, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), n_m * n_n, gl.num_programs(0)):
        mt, nt = _tile_coords(tile, m_lo, n_m, n_n, GROUP_M)
        e = gl.load(tile_expert_ptr + mt)
        row0 = gl.load(tile_row_ptr + mt)
        row_end = gl.load(offsets_ptr + e + 1)
        we = e.to(gl.int64)
        sbase = sc_ptr + we * stride_se
        g_g, g_u = _tile_exponents(sbase, nt, n_out, k_blocks, gate_mult, up_off, ACTIVATION, BLOCK_N, LR)
        g3_g = gl.expand_dims(gl.expand_dims(gl.convert_layout(g_g, LG), 1), 2)
        g3_u = gl.expand_dims(gl.expand_dims(gl.convert_layout(g_u, LG), 1), 2)
        acc_g = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, ACC)
        acc_u = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, ACC)
        for ki in range(0, n_k):
            slot = it % STAGES
            buf = it % 2
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            s_g = s_ring.index(NW * slot).load(gl.SliceLayout(2, LW))
            s_u = s_g
            if ACTIVATION != 0:
                s_u = s_ring.index(NW * slot + 1).load(gl.SliceLayout(2, LW))
            _decode_step(w_ring, dec, slot, buf, s_g, s_u, g3_g, g3_u, ACTIVATION, SPLIT, BLOCK_N, BLOCK_K, LW)
            acc_g, acc_u = _mma_step(x_ring, dec, slot, buf, acc_g, acc_u, ACTIVATION)
            # step it - 1's MMAs are done in both warpgroups: its ring slot goes back to the loader
            gl.thread_barrier()
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ki > 0)
            it += 1
        acc_g, acc_u = _mma_drain(acc_g, acc_u, ACTIVATION)
        gl.thread_barrier()
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        _epilogue(acc_g, acc_u, g_g, g_u, row0, row_end, nt, we, xs_ptr, sorted_slot_ptr, bias_ptr, stride_be, out_ptr,
                  stride_o, n_out, gate_mult, up_off, alpha, limit, TOPK, GATHER, ACTIVATION, HAS_BIAS, BLOCK_M,
                  BLOCK_N, ACC)


@gluon.jit
def fold_gemm_ws_kernel(
    x_ptr, xs_ptr, w_ptr, sc_ptr, stride_we, stride_se, bias_ptr, stride_be, out_ptr, stride_o,
    sorted_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, tile_start_ptr,
    e_lo, e_hi, n_out, k, k_blocks, gate_mult, up_off, alpha, limit,
    TOPK: gl.constexpr, GATHER: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
    SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``fold_gemm_kernel``'s GEMM (same arguments, same result bit for bit) warp-specialized: a loader
    partition of LOAD_WARPS warps (LOAD_REGS registers a thread) fills the STAGES-deep ring (activation rows,
    packed bytes, E8M0 scales [NW * STAGES, BLOCK_N, BLOCK_K/32]) and the num_warps MMA warps decode, fence
    and multiply. Ring hand-off: mbarriers ``ready`` (copies landed) and ``empty`` (slot's MMAs done), one
    of each a slot. Launch with maxnreg so that num_warps + LOAD_WARPS (rounded up to 4) warps fit."""
    X_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    W_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    RAW_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    NW: gl.constexpr = 2 if ACTIVATION != 0 else 1
    x_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], X_SL)
    w_ring = gl.allocate_shared_memory(gl.uint8, [NW * STAGES, BLOCK_N, BLOCK_K // 32, 16], RAW_SL)
    s_ring = gl.allocate_shared_memory(gl.uint8, [NW * STAGES, BLOCK_N, BLOCK_K // 32],
                                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    dec = gl.allocate_shared_memory(gl.float8e4nv, [2 * NW, BLOCK_N, BLOCK_K], W_SL)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_ws_mma_partition, (x_ring, w_ring, s_ring, dec, ready, empty, xs_ptr, sc_ptr, stride_se, bias_ptr,
                             stride_be, out_ptr, stride_o, sorted_slot_ptr, offsets_ptr, tile_expert_ptr,
                             tile_row_ptr, tile_start_ptr, e_lo, e_hi, n_out, k, k_blocks, gate_mult, up_off, alpha,
                             limit, TOPK, GATHER, ACTIVATION, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                             STAGES, num_warps)),
        (_ws_load_partition, (x_ring, w_ring, s_ring, ready, empty, x_ptr, w_ptr, sc_ptr, stride_we, stride_se,
                              sorted_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, tile_start_ptr, e_lo,
                              e_hi, n_out, k, k_blocks, gate_mult, up_off, TOPK, GATHER, ACTIVATION, BLOCK_M,
                              BLOCK_N, BLOCK_K, GROUP_M, STAGES, LOAD_WARPS)),
    ], [LOAD_WARPS], [LOAD_REGS])


WS_LOAD_WARPS, WS_LOAD_REGS, WS_MAXNREG = 4, 88, 168
"""The warp-specialized kernel's loader (warps, registers a thread) and the launch's register cap: 12 warps
(8 MMA + 4 loader) x 168 = 64,512 of the SM's 65,536 registers; the MMA warps then run at 208 registers
(``setmaxnreg``). Picked on CPU (sm_90 compile, 2026-12-01): a 40 / 56 / 72-register loader spills in its
K loop, 88 does not, and the MMA K loop spills at none of them."""

GLUON_PTRS = {"x_ptr": "fp8e4nv", "xs_ptr": "fp32", "w_ptr": "u8", "sc_ptr": "u8", "bias_ptr": "bf16",
              "out_ptr": "bf16", "sorted_slot_ptr": "i32", "offsets_ptr": "i32", "tile_expert_ptr": "i32",
              "tile_row_ptr": "i32", "tile_start_ptr": "i32"}
"""Pointer arguments of ``fold_gemm_kernel`` and their element types (for an ahead-of-time compile)."""


def compile_sm90(const: dict, num_warps: int = 8, maxnreg: int = 0):
    """``fold_gemm_kernel`` (or ``fold_gemm_ws_kernel`` when ``const`` holds LOAD_WARPS) compiled for sm_90
    (CUDA 9.0 target) on any machine, with the constexprs ``const`` (all of TOPK, GATHER, ACTIVATION, HAS_BIAS,
    SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES; the ws kernel also LOAD_WARPS, LOAD_REGS) and a register
    cap ``maxnreg`` (0: none): the CPU test of the configs shipped. Returns the compiled kernel (``.asm``,
    ``.n_regs``, ``.n_spills`` after ``.init_handles()`` only on a GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kern = fold_gemm_ws_kernel if "LOAD_WARPS" in const else fold_gemm_kernel
    const = dict({} if "LOAD_WARPS" in const else {"PROBE": 0}, **const, num_warps=num_warps)
    sig = {n: ("constexpr" if n in const else "*" + GLUON_PTRS[n] if n in GLUON_PTRS
               else "fp32" if n in ("alpha", "limit") else "i32") for n in kern.arg_names}
    div16 = set(GLUON_PTRS) | {"stride_we", "stride_se", "stride_o", "k", "n_out"}
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in kern.arg_names if n in div16}
    src = GluonASTSource(kern, sig, constexprs=const, attrs=attrs)
    opts = dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def fold_gemm(x, x_scale, op, perm, tiles, out, *, top_k: int, gather: bool, activation: int, n_out: int,
              e_lo: int, e_hi: int, gate_mult: int, up_off: int, alpha: float, limit: float, cfg,
              grid: tuple[int]) -> torch.Tensor:
    """One grouped GEMM launch of ``fold_gemm_kernel`` (or its warp-specialized form) with the arguments
    ``moe_gemm`` worked out (op: a ``moe_gemm.folded_operand``, x e4m3 [rows, K] contiguous with fp32 per-row
    scales x_scale [rows]; experts e_lo..e_hi; gate_mult / up_off: the gate and up rows' layout; cfg:
    block_m / block_n / block_k / group_m / num_warps / num_stages / gluon_ws / probe; grid: (programs,)). out
    bf16 [S, n_out], sorted order. Bytes per tile and step: BLOCK_M * BLOCK_K (x) + (1 or 2) * BLOCK_N * BLOCK_K *
    17/32 (MXFP4); FLOPs 2 * S * N * K."""
    bias = op.bias if op.bias is not None else out
    args = (x, x_scale, op.w, op.sc, op.stride_we, op.stride_se, bias, bias.stride(0) if op.bias is not None else 0,
            out, out.stride(0), perm.sorted_slot, perm.expert_offsets, tiles.tile_expert, tiles.tile_row,
            tiles.tile_start, e_lo, e_hi, n_out, op.k, op.k // 32, gate_mult, up_off, float(alpha), float(limit))
    const = dict(TOPK=top_k, GATHER=gather, ACTIVATION=activation, HAS_BIAS=op.bias is not None, SPLIT=op.mode == 6,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    if cfg.gluon_ws:
        fold_gemm_ws_kernel[grid](*args, LOAD_WARPS=WS_LOAD_WARPS, LOAD_REGS=WS_LOAD_REGS, maxnreg=WS_MAXNREG,
                                  **const)
    else:
        fold_gemm_kernel[grid](*args, PROBE=cfg.probe, **const)
    return out


def sm90_report(const: dict, num_warps: int = 8, maxnreg: int = 0) -> dict:
    """``compile_sm90`` plus ``ptxas -v`` (Triton's bundled ptxas): registers per thread, spill bytes
    (stores + loads), shared memory bytes, and the ``wgmma.wait_group`` counts in the PTX (a pending count
    of 1 or 2 in the K loop: the MMAs stay in flight across the next step's decode). Needs the compiler,
    not the interpreter (run with TRITON_INTERPRET unset)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    ck = compile_sm90(const, num_warps, maxnreg)
    ptx = ck.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
        info = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(Path(d) / "k.ptx"), "-o",
                               str(Path(d) / "k.cubin")], capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)),
        "shared_bytes": ck.metadata.shared,
        "wgmma_waits": sorted(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)),
    }


if __name__ == "__main__":
    # python -m adapt.kernels.moe_gluon '[[{constexprs}, warps(, maxnreg)], ...]' -> one JSON report per line
    import json
    import sys

    for const, warps, *cap in json.loads(sys.argv[1]):
        print(json.dumps(dict(sm90_report(const, warps, *cap), const=const, num_warps=warps)), flush=True)
