"""Probe: the planar MXFP4 grouped GEMM's K loop written in Gluon (triton 3.6), beside the tl kernel.

Not wired into adapt: a measurement of whether explicit layouts and async wgmma move the small-T GEMMs.
Scope: DeepSeek-V3-like GEMMs (K a multiple of 256, so steps come in pairs), one-multiply scales, no split, no
bias, bf16 output in sorted order (``moe_planar._planar_gemm_kernel`` with ACTIVATION 0, SPLIT_K 1); GATHER
(GEMM1: x row = token of the slot) or sorted x (GEMM2).

Kernel: one program per (m-tile, n-tile), tokens on the MMA's N (BLOCK_M = 8 or 16), weight rows on M (64 a
warpgroup). Per 128-K step each thread loads its packed words straight into registers in the wgmma
A-operand order (two steps ahead of the MMA, unrolled by two), decodes each K plane of 16 into one
bf16x2 register per word (``moe_planar._plane_ptx``, the tl kernel's PTX), and issues eight async
m64nBLOCK_Mk16 wgmma (A from registers, B = the x step staged in shared memory), keeping one step in flight.

Usage: CPU (compile for sm_90 and count SASS): PYTHONPATH=. python gluon_probe.py compile
       H200: PYTHONPATH=. python gluon_probe.py bench OUT_JSON
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from adapt.kernels import moe_planar as mp

_ASM = [[gl.constexpr(mp._plane_ptx(p, False, h)) for h in (False, True)] for p in range(4)]
_A0L, _A1L, _A2L, _A3L = (_ASM[p][0] for p in range(4))
_A0H, _A1H, _A2H, _A3H = (_ASM[p][1] for p in range(4))


@gluon.jit
def _dec(w2, f2, ASM: gl.constexpr):
    """One K plane: words (each twice) int32 [BN, 16] and factor pairs int32 [BN, 16] -> bf16 [BN, 16] by the
    plane's PTX (``_A<p><L|H>``: plane p, low or high factor of the pair)."""
    return gl.inline_asm_elementwise(ASM, "=r,r,r,r,r", [w2, f2], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _twice(v, BLOCK_N: gl.constexpr, A_L: gl.constexpr):
    """int32 [BN, 8] -> [BN, 16] with column 2c + s = v[:, c] (the pair layout of the A operand)."""
    return gl.convert_layout(gl.reshape(gl.join(v, v), [BLOCK_N, 16]), A_L, assert_trivial=True)


@gluon.jit
def _step(w0, w1, s4, xs, acc, BLOCK_N: gl.constexpr, A_L: gl.constexpr):
    """Eight async wgmma of one 128-K step: plane j = 4h + p of half h (words w0 / w1 [BN, 8]) against
    rows 16j..16j+15 of the step's x^T in shared memory (xs: [BLOCK_M, 128] bf16)."""
    u = s4.to(gl.uint32, bitcast=True)
    fe = ((u << 7) & 0x7F807F80).to(gl.int32, bitcast=True)  # blocks 0 (low) and 2 (high)
    fo = (((u >> 8) << 7) & 0x7F807F80).to(gl.int32, bitcast=True)  # blocks 1 and 3
    fe2 = _twice(gl.broadcast(fe[:, None], w0)[0], BLOCK_N, A_L)
    fo2 = _twice(gl.broadcast(fo[:, None], w0)[0], BLOCK_N, A_L)
    a0 = _twice(w0, BLOCK_N, A_L)
    a1 = _twice(w1, BLOCK_N, A_L)
    xt = xs.permute((1, 0))
    acc = warpgroup_mma(_dec(a0, fe2, _A0L), xt.slice(0, 16, 0), acc, is_async=True)
    acc = warpgroup_mma(_dec(a0, fe2, _A1L), xt.slice(16, 16, 0), acc, is_async=True)
    acc = warpgroup_mma(_dec(a0, fo2, _A2L), xt.slice(32, 16, 0), acc, is_async=True)
    acc = warpgroup_mma(_dec(a0, fo2, _A3L), xt.slice(48, 16, 0), acc, is_async=True)
    acc = warpgroup_mma(_dec(a1, fe2, _A0H), xt.slice(64, 16, 0), acc, is_async=True)
    acc = warpgroup_mma(_dec(a1, fe2, _A1H), xt.slice(80, 16, 0), acc, is_async=True)
    acc = warpgroup_mma(_dec(a1, fo2, _A2H), xt.slice(96, 16, 0), acc, is_async=True)
    acc = warpgroup_mma(_dec(a1, fo2, _A3H), xt.slice(112, 16, 0), acc, is_async=True)
    return acc


@gluon.jit
def _gl_planar_kernel(
    x_ptr, stride_x, w_ptr, sc_ptr, stride_we, stride_se, out_ptr, stride_o,
    sorted_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, tile_start_ptr,
    n_experts, n_rows, k_words, k_steps,
    TOPK: gl.constexpr, GATHER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LATE: gl.constexpr = False,
):
    # the A operand of m64 wgmma, 4 warps: lane l holds rows l // 4 (+ 8) of its warp's 16, K pairs 2 (l % 4) (+ 8)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    # words of one half step [BN, 8] (c = 4 posb + t): the same threads and rows, c = t on lanes, posb in registers
    if BLOCK_N == 64:
        W_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[8, 0], [0, 4]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, 8])
    else:
        W_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[8, 0], [0, 4], [64, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, 8])
    R_L: gl.constexpr = gl.SliceLayout(1, W_L)
    X_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 4], [1, 0])
    XS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.bfloat16)

    pid = gl.program_id(0)
    n_n = gl.cdiv(n_rows, BLOCK_N)
    mt = pid // n_n
    nt = pid % n_n
    n_m = gl.load(tile_start_ptr + n_experts)
    if mt < n_m:
        e = gl.load(tile_expert_ptr + mt)
        row0 = gl.load(tile_row_ptr + mt)
        row_end = gl.load(offsets_ptr + e + 1)
        # x rows of the tile (tokens with GATHER, else sorted positions), in X_L
        xr = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_L))
        xr_ok = xr < row_end
        if GATHER:
            xtok = gl.load(sorted_slot_ptr + xr, mask=xr_ok, other=0) // TOPK
        else:
            xtok = xr
        xcol = gl.arange(0, 128, layout=gl.SliceLayout(0, X_L))
        xp = x_ptr + xtok.to(gl.int64)[:, None] * stride_x + xcol[None, :]
        xm = xr_ok[:, None] & (xcol < 128)[None, :]
        # weight rows of the tile in W_L (clamped: no masks on the loads)
        n = nt * BLOCK_N + gl.arange(0, BLOCK_N, layout=R_L)
        nc = gl.minimum(n, n_rows - 1).to(gl.int64)
        wrow = w_ptr + e.to(gl.int64) * stride_we + (nc // 64) * (k_words * 64) + (nc % 64) * 16
        srow = sc_ptr + e.to(gl.int64) * stride_se + (nc // 64) * (k_steps * 64) + (nc % 64)
        c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, W_L))
        wp = wrow[:, None] + c8[None, :]

        xs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, 128], XS_L)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        steps = k_steps
        # steps st, st + 1 in registers, st + 2, st + 3 loading
        wa0 = gl.load(wp)
        wa1 = gl.load(wp + 8)
        sa = gl.load(srow)
        xa = gl.load(xp, mask=xm, other=0.0)
        wb0 = gl.load(wp + 1024)
        wb1 = gl.load(wp + 1024 + 8)
        sb = gl.load(srow + 64)
        xb = gl.load(xp + 128, mask=xm, other=0.0)
        for st in range(0, steps, 2):
            nxt = gl.minimum(st + 2, steps - 2)
            if LATE:  # each step's registers reloaded right after its wgmma are issued: two steps live, not four
                xs.index(0).store(xa)
                fence_async_shared()
                gl.thread_barrier()
                acc = _step(wa0, wa1, sa, xs.index(0), acc, BLOCK_N, A_L)
                wa0 = gl.load(wp + nxt * 1024)
                wa1 = gl.load(wp + nxt * 1024 + 8)
                sa = gl.load(srow + nxt * 64)
                xa = gl.load(xp + nxt * 128, mask=xm, other=0.0)
                acc = warpgroup_mma_wait(num_outstanding=8, deps=(acc,))
                xs.index(1).store(xb)
                fence_async_shared()
                gl.thread_barrier()
                acc = _step(wb0, wb1, sb, xs.index(1), acc, BLOCK_N, A_L)
                wb0 = gl.load(wp + nxt * 1024 + 1024)
                wb1 = gl.load(wp + nxt * 1024 + 1024 + 8)
                sb = gl.load(srow + nxt * 64 + 64)
                xb = gl.load(xp + nxt * 128 + 128, mask=xm, other=0.0)
                acc = warpgroup_mma_wait(num_outstanding=8, deps=(acc,))
            else:
                na0 = gl.load(wp + nxt * 1024)
                na1 = gl.load(wp + nxt * 1024 + 8)
                nsa = gl.load(srow + nxt * 64)
                nxa = gl.load(xp + nxt * 128, mask=xm, other=0.0)
                nb0 = gl.load(wp + nxt * 1024 + 1024)
                nb1 = gl.load(wp + nxt * 1024 + 1024 + 8)
                nsb = gl.load(srow + nxt * 64 + 64)
                nxb = gl.load(xp + nxt * 128 + 128, mask=xm, other=0.0)
                # step st: the x buffer 0 was read by step st - 2, whose wgmma completed at the wait below
                xs.index(0).store(xa)
                fence_async_shared()
                gl.thread_barrier()
                acc = _step(wa0, wa1, sa, xs.index(0), acc, BLOCK_N, A_L)
                acc = warpgroup_mma_wait(num_outstanding=8, deps=(acc,))
                xs.index(1).store(xb)
                fence_async_shared()
                gl.thread_barrier()
                acc = _step(wb0, wb1, sb, xs.index(1), acc, BLOCK_N, A_L)
                acc = warpgroup_mma_wait(num_outstanding=8, deps=(acc,))
                wa0, wa1, sa, xa = na0, na1, nsa, nxa
                wb0, wb1, sb, xb = nb0, nb1, nsb, nxb
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        on = nt * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        om = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        optr = out_ptr + om.to(gl.int64)[None, :] * stride_o + on[:, None]
        gl.store(optr, acc.to(gl.bfloat16), mask=(on < n_rows)[:, None] & (om < row_end)[None, :])


