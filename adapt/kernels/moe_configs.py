"""Tile configurations of the MoE GEMMs, as data keyed by device and by tokens per expert.

``pick_configs(slots, n_experts, compute)`` returns the (GEMM1, GEMM2) ``GemmConfig`` of the plain
MXFP4 / FP8 grouped GEMM (``moe_gemm``); ``pick_planar_configs(slots, n_experts, device, H, I)`` the
``PlanarConfig`` pair of the planar small-T GEMM (``moe_planar``), ``pick_planar_fused_combine`` whether
its weighted combine runs in GEMM2's epilogue. The planar table ``PLANAR_TABLES``
maps (device name, expert shape) to rows (largest mean slots per expert, GEMM1 config, GEMM2
config), first match wins; each row's source is the benchmark record named beside it. Under the CPU interpreter
every pick is a small tile, so tests stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from adapt.kernels.mxfp4 import INTERPRET


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape of one grouped GEMM: tokens per tile (block_m), weight rows per tile (block_n;
    gate and up rows each for GEMM1), K per step, L2 grouping, warps, pipeline depth, programs per SM
    (0: one program per work item, so kernels on other streams can take SMs as programs retire),
    and the MMA orientation: swap_ab True puts weight rows in the MMA's M (small T), False puts
    tokens in M and the weight tile in the B operand (large T: the decoded tile goes through shared
    memory the way wgmma wants it). reserve_sms: SMs a persistent grid leaves free (programs = SMs *
    programs_per_sm - reserve_sms, at least one), so a kernel on another stream has whole SMs: the
    FP8 workspace's conversion beside the GEMMs (``FP8Workspace(schedule="split")``). prefetch_scales: the
    in-GEMM fold (``compute="fp8_fold"``) loads each K step's E8M0 scales one step ahead (a loop-carried
    tile; they are too narrow for the asynchronous copy pipeline); early_up: the fold decodes the gate and
    up tiles before either MMA; maxnreg: a register cap per thread (0: none), so two 8-warp programs fit;
    gluon: the fold runs ``moe_gluon.fold_gemm`` (decode of step k + 1 beside the MMAs of step k) where
    ``moe_gluon.usable`` (sm_90), token-major only; elsewhere the ``tl`` kernel; gluon_ws: with gluon, the
    warp-specialized form (``moe_gluon.fold_gemm_ws_kernel``: a loader warpgroup fills the ring, the MMA warps
    issue no global loads in the K loop); probe: with gluon (not gluon_ws), a timing-only variant whose output is
    wrong (``moe_gluon.fold_gemm_kernel``'s PROBE: 1 no proxy fence, 2 decode only the first two K steps,
    3 both); 0 everywhere but the probe rows of ``bench_moe.FOLD_SWEEP``."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 4
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4
    swap_ab: bool = True
    reserve_sms: int = 0
    prefetch_scales: bool = True
    early_up: bool = False
    maxnreg: int = 0
    gluon: bool = False
    gluon_ws: bool = False
    probe: int = 0


@dataclass(frozen=True)
class PlanarConfig:
    """Tile of the planar GEMM: tokens per tile (block_m, >= 16), weight rows per tile (block_n;
    GEMM1 yields block_n / 2 outputs), K splits, L2 grouping, warps, stages, programs per SM
    (0: one program per work item), one_dot: one MMA chain of K = 128 per step (the decoded
    planes joined into the operand) instead of eight dots of K = 16, and maxnreg: a register cap
    per thread (0: none; 128 fits four 4-warp programs per SM where the compiler would take 156),
    flatten: with programs_per_sm > 0, the tile and K loops pipelined as one loop (loads run ahead
    across a program's tiles), stream_k: num_sms * programs_per_sm (at least 1 a SM) persistent programs,
    each one equal run of the tiles x K steps, sums out by fp32 atomic adds (``moe_planar._planar_gemm_kernel``'s
    STREAM_K; split_k and flatten ignored); l2_next (GEMM1 only, 0 off): the programs of each expert's first
    m-tile prefetch that fraction of the expert's next-GEMM words into L2 (evict-last priority), so GEMM2 reads
    them from L2 (``moe_planar._planar_gemm_kernel``'s L2_NEXT). Measured slower at T = 1..64 on the H200 (3-14%,
    benchmarks/moe/2026-12-02-s11 call 5), so no table row sets it."""

    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    group_m: int = 4
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 0
    one_dot: bool = False
    maxnreg: int = 0
    flatten: bool = False
    stream_k: bool = False
    l2_next: float = 0.0


@dataclass(frozen=True)
class PlanarMLPConfig:
    """Tile of the one-kernel planar MLP (``moe_planar.planar_moe(one_kernel=...)``, T <= 16): tokens per
    m-tile (block_m), intermediates per program (block_i: 64 = half a planar step of W2's K, or 128 =
    one step; GEMM1 then reads 2 * block_i interleaved gate/up rows), W2 rows per inner tile
    (block_n2, a multiple of 64), warps, stages, register cap (0: none), natural_half: with block_i 64,
    W2's half-step operand permuted into K order (else h is permuted once to the decode's order),
    stages2: pipeline depth of GEMM2's n-loop (0: num_stages; its stage is block_n2 x block_i / 2 bytes)."""

    block_m: int = 16
    block_i: int = 64
    block_n2: int = 128
    num_warps: int = 4
    num_stages: int = 4
    maxnreg: int = 0
    natural_half: bool = True
    stages2: int = 0


