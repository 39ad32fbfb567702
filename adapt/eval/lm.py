"""lm-eval's ``LM`` over adapt's runtime: loglikelihood, rolling loglikelihood and greedy generate_until.

    lm = AdaptLM(model_dir, kernels="all", dtype="bf16")          # the adapted path
    ref = AdaptLM(model_dir, kernels="none", dtype="fp32")        # the float32 reference path
    lm_eval.simple_evaluate(model=lm, tasks=[...])

Requests are scored in steps of up to ``batch`` sequences (one prefill step each, every position's
logits kept); a context and continuation are tokenized together and split where the context's own
tokens end, so a merge across the boundary is charged to the continuation (as lm-eval's HF model
does). Sequences longer than the model's limit keep their last ``max_length`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lm_eval.api.model import LM


class AdaptLM(LM):
    """An lm-eval model backed by ``adapt.runtime.engine.Engine``.

    model_dir: checkpoint directory with a tokenizer; kernels / formats / layers: as ``Engine.load``;
    dtype 'fp32' | 'bf16'; max_length: tokens per sequence; batch: sequences per step.
    """

    def __init__(self, model_dir: str | Path, *, kernels: str = "none", dtype: str = "fp32", formats=None,
                 layers=None, device: str = "cpu", max_length: int = 512, batch: int = 8):
        super().__init__()
        from transformers import AutoTokenizer

        from adapt.runtime.engine import Engine

        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.batch = batch
        self.max_length = max_length
        self.engine = Engine.load(self.model_dir, kernels=kernels, layers=layers, device=device,
                                  dtype=torch.float32 if dtype == "fp32" else torch.bfloat16,
                                  max_tokens=batch * (max_length + 64), formats=formats)
        eos = self.engine.model.eos_ids or (self.tokenizer.eos_token_id,)
        self.prefix_id = int(eos[0])

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self._encode(context + continuation)
        ctx = self._encode(context)
        cut = len(ctx) if whole[: len(ctx)] == ctx else len(whole) - len(self._encode(continuation))
        return [self.prefix_id] + whole[:cut], whole[cut:]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum of continuation log-probs, continuation is greedy)."""
        out = []
        for start in range(0, len(pairs), self.batch):
            chunk = pairs[start : start + self.batch]
            seqs = [(ctx + cont)[-(self.max_length + 1) :] for ctx, cont in chunk]
            ids = self.engine.start(len(seqs))
            try:
                logits = self.engine.step(ids, [s[:-1] for s in seqs], all_logits=True)
            finally:
                self.engine.release(ids)
            for (_, cont), seq, rows in zip(chunk, seqs, logits, strict=True):
                n = len(cont)
                logp = torch.log_softmax(rows[-n:].float().cpu(), -1)
                target = torch.tensor(seq[-n:])
                out.append((float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self._score([self._pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        results = []
        for request in requests:
            tokens = self._encode(request.args[0])
            pairs, done = [], 0
            while done < len(tokens):  # windows of max_length predictions, each with as much context as fits
                end = min(done + self.max_length, len(tokens))
                context = ([self.prefix_id] + tokens)[max(0, end - self.max_length) : done + 1]
                pairs.append((context, tokens[done:end]))
                done = end
            results.append(sum(score for score, _ in self._score(pairs)))
        return results

    def generate_until(self, requests) -> list[str]:
        results = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            prompt = ([self.prefix_id] + self._encode(context))[-self.max_length :]
            new = int(kwargs.get("max_gen_toks", 32))
            tokens = self.engine.generate([prompt], new).tokens[0]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            results.append(text)
        return results
