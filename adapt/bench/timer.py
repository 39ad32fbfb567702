"""The one GPU timer of adapt's benchmarks: CUDA-graph replays, optional L2 flush, eager fallback recorded.

``time_cuda(fn)`` captures ``fn`` in a CUDA graph (after warm-up calls on a side stream, as
capture requires) and times ``reps`` replays with CUDA events; when ``fn`` cannot be captured
(host synchronisation, dynamic shapes, an allocator that refuses capture) it times ``fn`` itself
and records why. ``flush_l2=True`` overwrites a buffer of twice the device's L2 between timed
runs (outside the timed interval), so each run reads its operands from HBM, as a layer does in a
model whose weights exceed L2. Times are medians, in microseconds.

``WARM_MS`` (environment ``ADAPT_TIMER_WARM_MS``, default 0): before the timed replays, replay back to back for
about that many milliseconds of device time (a device that lowered its clock during host work is back up before the
timing). It did not change the batch-1 DSA figures on the H100 (2026-12-02, benchmarks/gpu-2026-12-02-dsa-s14, call
3: the SM clock read 1980 MHz throughout); what moved them was the host's launch latency in every synced replay,
which ``batch`` takes out.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    """median_us: median of ``reps`` timed runs (us); mode: "graph" (CUDA-graph replays) or "eager";
    fallback: why capture failed (empty when it did not); l2_flushed: whether L2 was flushed before
    each run."""

    median_us: float
    reps: int
    mode: str
    fallback: str = ""
    l2_flushed: bool = False


WARM_MS = float(os.environ.get("ADAPT_TIMER_WARM_MS", "0"))
WARM_MAX_RUNS = 8192


def _back_to_back_ms(run: Callable[[], object], n: int) -> float:
    """Milliseconds between one pair of events around ``n`` runs enqueued back to back (a sync at the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _warm(run: Callable[[], object], warm_ms: float) -> int:
    """``run`` back to back in doubling batches until about ``warm_ms`` of device time (at most WARM_MAX_RUNS
    runs); returns the runs made."""
    done_ms, runs, batch = 0.0, 0, 1
    while done_ms < warm_ms and runs < WARM_MAX_RUNS:
        done_ms += _back_to_back_ms(run, batch)
        runs += batch
        batch = min(2 * batch, WARM_MAX_RUNS - runs) or 1
    return runs


def _event_times_us(run: Callable[[], object], reps: int, flush: torch.Tensor | None) -> list[float]:
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def _batched_times_us(run: Callable[[], object], reps: int, batch: int) -> list[float]:
    """``reps`` samples, each the mean of ``batch`` runs enqueued back to back between one pair of events: the
    device time of a run in steady state, the host's launch latency hidden behind the runs before it (as a
    serving engine replays its decode graph with the host ahead of the device)."""
    return [_back_to_back_ms(run, batch) * 1e3 / batch for _ in range(reps)]


def time_cuda(fn: Callable[[], object], reps: int = 20, *, warmup: int = 2, graph: bool = True,
              flush_l2: bool = False, batch: int = 1) -> Timing:
    """Median time of ``fn`` on the current CUDA device (see the module docstring). ``batch`` > 1 (graph mode, no
    L2 flush): each of the ``reps`` samples is the mean of ``batch`` replays enqueued back to back
    (``_batched_times_us``), so a graph of a few microseconds is timed without the host's launch latency, which a
    sync after every replay puts into each sample (2026-12-02, H100, batch-1 DSA scoring graph: 10-20 us a replay
    with a sync, 7.3-7.5 back to back)."""
    if batch > 1 and flush_l2:
        raise ValueError("time_cuda: batch > 1 times replays back to back; it cannot flush L2 between them")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    flush = None
    if flush_l2:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 64 << 20)
        flush = torch.empty(2 * max(l2, 1 << 20), dtype=torch.uint8, device="cuda")
    fallback = ""
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cuda_graph):
                fn()
        except RuntimeError as exc:
            fallback = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            torch.cuda.synchronize()
        else:
            cuda_graph.replay()
            torch.cuda.synchronize()
            _warm(cuda_graph.replay, WARM_MS)
            if batch > 1:
                times = _batched_times_us(cuda_graph.replay, reps, batch)
            else:
                times = _event_times_us(cuda_graph.replay, reps, flush)
            del cuda_graph
            return Timing(statistics.median(times), reps, "graph", "", flush is not None)
    else:
        fallback = "graph capture not requested"
    _warm(fn, WARM_MS)
    times = _event_times_us(fn, reps, flush)
    return Timing(statistics.median(times), reps, "eager", fallback, flush is not None)


def graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median microseconds of CUDA-graph replays of ``fn`` (eager when it cannot be captured)."""
    return time_cuda(fn, reps).median_us


def time_eager_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of ``reps`` eager runs of ``fn`` (CUDA events) after ``warmup`` runs."""
    return time_cuda(fn, reps, warmup=warmup, graph=False).median_us / 1e3


def time_graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``reps`` CUDA-graph replays of ``fn`` (no host launch gaps, as a serving
    engine runs a decode step); eager when ``fn`` cannot be captured."""
    return time_cuda(fn, reps, warmup=1).median_us / 1e3


def time_in_turns(variants: dict[str, Callable[[], object]], rounds: int = 3, reps: int = 20,
                  timer: Callable[..., Timing] = time_cuda) -> dict[str, list[float]]:
    """Each variant timed once a round (``timer(fn, reps=reps)``'s median, us), ``rounds`` rounds, every round
    over all variants in order: a drift of the clock or the memory over the run falls on every variant alike,
    where timing one variant's rounds back to back puts it on whichever ran last. Returns name -> per-round us."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(timer(fn, reps=reps).median_us)
    return times