def pick_configs(slots: int, n_experts: int, compute: str) -> tuple[GemmConfig, GemmConfig]:
    """Configs for (GEMM1, GEMM2) from the mean slots per expert (same block_m for both).

    compute: "bf16" (MXFP4 decoded to bf16), "fp8" (MXFP4 decoded to e4m3 in the GEMM),
    "fp8_stored" (e4m3 weights read from memory: offline copy or workspace), "fp8_block" (FP8-block
    experts, W8A8: K steps of 128, one per scale block) or "bf16_stored" (bf16 experts, or FP8-block
    experts widened to bf16: the fp8_stored tiles with the same bytes per row and step, so K steps of
    128 (swap) or 64).
    """
    if INTERPRET:
        c = GemmConfig(
            block_m=16, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1, programs_per_sm=1
        )
        return c, c
    if compute == "bf16_stored":
        c1, c2 = pick_configs(slots, n_experts, "fp8_stored")
        return replace(c1, block_k=128 if c1.swap_ab else 64), replace(c2, block_k=128 if c2.swap_ab else 64)
    if compute == "fp8_block":
        # each K step's partial sum is scaled before it joins the accumulator (a second [M, N] fp32
        # tile live): at large T half the fp8_stored n-tile keeps that within the register file
        c1, c2 = pick_configs(slots, n_experts, "fp8_stored")
        if not c1.swap_ab and c1.block_m == 128:
            return replace(c1, block_n=64), replace(c2, block_n=128)
        return replace(c1, block_k=128), replace(c2, block_k=128)
    per_expert = slots / max(1, n_experts)
    bk_small = 256
    if per_expert <= 16 and compute == "bf16":
        # word decode: K steps of 128 and 6 stages keep registers at <= 168 (3-4 programs per SM)
        return (GemmConfig(16, 32, 128, 4, 4, 6, 4), GemmConfig(16, 64, 128, 4, 4, 6, 4))
    if per_expert <= 16:
        return (GemmConfig(16, 32, bk_small, 4, 4, 4, 4), GemmConfig(16, 64, bk_small, 4, 4, 4, 4))
    if per_expert <= 48:
        return (GemmConfig(32, 32, bk_small, 4, 4, 4, 4), GemmConfig(32, 64, bk_small, 4, 4, 4, 4))
    if compute == "bf16":
        if per_expert <= 160:
            return (GemmConfig(64, 64, 128, 4, 4, 3, 2), GemmConfig(64, 128, 128, 4, 8, 3, 2))
        return (GemmConfig(128, 64, 64, 8, 8, 3, 1), GemmConfig(128, 128, 64, 8, 8, 3, 1))
    # fp8 MMA with 64+ tokens per expert: tokens in M, weight tile as the B operand
    if per_expert <= 160:
        return (
            GemmConfig(64, 64, 128, 4, 4, 3, 2, swap_ab=False),
            GemmConfig(64, 128, 128, 4, 4, 3, 2, swap_ab=False),
        )
    if compute == "fp8_stored":
        return (
            GemmConfig(128, 128, 128, 8, 8, 3, 1, swap_ab=False),
            GemmConfig(128, 256, 128, 8, 8, 3, 1, swap_ab=False),
        )
    return (
        GemmConfig(128, 64, 128, 8, 8, 3, 1, swap_ab=False),
        GemmConfig(128, 128, 128, 8, 8, 3, 1, swap_ab=False),
    )


