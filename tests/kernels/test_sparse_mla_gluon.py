"""The Gluon sparse MLA kernel (sm_90 only): its sm_90 build on the CPU (registers, spills, shared memory, MMAs),
and on the GPU against the torch twin ``sparse_mla_torch`` at the kernel-vs-twin tolerance of
test_sparse_mla.py (decode batch 64 over a short context, and the DeepSeek-V3.2 shape: 128 heads, top-2048)."""

import pytest

# the configurations sparse_mla can launch: BLOCK_K 64, one slice (bf16 out) or several (fp32 partials), the
# slots of the tile after next read ahead (PREFETCH, the default) or not
SHIPPED = [{"gluon": True, "BLOCK_K": 64, "SPLIT": split, "PREFETCH": pf} for split in (False, True)
           for pf in (True, False)] + [{"gluon": True, "SPLIT": split, "DIRECT": True, "EARLY_LOADS": early}
                                       for split in (False, True) for early in (False, True)]
# the L2 prefetch option (``L2_AHEAD``, off by default until measured) on the default flags
L2_AHEAD = [{"gluon": True, "SPLIT": split, "DIRECT": True, "L2_AHEAD": 2} for split in (False, True)]
# the lazy rescale (``LAZY``, off by default until measured) on the default flags
LAZY = [{"gluon": True, "SPLIT": split, "DIRECT": True, "LAZY": 8.0} for split in (False, True)]
# programmatic dependent launch (``GLUON_PDL``) and bf16 slice partials (``sparse_mla.PARTIAL_BF16``), off by default
# until measured, on the default flags
CHAIN = [{"gluon": True, "SPLIT": True, "DIRECT": True, "PDL": True},
         {"gluon": True, "SPLIT": True, "DIRECT": True, "PARTIAL_BF16": True}]
H200_SHARED_BYTES = 232448  # 227 KB per block (CUDA sm_90 limit)
# F16 against ``sparse_mla_torch(..., half=True)`` (q and the tile rounded to fp16 as the kernel does; p stays fp32
# there, fp16 in the kernel): the tl half tile measured 6.5e-4 against it (benchmarks/gpu-2026-11-30-dsa-s3-prefill)
F16_HALF_TWIN_REL_TOL = 1.5e-3
TWIN_REL_TOL_CUDA = 5e-3  # test_sparse_mla.TWIN_REL_TOL["cuda"]: p rounded to bf16 for p @ v, the twin keeps fp32


@pytest.mark.slow
def test_gluon_kernel_builds_for_sm90_within_registers():
    from tests.kernels.test_sparse_mla_sass import sass_rows

    for row in sass_rows(SHIPPED + L2_AHEAD + CHAIN):
        assert "error" not in row, row
        assert row["regs"] <= 255 and row["spill_bytes"] == 0, row
        assert row["shared"] <= H200_SHARED_BYTES, row
        # both MMAs of the tile in the loop (bf16 HGMMA), and no fp32 FMA-pipe matmul
        assert row["loop_ops"].get("HGMMA", 0) >= 2 and row["loop_ops"].get("FFMA", 0) < 64, row
        # L2 prefetches (CCTL) in the loop exactly where asked: 64 rows x 8 lines = 2 per thread
        assert row["loop_ops"].get("CCTL", 0) == (2 if row["config"].get("L2_AHEAD") else 0), row


@pytest.mark.slow
def test_lazy_rescale_skips_the_accumulator_multiplies():
    """With LAZY the accumulator's rescale ([64, 512] fp32 over 256 threads: 128 FMUL a thread) sits alone under a
    forward branch of the tile loop, which adds no barrier and keeps the wgmmas in flight (no WARPGROUP pair per
    HGMMA, as ptxas's serialisation would give); the default build has no such branch."""
    from tests.kernels.test_sparse_mla_sass import sass_rows

    default, *lazy = sass_rows([{"gluon": True, "DIRECT": True}] + LAZY)
    assert default["branch_skip"]["len"] < 16, default
    for row in lazy:
        assert "error" not in row, row
        assert row["regs"] <= 255 and row["spill_bytes"] == 0 and row["shared"] <= H200_SHARED_BYTES, row
        assert row["branch_skip"] == {"len": 128, "ops": {"FMUL": 128}}, row
        assert row["loop_ops"]["BAR"] == default["loop_ops"]["BAR"], row
        assert row["loop_ops"].get("WARPGROUP", 0) <= 8, row


