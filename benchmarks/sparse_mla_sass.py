"""Compile adapt's sparse MLA decode kernels for sm_90 on a machine without a GPU and count their SASS.

Usage: PYTHONPATH=. python benchmarks/sparse_mla_sass.py ['[{"BLOCK_K": 64, "QK_FP8": true, "warps": 8, "stages": 1}]']
       (an object with "bf16": true compiles ``sparse_mla_gluon.sparse_mla_gluon_bf16_kernel``, the prefill
       kernel over a dense bf16 latent, its SPLIT, BLOCK_K, EARLY_WAIT, DEFER_SUM and COPY_ROWS4 from the object;
       one with "gluon": true compiles ``sparse_mla_gluon.sparse_mla_gluon_kernel`` instead, its BLOCK_K,
       SPLIT, PREFETCH, EARLY_LOADS, DIRECT, L2_AHEAD, WARPS, ABLATE, LAZY, PDL, PARTIAL_BF16, F16 and
       GATHER_ROWS from the object; one with "cp": true ``sparse_mla_gluon.sparse_mla_gluon_cp_kernel``, its SPLIT
       and F16:
       ``compile_gluon``; its row adds ``branch_skip``, the loop's longest forward branch: with LAZY the
       accumulator's rescale, so loop_len - branch_skip.len instructions a tile on the tiles that skip it)

Each JSON object overrides the four-group kernel's constexprs (upper-case keys; the default is the
DeepSeek-V3.2 decode tile: 64 heads, 128 positions, rank 512 in four e4m3 groups, rope 64) and the
launch options (warps, stages). Prints, for each: shared memory (bytes), ptxas registers, spill bytes,
the opcode counts of the loop that holds the MMAs (HGMMA for bf16, QGMMA for fp8) and the order of the
global loads and MMAs (``load_mma_order``), with the ptxas
and cuobjdump that the triton wheel carries (``benchmarks/moe/sass_report.report``).
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "moe"))
import triton  # noqa: E402
from sass_report import BIN, compile_sm90, report, sass_ops, sass_text, smallest_loop  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from adapt.kernels import sparse_mla as sm  # noqa: E402
from adapt.kernels import sparse_mla_gluon as smg  # noqa: E402

BASE = dict(RANK=512, ROPE=64, GROUP=128, BLOCK_H=64, BLOCK_K=128, PAGE=64, SPLIT=False, UPCAST=False,
            PREFETCH=False, QK_FP8=False, HEADS_INNER=False, HALF=False)
PTRS = dict(qn_ptr="bf16", qr_ptr="bf16", qscale_ptr="fp32", nope_ptr="fp8e4nv", nscale_ptr="fp32", rope_ptr="bf16",
            block_table_ptr="i32", seq_ptr="i32", idx_ptr="i32", out_ptr="bf16", lse_ptr="fp32")


def compile_groups4(const: dict, num_warps: int, num_stages: int, swap_ab: bool = False):
    """``_sparse_mla_fp8x4_kernel`` for sm_90 with the given constexprs (SWAP_AB from swap_ab; pointers
    16-byte aligned)."""
    kern = sm._sparse_mla_fp8x4_kernel
    const = dict(const, SWAP_AB=bool(swap_ab))
    ptrs = dict(PTRS, out_ptr="fp32" if const.get("SPLIT") else "bf16", qn_ptr="fp8e4nv" if const.get("QK_FP8")
                else "bf16")
    return compile_sm90(kern, const, ptrs, (), num_warps, num_stages, floats=("scale_log2",))


def _compile_gluon_sm90(kern, const: dict, options: dict, partial: str = "fp32", ptr_types: dict | None = None):
    """A Gluon sparse MLA kernel for sm_90 at the DeepSeek-V3.2 shapes (rank 512 in four e4m3 groups, rope 64, 64
    heads) with these constexprs (SPLIT among them; shape constexprs the kernel does not take are dropped) and launch
    options; pointers 16-byte aligned; ``partial``: the slice partials' element type under SPLIT; ``ptr_types``:
    pointer element types other than ``PTRS``'."""
    const = {k: v for k, v in dict(RANK=512, ROPE=64, GROUP=128, BLOCK_H=64, PAGE=64, **const).items()
             if k in kern.arg_names}
    ptrs = {k: v for k, v in PTRS.items() if k not in ("qscale_ptr",)}
    ptrs.update(ptr_types or {})
    ptrs["out_ptr"] = partial if const["SPLIT"] else "bf16"
    sig = {n: ("constexpr" if n in const else "*" + ptrs[n] if n in ptrs else "fp32" if n == "scale_log2" else "i32")
           for n in kern.arg_names}
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in kern.arg_names if n in ptrs}
    return triton.compile(GluonASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def compile_gluon(block_k: int, split: bool, prefetch: bool = True, early: bool = False, direct: bool = False,
                  l2_ahead: int = 0, warps: int = 8, ablate: int = 0, lazy: float = 0.0, pdl: bool = False,
                  partial_bf16: bool = False, f16: bool = False, gather_rows: int = 1):
    """``sparse_mla_gluon_kernel`` for sm_90 (``warps`` warps, 8 as launched by default; ``lazy``: its LAZY;
    ``pdl``: its PDL; ``partial_bf16``: bf16 slice partials, as ``sparse_mla.PARTIAL_BF16`` allocates them; ``f16``:
    its F16, fp16 MMAs; ``gather_rows``: its GATHER_ROWS)."""
    const = dict(BLOCK_K=block_k, SPLIT=split, PREFETCH=prefetch, EARLY_LOADS=early, DIRECT=direct,
                 L2_AHEAD=l2_ahead, WARPS=warps, ABLATE=ablate, LAZY=float(lazy), PDL=bool(pdl), F16=bool(f16),
                 GATHER_ROWS=int(gather_rows))
    return _compile_gluon_sm90(smg.sparse_mla_gluon_kernel, const, dict(num_warps=warps),
                               "bf16" if partial_bf16 else "fp32")


def compile_gluon_bf16(split: bool, block_k: int = 64, early_wait: bool = True, defer_sum: bool = True,
                       copy_rows4: bool = False):
    """``sparse_mla_gluon_bf16_kernel`` (the prefill kernel over a dense bf16 latent) for sm_90, 8 warps."""
    const = dict(BLOCK_K=block_k, SPLIT=split, HEAD_BLOCKS=2, EARLY_WAIT=early_wait, DEFER_SUM=defer_sum,
                 COPY_ROWS4=copy_rows4)
    return _compile_gluon_sm90(smg.sparse_mla_gluon_bf16_kernel, const, dict(num_warps=8),
                               ptr_types={"nope_ptr": "bf16"})


def compile_gluon_ws(split: bool, pwarps: int = 4, pregs: int = 152, maxnreg: int = 168, pair: bool = True,
                     pv_wait: bool = False, f16: bool = False):
    """``sparse_mla_gluon_ws_kernel`` for sm_90 (8 consumer warps + a producer of ``pwarps``), capped at ``maxnreg``
    registers as ``sparse_mla_gluon.launch`` launches it (``f16``: its F16)."""
    const = dict(BLOCK_K=64, SPLIT=split, PWARPS=pwarps, PREGS=pregs, PAIR=pair, PV_WAIT=pv_wait, F16=bool(f16))
    return _compile_gluon_sm90(smg.sparse_mla_gluon_ws_kernel, const, dict(num_warps=8, maxnreg=maxnreg))


def compile_gluon_cp(split: bool, f16: bool = False):
    """``sparse_mla_gluon_cp_kernel`` (the gathers two tiles ahead by cp.async) for sm_90, 8 warps."""
    const = dict(BLOCK_K=64, SPLIT=split, F16=bool(f16))
    return _compile_gluon_sm90(smg.sparse_mla_gluon_cp_kernel, const, dict(num_warps=8))


def branch_skip(ck) -> dict:
    """The longest forward branch inside the loop that holds the MMAs: the instructions it jumps over (``len``) and
    their opcode counts. With LAZY that is the accumulator's rescale (128 FMUL a thread at 8 warps)."""
    loop = smallest_loop(sass_ops(sass_text(ck.asm["cubin"])), "GMMA") or []
    at = {a: i for i, (a, _, _) in enumerate(loop)}
    best: list = []
    for i, (a, op, rest) in enumerate(loop):
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) > a and int(t.group(1), 16) in at and at[int(t.group(1), 16)] - i - 1 > len(best):
            best = loop[i + 1: at[int(t.group(1), 16)]]
    return dict(len=len(best), ops=dict(collections.Counter(o.split(".")[0] for _, o, _ in best).most_common(8)))


