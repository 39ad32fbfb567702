"""Compile the decode top-k select kernels for sm_90 on a machine without a GPU and report their build.

Usage: PYTHONPATH=. python benchmarks/topk_select_sass.py ['[{"kernel": "register", "FAST": 1, "warps": 16}]']

Each JSON object picks a kernel (``register``: ``topk._decode_select_kernel`` with the candidates of 2 parts of
2 * 2048 slots in registers, batch 64's default; ``flat``: ``topk._fused_select_kernel`` over 8192 slots), its
short-select level FAST (0, 1, 2) and warps. One JSON line each: ptxas registers and spills, SASS length, and
the loops (SASS instructions and barriers of each backward branch's body; the short select's bisection step is
the loop with barriers). Uses ``benchmarks/moe/sass_report.py``'s build (the ptxas and cuobjdump of the triton
wheel); run it in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "moe"))

from sass_report import compile_sm90, report, sass_ops, sass_text  # noqa: E402

from adapt.kernels import topk  # noqa: E402

PTRS = dict(scores_ptr="fp32", limits_ptr="i32", tau_ptr="i32", key_ptr="i32", pos_ptr="i32", count_ptr="i32",
            incl_ptr="i32", out_ptr="i32", redo_ptr="i32")
KERNELS = {
    "register": (topk._decode_select_kernel, dict(SEG_CAP=4096, PARTS=2, PARTS_P2=2, BLOCK=1024, BITS=8,
                                                  REGISTERS=True, FULL_BLOCK=4096)),
    "flat": (topk._fused_select_kernel, dict(PARTS_P2=2, LOG_PARTS=1, CAP=8192, BLOCK=1024, BITS=8,
                                             FULL_BLOCK=4096)),
}


def loops(cubin: bytes) -> tuple[int, list[dict]]:
    """(SASS instructions, [{"len", "bar"} of each loop body]) of a cubin."""
    ops = sass_ops(sass_text(cubin))
    at = {a: i for i, (a, _, _) in enumerate(ops)}
    found = []
    for i, (a, op, rest) in enumerate(ops):
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < a and int(t.group(1), 16) in at:
            body = collections.Counter(o.split(".")[0] for _, o, _ in ops[at[int(t.group(1), 16)]: i + 1])
            found.append({"len": sum(body.values()), "bar": body.get("BAR", 0)})
    return len(ops), found


def build(config: dict) -> dict:
    kern, const = KERNELS[config.get("kernel", "register")]
    warps = config.get("warps", 8)
    ck = compile_sm90(kern, dict(const, FAST=config.get("FAST", 0)), PTRS, num_warps=warps, num_stages=1)
    info = report(ck, 0)
    n, body = loops(ck.asm["cubin"])
    return dict(config, regs=info["regs"], spill_bytes=info["spill_bytes"], sass=n, loops=body)


if __name__ == "__main__":
    for c in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        try:
            row = build(c)
        except Exception as err:  # a build error is a row
            row = dict(c, error=f"{type(err).__name__}: {str(err)[:300]}")
        print(json.dumps(row), flush=True)
