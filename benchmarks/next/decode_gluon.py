"""The decode top-k's Gluon candidate pass against the tl pass (issue 16), on real indexer scores.

Session 8: call 2 timed the Gluon pass with one or two whole steps in flight (``topk.DECODE_GLUON_DEPTH``); the
variants now are the warps a candidate program (8 or 16) and its step, against the tl pass.

``topk_decode``'s first launch (``decode_candidates``) at batch 64 x 128K: the tl pass ran at 0.55 TB/s (58 us of
a 72 us top-k on 2026-12-01); its sm_90 step builds two scans, four layout conversions and 23 barriers for 16
scores a thread. The Gluon pass (``topk_gluon``) keeps one layout from load to store (2 barriers a step).
This times, on one set of inputs, graph-replayed: the whole ``topk_decode`` with each pass over launch options
(each checked against the twin, with its redo rows and its candidates against the tl pass at the same options),
a per-kernel profile of both defaults; then the last 4096-row chunk of a 128K causal prefill (sets against
torch.topk) and the whole prefill's ``index_topk`` (select "decode") with either pass, eager.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/decode_gluon.py OUT_DIR [BUDGET_S]
Writes OUT_DIR/decode_gluon.json; prints one line per variant.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, topk
from adapt.kernels.formats import PAGE_SIZE
from adapt.kernels.topk import decode_candidates, topk_decode, topk_indices_torch
from adapt.stages.bench_dsa import RUN2_INDEX_TILES, _decode_inputs, _queries, _random_cache
from benchmarks.dsa_kernel_profile import kernel_times

CONTEXT, TOPK, CHUNK = 131072, 2048, 4096
# (name, topk_decode options, Gluon steps in flight: topk.DECODE_GLUON_DEPTH). Session 8's call 2 timed depth 1
# against 2; its last call the warps a candidate program (16: two warps a scheduler more than 8).
DECODE_VARIANTS = [
    ("tl default", dict(gluon=False), 1),
    ("gluon default", dict(gluon=True), 1),
    ("gluon w16 block 8192", dict(gluon=True, num_warps=16, block=8192), 1),
    ("gluon w16 block 4096", dict(gluon=True, num_warps=16, block=4096), 1),
    ("gluon w8 block 2048", dict(gluon=True, block=2048), 1),
    ("gluon w16 block 4096 parts 4", dict(gluon=True, num_warps=16, block=4096, parts=4, seg_cap=2048), 1),
    ("gluon default again", dict(gluon=True), 1),
    ("gluon w16 block 8192 again", dict(gluon=True, num_warps=16, block=8192), 1),
    ("gluon w16 block 4096 again", dict(gluon=True, num_warps=16, block=4096), 1),
    ("tl default again", dict(gluon=False), 1),
]
PREFILL_VARIANTS = [
    ("tl prefill options", dict(dsa.PREFILL_DECODE_OPTIONS, gluon=False), 1),
    ("gluon prefill options", dict(dsa.PREFILL_DECODE_OPTIONS, gluon=True), 1),
    ("gluon w8 block 4096 sel 8", dict(gluon=True, block=4096, num_warps=8, select_warps=8), 1),
    ("gluon w16 block 8192 sel 8", dict(gluon=True, block=8192, num_warps=16, select_warps=8), 1),
    ("gluon w8 block 2048 sel 8", dict(gluon=True, block=2048, num_warps=8, select_warps=8), 1),
    ("gluon w8 block 4096 sel 16", dict(gluon=True, block=4096, num_warps=8, select_warps=16), 1),
]


def same_candidates(scores, limits, opts) -> bool:
    """Whether the Gluon pass stores the tl pass's tau, counts and slots at these options."""
    parts = opts.get("parts") or topk.decode_parts(scores.shape[0], scores.device)
    kw = dict(parts=parts, sample=topk.DECODE_SAMPLE, seg_cap=opts.get("seg_cap") or topk.DECODE_SEG_CAP * TOPK,
              block=opts.get("block"), num_warps=opts.get("num_warps"))
    a = decode_candidates(scores, limits, TOPK, gluon=True, **kw)
    b = decode_candidates(scores, limits, TOPK, gluon=False, **kw)
    stored = torch.arange(a[1].shape[2], device="cuda") < a[3].clamp(max=a[1].shape[2])[..., None]
    return bool(torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])
                and torch.equal(torch.where(stored, a[1], 0), torch.where(stored, b[1], 0))
                and torch.equal(torch.where(stored, a[2], 0), torch.where(stored, b[2], 0)))


