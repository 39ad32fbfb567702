"""Markdown tables of the peer-runner JSON rows (``bench_moe --peer-only``) in one folder.

Usage: python benchmarks/moe/s2_tables.py benchmarks/moe/2026-11-30-s2 [call prefix ...]
For each call prefix (file name start, e.g. call1_36a06da) and shape: adapt's MXFP4-storage rows
(planar_combine; the fp8 workspace schedules, offline fp8 and the conversion alone above 4096)
beside the peer, the ratio peer / adapt (>= 1: adapt at least as fast),
copy fractions, x byte floor, twin / reference errors; then the config sweep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VARIANTS = ("planar_combine", "planar_fused", "planar_gemm1", "planar_gemm2", "fp8_ws_combine",
            "fp8_ws_side_combine", "fp8_ws_split16_combine", "fp8_ws_split32_combine", "fp8_offline_combine",
            "ws_convert_only")
"""Row variants tabled, in this order (the workspace schedules and the conversion alone from call 5;
planar_fused, the combine in GEMM2's epilogue, from call 6; the planar GEMMs apart at T = 1, 64)."""
VARIANTS += ("planar_onek", "planar_onek_n64", "planar_onek_i128", "planar_onek_i128_n64", "planar_onek_c168",
             "planar_onek_c168_s8", "planar_onek_i128_s6", "planar_onek_n256_c168")
"""(2026-11-30-s3 call 7) the one-kernel MLP at T <= 16 with its tiles (``bench_moe.ONE_KERNEL_CONFIGS``)."""


def tables(folder: Path, prefix: str) -> str:
    out = []
    for f in sorted(folder.glob(f"{prefix}_moe_*.json")):
        r = json.loads(f.read_text())
        c = r["ceilings"]
        shape = f.stem.split("_moe_")[1]
        out += [f"### {prefix}: {shape}", "",
                f"{r['date']}, commit {r['commit']}, {r['gpu']}, torch {r['torch']}, triton {r['triton']}; same-run "
                f"copy {c['copy_tbps']:.2f} TB/s, bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s, fp8 _scaled_mm "
                f"{c['fp8_matmul_tflops']:.0f} TFLOP/s", "",
                "| T | adapt path | adapt us | peer us | peer / adapt | adapt of copy | peer of copy | adapt x floor "
                "| adapt vs twin | peer vs fp32 ref |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        rows = {(x["tokens"], x["variant"]): x for x in r["rows"] if "time_us" in x}
        for t in sorted({x["tokens"] for x in r["rows"]}):
            peer = rows.get((t, "peer"))
            for v in VARIANTS:
                a = rows.get((t, v))
                if not a:
                    continue
                ratio = f"{peer['time_us'] / a['time_us']:.2f}" if peer else "-"
                tw = f"{a['rel_err_vs_twin']:.1e}" if a.get("rel_err_vs_twin") is not None else ""
                pe = f"{peer['rel_err_vs_reference']:.1e}" if peer and peer.get("rel_err_vs_reference") else ""
                if peer:
                    out.append(f"| {t} | {v} | {a['time_us']:,.1f} | {peer['time_us']:,.1f} | {ratio} | "
                               f"{a['copy_fraction']:.2f} | {peer['copy_fraction']:.2f} | {a['x_floor']:.2f} | "
                               f"{tw} | {pe} |")
                else:
                    out.append(f"| {t} | {v} | {a['time_us']:,.1f} | - | - | {a['copy_fraction']:.2f} | - | "
                               f"{a['x_floor']:.2f} | {tw} | |")
        if r.get("sweep"):
            out += ["", "| T | sweep config (+fc: with the fused combine; else expert GEMMs, no combine) | us "
                    "| of copy | vs table |", "|---|---|---|---|---|"]
            for x in r["sweep"]:
                if "time_us" in x:
                    err = x.get("rel_err_vs_table")
                    out.append(f"| {x['tokens']} | {x['config']} | {x['time_us']:,.1f} | {x['copy_fraction']:.2f} | "
                               + (f"{err:.1e} |" if err is not None else " |"))
                else:
                    out.append(f"| | {x['config']} | failed: {x['error'][:60]} | |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    prefixes = sys.argv[2:] or sorted({p.name.split("_moe_")[0] for p in folder.glob("*_moe_*.json")})
    print("\n".join(tables(folder, p) for p in prefixes))
