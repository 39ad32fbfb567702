"""The shared FP8 expert workspace: online MXFP4 -> e4m3 conversion of only the active experts.

One ``FP8Workspace`` serves every MoE layer of a model: a layer's experts are processed in chunks
of ``chunk_experts``; the experts of a chunk that have tokens are converted (per-row exponent fold,
the rule of ``mxfp4.mxfp4_to_fp8(group_k=None)``) into one of two slot buffers, then that chunk's
GEMMs run. ``schedule`` orders the two: "serial" (default: the fastest on the H200 at T = 16384,
benchmarks/moe/2026-11-30-s2 call 5) on one stream with the offline path's persistent GEMMs;
"side" converts chunk c+1 on a side stream while chunk c's GEMMs run one program per tile; "split"
does the same with persistent GEMMs on a high-priority stream that leave ``reserve_sms`` SMs to the
conversion; "cohabit" caps the persistent GEMMs' registers (``gemm_maxnreg``) so that a few persistent
conversion programs an SM (``convert_programs_per_sm``) fit beside them. None overlapped (call 5: online =
conversion + GEMMs): the fp8 GEMM tiles at large T take an SM's whole register file (GEMM1 255 registers x
256 threads, sm_90 compile), and under a cap (benchmarks/moe/2026-12-02-s15) cohabit was 1.73-2.59x offline
against the serial 1.37x. That record takes it apart on the H200. Blocks of another kernel share SMs with the
GEMM programs only when their shared-memory carveout is set to the maximum. Even then any kernel that moves
memory beside the GEMMs adds about its own time to the pair: the conversion, a plain copy at 1-3 programs an
SM, a copy throttled to 1.57 TB/s, a copy with L2 streaming hints. Its size follows the experts computed at
once (2 * chunk_experts), never the expert count; ``online_memory_ratio`` gives the model's bound.

    ws = FP8Workspace(chunk_experts=16, hidden=7168, intermediate=2048, device="cuda")
    y = expert_mlp(hidden, perm, weights, top_k=8, workspace=ws)   # or moe_forward(..., workspace=ws)
    ws.nbytes            # bytes held
    ws.record_fold_loss(weights)   # once, at load time: count elements the e4m3 fold cannot hold
    ws.lost              # int64 [1] on the device: elements that lost bits (recorded layers)

The source is the layer's ``MoEWeights`` or its ``PlanarExperts`` (``moe_planar.planar_to_fp8``
writes the same bytes, GEMM1's rows gate/up interleaved, so the GEMMs read them with
``interleaved=True``). That conversion measured 1.7x the word conversion's time on the H200
(benchmarks/moe/2026-12-02-s11), so the runtime's layers with a workspace keep ``MoEWeights``.

The per-step conversion does no loss counting (``count_loss=False``, the default): the fold of a
layer is fixed by its weights, so its loss is counted once by ``record_fold_loss``.

Buffers: w1 e4m3 [2C, 2I, H], w1_exp int32 [2C, 2I], w2 e4m3 [2C, H, I], w2_exp int32 [2C, H].
Conversion kernel bytes per active expert: reads 3*H*I*17/32 (+ the scales once more for the row
exponent), writes 3*H*I + 4*(2I + H). One program converts BLOCK_R whole rows of one expert,
BLOCK_B 32-blocks per step; each 32-block (16 packed bytes) is four 32-bit words decoded with
integer ops, 8 codes per lane, into 32 e4m3 bytes (``mxfp4.e2m1_words_to_e4m3``).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels.moe_planar import PlanarExperts, planar_to_fp8
from adapt.kernels.mxfp4 import FOLD_WORD_MIN_SHIFT, decode_mxfp4_tile_fp8, e2m1_words_to_e4m3, fold_loss


def workspace_bytes(chunk_experts: int, hidden: int, intermediate: int) -> int:
    """Bytes of an ``FP8Workspace``: two chunks of experts, e4m3 weights + int32 row exponents."""
    per_expert = 3 * hidden * intermediate + 4 * (2 * intermediate + hidden)
    return 2 * chunk_experts * per_expert


@triton.jit
def _convert_experts_kernel(
    packed_ptr,
    scales_ptr,
    out_ptr,
    exp_ptr,
    lost_ptr,
    offsets_ptr,
    e_lo,
    slot_base,
    n_rows,
    k,
    k_bytes,
    k_scales,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (i, rb): expert e_lo + i, rows rb*BLOCK_R.. -> slot slot_base + i (skipped when idle),
    one code per lane, counting the elements the fold cannot hold (load time, ``record_fold_loss``).

    packed uint8 [E, N, K/2], scales uint8 [E, N, K/32] -> out e4m3 [slots, N, K], exp int32 [slots, N].
    k_bytes = K/2 and k_scales = K/32 are passed as integers so their divisibility (16-byte rows)
    is known to the compiler and packed rows load 16 bytes per thread.
    """
    i = tl.program_id(0)
    e = e_lo + i
    if tl.load(offsets_ptr + e + 1) > tl.load(offsets_ptr + e):
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < n_rows
        src = e.to(tl.int64) * n_rows + r
        dst = (slot_base + i).to(tl.int64) * n_rows + r
        gmax = tl.full((BLOCK_R,), -127, tl.int32)
        for c0 in range(0, k_scales, 64):
            cb = c0 + tl.arange(0, 64)
            s = tl.load(
                scales_ptr + src[:, None] * k_scales + cb[None, :],
                mask=rm[:, None] & (cb < k_scales)[None, :],
                other=0,
            )
            gmax = tl.maximum(gmax, tl.max(s.to(tl.int32), axis=1) - 127)
        g = gmax - 6
        tl.store(exp_ptr + dst, g, mask=rm)
        lost = tl.zeros((BLOCK_R,), tl.int32)
        for k0 in range(0, k, BLOCK_K):
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            km = (kb < k_bytes)[None, :]
            p = tl.load(packed_ptr + src[:, None] * k_bytes + kb[None, :], mask=rm[:, None] & km, other=0)
            s = tl.load(
                scales_ptr + src[:, None] * k_scales + ks[None, :],
                mask=rm[:, None] & (ks < k_scales)[None, :],
                other=127,
            )
            v = decode_mxfp4_tile_fp8(p, s, g, BLOCK_R, BLOCK_K)
            kk = k0 + tl.arange(0, BLOCK_K)
            tl.store(out_ptr + dst[:, None] * k + kk[None, :], v, mask=rm[:, None] & (kk < k)[None, :])
            lost += fold_loss(p, s, g, v, BLOCK_R, BLOCK_K)
        tl.atomic_add(lost_ptr, tl.sum(tl.where(rm, lost, 0), axis=0).to(tl.int64))


