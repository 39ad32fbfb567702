"""Compile the DSA indexer scoring kernel for sm_90 on a machine without a GPU and count its SASS
(the sparse MLA four-group kernel: ``benchmarks/sparse_mla_sass.py``).

Usage: PYTHONPATH=. python benchmarks/dsa_sass_report.py [index] '[{"ROWS": 4, "BLOCK_S": 64, "warps": 8}]'

Each JSON object overrides the kernel's constexprs (upper-case keys) and the launch options (warps,
stages). Prints, one JSON line per object (a build error as ``error``), shared memory, registers, spill
bytes and the opcode counts of the innermost loop that holds a wgmma (one key tile / one position tile),
through ``benchmarks/moe/sass_report.report`` (the ptxas and cuobjdump that the triton wheel carries).
"""

from __future__ import annotations

import json
import sys

from adapt.kernels import dsa
from benchmarks.moe.sass_report import compile_sm90, report

KERNELS = {
    # every constexpr of the kernel set (one left out would be compiled as an i32 argument), the decode-only ones
    # (EMIT and its sampling) off as in the prefill launch
    "index": (dsa._index_scores_kernel,
              dict(q_ptr="fp8e4nv", w_ptr="fp32", k_ptr="fp8e4nv", ks_ptr="fp32", block_table_ptr="i32",
                   limit_ptr="i32", tiles_ptr="i32", seq_ptr="i32", out_ptr="fp32", sample_ptr="fp32",
                   tau_ptr="fp32", cand_key_ptr="fp32", cand_pos_ptr="fp32", cand_count_ptr="fp32"),
              dict(HEAD_DIM=128, BLOCK_H=64, BLOCK_S=64, ROWS=4, PAGE=64, NUM_STAGES=3, UPCAST=False, STACKED=True,
                   DIRECT=False, FULL_TILES=False, EMIT=False, SAMPLE=1, RUN=1, EXPECT_NUM=1, EXPECT_DEN=1,
                   TAU_BITS=1, PDL=False), dict(warps=8, stages=3)),
}


def compile_kernel(name: str, over: dict):
    kern, ptrs, base, launch = KERNELS[name]
    const = dict(base, **{k: v for k, v in over.items() if k.isupper()})
    launch = dict(launch, **{k: v for k, v in over.items() if not k.isupper()})
    ck = compile_sm90(kern, const, ptrs, ("stride", "bt_stride", "out_stride"), launch["warps"], launch["stages"])
    return ck


if __name__ == "__main__":
    args = sys.argv[1:]
    which = args.pop(0) if args and args[0] in KERNELS else "index"  # the kernel name may be left out
    for over in json.loads(args[0]) if args else [{}]:
        try:
            info = report(compile_kernel(which, over), 0)
        except Exception as err:  # one row per config (tests.kernels.test_sparse_mla_sass.sass_rows)
            info = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(json.dumps(dict(kernel=which, config=over, **info)), flush=True)