_P = PlanarConfig
_SMALL = _P(16, 128, 1, 4, 4, 4, 0, True, 128)
_N64 = _P(16, 64, 1, 4, 4, 4, 0, True, 128)
_ST3 = _P(16, 128, 1, 4, 4, 3, 0, True, 128)
_ST5 = _P(16, 128, 1, 4, 4, 5, 0, True, 128)
_BIG = _P(128, 256, 1, 4, 8, 3, 0, True)
_H200_RECORD = ("benchmarks/moe/2026-11-30-s2 (call 2, commit 3f78ab0, tiled layout; call 4, commit 92ae05f, stages); "
                "benchmarks/moe/2026-11-30-s3 (call 6, commit 84a6321: alternatives timed, none faster)")
PLANAR_TABLES: dict[tuple[str, str], list[tuple[float, PlanarConfig, PlanarConfig]]] = {
    # (device name, "hidden x intermediate") -> rows (largest mean slots per expert, GEMM1, GEMM2),
    # each the fastest config of the H200 sweep in _H200_RECORD at the token counts of its range
    ("NVIDIA H200", "7168x2048"): [
        # T = 1: 88.8 us with the combine (block_n 128: 91.6 without); call 6 (fused combine, vs this row
        # 88.8 us): GEMM2 split 2 89.0, GEMM2 block_n 128 88.1, 6 stages 88.8, GEMM1 split 2 93.0, a 64-register
        # cap (eight programs an SM) 93.3, both 91.7: no lever moved T = 1
        (0.1, _N64, _N64),
        # T = 16 / 64 (call 4 sweep, expert GEMMs): 3 stages 761 / 1536 us, 4 stages 763 / 1578, 5 stages 758 / 1544;
        # with the combine (call 5) 750 / 1604 us (call 4, 4 stages: 752 / 1591): within the spread between calls.
        # 2026-11-30-s3 call 6 (combine in GEMM2's epilogue, vs this row 718 / 1530 us): a 96-register cap
        # 733 / 1553, the flattened persistent loop 862 / 1861, T = 64 GEMM1 split 2 1568, GEMM1 block_n 64
        # 3 stages 1661, GEMM2 block_n 64 1628: the row stays
        (2.0, _ST3, _ST3),
        # T = 256 (call 4 sweep): 5 stages 1913 us, 3 stages 1937, 4 stages 2084 (call 2: 4 stages 1907);
        # with the combine (call 5) 1853 us (call 4, 4 stages: 1865)
        # call 6 (fused combine, vs this row 1848 us): 96-register cap 1903, flattened loop 3175
        (16.0, _ST5, _ST5),
        (64.0, _P(64, 128, 1, 4, 8, 4, 0, True), _P(64, 128, 1, 4, 8, 4, 0, True)),  # T = 1024: 3037 with combine
        (float("inf"), _BIG, _BIG),  # T = 4096: 7830 us with combine (128 x 128: 8329 without)
    ],
    ("NVIDIA H200", "2880x2880"): [
        # T = 1: 48.3 us with the combine (block_n 128: 49.4 without). 2026-12-02 (benchmarks/moe/2026-12-02-s10,
        # call 4, commit 4e32908, fused combine, 3 rounds in turns): GEMM2 stream-K, 4 programs an SM, 47.8 us
        # against the table's 52.5 (both stream-K 48.1, GEMM1 alone 50.4): GEMM2's 4 x 45 tiles of 64 rows are
        # 180 programs on 132 SMs, so a third of the SMs streamed twice the bytes; now every SM the same
        (0.1, _N64, replace(_N64, programs_per_sm=4, stream_k=True)),
        # T = 16 / 64 / 256: 238 / 513 / 575 us (no register cap: 246 / 543 / 612); call 6 at T = 64 (fused
        # combine, vs this row 520.7 us): GEMM2 block_n 64 537, GEMM1 split 2 540, GEMM1 block_n 64 3 stages
        # 568, 96-register cap 587, flattened loop 599-624: the row stays
        (16.0, _SMALL, _SMALL),
        (64.0, _P(32, 128, 1, 4, 4, 4, 0, True), _P(32, 128, 1, 4, 4, 4, 0, True)),  # T = 1024: 989 with combine
        (float("inf"), _BIG, _BIG),  # T = 4096: 2316 us with combine (128 x 128: 2478 without)
    ],
}
"""Planar GEMM configs keyed by (``torch.cuda.get_device_name``, "HxI"); unknown keys take the
DeepSeek-V3 H200 rows (``PLANAR_DEFAULT``)."""
PLANAR_DEFAULT = ("NVIDIA H200", "7168x2048")


