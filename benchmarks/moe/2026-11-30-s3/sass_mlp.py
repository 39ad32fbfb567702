"""Compile the one-kernel planar MLP (``moe_planar._planar_mlp_kernel``) for sm_90 without a GPU and
count its SASS: registers, spills, shared memory and the opcodes of the loop that holds the wgmma
(``benchmarks/moe/sass_report.py``'s report, whose loop is the shortest such loop: GEMM2's n-loop).

Usage: PYTHONPATH=. python benchmarks/moe/2026-11-30-s3/sass_mlp.py ['[{"BLOCK_I": 128, "STAGES2": 6}]']
(upper-case keys override the constexprs, default the DeepSeek-V3 shape; warps, stages, cap as there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sass_report import compile_sm90, report  # noqa: E402

from adapt.kernels import moe_planar as mp  # noqa: E402

BASE = dict(TOPK=8, ACTIVATION=1, HAS_BIAS=False, TWO_MULS1=False, TWO_MULS2=False, BLOCK_M=16, BLOCK_I=64,
            BLOCK_N2=128, DOT_F32=False, EVEN_K1=True, EVEN_N2=True, NATURAL_HALF=True, STAGES2=4)
PTRS = dict(x_ptr="bf16", w1_ptr="i32", s1_ptr="i32", w2_ptr="i32", s2_ptr="i32", b1_ptr="fp32", b2_ptr="fp32",
            out_ptr="fp32", gamma_ptr="fp32", sorted_slot_ptr="i32", offsets_ptr="i32", tile_expert_ptr="i32",
            tile_row_ptr="i32", tile_start_ptr="i32")
DIV16 = ("stride_x", "stride_w1e", "stride_s1e", "stride_w2e", "stride_s2e", "stride_o", "hidden", "inter")


def compile_mlp(const: dict, num_warps: int, num_stages: int, maxnreg: int):
    return compile_sm90(mp._planar_mlp_kernel, const, PTRS, DIV16, num_warps, num_stages, maxnreg)


if __name__ == "__main__":
    for c in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        const = dict(BASE, **{k: v for k, v in c.items() if k.isupper()})
        cap = c.get("cap", 0)
        ck = compile_mlp(const, c.get("warps", 4), c.get("stages", 4), cap)
        print(json.dumps(dict(config=c, **report(ck, cap))), flush=True)
