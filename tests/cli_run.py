"""Run ``adapt`` the way a user does (``adapt.cli.main``: exit code, stdout, stderr) and snapshot a
run directory, for tests that assert the exit code, the one line and what is left on disk."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def adapt(capsys, *args: str) -> Result:
    """``adapt ARGS`` in this process through the console entry point (signal handlers restored)."""
    from adapt import cli

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    argv, sys.argv = sys.argv, ["adapt", *map(str, args)]
    capsys.readouterr()
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
        for s, handler in saved.items():
            signal.signal(s, handler)
    out = capsys.readouterr()
    return Result(code, out.out, out.err)


def adapt_process(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """``python -m adapt.cli ARGS`` as a child process of this checkout (stdout/stderr piped)."""
    import os

    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "adapt.cli", *map(str, args)], cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes); {} when it does not exist."""
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
