"""A stand-in OpenAI-compatible completions server with injectable faults, for the stage-6 detector tests.

    python fake_openai_server.py --port P [--leak-kib N] [--fail-every K]

Streams ``max_tokens`` SSE chunks per ``POST /v1/completions`` (then a usage chunk and ``[DONE]``),
answers ``GET /health`` and ``/v1/models``. ``--leak-kib N`` keeps N KiB of written memory per
request forever (a leak); ``--fail-every K`` answers every K-th completion with HTTP 500
(K = 20: 5 % of requests fail), counted deterministically.
"""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEPT: list[bytearray] = []
COUNT = [0]
LOCK = threading.Lock()


def handler(leak_kib: int, fail_every: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _json(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/completions":
                self._json(404, {"error": "not found"})
                return
            with LOCK:
                COUNT[0] += 1
                number = COUNT[0]
                if leak_kib:
                    KEPT.append(bytearray(b"\x01") * (leak_kib * 1024))
            if fail_every and number % fail_every == 0:
                self._json(500, {"error": {"message": "injected failure", "code": 500}})
                return
            tokens = int(body.get("max_tokens") or 1)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(payload: str) -> None:
                data = f"data: {payload}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            for _ in range(tokens):
                send(json.dumps({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}))
            send(json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens}}))
            send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--leak-kib", type=int, default=0)
    parser.add_argument("--fail-every", type=int, default=0)
    args = parser.parse_args()
    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass   # clients that drop a connection mid-stream are expected here

    server = Server(("127.0.0.1", args.port), handler(args.leak_kib, args.fail_every))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
