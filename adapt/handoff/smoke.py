"""Smoke test of a served model: fixed prompts, greedy decoding, token-by-token comparison.

Three sources of greedy continuations for the same prompt token ids:
  vllm          the OpenAI-compatible server (``/v1/completions``, temperature 0, ``logprobs=5``,
                ``ignore_eos``, token ids returned as ``token_id:<id>``), reached with stdlib urllib;
  transformers  ``generate`` on the same checkpoint (greedy, EOS disabled, raw logits per step);
  adapt         adapt's own runtime, where one exists for the architecture.

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
            "divergence gap (nats)": "-" if self.divergence_gap is None else round(self.divergence_gap, 5),
            "top-5 overlap min": round(self.min_overlap, 3),
            "top-5 overlap mean": round(self.mean_overlap, 3),
            "max |dlogprob| (nats)": round(self.max_logprob_diff, 5),
        }

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
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
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
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
