"""Programmatic dependent launch on the batch-1 decode step (issue 16): the DeepSeek-V3.2 step at batch 1 x 128K
(``dsa.index_topk`` with the radix select, then ``sparse_mla.sparse_mla``'s tl tile and combine: 14 kernels a
layer) with ``adapt.kernels.pdl`` off and on. First the outputs of both (indices and attention, bit for bit, at
batch 1 and 4), then the one-layer step in turns (ROUNDS rounds, CUDA-graph medians of 50 replays), then the
8-layer graph of ``bench_dsa._layered_step_us`` (the acceptance's second batch-1 line) off / on / off / on.

Usage (GPU): PYTHONPATH=. python benchmarks/next/pdl_probe.py OUT_JSON
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import sys

import torch

from adapt.bench.timer import time_in_turns
from adapt.kernels import dsa, pdl, sparse_mla
from adapt.stages.bench_dsa import GRAPH_LAYERS, _decode_inputs, _layered_step_us

CONTEXT, TOPK, ROUNDS = 131072, 2048, 5


def _step(inputs):
    layer, bt, seq, lim, (q8, w, qn, qr) = inputs
    idx, _ = dsa.index_topk(q8, w, layer.index_k, layer.index_scale, bt, seq, lim, TOPK, max_keys=CONTEXT,
                            rows_per_tile=1)
    return idx, sparse_mla.sparse_mla(qn, qr, layer.latent_nope, layer.latent_scale, layer.latent_rope, bt, seq, idx,
                                      0.1)


def main(out: str) -> None:
    res = dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), commit=os.environ.get("ADAPT_COMMIT"),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    equal = {}
    for batch in (1, 4):
        inputs = _decode_inputs(batch, CONTEXT)
        got = {on: pdl.with_setting(on, lambda i=inputs: _step(i))() for on in (False, True)}
        torch.cuda.synchronize()
        equal[batch] = bool(torch.equal(got[False][0], got[True][0]) and torch.equal(got[False][1], got[True][1]))
        print(f"batch {batch}: PDL output equal {equal[batch]}", flush=True)
    res["equal"] = equal
    inputs = _decode_inputs(1, CONTEXT)
    times = time_in_turns({"off": pdl.with_setting(False, lambda: _step(inputs)),
                           "on": pdl.with_setting(True, lambda: _step(inputs))},
                          ROUNDS, 50)
    res["one_layer_us"] = times
    print(json.dumps({k: [round(v, 2) for v in t] for k, t in times.items()}), flush=True)
    block_table = inputs[1]
    layered = {"off": [], "on": []}
    for _ in range(2):
        for on in (False, True):
            pdl.set_enabled(on)
            layered["on" if on else "off"].append(_layered_step_us(1, CONTEXT, TOPK, "fp8", block_table, {}, {}, 50,
                                                                   GRAPH_LAYERS))
    pdl.set_enabled(False)
    res["layered_us_per_layer"] = layered
    res["summary"] = {k: statistics.median(v) for k, v in times.items()} | {
        f"layered_{k}": statistics.median(v) for k, v in layered.items()}
    print(json.dumps(res["summary"]), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
