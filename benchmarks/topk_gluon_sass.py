"""Compile the decode top-k's candidate pass for sm_90 on a machine without a GPU and report each step loop.

Usage: PYTHONPATH=. python benchmarks/topk_gluon_sass.py ['[{"kernel": "gluon", "PER_THREAD": 16, "warps": 8}]']

Each JSON object picks a kernel (``gluon``: ``topk_gluon.decode_candidates_gluon_kernel``; ``tl``:
``topk._decode_candidates_kernel``), at batch 64's launch (2 parts of 4096 slots, the 4096-score sample, 16-byte
aligned rows) and its warps; upper-case keys override constexprs (``PER_THREAD``, ``DEPTH``; ``BLOCK`` for
tl). One JSON line each: ptxas registers and spills, SASS length, and every loop (SASS instructions and barriers of
each backward branch's body: the step loops). Run it in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "moe"))

import triton  # noqa: E402
from sass_report import compile_sm90, report  # noqa: E402
from topk_select_sass import loops  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from adapt.kernels import topk, topk_gluon  # noqa: E402

PTRS = dict(scores_ptr="fp32", limits_ptr="i32", tau_ptr="i32", key_ptr="i32", pos_ptr="i32", count_ptr="i32")
DIV16 = ("stride", "n_cols")
BASE = dict(SAMPLE=topk.DECODE_SAMPLE, RUN=topk.DECODE_SAMPLE_RUN, EXPECT_NUM=7, EXPECT_DEN=4, SEG_CAP=4096, PARTS=2,
            ALIGNED=True, TAU_BITS=topk.DECODE_TAU_BITS)


def compile_gluon(const: dict, warps: int):
    kern = topk_gluon.decode_candidates_gluon_kernel
    const = dict(const, WARPS=warps)
    sig = {n: ("constexpr" if n in const else "*" + PTRS[n] if n in PTRS else "i32") for n in kern.arg_names}
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in kern.arg_names if n in PTRS or n in DIV16}
    return triton.compile(GluonASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))


def build(config: dict) -> dict:
    warps = config.get("warps", 8)
    const = dict(BASE, **{k: v for k, v in config.items() if k.isupper()})
    if config.get("kernel", "gluon") == "gluon":
        const.setdefault("PER_THREAD", 16)
        const.setdefault("DEPTH", topk.DECODE_GLUON_DEPTH)  # as dispatched
        ck = compile_gluon(const, warps)
    else:
        const.setdefault("BLOCK", topk.DECODE_BLOCK)
        const.setdefault("PREFETCH", True)
        ck = compile_sm90(topk._decode_candidates_kernel, const, PTRS, DIV16, num_warps=warps, num_stages=1)
    info = report(ck, 0)
    n, body = loops(ck.asm["cubin"])
    return dict(config=config, regs=info["regs"], spill_bytes=info["spill_bytes"], sass=n, loops=body)


if __name__ == "__main__":
    for c in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        try:
            print(json.dumps(build(c)), flush=True)
        except Exception as err:  # a variant that does not compile is printed, the others still run
            print(json.dumps(dict(config=c, error=f"{type(err).__name__}: {str(err)[:300]}")), flush=True)
