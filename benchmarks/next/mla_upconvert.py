"""Issue 16, prefill: sparse MLA over the cache converted once to a dense bf16 latent (``sparse_mla(...,
upconvert=True)``: ``upconvert_latent`` + ``sparse_mla_gluon.sparse_mla_gluon_bf16_kernel``) against the default fp8
Gluon kernel, which gathers e4m3 rows and dequantises them in its loop (about a third of its 1,222 instructions a
tile, sm_90 build), for every (row, 64 heads) program that selects them.

Cases (one 128K sequence, 128 heads, top-2048; FLOPs 2 * heads * positions * (512 + 64 + 512) a row):
- the last 4096 rows with uniformly random positions (as ``mla_ws.py``): the fp8 kernel, upconvert (conversion
  included), the conversion alone, the bf16 kernel alone over a converted cache at its defaults and with its options
  (EARLY_WAIT, DEFER_SUM, COPY_ROWS4) named; checked against the twin on 256 rows and bit-compared (without DEFER_SUM
  the bf16 kernel equals the fp8 one);
- the whole prefill's attention as ``bench_dsa`` runs it (128K rows in chunks of 16384, causal random positions;
  its ``sparse_mla_ms``): default against upconvert, in turns.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/mla_upconvert.py OUT_DIR [ROUNDS]
Writes OUT_DIR/mla_upconvert.json; prints one line per row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import sparse_mla as sm
from adapt.kernels import sparse_mla_gluon
from adapt.stages.bench_dsa import HEADS, RANK, ROPE, _random_cache, _rel_err

CONTEXT, TOPK, TAIL, CHUNK = 131072, 2048, 4096, 16384


def flops(positions: float) -> float:
    return 2.0 * HEADS * positions * (RANK + ROPE + RANK)


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.manual_seed(0)
    rows_out: list[dict] = []

    def emit(row):
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
    block_table = torch.randperm(CONTEXT // 64, device="cuda").view(1, -1).int()
    q_nope = torch.randn(CHUNK, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(CHUNK, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    cache = (layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table)

    # the last 4096 rows, uniform random positions
    token_seq = torch.zeros(CHUNK, device="cuda", dtype=torch.int32)
    idx = torch.randint(0, CONTEXT, (TAIL, TOPK), device="cuda", dtype=torch.int32)
    args = (q_nope[:TAIL], q_rope[:TAIL], *cache[:3], block_table, token_seq[:TAIL], idx, 0.1)
    twin = sm.sparse_mla_torch(*(a[:256] if i in (0, 1, 6, 7) else a for i, a in enumerate(args)))
    base = sm.sparse_mla(*args, upconvert=False)
    dense = sm.upconvert_latent(*cache)
    conv_ok = torch.equal(dense[0], sm.upconvert_latent_torch(*cache)[0])
    seq_rows = dense[0].shape[1]
    out = torch.empty_like(base)

    def bf16(**flags):
        """The bf16 kernel alone over the converted cache, its launch options ``flags`` (defaults where not named)."""
        return lambda: sparse_mla_gluon.launch_bf16(q_nope[:TAIL], q_rope[:TAIL], dense[0], dense[1], seq_rows,
                                                    token_seq[:TAIL], idx, 0.1, out, out, 1, TOPK, **flags)

    bf16_only = bf16()
    bf16_row_major = bf16(heads_inner=False)
    bf16_early = bf16(early_wait=True, defer_sum=False, copy_rows4=False)
    bf16_rows4 = bf16(defer_sum=True, copy_rows4=True)
    bf16_defer = bf16(early_wait=True, defer_sum=True, copy_rows4=False)

    variants = [("fp8 gluon", lambda: sm.sparse_mla(*args, upconvert=False)),
                ("bf16 gluon alone, early wait", bf16_early),
                ("bf16 gluon alone, early wait + defer sum", bf16_defer),
                ("bf16 gluon alone, copy rows 4 + defer sum", bf16_rows4),
                ("bf16 gluon alone, head blocks row-major", bf16_row_major),
                ("upconvert + bf16 gluon", lambda: sm.sparse_mla(*args, upconvert=True)),
                ("conversion alone", lambda: sm.upconvert_latent(*cache)),
                ("bf16 gluon alone", bf16_only)]
    got = sm.sparse_mla(*args, upconvert=True)
    bf16_defer()
    defer_err = _rel_err(out[:256].float(), twin.float())
    defer_out = out.clone()
    bf16_rows4()
    rows4_equal = bool(torch.equal(out, defer_out))
    bf16_early()
    early_equal = bool(torch.equal(out, base))
    bf16_only()
    check = {"rel_err_vs_twin_fp8": _rel_err(base[:256].float(), twin.float()),
             "rel_err_vs_twin_upconvert": _rel_err(got[:256].float(), twin.float()),
             "upconvert_equals_fp8": bool(torch.equal(got, base)), "bf16_alone_equals": bool(torch.equal(out, got)),
             "early_wait_equals_fp8": early_equal, "rel_err_vs_twin_defer_sum": defer_err,
             "copy_rows4_equals_defer_sum": rows4_equal,
             "conversion_equals_twin": conv_ok}
    emit({"case": "tail 4096 rows, uniform positions", **check})
    for r in range(rounds):
        for name, fn in variants:
            t = time_cuda(fn, 10, warmup=2)
            emit({"case": "tail 4096", "round": r, "variant": name, "us": t.median_us, "timed_as": t.mode,
                  "TFLOPs": flops(TAIL * TOPK) / t.median_us / 1e6 if "conversion" not in name else None})
    dense = out = got = base = None  # freed before the whole-prefill case
    torch.cuda.empty_cache()

    # the whole prefill's attention (bench_dsa's attend(): chunks of 16384 rows, causal random positions)
    pos = torch.arange(CONTEXT, device="cuda")
    full_idx = (torch.rand(CONTEXT, TOPK, device="cuda") * (pos[:, None] + 1)).int()
    full_idx = torch.where(torch.arange(TOPK, device="cuda")[None, :] <= pos[:, None], full_idx, -1)
    token_seq = torch.zeros(CONTEXT, device="cuda", dtype=torch.int32)
    positions = float((full_idx >= 0).sum())

    def attend(**opt):
        for r0 in range(0, CONTEXT, CHUNK):
            r1 = min(CONTEXT, r0 + CHUNK)
            sm.sparse_mla(q_nope[: r1 - r0], q_rope[: r1 - r0], *cache[:3], block_table, token_seq[r0:r1],
                          full_idx[r0:r1], 0.1, **opt)

    for r in range(rounds):
        for name, opt, rows4 in [("fp8 gluon", {"upconvert": False}, False),
                                 ("upconvert + bf16 gluon, early wait + defer sum", {"upconvert": True}, False),
                                 ("upconvert + bf16 gluon, copy rows 4 + defer sum", {"upconvert": True}, True)]:
            default = sparse_mla_gluon.BF16_COPY_ROWS4
            sparse_mla_gluon.BF16_COPY_ROWS4 = rows4
            t = time_cuda(lambda o=opt: attend(**o), 3, warmup=1, graph=False)
            sparse_mla_gluon.BF16_COPY_ROWS4 = default
            emit({"case": "prefill 128K attention", "round": r, "variant": name, "ms": t.median_us / 1e3,
                  "timed_as": t.mode, "TFLOPs": flops(positions) / t.median_us / 1e6})
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out_dir / "mla_upconvert.json").write_text(json.dumps({"info": info, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
