"""Compile adapt's planar MoE kernel for sm_90 on a machine without a GPU and count its SASS.

Usage: PYTHONPATH=. python benchmarks/moe/sass_report.py [name ...]   (names from VARIANTS; default all)

For each variant: registers, spills, shared memory, and SASS instruction counts per K step (the
main loop's body: global/shared loads by width, integer ops, bf16x2 multiplies, wgmma, barriers),
so load width and decode cost can be read before any device time is spent. Writes
<out>/<name>.sass and .ptx when OUT_DIR is set.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from adapt.kernels import moe_planar as mp

TARGET = GPUTarget("cuda", 90, 32)


def _sig(kernel, ptr_types: dict, floats: set, constexprs: dict):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = "*" + ptr_types[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_planar(const: dict, num_warps: int, num_stages: int, maxnreg: int | None, kernel=None):
    """Compile ``_planar_gemm_kernel`` (or ``kernel`` with the same argument names) for sm_90."""
    kernel = kernel or mp._planar_gemm_kernel
    ptrs = dict(x_ptr="bf16", w_ptr="i32", sc_ptr="i32", bias_ptr="fp32", out_ptr="bf16", part_ptr="fp32",
                sorted_slot_ptr="i32", offsets_ptr="i32", tile_expert_ptr="i32", tile_row_ptr="i32",
                tile_start_ptr="i32")
    ptrs = {k: v for k, v in ptrs.items() if k in kernel.arg_names}
    floats = {"alpha", "limit"}
    sig = _sig(kernel, ptrs, floats, const)
    div16 = [n for n in kernel.arg_names if n in ptrs or n in ("stride_x", "stride_we", "stride_se", "stride_o",
                                                               "k_words", "n_rows", "k")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(kernel, sig, constexprs=const, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=TARGET, options=opts)


def sass_of(ck) -> str:
    binpath = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"planar_{os.getpid()}.cubin"
    tmp.write_bytes(ck.asm["cubin"])
    out = subprocess.run([str(binpath), "--dump-sass", str(tmp)], capture_output=True, text=True).stdout
    tmp.unlink()
    return out


def loop_body_counts(sass: str) -> dict:
    """Opcode counts over the whole kernel and over the hottest loop (the largest backward branch
    body that holds a WGMMA)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr_of = {}
    ops = []
    for i, ln in enumerate(lines):
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", ln)
        if not m:
            continue
        addr_of[int(m.group(1), 16)] = len(ops)
        ops.append((int(m.group(1), 16), m.group(3), ln))
    best = None
    for idx, (addr, op, ln) in enumerate(ops):
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", ln.split(op, 1)[1])
            if t and int(t.group(1), 16) < addr:
                lo = addr_of.get(int(t.group(1), 16))
                if lo is None:
                    continue
                body = [o for _, o, _ in ops[lo: idx + 1]]
                if any(o.startswith(("HGMMA", "WGMMA", "HMMA")) for o in body):
                    if best is None or len(body) > len(best):
                        best = body
    total = collections.Counter(o for _, o, _ in ops)
    loop = collections.Counter(best or [])
    return {"total": total, "loop": loop, "loop_len": len(best or [])}


def summarize(name: str, ck, out_dir: Path | None) -> dict:
    sass = sass_of(ck)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.sass").write_text(sass)
        (out_dir / f"{name}.ptx").write_text(ck.asm["ptx"])
    c = loop_body_counts(sass)
    lp = c["loop"]

    def grp(prefix):
        return sum(v for k, v in lp.items() if k.startswith(prefix))

    md = ck.metadata
    return dict(
        name=name, regs=getattr(md, "num_regs", None) if hasattr(md, "num_regs") else None,
        shared=md.shared, loop_len=c["loop_len"],
        ldg=grp("LDG"), ldgsts={k: v for k, v in lp.items() if k.startswith("LDGSTS")},
        lds={k: v for k, v in lp.items() if k.startswith("LDS") or k.startswith("LDSM")},
        sts={k: v for k, v in lp.items() if k.startswith("STS")},
        lop3=grp("LOP3"), shf=grp("SHF") + grp("SHL") + grp("SHR"), hmul2=grp("HMUL2") + grp("HFMA2"),
        prmt=grp("PRMT"), gmma={k: v for k, v in lp.items() if "GMMA" in k}, bar=grp("BAR") + grp("WARPSYNC"),
        imad=grp("IMAD") + grp("IADD") + grp("LEA") + grp("ISETP") + grp("SEL"), f2f=grp("F2F") + grp("F2FP"),
    )


if __name__ == "__main__":
    from benchmarks.moe.variants import VARIANTS  # noqa: E402

    names = sys.argv[1:] or list(VARIANTS)
    out = Path(os.environ["OUT_DIR"]) if os.environ.get("OUT_DIR") else None
    for n in names:
        const, warps, stages, cap, kern = VARIANTS[n]
        ck = compile_planar(const, warps, stages, cap, kern)
        r = summarize(n, ck, out)
        print(r, flush=True)
