"""Compile adapt's grouped MoE GEMM (``moe_gemm._moe_gemm_kernel``) for sm_90 without a GPU and count its SASS.

Usage: PYTHONPATH=. python benchmarks/moe/sass_gemm.py ['[{"W_MODE": 5, "BLOCK_N": 64}, ...]']

Each JSON object overrides constexprs (upper-case keys; default: the DeepSeek-V3 T = 16384 GEMM1 of the
offline FP8 path: e4m3 weights (W_MODE 2), gather, SwiGLU, token-major 128 x 128 x 128) and launch options
(warps, stages). Prints shared memory, registers, spills and the opcode counts of the innermost loop that
holds the wgmma (one K step), as ``sass_report.py`` does for the planar kernel.
"""

from __future__ import annotations

import json
import sys

from adapt.kernels import moe_gemm as mg
from benchmarks.moe.sass_report import compile_sm90, report

BASE = dict(TOPK=8, GATHER=True, W_MODE=2, ACT_FP8=True, ACT_GROUP=False, ACTIVATION=1, HAS_BIAS=False, BLOCK_M=128,
            BLOCK_N=128, BLOCK_K=128, GROUP_M=8, DOT_F32=False, SWAP=False, WORD_ORDER_OUT=False,
            PREFETCH=False, EARLY_UP=False)
PTRS = dict(x_ptr="fp8e4nv", xs_ptr="fp32", w_ptr="u8", sc_ptr="i32", bias_ptr="fp32", out_ptr="bf16",
            sorted_slot_ptr="i32", offsets_ptr="i32", tile_expert_ptr="i32", tile_row_ptr="i32", tile_start_ptr="i32")
DIV16 = ("stride_x", "stride_we", "stride_se", "stride_o", "k", "n_out")


def compile_gemm(const: dict, num_warps: int, num_stages: int, maxnreg: int = 0):
    ptrs = dict(PTRS)
    if const["W_MODE"] == 2:
        ptrs["w_ptr"] = "fp8e4nv"
    elif const["W_MODE"] >= 5:
        ptrs["sc_ptr"] = "u8"
    return compile_sm90(mg._moe_gemm_kernel, const, ptrs, DIV16, num_warps, num_stages, maxnreg)


if __name__ == "__main__":
    for c in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        const = dict(BASE, **{k: v for k, v in c.items() if k.isupper()})
        ck = compile_gemm(const, c.get("warps", 8), c.get("stages", 3), c.get("cap", 0))
        print(json.dumps(dict(config=c, **report(ck, c.get("cap", 0)))), flush=True)