@pytest.mark.slow
def test_f16_tile_dequantises_in_packed_half_math():
    """F16: the tile is dequantised as e4m3x2 -> f16x2 conversions and HMUL2 (64 a thread a tile: 128 elements), with
    no fp32 widening (HADD2.F32) left in the loop, and both MMAs stay HGMMA; within registers and shared memory (the
    fp16 buffers are the bf16 ones' size), and the loop shorter than the bf16 build's."""
    from tests.kernels.test_sparse_mla_sass import sass_rows

    bf16, f16, rows8 = sass_rows([{"gluon": True, "SPLIT": True, "DIRECT": True},
                                  {"gluon": True, "SPLIT": True, "DIRECT": True, "F16": True},
                                  {"gluon": True, "SPLIT": True, "DIRECT": True, "F16": True, "GATHER_ROWS": 8}])
    for row in (bf16, f16):
        assert "error" not in row, row
        assert row["regs"] <= 255 and row["spill_bytes"] == 0 and row["shared"] <= H200_SHARED_BYTES, row
        assert row["loop_ops"].get("HGMMA", 0) >= 2, row
    assert f16["loop_ops"].get("HMUL2", 0) == 64 and "HADD2" not in f16["loop_ops"], f16
    assert bf16["loop_ops"].get("HADD2", 0) >= 64 and "HMUL2" not in bf16["loop_ops"], bf16
    assert f16["shared"] == bf16["shared"], (f16, bf16)
    assert f16["loop_len"] < bf16["loop_len"] - 128, (f16, bf16)
    # GATHER_ROWS 8 (8 rows a warp): the same stores and MMAs, within registers, and fewer loads of the row scales
    assert "error" not in rows8 and rows8["regs"] <= 255 and rows8["spill_bytes"] == 0, rows8
    assert rows8["loop_ops"]["STS"] == f16["loop_ops"]["STS"] and rows8["loop_ops"]["HGMMA"] == f16["loop_ops"]["HGMMA"]
    assert rows8["loop_ops"]["LDG"] < f16["loop_ops"]["LDG"], (rows8, f16)


@pytest.mark.slow
def test_cp_async_kernel_stages_two_tiles_ahead_within_shared_memory():
    """CP (``sparse_mla_gluon_cp_kernel``): the loop copies the rows of the tile two ahead by cp.async (LDGSTS: 8
    e4m3 chunks, 8 scales and 2 rope chunks a thread) after its MMAs, holds both MMAs (HGMMA; HMUL2 with F16), and
    fits one program in the H200's shared memory with one dequantised slot and the staging buffer."""
    from tests.kernels.test_sparse_mla_sass import sass_rows

    for row in sass_rows([{"cp": True}, {"cp": True, "F16": True, "SPLIT": True}]):
        assert "error" not in row, row
        assert row["regs"] <= 255 and row["shared"] <= H200_SHARED_BYTES, row
        assert row["loop_ops"].get("LDGSTS", 0) == 18 and row["loop_ops"].get("HGMMA", 0) >= 2, row
        assert ("HMUL2" in row["loop_ops"]) == bool(row["config"].get("F16")), row