@triton.jit
def _convert_experts_words_kernel(
    words_ptr,
    packed_ptr,
    scales_ptr,
    out64_ptr,
    out_ptr,
    exp_ptr,
    offsets_ptr,
    e_lo,
    slot_base,
    n_rows,
    k_scales,
    n_items,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MIN_SHIFT: tl.constexpr,
    PERSIST: tl.constexpr = False,
):
    """The conversion hot path, 8 codes per 32-bit lane; program (i, rb) as ``_convert_experts_kernel``.
    PERSIST: a grid of fewer programs, each taking work items w = i * row_blocks + rb in turn (w from
    ``program_id(0)`` up to ``n_items`` by the grid size), so the conversion can run beside the GEMMs
    with a few programs an SM (``FP8Workspace(schedule="cohabit")``).

    words int32 [E, N, K/8] (the packed bytes as words; one 32-block = 4 words = one 16-byte load),
    packed uint8 [E, N, K/2] (same memory), scales uint8 [E, N, K/32] -> out64 int64 [slots, N, K/8]
    (8 e4m3 bytes per word; out_ptr is the same memory as e4m3), exp int32 [slots, N]. A step of
    BLOCK_R rows x BLOCK_B 32-blocks whose fold shifts are all >= MIN_SHIFT is decoded with integer
    ops on words (``e2m1_words_to_e4m3``); any other step takes the per-byte decode (exact rounding).
    K = 32 * k_scales and K/8 = 4 * k_scales are formed here, so the compiler knows the row pitches are
    multiples of 4 words and 32 bytes and keeps 16-byte loads and stores when k_scales is not a multiple
    of 16 (gpt-oss: K = 2880, 90 blocks; passed as integers, K/8 = 360 lost them: 4-byte word loads,
    8-byte stores, sm_90 PTX).
    """
    if PERSIST:
        row_blocks = tl.cdiv(n_rows, BLOCK_R)
        for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
            _convert_word_rows(words_ptr, packed_ptr, scales_ptr, out64_ptr, out_ptr, exp_ptr, offsets_ptr, e_lo,
                               slot_base, n_rows, k_scales, w // row_blocks, w % row_blocks, BLOCK_R, BLOCK_B,
                               MIN_SHIFT)
    else:
        _convert_word_rows(words_ptr, packed_ptr, scales_ptr, out64_ptr, out_ptr, exp_ptr, offsets_ptr, e_lo,
                           slot_base, n_rows, k_scales, tl.program_id(0), tl.program_id(1), BLOCK_R, BLOCK_B,
                           MIN_SHIFT)


