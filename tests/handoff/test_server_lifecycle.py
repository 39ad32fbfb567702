"""VllmServer's process handling with stand-in servers (plain Python processes, no vLLM)."""

import socket
import sys
import time
import urllib.error
import urllib.request

import pytest

from adapt.errors import InputError
from adapt.handoff.vllm import ServerFailed, VllmServer, free_port, session_processes

DIES = "import sys\nfor i in range(40):\n    print('line', i, flush=True)\nsys.exit(3)\n"
STUBBORN = (  # ignores SIGTERM and leaves a grandchild that ignores it too
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
    "print('up', flush=True)\ntime.sleep(300)\n"
)
HEALTHY = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1])), H).serve_forever()\n"
)


def test_server_that_dies_reports_exit_code_and_log_tail(tmp_path):
    server = VllmServer([sys.executable, "-c", DIES], tmp_path / "log", port=free_port())
    with server, pytest.raises(ServerFailed) as err:
        server.wait_healthy(60)
    assert "code 3" in str(err.value)
    assert len(err.value.log_tail) == 30 and err.value.log_tail[-1] == "line 39"
    assert server.leftover == []


def test_stop_kills_the_whole_session_even_when_sigterm_is_ignored(tmp_path):
    server = VllmServer([sys.executable, "-c", STUBBORN], tmp_path / "log", port=free_port(), grace_s=1.0)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while len(session_processes(server.process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(session_processes(server.process.pid)) == 2
    finally:
        leftover = server.stop()
    assert leftover == []
    assert session_processes(server.process.pid) == []


def _health_status(base_url: str) -> int:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_healthy_server_is_detected_and_stopped(tmp_path):
    with VllmServer([sys.executable, "-c", HEALTHY], tmp_path / "log", port=free_port()) as server:
        server.wait_healthy(60)
        assert _health_status(server.base_url) == 200  # wait_healthy returned only once /health said 200
        pid = server.process.pid
    assert server.leftover == [] and session_processes(pid) == []


def test_server_answering_503_is_never_called_healthy(tmp_path):
    unhealthy = HEALTHY.replace("200 if self.path == '/health' else 404", "503")
    with VllmServer([sys.executable, "-c", unhealthy], tmp_path / "log", port=free_port()) as server:
        with pytest.raises(ServerFailed, match="not healthy after 3 s"):
            server.wait_healthy(3)
        assert _health_status(server.base_url) == 503  # it was up and answering, just not healthy


def test_port_in_use_is_refused_before_starting(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = VllmServer([sys.executable, "-c", DIES], tmp_path / "log", port=busy.getsockname()[1])
        with pytest.raises(InputError, match="already in use"):
            server.start()
    assert server.process is None
