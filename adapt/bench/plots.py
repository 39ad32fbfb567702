"""PNG plots of a concurrency sweep: latency percentiles and output throughput against concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def sweep_plots(rows: list[dict[str, Any]], out_dir: Path) -> dict[str, Path]:
    """Write ``latency.png`` (TTFT/TPOT/ITL/e2e p50 and p99, ms, one panel each, a line per workload)
    and ``throughput.png`` (output tokens/s) into ``out_dir``; rows are ``loadgen.summarize`` results
    with ``workload`` and ``concurrency``. Returns name -> path of the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    measured = [r for r in rows if "error" not in r]
    workloads = list(dict.fromkeys(r["workload"] for r in measured))
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, metric, label in zip(axes, ("ttft", "tpot", "itl", "e2el"),
                                 ("TTFT", "TPOT", "ITL", "end-to-end latency"), strict=True):
        for workload in workloads:
            points = sorted((r["concurrency"], r[f"{metric}_p50_ms"], r[f"{metric}_p99_ms"])
                            for r in measured if r["workload"] == workload and r[f"{metric}_p50_ms"] is not None)
            if not points:
                continue
            line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{workload} p50")
            ax.plot([p[0] for p in points], [p[2] for p in points], marker="x", linestyle="--",
                    color=line[0].get_color(), label=f"{workload} p99")
        ax.set_title(label)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("ms")
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    paths = {"latency.png": out_dir / "latency.png", "throughput.png": out_dir / "throughput.png"}
    fig.savefig(paths["latency.png"], dpi=90)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for workload in workloads:
        points = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in measured if r["workload"] == workload)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=workload)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_title("output throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["throughput.png"], dpi=90)
    plt.close(fig)
    return paths