def decode_batch(result: dict, t0: float, budget_s: float) -> None:
    layer, block_table, token_seq, limits, (q8, weights, _, _) = _decode_inputs(64, CONTEXT)
    scores = dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits, CONTEXT,
                              rows_per_tile=1, **RUN2_INDEX_TILES["decode_index"])
    twin = topk_indices_torch(scores, limits, TOPK)
    out = torch.empty(64, TOPK, dtype=torch.int32, device="cuda")
    redo = torch.empty(64, dtype=torch.int32, device="cuda")
    rows = result["decode_batch64"] = []
    for name, opts, depth in DECODE_VARIANTS:
        if time.monotonic() - t0 > budget_s:
            rows.append({"name": name, "skipped": "budget"})
            continue
        topk.DECODE_GLUON_DEPTH = depth
        try:
            timing = time_cuda(lambda o=opts: topk_decode(scores, limits, TOPK, out=out, redo=redo, **o), 20,
                               warmup=2)
            topk_decode(scores, limits, TOPK, out=out, redo=redo, **opts)
            row = {"name": name, **opts, "depth": depth, "us": timing.median_us, "timed_as": timing.mode,
                   "equals_twin": bool(torch.equal(out, twin)), "redo_rows": int(redo.sum())}
            if opts.get("gluon"):
                row["same_candidates_as_tl"] = same_candidates(scores, limits, opts)
            rows.append(row)
        except Exception as err:  # recorded; the others still run
            rows.append({"name": name, **opts, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        print(f"batch 64: {rows[-1]}", flush=True)
    result["read_bytes"] = 4 * int(limits.sum())
    for name, opts, depth in (("tl", dict(gluon=False), 1), ("gluon", dict(gluon=True), 1),
                              ("gluon w16 block 8192", dict(gluon=True, num_warps=16, block=8192), 1)):
        topk.DECODE_GLUON_DEPTH = depth
        try:
            prof = kernel_times(lambda o=opts: topk_decode(scores, limits, TOPK, out=out, redo=redo, **o), 5)
            result["profile_" + name] = prof
            print(f"profile {name}: " + "; ".join(f"{r['kernel'][:40]} {r['us_per_step']:.1f} us" for r in prof[:4]),
                  flush=True)
        except Exception as err:
            result["profile_" + name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}


def prefill(result: dict, t0: float, budget_s: float) -> None:
    layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
    block_table = torch.arange(-(-CONTEXT // PAGE_SIZE), device="cuda", dtype=torch.int32)[None]
    r0, r1 = CONTEXT - CHUNK, CONTEXT
    q8, weights, _, _ = _queries(CHUNK)
    token_seq = torch.zeros(CHUNK, device="cuda", dtype=torch.int32)
    limits = torch.arange(r0 + 1, r1 + 1, device="cuda", dtype=torch.int32)
    scores = dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits, CONTEXT,
                              **RUN2_INDEX_TILES["prefill_index"])
    want = torch.topk(scores, TOPK, dim=-1, sorted=False).indices.int().sort(dim=1).values
    out = torch.empty(CHUNK, TOPK, dtype=torch.int32, device="cuda")
    rows = result["prefill_chunk"] = []
    for name, opts, depth in PREFILL_VARIANTS:
        if time.monotonic() - t0 > budget_s:
            rows.append({"name": name, "skipped": "budget"})
            continue
        topk.DECODE_GLUON_DEPTH = depth
        try:
            timing = time_cuda(lambda o=opts: topk_decode(scores, limits, TOPK, out=out, **o), 5, warmup=1)
            differ = int((topk_decode(scores, limits, TOPK, out=out, **opts).sort(dim=1).values != want)
                         .any(dim=1).sum())
            rows.append({"name": name, **opts, "depth": depth, "ms": timing.median_us / 1e3, "timed_as": timing.mode,
                         "rows_differing": differ})
        except Exception as err:
            rows.append({"name": name, **opts, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        print(f"prefill rows {r0}-{r1}: {rows[-1]}", flush=True)
    try:
        result["prefill_chunk_profile"] = kernel_times(
            lambda: topk_decode(scores, limits, TOPK, out=out, **dsa.PREFILL_DECODE_OPTIONS), 3)
        print("prefill chunk profile: " + "; ".join(f"{r['kernel'][:40]} {r['us_per_step']:.0f} us"
                                                    for r in result["prefill_chunk_profile"][:4]), flush=True)
    except Exception as err:
        result["prefill_chunk_profile"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    scores = want = None  # freed before the whole prefill
    torch.cuda.empty_cache()
    q8, weights, _, _ = _queries(CONTEXT)
    token_seq = torch.zeros(CONTEXT, device="cuda", dtype=torch.int32)
    limits = torch.arange(1, CONTEXT + 1, device="cuda", dtype=torch.int32)
    held: dict = {}
    adopted = topk.DECODE_GLUON, topk.DECODE_GLUON_DEPTH
    whole = result["whole_prefill"] = {}
    for name, flag, depth in (("tl", False, 1), ("gluon", True, 1), ("tl again", False, 1), ("gluon again", True, 1)):
        if time.monotonic() - t0 > budget_s:
            whole[name] = "skipped: budget"
            continue
        topk.DECODE_GLUON = flag
        topk.DECODE_GLUON_DEPTH = depth
        try:
            def run(n=name):
                held[n] = dsa.index_topk(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq,
                                         limits, TOPK, max_score_bytes=2 << 30, select="decode",
                                         **RUN2_INDEX_TILES["prefill_index"])[0]
            whole[name + "_ms"] = time_cuda(run, reps=3, warmup=1, graph=False).median_us / 1e3
        except Exception as err:
            whole[name] = f"{type(err).__name__}: {str(err)[:300]}"
        finally:
            topk.DECODE_GLUON, topk.DECODE_GLUON_DEPTH = adopted
        print(f"whole prefill index_topk ({name}): {whole.get(name + '_ms', whole.get(name))}", flush=True)
    for name in ("gluon",):
        if "tl" in held and name in held:
            whole[f"rows_differing_{name}_vs_tl"] = int((held["tl"] != held[name]).any(dim=1).sum())


def main(out_dir: Path, budget_s: float) -> None:
    t0 = time.monotonic()
    depth = topk.DECODE_GLUON_DEPTH
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name()}
    decode_batch(result, t0, budget_s)
    torch.cuda.empty_cache()
    (out_dir / "decode_gluon.json").write_text(json.dumps(result, indent=1))
    prefill(result, t0, budget_s)
    topk.DECODE_GLUON_DEPTH = depth
    result["seconds"] = time.monotonic() - t0
    (out_dir / "decode_gluon.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 100.0)
