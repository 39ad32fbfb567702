"""Edge-case probes of a served model over its OpenAI-compatible HTTP API (stdlib only).

Prompts are token-id lists (``/v1/completions`` accepts them), so a probe controls exact lengths:
at KV page boundaries (block_size - 1, block_size, block_size + 1, 2 * block_size tokens), at
``max_model_len`` (prompt + output = the limit), over it (expects a clean HTTP 400 and a server
that still answers), and a stream cancelled mid-way (its KV must be freed: vLLM's ``/metrics``
``vllm:kv_cache_usage_perc`` back to its idle value, no request left running).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def prompt_ids(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of ``length`` token ids in [3, 256) (inside any vocabulary of 256 tokens or
    more: the tiny hybrid and multimodal models have exactly 256)."""
    return [3 + (7 * i + 13 * salt) % 253 for i in range(length)]


def post_json(base_url: str, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, Any]:
    """POST JSON; returns (HTTP status, decoded JSON body or text). Connection errors raise OSError."""
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def get_json(base_url: str, path: str, timeout_s: float = 10.0) -> Any:
    """``GET base_url + path`` decoded as JSON, or None when the server does not answer 200 with JSON."""
    try:
        with urllib.request.urlopen(base_url + path, timeout=timeout_s) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (urllib.error.URLError, OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def answers(base_url: str, timeout_s: float = 10.0) -> bool:
    """Whether an HTTP server answers at ``base_url`` at all (``GET /v1/models``; any HTTP status counts),
    as against a refused connection, an unknown host or no answer within ``timeout_s``."""
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def served_models(base_url: str) -> list[dict[str, Any]] | None:
    """The models an OpenAI-compatible server lists (``GET /v1/models``): each ``{"id", "root",
    "max_model_len"}`` as the server gives them (vLLM: root is the path or hub id it loaded, max_model_len its
    context in tokens); None when the server does not list them."""
    data = get_json(base_url, "/v1/models")
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    return [{"id": m.get("id"), "root": m.get("root"), "max_model_len": m.get("max_model_len")}
            for m in data["data"] if isinstance(m, dict)]


def server_version(base_url: str) -> str | None:
    """The serving engine's version as the server reports it (vLLM's ``GET /version``), or None."""
    data = get_json(base_url, "/version")
    return str(data["version"]) if isinstance(data, dict) and data.get("version") else None


def healthy(base_url: str) -> bool:
    """Whether ``GET /health`` answers 200 within 10 s."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=10) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def server_metrics(base_url: str) -> dict[str, float]:
    """Prometheus gauges from ``/metrics`` that the probes read (summed over engines).

    Keys: ``kv_cache_usage`` (fraction 0..1), ``running``, ``waiting``, ``block_size`` (tokens per KV
    page, from ``vllm:cache_config_info``). Missing gauges are absent from the dict.
    """
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return {}
    names = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:gpu_cache_usage_perc": "kv_cache_usage",
             "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        if name in names:
            out[names[name]] = out.get(names[name], 0.0) + float(value)
        elif name == "vllm:cache_config_info" and 'block_size="' in head:
            size = head.split('block_size="', 1)[1].split('"', 1)[0]
            if size.isdigit():
                out["block_size"] = float(size)
    return out


def complete(base_url: str, model: str, ids: list[int], max_tokens: int) -> tuple[int, Any]:
    """One greedy, non-streamed completion of token ids (EOS ignored)."""
    return post_json(base_url, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})


def _generated(body: Any) -> int | None:
    if isinstance(body, dict) and isinstance(body.get("usage"), dict):
        return body["usage"].get("completion_tokens")
    return None


def length_probes(base_url: str, model: str, block_size: int, max_model_len: int) -> list[dict[str, Any]]:
    """Prompts at KV page boundaries and at ``max_model_len``; one over the limit.

    Each row: probe, prompt_tokens, max_tokens, status, generated, expected ("200" or "400"), ok.
    """
    rows = []
    cases = [(f"page-{n}", n, 2) for n in (block_size - 1, block_size, block_size + 1, 2 * block_size)
             if 0 < n and n + 2 <= max_model_len]
    cases.append(("max-model-len", max_model_len - 1, 1))
    for salt, (name, length, max_tokens) in enumerate(cases):
        status, body = complete(base_url, model, prompt_ids(length, salt), max_tokens)
        generated = _generated(body)
        rows.append({"probe": name, "prompt_tokens": length, "max_tokens": max_tokens, "status": status,
                     "generated": generated, "expected": 200,
                     "ok": status == 200 and generated == max_tokens})
    status, body = complete(base_url, model, prompt_ids(max_model_len + 1, 99), 1)
    clean = status == 400 and isinstance(body, dict) and "error" in body
    alive = healthy(base_url)
    after, after_body = complete(base_url, model, prompt_ids(8, 98), 2)
    rows.append({"probe": "over-limit", "prompt_tokens": max_model_len + 1, "max_tokens": 1, "status": status,
                 "generated": None, "expected": 400,
                 "ok": clean and alive and after == 200 and _generated(after_body) == 2,
                 "server_after": "healthy, answers" if alive and after == 200 else f"health {alive}, status {after}"})
    return rows


def cancel_probe(base_url: str, model: str, prompt_tokens: int, max_tokens: int, *, read_chunks: int = 1,
                 timeout_s: float = 30.0) -> dict[str, Any]:
    """Start a streamed completion, read ``read_chunks`` SSE chunks (more while the KV gauge has not yet
    shown the request), drop the connection, and check that the server frees the request's KV:
    ``kv_cache_usage`` returns to its idle value and no request is left running within ``timeout_s``.

    A thread samples ``/metrics`` from the moment the request is sent, so ``kv_usage_during`` is the
    highest usage seen while the stream was open (the gauge is published by the engine's stats loop).
    When the server streams every token before the client drops the connection (a small model is
    that fast), nothing was cancelled: ``exercised`` is False and ``ok`` False with that reason.

    Returns idle / during / after KV usage (fractions), ``freed_after_s``, ``exercised`` and ``ok``;
    ``ok`` is False with a ``reason`` when the server exposes no KV gauge (nothing to check against).
    """
    import threading

    idle = server_metrics(base_url)
    if "kv_cache_usage" not in idle:
        return {"ok": False, "exercised": False, "reason": "the server's /metrics has no KV-cache usage gauge"}
    peak = {"kv_cache_usage": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            usage = server_metrics(base_url).get("kv_cache_usage", 0.0)
            peak["kv_cache_usage"] = max(peak["kv_cache_usage"], usage)
            stop.wait(0.01)

    parts = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = json.dumps({"model": model, "prompt": prompt_ids(prompt_tokens, 7), "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    chunks = 0
    finished = False
    deadline = time.monotonic() + timeout_s
    if response.status == 200:
        while True:
            line = response.readline()
            if not line or b"[DONE]" in line:
                finished = True
                break
            if not line.startswith(b"data: "):
                continue
            chunks += 1
            if chunks >= read_chunks and (peak["kv_cache_usage"] > idle["kv_cache_usage"]
                                          or time.monotonic() > deadline):
                break
    stop.set()
    sampler.join()
    conn.sock.close() if conn.sock else None
    conn.close()
    started = time.monotonic()
    after = server_metrics(base_url)
    while time.monotonic() - started < timeout_s:
        after = server_metrics(base_url)
        if after.get("running", 0) == 0 and after.get("kv_cache_usage", 1.0) <= idle["kv_cache_usage"]:
            break
        time.sleep(0.25)
    freed = after.get("running", 1) == 0 and after.get("kv_cache_usage", 1.0) <= idle["kv_cache_usage"]
    used = peak["kv_cache_usage"] > idle["kv_cache_usage"]
    exercised = response.status == 200 and not finished and chunks >= read_chunks
    out = {"status": response.status, "chunks_read": chunks, "kv_usage_idle": idle["kv_cache_usage"],
           "kv_usage_during": peak["kv_cache_usage"], "kv_usage_after": after.get("kv_cache_usage"),
           "running_after": after.get("running"), "freed_after_s": round(time.monotonic() - started, 2),
           "exercised": exercised, "ok": exercised and used and freed}
    if not exercised:
        out["reason"] = (f"the server streamed all {chunks} tokens before the client dropped the stream, so "
                         "nothing was cancelled (the model is faster than the probe)" if finished else
                         f"the stream did not start (HTTP {response.status}, {chunks} chunks)")
    elif not used:
        out["reason"] = "KV usage did not rise while the stream ran, so its release cannot be shown"
    elif not freed:
        out["reason"] = f"KV not back to idle within {timeout_s:.0f} s after the client left"
    return out