def gl_planar_gemm(x, w: mp.PlanarMXFP4, perm, tiles, out, *, top_k: int, gather: bool, block_m: int, block_n: int,
                   num_warps: int = 4, maxnreg: int = 0, late: bool = False):
    """``planar_gemm`` (activation 0, no bias, no split) through the Gluon kernel."""
    assert w.k % 256 == 0 and not w.two_muls and num_warps == 4
    e, n_rows, k_words = w.words.shape[0], w.n, w.k_padded // 8
    n_n = triton.cdiv(n_rows, block_n)
    _gl_planar_kernel[(tiles.max_tiles * n_n,)](
        x, x.stride(0), w.words, w.scales.view(torch.int32), w.words.stride(0), w.scales.stride(0) // 4,
        out, out.stride(0), perm.sorted_slot, perm.expert_offsets, tiles.tile_expert, tiles.tile_row,
        tiles.tile_start, e, n_rows, k_words, k_words // 16,
        TOPK=top_k, GATHER=gather, BLOCK_M=block_m, BLOCK_N=block_n, LATE=late, num_warps=num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return out


VARIANTS = ((8, 64, 0, True), (8, 64, 128, True))
"""(BLOCK_M, BLOCK_N, register cap) of the Gluon kernel timed (sm_90 on CPU: 164 / 138 registers uncapped, no
spill; the 128 cap spills 256 / 108 bytes; BLOCK_N 128 needs 255 registers and spills)."""


def compile_check(configs=VARIANTS) -> list[dict]:
    """Compile for sm_90 on this machine (no GPU) and count the SASS (``sass_report.report``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/moe: sass_report
    from sass_report import report

    ptrs = dict(x_ptr="bf16", w_ptr="i32", sc_ptr="i32", out_ptr="bf16", sorted_slot_ptr="i32", offsets_ptr="i32",
                tile_expert_ptr="i32", tile_row_ptr="i32", tile_start_ptr="i32")
    div16 = ("stride_x", "stride_we", "stride_se", "stride_o", "k_words", "n_rows")
    kern = _gl_planar_kernel
    res = []
    for bm, bn, cap, late in configs:
        const = dict(TOPK=8, GATHER=True, BLOCK_M=bm, BLOCK_N=bn, LATE=late)
        sig = {n: ("constexpr" if n in const else "*" + ptrs[n] if n in ptrs else "i32") for n in kern.arg_names}
        attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in kern.arg_names
                 if n in ptrs or n in div16}
        opts = dict(num_warps=4, **({"maxnreg": cap} if cap else {}))
        ck = triton.compile(GluonASTSource(kern, sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=opts)
        r = report(ck, cap)
        r["config"] = {"BLOCK_M": bm, "BLOCK_N": bn, "cap": cap, "LATE": late}
        res.append(r)
        print(json.dumps(r), flush=True)
    return res


def _layer(e, n, kk, dev):
    """Random MXFP4 codes and one-multiply scales (E8M0 118..125) for e experts [n, kk] -> planar."""
    packed = torch.randint(0, 256, (e, n, kk // 2), dtype=torch.uint8, device=dev)
    scales = torch.randint(118, 126, (e, n, kk // 32), dtype=torch.uint8, device=dev)
    return mp.planar_from_mxfp4(packed, scales)


def bench(out_json: str) -> None:
    """H200, DeepSeek-V3 GEMM1 (raw gate/up rows, gathered x) and GEMM2 (sorted x), top-8 uniform routing.
    Correctness: 16 experts, T = 4, the Gluon kernel and the tl kernel against the twin (``planar_gemm_torch``).
    Timing: 256 experts, T = 1 (8 active), beside the tl kernel with the table's tile (CUDA-graph medians)."""
    from adapt.bench.timer import graph_time_us
    from adapt.kernels import routing as rt
    from adapt.kernels.moe_configs import pick_planar_configs
    from adapt.kernels.moe_tiles import max_m_tiles, tile_map

    torch.manual_seed(0)
    dev = "cuda"
    k, h, inter = 8, 7168, 2048
    rows = []
    for name, n, kk, gather in (("gemm1", 2 * inter, h, True), ("gemm2", h, inter, False)):
        for e, t, timed in ((16, 4, False), (256, 1, True)):
            w = _layer(e, n, kk, dev)
            ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]).int()
            perm = rt.permute_by_expert(ids, e)
            s = t * k
            x = (torch.randn(t if gather else s, kk, device=dev) * 0.5).bfloat16()
            c1, c2 = pick_planar_configs(s, e, torch.cuda.get_device_name(), h, inter)
            cfg = c1 if gather else c2
            tl_out = torch.empty(s, n, dtype=torch.bfloat16, device=dev)
            tl_tiles = tile_map(perm.expert_offsets, cfg.block_m, max_m_tiles(s, e, cfg.block_m))
            run_tl = partial(mp.planar_gemm, x, w, None, perm, tl_tiles, tl_out, top_k=k, gather=gather,
                             activation=0, alpha=1.0, limit=0.0, cfg=cfg)
            ref = run_tl().float()
            row = {"gemm": name, "experts": e, "tokens": t, "tl_config": str(cfg)}
            if timed:
                row["tl_us"] = graph_time_us(run_tl)
            else:
                twin = torch.empty(s, n, dtype=torch.bfloat16, device=dev)
                mp.planar_gemm_torch(x, w, None, perm, None, twin, top_k=k, gather=gather, activation=0, alpha=1.0,
                                     limit=0.0)
                ref = twin.float()
                row["tl_vs_twin"] = float((tl_out.float() - ref).norm() / ref.norm())
            for bm, bn, cap, late in VARIANTS:
                tag = f"gl_{bm}x{bn}c{cap}" + ("_late" if late else "")
                g_out = torch.zeros(s, n, dtype=torch.bfloat16, device=dev)
                g_tiles = tile_map(perm.expert_offsets, bm, max_m_tiles(s, e, bm))
                try:
                    run_gl = partial(gl_planar_gemm, x, w, perm, g_tiles, g_out, top_k=k, gather=gather, block_m=bm,
                                     block_n=bn, maxnreg=cap, late=late)
                    got = run_gl().float()
                    torch.cuda.synchronize()
                    row[tag + ("_vs_tl" if timed else "_vs_twin")] = float((got - ref).norm() / ref.norm())
                    if timed:
                        row[tag + "_us"] = graph_time_us(run_gl)
                except Exception as exc:  # noqa: BLE001 - recorded
                    row[tag + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            del w
            torch.cuda.empty_cache()
    with open(out_json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_check()
    else:
        bench(sys.argv[2])
