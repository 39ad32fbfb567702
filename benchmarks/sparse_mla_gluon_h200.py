"""Sparse MLA on one H200: the Gluon kernel (adapt/kernels/sparse_mla_gluon.py) beside the tl default, DeepSeek-V3.2
shapes (128 heads, latent 512 in e4m3 four groups + rope 64 bf16, top-2048).

Usage (repo root, GPU machine): PYTHONPATH=. python benchmarks/sparse_mla_gluon_h200.py OUT.json [spec JSON]
(spec: ``main``; e.g. '{"only": ["gluon", "gluon l2 ahead 2"], "batches": [64], "step": false}')

Rows: decode batch 64 x 128K and batch 1 x 128K (CUDA-graph medians, adapt.bench.timer.time_graph_ms), the last
4096 rows of a 128K prefill (eager medians, as bench_dsa's prefill sweep); selected positions are uniform random
(top-2048 of random scores), so the gathers are as scattered as the indexer's. Each row: us, TFLOP/s
(2 x rows x 128 x positions x (512 + 64 + 512)), rel. error against the twin ``sparse_mla_torch`` on 4 rows, and
the same-run ceilings (adapt.bench.ceilings.measure_ceilings); then bench_dsa's batch-64 decode step with the
default tiles (``main``)."""

from __future__ import annotations

import datetime as dt
import json
import sys

import torch

from adapt.bench.ceilings import measure_ceilings
from adapt.bench.provenance import commit
from adapt.bench.timer import time_eager_ms, time_graph_ms
from adapt.kernels import sparse_mla as sm
from adapt.kernels.formats import PAGE_SIZE
from adapt.stages.bench_dsa import HEADS, RANK, ROPE, RUN2_INDEX_TILES, _decode_case, _random_cache, _rel_err

TOPK = 2048
FLOP_PER_POSITION = 2 * HEADS * (RANK + ROPE + RANK)
DECODE_VARIANTS = {
    "tl default": {"gluon": False},
    "gluon": {"gluon": True},
    "gluon without slot prefetch": {"gluon": True, "prefetch": False},
    "gluon direct": {"gluon": {"DIRECT": True}},
    "gluon early loads": {"gluon": {"EARLY_LOADS": True}},
    "gluon direct + early loads": {"gluon": {"DIRECT": True, "EARLY_LOADS": True}},
    "gluon l2 ahead 2": {"gluon": {"L2_AHEAD": 2}},
    "gluon l2 ahead 4": {"gluon": {"L2_AHEAD": 4}},
}
PREFILL_VARIANTS = {
    "tl default": {"gluon": False},
    "tl sweep best (half, heads_inner, bk64, 2 stages, prefetch)": dict(half=True, heads_inner=True, block_k=64,
                                                                        num_stages=2, prefetch=True),
    "gluon": {"gluon": True},
    "gluon without slot prefetch": {"gluon": True, "prefetch": False},
    "gluon direct": {"gluon": {"DIRECT": True}},
    "gluon direct + early loads": {"gluon": {"DIRECT": True, "EARLY_LOADS": True}},
    "gluon l2 ahead 2": {"gluon": {"L2_AHEAD": 2}},
    "gluon l2 ahead 4": {"gluon": {"L2_AHEAD": 4}},
}


