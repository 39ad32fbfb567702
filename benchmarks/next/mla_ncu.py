"""The Gluon sparse MLA decode kernel at batch 64 x 128K top-2048 (128 heads), launched eager a few times for
Nsight Compute (issue 16: where its 4.3 us a tile go). Gluon flags from argv[2] (JSON, default none).

Usage (CUDA machine): ncu --clock-control none --set full -k regex:sparse_mla_gluon --launch-skip 2 --launch-count 1 \
    --export R -f python3 benchmarks/next/mla_ncu.py [LAUNCHES [FLAGS]]
"""

from __future__ import annotations

import json
import sys

import torch

from adapt.kernels.sparse_mla import sparse_mla
from adapt.stages.bench_dsa import _decode_inputs

CONTEXT, TOPK = 131072, 2048


def main() -> None:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    flags = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    torch.manual_seed(0)
    layer, block_table, token_seq, _, (_, _, q_nope, q_rope) = _decode_inputs(64, CONTEXT)
    idx = torch.stack([torch.randperm(CONTEXT, device="cuda")[:TOPK] for _ in range(64)]).int()
    args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, block_table, token_seq, idx,
            0.1)
    for _ in range(launches):
        sparse_mla(*args, gluon=dict(flags))
    torch.cuda.synchronize()
    print("launched", launches, flags)


if __name__ == "__main__":
    main()