@pytest.mark.slow
def test_warp_specialised_kernel_builds_for_sm90():
    """The WS form (benchmarks/gpu-2026-12-01-dsa-s9): 8 consumer warps + 4 producer warps under the launch's
    168-register cap, the producer at PREGS and the consumers at the rest (setmaxnreg), within shared memory;
    with PV_WAIT its wgmmas run in flight (a few WARPGROUP ops a tile, not an arrive/wait pair per HGMMA)."""
    from tests.kernels.test_sparse_mla_sass import sass_rows

    rows = sass_rows([{"ws": True, "PV_WAIT": True, "PAIR": False}, {"ws": True, "PV_WAIT": True, "SPLIT": True},
                      {"ws": True, "PAIR": False}])
    for row in rows:
        assert "error" not in row, row
        assert row["regs"] <= 168 and row["shared"] <= H200_SHARED_BYTES, row
        # producer 152, consumers (168 * 12 - 152 * 4) / 8 = 176; 24 and 240 around the region
        assert {"152", "176"} <= set(row["setmaxnreg"]), row
        assert row["mbarrier_waits"] >= 2 and row["loop_ops"].get("HGMMA", 0) >= 40, row
    assert rows[0]["loop_ops"].get("WARPGROUP", 0) <= 8, rows[0]
    assert rows[2]["loop_ops"].get("WARPGROUP", 0) >= 40, rows[2]  # without PV_WAIT ptxas serialises (C7515)


def _case(lengths, rows, heads, topk, seed=0):
    from tests.kernels.test_sparse_mla import setup

    layer, batch, indices, q_nope, q_rope = setup(lengths, heads=heads, rank=512, rope=64, topk=topk,
                                                  latent_format="fp8", device="cuda", seed=seed, scale_groups=4)
    sub = type(batch)(batch.slots, batch.positions[rows], batch.token_seq[rows], batch.query_starts,
                      batch.block_table, batch.seq_lens)
    args = (q_nope[rows], q_rope[rows], layer.latent_nope, layer.latent_scale, layer.latent_rope,
            batch.block_table, sub.token_seq, indices[rows], 0.07)
    return layer, sub, args


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"splits": 3}, {"prefetch": False}, {"gluon": {"DIRECT": False}},
                                     {"gluon": {"DIRECT": True, "EARLY_LOADS": True}},
                                     pytest.param({"gluon": {"L2_AHEAD": 2}}, id="l2_ahead2"),
                                     pytest.param({"gluon": {"L2_AHEAD": 4}, "splits": 2}, id="l2_ahead4_splits2"),
                                     pytest.param({"gluon": {"WS": True}}, id="ws"),
                                     pytest.param({"gluon": {"WS": True}, "splits": 3}, id="ws_splits3"),
                                     pytest.param({"gluon": {"WS": True}, "splits": 5}, id="ws_one_tile_slices"),
                                     pytest.param({"gluon": {"WS": True, "PAIR": False}}, id="ws_single_tiles"),
                                     pytest.param({"gluon": {"WARPS": 16}}, id="w16"),
                                     pytest.param({"gluon": {"WARPS": 16}, "splits": 3}, id="w16_splits3"),
                                     pytest.param({"gluon": {"WS": True, "PV_WAIT": True}}, id="ws_pv_wait"),
                                     pytest.param({"gluon": {"WS": True, "PV_WAIT": True, "PAIR": False}, "splits": 5},
                                                  id="ws_pv_wait_single_tiles"),
                                     pytest.param({"gluon": {"F16": True}}, id="f16"),
                                     pytest.param({"gluon": {"F16": True}, "splits": 3}, id="f16_splits3"),
                                     pytest.param({"gluon": {"GATHER_ROWS": 8}}, id="gather_rows8"),
                                     pytest.param({"gluon": {"GATHER_ROWS": 4}, "splits": 3}, id="rows4_splits3"),
                                     pytest.param({"gluon": {"GATHER_ROWS": 8, "F16": True}}, id="gather_rows8_f16"),
                                     pytest.param({"gluon": {"CP": True}}, id="cp"),
                                     pytest.param({"gluon": {"CP": True, "F16": True}, "splits": 3}, id="cp_f16_s3"),
                                     pytest.param({"gluon": {"LAZY": 8.0}}, id="lazy8"),
                                     pytest.param({"gluon": {"LAZY": 0.25}, "splits": 3}, id="lazy_small_splits3")])
