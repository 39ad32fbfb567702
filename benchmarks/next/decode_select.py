"""The decode top-k's candidate pass spread over more programs (issue 16, decode batch 64 x 128K).

At batch 64 ``topk_decode`` runs 2 parts a row (128 candidate programs of 8 warps on 132 SMs): on 2026-12-01
(H200, commit b7497e5, torch.profiler) its candidate pass took 58.1 us for 32 MiB of scores (0.55 TB/s) and the
register select 14.3 us. The register select holds parts x seg_cap slots (at most 8192), so more parts need fewer
slots a part: ``seg_cap`` (a part expects about 7/4 * topk / parts candidates; a part past its slots sends the row
to the full-row select, still exact). This times parts x seg_cap x the candidate launch on real indexer scores,
each checked against topk_indices_torch, graph-timed; then the fastest with one row all equal (a misjudged row).

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/decode_select.py OUT_DIR [BUDGET_S [parts|tau|b1]]
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, topk
from adapt.kernels.topk import topk_decode, topk_indices, topk_indices_torch
from adapt.stages.bench_dsa import RUN2_INDEX_TILES, _decode_inputs

CONTEXT, TOPK = 131072, 2048
TAU_BITS = topk.DECODE_TAU_BITS


def variants(batch: int) -> list[dict]:
    if batch == 1:
        grid = [dict(parts=p, seg_cap=c, flat=True, select_warps=16) for p, c in ((32, 256), (64, 128), (128, 64),
                                                                                   (128, 128))]
        return [{}] + grid + [dict(g, num_warps=4, block=1024) for g in grid]
    out = [{}]
    for parts, warps, block in itertools.product((2, 4, 8), (4, 8), (2048, 4096)):
        cap = 8192 // parts
        out.append(dict(parts=parts, seg_cap=cap, num_warps=warps, block=block))
    out += [dict(parts=16, seg_cap=512, num_warps=4, block=2048), dict(parts=8, seg_cap=512, num_warps=4, block=2048)]
    return out


def b1_grid() -> list[dict]:
    """Batch 1 with the Gluon candidate pass (session 8): the flat select over 32-128 parts of 2048 slots, steps of
    512-2048 scores on 2-8 warps, 8 or 16 select warps; the tl pass at one of them for comparison."""
    out = []
    for parts in (32, 64, 128):
        for warps, block in ((4, 1024), (2, 512), (8, 2048)):
            for sel in (16, 8):
                out.append(dict(parts=parts, seg_cap=2048, flat=True, num_warps=warps, block=block,
                                select_warps=sel))
    out.append(dict(parts=64, seg_cap=2048, flat=True, num_warps=4, block=1024, select_warps=16, gluon=False))
    return out


def tau_grid() -> list[dict]:
    """Where the candidate pass's time goes: the sample's threshold search (TAU_BITS bisection steps over SAMPLE
    sampled scores, repeated by every part of a row) against the scan, at 2 and 8 parts."""
    out = []
    for parts, cap in ((2, None), (8, 1024)):
        for bits, sample in ((16, 4096), (12, 4096), (8, 4096), (4, 4096), (16, 1024), (16, 512)):
            out.append(dict(parts=parts, seg_cap=cap, sample=sample, tau_bits=bits))
    return out


def run_batch(batch: int, t0: float, budget_s: float, grid: str = "parts") -> dict:
    layer, block_table, token_seq, limits, (q8, weights, _, _) = _decode_inputs(batch, CONTEXT)
    scores = dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits, CONTEXT,
                              rows_per_tile=1, **RUN2_INDEX_TILES["decode_index"])
    twin = topk_indices_torch(scores, limits, TOPK)
    out = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
    redo = torch.empty(batch, dtype=torch.int32, device="cuda")
    rows = []
    if batch <= dsa.TRITON_SELECT_MAX_ROWS:
        timing = time_cuda(lambda: topk_indices(scores, limits, TOPK, out=out), 20, warmup=1)
        rows.append({"name": "radix select (the batch-1 default)", "us": timing.median_us,
                     "equals_twin": bool(torch.equal(topk_indices(scores, limits, TOPK, out=out), twin))})
    for opt in {"parts": variants, "b1": lambda b: b1_grid(), "tau": lambda b: tau_grid()}[grid](batch):
        if time.monotonic() - t0 > budget_s:
            rows.append({**opt, "skipped": "budget"})
            continue
        kw = {k: v for k, v in opt.items() if k != "tau_bits" and v is not None}
        topk.DECODE_TAU_BITS = opt.get("tau_bits", TAU_BITS)
        try:
            timing = time_cuda(lambda o=kw: topk_decode(scores, limits, TOPK, out=out, redo=redo, **o), 20, warmup=1)
            topk_decode(scores, limits, TOPK, out=out, redo=redo, **kw)
            rows.append({**opt, "us": timing.median_us, "equals_twin": bool(torch.equal(out, twin)),
                         "redo_rows": int(redo.sum()), "timed_as": timing.mode})
        except Exception as err:  # recorded; the others still run
            rows.append({**opt, "error": f"{type(err).__name__}: {str(err)[:200]}"})
        print(f"batch {batch}: {rows[-1]}", flush=True)
    topk.DECODE_TAU_BITS = TAU_BITS
    if grid != "parts":
        return {"batch": batch, "grid": grid, "rows": rows}
    exact = [r for r in rows if r.get("equals_twin") and "us" in r and "name" not in r]
    if exact and batch > 1 and time.monotonic() - t0 < budget_s:
        best = min(exact, key=lambda r: r["us"])
        opt = {k: v for k, v in best.items() if k not in ("us", "equals_twin", "redo_rows", "timed_as")}
        scores[0] = 1.0
        twin = topk_indices_torch(scores, limits, TOPK)
        timing = time_cuda(lambda: topk_decode(scores, limits, TOPK, out=out, redo=redo, **opt), 20, warmup=1)
        topk_decode(scores, limits, TOPK, out=out, redo=redo, **opt)
        rows.append({**opt, "row_0_all_equal": True, "us": timing.median_us,
                     "equals_twin": bool(torch.equal(out, twin)), "redo_rows": int(redo.sum())})
        print(f"batch {batch}: {rows[-1]}", flush=True)
    return {"batch": batch, "rows": rows}


def main(out_dir: Path, budget_s: float, grid: str = "parts") -> None:
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "batches": []}
    for batch in {"parts": (64, 1), "b1": (1,), "tau": (64,)}[grid]:
        result["batches"].append(run_batch(batch, t0, budget_s, grid))
        torch.cuda.empty_cache()
        (out_dir / "decode_select.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 60.0,
         sys.argv[3] if len(sys.argv) > 3 else "parts")
