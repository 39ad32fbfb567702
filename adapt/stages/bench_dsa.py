"""DSA kernel benchmark on one CUDA GPU at DeepSeek-V3.2 shapes (``adapt bench kernels --dsa``).

Per layer, on random (never zero) data, medians of CUDA-event timings:

- decode: one query token per sequence, batch x context grid; indexer scan + top-k and
  sparse MLA over the paged caches (latent fp8 656 B/token by default, indexer 132 B/token);
  byte floor = indexer keys B*S*132 + selected latent rows B*topk*latent_bytes, at the
  copy bandwidth measured in the same run;
- prefill: one sequence of T tokens; indexer scoring + chunked top-k + sparse MLA (the
  DSA core: projections are GEMMs that dense attention has too and are left out of both);
- in the same run: device-to-device copy bandwidth, torch bf16 matmul and fp8 _scaled_mm
  rates, and torch scaled_dot_product_attention over dense KV with the same heads and
  context (causal 128 heads x (192 q.k, 128 v) for prefill; the dense latent (MQA over
  576/512) for decode);
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
import os
import statistics
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from adapt.errors import InputError
from adapt.kernels import dsa, sparse_mla
from adapt.kernels.formats import FP8_DTYPE, PAGE_SIZE
from adapt.model.spec import load_spec
from adapt.runtime.kv_cache import DSALayerCache, PagedKVCache, mla_layout

_MLA = load_spec("deepseek-v3.2").layers[0].attention  # the benchmarked shape: DeepSeek-V3.2's MLA + DSA
HEADS, RANK, ROPE = _MLA.num_heads, _MLA.kv_lora_rank, _MLA.qk_rope_head_dim
INDEX_HEADS, INDEX_DIM, NOPE, VDIM = _MLA.index_n_heads, _MLA.index_head_dim, _MLA.qk_nope_head_dim, _MLA.v_head_dim


def _time_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of ``reps`` runs of ``fn`` (CUDA events), after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``reps`` replays of ``fn`` captured in a CUDA graph (no host launch
    gaps, as a serving engine runs a decode step); falls back to ``_time_ms`` when ``fn`` cannot be
    captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return _time_ms(fn, reps)
    return _time_ms(graph.replay, reps)


def _ceilings(reps: int) -> dict:
    n = 1 << 28
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), reps)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b, reps)
    a8, b8 = a.to(FP8_DTYPE), b.to(FP8_DTYPE).T.contiguous().T
    one = torch.ones((), device="cuda")
    fp8_ms = _time_ms(
        lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps
    )
    flops = 2 * 8192**3
    return {
        "copy_TBps": 2 * n / copy_ms / 1e9,
        "bf16_matmul_TFLOPs": flops / mm_ms / 1e9,
        "fp8_scaled_mm_TFLOPs": flops / fp8_ms / 1e9,
    }


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


def _latent_row_bytes(latent_format: str) -> int:
    return (RANK + 4 * RANK // 128 if latent_format == "fp8" else 2 * RANK) + 2 * ROPE


def _decode_case(
    batch: int, context: int, topk: int, latent_format: str, copy_tbps: float, reps: int, tiles: dict
) -> dict:
    cache = _random_cache(batch * context, latent_format)
    layer = cache.dsa_layer(0)
    pages_per_seq = context // PAGE_SIZE
    block_table = torch.randperm(batch * pages_per_seq, device="cuda").view(batch, pages_per_seq).int()
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    limits = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q8, weights, q_nope, q_rope = _queries(batch)
    holder = {}

    def index():
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
            **_mla_tiles(tiles, batch),
        )

    index_ms = _time_graph_ms(index, reps)
    scores_ms = _time_graph_ms(
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
    attend_ms = _time_graph_ms(attend, reps)
    step_ms = _time_graph_ms(lambda: (index(), attend()), reps)
    key_bytes = batch * context * (INDEX_DIM + 4)
    latent_bytes = batch * topk * _latent_row_bytes(latent_format)
    floor_bytes = key_bytes + latent_bytes
    floor_us = floor_bytes / copy_tbps / 1e6
    index_flops = 2 * INDEX_HEADS * INDEX_DIM * context * batch
    attend_flops = 2 * batch * HEADS * topk * (RANK + ROPE + RANK)
    dense = _dense_decode_ms(batch, context, reps)
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "context": context,
        "latent_format": latent_format,
        "index_topk_us": index_ms * 1e3,
        "index_scores_us": scores_ms * 1e3,
        "topk_us": (index_ms - scores_ms) * 1e3,
        "sparse_mla_us": attend_ms * 1e3,
        "step_us": step_ms * 1e3,
        "floor_bytes": floor_bytes,
        "floor_us": floor_us,
        "step_over_floor": step_ms * 1e3 / floor_us,
        "achieved_TBps": floor_bytes / step_ms / 1e9,
        "index_TBps": key_bytes / index_ms / 1e9,
        "index_scores_TBps": (key_bytes + batch * context * 4) / scores_ms / 1e9,
        "index_TFLOPs": index_flops / index_ms / 1e9,
        "sparse_mla_TBps": (latent_bytes + batch * HEADS * (RANK + ROPE + RANK) * 2) / attend_ms / 1e9,
        "sparse_mla_TFLOPs": attend_flops / attend_ms / 1e9,
        "dense_sdpa_us": None if dense is None else dense * 1e3,
        "dense_over_step": None if dense is None else dense / step_ms,
    }


def _mla_tiles(tiles: dict, rows: int) -> dict:
    """The swept sparse MLA tiles for ``rows`` query rows: a position-split count is kept only at
    the sweep's batch (elsewhere the kernel picks it: more slices at batch 1, and none in prefill,
    whose partial-output workspace would be rows x splits x 128 x 512 x 4 B)."""
    return {k: v for k, v in tiles["mla"].items() if k != "splits" or rows == SWEEP_BATCH}


def _dense_decode_ms(batch: int, context: int, reps: int) -> float | None:
    """Dense MLA decode through SDPA: 128 heads as 128 query rows over one latent KV head
    (None when no SDPA backend takes 576/512 dims or the KV would not fit)."""
    kv_bytes = batch * context * (RANK + ROPE) * 2
    if kv_bytes > 40 * 2**30:
        return None
    k = torch.randn(batch, 1, context, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 1, HEADS, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    v = k[..., :RANK]
    try:
        ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.1), reps)
    except (RuntimeError, torch.OutOfMemoryError):
        ms = None
    torch.cuda.empty_cache()
    return ms


def _prefill_case(
    length: int, topk: int, latent_format: str, reps: int, max_score_bytes: int, attend_rows: int, tiles: dict
) -> dict:
    cache = _random_cache(length, latent_format)
    layer = cache.dsa_layer(0)
    block_table = torch.arange(-(-length // PAGE_SIZE), device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(length, device="cuda", dtype=torch.int32)
    limits = torch.arange(1, length + 1, device="cuda", dtype=torch.int32)
    q8, weights, _, _ = _queries(length)
    q_nope = torch.randn(attend_rows, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(attend_rows, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    holder = {}

    def index():
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
            **tiles["prefill_index"],
        )

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
                **_mla_tiles(tiles, attend_rows),
            )

    rows_per_chunk = max(1, max_score_bytes // (4 * length))

    def scores_only():
        for r0 in range(0, length, rows_per_chunk):
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
                **tiles["prefill_index"],
            )

    index_ms = _time_ms(index, reps)
    all_scores_ms = _time_ms(scores_only, reps)
    scores_ms = _time_ms(
        lambda: dsa.index_scores(
            q8[-4096:],
            weights[-4096:],
            layer.index_k,
            layer.index_scale,
            block_table,
            token_seq[-4096:],
            limits[-4096:],
            length,
            **tiles["prefill_index"],
        ),
        reps,
    )
    attend_ms = _time_ms(attend, reps)
    total_ms = index_ms + attend_ms
    selected = sum(min(t + 1, topk) for t in range(length))
    index_flops = 2 * INDEX_HEADS * INDEX_DIM * length * (length + 1) / 2
    tail_flops = 2 * INDEX_HEADS * INDEX_DIM * sum(range(length - 4095, length + 1))
    attend_flops = 2 * HEADS * selected * (RANK + ROPE + RANK)
    dense_ms, dense_note = _dense_prefill_ms(length, reps)
    dense_flops = 2 * HEADS * (NOPE + ROPE + VDIM) * length * length / 2
    result = {
        "tokens": length,
        "latent_format": latent_format,
        "index_topk_ms": index_ms,
        "index_chunks": holder["stats"].chunks,
        "peak_score_bytes": holder["stats"].peak_score_bytes,
        "index_scores_ms": all_scores_ms,
        "topk_ms": index_ms - all_scores_ms,
        "index_scores_all_TFLOPs": index_flops / all_scores_ms / 1e9,
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
    }
    torch.cuda.empty_cache()
    return result


def _dense_prefill_ms(length: int, reps: int) -> tuple[float, str]:
    """Causal SDPA, 128 heads, q/k 192 and v 128 (falls back to v padded to 192)."""
    q = torch.randn(1, HEADS, length, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        v = torch.randn(1, HEADS, length, VDIM, device="cuda", dtype=torch.bfloat16)
        ms = _time_ms(lambda: sdpa(q, k, v, is_causal=True), reps)
        note = "q,k 192 / v 128"
    except RuntimeError:
        v = torch.randn_like(q)
        ms = _time_ms(lambda: sdpa(q, k, v, is_causal=True), reps)
        note = "q,k,v 192 (v padded: no SDPA backend took v 128)"
    torch.cuda.empty_cache()
    return ms, note


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


def _commit() -> str:
    if os.environ.get("ADAPT_COMMIT"):
        return os.environ["ADAPT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
        "ceilings": _ceilings(reps),
    }
    copy = result["ceilings"]["copy_TBps"]
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
                                  "splits"),
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
    dict(block_h=64, block_k=32, v_split=1, qk_chunk=512, num_warps=8, num_stages=2),  # fused
    # q loaded once, one q.k dot over the whole latent, output in 2 slices, partials through the
    # split path (its fp32 epilogue compiled with the fewest register spills, sm_90 AOT: 16 B stack).
    dict(block_h=64, block_k=32, v_split=2, qk_chunk=512, num_warps=8, num_stages=2, splits=2),
)
SWEEP_BATCH = 64

# Index tiles measured fastest on the H200 in run 2 (benchmarks/dsa/2026-11-29-run2-grid.json);
# the acceptance mode uses them instead of re-sweeping.
RUN2_INDEX_TILES = {
    "decode_index": dict(key_block=128, num_stages=4, num_warps=4, programs=2048),
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
    out_dir: Path, *, topk: int = 2048, latent_format: str = "fp8", reps: int = 10
) -> dict:
    """The acceptance subset: same-run ceilings (torch and Triton 16-byte copy), a sparse MLA tile
    sweep at batch 64 x 128K, decode at batch 1 and 64 x 128K, prefill 128K (indexer + top-k +
    sparse MLA and dense causal SDPA). Writes ``dsa_bench.json`` / ``.md`` into ``out_dir``."""
    if not torch.cuda.is_available():
        raise InputError(
            "the DSA benchmark needs a CUDA GPU and none is visible",
            hint="run it on the GPU machine, e.g. `adapt bench kernels --dsa` there",
        )
    from adapt.stages.bench_moe import measure_copy

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ceilings = _ceilings(reps)
    copy = measure_copy(gib=2, reps=reps)
    ceilings["copy_torch_small_TBps"] = ceilings["copy_TBps"]
    ceilings.update({k: v for k, v in copy.items() if k.endswith("_tbps")})
    ceilings["copy_TBps"] = max(ceilings["copy_TBps"], copy["copy_tbps"])
    result = {
        "mode": "acceptance",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shapes": {"heads": HEADS, "latent": RANK, "rope": ROPE, "index_heads": INDEX_HEADS,
                   "index_dim": INDEX_DIM, "topk": topk, "latent_format": latent_format},
        "ceilings": ceilings,
        "decode": [],
        "prefill": [],
    }
    batch, context = 64, 131072
    cache = _random_cache(batch * context, latent_format)
    layer = cache.dsa_layer(0)
    pages = context // PAGE_SIZE
    block_table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    _, _, q_nope, q_rope = _queries(batch)
    idx = torch.stack([torch.randperm(context, device="cuda")[:topk] for _ in range(batch)]).int()
    sweep = _mla_sweep(layer, block_table, token_seq, q_nope, q_rope, idx, MLA_SWEEP, reps)
    del cache, layer
    torch.cuda.empty_cache()
    tiles = {**RUN2_INDEX_TILES, **{"mla": _fastest_tiles(sweep)["mla"]}}
    result.update(tile_sweep=sweep, tiles_used=tiles)
    _write(out_dir, result)
    for b in (1, batch):
        result["decode"].append(
            _decode_case(b, context, topk, latent_format, ceilings["copy_TBps"], reps, tiles)
        )
        _write(out_dir, result)
    result["prefill"].append(_prefill_case(context, topk, latent_format, 2, 2 << 30, 16384, tiles))
    _write(out_dir, result)
    return result


def _write(out_dir: Path, result: dict) -> None:
    """Write what has been measured so far (a run cut short still leaves its finished cases)."""
    (out_dir / "dsa_bench.json").write_text(json.dumps(result, indent=2))
    (out_dir / "dsa_bench.md").write_text(render_markdown(result))


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
    prefill_options = [
        dict(rows_per_tile=8, num_stages=3, num_warps=4),
        dict(rows_per_tile=8, num_stages=2, num_warps=8),
        dict(rows_per_tile=4, num_stages=3, num_warps=4),
        dict(rows_per_tile=8, num_stages=2, num_warps=4),
    ]
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


def compact_summary(result: dict) -> str:
    """A few lines for a terminal: ceilings, each decode and prefill case with its split."""
    c = result["ceilings"]
    lines = [
        f"DSA {result['gpu']} {result['date']} commit {result['commit']}: copy {c['copy_TBps']:.2f} TB/s, "
        f"bf16 {c['bf16_matmul_TFLOPs']:.0f}, fp8 {c['fp8_scaled_mm_TFLOPs']:.0f} TFLOP/s; "
        f"tiles {result['tiles_used']}",
        "decode  B x S: scores/topk/mla/step us | floor us | step/floor | dense us",
    ]
    for d in result["decode"]:
        lines.append(
            f"  {d['batch']:>3} x {d['context']:>6}: {d['index_scores_us']:.0f}/{d['topk_us']:.0f}/"
            f"{d['sparse_mla_us']:.0f}/{d['step_us']:.0f} | {d['floor_us']:.0f} | {d['step_over_floor']:.2f} "
            f"| {_fmt(d['dense_sdpa_us'], 0)}"
        )
    lines.append("prefill T: scores/topk/mla/total ms | dense ms | speedup")
    for p in result["prefill"]:
        lines.append(
            f"  {p['tokens']:>6}: {p['index_scores_ms']:.1f}/{p['topk_ms']:.1f}/{p['sparse_mla_ms']:.1f}/"
            f"{p['total_ms']:.1f} | {p['dense_sdpa_ms']:.1f} | {p['speedup_vs_dense']:.2f}x"
        )
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
        f"Ceilings (same run): copy {c['copy_TBps']:.2f} TB/s, "
        f"bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s, "
        f"fp8 _scaled_mm {c['fp8_scaled_mm_TFLOPs']:.0f} TFLOP/s.",
        "",
        "## Decode (one token per sequence)",
        "",
        "| batch | context | scores us | top-k us | index+top-k us | sparse MLA us | step us | floor us "
        "| step/floor | TB/s | scores TB/s | MLA TFLOP/s | dense SDPA us | dense/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in result["decode"]:
        lines.append(
            f"| {d['batch']} | {d['context']} | {_fmt(d['index_scores_us'])} | {_fmt(d['topk_us'])} "
            f"| {_fmt(d['index_topk_us'])} | {_fmt(d['sparse_mla_us'])} "
            f"| {_fmt(d['step_us'])} | {_fmt(d['floor_us'])} | {_fmt(d['step_over_floor'], 2)} "
            f"| {_fmt(d['achieved_TBps'], 2)} | {_fmt(d['index_scores_TBps'], 2)} "
            f"| {_fmt(d['sparse_mla_TFLOPs'])} "
            f"| {_fmt(d['dense_sdpa_us'])} | {_fmt(d['dense_over_step'], 2)} |"
        )
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
    lines += ["", "## Tile sweep", "", "| kernel | options | us | rate |", "|---|---|---|---|"]
    for row in result.get("tile_sweep", []):
        opts = {k: v for k, v in row.items() if k not in ("kernel", "us", "TFLOPs", "key_TBps", "error")}
        rate = (
            f"{row['TFLOPs']:.0f} TFLOP/s"
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
    args = parser.parse_args()
    if args.acceptance:
        summary = run_dsa_acceptance(args.out)
    elif args.quick:
        summary = run_dsa_bench(
            args.out, decode_batches=(1, 4), contexts=(8192,), prefill_lengths=(8192,), reps=3, prefill_reps=2
        )
    else:
        summary = run_dsa_bench(args.out)
    print((args.out / "dsa_bench.md").read_text())
    print(compact_summary(summary))
