"""Soak sampling: the serving process tree's resident memory over time, and a growth slope.

``MemorySampler`` reads ``VmRSS`` from ``/proc/<pid>/status`` for a root process and all its
descendants (vLLM's API server, engine core and workers are separate processes) and, where an
NVIDIA GPU is present, the GPU memory those processes hold (``nvidia-smi``), every ``interval_s``
seconds in a background thread. ``growth_slope`` fits a least-squares line to the samples.

Units: bytes, seconds; slopes in bytes per second.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (from /proc's parent links), root first."""
    from adapt.handoff.vllm import live_processes

    children: dict[int, list[int]] = {}
    for pid, parent, _ in live_processes():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if Path(f"/proc/{pid}").exists():
            tree.append(pid)
            todo += children.get(pid, [])
    return tree


def rss_bytes(pids: list[int]) -> int:
    """Sum of VmRSS over ``pids`` (bytes); processes that vanished count 0."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total


def gpu_bytes(pids: list[int]) -> int | None:
    """GPU memory held by ``pids`` (bytes) per ``nvidia-smi``; None without an NVIDIA GPU."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    wanted, total = set(pids), 0
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in wanted and parts[1].isdigit():
            total += int(parts[1]) * 2**20
    return total


@dataclass
class MemorySampler:
    """Samples the memory of ``root``'s process tree every ``interval_s`` s while running.

    samples: (time.monotonic() seconds, RSS bytes, GPU bytes or None). CLOCK_MONOTONIC is one clock
    for every process of the machine, so these times line up with ``vllm bench serve``'s request
    start times (``time.perf_counter``).
    """

    root: int
    interval_s: float = 1.0
    samples: list[tuple[float, int, int | None]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def sample(self) -> None:
        pids = process_tree(self.root)
        self.samples.append((time.monotonic(), rss_bytes(pids), gpu_bytes(pids)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.sample()


def growth_slope(times_s: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` against ``times_s`` (units of value per second); 0 for < 2 points."""
    n = len(times_s)
    if n < 2:
        return 0.0
    mean_t, mean_v = sum(times_s) / n, sum(values) / n
    var = sum((t - mean_t) ** 2 for t in times_s)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in zip(times_s, values, strict=True)) / var


@dataclass
class LeakJudgement:
    """The soak's memory verdict.

    rss_slope_mib_per_min: least-squares RSS growth over the judged window (MiB/min);
    rss_growth_mib: last judged sample minus first (MiB); window_s: seconds judged (the first
    ``warmup_fraction`` of the soak is left out: allocator pools and caches fill there);
    gpu_slope_mib_per_min: the same for GPU memory (None without a GPU); leak: the verdict.
    """

    rss_slope_mib_per_min: float
    rss_growth_mib: float
    rss_start_mib: float
    rss_end_mib: float
    window_s: float
    samples: int
    gpu_slope_mib_per_min: float | None
    leak: bool


def judge_leak(samples: list[tuple[float, int, int | None]], *, max_slope_mib_per_min: float,
               warmup_fraction: float = 0.25, load_window: tuple[float, float] | None = None) -> LeakJudgement:
    """A leak is a growth slope above ``max_slope_mib_per_min`` for RSS or GPU memory while the load
    ran (``load_window``: first request start and last request end on the same clock as the samples;
    None: all samples), after its first ``warmup_fraction`` (fewer than 3 samples there cannot show one)."""
    if not samples:
        return LeakJudgement(0.0, 0.0, 0.0, 0.0, 0.0, 0, None, False)
    start, end = load_window or (samples[0][0], samples[-1][0])
    begin = start + (end - start) * warmup_fraction
    window = [s for s in samples if begin <= s[0] <= end]
    if not window:
        return LeakJudgement(0.0, 0.0, 0.0, 0.0, 0.0, 0, None, False)
    times = [s[0] for s in window]
    rss_slope = growth_slope(times, [s[1] for s in window]) * 60 / 2**20
    gpu = [s for s in window if s[2] is not None]
    gpu_slope = growth_slope([s[0] for s in gpu], [s[2] for s in gpu]) * 60 / 2**20 if gpu else None
    leak = len(window) >= 3 and (rss_slope > max_slope_mib_per_min
                                 or (gpu_slope is not None and gpu_slope > max_slope_mib_per_min))
    return LeakJudgement(
        rss_slope_mib_per_min=rss_slope, rss_growth_mib=(window[-1][1] - window[0][1]) / 2**20,
        rss_start_mib=window[0][1] / 2**20, rss_end_mib=window[-1][1] / 2**20,
        window_s=times[-1] - times[0], samples=len(window), gpu_slope_mib_per_min=gpu_slope, leak=leak)
