"""Where the 128K prefill's top-k time goes (issue 16): the select methods and ``topk_decode`` launch options on
real prefill score chunks, each checked against torch.topk's position sets, then a per-kernel profile of the
default prefiltered select and of ``topk_decode`` on one chunk.

On 2026-12-01 (H200, commit b7497e5) the whole prefill's top-k took 72.8 ms with the prefiltered select and about
76 ms with ``topk_decode`` at its decode defaults, while reading every visible score once is about 10 ms.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/prefill_select.py OUT_DIR [BUDGET_S]
Writes OUT_DIR/prefill_select.json; prints one line per variant.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, topk
from adapt.kernels.formats import PAGE_SIZE
from adapt.stages.bench_dsa import RUN2_INDEX_TILES, _queries, _random_cache
from benchmarks.dsa_kernel_profile import kernel_times

LENGTH, TOPK, CHUNK = 131072, 2048, 4096
# (name, callable options): topk_decode keyword options
DECODE_VARIANTS = [
    ("decode default", {}),
    ("decode block 2048 cand warps 4", {"block": 2048, "num_warps": 4}),
    ("decode block 2048 w4 sel 8", {"block": 2048, "num_warps": 4, "select_warps": 8}),
    ("decode block 2048 w4 sel 4", {"block": 2048, "num_warps": 4, "select_warps": 4}),
    ("decode block 2048 cand warps 2", {"block": 2048, "num_warps": 2}),
    ("decode block 1024 cand warps 4", {"block": 1024, "num_warps": 4}),
    ("decode block 1024 cand warps 2", {"block": 1024, "num_warps": 2}),
    ("decode block 1024 w2 sel 8", {"block": 1024, "num_warps": 2, "select_warps": 8}),
    ("decode block 512 cand warps 1", {"block": 512, "num_warps": 1}),
    ("decode block 2048 w4 no prefetch", {"block": 2048, "num_warps": 4, "prefetch": False}),
]
# topk_prefiltered's candidate pass options (its final select: torch.topk over the candidates)
PREFILTER_VARIANTS = [
    ("prefilter block 1024 w4", {"block": 1024, "num_warps": 4}),
    ("prefilter block 2048 w4", {"block": 2048, "num_warps": 4}),
    ("prefilter block 1024 w2", {"block": 1024, "num_warps": 2}),
]


def _sets_differ(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got.sort(dim=1).values != want.sort(dim=1).values).any(dim=1).sum())


def run_chunk(layer, block_table, r0: int, t0: float, budget_s: float, result: dict) -> None:
    """The select variants on the score chunk of rows [r0, r0 + CHUNK) (causal limits), into ``result``."""
    r1 = r0 + CHUNK
    q8, weights, _, _ = _queries(CHUNK)
    token_seq = torch.zeros(CHUNK, device="cuda", dtype=torch.int32)
    limits = torch.arange(r0 + 1, r1 + 1, device="cuda", dtype=torch.int32)
    cols = -(-r1 // dsa.KEY_BLOCK) * dsa.KEY_BLOCK
    scores = dsa.index_scores(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits, cols,
                              **RUN2_INDEX_TILES["prefill_index"])
    visible_bytes = 4 * int(limits.sum())
    want = torch.topk(scores, TOPK, dim=-1, sorted=False).indices.int()
    chunk = {"rows": [r0, r1], "cols": cols, "visible_score_bytes": visible_bytes, "variants": []}
    result["chunks"].append(chunk)
    out = torch.empty(CHUNK, TOPK, dtype=torch.int32, device="cuda")

    def record(name, fn, graph):
        if time.monotonic() - t0 > budget_s:
            chunk["variants"].append({"name": name, "skipped": "budget"})
            return
        try:
            differ = _sets_differ(fn(), want)
            timing = time_cuda(fn, reps=5, warmup=1, graph=graph)
        except Exception as err:  # recorded; the other variants still run
            chunk["variants"].append({"name": name, "error": f"{type(err).__name__}: {str(err)[:200]}"})
            print(f"rows {r0}: {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
            return
        ms = timing.median_us / 1e3
        row = {"name": name, "ms": ms, "mode": timing.mode, "rows_differing": differ,
               "visible_TBps": visible_bytes / ms / 1e9}
        chunk["variants"].append(row)
        print(f"rows {r0}-{r1}: {name:34s} {ms:8.3f} ms ({timing.mode}) {row['visible_TBps']:.2f} TB/s of "
              f"visible scores, {differ} rows differ", flush=True)

    record("torch.topk", lambda: torch.topk(scores, TOPK, dim=-1, sorted=False).indices.int(), True)
    record("prefilter (torch final)", lambda: topk.topk_prefiltered(scores, limits, TOPK, out=out)[0], False)
    record("prefilter (triton final)",
           lambda: topk.topk_prefiltered(scores, limits, TOPK, out=out, final="triton")[0], False)
    for name, opts in PREFILTER_VARIANTS:
        record(name, lambda o=opts: topk.topk_prefiltered(scores, limits, TOPK, out=out, **o)[0], False)
    for name, opts in DECODE_VARIANTS:
        record(name, lambda o=opts: topk.topk_decode(scores, limits, TOPK, out=out, **o), True)
    if r1 == LENGTH and time.monotonic() - t0 < budget_s:
        result["profile"]["prefilter"] = kernel_times(lambda: topk.topk_prefiltered(scores, limits, TOPK, out=out), 3)
        result["profile"]["decode default"] = kernel_times(lambda: topk.topk_decode(scores, limits, TOPK, out=out), 3)
        for key, rows in result["profile"].items():
            top = [f"{r['kernel'][:40]} x{r['launches_per_step']:g} {r['us_per_step']:.0f} us" for r in rows[:6]]
            print(f"profile {key}: " + "; ".join(top), flush=True)


def whole_prefill(layer, block_table, result: dict) -> dict:
    """``index_topk`` over the whole causal prefill (2 GiB score chunks, as bench_dsa) with the prefiltered select,
    with ``decode`` under the ``topk_decode`` options that were fastest summed over the timed chunks
    (``dsa.PREFILL_DECODE_OPTIONS``) and under its decode defaults, each timed eagerly (the prefilter syncs), and the
    position sets compared. (Calls 2-3 of benchmarks/gpu-2026-12-01-dsa-s7 ran this before the decode select became
    the prefill default: their ``auto_ms`` is the prefiltered select.)"""
    totals: dict[str, float] = defaultdict(float)
    for chunk in result["chunks"]:
        for row in chunk["variants"]:
            if "ms" in row and row["name"].startswith("decode") and row["rows_differing"] == 0:
                totals[row["name"]] += row["ms"]
    complete = [n for n in totals if all(any(r.get("name") == n and "ms" in r for r in c["variants"])
                                         for c in result["chunks"])]
    if not complete:
        return {"error": "no decode variant ran on every chunk"}
    best = min(complete, key=totals.get)
    options = dict(dict(DECODE_VARIANTS)[best])
    q8, weights, _, _ = _queries(LENGTH)
    token_seq = torch.zeros(LENGTH, device="cuda", dtype=torch.int32)
    limits = torch.arange(1, LENGTH + 1, device="cuda", dtype=torch.int32)
    held = {}

    def run(select):
        held[select] = dsa.index_topk(q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits,
                                      TOPK, max_score_bytes=2 << 30, select=select,
                                      **RUN2_INDEX_TILES["prefill_index"])[0]

    out = {"decode_options": options, "chosen_from": best}
    adopted = dsa.PREFILL_DECODE_OPTIONS
    try:
        out["prefilter_ms"] = time_cuda(lambda: run("prefilter"), reps=3, warmup=1, graph=False).median_us / 1e3
        dsa.PREFILL_DECODE_OPTIONS = options
        out["decode_ms"] = time_cuda(lambda: run("decode"), reps=3, warmup=1, graph=False).median_us / 1e3
        dsa.PREFILL_DECODE_OPTIONS = {}
        out["decode_default_ms"] = time_cuda(lambda: run("decode"), reps=3, warmup=1, graph=False).median_us / 1e3
        differ = (held["prefilter"].sort(dim=1).values != held["decode"].sort(dim=1).values).any(dim=1)
        out["rows_differing_decode_vs_prefilter"] = int(differ.sum())
    except Exception as err:  # recorded
        out["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    finally:
        dsa.PREFILL_DECODE_OPTIONS = adopted
    print(f"whole prefill index_topk: {out}", flush=True)
    return out


def main(out_dir: Path, budget_s: float) -> None:
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    layer = _random_cache(LENGTH, "fp8").dsa_layer(0)
    block_table = torch.arange(-(-LENGTH // PAGE_SIZE), device="cuda", dtype=torch.int32)[None]
    result = {"gpu": torch.cuda.get_device_name(), "chunks": [], "profile": {}}
    for r0 in (32768, LENGTH - CHUNK):
        run_chunk(layer, block_table, r0, t0, budget_s, result)
        torch.cuda.empty_cache()
        (out_dir / "prefill_select.json").write_text(json.dumps(result, indent=1))
    result["whole_prefill"] = whole_prefill(layer, block_table, result)
    result["seconds"] = time.monotonic() - t0
    (out_dir / "prefill_select.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