@triton.jit
def _convert_word_rows(words_ptr, packed_ptr, scales_ptr, out64_ptr, out_ptr, exp_ptr, offsets_ptr, e_lo, slot_base,
                       n_rows, k_scales, i, rb, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                       MIN_SHIFT: tl.constexpr):
    """Rows [rb * BLOCK_R, (rb + 1) * BLOCK_R) of the chunk's expert i (``_convert_experts_words_kernel``)."""
    k = k_scales * 32
    k_words = k_scales * 4
    e = e_lo + i
    if tl.load(offsets_ptr + e + 1) > tl.load(offsets_ptr + e):
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < n_rows
        src = e.to(tl.int64) * n_rows + r
        dst = (slot_base + i).to(tl.int64) * n_rows + r
        gmax = tl.full((BLOCK_R,), -127, tl.int32)
        for c0 in range(0, k_scales, 64):
            cb = c0 + tl.arange(0, 64)
            s = tl.load(
                scales_ptr + src[:, None] * k_scales + cb[None, :],
                mask=rm[:, None] & (cb < k_scales)[None, :],
                other=0,
            )
            gmax = tl.maximum(gmax, tl.max(s.to(tl.int32), axis=1) - 127)
        g = gmax - 6
        tl.store(exp_ptr + dst, g, mask=rm)
        j = tl.arange(0, 4)
        for b0 in range(0, k_scales, BLOCK_B):
            cb = b0 + tl.arange(0, BLOCK_B)
            bm = rm[:, None] & (cb < k_scales)[None, :]  # [R, B]
            s = tl.load(scales_ptr + src[:, None] * k_scales + cb[None, :], mask=bm, other=0)
            d = tl.where(bm, s.to(tl.int32) - 127 - g[:, None], 0)  # [R, B], <= 6
            if tl.min(tl.min(d, axis=1), axis=0) >= MIN_SHIFT:
                wi = cb[None, :, None] * 4 + j[None, None, :]  # [1, B, 4] word index in the row
                wm = bm[:, :, None]
                w = tl.load(words_ptr + src[:, None, None] * k_words + wi, mask=wm, other=0)
                bias8 = ((d + 6) << 3).to(tl.uint32) * 0x01010101
                lo, hi = e2m1_words_to_e4m3(w.to(tl.uint32, bitcast=True), bias8[:, :, None])
                out = lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)
                tl.store(
                    out64_ptr + dst[:, None, None] * k_words + wi, out.to(tl.int64, bitcast=True), mask=wm
                )
            else:
                kb = b0 * 16 + tl.arange(0, BLOCK_B * 16)
                km = rm[:, None] & (kb < k_scales * 16)[None, :]
                p = tl.load(packed_ptr + src[:, None] * (k_scales * 16) + kb[None, :], mask=km, other=0)
                v = decode_mxfp4_tile_fp8(p, tl.where(bm, s, 127), g, BLOCK_R, BLOCK_B * 32)
                kk = b0 * 32 + tl.arange(0, BLOCK_B * 32)
                tl.store(out_ptr + dst[:, None] * k + kk[None, :], v, mask=rm[:, None] & (kk < k)[None, :])


