"""sm_90 compile report of the Gluon fold GEMM (``adapt.kernels.moe_gluon``) at the tiles of calls 1-2, on CPU:
registers, spills, shared memory, wgmma waits (``moe_gluon.sm90_report``) and the SASS K loop's length and op
counts (``benchmarks/moe/sass_report.report``). Prints one JSON line per config. Round 2 adds the warp-specialized
kernel (``ws`` configs): its MMA loop (the shortest loop holding a GMMA) and its loader loop (the shortest holding
an LDGSTS), and the register counts ``setmaxnreg`` gives each partition.

Usage: TRITON_INTERPRET unset,
  PYTHONPATH=. python benchmarks/moe/2026-12-01-s4-fold/sass_gluon.py [NAME ...] > OUT.jsonl
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sass_report  # noqa: E402

from adapt.kernels import moe_gluon  # noqa: E402

CONFIGS = {
    # name: (ACTIVATION, BLOCK_M, BLOCK_N, STAGES, SPLIT); DeepSeek-V3 GEMM1 (SwiGLU) / GEMM2, gpt-oss GEMM1
    "gemm1_128x128_split": (1, 128, 128, 3, True),
    "gemm1_128x128_stored": (1, 128, 128, 3, False),
    "gemm1_128x128_split_s4": (1, 128, 128, 4, True),
    "gemm1_256x64_split": (1, 256, 64, 3, True),
    "gemm1_oss_128x128_split": (2, 128, 128, 3, True),
    "gemm2_128x256_split": (0, 128, 256, 3, True),
    "gemm2_256x128_split": (0, 256, 128, 3, True),
    # round 2: warp-specialized, 4-warp loader at moe_gluon.WS_LOAD_REGS, launch cap WS_MAXNREG
    "ws_gemm1_128x128_split": (1, 128, 128, 3, True),
    "ws_gemm1_128x128_stored": (1, 128, 128, 3, False),
    "ws_gemm1_oss_128x128_split": (2, 128, 128, 3, True),
    "ws_gemm2_128x256_split": (0, 128, 256, 3, True),
    "ws_gemm2_128x128_split": (0, 128, 128, 3, True),
}


def _ws_loops(ck) -> dict:
    """The loader loop's length and op counts, the local-memory ops (spills) and the setmaxnreg values."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cubin").write_bytes(ck.asm["cubin"])
        sass = subprocess.run([str(sass_report.BIN / "cuobjdump"), "--dump-sass", str(Path(d) / "k.cubin")],
                              capture_output=True, text=True).stdout
    ops = sass_report.sass_ops(sass)
    loop = sass_report.smallest_loop(ops, "LDGSTS")
    return dict(loader_loop_len=len(loop or []),
                loader_loop_ops=dict(collections.Counter(o.split(".")[0] for _, o, _ in loop or []).most_common(12)),
                local_ops=sum(o in ("STL", "LDL") or o.startswith(("STL.", "LDL.")) for _, o, _ in ops),
                setmaxnreg=[int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?0x([0-9a-f]+)", sass)])

if __name__ == "__main__":
    for name, (act, bm, bn, st, split) in CONFIGS.items():
        if sys.argv[1:] and name not in sys.argv[1:]:
            continue
        const = dict(TOPK=8 if act == 1 else 4, GATHER=act != 0, ACTIVATION=act, HAS_BIAS=act == 2, SPLIT=split,
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, STAGES=st)
        cap, extra = 0, {}
        if name.startswith("ws_"):
            const.update(LOAD_WARPS=moe_gluon.WS_LOAD_WARPS, LOAD_REGS=moe_gluon.WS_LOAD_REGS)
            cap = moe_gluon.WS_MAXNREG
        rep = moe_gluon.sm90_report(const, 8, cap)
        ck = moe_gluon.compile_sm90(const, 8, cap)
        loop = sass_report.report(ck, 0)
        if cap:
            extra = _ws_loops(ck)
        print(json.dumps(dict(name=name, **rep, loop_len=loop["loop_len"], loop_ops=loop["loop_ops"], **extra)),
              flush=True)
