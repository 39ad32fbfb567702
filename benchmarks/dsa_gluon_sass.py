"""Compile the Gluon indexer prefill kernel (``adapt.kernels.dsa_gluon``) for sm_90 on a machine without a GPU
and report what ptxas made of it: registers, spill bytes, the opcode counts of the innermost loop holding a
wgmma (two 64-key tiles per trip), and ptxas' wgmma notes (C7514: every wgmma serialised; C7517: a wait
injected before a read of wgmma-written registers). Either note means the MMA / epilogue overlap is lost.

Usage: PYTHONPATH=. python benchmarks/dsa_gluon_sass.py '[{"NUM_STAGES": 3}, {"W_SMEM": false}]'

Each JSON object overrides the kernel's constexprs (upper-case keys; base: DeepSeek-V3.2's indexer, 64 heads x
128, 2 rows, one 64-token page per key tile, 3 stages) and "maxnreg" sets a register cap; one JSON line per
config on stdout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from adapt.kernels import dsa_gluon
from benchmarks.moe.sass_report import BIN, report

BASE = dict(HEAD_DIM=128, BLOCK_H=64, BLOCK_S=64, ROWS=2, PAGE=64, NUM_STAGES=3, W_SMEM=True)
PTRS = dict(q_ptr="fp8e4nv", w_ptr="fp32", k_ptr="fp8e4nv", ks_ptr="fp32", block_table_ptr="i32",
            limit_ptr="i32", tiles_ptr="i32", out_ptr="fp32")
DIV16 = ("bt_stride", "out_stride")


def compile_gluon(const: dict, maxnreg: int = 0):
    """``_index_scores_gluon_kernel`` compiled for sm_90 (4 warps) with the given constexprs; maxnreg: a
    register cap (0: none)."""
    const = dict(const)
    warps = dsa_gluon.GLUON_WARPS
    kern = dsa_gluon._index_scores_gluon_rows_kernel if const.pop("SPLIT_ROWS", False) else \
        dsa_gluon._index_scores_gluon_kernel
    groups = const.pop("WARPGROUPS", 0)
    ws_rows = const.pop("WS", 0)
    if ws_rows:  # WS-row tiles on WS / 2 warpgroups sharing the TMA'd key pages
        kern = dsa_gluon._index_scores_gluon_ws_kernel
        const.update(BLOCK_S=64, TMA=True, ROWS=ws_rows)
        const.setdefault("CARRY", True)
        const.setdefault("WREGS", 128)
    elif groups:
        kern, warps = dsa_gluon._index_scores_gluon_wg_kernel, 4 * groups
        const.update(BLOCK_S=64 * groups, WARPS=warps)
        const.setdefault("CARRY", False)
        const.setdefault("TMA", False)
        const.setdefault("REG_A", False)
        const.pop("ROWS", None)
    if kern is not dsa_gluon._index_scores_gluon_kernel:
        const.pop("W_SMEM", None)
    tma = bool(const.get("TMA"))
    const = {k: v for k, v in const.items() if k in kern.arg_names}
    sig = {n: ("constexpr" if n in const else "*" + PTRS[n] if n in PTRS else "i32") for n in kern.arg_names}
    if "k_desc" in sig:  # the wg kernel: the key cache as a TMA descriptor, or its pointer again (unused)
        sig["k_desc"] = _key_desc_type(const["HEAD_DIM"], const["BLOCK_S"]) if tma else "*fp8e4nv"
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in kern.arg_names
             if n in PTRS or n in DIV16 or (n == "k_desc" and not tma)}
    return triton.compile(GluonASTSource(kern, sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {})))


def _key_desc_type(head_dim: int, rows: int) -> str:
    """The signature type of ``dsa_gluon.launch``'s TMA descriptor of the key cache (one page a box)."""
    cache = torch.empty(4, rows, head_dim, dtype=torch.float8_e4m3fn)
    return mangle_type(dsa_gluon.key_page_descriptor(cache, rows))


def wgmma_notes(ck, maxnreg: int = 0) -> list[str]:
    """ptxas' wgmma performance notes (C7514 / C7517 / C7515 ...) for the kernel's PTX."""
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(ck.asm["ptx"])
        cap = ["--maxrregcount", str(maxnreg)] if maxnreg else []
        info = subprocess.run([str(BIN / "ptxas"), "-v", *cap, "--gpu-name", "sm_90a", str(ptx), "-o",
                               str(Path(d) / "k.cubin")], capture_output=True, text=True).stderr
    return re.findall(r"\((C75\d\d)\)", info)


if __name__ == "__main__":
    for over in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        const = dict(BASE, **{k: v for k, v in over.items() if k.isupper()})
        cap = over.get("maxnreg", 0)
        try:
            ck = compile_gluon(const, cap)
        except Exception as err:  # one line per config, the others still run
            print(json.dumps(dict(config=over, error=f"{type(err).__name__}: {str(err)[-300:]}")), flush=True)
            continue
        print(json.dumps(dict(config=over, notes=wgmma_notes(ck, cap), **report(ck, cap))), flush=True)
