"""What the planar MoE probes share (``moe_pdl.py``, ``moe_l2.py``, ``moe_n256.py``): the record's header, one
real-shape layer's planar experts on ``bench_moe``'s random codes, and variants of ``planar_moe`` timed in turns.

Imported by the probes (run as ``PYTHONPATH=. python benchmarks/next/<probe>.py``: their folder is on the path)."""

from __future__ import annotations

import datetime as dt
import os
import statistics

import torch

from adapt.bench.timer import time_in_turns
from adapt.kernels.moe_gemm import ACTIVATIONS
from adapt.kernels.moe_planar import PlanarExperts, planar_moe
from adapt.kernels.moe_weights import mxfp4_expert_bytes
from adapt.stages.bench_moe import SHAPES, _random_layer


def header(ceil: dict) -> dict:
    """The record's first fields: date, commit (ADAPT_COMMIT), GPU, torch, the same-run copy rate; rows to fill."""
    return dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), commit=os.environ.get("ADAPT_COMMIT"),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tbps=ceil["copy_tbps"], rows=[])


def planar_layer(name: str) -> tuple[dict, PlanarExperts]:
    """Shape ``name`` of ``bench_moe.SHAPES`` and its planar experts (seed 0: the benchmark's codes)."""
    shape = SHAPES[name]
    torch.manual_seed(0)
    routed, _ = _random_layer(shape, "cuda")
    return shape, PlanarExperts.from_weights(routed)


def moe_fn(shape: dict, planar: PlanarExperts, x, perm, topw, config=None):
    """``planar_moe`` of the runtime's path on one point (``config``: a (GEMM1, GEMM2) pair, None: the table)."""
    k, act = shape["top_k"], ACTIVATIONS[shape["activation"]]
    return lambda: planar_moe(x, perm, planar, topw, top_k=k, activation=act, config=config)


def floor_us(shape: dict, active: int, copy_tbps: float) -> float:
    """The point's byte floor: its active experts' MXFP4 bytes at the copy rate."""
    return active * mxfp4_expert_bytes(shape["hidden"], shape["intermediate"]) / (copy_tbps * 1e6)


def in_turns(fns: dict, rounds: int, reps: int) -> tuple[dict, dict]:
    """``time_in_turns`` of the variants -> (per-round us, median us) by name."""
    times = time_in_turns(fns, rounds, reps)
    return times, {v: statistics.median(ts) for v, ts in times.items()}