def test_gluon_decode_batch64_matches_twin(options):
    """64 decode rows (one per sequence of 300 tokens), 128 heads, top-256 (rows see all 300 or fewer: -1 pads in
    the tail of some rows' lists are masked)."""
    import torch

    from adapt.kernels.sparse_mla import sparse_mla, sparse_mla_torch
    from tests.kernels.test_sparse_mla import rel, setup

    layer, batch, indices, q_nope, q_rope = setup([300] * 64, heads=128, rank=512, rope=64, topk=256,
                                                  latent_format="fp8", device="cuda", scale_groups=4)
    rows = (batch.positions == 299).nonzero().squeeze(1)  # the last token of each sequence
    assert len(rows) == 64
    indices[rows[::7], 200:] = -1  # some rows select fewer positions
    args = (q_nope[rows], q_rope[rows], layer.latent_nope, layer.latent_scale, layer.latent_rope,
            batch.block_table, batch.token_seq[rows], indices[rows], 0.07)
    got = sparse_mla(*args, **{"gluon": True, **options})
    twin = sparse_mla_torch(*args)
    assert torch.isfinite(got).all()
    assert rel(got, twin) <= TWIN_REL_TOL_CUDA
    l2 = options.get("gluon", {}).get("L2_AHEAD") if isinstance(options.get("gluon"), dict) else None
    if l2:  # the L2 prefetches change no arithmetic: bit-equal to the same launch without them
        assert torch.equal(sparse_mla(*args, **{**options, "gluon": {**options["gluon"], "L2_AHEAD": 0}}), got)
    flags = options.get("gluon", {})
    if flags.get("CP"):  # the same arithmetic in the same order, the rows staged through shared memory: bit-equal
        assert torch.equal(sparse_mla(*args, **{**options, "gluon": {k: v for k, v in flags.items() if k != "CP"}}),
                           got)
    if flags.get("GATHER_ROWS", 1) != 1:  # another register layout for the same loads and stores: bit-equal
        same = {**options, "gluon": {k: v for k, v in flags.items() if k != "GATHER_ROWS"}}
        assert torch.equal(sparse_mla(*args, **same), got)
    if flags.get("F16"):  # the fp16 tile: nearer still to the twin that rounds q and the tile to fp16 as it does
        assert rel(got, sparse_mla_torch(*args, half=True)) <= F16_HALF_TWIN_REL_TOL
    if flags.get("WS"):  # same arithmetic and reduction order as the single-partition kernel: bit-equal
        # (WARPS 16 is not: its softmax row sums add four warpgroups' parts, not two)
        assert torch.equal(sparse_mla(*args, **{**options, "gluon": {}}), got)
    if not options:  # 64 rows x 2 head blocks take no position slices: the default is the Gluon kernel
        assert torch.equal(sparse_mla(*args), got)
        assert not torch.equal(sparse_mla(*args, gluon=False), got)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"gluon": {"DIRECT": True}, "splits": 16},
                                     pytest.param({"gluon": {"L2_AHEAD": 2}}, id="l2_ahead2"),
                                     pytest.param({"gluon": {"WS": True}}, id="ws"),
                                     pytest.param({"gluon": {"WS": True}, "splits": 16}, id="ws_splits16"),
                                     pytest.param({"gluon": {"WS": True}, "splits": 11}, id="ws_three_tile_slices"),
                                     pytest.param({"gluon": {"WARPS": 16}}, id="w16"),
                                     pytest.param({"gluon": {"WS": True, "PV_WAIT": True}, "splits": 11},
                                                  id="ws_pv_wait_three_tile_slices"),
                                     pytest.param({"gluon": {"F16": True}}, id="f16"),
                                     pytest.param({"gluon": {"F16": True}, "splits": 16}, id="f16_splits16"),
                                     pytest.param({"gluon": {"GATHER_ROWS": 8}, "splits": 16}, id="gather_rows8"),
                                     pytest.param({"gluon": {"CP": True}}, id="cp"),
                                     pytest.param({"gluon": {"CP": True}, "splits": 16}, id="cp_splits16"),
                                     pytest.param({"gluon": {"LAZY": 8.0}, "splits": 16}, id="lazy8_splits16")])