def _rows(label, layer, block_table, token_seq, idx, q_nope, q_rope, variants, graph, reps, extra=None):
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table, token_seq, idx, 0.1)
    sub = tuple(a[:4] if a is q_nope or a is q_rope or a is token_seq or a is idx else a for a in args)
    flops = FLOP_PER_POSITION * int((idx >= 0).sum())
    out = []
    twins = {}
    for name, opt in variants.items():
        row = {"case": label, "variant": name, **opt}
        try:
            got = sm.sparse_mla(*args, **opt)[:4]  # the timed launch (its slices), first 4 rows checked
            half = bool(opt.get("half"))
            if half not in twins:
                twins[half] = sm.sparse_mla_torch(*sub, half=half)
            row["rel_err_vs_twin"] = _rel_err(got, twins[half])
            timer = time_graph_ms if graph else time_eager_ms
            ms = timer(lambda o=opt: sm.sparse_mla(*args, **o), reps)
            row.update(us=ms * 1e3, TFLOPs=flops / ms / 1e9)
        except Exception as err:  # recorded; the other variants still run
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def decode(batch: int, context: int, variants: dict, reps: int) -> list[dict]:
    cache = _random_cache(batch * context, "fp8")
    layer = cache.dsa_layer(0)
    pages = context // PAGE_SIZE
    block_table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    token_seq = torch.arange(batch, device="cuda", dtype=torch.int32)
    idx = torch.rand(batch, context, device="cuda").topk(TOPK, dim=1).indices.int()
    q_nope = torch.randn(batch, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    if batch < 64:
        variants = dict(variants, **{f"{k} splits {n}": {**v, "splits": n} for k, v in variants.items()
                                     for n in (16, 32) if k in ("tl default", "gluon", "gluon direct")})
    return _rows(f"decode b{batch} x {context}", layer, block_table, token_seq, idx, q_nope, q_rope, variants, True,
                 reps)


def prefill_tail(length: int, rows: int, variants: dict, reps: int) -> list[dict]:
    cache = _random_cache(length, "fp8")
    layer = cache.dsa_layer(0)
    block_table = torch.arange(length // PAGE_SIZE, device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(rows, device="cuda", dtype=torch.int32)
    pos = torch.arange(length - rows, length, device="cuda")
    idx = torch.empty(rows, TOPK, device="cuda", dtype=torch.int32)
    for r0 in range(0, rows, 512):  # causal: row t selects among positions 0 .. t
        scores = torch.rand(min(512, rows - r0), length, device="cuda")
        scores[torch.arange(length, device="cuda")[None, :] > pos[r0:r0 + 512, None]] = -1.0
        idx[r0:r0 + 512] = scores.topk(TOPK, dim=1).indices.int()
    q_nope = torch.randn(rows, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(rows, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    return _rows(f"prefill last {rows} of {length}", layer, block_table, token_seq, idx, q_nope, q_rope, variants,
                 False, reps)


def main(path: str, spec: str | None = None) -> None:
    """Ceilings, the sparse MLA rows, then (``step``, default on) bench_dsa's decode case at batch 64 x 128K with
    the default tiles (index + top-k + sparse MLA step against its byte floor); the JSON is rewritten after
    each part, so a call cut short keeps what finished. ``spec`` (JSON) may name ``only`` (the variants to time,
    by name), ``batches`` (decode batches, default [64, 1]), ``reps``, ``prefill``, ``prefill_reps``, ``step``."""
    cfg = json.loads(spec) if spec else {}
    only = cfg.get("only")
    unknown = set(only or ()) - set(DECODE_VARIANTS) - set(PREFILL_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}")

    def pick(variants: dict) -> dict:
        return {k: v for k, v in variants.items() if only is None or k in only}

    result = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit(),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    result["ceilings"] = measure_ceilings(copy_gib=2, reps=10, matmul_reps=5)
    print(json.dumps(result["ceilings"]), flush=True)
    for batch in cfg.get("batches", (64, 1)):
        result["rows"] += decode(batch, 131072, pick(DECODE_VARIANTS), cfg.get("reps", 20))
        torch.cuda.empty_cache()
        save()
    if cfg.get("prefill", True):
        result["rows"] += prefill_tail(131072, 4096, pick(PREFILL_VARIANTS), cfg.get("prefill_reps", 5))
        torch.cuda.empty_cache()
        save()
    if cfg.get("step", True):
        step = _decode_case(64, 131072, TOPK, "fp8", result["ceilings"]["copy_tbps"], 10,
                            {**RUN2_INDEX_TILES, "mla": {}})
        result["decode_step_b64"] = step
        print(json.dumps({k: step[k] for k in ("sparse_mla_us", "sparse_mla_TFLOPs", "step_us", "floor_us",
                                               "step_over_floor", "step_us_decode_select",
                                               "step_over_floor_decode_select", "sparse_mla_rel_err_vs_twin")}),
              flush=True)
        save()


if __name__ == "__main__":
    main(*sys.argv[1:])
