"""DSA kernel benchmark on one CUDA GPU at DeepSeek-V3.2 shapes (``adapt bench kernels --dsa``).

Per layer, on random (never zero) data, medians of CUDA-event timings:

- decode: one query token per sequence, batch x context grid; indexer scan + top-k and
  sparse MLA over the paged caches (latent fp8 656 B/token by default, indexer 132 B/token);
  byte floor = indexer keys B*S*132 + selected latent rows B*topk*latent_bytes, at the
  copy bandwidth measured in the same run;
- prefill: one sequence of T tokens; indexer scoring + chunked top-k + sparse MLA (the
  DSA core: projections are GEMMs that dense attention has too and are left out of both);
- in the same run: device-to-device copy bandwidth, torch bf16 matmul and fp8 _scaled_mm
  rates, and the dense baselines for the same heads and context: prefill = causal
  scaled_dot_product_attention on MLA's MHA-mode shapes (128 heads, q.k 192, v 128) with the
  backend that ran recorded (Flash, cuDNN, then memory-efficient, each forced in turn); decode =
  the absorbed MLA path over a dense bf16 latent cache (bf16 bmm + fp32 softmax + bf16 bmm) in a
  CUDA graph like the DSA step, with its byte floor (the cache read once);
- the prefill form: absorbed latent Triton kernel vs the per-head 192/128 form (torch
  gather + matmul), per query row, at the smallest prefill length.

Writes ``dsa_bench.json`` and ``dsa_bench.md`` into ``out_dir`` and returns the dict.
``--acceptance`` (``run_dsa_acceptance``) runs only the acceptance cases: decode batch 1 and
64 x 128K, prefill 128K, a small sparse MLA tile sweep, and the same-run copy ceiling (torch
and the Triton 16-byte copy of ``bench_moe``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from adapt.bench import timer
from adapt.bench.acceptance import Criterion, benchmark_report, evaluate, find_row
from adapt.bench.ceilings import measure_ceilings
from adapt.bench.provenance import commit as _commit
from adapt.bench.timer import time_cuda
from adapt.bench.timer import time_eager_ms as _time_ms
from adapt.bench.timer import time_graph_ms as _time_graph_ms
from adapt.errors import InputError
from adapt.kernels import dsa, pdl, sparse_mla
from adapt.kernels import topk as _topk
from adapt.kernels.formats import FP8_DTYPE, PAGE_SIZE
from adapt.kernels.topk import topk_decode, topk_indices, topk_indices_torch, topk_prefiltered
from adapt.model.spec import load_spec
from adapt.report import StageReport, load_gates
from adapt.runtime.kv_cache import DSALayerCache, PagedKVCache, mla_layout

_MLA = load_spec("deepseek-v3.2").layers[0].attention  # the benchmarked shape: DeepSeek-V3.2's MLA + DSA
HEADS, RANK, ROPE = _MLA.num_heads, _MLA.kv_lora_rank, _MLA.qk_rope_head_dim
INDEX_HEADS, INDEX_DIM, NOPE, VDIM = _MLA.index_n_heads, _MLA.index_head_dim, _MLA.qk_nope_head_dim, _MLA.v_head_dim


def _random_cache(num_tokens: int, latent_format: str) -> PagedKVCache:
    """A one-layer cache (the runtime's PagedKVCache, MLA + DSA layout) of random content."""
    pages = -(-num_tokens // PAGE_SIZE)
    cache = PagedKVCache(pages, {0: mla_layout(RANK, ROPE, INDEX_DIM, latent_format=latent_format)}, "cuda")
    layer: DSALayerCache = cache.dsa_layer(0)
    step = 1 << 14
    for p0 in range(0, pages, step):
        p1 = min(pages, p0 + step)
        shape = (p1 - p0, PAGE_SIZE)
        layer.index_k[p0:p1] = torch.randn(*shape, INDEX_DIM, device="cuda").mul_(30).to(FP8_DTYPE)
        layer.latent_nope[p0:p1] = torch.randn(*shape, RANK, device="cuda").mul_(30).to(layer.latent_nope.dtype)
        layer.latent_rope[p0:p1] = torch.randn(*shape, ROPE, device="cuda").to(torch.bfloat16)
    layer.index_scale.uniform_(0.5e-2, 1.5e-2)
    if layer.latent_scale is not None:
        layer.latent_scale.uniform_(0.5e-2, 1.5e-2)
    return cache


def _queries(rows: int):
    q8, q_scale = dsa.quantize_fp8_rows(torch.randn(rows, INDEX_HEADS, INDEX_DIM, device="cuda"))
    weights = dsa.fold_index_weights(torch.randn(rows, INDEX_HEADS, device="cuda"), q_scale, INDEX_DIM)
    q_nope = torch.randn(rows, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(rows, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    return q8, weights, q_nope, q_rope


def _decode_inputs(batch: int, context: int, latent_format: str = "fp8"):
    """One decode step's inputs: ``batch`` sequences of ``context`` tokens in a random cache (their pages shuffled),
    the block table, one row a sequence seeing the whole context, and random queries. Returns (layer, block_table,
    token_seq, limits, (q8, weights, q_nope, q_rope))."""
    layer = _random_cache(batch * context, latent_format).dsa_layer(0)
    pages = context // PAGE_SIZE
    block_table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    limits = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return layer, block_table, token_seq, limits, _queries(batch)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over the entries finite in ``want`` (float64)."""
    finite = torch.isfinite(want)
    g, w = got[finite].double(), want[finite].double()
    return float((g - w).norm() / w.norm())


def _latent_row_bytes(latent_format: str) -> int:
    return (RANK + 4 * RANK // 128 if latent_format == "fp8" else 2 * RANK) + 2 * ROPE


def _decode_case(
    batch: int, context: int, topk: int, latent_format: str, copy_tbps: float, reps: int, tiles: dict,
    sweep: bool = True,
) -> dict:
    layer, block_table, token_seq, limits, (q8, weights, q_nope, q_rope) = _decode_inputs(batch, context,
                                                                                         latent_format)
    holder = {}
    tiles = dict(tiles)
    programs_sweep = []
    if batch < SWEEP_BATCH:  # few rows: time how many programs split the context, keep the fastest
        for programs in DECODE_INDEX_PROGRAMS:
            opt = {**tiles["decode_index"], "programs": programs}
            ms = _time_graph_ms(lambda o=opt: dsa.index_scores(q8, weights, layer.index_k, layer.index_scale,
                                                               block_table, token_seq, limits, context,
                                                               rows_per_tile=1, **o), reps)
            programs_sweep.append({"programs": programs, "us": ms * 1e3})
        best = min(programs_sweep, key=lambda row: row["us"])["programs"]
        if STEP_SWEPT_TILES:  # else the step runs the defaults a user gets; the sweep is a record beside it
            tiles["decode_index"] = {**tiles["decode_index"], "programs": best}

    def index():  # the default decode path (dsa.index_topk's auto)
        holder["idx"], _ = dsa.index_topk(
            q8,
            weights,
            layer.index_k,
            layer.index_scale,
            block_table,
            token_seq,
            limits,
            topk,
            max_keys=context,
            rows_per_tile=1,
            **tiles["decode_index"],
        )

    fused = _fused_rows(q8, weights, layer, block_table, token_seq, limits, topk, context, tiles["decode_index"],
                        reps)
    timed = [row for row in fused if "us" in row and row.get("equals_twin")]
    fused_tiles = None  # the fastest exact fused tile
    if timed:
        best = min(timed, key=lambda row: row["us"])
        fused_tiles = {k: best.get(k) for k in FUSED_TILE_KEYS}

    attend_tiles = {}

    def attend():
        return sparse_mla.sparse_mla(
            q_nope,
            q_rope,
            layer.latent_nope,
            layer.latent_scale,
            layer.latent_rope,
            block_table,
            token_seq,
            holder["idx"],
            0.1,
            **attend_tiles,
        )

    scores = dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits,
                              context, rows_per_tile=1, **tiles["decode_index"])
    scores_ms = _time_steady_ms(
        lambda: dsa.index_scores(
            q8,
            weights,
            layer.index_k,
            layer.index_scale,
            block_table,
            token_seq,
            limits,
            context,
            rows_per_tile=1,
            **tiles["decode_index"],
        ),
        reps,
    )
    selected = torch.empty(batch, topk, dtype=torch.int32, device="cuda")
    select_ms = _time_steady_ms(lambda: topk_indices(scores, limits, topk, out=selected), reps)
    select_by_bits = {bits: 1e3 * _time_graph_ms(lambda b=bits: topk_indices(scores, limits, topk, out=selected,
                                                                             digit_bits=b), reps)
                      for bits in (4, 8)}
    torch_topk_ms = _time_steady_ms(lambda: torch.topk(scores, topk, dim=-1, sorted=False), reps)
    topk_sweep = []
    for opt in (TOPK_SWEEP if batch >= SWEEP_BATCH and sweep else ()):  # select tiles where torch.topk ran
        ms = _time_graph_ms(lambda o=opt: topk_indices(scores, limits, topk, out=selected, **o), reps)
        topk_sweep.append({**opt, "us": ms * 1e3})
    decode_select = _decode_select_rows(scores, limits, topk, selected, reps, sweep)
    index_ms = _time_steady_ms(index, reps)
    index_synced_ms = _time_graph_ms(index, reps)
    checks = {
        "topk_equals_twin": bool(torch.equal(topk_indices(scores, limits, topk), topk_indices_torch(scores, limits,
                                                                                                    topk))),
        "index_scores_rel_err_vs_twin": _rel_err(scores[:2], dsa.index_scores_torch(
            q8[:2], weights[:2], layer.index_k, layer.index_scale, block_table, token_seq[:2], limits[:2], context)),
    }
    scores = None  # frees the score buffer (the lambdas above hold the name, not the tensor)
    index()
    mla_tiles = _mla_tiles(tiles, batch)
    splits_sweep = []
    if batch < SWEEP_BATCH:  # few rows: time the position-split counts and keep the fastest for the step
        for splits in MLA_DECODE_SPLITS:
            try:
                ms = _time_graph_ms(lambda n=splits: sparse_mla.sparse_mla(
                    q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table, token_seq,
                    holder["idx"], 0.1, **{**mla_tiles, "splits": n}), reps)
            except Exception as err:  # recorded; the kernel's default split count then runs the step
                splits_sweep.append({"splits": splits, "error": str(err)[:200]})
                continue
            splits_sweep.append({"splits": splits, "us": ms * 1e3})
        timed = [row for row in splits_sweep if "us" in row]
        if timed and STEP_SWEPT_TILES:
            mla_tiles = {**mla_tiles, "splits": min(timed, key=lambda row: row["us"])["splits"]}
    attend_tiles.update(mla_tiles)
    twin_args = (q_nope[:4], q_rope[:4], layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table,
                 token_seq[:4], holder["idx"][:4], 0.1)
    got = attend()[:4]
    checks["sparse_mla_rel_err_vs_twin"] = _rel_err(got, sparse_mla.sparse_mla_torch(
        *twin_args, qk_fp8=bool(mla_tiles.get("qk_fp8"))))
    if mla_tiles.get("qk_fp8"):  # what q.k in e4m3 moves the output from the bf16-q function (not a twin check)
        checks["sparse_mla_rel_err_vs_bf16_q_twin"] = _rel_err(got, sparse_mla.sparse_mla_torch(*twin_args))
    attend_ms = _time_steady_ms(attend, reps)
    attend_synced_ms = _time_graph_ms(attend, reps)
    step_ms = _time_steady_ms(lambda: (index(), attend()), reps)
    step_synced_ms = _time_graph_ms(lambda: (index(), attend()), reps)

    # scores, then auto's select without the fused path; while that path is off, index() is this path (timed once)
    old_select = dsa.auto_select(batch, context, topk)

    def index_decode_select():
        holder["idx"], _ = dsa.index_topk(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq,
                                          limits, topk, max_keys=context, rows_per_tile=1, select=old_select,
                                          **tiles["decode_index"])

    if dsa.FUSED_DECODE_MIN_ROWS is None:
        index_decode_ms, step_decode_ms = index_ms, step_ms
    else:
        index_decode_ms = _time_graph_ms(index_decode_select, reps)
        step_decode_ms = _time_graph_ms(lambda: (index_decode_select(), attend()), reps)
    layer = None
    torch.cuda.empty_cache()
    layered, layered_synced = (_layered_step_us(batch, context, topk, latent_format, block_table,
                                                tiles["decode_index"], mla_tiles, reps, GRAPH_LAYERS)
                               if batch < SWEEP_BATCH else (None, None))
    key_bytes = batch * context * (INDEX_DIM + 4)
    latent_bytes = batch * topk * _latent_row_bytes(latent_format)
    floor_bytes = key_bytes + latent_bytes
    floor_us = floor_bytes / copy_tbps / 1e6
    index_flops = 2 * INDEX_HEADS * INDEX_DIM * context * batch
    attend_flops = 2 * batch * HEADS * topk * (RANK + ROPE + RANK)
    dense = _dense_decode(batch, context, reps, copy_tbps)
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "context": context,
        "latent_format": latent_format,
        "index_topk_us": index_ms * 1e3,
        "index_topk_us_synced": index_synced_ms * 1e3,
        "index_scores_us": scores_ms * 1e3,
        "topk_us": (index_ms - scores_ms) * 1e3,
        "topk_kernel_us": select_ms * 1e3,
        "topk_kernel_us_by_digit_bits": select_by_bits,
        "torch_topk_us": torch_topk_ms * 1e3,
        "topk_kernel_sweep": topk_sweep,
        "topk_decode_sweep": decode_select,
        "fused_sweep": fused,
        "fused_tiles": fused_tiles,
        "old_select": old_select,
        "topk_us_decode_select": (index_decode_ms - scores_ms) * 1e3,
        "step_us_decode_select": step_decode_ms * 1e3,
        "step_over_floor_decode_select": step_decode_ms * 1e3 / floor_us,
        "sparse_mla_us": attend_ms * 1e3,
        "sparse_mla_us_synced": attend_synced_ms * 1e3,
        "sparse_mla_tiles": mla_tiles,
        "sparse_mla_splits_sweep": splits_sweep,
        "index_programs_sweep": programs_sweep,
        "index_tiles": tiles["decode_index"],
        "step_swept_tiles": STEP_SWEPT_TILES if batch < SWEEP_BATCH else None,
        "step_us": step_ms * 1e3,
        "step_us_synced": step_synced_ms * 1e3,
        "step_us_per_layer_in_graph_of_layers": layered,
        "step_us_per_layer_in_graph_of_layers_synced": layered_synced,
        "step_timing": f"CUDA-graph replays, {STEADY_BATCH} back to back a sample (device time, the host ahead): the "
                       "step, index_topk, index_scores, the select kernels, torch.topk, sparse MLA and the dense "
                       "baseline; _synced: one replay a sample with a sync after it (host launch latency included)",
        "graph_layers": GRAPH_LAYERS if layered is not None else None,
        "floor_bytes": floor_bytes,
        "floor_us": floor_us,
        "step_over_floor": step_ms * 1e3 / floor_us,
        "achieved_TBps": floor_bytes / step_ms / 1e9,
        "index_TBps": key_bytes / index_ms / 1e9,
        "index_scores_TBps": (key_bytes + batch * context * 4) / scores_ms / 1e9,
        "index_TFLOPs": index_flops / index_ms / 1e9,
        "sparse_mla_TBps": (latent_bytes + batch * HEADS * (RANK + ROPE + RANK) * 2) / attend_ms / 1e9,
        "sparse_mla_TFLOPs": attend_flops / attend_ms / 1e9,
        **checks,
        **dense,
        "dense_over_step": None if dense["dense_us"] is None else dense["dense_us"] / (step_ms * 1e3),
    }


# Triton select tiles timed on the batch-64 x 128K decode scores (torch.topk runs the step there: the
# default select took 224-251 us against 144-152 us on 2026-11-30): digit bits, scores per program,
# scores per loop step, warps. The default (4 bits, 4096, 1024, 4 warps) is timed as
# topk_kernel_us_by_digit_bits.
TOPK_SWEEP = (
    dict(digit_bits=4, slice_size=1024),
    dict(digit_bits=4, slice_size=16384),
    dict(digit_bits=8, slice_size=1024),
    dict(digit_bits=4, num_warps=8),
    dict(digit_bits=4, block=2048, num_warps=8),
    dict(digit_bits=4, block=512),
)

# Layers per CUDA graph for the per-layer decode time below batch 64: a serving engine replays one graph
# for all layers of a step (DeepSeek-V3.2: 61), where a one-layer graph also times one graph launch per
# layer (H200, 2026-11-30, batch 1: 53.9-56.1 us per layer in 8 against 53.6-54.7 us alone, within the
# run-to-run spread).
GRAPH_LAYERS = 8


# ``topk_decode`` tiles timed on every decode case's scores beside torch.topk (issue 16: torch.topk runs the
# batch-64 step, 144-151 us on 2026-11-30): the default (parts per row from the SM count, 4096-score steps,
# 8 warps, 8-bit digits, 4096 sampled scores, candidates in registers), then three changes (at SWEEP_BATCH rows
# and above only: each is a build of its own, and the acceptance call has a time limit).
TOPK_DECODE_SWEEP = (
    {},
    dict(block=2048),
    dict(parts=4, block=2048, num_warps=4),
    dict(registers=False),
)


# ``dsa.index_topk_fused`` tiles timed in every decode case (CUDA graph of its three launches): the default (1024
# scoring programs, 4096 sampled keys), 2048 programs (the plain scoring kernel's acceptance tile), 264 programs
# (longer runs per program: fewer redundant tau computations and candidate runs), a smaller sample (2048 keys).
FUSED_SWEEP = ({}, dict(programs=2048), dict(programs=264), dict(sample=2048))
FUSED_TILE_KEYS = ("sample", "programs")  # the fastest fused tile is reported by these (the step runs auto's path)


def _fused_rows(q8, weights, layer, block_table, token_seq, limits, topk: int, context: int, index_tiles: dict,
                reps: int) -> list[dict]:
    """One row per FUSED_SWEEP tile: us (CUDA-graph replays of index + top-k), whether the positions equal
    topk_indices_torch of the kernel's own scores, and how many rows the sample misjudged."""
    rows = []
    out = torch.empty(q8.shape[0], topk, dtype=torch.int32, device="cuda")
    redo = torch.empty(q8.shape[0], dtype=torch.int32, device="cuda")
    args = (q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits, topk, context)
    for opt in FUSED_SWEEP:
        tile = {**{k: v for k, v in index_tiles.items() if k != "programs"}, **opt}
        try:
            timing = time_cuda(lambda t=tile: dsa.index_topk_fused(*args, out=out, redo=redo, **t), reps, warmup=1)
            _, scores = dsa.index_topk_fused(*args, out=out, redo=redo, **tile)
            rows.append({**opt, "us": timing.median_us, "timed_as": timing.mode,
                         "equals_twin": bool(torch.equal(out, topk_indices_torch(scores, limits, topk))),
                         "redo_rows": int(redo.sum())})
        except Exception as err:  # recorded; the other tiles still run
            rows.append({**opt, "error": str(err)[:200]})
    return rows


def _decode_select_rows(scores: torch.Tensor, limits: torch.Tensor, topk: int, out: torch.Tensor,
                        reps: int, sweep: bool = True) -> list[dict]:
    """One row per TOPK_DECODE_SWEEP tile: us (timed_as "graph": CUDA-graph replays, the capture worked), whether
    the result equals topk_indices_torch's, and how many rows the sample misjudged (selected again from their
    full scores on the device); then the default tile with row 0 set all equal (what one misjudged row costs)."""
    twin = topk_indices_torch(scores, limits, topk)
    redo = torch.empty(scores.shape[0], dtype=torch.int32, device=scores.device)
    rows = []
    for opt in TOPK_DECODE_SWEEP if scores.shape[0] >= SWEEP_BATCH and sweep else TOPK_DECODE_SWEEP[:1]:
        try:
            timing = time_cuda(lambda o=opt: topk_decode(scores, limits, topk, out=out, redo=redo, **o), reps,
                               warmup=1)
            topk_decode(scores, limits, topk, out=out, redo=redo, **opt)
            rows.append({**opt, "us": timing.median_us, "equals_twin": bool(torch.equal(out, twin)),
                         "redo_rows": int(redo.sum()), "timed_as": timing.mode})
        except Exception as err:  # recorded; the other tiles still run
            rows.append({**opt, "error": str(err)[:200]})
    if scores.shape[0] > 1:  # the default with one row the sample misjudges (all equal: the full-row select)
        scores = scores.clone()
        scores[0] = 1.0
        twin = topk_indices_torch(scores, limits, topk)
        try:
            timing = time_cuda(lambda: topk_decode(scores, limits, topk, out=out, redo=redo), reps, warmup=1)
            topk_decode(scores, limits, topk, out=out, redo=redo)
            rows.append({"row_0_all_equal": True, "us": timing.median_us, "equals_twin": bool(torch.equal(out, twin)),
                         "redo_rows": int(redo.sum()), "timed_as": timing.mode})
        except Exception as err:
            rows.append({"row_0_all_equal": True, "error": str(err)[:200]})
    return rows


def _layered_step_us(batch: int, context: int, topk: int, latent_format: str, block_table: torch.Tensor,
                     index_tiles: dict, mla_tiles: dict, reps: int, layers: int) -> tuple[float, float]:
    """Microseconds per layer of one CUDA graph that runs the decode step (index + top-k + sparse MLA) of
    ``layers`` layers in sequence, each over its own random cache and queries (no layer reads another's
    data from L2): (steady, synced), the median of replays / layers timed as ``_time_steady_ms`` and as
    ``_time_graph_ms``."""
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    limits = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    stack = []
    for _ in range(layers):
        layer = _random_cache(batch * context, latent_format).dsa_layer(0)
        stack.append((layer, *_queries(batch)))

    def step():
        for layer, q8, weights, q_nope, q_rope in stack:
            idx, _ = dsa.index_topk(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits,
                                    topk, max_keys=context, rows_per_tile=1, **index_tiles)
            sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                  block_table, token_seq, idx, 0.1, **mla_tiles)

    us = _time_steady_ms(step, reps) * 1e3 / layers
    synced = _time_graph_ms(step, reps) * 1e3 / layers
    stack = None
    torch.cuda.empty_cache()
    return us, synced


def _mla_tiles(tiles: dict, rows: int) -> dict:
    """The swept sparse MLA tiles for ``rows`` query rows: a position-split count is kept only at
    the sweep's batch (elsewhere the kernel picks it: more slices at batch 1, and none in prefill,
    whose partial-output workspace would be rows x splits x 128 x 512 x 4 B)."""
    return {k: v for k, v in tiles["mla"].items() if k != "splits" or rows == SWEEP_BATCH}


def _dense_decode(batch: int, context: int, reps: int, copy_tbps: float) -> dict:
    """Dense absorbed MLA decode as a serving engine without a fused kernel runs it, timed like the DSA
    step (CUDA-graph replays back to back, ``_time_steady_ms``; the synced figure beside): per sequence, 128 query
    heads x the whole dense latent cache [S, 576] bf16: scores = q @ KV^T (bf16 matmul), fp32 softmax,
    o = P @ KV[:, :512].

    Byte floor: the latent cache read once, B * S * 1152 B (bf16) at the same-run copy rate; the fp8
    cache of the DSA path (656 B/token) would give B * S * 656 B. None when the buffers would not
    fit in 60 GiB."""
    kv_bytes = batch * context * (RANK + ROPE) * 2
    row = {"dense_method": "absorbed MLA, bf16 bmm + fp32 softmax + bf16 bmm, CUDA graph",
           "dense_floor_us": kv_bytes / copy_tbps / 1e6,
           "dense_floor_fp8_cache_us": batch * context * _latent_row_bytes("fp8") / copy_tbps / 1e6,
           "dense_us": None}
    if kv_bytes + batch * HEADS * context * 10 > 60 * 2**30:
        return row
    kv = torch.randn(batch, context, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, HEADS, RANK + ROPE, device="cuda", dtype=torch.bfloat16)

    def dense():
        logits = torch.bmm(q, kv.transpose(1, 2))
        probs = torch.softmax(logits.float() * 0.1, dim=-1).to(torch.bfloat16)
        return torch.bmm(probs, kv[..., :RANK])

    ms = _time_steady_ms(dense, reps)
    row.update(dense_us_synced=_time_graph_ms(dense, reps) * 1e3)
    row.update(dense_us=ms * 1e3, dense_TBps=kv_bytes / ms / 1e9, dense_over_floor=ms * 1e3 / row["dense_floor_us"])
    return row


# Rows at the end of the prefill (the longest) on which the prefill sweeps run.
PREFILL_TAIL_ROWS = 4096
MEASURED_KEYS = ("kernel", "us", "TFLOPs", "key_TBps", "error", "all_rows_ms", "all_rows_TFLOPs")
"""A sweep row's measured fields; the rest are the tile's options."""


def _prefill_case(
    length: int, topk: int, latent_format: str, reps: int, max_score_bytes: int, attend_rows: int, tiles: dict,
    index_sweep: Sequence[dict] = (), mla_sweep: Sequence[dict] = (), selects: Sequence[str] = ("auto",),
) -> dict:
    """One causal prefill of ``length`` tokens. ``index_sweep``: indexer tile options timed on the last
    4096 rows first (a tile that fails to compile is recorded with its error); the fastest then runs
    the whole prefill. ``mla_sweep``: sparse MLA options timed on the last 4096 rows over the kernel's own
    selection; the fastest then runs the whole prefill. ``selects``: ``index_topk`` select methods each
    timed over the whole prefill (scores + top-k); the first is the step's."""
    tiles = dict(tiles)
    n_tail = PREFILL_TAIL_ROWS
    last = slice(length - n_tail, length)
    cache = _random_cache(length, latent_format)
    layer = cache.dsa_layer(0)
    block_table = torch.arange(-(-length // PAGE_SIZE), device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(length, device="cuda", dtype=torch.int32)
    limits = torch.arange(1, length + 1, device="cuda", dtype=torch.int32)
    q8, weights, _, _ = _queries(length)
    q_nope = torch.randn(attend_rows, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(attend_rows, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    holder = {}

    def index(select: str = selects[0]):
        holder["idx"], holder["stats"] = dsa.index_topk(
            q8,
            weights,
            layer.index_k,
            layer.index_scale,
            block_table,
            token_seq,
            limits,
            topk,
            max_score_bytes=max_score_bytes,
            select=select,
            **tiles["prefill_index"],
        )

    mla_options = _mla_tiles(tiles, attend_rows)

    def attend():
        idx = holder["idx"]
        for r0 in range(0, length, attend_rows):
            r1 = min(length, r0 + attend_rows)
            sparse_mla.sparse_mla(
                q_nope[: r1 - r0],
                q_rope[: r1 - r0],
                layer.latent_nope,
                layer.latent_scale,
                layer.latent_rope,
                block_table,
                token_seq[r0:r1],
                idx[r0:r1],
                0.1,
                **mla_options,
            )

    rows_per_chunk = max(1, max_score_bytes // (4 * length))

    def scores_only(options: dict | None = None):
        # the chunks' tile rows given, as ``dsa.index_topk`` decides them once a call (else each call reads back
        # whether its rows are one sequence's), and its chunk order
        options = {"rows_per_tile": dsa.prefill_rows_per_tile(q8.device),
                   **(tiles["prefill_index"] if options is None else options)}
        starts = range(0, length, rows_per_chunk)  # in ``dsa.index_topk``'s order
        for r0 in reversed(starts) if dsa.CHUNKS_WIDEST_FIRST else starts:
            r1 = min(length, r0 + rows_per_chunk)
            dsa.index_scores(
                q8[r0:r1],
                weights[r0:r1],
                layer.index_k,
                layer.index_scale,
                block_table,
                token_seq[r0:r1],
                limits[r0:r1],
                -(-r1 // dsa.KEY_BLOCK) * dsa.KEY_BLOCK,
                **options,
            )

    tail_flops = 2 * INDEX_HEADS * INDEX_DIM * sum(range(length - PREFILL_TAIL_ROWS + 1, length + 1))
    all_flops = 2 * INDEX_HEADS * INDEX_DIM * length * (length + 1) / 2
    sweep_rows = []
    for opt in index_sweep:
        try:
            ms = _time_ms(lambda o=opt: dsa.index_scores(q8[last], weights[last], layer.index_k, layer.index_scale,
                                                         block_table, token_seq[last], limits[last], length, **o),
                          reps)
        except Exception as err:  # a tile that does not compile is recorded, the others still run
            sweep_rows.append({"kernel": "index_scores prefill last 4096", **opt, "error": str(err)[:200]})
            continue
        sweep_rows.append({"kernel": "index_scores prefill last 4096", **opt, "us": ms * 1e3,
                           "TFLOPs": tail_flops / ms / 1e9})
        if len(index_sweep) > 1:  # each tile also over all rows (the acceptance line's measure)
            all_ms = time_cuda(lambda o=opt: scores_only(o), reps, warmup=1).median_us / 1e3  # as the line's
            sweep_rows[-1].update(all_rows_ms=all_ms, all_rows_TFLOPs=all_flops / all_ms / 1e9)
    timed = [row for row in sweep_rows if "us" in row]
    if timed:  # over all rows where each tile ran there too (the acceptance line's measure), else the tail
        best = min(timed, key=lambda row: row.get("all_rows_ms", row["us"]))
        tiles["prefill_index"] = {k: v for k, v in best.items() if k not in MEASURED_KEYS}
    tail = dsa.index_scores(q8[last], weights[last], layer.index_k, layer.index_scale, block_table,
                            token_seq[last], limits[last], length, **tiles["prefill_index"])
    tail_limits = limits[last]
    tail_select = {"triton_8bit": _time_ms(lambda: topk_indices(tail, tail_limits, topk, digit_bits=8), reps),
                   "torch_topk": _time_ms(lambda: torch.topk(tail, topk, dim=-1, sorted=False), reps),
                   "prefilter": _time_ms(lambda: topk_prefiltered(tail, tail_limits, topk), reps),
                   "prefilter_triton": _time_ms(lambda: topk_prefiltered(tail, tail_limits, topk, final="triton"),
                                                reps)}
    tail_select["triton_equals_twin_rows0_8"] = bool(torch.equal(topk_indices(tail[:8], tail_limits[:8], topk),
                                                                 topk_indices_torch(tail[:8], tail_limits[:8], topk)))
    pre, fell_back = topk_prefiltered(tail, tail_limits, topk)
    want = torch.topk(tail, topk, dim=-1, sorted=False).indices
    tail_select["prefilter_fallback_rows"] = fell_back
    tail_select["prefilter_equals_torch_topk_sets"] = bool(torch.equal(pre.sort(dim=1).values,
                                                                       want.int().sort(dim=1).values))
    tail = pre = want = None
    mla_rows = []
    index()
    tail_idx = holder["idx"][last]
    selected_tail = sum(min(t + 1, topk) for t in range(length - PREFILL_TAIL_ROWS, length))
    for opt in mla_sweep:
        try:
            ms = _time_ms(lambda o=opt: sparse_mla.sparse_mla(
                q_nope[:n_tail], q_rope[:n_tail], layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table,
                token_seq[last], tail_idx, 0.1, **o), reps)
        except Exception as err:  # recorded; the others still run
            mla_rows.append({"kernel": "sparse_mla prefill last 4096", **opt, "error": str(err)[:200]})
            continue
        mla_rows.append({"kernel": "sparse_mla prefill last 4096", **opt, "us": ms * 1e3,
                         "TFLOPs": 2 * HEADS * selected_tail * (RANK + ROPE + RANK) / ms / 1e9})
    timed = [row for row in mla_rows if "us" in row]
    if timed:
        best = min(timed, key=lambda row: row["us"])
        mla_options = {k: v for k, v in best.items() if k not in MEASURED_KEYS}
    tail_idx = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    index_ms = _time_ms(index, reps)
    peak_bytes = torch.cuda.max_memory_allocated()
    stats = holder["stats"]
    select_ms = {selects[0]: index_ms}
    select_sets = {}
    first_idx = holder["idx"]
    for select in selects[1:]:
        select_ms[select] = _time_ms(lambda s=select: index(s), reps)
        select_sets[select] = _same_sets(holder["idx"], first_idx)
    first_idx = None
    index()  # the step's selection again, for sparse MLA and the twin checks
    # the indexer line's measure (index_scores_all_TFLOPs): the chunk loop's device time, as CUDA-graph replays (as
    # every other kernel line here). Timed eager, the loop also holds the host's work between chunks where the narrow
    # last chunks outrun it: 4% more in a process that compiled its kernels than in one that loaded them from
    # Triton's cache, while index_topk's time was the same (benchmarks/gpu-2026-12-03-dsa-s19, call 4). The eager
    # figure stays beside it, and top-k is index_topk's time less it (both eager).
    all_scores_ms = _time_ms(scores_only, reps)
    scores_timing = time_cuda(scores_only, reps, warmup=1)
    graph_scores_ms = scores_timing.median_us / 1e3
    scores_ms = _time_ms(
        lambda: dsa.index_scores(
            q8[last],
            weights[last],
            layer.index_k,
            layer.index_scale,
            block_table,
            token_seq[last],
            limits[last],
            length,
            **tiles["prefill_index"],
        ),
        reps,
    )
    attend_ms = _time_ms(attend, reps)
    twin_checks = _prefill_twin_checks(q8, weights, q_nope, q_rope, layer, block_table, token_seq, limits,
                                       holder["idx"], length, tiles, mla_options)
    total_ms = index_ms + attend_ms
    selected = sum(min(t + 1, topk) for t in range(length))
    index_flops = 2 * INDEX_HEADS * INDEX_DIM * length * (length + 1) / 2
    attend_flops = 2 * HEADS * selected * (RANK + ROPE + RANK)
    dense_ms, dense_note = _dense_prefill_ms(length, reps)
    dense_flops = 2 * HEADS * (NOPE + ROPE + VDIM) * length * length / 2
    result = {
        "tokens": length,
        "latent_format": latent_format,
        "index_topk_ms": index_ms,
        "index_chunks": stats.chunks,
        "peak_allocated_bytes_during_index": peak_bytes,
        "peak_score_bytes": stats.peak_score_bytes,
        "prefilter_fallback_rows": stats.prefilter_fallback_rows,
        "select": selects[0],
        "index_topk_ms_by_select": select_ms,
        "select_sets_equal_first": select_sets,
        "index_scores_ms": all_scores_ms,
        "topk_ms": index_ms - all_scores_ms,
        "index_scores_graph_ms": graph_scores_ms,
        "index_scores_graph_timing": scores_timing.mode + (f" ({scores_timing.fallback})" if scores_timing.fallback
                                                           else ""),
        "index_scores_all_TFLOPs": index_flops / graph_scores_ms / 1e9,
        "index_scores_all_TFLOPs_eager": index_flops / all_scores_ms / 1e9,
        "index_scores_last4096_ms": scores_ms,
        "index_scores_TFLOPs": tail_flops / scores_ms / 1e9,
        "index_TFLOPs_with_topk": index_flops / index_ms / 1e9,
        "sparse_mla_ms": attend_ms,
        "sparse_mla_TFLOPs": attend_flops / attend_ms / 1e9,
        "total_ms": total_ms,
        "dense_sdpa_ms": dense_ms,
        "dense_sdpa_note": dense_note,
        "dense_sdpa_TFLOPs": dense_flops / dense_ms / 1e9,
        "speedup_vs_dense": dense_ms / total_ms,
        "sparse_mla_rows_per_launch": attend_rows,
        "sparse_mla_upconvert_auto": sparse_mla.UPCONVERT_AUTO,
        "sparse_mla_upconverts_chunks": sparse_mla.upconvert_worth(attend_rows, HEADS, topk, block_table),
        "sparse_mla_bf16_flags": sparse_mla.sparse_mla_gluon.bf16_flags(),
        "index_tiles": tiles["prefill_index"],
        # the library's default prefill scoring kernel where the tiles leave it open (0 groups: the tl tile)
        "index_default": dict(wg_groups=dsa.PREFILL_WG_GROUPS, wg_carry=dsa.PREFILL_WG_CARRY,
                              wg_tma=dsa.PREFILL_WG_TMA, wg_reg_a=dsa.PREFILL_WG_REG_A, ws_rows=dsa.PREFILL_WS_ROWS,
                              ws_stages=dsa.PREFILL_WS_STAGES, rows_per_tile=dsa.prefill_rows_per_tile(q8.device)),
        "sparse_mla_tiles": mla_options,
        "topk_last4096_rows_ms": tail_select,
        "index_sweep": sweep_rows,
        "sparse_mla_sweep": mla_rows,
        **twin_checks,
    }
    torch.cuda.empty_cache()
    return result


def _same_sets(got: torch.Tensor, want: torch.Tensor, rows: int = 256) -> dict:
    """Whether two selections keep the same position sets (each row sorted; order and tie choice aside) on the
    first and last ``rows`` rows, and how many of those rows differ."""
    pick = torch.cat([torch.arange(min(rows, got.shape[0])),
                      torch.arange(max(0, got.shape[0] - rows), got.shape[0])]).to(got.device)
    differ = (got[pick].sort(dim=1).values != want[pick].sort(dim=1).values).any(dim=1)
    return {"rows_checked": int(pick.numel()), "rows_differing": int(differ.sum())}


def _prefill_twin_checks(q8, weights, q_nope, q_rope, layer, block_table, token_seq, limits, idx, length: int,
                         tiles: dict, mla_options: dict, rows: int = 4) -> dict:
    """The prefill kernels against their twins on the last ``rows`` query rows (full causal context):
    index scores with the timed indexer tiles, sparse MLA with the timed tiles over the kernel's own
    selection. A check that fails to run is recorded (``twin_check_error``), never raised."""
    last = slice(length - rows, length)
    out = {}
    try:
        got = dsa.index_scores(q8[last], weights[last], layer.index_k, layer.index_scale, block_table, token_seq[last],
                               limits[last], length, **tiles["prefill_index"])
        out["index_scores_rel_err_vs_twin"] = _rel_err(got, dsa.index_scores_torch(
            q8[last], weights[last], layer.index_k, layer.index_scale, block_table, token_seq[last], limits[last],
            length))
        args = (q_nope[:rows], q_rope[:rows], layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table,
                token_seq[last], idx[last], 0.1)
        out["sparse_mla_rel_err_vs_twin"] = _rel_err(sparse_mla.sparse_mla(*args, **mla_options),
                                                     sparse_mla.sparse_mla_torch(*args, **mla_options))
    except Exception as err:  # noqa: BLE001 - recorded: the row then counts as untwinned in the report
        out["twin_check_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    return out


def _dense_prefill_ms(length: int, reps: int) -> tuple[float, str]:
    """Causal SDPA on MLA's MHA-mode shapes (128 heads, q/k 192, v 128), each backend forced in turn
    (Flash, cuDNN, memory-efficient); the first that runs is timed. Returns (ms, note naming the
    backend that ran and why the ones before it were refused)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, HEADS, length, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(1, HEADS, length, VDIM, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    refused = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                ms = _time_ms(lambda: sdpa(q, k, v, is_causal=True), reps)
        except RuntimeError as err:
            refused.append(f"{backend.name}: {str(err).splitlines()[0][:120]}")
            continue
        note = f"{backend.name} ran (q,k 192 / v 128)" + (f"; refused: {' | '.join(refused)}" if refused else "")
        torch.cuda.empty_cache()
        return ms, note
    raise RuntimeError("no SDPA backend ran causal 192/128 attention: " + " | ".join(refused))


def _prefill_forms(length: int, topk: int, rows: int, reps: int, tiles: dict) -> dict:
    """Per query row: absorbed latent kernel vs the per-head 192/128 form (torch gather + matmul)."""
    cache = _random_cache(length, "bf16")
    layer = cache.dsa_layer(0)
    block_table = torch.arange(length // PAGE_SIZE, device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(rows, device="cuda", dtype=torch.int32)
    idx = torch.stack([torch.randperm(length, device="cuda")[:topk] for _ in range(rows)]).int()
    q_nope = torch.randn(rows, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(rows, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)

    def absorbed_ms(options: dict) -> float:
        return _time_ms(
            lambda: sparse_mla.sparse_mla(
                q_nope,
                q_rope,
                layer.latent_nope,
                None,
                layer.latent_rope,
                block_table,
                token_seq,
                idx,
                0.1,
                **options,
            ),
            reps,
        )

    absorbed_tiles = tiles["mla"]
    try:
        absorbed = absorbed_ms(absorbed_tiles)
    except Exception:  # the fp8-tuned tile can need more shared memory with a bf16 latent
        absorbed_tiles = {}
        absorbed = absorbed_ms(absorbed_tiles)
    keys = torch.randn(length, HEADS, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(length, HEADS, VDIM, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(rows, HEADS, 1, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)

    def per_head():
        k_sel = keys[idx.long()].permute(0, 2, 1, 3)
        v_sel = values[idx.long()].permute(0, 2, 1, 3)
        return torch.softmax((q @ k_sel.transpose(-1, -2)).float() * 0.1, -1).to(torch.bfloat16) @ v_sel

    per_head_ms = _time_ms(per_head, reps)
    torch.cuda.empty_cache()
    return {
        "context": length,
        "rows": rows,
        "absorbed_triton_us_per_row": absorbed * 1e3 / rows,
        "absorbed_tiles": absorbed_tiles,
        "per_head_torch_us_per_row": per_head_ms * 1e3 / rows,
        "absorbed_bytes_per_row": topk * (2 * RANK + 2 * ROPE),
        "per_head_bytes_per_row": topk * HEADS * (NOPE + ROPE + VDIM) * 2,
    }


def run_dsa_bench(
    out_dir: Path,
    *,
    decode_batches: Sequence[int] = (1, 16, 64),
    contexts: Sequence[int] = (8192, 32768, 131072),
    prefill_lengths: Sequence[int] = (8192, 32768, 131072),
    topk: int = 2048,
    latent_format: str = "fp8",
    reps: int = 10,
    prefill_reps: int = 3,
    max_score_bytes: int = 2 << 30,
    attend_rows: int = 16384,
) -> dict:
    """Run the DSA benchmark grid on the current CUDA device; write JSON + Markdown to ``out_dir``."""
    if not torch.cuda.is_available():
        raise InputError(
            "the DSA benchmark needs a CUDA GPU and none is visible",
            hint="run it on the GPU machine, e.g. `adapt bench kernels --dsa` there",
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name(),
        "pdl": pdl.active(torch.device("cuda")),  # programmatic dependent launch of the decode chain (kernels.pdl)
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shapes": {
            "heads": HEADS,
            "latent": RANK,
            "rope": ROPE,
            "index_heads": INDEX_HEADS,
            "index_dim": INDEX_DIM,
            "topk": topk,
            "latent_format": latent_format,
        },
        "ceilings": measure_ceilings(copy_gib=2, reps=reps),
    }
    copy = result["ceilings"]["copy_tbps"]
    sweep = _tile_sweep(topk, latent_format, reps)
    tiles = _fastest_tiles(sweep)
    result.update(decode=[], prefill=[], tile_sweep=sweep, tiles_used=tiles)
    _write(out_dir, result)
    for s in contexts:
        for b in decode_batches:
            result["decode"].append(_decode_case(b, s, topk, latent_format, copy, reps, tiles))
            _write(out_dir, result)
    result["prefill_forms"] = _prefill_forms(min(prefill_lengths), topk, 16, reps, tiles)
    for t in prefill_lengths:
        result["prefill"].append(
            _prefill_case(t, topk, latent_format, prefill_reps, max_score_bytes, attend_rows, tiles)
        )
        _write(out_dir, result)
    return result


def _fastest_tiles(sweep: list[dict]) -> dict:
    """The fastest measured options of each kernel in the sweep (what the grid then runs)."""
    keep = {
        "index_scores decode": ("key_block", "num_stages", "num_warps", "programs"),
        "index_scores prefill 4096": ("rows_per_tile", "num_stages", "num_warps"),
        "sparse_mla decode b64": ("block_h", "block_k", "v_split", "qk_chunk", "num_warps", "num_stages",
                                  "splits", "prefetch", "groups4", "qk_fp8", "swap_ab", "gluon"),
    }
    names = {
        "index_scores decode": "decode_index",
        "index_scores prefill 4096": "prefill_index",
        "sparse_mla decode b64": "mla",
    }
    tiles = {"decode_index": {}, "prefill_index": {}, "mla": {}}
    for kernel, fields in keep.items():
        timed = [row for row in sweep if row["kernel"] == kernel and "us" in row]
        if timed:
            best = min(timed, key=lambda row: row["us"])
            tiles[names[kernel]] = {f: best[f] for f in fields if f in best}
    return tiles


# Sparse MLA tiles timed at batch 64 x 128K decode (position splits, except where a tile names
# them, left to the kernel: 1 when rows x head blocks x v_split fill the 132 SMs, more otherwise).
# Shared memory per program as Triton reports it for sm_90 (e4m3 latent, R 512; H200 limit
# 227 KB): 104 KB, 105 KB (128 KB when split), 105 KB.
MLA_SWEEP = (
    dict(block_h=64, block_k=64, v_split=2, num_warps=8, num_stages=1),  # run 2's fastest (593 us events)
    dict(block_h=64, block_k=32, v_split=1, qk_chunk=512, num_warps=8, num_stages=2, groups4=False),  # fused
    # q loaded once, one q.k dot over the whole latent, output in 2 slices, partials through the
    # split path (its fp32 epilogue compiled with the fewest register spills, sm_90 AOT: 16 B stack).
    dict(block_h=64, block_k=32, v_split=2, qk_chunk=512, num_warps=8, num_stages=2, splits=2),
)
SWEEP_BATCH = 64
# The decode step's timing (``_time_steady_ms``): CUDA-graph replays this many back to back a sample, so that a
# step of tens of microseconds is timed as the device runs it in a serving loop (the host ahead), not with the
# host's launch latency of each replay in it. The per-replay figure (a sync after each) is kept beside it as
# ``*_synced``: on 2026-12-02 (H100, benchmarks/gpu-2026-12-02-dsa-s14, call 3) it swung between processes (the
# batch-1 scoring graph 10-20 us a replay, 7.3-7.5 back to back; the one-layer step 40.4-42.9 against 37.5).
STEADY_BATCH = 20


def _time_steady_ms(fn, reps: int) -> float:
    """Median milliseconds of one CUDA-graph replay of ``fn``, replays timed STEADY_BATCH back to back a sample."""
    return time_cuda(fn, reps, warmup=1, batch=STEADY_BATCH).median_us / 1e3


# Below SWEEP_BATCH rows the indexer's program count and the sparse MLA's position splits are timed alone (the
# sweeps below). False: the step runs the library's defaults (what a user gets) and the sweeps are a record beside
# it; True: the step takes each sweep's fastest (the harness before session 14, when the pick, made on a ~10 us
# graph timed alone, changed from one process to the next and was slower in the step than the default: 2026-12-02,
# benchmarks/gpu-2026-12-02-dsa-s13 and -s14).
STEP_SWEPT_TILES = False
# Position-split counts timed for sparse MLA decode below SWEEP_BATCH rows (batch 1: 2 programs of
# 64 heads per split with the fused tile); the fastest is kept for the step.
MLA_DECODE_SPLITS = (4, 8, 16, 32, 64)
# Indexer programs (context splits) timed for decode below SWEEP_BATCH rows (batch 1 x 128K: 2048 key
# tiles of 64, so 2048 programs give one tile each, 264 give eight); the fastest is kept for the step.
DECODE_INDEX_PROGRAMS = (264, 528, 1056, 2048)

# Index tiles measured fastest on the H200 in run 2 (benchmarks/dsa/2026-11-29-run2-grid.json; decode: the
# dsa.DECODE_* defaults, session 7's grid, benchmarks/gpu-2026-12-01-dsa-s7); the acceptance mode uses them
# instead of re-sweeping.
RUN2_INDEX_TILES = {
    # no ``programs``: index_scores' decode default (DECODE_PROGRAMS, at most DECODE_PROGRAMS_PER_ROW a row); passing
    # DECODE_PROGRAMS gave batch 1 2048 one-tile programs instead of the default 512 (until session 14)
    "decode_index": dict(key_block=dsa.DECODE_KEY_BLOCK, num_stages=dsa.DECODE_STAGES, num_warps=4),
    "prefill_index": dict(rows_per_tile=4, num_stages=3, num_warps=4),
}


def _mla_sweep(layer, block_table, token_seq, q_nope, q_rope, idx, options, reps) -> list[dict]:
    """Graph-timed sparse MLA decode over ``idx`` for each tile option (a tile that does not
    compile, e.g. out of shared memory, is recorded with its error)."""
    batch, topk = idx.shape
    rows = []
    for opt in options:
        try:
            ms = _time_graph_ms(
                lambda o=opt: sparse_mla.sparse_mla(
                    q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table,
                    token_seq, idx, 0.1, **o,
                ),
                reps,
            )
        except Exception as err:  # a tile that does not compile is recorded, the others still run
            rows.append({"kernel": "sparse_mla decode b64", **opt, "error": str(err)[:200]})
            continue
        rows.append(
            {
                "kernel": "sparse_mla decode b64",
                **opt,
                "us": ms * 1e3,
                "TFLOPs": 2 * batch * HEADS * topk * (2 * RANK + ROPE) / ms / 1e9,
            }
        )
    return rows


def run_dsa_acceptance(
    out_dir: Path, *, topk: int = 2048, latent_format: str = "fp8", reps: int = 10, sweep: bool = True,
    prefill_only: bool = False, prefill: bool = True, prefill_selects: Sequence[str] | None = None,
    decode_batches: Sequence[int] = (1, 64),
) -> dict:
    """The acceptance subset: same-run ceilings (torch and Triton 16-byte copy), a sparse MLA tile
    sweep at batch 64 x 128K, decode at batch 1 and 64 x 128K, prefill 128K (indexer + top-k +
    sparse MLA and dense causal SDPA, with the indexer, sparse MLA and select sweeps of
    ``_prefill_case``). ``sweep=False``: the kernels' default tiles only (one row in each sweep).
    ``prefill_only``: ceilings and the prefill case only (its decode acceptance lines then count as
    unmet); ``prefill=False``: the decode cases only (the prefill lines then count as unmet); ``decode_batches``: the
    decode cases' batches (1 and 64; a batch left out leaves its lines unmet).
    Writes ``dsa_bench.json`` / ``.md`` into ``out_dir``."""
    if not torch.cuda.is_available():
        raise InputError(
            "the DSA benchmark needs a CUDA GPU and none is visible",
            hint="run it on the GPU machine, e.g. `adapt bench kernels --dsa` there",
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ceilings = measure_ceilings(copy_gib=2, reps=reps)
    result = {
        "mode": "acceptance",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name(),
        "pdl": pdl.active(torch.device("cuda")),  # programmatic dependent launch of the decode chain (kernels.pdl)
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shapes": {"heads": HEADS, "latent": RANK, "rope": ROPE, "index_heads": INDEX_HEADS,
                   "index_dim": INDEX_DIM, "topk": topk, "latent_format": latent_format},
        "ceilings": ceilings,
        "decode_gluon_candidates": _topk.DECODE_GLUON,
        "few_rows_select": dsa.FEW_ROWS_SELECT,
        "few_rows_decode_options": dsa.FEW_ROWS_DECODE_OPTIONS,
        "few_rows_grid_options": dsa.FEW_ROWS_GRID_OPTIONS,
        "combine_at_once": sparse_mla.COMBINE_AT_ONCE,
        "mla_gluon_sliced": sparse_mla.GLUON_SLICED,
        "mla_gluon_flags": {**sparse_mla.sparse_mla_gluon.GLUON_FLAGS, **sparse_mla.sparse_mla_gluon.CP_FLAGS},
        "step_swept_tiles": STEP_SWEPT_TILES,
        "timer_warm_ms": timer.WARM_MS,
        "decode": [],
        "prefill": [],
    }
    batch, context = 64, 131072
    if prefill_only:
        tiles = {**RUN2_INDEX_TILES, "mla": {}}
        result.update(tile_sweep=[], tiles_used=tiles, errors=[])
        _run_prefill(result, context, topk, latent_format, tiles, sweep, selects=prefill_selects)
        _write(out_dir, result)
        return result
    cache = _random_cache(batch * context, latent_format)
    layer = cache.dsa_layer(0)
    pages = context // PAGE_SIZE
    block_table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    _, _, q_nope, q_rope = _queries(batch)
    idx = torch.stack([torch.randperm(context, device="cuda")[:topk] for _ in range(batch)]).int()
    mla_rows = _mla_sweep(layer, block_table, token_seq, q_nope, q_rope, idx,
                          ACCEPTANCE_MLA_SWEEP if sweep else ({},), reps)
    del cache, layer
    torch.cuda.empty_cache()
    tiles = {**RUN2_INDEX_TILES, **{"mla": _fastest_tiles(mla_rows)["mla"]}}
    result.update(tile_sweep=mla_rows, tiles_used=tiles)
    _write(out_dir, result)
    result["errors"] = []
    for b in decode_batches:
        try:
            result["decode"].append(_decode_case(b, context, topk, latent_format, ceilings["copy_tbps"], reps,
                                                       tiles, sweep))
        except Exception as err:  # recorded (its acceptance lines count as unmet); the other cases still run
            result["errors"].append(f"decode batch {b}: {type(err).__name__}: {str(err)[:300]}")
        torch.cuda.empty_cache()
        _write(out_dir, result)
    _run_prefill(result, context, topk, latent_format, tiles, sweep, run=prefill, selects=prefill_selects)
    _write(out_dir, result)
    return result


def _run_prefill(result: dict, context: int, topk: int, latent_format: str, tiles: dict, sweep: bool,
                 run: bool = True, selects: Sequence[str] | None = None) -> None:
    """The acceptance prefill case into ``result`` when ``run`` (an error is recorded, as for decode), then
    the acceptance lines."""
    try:
        if run:
            result["prefill"].append(_prefill_case(context, topk, latent_format, 2, 2 << 30, 16384, tiles,
                                                   index_sweep=PREFILL_INDEX_SWEEP if sweep else ({},),
                                                   mla_sweep=PREFILL_MLA_SWEEP if sweep else ({},),
                                                   selects=tuple(selects) if selects else
                                                   ("auto", "torch", "prefilter_triton") if sweep else ("auto",)))
    except Exception as err:  # recorded, as above
        result["errors"].append(f"prefill: {type(err).__name__}: {str(err)[:300]}")
    result["acceptance"] = acceptance_lines(result)


# Indexer prefill tiles timed in the acceptance run, all the stacked form (one MMA over rows x 64
# heads per key tile). sm_90 AOT, Triton 3.6, registers per thread / stack bytes / shared KB:
# 4 rows x 64 keys, 8 warps (123 / 0 / 50; fastest on 2026-11-30 at 646 TFLOP/s on the last 4096 rows, the
# default); 8 x 64, 8 warps (230 / 0 / 83); 4 x 128, 8 warps (242 / 0 / 68); 4 x 64, 4 warps (232 / 0 / 50);
# 2 x 64, 4 warps (125 / 0 / 33; 566 TFLOP/s on 2026-11-30).
# Third session (one-page key tiles: one block-table entry per tile; sm_90 loop per key tile 339 -> 280
# instructions at 4 x 64 on 8 warps, 388 -> 292 at 2 x 64 on 4 warps, 123-125 registers): 4 x 64 on 8 warps,
# its unmasked full-tile loop (158 registers: one program per SM), 2 and 4 stages, and 2 x 64 on 4 warps
# (the wider tiles above were slower in both earlier calls and are not re-run). H200, commit 4f58965, TFLOP/s
# on the last 4096 rows: 663, 399, 662, 671, 740 (now the default).
# (The tl rows name gluon=False since session 18: 4-row tiles left to the library run the warp-specialised kernel.)
PREFILL_INDEX_SWEEP = (
    dict(rows_per_tile=4, key_block=64, num_stages=3, num_warps=8, gluon=False),
    dict(rows_per_tile=4, key_block=64, num_stages=3, num_warps=8, full_tiles=True, gluon=False),
    dict(rows_per_tile=4, key_block=64, num_stages=2, num_warps=8, gluon=False),
    dict(rows_per_tile=4, key_block=64, num_stages=4, num_warps=8, gluon=False),
    dict(rows_per_tile=2, key_block=64, num_stages=3, num_warps=4, gluon=False),
    # Fourth session: the Gluon kernels of adapt.kernels.dsa_gluon (the same 2 x 64 tile on 4 warps, the MMA of one
    # key tile or row overlapped with the epilogue of the one before). H200, benchmarks/gpu-2026-12-01-dsa-s4-indexer,
    # TFLOP/s on the last 4096 rows / over all 128K rows, tl 2 x 64 in the same call 720 / 738 and 706 / 737:
    # stacked (186 registers, 2 programs per SM) 484 / 499; capped at 168 registers (162, 3 per SM) with 3, 4, 2
    # stages 681 / 686, 684 / 683, 688 / 687 (656 / 681 in the next call); stacked without the weights re-read
    # 644 / 651; row-split (117 registers, 4 per SM) with 3, 2, 4 stages 708 / 682, 696 / 686, 701 / 677, and
    # 4 rows 628 / 637. None beat tl over all rows; the row-split one stays here as the same-run comparison.
    dict(rows_per_tile=2, key_block=64, num_stages=2, gluon=True, gluon_split_rows=True),
    # the row-split kernel capped at 96 registers (96, no spill: 5 programs per SM; the tl tile spills 104 bytes
    # at that cap): 3 / 2 stages 733 / 719 and 731 / 717 against tl 722 / 739 in the same call (534dcd7)
    dict(rows_per_tile=2, key_block=64, num_stages=3, gluon=True, gluon_split_rows=True, gluon_maxnreg=96),
    dict(rows_per_tile=2, key_block=64, num_stages=2, gluon=True, gluon_split_rows=True, gluon_maxnreg=96),
    # Session 17: the multi-warpgroup Gluon kernel (dsa.PREFILL_WG_GROUPS / PREFILL_WG_CARRY: one warpgroup with the
    # carried epilogue is the library's default on sm_90), and two warpgroups on 128-key tiles
    dict(rows_per_tile=2, key_block=64, num_stages=3, gluon=True, gluon_warpgroups=1, gluon_carry=True),
    dict(rows_per_tile=2, key_block=128, num_stages=3, gluon=True, gluon_warpgroups=2, gluon_carry=True),
    # Session 18: the warp-specialised kernel, a warpgroup every 2 rows sharing each key page (4 rows at 3 stages is
    # the library's default on sm_90, dsa.PREFILL_WS_ROWS / PREFILL_WS_STAGES; benchmarks/gpu-2026-12-03-dsa-s18)
    dict(rows_per_tile=4, num_stages=3, gluon=True, gluon_ws=True, gluon_carry=True),
    dict(rows_per_tile=4, num_stages=4, gluon=True, gluon_ws=True, gluon_carry=True),
    dict(rows_per_tile=8, num_stages=4, gluon=True, gluon_ws=True, gluon_carry=True),
)

# Sparse MLA prefill tiles (the last 4096 rows of the 128K prefill, 16 tiles of 128 positions per row; H200,
# commit 4f58965, ms: 11.64, 11.50, 13.40, 13.32, 11.89, 11.19 in the order below), the
# four-group kernel with 64 heads x 8 warps. sm_90 AOT, Triton 3.6, loop instructions per 128 positions /
# registers / stack bytes / shared KB: default 128 positions (2563 / 255 / 80 / 216); heads_inner (the same
# kernel, launch order only); half: fp16 dequantization and MMAs (1952 / 255 / 192 / 216); half with 64
# positions (2 x 1056 / 255 / 0 / 144); half, 64, 2 stages + prefetch (2 x 1129 / 255 / 0 / 185; its bf16 form,
# 2 x 1482 instructions, ran 227 against 218 us for the default at decode batch 64 in the second session).
# Since 2026-12-01 {} is the Gluon kernel on sm_90 (sparse_mla's default where no position slices are taken:
# 7.75 ms on those rows, benchmarks/gpu-2026-12-01-dsa-s4-mla); gluon=False times the tl default beside it.
PREFILL_MLA_SWEEP = (
    {},
    dict(gluon=False),
    dict(heads_inner=True),
    dict(half=True),
    dict(half=True, heads_inner=True),
    dict(half=True, heads_inner=True, block_k=64),
    dict(half=True, heads_inner=True, block_k=64, num_stages=2, prefetch=True),
    # session 16: the cache converted once to a dense bf16 latent, then the Gluon bf16 kernel (no dequantisation in
    # its loop, cp.async gathers; the conversion is inside the timed call)
    dict(upconvert=True),
)

# Sparse MLA decode tiles for the acceptance run (batch 64 x 128K), 64 heads x 8 warps each, all the
# four-scale-group kernel (groups4). sm_90 AOT (benchmarks/sparse_mla_sass.py, Triton 3.6 of the CPU venv),
# shared KB / registers / spill bytes / SASS instructions in the loop: bf16 q.k, 128 positions, 1 stage
# (200 / 255 / 380 / 2636: the default, 203 us at batch 64 on 2026-11-30, benchmarks/gpu-2026-11-30-dsa-s2);
# q.k in e4m3 (qk_fp8): 128 positions 1 stage (168 / 255 / 2408 / 4699), 64 positions 2 stages + prefetch
# (154 / 255 / 240 / 2371), 3 stages + prefetch (196 / 255 / 656 / 2699), 32 positions 3 stages + prefetch
# (118 / 255 / 76 / 1461); positions on the q.k MMA's M side (swap_ab): 128 positions (216 / 255 / 584 /
# 3249), with qk_fp8 (184 / 255 / 956 / 2685), 64 positions 2 stages + prefetch (193 / 255 / 152 / 2564),
# with qk_fp8 (162 / 255 / 568 / 2105).
_FUSED = dict(block_h=64, v_split=1, qk_chunk=512, num_warps=8, groups4=True)
ACCEPTANCE_MLA_SWEEP = (
    dict(_FUSED, block_k=128, num_stages=1),
    dict(_FUSED, block_k=128, num_stages=1, qk_fp8=True),
    dict(_FUSED, block_k=64, num_stages=2, prefetch=True, qk_fp8=True),
    dict(_FUSED, block_k=64, num_stages=3, prefetch=True, qk_fp8=True),
    dict(_FUSED, block_k=32, num_stages=3, prefetch=True, qk_fp8=True),
    dict(_FUSED, block_k=128, num_stages=1, swap_ab=True),
    dict(_FUSED, block_k=128, num_stages=1, swap_ab=True, qk_fp8=True),
    dict(_FUSED, block_k=64, num_stages=2, prefetch=True, swap_ab=True),
    dict(_FUSED, block_k=64, num_stages=2, prefetch=True, swap_ab=True, qk_fp8=True),
    dict(gluon=False),  # the tl tile even where the Gluon kernel is the default
    dict(gluon=True),  # the Gluon kernel (sparse_mla_gluon; sm_90)
    dict(gluon={"F16": True}),  # the Gluon kernel with fp16 MMAs (its F16 flag)
    dict(gluon={"CP": True}),  # the gathers two tiles ahead by cp.async (sparse_mla_gluon_cp_kernel)
)


def dsa_rows(result: dict) -> list[dict]:
    """The timed DSA steps as report rows: one per decode case (``time_us`` = the CUDA-graph step) and
    per prefill case (indexer + top-k + sparse MLA), each with its error against the twins (the larger
    of the index scores' and the sparse MLA's ||kernel - twin|| / ||twin||; a top-k selection that
    differs from the twin's is a ``twin_mismatch``) and the tolerance of gates.yaml's
    ``kernels.max_twin_rel_error_gpu``. Errors of the run are rows too (never timed)."""
    tolerance = load_gates()["kernels"]["max_twin_rel_error_gpu"]
    rows = []
    for phase, cases in (("decode", result.get("decode", [])), ("prefill", result.get("prefill", []))):
        for case in cases:
            row = {k: v for k, v in case.items() if not isinstance(v, (dict, list))}
            row["phase"] = phase
            row["time_us"] = case["step_us"] if phase == "decode" else case["total_ms"] * 1e3
            errors = [case[k] for k in ("index_scores_rel_err_vs_twin", "sparse_mla_rel_err_vs_twin") if k in case]
            if errors:
                row["twin_rel_error"] = max(errors)
                row["twin_tolerance"] = tolerance
            same = case.get("topk_equals_twin", case.get("topk_last4096_rows_ms", {}).get("triton_equals_twin_rows0_8"))
            if same is False:
                row["twin_mismatch"] = "the top-k selection differs from topk_indices_torch's"
            if "twin_check_error" in case:
                row["twin_error"] = case["twin_check_error"]
            rows.append(row)
    rows += [{"error": text} for text in result.get("errors", [])]
    return rows


def _case(rows: list[dict], phase: str, **match) -> dict | None:
    return find_row(rows, phase=phase, **match)


def dsa_criteria() -> list[Criterion]:
    """Issue 16's acceptance lines on the rows of ``dsa_rows`` (DeepSeek-V3.2 shapes, 128K context)."""

    def field(phase, key, **match):
        return lambda rows: (row := _case(rows, phase, **match)) and row[key]

    def best_mla(rows):
        rates = [r["sparse_mla_TFLOPs"] for r in rows if r.get("phase") == "decode" and "error" not in r]
        return max(rates) if rates else None

    return [
        Criterion("decode batch 64 x 128K: step / byte floor", field("decode", "step_over_floor", batch=64,
                                                                     context=131072), "<=", 1.5),
        Criterion("decode batch 1 x 128K: step us per layer", field("decode", "step_us", batch=1, context=131072),
                  "<=", 40),
        Criterion(f"decode batch 1 x 128K: step us per layer in a graph of {GRAPH_LAYERS} layers",
                  field("decode", "step_us_per_layer_in_graph_of_layers", batch=1, context=131072), "<=", 40),
        Criterion("sparse MLA decode TFLOP/s (best batch)", best_mla, ">=", 300),
        Criterion("indexer prefill scoring TFLOP/s (all 128K rows)", field("prefill", "index_scores_all_TFLOPs",
                                                                           tokens=131072), ">=", 900),
        Criterion("prefill 128K: speedup over dense SDPA", field("prefill", "speedup_vs_dense", tokens=131072),
                  ">=", 3),
    ]


def acceptance_lines(result: dict) -> list[dict]:
    """Issue 16's acceptance lines computed from the measured rows (``adapt.bench.acceptance.evaluate``);
    a missing row counts as unmet. Keys: line, measured, target, met."""
    return [{"line": a["criterion"], "measured": a["value"], "target": a["bound"], "met": a["met"]}
            for a in evaluate(dsa_criteria(), dsa_rows(result))]


def dsa_report(result: dict) -> StageReport:
    """The run as a stage-6 StageReport (stage ``bench-dsa``): the step rows, issue 16's lines and the
    twin check of every timed row."""
    prov = {k: result[k] for k in ("date", "commit", "torch", "triton") if k in result}
    prov["device"] = result.get("gpu", "")
    return benchmark_report("dsa", "DeepSeek Sparse Attention at DeepSeek-V3.2 shapes", dsa_rows(result),
                            dsa_criteria(), provenance=prov, ceilings=result.get("ceilings"))


def _write(out_dir: Path, result: dict) -> None:
    """Write what has been measured so far (a run cut short still leaves its finished cases)."""
    (out_dir / "dsa_bench.json").write_text(json.dumps(result, indent=2))
    (out_dir / "dsa_bench.md").write_text(render_markdown(result))
    report = dsa_report(result)
    (out_dir / "dsa_report.json").write_text(report.to_json())
    (out_dir / "dsa_report.md").write_text(report.to_markdown())


def _tile_sweep(topk: int, latent_format: str, reps: int) -> list[dict]:
    """Time kernel tile options at batch 64 x 128K decode and at the last 4096 rows of a 32K prefill."""
    batch, context = 64, 131072
    cache = _random_cache(batch * context, latent_format)
    layer = cache.dsa_layer(0)
    pages = context // PAGE_SIZE
    block_table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    limits = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q8, weights, q_nope, q_rope = _queries(batch)
    rows = []
    decode_options = [
        dict(key_block=128, num_stages=3, num_warps=4, programs=1024),
        dict(key_block=128, num_stages=4, num_warps=4, programs=2048),
        dict(key_block=64, num_stages=4, num_warps=4, programs=2048),
        dict(key_block=128, num_stages=2, num_warps=8, programs=1024),
        dict(key_block=128, num_stages=1, num_warps=4, programs=1024),
    ]
    for opt in decode_options:
        try:
            ms = _time_graph_ms(
                lambda o=opt: dsa.index_scores(
                    q8,
                    weights,
                    layer.index_k,
                    layer.index_scale,
                    block_table,
                    token_seq,
                    limits,
                    context,
                    rows_per_tile=1,
                    **o,
                ),
                reps,
            )
        except Exception as err:  # a tile that does not compile is recorded, the others still run
            rows.append({"kernel": "index_scores decode", **opt, "error": str(err)[:200]})
            continue
        rows.append(
            {
                "kernel": "index_scores decode",
                **opt,
                "us": ms * 1e3,
                "key_TBps": batch * context * (INDEX_DIM + 4) / ms / 1e9,
            }
        )
    idx = torch.stack([torch.randperm(context, device="cuda")[:topk] for _ in range(batch)]).int()
    options = MLA_SWEEP
    rows += _mla_sweep(layer, block_table, token_seq, q_nope, q_rope, idx, options, reps)
    torch.cuda.empty_cache()
    del cache, layer
    torch.cuda.empty_cache()
    prefill_rows, prefill_context = 4096, 32768
    cache = _random_cache(prefill_context, latent_format)
    layer = cache.dsa_layer(0)
    block_table = torch.arange(prefill_context // PAGE_SIZE, device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(prefill_rows, device="cuda", dtype=torch.int32)
    limits = torch.arange(
        prefill_context - prefill_rows + 1, prefill_context + 1, device="cuda", dtype=torch.int32
    )
    q8, weights, _, _ = _queries(prefill_rows)
    flops = 2 * INDEX_HEADS * INDEX_DIM * float(limits.double().sum())
    prefill_options = PREFILL_INDEX_SWEEP
    for opt in prefill_options:
        try:
            ms = _time_ms(
                lambda o=opt: dsa.index_scores(
                    q8,
                    weights,
                    layer.index_k,
                    layer.index_scale,
                    block_table,
                    token_seq,
                    limits,
                    prefill_context,
                    **o,
                ),
                reps,
            )
        except Exception as err:  # a tile that does not compile is recorded, the others still run
            rows.append({"kernel": "index_scores prefill 4096", **opt, "error": str(err)[:200]})
            continue
        rows.append(
            {"kernel": "index_scores prefill 4096", **opt, "us": ms * 1e3, "TFLOPs": flops / ms / 1e9}
        )
    torch.cuda.empty_cache()
    return rows


def _tile_rows_text(rows: list[dict]) -> str:
    """Timed tile rows as one line: options (or 'default'): us (timed as, twin, redo rows), or the error."""
    measured = ("us", "equals_twin", "redo_rows", "timed_as", "error")
    return ", ".join(
        f"{ {k: v for k, v in r.items() if k not in measured} or 'default'}: "
        + (f"{_fmt(r['us'])} ({r['timed_as']}, twin {r['equals_twin']}, redo {r['redo_rows']})" if "us" in r
           else r["error"])
        for r in rows)


def _fused_line(d: dict) -> str:
    """The fused decode index + top-k (``dsa.index_topk_fused``, an option): its tiles (us of index + top-k, equal
    to the twin select of its scores, misjudged rows) and the fastest."""
    return f"fused index+top-k us: {_tile_rows_text(d['fused_sweep'])}; fastest {d.get('fused_tiles')}"


def _decode_select_line(d: dict) -> str:
    """The decode top-k (``topk_decode``) beside torch.topk: its tiles (us, equal to the twin, misjudged rows)
    and the step with it."""
    tiles = _tile_rows_text(d["topk_decode_sweep"])
    return (f"topk_decode us: {tiles}; torch.topk {_fmt(d.get('torch_topk_us'))}; step with select="
            f"{d.get('old_select', 'decode')} "
            f"{_fmt(d.get('step_us_decode_select'))} us (top-k in the step {_fmt(d.get('topk_us_decode_select'))}, "
            f"step / floor {_fmt(d.get('step_over_floor_decode_select'), 2)})")


def compact_summary(result: dict) -> str:
    """A few lines for a terminal: ceilings, each decode and prefill case with its split."""
    c = result["ceilings"]
    lines = [
        f"DSA {result['gpu']} {result['date']} commit {result['commit']}: copy {c['copy_tbps']:.2f} TB/s, "
        f"bf16 {c['bf16_matmul_tflops']:.0f}, fp8 {c['fp8_matmul_tflops']:.0f} TFLOP/s; "
        f"tiles {result['tiles_used']}",
        "decode  B x S: scores/topk/mla/step us | floor us | step/floor | dense us (floor)",
    ]
    for d in result["decode"]:
        lines.append(
            f"  {d['batch']:>3} x {d['context']:>6}: {d['index_scores_us']:.0f}/{d['topk_us']:.0f}/"
            f"{d['sparse_mla_us']:.0f}/{d['step_us']:.0f} | {d['floor_us']:.0f} | {d['step_over_floor']:.2f} "
            f"| {_fmt(d['dense_us'], 0)} ({_fmt(d['dense_floor_us'], 0)})"
        )
        if d.get("topk_decode_sweep"):
            lines.append(f"    {_decode_select_line(d)}")
        if d.get("fused_sweep"):
            lines.append(f"    {_fused_line(d)}")
    lines.append("prefill T: scores/topk/mla/total ms | dense ms | speedup")
    for p in result["prefill"]:
        lines.append(
            f"  {p['tokens']:>6}: {p['index_scores_ms']:.1f}/{p['topk_ms']:.1f}/{p['sparse_mla_ms']:.1f}/"
            f"{p['total_ms']:.1f} | {p['dense_sdpa_ms']:.1f} | {p['speedup_vs_dense']:.2f}x ({p['dense_sdpa_note']})"
        )
        peak_gib = p["peak_allocated_bytes_during_index"] / 2**30
        lines.append(f"    index+topk ms by select {p.get('index_topk_ms_by_select')}; prefilter fallback rows "
                     f"{p.get('prefilter_fallback_rows')}; peak {peak_gib:.2f} GiB; "
                     f"index tiles {p['index_tiles']}; mla tiles {p.get('sparse_mla_tiles')}")
        if "index_scores_graph_ms" in p:
            lines.append(f"    scores over all rows: {p['index_scores_graph_ms']:.1f} ms as "
                         f"{p['index_scores_graph_timing']} ({p['index_scores_all_TFLOPs']:.1f} TFLOP/s), "
                         f"{p['index_scores_ms']:.1f} eager ({p['index_scores_all_TFLOPs_eager']:.1f})")
        lines.append(f"    tail select ms {p.get('topk_last4096_rows_ms')}")
        lines.append(f"    twin: scores {p.get('index_scores_rel_err_vs_twin')}, "
                     f"mla {p.get('sparse_mla_rel_err_vs_twin')} {p.get('twin_check_error', '')}")
        for r in p.get("index_sweep", []) + p.get("sparse_mla_sweep", []):
            opts = {k: v for k, v in r.items() if k not in MEASURED_KEYS}
            lines.append(f"    {r['kernel']} {opts}: {_fmt(r.get('us'), 0)} us {_fmt(r.get('TFLOPs'), 0)} TFLOP/s "
                         f"{r.get('error', '')}")
    lines += [f"  ERROR {e}" for e in result.get("errors", [])]
    for a in result.get("acceptance", []):
        verdict = "MET" if a["met"] else "NOT MET"
        lines.append(f"  {verdict}: {a['line']} = {_fmt(a['measured'], 2)} (target {a['target']})")
    return "\n".join(lines)


def _fmt(value, digits=1):
    return "-" if value is None else f"{value:,.{digits}f}"


def render_markdown(result: dict) -> str:
    """The benchmark as Markdown tables (what README.md in benchmarks/dsa quotes)."""
    c = result["ceilings"]
    lines = [
        f"# DSA kernels, {result['gpu']}",
        "",
        f"Date {result['date']}, commit {result['commit']}, torch {result['torch']}, "
        f"triton {result['triton']}. "
        f"Shapes: {result['shapes']}. Medians of CUDA-event timings, per layer.",
        "",
        f"Ceilings (same run): copy {c['copy_tbps']:.2f} TB/s, "
        f"bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s, "
        f"fp8 _scaled_mm {c['fp8_matmul_tflops']:.0f} TFLOP/s.",
        "",
        "## Decode (one token per sequence)",
        "",
        "Top-k: the index+top-k graph minus the scores graph; the select kernel alone and torch.topk on "
        "the same scores are timed too. Dense: the absorbed MLA path over a dense bf16 latent cache "
        "(bf16 bmm + fp32 softmax + bf16 bmm, CUDA graph), its byte floor = the cache read once.",
        "",
        "| batch | context | scores us | top-k us | select kernel us | torch.topk us | sparse MLA us | step us "
        "| floor us | step/floor | TB/s | scores TB/s | MLA TFLOP/s | dense us | dense floor us | dense/floor "
        "| dense/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in result["decode"]:
        lines.append(
            f"| {d['batch']} | {d['context']} | {_fmt(d['index_scores_us'])} | {_fmt(d['topk_us'])} "
            f"| {_fmt(d.get('topk_kernel_us'))} | {_fmt(d.get('torch_topk_us'))} | {_fmt(d['sparse_mla_us'])} "
            f"| {_fmt(d['step_us'])} | {_fmt(d['floor_us'])} | {_fmt(d['step_over_floor'], 2)} "
            f"| {_fmt(d['achieved_TBps'], 2)} | {_fmt(d['index_scores_TBps'], 2)} "
            f"| {_fmt(d['sparse_mla_TFLOPs'])} "
            f"| {_fmt(d.get('dense_us'))} | {_fmt(d.get('dense_floor_us'))} | {_fmt(d.get('dense_over_floor'), 2)} "
            f"| {_fmt(d['dense_over_step'], 2)} |"
        )
        if "topk_kernel_us_by_digit_bits" in d:
            lines.append(f"|  | select kernel us by digit bits: {d['topk_kernel_us_by_digit_bits']} |")
        if d.get("topk_kernel_sweep"):
            sweep = ", ".join(f"{ {k: v for k, v in r.items() if k != 'us'} }: {_fmt(r['us'])}"
                              for r in d["topk_kernel_sweep"])
            lines.append(f"|  | select kernel tiles (us): {sweep} |")
        if d.get("topk_decode_sweep"):
            lines.append(f"|  | {_decode_select_line(d)} |")
        if d.get("fused_sweep"):
            lines.append(f"|  | {_fused_line(d)} |")
        if "sparse_mla_rel_err_vs_bf16_q_twin" in d:
            lines.append(f"|  | sparse MLA (q.k in e4m3) against the bf16-q twin: rel. error "
                         f"{d['sparse_mla_rel_err_vs_bf16_q_twin']:.1e} |")
        if "topk_equals_twin" in d:
            lines.append(f"|  | kernels vs twins: top-k identical {d['topk_equals_twin']}, scores rel. error "
                         f"{d['index_scores_rel_err_vs_twin']:.1e}, sparse MLA rel. error "
                         f"{d['sparse_mla_rel_err_vs_twin']:.1e} |")
        if d.get("step_us_per_layer_in_graph_of_layers") is not None:
            lines.append(f"|  | step per layer in one graph of {d['graph_layers']} layers (own caches): "
                         f"{_fmt(d['step_us_per_layer_in_graph_of_layers'])} us (a sync after each replay: "
                         f"{_fmt(d.get('step_us_per_layer_in_graph_of_layers_synced'))} us) |")
        if d.get("step_us_synced") is not None:
            lines.append(f"|  | step (one-layer graph) with a sync after each replay: {_fmt(d['step_us_synced'])} us; "
                         f"the step column: {STEADY_BATCH} replays back to back a sample |")
        if d.get("index_programs_sweep"):
            sweep = ", ".join(f"{r['programs']}: {_fmt(r['us'])}" for r in d["index_programs_sweep"])
            lines.append(f"|  | indexer programs (us): {sweep} |")
        if d.get("sparse_mla_splits_sweep"):
            sweep = ", ".join(f"{r['splits']}: {_fmt(r.get('us'))}" for r in d["sparse_mla_splits_sweep"])
            lines.append(f"|  | sparse MLA position splits (us): {sweep} |")
    lines += [
        "",
        "## Prefill (one sequence, causal)",
        "",
        "| tokens | scores ms | top-k ms | index+top-k ms | chunks | peak score MiB | scores TFLOP/s "
        "| sparse MLA ms | MLA TFLOP/s | total ms | dense SDPA ms | SDPA TFLOP/s | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["prefill"]:
        lines.append(
            f"| {p['tokens']} | {_fmt(p['index_scores_ms'])} | {_fmt(p['topk_ms'])} "
            f"| {_fmt(p['index_topk_ms'])} "
            f"| {p['index_chunks']} "
            f"| {_fmt(p['peak_score_bytes'] / 2**20, 0)} | {_fmt(p['index_scores_all_TFLOPs'])} "
            f"| {_fmt(p['sparse_mla_ms'])} | {_fmt(p['sparse_mla_TFLOPs'])} | {_fmt(p['total_ms'])} "
            f"| {_fmt(p['dense_sdpa_ms'])} | {_fmt(p['dense_sdpa_TFLOPs'])} "
            f"| {_fmt(p['speedup_vs_dense'], 2)} |"
        )
        lines += ["", f"Dense: {p['dense_sdpa_note']}. Indexer tiles: {p.get('index_tiles')}. Peak allocated during "
                  f"the indexer: {_fmt(p.get('peak_allocated_bytes_during_index', 0) / 2**30, 2)} GiB. "
                  f"Top-k of the last 4096 rows (ms): {p.get('topk_last4096_rows_ms')}."]
    if result.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in result["errors"]]
    if result.get("acceptance"):
        lines += ["", "## Acceptance (issue 16)", "", "| line | measured | target | met |", "|---|---|---|---|"]
        lines += [f"| {a['line']} | {_fmt(a['measured'], 2)} | {a['target']} | {'MET' if a['met'] else 'NOT MET'} |"
                  for a in result["acceptance"]]
    lines += ["", "## Tile sweep", "", "| kernel | options | us | rate |", "|---|---|---|---|"]
    prefill_sweeps = [r for p in result.get("prefill", [])
                      for r in p.get("index_sweep", []) + p.get("sparse_mla_sweep", [])]
    for row in result.get("tile_sweep", []) + prefill_sweeps:
        opts = {k: v for k, v in row.items() if k not in MEASURED_KEYS}
        all_rows = f"; all rows {row['all_rows_TFLOPs']:.0f} TFLOP/s" if "all_rows_TFLOPs" in row else ""
        rate = (
            f"{row['TFLOPs']:.0f} TFLOP/s{all_rows}"
            if "TFLOPs" in row
            else f"{row['key_TBps']:.2f} TB/s"
            if "key_TBps" in row
            else row.get("error", "")
        )
        lines.append(f"| {row['kernel']} | {opts} | {_fmt(row.get('us'))} | {rate} |")
    f = result.get("prefill_forms")
    if f is None:
        return "\n".join(lines)
    lines += [
        "",
        f"## Prefill form (per query row, context {f['context']}, {f['rows']} rows)",
        "",
        "| form | us per row | bytes gathered per row |",
        "|---|---|---|",
        f"| absorbed latent 576/512 (Triton) | {_fmt(f['absorbed_triton_us_per_row'], 2)} "
        f"| {f['absorbed_bytes_per_row']:,} |",
        f"| per-head 192/128 (torch gather + matmul) | {_fmt(f['per_head_torch_us_per_row'], 2)} "
        f"| {f['per_head_bytes_per_row']:,} |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="DSA kernel benchmark (one CUDA GPU)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="small grid for a smoke run")
    parser.add_argument("--acceptance", action="store_true",
                        help="decode 1 and 64 x 128K, prefill 128K, same-run ceilings only (under 2 minutes)")
    parser.add_argument("--no-sweep", action="store_true", help="with --acceptance: the kernels' default tiles only")
    parser.add_argument("--prefill-only", action="store_true",
                        help="with --acceptance: ceilings and the 128K prefill case (with its sweeps) only")
    parser.add_argument("--no-prefill", action="store_true", help="with --acceptance: the decode cases only")
    parser.add_argument("--decode-batches", default="1,64", metavar="LIST",
                        help="with --acceptance: comma-separated decode batches of 1 and 64 (default: both; one left "
                             "out leaves its acceptance lines unmet)")
    parser.add_argument("--decode-gluon", action=argparse.BooleanOptionalAction, default=None,
                        help="the top-k candidate pass by its Gluon kernel on sm_90 or by the tl kernel, decode and "
                             f"prefill (default: topk.DECODE_GLUON, now {_topk.DECODE_GLUON})")
    parser.add_argument("--few-rows-select", choices=("triton", "grid", "decode"), default=None,
                        help="the select of decode batches of at most dsa.TRITON_SELECT_MAX_ROWS rows (default: "
                             f"dsa.FEW_ROWS_SELECT, now {dsa.FEW_ROWS_SELECT})")
    parser.add_argument("--few-rows-options", default=None, metavar="JSON",
                        help="options of those batches' select: topk_decode's under --few-rows-select decode "
                             f"(default: dsa.FEW_ROWS_DECODE_OPTIONS, now {dsa.FEW_ROWS_DECODE_OPTIONS}), topk_grid's "
                             f"under grid (default: dsa.FEW_ROWS_GRID_OPTIONS, now {dsa.FEW_ROWS_GRID_OPTIONS})")
    parser.add_argument("--mla-gluon-sliced", action=argparse.BooleanOptionalAction, default=None,
                        help="the Gluon sparse MLA kernel also for decode batches that take position slices, or the "
                             f"tl kernel there (default: sparse_mla.GLUON_SLICED, now {sparse_mla.GLUON_SLICED})")
    parser.add_argument("--combine-at-once", action=argparse.BooleanOptionalAction, default=None,
                        help="the sparse MLA slice combine loads every slice at once, or one slice after the other "
                             f"(default: sparse_mla.COMBINE_AT_ONCE, now {sparse_mla.COMBINE_AT_ONCE})")
    parser.add_argument("--step-swept-tiles", action=argparse.BooleanOptionalAction, default=None,
                        help="below batch 64, the step with the indexer programs and sparse MLA splits its sweeps "
                             "timed fastest alone, or with the library's defaults (default: "
                             f"STEP_SWEPT_TILES, now {STEP_SWEPT_TILES})")
    parser.add_argument("--mla-upconvert", action=argparse.BooleanOptionalAction, default=None,
                        help="sparse MLA over the cache converted once to bf16 where sparse_mla.upconvert_worth "
                             "counts it worth it (prefill chunks), or never (default: sparse_mla.UPCONVERT_AUTO, now "
                             f"{sparse_mla.UPCONVERT_AUTO})")
    parser.add_argument("--mla-f16", action=argparse.BooleanOptionalAction, default=None,
                        help="the Gluon sparse MLA decode kernel's MMAs in fp16 (its F16 flag), or in bf16 (default: "
                             "sparse_mla_gluon.GLUON_FLAGS['F16'], now "
                             f"{sparse_mla.sparse_mla_gluon.GLUON_FLAGS['F16']})")
    parser.add_argument("--mla-cp", action=argparse.BooleanOptionalAction, default=None,
                        help="the Gluon sparse MLA decode kernel that stages the gathers two tiles ahead by cp.async "
                             "(sparse_mla_gluon.CP_FLAGS['CP'], now "
                             f"{sparse_mla.sparse_mla_gluon.CP_FLAGS['CP']})")
    parser.add_argument("--mla-gather-rows", type=int, default=None, metavar="N",
                        help="rows a warp of the Gluon sparse MLA decode kernel gathers at once (1, 2, 4 or 8; its "
                             "GATHER_ROWS; default: sparse_mla_gluon.GLUON_FLAGS['GATHER_ROWS'], now "
                             f"{sparse_mla.sparse_mla_gluon.GLUON_FLAGS['GATHER_ROWS']})")
    parser.add_argument("--mla-defer-sum", action=argparse.BooleanOptionalAction, default=None,
                        help="the bf16 sparse MLA kernel's DEFER_SUM (default: sparse_mla_gluon.BF16_DEFER_SUM, now "
                             f"{sparse_mla.sparse_mla_gluon.BF16_DEFER_SUM})")
    parser.add_argument("--prefill-gluon-wg", type=int, default=None, metavar="G",
                        help="prefill scoring's default kernel at 2-row tiles (--prefill-ws 0): the multi-warpgroup "
                             "Gluon kernel with G warpgroups (1, 2 or 4), or 0 for the tl tile (default: "
                             f"dsa.PREFILL_WG_GROUPS, now {dsa.PREFILL_WG_GROUPS})")
    parser.add_argument("--prefill-reg-a", action=argparse.BooleanOptionalAction, default=None,
                        help="the multi-warpgroup prefill kernel's key tile in registers as its wgmma A operand "
                             f"(default: dsa.PREFILL_WG_REG_A, now {dsa.PREFILL_WG_REG_A})")
    parser.add_argument("--prefill-ws", type=int, default=None, metavar="ROWS",
                        help="prefill scoring's default tiles on sm_90: ROWS (4 or 8) rows on the warp-specialised "
                             "Gluon kernel, or 0 for 2-row tiles on the one-warpgroup kernel (default: "
                             f"dsa.PREFILL_WS_ROWS, now {dsa.PREFILL_WS_ROWS})")
    parser.add_argument("--prefill-ws-stages", type=int, default=None, metavar="N",
                        help="key pages in flight in the warp-specialised prefill kernel (default: "
                             f"dsa.PREFILL_WS_STAGES, now {dsa.PREFILL_WS_STAGES})")
    parser.add_argument("--prefill-selects", default=None,
                        help="with --acceptance: comma-separated index_topk select methods timed over the whole "
                             f"prefill, the first the step's (of {', '.join(dsa.SELECT_METHODS)}; default: auto, "
                             "and with the sweep also torch and prefilter_triton)")
    args = parser.parse_args()
    if args.decode_gluon is not None:
        _topk.DECODE_GLUON = args.decode_gluon
    if args.few_rows_select:
        dsa.FEW_ROWS_SELECT = args.few_rows_select
    if args.mla_gluon_sliced is not None:
        sparse_mla.GLUON_SLICED = args.mla_gluon_sliced
    if args.combine_at_once is not None:
        sparse_mla.COMBINE_AT_ONCE = args.combine_at_once
    if args.mla_upconvert is not None:
        sparse_mla.UPCONVERT_AUTO = args.mla_upconvert
    if args.mla_f16 is not None:
        sparse_mla.sparse_mla_gluon.GLUON_FLAGS["F16"] = args.mla_f16
    if args.mla_cp is not None:
        sparse_mla.sparse_mla_gluon.CP_FLAGS["CP"] = args.mla_cp
    if args.mla_gather_rows is not None:
        if args.mla_gather_rows not in (1, 2, 4, 8):
            parser.error(f"--mla-gather-rows: 1, 2, 4 or 8 rows, not {args.mla_gather_rows}")
        sparse_mla.sparse_mla_gluon.GLUON_FLAGS["GATHER_ROWS"] = args.mla_gather_rows
    if args.mla_defer_sum is not None:
        sparse_mla.sparse_mla_gluon.BF16_DEFER_SUM = args.mla_defer_sum
    if args.prefill_gluon_wg is not None:
        if args.prefill_gluon_wg not in (0, 1, 2, 4):
            parser.error(f"--prefill-gluon-wg: 0, 1, 2 or 4 warpgroups, not {args.prefill_gluon_wg}")
        dsa.PREFILL_WG_GROUPS = args.prefill_gluon_wg
    if args.prefill_ws is not None:
        if args.prefill_ws not in (0, 4, 8):
            parser.error(f"--prefill-ws: 0, 4 or 8 rows, not {args.prefill_ws}")
        dsa.PREFILL_WS_ROWS = args.prefill_ws
    if args.prefill_ws_stages is not None:
        if not 2 <= args.prefill_ws_stages <= 8:
            parser.error(f"--prefill-ws-stages: 2 to 8 key pages in flight, not {args.prefill_ws_stages}")
        dsa.PREFILL_WS_STAGES = args.prefill_ws_stages
    if args.prefill_reg_a is not None:
        dsa.PREFILL_WG_REG_A = args.prefill_reg_a
    if args.step_swept_tiles is not None:
        globals()["STEP_SWEPT_TILES"] = args.step_swept_tiles
    if args.few_rows_options:
        try:
            options = dict(json.loads(args.few_rows_options))
        except (ValueError, TypeError) as err:
            parser.error(f"--few-rows-options: not a JSON object of select options ({err})")
        if dsa.FEW_ROWS_SELECT == "grid":
            dsa.FEW_ROWS_GRID_OPTIONS = options
        else:
            dsa.FEW_ROWS_DECODE_OPTIONS = options
    if args.acceptance:
        selects = [m.strip() for m in args.prefill_selects.split(",") if m.strip()] if args.prefill_selects else None
        bad = [m for m in selects or () if m not in dsa.SELECT_METHODS]
        if bad:
            parser.error(f"--prefill-selects: {', '.join(bad)} not among {', '.join(dsa.SELECT_METHODS)}")
        try:
            batches = sorted({int(b) for b in args.decode_batches.split(",") if b.strip()})
        except ValueError:
            batches = []
        if not batches or any(b not in (1, 64) for b in batches):
            parser.error(f"--decode-batches: a comma-separated list of 1 and 64, not {args.decode_batches!r}")
        summary = run_dsa_acceptance(args.out, sweep=not args.no_sweep, prefill_only=args.prefill_only,
                                     prefill=not args.no_prefill, prefill_selects=selects, decode_batches=batches)
    elif args.quick:
        summary = run_dsa_bench(
            args.out, decode_batches=(1, 4), contexts=(8192,), prefill_lengths=(8192,), reps=3, prefill_reps=2
        )
    else:
        summary = run_dsa_bench(args.out)
    print((args.out / "dsa_bench.md").read_text())
    print(compact_summary(summary))