def test_gluon_deepseek_v32_shape_matches_twin(options):
    """128 heads, latent 512 + 64 in e4m3 (four groups), top-2048 over 5000 cached tokens (rows 0 .. 2047 select
    fewer than 2048), against the twin and the float64 reference; a row with no position returns 0."""
    import torch

    from adapt.kernels.sparse_mla import sparse_mla, sparse_mla_torch
    from tests.kernels.test_sparse_mla import reference, rel

    rows = torch.tensor([0, 63, 64, 2047, 2048, 3999, 4000, 4999]).cuda()
    layer, sub, args = _case((4000, 1000), rows, heads=128, topk=2048)
    args[7][1] = -1
    got = sparse_mla(*args, **{"gluon": True, **options})
    twin = sparse_mla_torch(*args)
    want = reference(layer, sub, args[7], args[0], args[1], 0.07)
    assert torch.equal(got[1].float().cpu(), torch.zeros(128, 512))
    assert rel(got, want) < 1e-2
    assert rel(got, twin) <= TWIN_REL_TOL_CUDA
    if options.get("gluon", {}).get("F16"):  # fp16 keeps 3 more mantissa bits of the tile and of p than bf16
        assert rel(got, sparse_mla_torch(*args, half=True)) <= F16_HALF_TWIN_REL_TOL
        assert rel(got, want) < rel(sparse_mla(*args, gluon={}, splits=options.get("splits")), want)


@pytest.mark.gpu
def test_gluon_kernel_is_the_batch1_default_with_its_slices_merged_at_once(monkeypatch):
    """One decode row at DeepSeek-V3.2 shapes: the default dispatch takes the Gluon kernel in 32 slices of 64
    positions (GLUON_SLICED) and merges them with the combine loading every slice at once (COMBINE_AT_ONCE):
    bit-equal to asking for that, within the twin tolerance, and within one bf16 ulp of the slice loop."""
    import torch

    from adapt.kernels import sparse_mla as sm
    from tests.kernels.test_sparse_mla import rel

    rows = torch.tensor([4999]).cuda()
    _, _, args = _case((4000, 1000), rows, heads=128, topk=2048)
    assert sm.GLUON_SLICED and sm.COMBINE_AT_ONCE
    got = sm.sparse_mla(*args)
    assert torch.equal(got, sm.sparse_mla(*args, gluon=True))
    assert rel(got, sm.sparse_mla_torch(*args)) <= TWIN_REL_TOL_CUDA
    monkeypatch.setattr(sm, "COMBINE_AT_ONCE", False)
    loop = sm.sparse_mla(*args).float().cpu()
    ulp = torch.exp2(torch.floor(torch.log2(loop.abs().clamp_min(2.0 ** -126))) - 7)
    assert bool(((got.float().cpu() - loop).abs() <= ulp).all())
    monkeypatch.setattr(sm, "GLUON_SLICED", False)
    assert not torch.equal(sm.sparse_mla(*args), sm.sparse_mla(*args, gluon=True))  # the tl kernel again


@pytest.mark.gpu
def test_batch1_chain_options_pdl_and_bf16_partials(monkeypatch):
    """One decode row at DeepSeek-V3.2 shapes (the Gluon kernel in 32 slices): with programmatic dependent launch
    (GLUON_PDL) the output is bit-equal to the launch without it; with bf16 slice partials (PARTIAL_BF16) within
    2**-8 of the fp32 partials' output (relative, over the whole output: one more bf16 rounding of each partial
    before the merge; an element near zero after the merge may move by more than its own ulps) and within the twin
    tolerance."""
    import torch

    from adapt.kernels import sparse_mla as sm
    from adapt.kernels import sparse_mla_gluon as smg
    from tests.kernels.test_sparse_mla import rel

    rows = torch.tensor([4999]).cuda()
    _, _, args = _case((4000, 1000), rows, heads=128, topk=2048)
    want = sm.sparse_mla(*args)
    monkeypatch.setattr(smg, "GLUON_PDL", True)
    assert torch.equal(sm.sparse_mla(*args), want)
    monkeypatch.setattr(sm, "PARTIAL_BF16", True)
    got = sm.sparse_mla(*args)
    assert not torch.equal(got, want)  # the bf16 partials did run
    assert rel(got, want) <= 2.0 ** -8
    assert rel(got, sm.sparse_mla_torch(*args)) <= TWIN_REL_TOL_CUDA
