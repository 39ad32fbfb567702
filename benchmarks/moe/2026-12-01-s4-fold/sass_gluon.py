"""sm_90 compile report of the Gluon fold GEMM (``adapt.kernels.moe_gluon``) at the tiles of calls 1-2, on CPU:
registers, spills, shared memory, wgmma waits (``moe_gluon.sm90_report``) and the SASS K loop's length and op
counts (``benchmarks/moe/sass_report.report``). Prints one JSON line per config.

Usage: TRITON_INTERPRET unset, PYTHONPATH=. python benchmarks/moe/2026-12-01-s4-fold/sass_gluon.py > OUT.jsonl
"""

from __future__ import annotations

import json
import sys
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
}

if __name__ == "__main__":
    for name, (act, bm, bn, st, split) in CONFIGS.items():
        const = dict(TOPK=8 if act == 1 else 4, GATHER=act != 0, ACTIVATION=act, HAS_BIAS=act == 2, SPLIT=split,
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, STAGES=st)
        rep = moe_gluon.sm90_report(const, 8)
        loop = sass_report.report(moe_gluon.compile_sm90(const, 8), 0)
        print(json.dumps(dict(name=name, **rep, loop_len=loop["loop_len"], loop_ops=loop["loop_ops"])), flush=True)
