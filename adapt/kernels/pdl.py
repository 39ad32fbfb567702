"""Programmatic dependent launch (PDL, sm_90 and newer) for chains of small kernels.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still running: its programs
start, wait at ``griddepcontrol.wait`` until that kernel has finished and its writes are visible, and so the launch
and the ramp of each kernel overlap the tail of the one before instead of following it. In a CUDA graph the
dependency is kept as a programmatic edge. Each kernel of a chain calls ``enter(PDL)`` first: the wait, before any
load or store (so every read of an earlier kernel's output and every write an earlier kernel may still read come
after it), then ``griddepcontrol.launch_dependents`` (the next kernel may launch once every program of this one has
started). The chain adapt runs this way, when enabled: the decode step's indexer scores, radix top-k and sparse
MLA with its combine (``dsa.index_scores`` decode, ``topk.topk_grid`` or ``topk.topk_indices``,
``sparse_mla.sparse_mla``'s tl kernel).

On by default where it applies (a CUDA device of capability 9.0 or newer, not the interpreter); ``ADAPT_PDL=0`` in
the environment or ``set_enabled(False)`` turns it off. Measured on the H200 (benchmarks/gpu-2026-12-02-dsa-s10,
2026-12-02): the batch-1 x 128K step 53.3 -> 46.8 us per layer (8-layer graph 53.8 -> 47.2), outputs bit-equal.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENABLED = os.environ.get("ADAPT_PDL", "1") != "0"


def set_enabled(on: bool) -> bool:
    """Turn PDL on or off for later launches; returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(on)
    return previous


def active(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL now: enabled, a CUDA device of capability 9.0 or newer, not the
    interpreter."""
    if not _ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch of the chain: the ``PDL`` constexpr and Triton's ``launch_pdl``."""
    on = active(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def with_setting(on: bool, fn):
    """``fn`` wrapped to run with PDL set to ``on`` (benchmarks time a chain both ways in turns; a CUDA graph
    captured inside keeps the launches' setting)."""

    def run():
        set_enabled(on)
        return fn()

    return run


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a chain kernel: with PDL, wait for the kernel before, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
