"""The lazy rescale of the single-partition Gluon sparse MLA decode kernel (``sparse_mla_gluon_kernel``'s LAZY flag)
against its default, exact online softmax (issue 16: sparse MLA decode at least 300 TFLOP/s), in the order default,
lazy TAU 8, lazy TAU 8, default (drift between the first and the last call shows), then lazy TAU 0.5 once.

The single-partition kernel runs each tile as one chain: q.k MMA wait -> softmax -> accumulator rescale (128 FMUL
a thread) -> p @ v issue -> gathers and dequantisation of the next tile (about 4.4 us a 64-position tile at batch
64). With LAZY = TAU a row keeps its running max until a tile's exceeds it by more than TAU (log2 units), and the
rescale runs under a uniform branch only on tiles where some row moved: the sm_90 build's loop is 1,244
instructions a thread with the rescale and 1,116 without it, against 1,222 for the default
(``benchmarks/sparse_mla_sass.py``). TAU 0.5 makes the branch fire more often, to show what taking it costs.

Times, graph-replayed, on one set of inputs each: decode batch 64 x 128K top-2048 (128 heads), batch 1 with position
slices, and 4096 prefill rows of one 128K sequence (top-2048 each); every variant checked against the twin and
bit-compared with the default (the lazy variants round p and l against another max: ``equals_single_partition``
false is expected, ``rel_err_vs_twin`` is their check). FLOPs: 2 * heads * positions * (512 + 64 + 512) a row.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/mla_ws.py OUT_DIR [BUDGET_S]
Writes OUT_DIR/mla_ws.json; prints one line per variant.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import sparse_mla_gluon
from adapt.kernels.sparse_mla import sparse_mla, sparse_mla_torch
from adapt.stages.bench_dsa import HEADS, RANK, ROPE, _decode_inputs, _random_cache, _rel_err

CONTEXT, TOPK = 131072, 2048
VARIANTS = [
    ("single-partition (default)", {}),
    ("lazy rescale tau 8", {"LAZY": 8.0}),
    ("lazy rescale tau 8 again", {"LAZY": 8.0}),
    ("single-partition again", {}),
    ("lazy rescale tau 0.5", {"LAZY": 0.5}),
]


def flops(rows: int) -> float:
    return 2.0 * rows * HEADS * TOPK * (RANK + ROPE + RANK)


def run_case(name, args, rows, splits, out, budget_end, reps=30, twin_rows=None):
    twin_args = args if twin_rows is None else tuple(a[:twin_rows] if i in (0, 1, 6, 7) else a
                                                      for i, a in enumerate(args))
    twin = sparse_mla_torch(*twin_args)
    base = None
    for vname, flags in VARIANTS:
        if time.time() > budget_end:
            out.append({"case": name, "variant": vname, "skipped": "budget"})
            continue
        opts = {"gluon": dict(flags)} if splits is None else {"gluon": dict(flags), "splits": splits}
        row = {"case": name, "variant": vname, "flags": flags, "splits": splits}
        try:
            got = sparse_mla(*args, **opts)
            torch.cuda.synchronize()
            row["rel_err_vs_twin"] = _rel_err(got[:twin.shape[0]].float(), twin.float())
            if base is None and not flags:
                base = got.clone()
            row["equals_single_partition"] = bool(base is not None and torch.equal(got, base))
            t = time_cuda(lambda o=opts: sparse_mla(*args, **o), reps, warmup=2)
            row.update(us=t.median_us, timed_as=t.mode, tflops=flops(rows) / t.median_us / 1e6)
        except Exception as err:  # recorded; the other variants still run
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        out.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    budget_end = time.time() + (float(sys.argv[2]) if len(sys.argv) > 2 else 240)
    torch.manual_seed(0)
    rows_out: list[dict] = []
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "gluon_flags": sparse_mla_gluon.GLUON_FLAGS}
    # decode batch 64 x 128K
    layer, block_table, token_seq, limits, (_, _, q_nope, q_rope) = _decode_inputs(64, CONTEXT)
    idx = torch.stack([torch.randperm(CONTEXT, device="cuda")[:TOPK] for _ in range(64)]).int()
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table, token_seq, idx,
            0.1)
    run_case("decode b64 x 128K", args, 64, None, rows_out, budget_end)
    args1 = tuple(a[:1] if i in (0, 1, 6, 7) else a for i, a in enumerate(args))
    run_case("decode b1 x 128K", args1, 1, None, rows_out, budget_end)
    layer = block_table = args = args1 = None
    torch.cuda.empty_cache()
    # 4096 prefill rows of one 128K sequence
    rows = 4096
    layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
    block_table = torch.randperm(CONTEXT // 64, device="cuda").view(1, -1).int()
    token_seq = torch.zeros(rows, device="cuda", dtype=torch.int32)
    idx = torch.randint(0, CONTEXT, (rows, TOPK), device="cuda", dtype=torch.int32)
    q_nope = torch.randn(rows, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(rows, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table, token_seq, idx, 0.1)
    run_case("prefill 4096 rows of 128K", args, rows, None, rows_out, budget_end, reps=10, twin_rows=256)
    (out_dir / "mla_ws.json").write_text(json.dumps({"info": info, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