def load_mma_order(ck) -> str:
    """The kernel's global loads and MMAs in SASS order, runs compressed: 'L103 M104' = 103 LDG, then 104
    HGMMA / QGMMA; 'A' marks asynchronous copies (LDGSTS). In the one-stage loop every gathered load of a
    tile should come before its first MMA: an MMA between them costs a second memory round trip per tile."""
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(ck.asm["cubin"])
        sass = subprocess.run([str(BIN / "cuobjdump"), "--dump-sass", str(cubin)], capture_output=True,
                              text=True).stdout
    runs: list[list] = []
    for line in sass.splitlines():
        if not re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            continue
        op = line.split(";")[0].split("*/")[-1]
        kind = "A" if "LDGSTS" in op else "L" if re.search(r"\bLDG\b|\bLDG\.", op) else "M" if "GMMA" in op else None
        if kind and runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        elif kind:
            runs.append([kind, 1])
    return " ".join(f"{k}{n}" for k, n in runs)


if __name__ == "__main__":
    for c in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        const = dict(BASE, **{k: v for k, v in c.items() if k.isupper()})
        try:
            if c.get("ws"):
                ck = compile_gluon_ws(c.get("SPLIT", False), c.get("PWARPS", 4), c.get("PREGS", 152),
                                      c.get("MAXNREG", 168), c.get("PAIR", True), c.get("PV_WAIT", False),
                                      c.get("F16", False))
                ptx = ck.asm["ptx"]
                print(json.dumps(dict(config=c, **report(ck, c.get("MAXNREG", 168)), order=load_mma_order(ck),
                                      setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                       ptx))),
                                      mbarrier_waits=ptx.count("mbarrier.try_wait"))), flush=True)
                continue
            if c.get("cp"):
                ck = compile_gluon_cp(c.get("SPLIT", False), c.get("F16", False))
                print(json.dumps(dict(config=c, **report(ck, 0), order=load_mma_order(ck))), flush=True)
                continue
            if c.get("bf16"):
                ck = compile_gluon_bf16(c.get("SPLIT", False), c.get("BLOCK_K", 64), c.get("EARLY_WAIT", True),
                                        c.get("DEFER_SUM", True), c.get("COPY_ROWS4", False))
                print(json.dumps(dict(config=c, **report(ck, 0), order=load_mma_order(ck))), flush=True)
                continue
            if c.get("gluon"):
                ck = compile_gluon(c.get("BLOCK_K", 64), c.get("SPLIT", False), c.get("PREFETCH", True),
                                   c.get("EARLY_LOADS", False), c.get("DIRECT", False), c.get("L2_AHEAD", 0),
                                   c.get("WARPS", 8), c.get("ABLATE", 0), c.get("LAZY", 0.0), c.get("PDL", False),
                                   c.get("PARTIAL_BF16", False), c.get("F16", False), c.get("GATHER_ROWS", 1))
                print(json.dumps(dict(config=c, **report(ck, 0), order=load_mma_order(ck),
                                      branch_skip=branch_skip(ck))), flush=True)
                continue
            ck = compile_groups4(const, c.get("warps", 8), c.get("stages", 1), c.get("swap_ab", False))
        except Exception as err:  # a variant that does not compile is printed, the others still run
            print(json.dumps(dict(config=c, error=str(err).splitlines()[-1][:300])), flush=True)
            continue
        print(json.dumps(dict(config=c, **report(ck, 0), order=load_mma_order(ck))), flush=True)
