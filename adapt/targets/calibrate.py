"""Calibrate a target: measure the accelerator of this machine and write a target YAML from it.

``calibrate(base)`` times, on the devices visible here,

- device memory (bytes the runtime reports per device);
- read bandwidth (a reduction over a large buffer: bytes read / s) and copy bandwidth
  (``dst.copy_(src)``: bytes read + bytes written / s), best over several sizes;
- dense matrix rates (FLOP/s = 2 m n k / s) in bf16 (and fp32 on a CPU) and in FP8 e4m3
  (``torch._scaled_mm`` with per-tensor scales) at several shapes;
- kernel launch cost: eager launches back to back (us per launch, what the host issues) and
  kernels replayed from one CUDA graph (us per kernel, the device-side gap);
- with two or more GPUs: all-reduce, all-gather and all-to-all through ``torch.distributed``
  (NCCL, one process per GPU), reported as bus bandwidth in the nccl-tests convention
  (all-reduce: algorithm bandwidth x 2 (n - 1) / n; all-gather and all-to-all: x (n - 1) / n),
  and the time of a small all-reduce as the per-step latency.

``Calibration.target_fields()`` takes the named datasheet profile (``base``) and replaces every
field that was measured; each measured field's source reads "measured <date> on <device> ...",
each other field keeps its datasheet source prefixed with "datasheet", and a ``calibration``
section lists which is which, what was refused and why, and every timed point.

Nothing here needs more than torch and PyYAML: it imports on a bare GPU node (no eval/serve extras).
Timings are medians of CUDA-event intervals (GPU) or ``time.perf_counter`` (CPU) after warm-up.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from adapt.errors import InputError
from adapt.targets.target import GiB, Target, load_target

MiB = 1024**2
# NVLink multicast stays off for every process calibrate starts (device/KINDS.md: a program using
# it can take a shared host's GPUs out of service).
NCCL_SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Matrix shapes (m, n, k): square ones for the peak, and the DeepSeek-V3 expert GEMM shapes
# (hidden 7168, expert width 2048) at a prefill-sized and a decode-sized token count.
GPU_MATMUL_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 2048, 7168), (16384, 7168, 2048),
                     (256, 2048, 7168))
CPU_MATMUL_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048))
QUICK_MATMUL_SHAPES = ((256, 256, 256), (512, 512, 512))
GPU_BUFFER_BYTES = (256 * MiB, 1 * GiB, 4 * GiB)
CPU_BUFFER_BYTES = (256 * MiB, 1 * GiB)
QUICK_BUFFER_BYTES = (64 * MiB,)  # beyond a CPU's last-level cache, small enough for seconds
COLLECTIVE_BYTES = (1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB)
ROTATE_BYTES = 512 * MiB  # inputs are rotated until they span this much memory (beyond any cache)

Progress = Callable[[str, int, int], None]


@dataclass
class Calibration:
    """What was measured on this machine, what was refused (with the reason), against a base target.

    measured: field -> value in the target YAML's units (GiB, TB/s, TFLOP/s, GB/s, us)
    sources: field -> "measured <date> on <device> ..." for each measured field
    points: measurement -> list of timed points (shape or bytes, seconds, rate)
    refused: measurement -> why it could not run here
    """

    base: Target
    device: str
    date: str
    devices: int
    environment: dict[str, str]
    measured: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    points: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def target_fields(self, name: str | None = None) -> dict[str, Any]:
        """The calibrated target as YAML-ready data: the base profile's fields, measured ones replaced."""
        base = yaml.safe_load(Path(self.base.path).read_text())
        data = {k: v for k, v in base.items() if k != "sources"}
        sources = {k: f"datasheet ({Path(self.base.path).name}): {v}" for k, v in base.get("sources", {}).items()}
        data["name"] = name or f"{self.base.name}-calibrated"
        data["description"] = (f"{self.base.description}; measured {self.date} on {self.device} "
                               f"({self.devices} device(s) visible)")
        peak = dict(base.get("peak_tflops", {}))
        measured_peaks = {k.split(".", 1)[1]: v for k, v in self.measured.items() if k.startswith("peak_tflops.")}
        peak.update({k: _significant(v) for k, v in measured_peaks.items()})
        data["peak_tflops"] = peak
        for key, value in self.measured.items():
            if not key.startswith("peak_tflops."):
                data[key] = value
                sources[key] = self.sources[key]
        if measured_peaks:
            kept = sorted(set(peak) - set(measured_peaks))
            sources["peak_tflops"] = "; ".join(
                [self.sources[f"peak_tflops.{k}"] for k in sorted(measured_peaks)]
                + ([f"datasheet ({Path(self.base.path).name}): {', '.join(kept)}"] if kept else []))
        data["sources"] = sources
        measured_fields = sorted({k.split(".")[0] for k in self.measured} - {"peak_tflops"}) + (
            [f"peak_tflops.{k}" for k in sorted(measured_peaks)])
        data["calibration"] = {
            "base": self.base.name, "device": self.device, "date": self.date, "devices": self.devices,
            "environment": self.environment,
            "measured": measured_fields,
            "datasheet": sorted(k for k in sources if k not in self.measured and k != "peak_tflops")
            + [f"peak_tflops.{k}" for k in sorted(set(peak) - set(measured_peaks))],
            "refused": dict(self.refused), "notes": list(self.notes), "points": self.points,
        }
        return data

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base.name, "device": self.device, "date": self.date, "devices": self.devices,
                "environment": self.environment, "measured": self.measured, "sources": self.sources,
                "refused": self.refused, "notes": self.notes, "points": self.points}


