"""Compile adapt's planar MoE kernel for sm_90 on a machine without a GPU and count its SASS.

Usage: PYTHONPATH=. python benchmarks/moe/sass_report.py ['[{"BLOCK_N": 64}, {"BLOCK_M": 64, "warps": 8, "cap": 0}]']

Each JSON object overrides the kernel's constexprs (upper-case keys; the default is the DeepSeek-V3
T = 16 GEMM1: gather, SwiGLU, block 16 x 128, one MMA chain per step) and the launch options
(warps, stages, cap = register cap, 0 for none). For each: shared memory, ptxas registers and
spills, and the opcode counts of the innermost loop that holds the wgmma (one 128-K step), so load
width, decode cost and spills can be read before any device time is spent. Uses the ptxas and
cuobjdump that the triton wheel carries.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from adapt.kernels import moe_planar as mp

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
BASE = dict(TOPK=8, GATHER=True, ACTIVATION=1, HAS_BIAS=False, SPLIT_K=1, TWO_MULS=False, BLOCK_M=16, BLOCK_N=128,
            GROUP_M=4, DOT_F32=False, ONE_DOT=True, EVEN_K=True, FLATTEN=False, COMBINE=False)
PTRS = dict(x_ptr="bf16", w_ptr="i32", sc_ptr="i32", bias_ptr="fp32", out_ptr="bf16", part_ptr="fp32", gamma_ptr="fp32",
            sorted_slot_ptr="i32", offsets_ptr="i32", tile_expert_ptr="i32", tile_row_ptr="i32", tile_start_ptr="i32")
DIV16 = ("stride_x", "stride_we", "stride_se", "stride_o", "k_words", "n_rows", "k")


def compile_sm90(kern, const: dict, ptrs: dict, div16=(), num_warps: int = 4, num_stages: int = 3, maxnreg: int = 0,
                 floats=("alpha", "limit")):
    """Triton kernel ``kern`` compiled for sm_90 with the given constexprs; ptrs: pointer argument ->
    element type, those and the div16 arguments marked 16-divisible (as at the real shapes); floats: the
    fp32 scalar arguments (every other scalar is i32); maxnreg: a register cap (0: none)."""
    sig = {n: ("constexpr" if n in const else "*" + ptrs[n] if n in ptrs else "fp32" if n in floats
               else "i32") for n in kern.arg_names}
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in kern.arg_names if n in ptrs or n in div16}
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(ASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)


def compile_planar(const: dict, num_warps: int, num_stages: int, maxnreg: int):
    """``_planar_gemm_kernel`` compiled for sm_90 with the given constexprs (``compile_sm90``)."""
    return compile_sm90(mp._planar_gemm_kernel, const, PTRS, DIV16, num_warps, num_stages, maxnreg)


def sass_ops(sass: str) -> list[tuple[int, str, str]]:
    """cuobjdump SASS text -> (address, opcode, operands) per instruction."""
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return ops


def smallest_loop(ops: list[tuple[int, str, str]], marker: str) -> list[tuple[int, str, str]] | None:
    """The shortest backward-branch body holding an opcode that contains ``marker`` (a K loop), or None."""
    at = {a: i for i, (a, _, _) in enumerate(ops)}
    loop = None
    for i, (a, op, rest) in enumerate(ops):
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < a and int(t.group(1), 16) in at:
            body = ops[at[int(t.group(1), 16)]: i + 1]
            if any(marker in o for _, o, _ in body) and (loop is None or len(body) < len(loop)):
                loop = body
    return loop


def sass_text(cubin: bytes) -> str:
    """cuobjdump's SASS of a cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(BIN / "cuobjdump"), "--dump-sass", str(path)], capture_output=True,
                              text=True).stdout


def report(ck, maxnreg: int) -> dict:
    sass = sass_text(ck.asm["cubin"])
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(ck.asm["ptx"])
        args = [str(BIN / "ptxas"), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(d) / "o.cubin")]
        if maxnreg:
            args[1:1] = ["--maxrregcount", str(maxnreg)]
        info = subprocess.run(args, capture_output=True, text=True).stderr
    loop = smallest_loop(sass_ops(sass), "GMMA")
    regs = re.findall(r"Used (\d+) registers", info)
    spill = re.findall(r"(\d+) bytes spill stores", info)
    return dict(shared=ck.metadata.shared, regs=int(regs[-1]) if regs else None,
                spill_bytes=int(spill[-1]) if spill else None, loop_len=len(loop or []),
                loop_ops=dict(collections.Counter(o.split(".")[0] for _, o, _ in loop or []).most_common(40)))


if __name__ == "__main__":
    for c in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        const = dict(BASE, **{k: v for k, v in c.items() if k.isupper()})
        cap = c.get("cap", 128)
        ck = compile_planar(const, c.get("warps", 4), c.get("stages", 4), cap)
        print(json.dumps(dict(config=c, **report(ck, cap))), flush=True)
