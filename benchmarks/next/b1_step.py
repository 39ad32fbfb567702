"""The batch-1 decode step (issue 16) under module switches, in turns: each variant sets module attributes (the
Gluon sparse MLA's programmatic dependent launch, its partials in bf16, the grid select's warps, ...) and the step
runs in the acceptance's form (one CUDA graph of 8 layers over their own 128K caches, us a layer; replays STEADY
back to back a sample). Before timing,
each variant's output on layer 0 is compared with the default's (bit-equal, or the largest difference in bf16 ulps
of the output) and with the float64 twin (``sparse_mla_torch`` on the same positions: relative error). Then the
parts of the default and of the last variant (scores + select; sparse MLA with and without its combine).

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/b1_step.py OUT_DIR [ROUNDS]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import dsa, sparse_mla, sparse_mla_gluon
from adapt.stages.bench_dsa import GRAPH_LAYERS, _queries, _random_cache

CONTEXT, TOPK = 131072, 2048
STEADY = 10  # graph replays back to back a sample (``time_cuda``'s batch; session 14 on: the host's latency hidden)
# name -> {(module, attribute): value}
VARIANTS = {
    "default": {},
    # session 14, call 2 (H200, commit cc5df85, 5 rounds, graph of 8 synced a replay): default 39.70, GLUON_PDL
    # 41.25, PARTIAL_BF16 43.05, both 47.13, cand_once 39.50, 16 select warps 44.20, PDL + cand once 41.62; call 6
    # (b7fcd5c, back to back): default 39.38, cand_once 39.21 (the default since), two select programs an SM (256 of
    # 512 keys) 46.43 at 8 warps and 42.87 at 4 (removed)
    "select cand once off": {(dsa, "FEW_ROWS_GRID_OPTIONS"): {"num_warps": 8, "cand_once": False}},
    "mla pdl": {(sparse_mla_gluon, "GLUON_PDL"): True},
}


def ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors (finite entries)."""
    a = got.view(torch.int16).int()
    b = want.view(torch.int16).int()
    a = torch.where(a < 0, -(a & 0x7FFF), a)
    b = torch.where(b < 0, -(b & 0x7FFF), b)
    return int((a - b).abs().max())


def main(out_dir: Path, rounds: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    block_table = torch.arange(CONTEXT // 64, device="cuda", dtype=torch.int32)[None]
    token_seq = torch.zeros(1, device="cuda", dtype=torch.int32)
    limits = torch.full((1,), CONTEXT, device="cuda", dtype=torch.int32)
    stack = []
    for _ in range(GRAPH_LAYERS):
        layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
        q8, weights, q_nope, q_rope = _queries(1)
        stack.append((layer, (q8, weights, layer.index_k, layer.index_scale, block_table, token_seq, limits),
                      q_nope, q_rope))

    def step_of(layer, args, q_nope, q_rope, parts="step"):
        idx, _ = dsa.index_topk(*args, TOPK, max_keys=CONTEXT, rows_per_tile=1)
        if parts == "select":
            return idx
        return sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope,
                                     block_table, token_seq, idx, 0.1)

    def graph(parts="step"):
        def run():
            for layer, args, q_nope, q_rope in stack:
                step_of(layer, args, q_nope, q_rope, parts)
        return run

    saved = {key: getattr(*key) for v in VARIANTS.values() for key in v}

    def apply(name):
        for (mod, attr), value in saved.items():
            setattr(mod, attr, value)
        for (mod, attr), value in VARIANTS[name].items():
            setattr(mod, attr, value)

    layer0 = stack[0]
    checks = {}
    want = None
    idx0 = dsa.index_topk(*layer0[1], TOPK, max_keys=CONTEXT, rows_per_tile=1)[0]
    twin = sparse_mla.sparse_mla_torch(layer0[2], layer0[3], layer0[0].latent_nope, layer0[0].latent_scale,
                                       layer0[0].latent_rope, block_table, token_seq, idx0, 0.1)
    for name in VARIANTS:
        apply(name)
        try:
            idx = step_of(*layer0, parts="select")
            out = step_of(*layer0)
            torch.cuda.synchronize()
            if want is None:
                want = out.clone()
            d = (out.float() - twin.float()).norm() / twin.float().norm()
            checks[name] = {"select_equal": bool(torch.equal(idx, idx0)), "bit_equal": bool(torch.equal(out, want)),
                            "max_ulps_vs_default": ulps(out, want), "rel_err_vs_twin": float(d)}
        except Exception as err:  # recorded; the variant is then left out of the timing
            checks[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(name, json.dumps(checks[name]), flush=True)
    apply("default")
    rows = []
    names = [n for n in VARIANTS if "error" not in checks[n]]
    for rnd in range(rounds):
        for name in names:
            apply(name)
            us = time_cuda(graph(), 30, warmup=1, batch=STEADY).median_us / GRAPH_LAYERS
            rows.append({"round": rnd, "variant": name, "us_per_layer": us})
            print(json.dumps(rows[-1]), flush=True)
    real_combine = sparse_mla._combine
    for rnd in range(2):
        for name in (names[0], names[-1]):
            apply(name)
            for parts in ("select", "mla", "mla without combine"):
                if parts == "select":
                    fn = graph("select")
                else:
                    def fn(skip=parts != "mla"):
                        sparse_mla._combine = (lambda *a, **k: None) if skip else real_combine
                        for layer, _, q_nope, q_rope in stack:
                            sparse_mla.sparse_mla(q_nope, q_rope, layer.latent_nope, layer.latent_scale,
                                                  layer.latent_rope, block_table, token_seq, idx0, 0.1)
                        sparse_mla._combine = real_combine
                us = time_cuda(fn, 30, warmup=1, batch=STEADY).median_us / GRAPH_LAYERS
                rows.append({"round": rnd, "variant": f"{name}: {parts}", "us_per_layer": us})
                print(json.dumps(rows[-1]), flush=True)
    apply("default")
    summary = {n: statistics.median(r["us_per_layer"] for r in rows if r["variant"] == n)
               for n in dict.fromkeys(r["variant"] for r in rows)}
    print(json.dumps(summary, indent=1))
    (out_dir / "b1_step.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "checks": checks,
                                                      "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5)