def _significant(value: float) -> float:
    """``value`` to 4 significant digits (the YAML's numbers: no false precision, no rounding to 0)."""
    return float(f"{float(value):.4g}")


# ---------------------------------------------------------------- timing


def _median_seconds(fn: Callable[[], Any], cuda: bool, *, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall time of one ``fn()`` call (s): CUDA events around each call on a GPU, perf_counter on a CPU."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1e3
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rotating(make: Callable[[], Any], nbytes: int) -> Callable[[], Any]:
    """A callable returning the next of enough copies of ``make()`` to span ROTATE_BYTES (at most 16)."""
    copies = [make() for _ in range(max(1, min(16, -(-ROTATE_BYTES // max(nbytes, 1)))))]
    state = {"i": 0}

    def next_copy():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    return next_copy


# ---------------------------------------------------------------- single-device measurements


def _memory(cal: Calibration, device: str) -> None:
    import torch

    if device == "cuda":
        total = min(torch.cuda.mem_get_info(i)[1] for i in range(cal.devices))
        how = "torch.cuda.mem_get_info total"
    else:
        text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
        kib = [int(line.split()[1]) for line in text.splitlines() if line.startswith("MemTotal:")]
        if not kib:
            cal.refused["memory"] = "no /proc/meminfo on this machine: host memory cannot be read"
            return
        total = kib[0] * 1024
        how = "MemTotal of /proc/meminfo"
    cal.measured["memory_gib"] = round(total / GiB, 1)
    cal.sources["memory_gib"] = f"measured {cal.date} on {cal.device}: {how} ({total:,} bytes)"


def _bandwidth(cal: Calibration, device: str, sizes: tuple[int, ...], tick: Callable[[], None]) -> None:
    """Read (sum) and copy bandwidth over buffers of ``sizes`` bytes; the best size sets the field."""
    import torch

    cuda = device == "cuda"
    reads, copies = [], []
    for nbytes in sizes:
        n = nbytes // 4
        src = torch.rand(n, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        t_read = _median_seconds(lambda src=src: src.sum(), cuda)
        t_copy = _median_seconds(lambda src=src, dst=dst: dst.copy_(src), cuda)
        reads.append({"bytes": n * 4, "seconds": t_read, "tbs": n * 4 / t_read / 1e12})
        copies.append({"bytes_read_plus_written": 2 * n * 4, "seconds": t_copy, "tbs": 2 * n * 4 / t_copy / 1e12})
        del src, dst
        tick()
    cal.points["read_bandwidth"] = reads
    cal.points["copy_bandwidth"] = copies
    best_read = max(p["tbs"] for p in reads)
    best_copy = max(p["tbs"] for p in copies)
    # the cost model's HBM term counts bytes read (weights, KV): the read rate is the one it needs
    cal.measured["hbm_bandwidth_tbs"] = _significant(best_read)
    cal.sources["hbm_bandwidth_tbs"] = (
        f"measured {cal.date} on {cal.device}: read bandwidth (torch sum over fp32 buffers of "
        f"{', '.join(f'{s / MiB:,.0f}' for s in sizes)} MiB, median of 10, best size) {best_read:.4g} TB/s; "
        f"copy (read + write counted) {best_copy:.4g} TB/s")


def _matmul(cal: Calibration, device: str, dtype_name: str, shapes, tick: Callable[[], None]) -> None:
    """Dense matrix rate (FLOP/s = 2 m n k / s) per shape; the best shape sets peak_tflops.<dtype>."""
    import torch

    cuda = device == "cuda"
    points = []
    for m, n, k in shapes:
        if dtype_name == "fp8":
            scale = torch.ones((), dtype=torch.float32, device=device)

            def make(m=m, n=n, k=k):
                a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
                b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
                return a, b

            nxt = _rotating(make, (m + n) * k)

            def run(nxt=nxt, scale=scale):
                a, b = nxt()
                return torch._scaled_mm(a, b.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
        else:
            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]

            def make(m=m, n=n, k=k, dtype=dtype):
                return (torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))

            nxt = _rotating(make, (m + n) * k * dtype.itemsize)

            def run(nxt=nxt):
                a, b = nxt()
                return a @ b

        seconds = _median_seconds(run, cuda, repeats=10 if cuda else 3, warmup=3 if cuda else 1)
        points.append({"m": m, "n": n, "k": k, "seconds": seconds, "tflops": 2 * m * n * k / seconds / 1e12})
        tick()
    cal.points[f"matmul_{dtype_name}"] = points
    best = max(points, key=lambda p: p["tflops"])
    key = f"peak_tflops.{dtype_name}"
    cal.measured[key] = best["tflops"]
    what = ("torch._scaled_mm e4m3 x e4m3 -> bf16, per-tensor scales" if dtype_name == "fp8"
            else f"torch {dtype_name} matmul")
    cal.sources[key] = (f"measured {cal.date} on {cal.device}: {dtype_name} {best['tflops']:.4g} TFLOP/s, {what} on "
                        f"random data, best of {', '.join('{m}x{n}x{k}'.format(**p) for p in points)}")


def _launch(cal: Calibration, device: str) -> None:
    """Per-launch cost of a one-element kernel: eager back to back, and replayed from a CUDA graph."""
    import torch

    x = torch.zeros(1, device=device)
    count = 200
    if device == "cuda":
        def eager():
            for _ in range(count):
                x.add_(1)

        eager_s = _median_seconds(eager, True, repeats=5) / count
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            eager()  # warm-up on the capture stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(count):
                x.add_(1)
        graph_s = _median_seconds(graph.replay, True, repeats=5) / count
        cal.points["launch"] = [{"kernels": count, "eager_us": eager_s * 1e6, "graph_us": graph_s * 1e6}]
        cal.notes.append(f"kernel launch: {eager_s * 1e6:.2f} us per eager launch, {graph_s * 1e6:.2f} us per "
                         "kernel replayed from a CUDA graph (one-element add, 200 back to back)")
    else:
        def eager():
            for _ in range(count):
                x.add_(1)

        eager_s = _median_seconds(eager, False, repeats=5) / count
        cal.points["launch"] = [{"ops": count, "eager_us": eager_s * 1e6}]
        cal.notes.append(f"CPU op dispatch: {eager_s * 1e6:.2f} us per one-element torch op (no kernel launch "
                         "on a CPU; CUDA graphs do not apply)")


# ---------------------------------------------------------------- collectives (one process per GPU)


def collective_worker(rank: int, world: int, port: int, sizes: list[int], out_path: str) -> None:
    """One rank of the collective benchmark (spawned; rank 0 writes the JSON result to ``out_path``).

    Each point: bytes (per rank: the all-reduce buffer, the all-gather output, the all-to-all send
    buffer), median seconds over 10 calls (the slowest rank's), algorithm and bus bandwidth (GB/s).
    """
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(NCCL_SAFETY_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    factors = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world,
               "all_to_all": (world - 1) / world}
    results: dict[str, list[dict[str, float]]] = {op: [] for op in factors}
    for nbytes in sizes:
        n = max(world, nbytes // 2 // world * world)  # bf16 elements, a multiple of the ranks
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        gathered = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        shard = x[: n // world]
        received = torch.empty_like(x)
        calls = {
            "all_reduce": lambda x=x: dist.all_reduce(x),
            "all_gather": lambda g=gathered, s=shard: dist.all_gather_into_tensor(g, s),
            "all_to_all": lambda r=received, x=x: dist.all_to_all_single(r, x),
        }
        for op, fn in calls.items():
            dist.barrier()
            seconds = _median_seconds(fn, True, warmup=5, repeats=10)
            worst = torch.tensor([seconds], device="cuda")
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            seconds = float(worst.item())
            algbw = n * 2 / seconds / 1e9
            results[op].append({"bytes": n * 2, "seconds": seconds, "algbw_gbs": algbw,
                                "busbw_gbs": algbw * factors[op]})
        del x, gathered, received
    small = torch.ones(2, dtype=torch.float32, device="cuda")
    dist.barrier()
    eager = _median_seconds(lambda: dist.all_reduce(small), True, warmup=20, repeats=50)
    graph_s, graph_error = _graph_all_reduce_seconds(small)
    worst = torch.tensor([eager, graph_s if graph_s is not None else 0.0], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        results["small_all_reduce"] = [{"bytes": 8, "seconds": float(worst[0].item()),
                                        "graph_seconds": float(worst[1].item()) if graph_s is not None else None,
                                        "graph_error": graph_error}]
        results["nccl"] = [{"version": ".".join(map(str, torch.cuda.nccl.version()))}]
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _graph_all_reduce_seconds(small, calls: int = 20) -> tuple[float | None, str]:
    """Seconds per 8-byte all-reduce replayed from a CUDA graph of ``calls`` of them (the device-side
    step, without the host's eager dispatch), or (None, why) when NCCL cannot be captured here."""
    import torch
    import torch.distributed as dist

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                dist.all_reduce(small)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                dist.all_reduce(small)
        return _median_seconds(graph.replay, True, warmup=3, repeats=20) / calls, ""
    except Exception as exc:  # capture is optional: the eager time stands
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def _collectives(cal: Calibration, sizes: tuple[int, ...]) -> None:
    import torch.multiprocessing as mp

    from adapt.handoff.vllm import free_port

    os.environ.update(NCCL_SAFETY_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        try:
            mp.spawn(collective_worker, args=(cal.devices, free_port(), list(sizes), str(out)),
                     nprocs=cal.devices, join=True)
        except Exception as exc:  # a failed rank: record why, keep the single-device numbers
            cal.refused["collectives"] = f"NCCL benchmark failed on {cal.devices} GPUs: {type(exc).__name__}: " + (
                str(exc).strip().splitlines() or [""])[-1][:300]
            return
        results = json.loads(out.read_text())
    nccl = results.pop("nccl")[0]["version"]
    small = results.pop("small_all_reduce")[0]
    cal.points["small_all_reduce"] = [small]
    for op, points in results.items():
        cal.points[op] = points
    largest = max(results["all_reduce"], key=lambda p: p["bytes"])
    largest_first = sorted(results["all_reduce"], key=lambda p: -p["bytes"])
    best = max(p["busbw_gbs"] for p in results["all_reduce"])
    world = cal.devices
    cal.measured["intra_node_bandwidth_gbs"] = _significant(best)
    cal.sources["intra_node_bandwidth_gbs"] = (
        f"measured {cal.date} on {cal.device}: NCCL {nccl} all-reduce bus bandwidth over {world} GPUs "
        f"(algbw x 2(n-1)/n, bf16, best of {', '.join(format(p['bytes'] / MiB, ',.0f') for p in largest_first)} "
        f"MiB; {largest['busbw_gbs']:.1f} GB/s at {largest['bytes'] / MiB:,.0f} MiB); all-gather "
        f"{max(p['busbw_gbs'] for p in results['all_gather']):.1f}, all-to-all "
        f"{max(p['busbw_gbs'] for p in results['all_to_all']):.1f} GB/s bus bandwidth")
    step = small["graph_seconds"] or small["seconds"]
    cal.measured["intra_node_latency_us"] = _significant(step * 1e6)
    how = (f"replayed from a CUDA graph of 20 (as vLLM's decode runs), median of 20 replays; eager from Python "
           f"{small['seconds'] * 1e6:.1f} us" if small["graph_seconds"] else
           f"eager from Python, median of 50 (CUDA-graph capture failed: {small['graph_error']})")
    cal.sources["intra_node_latency_us"] = (
        f"measured {cal.date} on {cal.device}: NCCL {nccl} all-reduce of 8 bytes over {world} GPUs, {how}")


# ---------------------------------------------------------------- driver


def _environment(device: str) -> tuple[str, dict[str, str]]:
    import platform

    import torch

    env = {"torch": str(torch.__version__), "python": platform.python_version()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(cuda=str(torch.version.cuda), compute_capability=f"{props.major}.{props.minor}",
                   multiprocessors=str(props.multi_processor_count))
        return torch.cuda.get_device_name(0), env
    cpu = platform.processor() or platform.machine()
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    env["threads"] = str(torch.get_num_threads())
    return f"CPU {names[0] if names else cpu} ({torch.get_num_threads()} threads)", env


def calibrate(base: str, *, devices: int | None = None, quick: bool = False,
              progress: Progress | None = None) -> Calibration:
    """Measure this machine against the base target ``base`` (name or YAML path).

    A GPU base target needs visible CUDA devices (InputError otherwise: measuring a CPU for a GPU
    profile would be wrong); a CPU base target (compute capability "cpu") measures the host.
    devices: GPUs for the collectives (default: all visible; 1 skips them with a reason).
    quick: small buffers and shapes (seconds on a CPU; for tests, not for a profile you plan with).
    progress: called as (step, done, total) after each timed step.
    """
    import torch

    target = load_target(base)
    on_cpu = target.compute_capability == "cpu"
    if not on_cpu and target.vendor in ("intel", "huawei"):
        raise InputError(f"{target.name} ({target.vendor}) cannot be calibrated by this adapt: it times through "
                         "torch's CUDA and CPU back ends only (no habana_frameworks / torch_npu path)",
                         field="--target", hint="measure with the vendor's tools (hl_qual, ascend-dmi) and "
                         "write the numbers into a copy of the target YAML with their sources")
    if not on_cpu and not torch.cuda.is_available():
        raise InputError(f"{target.name} is a GPU target (compute capability {target.compute_capability}) but no "
                         "CUDA device is visible here", field="--target",
                         hint="run `adapt calibrate` on that GPU's machine, or --target cpu to measure this host")
    device = "cpu" if on_cpu else "cuda"
    visible = torch.cuda.device_count() if device == "cuda" else 1
    if devices is not None and not 1 <= devices <= visible:
        raise InputError(f"{devices} devices asked for, {visible} visible", field="--devices")
    name, env = _environment(device)
    cal = Calibration(base=target, device=name, date=_dt.date.today().isoformat(),
                      devices=devices or visible, environment=env)
    if device == "cuda" and env["compute_capability"] != target.compute_capability:
        cal.notes.append(f"this GPU is compute capability {env['compute_capability']}, the base target "
                         f"{target.name} says {target.compute_capability}")
    sizes = QUICK_BUFFER_BYTES if quick else CPU_BUFFER_BYTES if on_cpu else GPU_BUFFER_BYTES
    shapes = QUICK_MATMUL_SHAPES if quick else CPU_MATMUL_SHAPES if on_cpu else GPU_MATMUL_SHAPES
    fp8_ok = device == "cuda" and float(env["compute_capability"]) >= 8.9 and hasattr(torch, "_scaled_mm")
    steps = ["memory", "bandwidth", "matmul bf16"] + (["matmul fp32"] if on_cpu else []) + (
        ["matmul fp8"] if fp8_ok else []) + ["launch"] + (["collectives"] if cal.devices > 1 else [])
    matmuls = sum(s.startswith("matmul") for s in steps)
    total = len(steps) - matmuls - 1 + len(sizes) + len(shapes) * matmuls
    done = 0

    def tick(step: str) -> Callable[[], None]:
        def advance() -> None:
            nonlocal done
            done += 1
            if progress:
                progress(step, done, total)
        return advance

    _memory(cal, device)
    tick("memory")()
    _bandwidth(cal, device, sizes, tick("bandwidth"))
    _matmul(cal, device, "bf16", shapes, tick("matmul bf16"))
    if on_cpu:
        _matmul(cal, device, "fp32", shapes, tick("matmul fp32"))
    if fp8_ok:
        _matmul(cal, device, "fp8", shapes, tick("matmul fp8"))
    elif device == "cpu":
        cal.refused["matmul fp8"] = ("a CPU has no fp8 matrix units: torch would emulate e4m3 in software, which "
                                     "is no rate a plan could use")
    else:
        cal.refused["matmul fp8"] = (f"fp8 tensor cores need compute capability >= 8.9; this GPU is "
                                     f"{env['compute_capability']}")
    _launch(cal, device)
    tick("launch")()
    if device == "cpu":
        cal.refused["collectives"] = ("no GPUs here: all-reduce / all-gather / all-to-all over NCCL need CUDA "
                                      "devices, and a CPU target has no device links to time")
    elif cal.devices < 2:
        cal.refused["collectives"] = (f"{cal.devices} GPU visible: collectives need at least 2; run on a "
                                      "machine with several GPUs")
    else:
        _collectives(cal, (1 * MiB, 16 * MiB) if quick else COLLECTIVE_BYTES)
        tick("collectives")()
    cal.refused.setdefault("inter-node links", "one host: links between nodes cannot be measured here "
                                               "(inter_node_* fields stay from the datasheet)")
    return cal


def write_target(cal: Calibration, path: Path, name: str | None = None) -> Target:
    """Write the calibrated target YAML to ``path`` and load it back through the target loader."""
    data = cal.target_fields(name)
    head = (f"# Calibrated target: measured {cal.date} on {cal.device} by `adapt calibrate --target "
            f"{cal.base.name}`.\n# Fields named under calibration.datasheet keep the {cal.base.name} datasheet "
            "numbers; calibration.refused says why they could not be measured here.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + yaml.safe_dump(data, sort_keys=False, width=120))
    return load_target(str(path))
