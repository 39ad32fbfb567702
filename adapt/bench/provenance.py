"""Where and when a benchmark ran: date, adapt commit, device, library versions."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path


def commit() -> str:
    """ADAPT_COMMIT from the environment (a device copy has no .git), else the checkout's HEAD with
    " (modified)" when tracked files under adapt/ differ from it, else "unknown"."""
    if os.environ.get("ADAPT_COMMIT"):
        return os.environ["ADAPT_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "adapt"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")


def provenance() -> dict[str, str]:
    """date (UTC, ISO seconds), commit, device (GPU name or CPU model), host, torch and triton versions."""
    out = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit(),
           "host": platform.node()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["device"] = (torch.cuda.get_device_name() if torch.cuda.is_available()
                         else f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    except ImportError:
        out["device"] = f"cpu: {platform.machine()}, {os.cpu_count()} cores"
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out
