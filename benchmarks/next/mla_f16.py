"""The Gluon sparse MLA decode kernel with fp16 MMAs (``sparse_mla_gluon_kernel``'s F16 flag) against its bf16
default (issue 16: sparse MLA decode at least 300 TFLOP/s), in the order default, F16, F16, default (drift between
the first and the last call shows).

F16 turns the tile's dequantisation from five instructions per two elements (e4m3x2 -> f16x2, two widenings to
fp32, two FMUL, one pack to bf16x2) into two (the conversion and one HMUL2 by the scale rounded to fp16): the sm_90
loop is 1,006 instructions a thread a tile against 1,226 (``benchmarks/sparse_mla_sass.py``).

Times, graph-replayed, as ``mla_ws.py`` (decode batch 64 x 128K top-2048 with 128 heads, batch 1, 4096 prefill
rows of one 128K sequence), each checked against the bf16 twin and the fp16 twin (``sparse_mla_torch(...,
half=True)``), and against a float64 reference on the first rows (``rel_err_vs_fp64``: e4m3 times its scale in
float64, no rounding of q, the tile or p).

Usage (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/next/mla_f16.py OUT_DIR [BUDGET_S [VARIANTS]]
(VARIANTS: a JSON list of [name, Gluon flags] pairs in place of the four above; "cases": "b64" in the flags
object of the first limits the run to batch 64)
Writes OUT_DIR/mla_f16.json; prints one line per variant.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from adapt.bench.timer import time_cuda
from adapt.kernels import sparse_mla_gluon
from adapt.kernels.formats import PAGE_SIZE
from adapt.kernels.sparse_mla import sparse_mla, sparse_mla_torch
from adapt.stages.bench_dsa import HEADS, RANK, ROPE, _decode_inputs, _random_cache, _rel_err

CONTEXT, TOPK = 131072, 2048
VARIANTS = [("bf16 (default)", {}), ("f16", {"F16": True}), ("f16 again", {"F16": True}),
            ("bf16 again", {})]
FP64_ROWS = 2


def flops(rows: int) -> float:
    return 2.0 * rows * HEADS * TOPK * (RANK + ROPE + RANK)


def reference_fp64(args, rows: int) -> torch.Tensor:
    """float64 sparse MLA of the first ``rows`` rows: the e4m3 latent times its group's scale, q as given."""
    q_nope, q_rope, nope, nscale, rope, block_table, token_seq, indices, softmax_scale = args
    nope = nope.reshape(-1, RANK)
    nscale = nscale.reshape(-1, nscale.shape[-1])
    rope = rope.reshape(-1, ROPE)
    out = torch.zeros(rows, HEADS, RANK, dtype=torch.float64, device=q_nope.device)
    for r in range(rows):
        idx = indices[r].long()
        idx = idx[idx >= 0]
        slots = block_table[int(token_seq[r])].long()[idx // PAGE_SIZE] * PAGE_SIZE + idx % PAGE_SIZE
        kv = (nope[slots].double().view(len(slots), nscale.shape[-1], -1)
              * nscale[slots].double().unsqueeze(-1)).view(len(slots), RANK)
        logits = (q_nope[r].double() @ kv.T + q_rope[r].double() @ rope[slots].double().T) * softmax_scale
        out[r] = torch.softmax(logits, dim=-1) @ kv
    return out


def run_case(name, args, rows, out, budget_end, reps=30, twin_rows=None):
    sub = args if twin_rows is None else tuple(a[:twin_rows] if i in (0, 1, 6, 7) else a for i, a in enumerate(args))
    twin = sparse_mla_torch(*sub).float()
    twin_half = sparse_mla_torch(*sub, half=True).float()
    ref = reference_fp64(args, min(FP64_ROWS, rows))
    for vname, flags in VARIANTS:
        if time.time() > budget_end:
            out.append({"case": name, "variant": vname, "skipped": "budget"})
            continue
        opts = {"gluon": dict(flags)}
        row = {"case": name, "variant": vname, "flags": flags}
        try:
            got = sparse_mla(*args, **opts, upconvert=False)
            torch.cuda.synchronize()
            row["rel_err_vs_twin"] = _rel_err(got[:twin.shape[0]].float(), twin)
            row["rel_err_vs_half_twin"] = _rel_err(got[:twin.shape[0]].float(), twin_half)
            row["rel_err_vs_fp64"] = _rel_err(got[:ref.shape[0]].double(), ref)
            row["finite"] = bool(torch.isfinite(got).all())
            t = time_cuda(lambda o=opts: sparse_mla(*args, **o, upconvert=False), reps, warmup=2)
            row.update(us=t.median_us, timed_as=t.mode, tflops=flops(rows) / t.median_us / 1e6)
        except Exception as err:  # recorded; the other variants still run
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        out.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    budget_end = time.time() + (float(sys.argv[2]) if len(sys.argv) > 2 else 240)
    only_b64 = False
    if len(sys.argv) > 3:
        VARIANTS[:] = [(name, dict(flags)) for name, flags in json.loads(sys.argv[3])]
        only_b64 = VARIANTS[0][1].pop("cases", None) == "b64"
    torch.manual_seed(0)
    rows_out: list[dict] = []
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "gluon_flags": sparse_mla_gluon.GLUON_FLAGS}
    layer, block_table, token_seq, limits, (_, _, q_nope, q_rope) = _decode_inputs(64, CONTEXT)
    idx = torch.stack([torch.randperm(CONTEXT, device="cuda")[:TOPK] for _ in range(64)]).int()
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table, token_seq, idx,
            0.1)
    run_case("decode b64 x 128K", args, 64, rows_out, budget_end)
    if only_b64:
        (out_dir / "mla_f16.json").write_text(json.dumps({"info": info, "rows": rows_out}, indent=1))
        return
    args1 = tuple(a[:1] if i in (0, 1, 6, 7) else a for i, a in enumerate(args))
    run_case("decode b1 x 128K", args1, 1, rows_out, budget_end)
    layer = block_table = args = args1 = None
    torch.cuda.empty_cache()
    rows = 4096
    layer = _random_cache(CONTEXT, "fp8").dsa_layer(0)
    block_table = torch.randperm(CONTEXT // 64, device="cuda").view(1, -1).int()
    token_seq = torch.zeros(rows, device="cuda", dtype=torch.int32)
    idx = torch.randint(0, CONTEXT, (rows, TOPK), device="cuda", dtype=torch.int32)
    q_nope = torch.randn(rows, HEADS, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(rows, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table, token_seq, idx, 0.1)
    run_case("prefill 4096 rows of 128K", args, rows, rows_out, budget_end, reps=10, twin_rows=256)
    (out_dir / "mla_f16.json").write_text(json.dumps({"info": info, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