def convert_experts(
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    exps: torch.Tensor,
    lost: torch.Tensor,
    expert_offsets: torch.Tensor,
    experts: tuple[int, int],
    slot_base: int,
    count_loss: bool = True,
    config: tuple[int, int, int] | None = None,
    programs: int = 0,
    maxnreg: int = 0,
) -> None:
    """Convert experts [lo, hi) that own tokens into slots slot_base + (e - lo) of ``out``/``exps``.

    packed uint8 [E, N, K/2], scales uint8 [E, N, K/32]; out e4m3 [slots, N, K], exps int32 [slots, N].
    count_loss: take the one-code-per-lane kernel that also adds the fold's lost elements to ``lost``
    (load time); otherwise the word kernel (8 codes per 32-bit lane, no counting: the hot path), whose
    program is ``config`` = (rows, 32-blocks per step, warps), ``CONVERT_CONFIG`` when None; programs > 0:
    that many persistent programs take the (expert, row block) items in turn; maxnreg: a register cap.
    """
    lo, hi = experts
    n, k = packed.shape[1], packed.shape[2] * 2
    if count_loss:
        bk = max(32, min(512, triton.next_power_of_2(k)))  # a partial last step is masked
        br = 8 if bk >= 512 else 16
        _convert_experts_kernel[(hi - lo, triton.cdiv(n, br))](
            packed,
            scales,
            out,
            exps,
            lost,
            expert_offsets,
            lo,
            slot_base,
            n,
            k,
            k // 2,
            k // 32,
            BLOCK_R=br,
            BLOCK_K=bk,
            num_warps=4 if bk >= 512 else 2,
        )
        return
    br, bmax, warps = config or CONVERT_CONFIG
    bb = max(1, min(bmax, triton.next_power_of_2(k // 32)))  # 32-blocks per step (16: 512 elements)
    n_items = (hi - lo) * triton.cdiv(n, br)
    grid = (min(programs, n_items),) if programs > 0 else (hi - lo, triton.cdiv(n, br))
    _convert_experts_words_kernel[grid](
        packed.view(torch.int32),
        packed,
        scales,
        out.view(torch.int64),
        out,
        exps,
        expert_offsets,
        lo,
        slot_base,
        n,
        k // 32,
        n_items,
        BLOCK_R=br,
        BLOCK_B=bb,
        MIN_SHIFT=FOLD_WORD_MIN_SHIFT,
        PERSIST=programs > 0,
        maxnreg=maxnreg or None,
        num_warps=warps,
    )


CONVERT_CONFIG = (4, 32, 2)
"""The word conversion's program: 4 rows x 32 32-blocks per step, 2 warps. H200, all experts of a layer at
T = 16384, same process per shape (benchmarks/moe/2026-11-30-s3, call 8, commit 594c7c6): DeepSeek-V3 4,991 us
against 5,419 for the earlier default (4, 16, 2) and 5,066 for (2, 16, 1); gpt-oss-120b 1,543 against 1,827 and
1,682. Before that (2026-11-30-s3-prefill, call 3) (4, 16, 2) replaced (8, 16, 4): 5,342 / 1,809 against 6,119 /
1,921 us; (16, 16, 4) 6,295 / 2,185, 8 warps slower."""

SCHEDULES = ("serial", "side", "split", "cohabit")
"""How ``FP8Workspace.run_layer`` orders conversion and GEMMs (see ``FP8Workspace``; "serial", the default, was the
fastest of the four on the H200)."""


def online_memory_ratio(n_layers: int, n_experts: int, hidden: int, intermediate: int, chunk_experts: int) -> float:
    """Expert memory of the online path over the offline FP8 copy, for a model of ``n_layers`` MoE
    layers of ``n_experts`` experts: (layers x MXFP4 experts as the runtime holds them, the planar layout
    with K padded to 128 and rows to 64, + one shared workspace) / (layers x e4m3 experts with int32 row
    exponents). Biases are left out (the same bytes on both sides)."""
    from adapt.kernels.moe_planar import PLANAR_STEP, ROW_BLOCK

    def padded(n: int, k: int) -> int:
        return -(-n // ROW_BLOCK) * ROW_BLOCK * (-(-k // PLANAR_STEP) * PLANAR_STEP) * 17 // 32

    mx = padded(2 * intermediate, hidden) + padded(hidden, intermediate)
    fp8 = 3 * hidden * intermediate + 4 * (2 * intermediate + hidden)
    ws = workspace_bytes(chunk_experts, hidden, intermediate)
    return (n_layers * n_experts * mx + ws) / (n_layers * n_experts * fp8)


class FP8Workspace:
    """Two chunks of e4m3 expert slots shared by all layers (see the module docstring)."""

    def __init__(
        self,
        chunk_experts: int,
        hidden: int,
        intermediate: int,
        device: str | torch.device,
        count_loss: bool = False,
        schedule: str = "serial",
        reserve_sms: int = 16,
        convert_config: tuple[int, int, int] | None = None,
        planar_config: tuple[int, int, int] | None = None,
        gemm_maxnreg: int = 192,
        convert_programs_per_sm: int = 2,
        convert_maxnreg: int = 0,
    ):
        if chunk_experts < 1:
            raise InputError(f"chunk_experts must be >= 1, got {chunk_experts}", field="chunk_experts")
        if schedule not in SCHEDULES:
            raise InputError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}", field="schedule"
            )
        self.schedule = schedule
        self.reserve_sms = reserve_sms
        self.gemm_maxnreg = gemm_maxnreg
        self.convert_programs_per_sm = convert_programs_per_sm
        self.convert_maxnreg = convert_maxnreg
        self.convert_config = convert_config
        self.planar_config = planar_config
        self.chunk_experts = chunk_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.count_loss = count_loss
        dev = torch.device(device)
        slots = 2 * chunk_experts
        self.w1 = torch.empty(slots, 2 * intermediate, hidden, dtype=torch.float8_e4m3fn, device=dev)
        self.w1_exp = torch.empty(slots, 2 * intermediate, dtype=torch.int32, device=dev)
        self.w2 = torch.empty(slots, hidden, intermediate, dtype=torch.float8_e4m3fn, device=dev)
        self.w2_exp = torch.empty(slots, hidden, dtype=torch.int32, device=dev)
        self.lost = torch.zeros(1, dtype=torch.int64, device=dev)
        cuda = dev.type == "cuda"
        self._side = torch.cuda.Stream(dev) if cuda and schedule != "serial" else None
        # split: the GEMMs on a high-priority stream, so their persistent programs are placed before the
        # conversion's blocks (torch instantiates graphs with per-node priorities)
        self._gemm = torch.cuda.Stream(dev, priority=-1) if cuda and schedule in ("split", "cohabit") else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w1_exp, self.w2, self.w2_exp))

    def record_fold_loss(self, weights) -> int:
        """Count (once, at load time) the elements of ``weights`` (``MoEWeights``) whose e4m3 fold is not exact.

        Converts every expert chunk by chunk with loss counting into the workspace buffers and adds
        the count to ``self.lost``; returns this layer's count. Synchronises with the device.
        """
        if isinstance(weights, PlanarExperts):
            raise InputError("the fold loss is counted on the MXFP4 tensors, before the planar copy replaces them",
                             field="weights", hint="call record_fold_loss(MoEWeights) at load, then to_planar")
        e = weights.n_experts
        every = torch.tensor([0] + [1] * e, dtype=torch.int32, device=self.w1.device).cumsum(0).int()
        before = int(self.lost.item())
        for lo in range(0, e, self.chunk_experts):
            chunk = (lo, min(e, lo + self.chunk_experts))
            for packed, scales, out, exps in (
                (weights.w1_packed, weights.w1_scales, self.w1, self.w1_exp),
                (weights.w2_packed, weights.w2_scales, self.w2, self.w2_exp),
            ):
                convert_experts(packed, scales, out, exps, self.lost, every, chunk, 0, count_loss=True)
        return int(self.lost.item()) - before

    def _convert(self, weights, perm, chunk: tuple[int, int], buf: int) -> None:
        base = buf * self.chunk_experts
        extra = {}
        if self.schedule == "cohabit" and not isinstance(weights, PlanarExperts):
            from adapt.kernels.moe_tiles import num_sms

            extra = dict(programs=num_sms(self.w1.device) * self.convert_programs_per_sm,
                         maxnreg=self.convert_maxnreg)
        if isinstance(weights, PlanarExperts):  # the layer's only MXFP4 copy is planar: convert from it
            for p, out, exps in ((weights.w1, self.w1, self.w1_exp), (weights.w2, self.w2, self.w2_exp)):
                planar_to_fp8(p, out, exps, perm.expert_offsets, chunk, base, self.planar_config)
            return
        convert_experts(
            weights.w1_packed,
            weights.w1_scales,
            self.w1,
            self.w1_exp,
            self.lost,
            perm.expert_offsets,
            chunk,
            base,
            self.count_loss,
            self.convert_config,
            **extra,
        )
        convert_experts(
            weights.w2_packed,
            weights.w2_scales,
            self.w2,
            self.w2_exp,
            self.lost,
            perm.expert_offsets,
            chunk,
            base,
            self.count_loss,
            self.convert_config,
            **extra,
        )

    def run_layer(
        self, weights, perm, tiles, xq, xs, hbuf, hq_hs, y, *, group, activation, configs, top_k, alpha, limit
    ) -> None:
        """GEMM1 + SwiGLU + GEMM2 of one layer, chunk by chunk through the workspace (fp8 MMA).

        xq/xs: quantised hidden [T, H]; hbuf bf16 [S, I]; hq_hs: (e4m3 [S, I], scales); y bf16 [S, H].
        Schedules: "serial" converts chunk c, then runs its GEMMs with the offline path's persistent
        configs, on the caller's stream; "side" converts chunk c+1 on a side stream while chunk c's
        GEMMs run one program per tile; "split" runs the GEMMs persistent on all SMs but
        ``reserve_sms`` on a high-priority stream and chunk c+1's conversion on the side stream; "cohabit" runs
        them one persistent program an SM under ``gemm_maxnreg`` on the high-priority stream and chunk c+1's
        conversion as ``convert_programs_per_sm`` persistent programs an SM on the side stream.
        """
        if (weights.hidden, weights.intermediate) != (self.hidden, self.intermediate):
            raise InputError(
                f"workspace is for hidden {self.hidden} x {self.intermediate}, layer is "
                f"{weights.hidden} x {weights.intermediate}",
                field="workspace",
            )
        if self.schedule == "side":
            configs = tuple(dataclasses.replace(c, programs_per_sm=0) for c in configs)
        elif self.schedule == "cohabit":
            configs = tuple(
                dataclasses.replace(c, programs_per_sm=1, reserve_sms=0, maxnreg=self.gemm_maxnreg) for c in configs
            )
        elif self.schedule == "split":
            configs = tuple(
                dataclasses.replace(c, programs_per_sm=max(1, c.programs_per_sm), reserve_sms=self.reserve_sms)
                for c in configs
            )
        e = weights.n_experts
        chunks = [(lo, min(e, lo + self.chunk_experts)) for lo in range(0, e, self.chunk_experts)]
        gemms = dict(
            weights=weights, perm=perm, tiles=tiles, xq=xq, xs=xs, hbuf=hbuf, hq_hs=hq_hs, y=y, group=group,
            activation=activation, configs=configs, top_k=top_k, alpha=alpha, limit=limit,
        )
        if self._side is None:
            for c, chunk in enumerate(chunks):
                self._convert(weights, perm, chunk, c % 2)
                self._chunk_gemms(chunk, c % 2, **gemms)
            return
        caller = torch.cuda.current_stream(xq.device)
        main = self._gemm if self._gemm is not None else caller
        main.wait_stream(caller)
        self._side.wait_stream(caller)
        converted, done = [], []
        for c, chunk in enumerate(chunks):
            buf = c % 2
            if c == 0:
                with torch.cuda.stream(self._side):
                    self._convert(weights, perm, chunk, buf)
                    converted.append(torch.cuda.Event())
                    converted[-1].record(self._side)
            main.wait_event(converted[c])
            if c + 1 < len(chunks):
                with torch.cuda.stream(self._side):
                    if c >= 1:
                        self._side.wait_event(done[c - 1])
                    self._convert(weights, perm, chunks[c + 1], 1 - buf)
                    converted.append(torch.cuda.Event())
                    converted[-1].record(self._side)
            with torch.cuda.stream(main):
                self._chunk_gemms(chunk, buf, **gemms)
                done.append(torch.cuda.Event())
                done[-1].record(main)
        caller.wait_stream(main)
        caller.wait_stream(self._side)

    def _chunk_gemms(
        self, chunk, buf, *, weights, perm, tiles, xq, xs, hbuf, hq_hs, y, group, activation, configs, top_k,
        alpha, limit,
    ) -> None:
        """GEMM1 + SwiGLU, activation quantisation and GEMM2 of the experts of ``chunk``, whose e4m3
        weights are in workspace buffer ``buf``, on the current stream."""
        from adapt.kernels.moe_gemm import fp8_operand, moe_gemm
        from adapt.kernels.moe_quant import quantize_fp8_rows

        c1, c2 = configs
        hq, hs = hq_hs
        base = buf * self.chunk_experts
        op1 = fp8_operand(self.w1, self.w1_exp, weights.w1_bias)
        op2 = fp8_operand(self.w2, self.w2_exp, weights.w2_bias)
        common = dict(top_k=top_k, alpha=alpha, limit=limit, experts=chunk, slot_base=base)
        moe_gemm(
            xq, xs, op1, perm, tiles, hbuf, gather=True, activation=activation,
            interleaved=weights.gate_up_interleaved, cfg=c1, **common,
        )
        quantize_fp8_rows(hbuf, group, row_range=(perm.expert_offsets, chunk[0], chunk[1]), out=(hq, hs))
        moe_gemm(hq, hs, op2, perm, tiles, y, gather=False, activation=0, interleaved=False, cfg=c2, **common)