PLANAR_FUSED_COMBINE: dict[tuple[str, str], tuple[float, float]] = {
    # (device name, "HxI") -> (lowest, highest) mean slots per expert at which the planar path runs the
    # weighted combine in GEMM2's epilogue (``moe_planar.planar_moe``) rather than GEMM2 then
    # ``routing.combine``. benchmarks/moe/2026-11-30-s3 call 6 (commit 84a6321), same process, both
    # paths on the table's tiles: DeepSeek-V3 T = 64 1,529.8 vs 1,617.2 us, T = 16 717.8 vs 716.3 (a tie,
    # the same row of PLANAR_TABLES); slower at T = 1 (88.8 vs 86.4), 256 (1,848 vs 1,822), 1024 (3,483
    # vs 3,100) and 4096 (8,253 vs 7,739: 4 fp32 atomics per output element of each slot). gpt-oss-120b:
    # no T faster beyond the spread (T = 64 520.7 vs 522.6, T = 16 246.6 vs 244.9) but T = 1 below.
    ("NVIDIA H200", "7168x2048"): (0.1, 2.0),
    # gpt-oss-120b T = 1 only: its GEMM2 runs stream-K (PLANAR_TABLES), whose sums go out by atomic adds either way,
    # so the fused combine saves the fp32 buffer, the epilogue and the combine kernels (2026-12-02-s10, call 4)
    ("NVIDIA H200", "2880x2880"): (0.0, 0.1),
}
"""Where the fused combine was measured faster; keys absent: never."""


def pick_planar_fused_combine(
    slots: int, n_experts: int, device_name: str = "", hidden: int = 0, intermediate: int = 0
) -> bool:
    """True when ``PLANAR_FUSED_COMBINE`` says the planar path at ``slots`` = T * k over ``n_experts``
    runs its combine in GEMM2's epilogue on this device and expert shape (never under the interpreter)."""
    if INTERPRET:
        return False
    span = PLANAR_FUSED_COMBINE.get((device_name, f"{hidden}x{intermediate}"))
    per_expert = slots / max(1, n_experts)
    return span is not None and span[0] < per_expert <= span[1]


def pick_planar_configs(
    slots: int, n_experts: int, device_name: str = "", hidden: int = 0, intermediate: int = 0
) -> tuple[PlanarConfig, PlanarConfig]:
    """(GEMM1, GEMM2) ``PlanarConfig`` for ``slots`` = T * k routed over ``n_experts``, from the
    table of (device_name, hidden x intermediate) or the default rows."""
    if INTERPRET:
        c = PlanarConfig(block_m=16, block_n=32, split_k=1, group_m=2, num_warps=4, num_stages=1)
        return c, c
    per_expert = slots / max(1, n_experts)
    rows = PLANAR_TABLES.get((device_name, f"{hidden}x{intermediate}"), PLANAR_TABLES[PLANAR_DEFAULT])
    for limit, c1, c2 in rows:
        if per_expert <= limit:
            return c1, c2
    raise AssertionError("the last row of a planar table must have no limit")


def pick_planar_mlp_config() -> PlanarMLPConfig:
    """The one-kernel planar MLP's tile (a small one under the interpreter, so tests stay fast)."""
    if INTERPRET:
        return PlanarMLPConfig(block_m=16, block_i=64, block_n2=64, num_warps=4, num_stages=1)
    return PlanarMLPConfig()
