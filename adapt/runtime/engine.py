"""A compact inference engine for validation: load, prefill, decode, sample, capture.

    engine = Engine.load("path/to/model", layers=[0, 3], kernels="attention,moe", dtype=torch.bfloat16)
    result = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)          # greedy
    with engine.capture(hidden_states=True, router=True) as cap:
        engine.generate(...)
    cap.hidden_states[3]  # per step [N, hidden] outputs of decoder layer 3

Batches hold sequences of different lengths: a step flattens every sequence's new tokens
(prefill: the whole prompt; decode: one token) into one [N] token row over the paged cache.
Serving stays vLLM's job; this engine exists to execute the adapted path and compare it.

Kernel selection (``kernels``): 'none' (every op family on its torch reference), 'all', or a
comma list of op families among attention, indexer, moe, norm_rope. Kernels run compiled on a
GPU and under the Triton interpreter on CPU (``prepare_triton`` sets ``TRITON_INTERPRET=1`` when
no GPU is present; it must run before any Triton kernel module is imported).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapt.errors import InputError
from adapt.kernels.formats import PAGE_SIZE, use_interpreter
from adapt.model.spec import load_spec
from adapt.runtime.model import OP_FAMILIES, Capture, DecoderModel
from adapt.runtime.moe import MoE

ProgressFn = Callable[[str, int, int, float], None]
"""progress(phase 'prefill' | 'decode', tokens done, tokens total, seconds elapsed)."""


def prepare_triton() -> None:
    """Run Triton kernels in the interpreter when there is no CUDA device (before importing kernels)."""
    if not torch.cuda.is_available():
        use_interpreter()


def parse_kernels(spec: str | dict[str, str] | None) -> dict[str, str]:
    """'none' | 'all' | 'attention,moe' | {family: 'torch' | 'kernel'} -> {family: path} for every family."""
    if isinstance(spec, dict):
        paths = {family: "torch" for family in OP_FAMILIES}
        for family, path in spec.items():
            if family not in OP_FAMILIES or path not in ("torch", "kernel"):
                raise InputError(
                    f"bad op path {family}={path}",
                    field="kernels",
                    hint=f"families: {', '.join(OP_FAMILIES)}; paths: torch, kernel",
                )
            paths[family] = path
        return paths
    text = (spec or "none").strip().lower()
    if text == "none":
        return {family: "torch" for family in OP_FAMILIES}
    if text == "all":
        return {family: "kernel" for family in OP_FAMILIES}
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in OP_FAMILIES]
    if unknown:
        raise InputError(
            f"unknown op family {', '.join(unknown)}",
            field="kernels",
            hint=f"use none, all, or a comma list of {', '.join(OP_FAMILIES)}",
        )
    return {family: "kernel" if family in chosen else "torch" for family in OP_FAMILIES}


def parse_layers(spec: str | int | Sequence[int] | None, num_layers: int) -> list[int]:
    """None -> all layers; N -> 0..N-1; '0,3,60' or [0, 3, 60] -> those (sorted, unique)."""
    if spec is None:
        return list(range(num_layers))
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise InputError(
                f"--layers takes a count or a comma list of layer indices, got {spec!r}", field="layers"
            ) from None
        spec = values[0] if len(values) == 1 and "," not in spec else values
    if isinstance(spec, int):
        if not 1 <= spec <= num_layers:
            raise InputError(f"layer count {spec} is outside 1..{num_layers}", field="layers")
        return list(range(spec))
    layers = sorted(set(int(i) for i in spec))
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad or not layers:
        raise InputError(f"layer indices {bad or 'none'} are outside 0..{num_layers - 1}", field="layers")
    return layers


@dataclass
class StepTiming:
    """Tokens and wall seconds of the prefill and decode phases of a ``generate`` call."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0


@dataclass
class Generation:
    """tokens: generated ids per sequence (prompt excluded); finished: stopped at a stop id."""

    tokens: list[list[int]]
    finished: list[bool]
    timing: StepTiming = field(default_factory=StepTiming)


@dataclass
class Followed:
    """predictions: argmax per position of each continuation; logits: fp32 [positions, vocab] per
    sequence, or None."""

    predictions: list[list[int]]
    logits: list[torch.Tensor] | None = None


class Engine:
    """Runs one model (whole or reduced depth) over a paged cache.

    Use ``Engine.load``. ``max_tokens`` sizes the cache: pages of 64 tokens for that many tokens
    over all live sequences.
    """

    def __init__(
        self, model: DecoderModel, *, max_tokens: int = 4096, cache_dtype: torch.dtype | None = None
    ):
        from adapt.runtime.kv_cache import PagedKVCache

        self.model = model
        self.spec = model.spec
        pages = -(-max_tokens // PAGE_SIZE)
        self.cache = PagedKVCache(pages, model.cache_layouts(cache_dtype or model.dtype), model.device)
        self.bytes_read = 0  # checkpoint tensor bytes read by ``load``

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        layers: str | int | Sequence[int] | None = None,
        kernels: str | dict[str, str] | None = "none",
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        max_tokens: int = 4096,
        moe_workspace: int = 0,
        latent_fp8: bool = False,
        formats=None,
        faults=None,
    ) -> Engine:
        """Read config.json and the tensors of the chosen layers from ``path``.

        layers: None (all), a count, or indices ('0,3,60'); kernels: see ``parse_kernels``;
        dtype: compute dtype (float32 for reference comparisons, bfloat16 to run);
        moe_workspace: with the MoE kernel, experts per chunk of the shared FP8 workspace (online
        MXFP4 -> e4m3 conversion of the active experts only, fp8 GEMMs; MXFP4 layers keep their
        tensors); 0 runs the planar MXFP4 GEMMs (bf16 activations) instead, the planar copy
        replacing the tensors; latent_fp8: MLA layers cache their latent as e4m3 + fp32 scales.
        formats / faults: ``adapt.runtime.variants.Formats`` / ``Faults``
        (precision variants and test hooks; None: as stored, no faults).
        """
        from adapt.runtime.weights import WeightStore

        paths = parse_kernels(kernels)
        if any(p == "kernel" for p in paths.values()):
            prepare_triton()
        if not (Path(path) / "config.json").is_file():
            raise InputError("no config.json", file=str(path), hint="is this a model directory?")
        spec = load_spec(path)
        layer_ids = parse_layers(layers, spec.num_layers)
        store = WeightStore(path, layers=None if layers is None else layer_ids, device=device)
        workspace = None
        moe = [layer.ffn for layer in spec.moe_layers]
        if moe_workspace and paths["moe"] == "kernel" and moe:
            from adapt.kernels.workspace import FP8Workspace

            workspace = FP8Workspace(min(moe_workspace, max(f.num_experts for f in moe)), spec.hidden,
                                     max(f.expert_intermediate for f in moe), device=device)
        model = DecoderModel(spec, store, layer_ids, paths=paths, dtype=dtype, workspace=workspace,
                             latent_fp8=latent_fp8)
        if formats is not None or faults is not None:
            from adapt.runtime.variants import Formats, configure

            configure(model, formats or Formats(), faults)
        engine = cls(model, max_tokens=max_tokens)
        engine.bytes_read = store.bytes_read
        return engine

    # -- capture ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(
        self, hidden_states: bool = True, router: bool = True, dsa_indices: bool = False
    ) -> Iterator[Capture]:
        """Record per-layer outputs, router top-k (and the torch path's router scores) and DSA
        selections of the steps run inside."""
        record = Capture(hidden_states, router, dsa_indices)
        previous = self.model.capture
        moes = [layer.ffn for layer in self.model.layers if isinstance(layer.ffn, MoE)]
        kept = [moe.keep_scores for moe in moes]
        self.model.capture = record
        for moe in moes:
            moe.keep_scores = router
        try:
            yield record
        finally:
            self.model.capture = previous
            for moe, keep in zip(moes, kept, strict=True):
                moe.keep_scores = keep

    # -- stepping --------------------------------------------------------------------------------

    def start(self, count: int) -> list[int]:
        """Register ``count`` empty sequences; returns their ids."""
        return [self.cache.add_sequence() for _ in range(count)]

    def start_with_prefixes(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
        """Register one sequence per prompt, each attached to the cached full blocks its prompt starts
        with; returns (ids, tokens already cached per prompt). Step each with ``prompt[cached:]``."""
        ids = self.start(len(prompts))
        return ids, [self.cache.reuse_prefix(i, p) for i, p in zip(ids, prompts, strict=True)]

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.cache.free_sequence(seq_id)

    @torch.no_grad()
    def step(
        self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], *, all_logits: bool = False,
        embeddings: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Append ``tokens[i]`` to sequence ``seq_ids[i]`` and run them (prefill or decode alike).

        embeddings: [sum of len(tokens[i]), hidden] model inputs in place of the token embeddings
        (multimodal prompts), or None. Returns per sequence fp32 logits: [vocab] of its last new
        token, or [n_i, vocab] for every new token when ``all_logits``.
        """
        counts = [len(t) for t in tokens]
        if any(c == 0 for c in counts):
            raise ValueError("every sequence in a step needs at least one new token")
        batch = self.cache.append_tokens(seq_ids, counts, tokens)
        flat = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64, device=self.model.device)
        if int(flat.max()) >= self.spec.vocab or int(flat.min()) < 0:
            raise InputError(f"token id outside the vocabulary of {self.spec.vocab}", field="tokens")
        if embeddings is not None and embeddings.shape != (flat.numel(), self.spec.hidden):
            raise ValueError(f"embeddings {tuple(embeddings.shape)} do not match {flat.numel()} tokens x hidden")
        hidden = self.model.forward(flat, batch, self.cache.pools, embeddings)
        ends = batch.query_starts.tolist()
        if all_logits:
            logits = self.model.logits(hidden)
            return [logits[ends[b] : ends[b + 1]] for b in range(len(seq_ids))]
        last = torch.tensor([e - 1 for e in ends[1:]], device=hidden.device)
        logits = self.model.logits(hidden[last])
        return list(logits)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int = 0,
        stop_ids: Iterable[int] | None = None,
        progress: ProgressFn | None = None,
        reuse_prefix: bool = True,
    ) -> Generation:
        """Prefill every prompt in one step, then decode all live sequences together.

        temperature 0 is greedy (argmax); otherwise tokens are drawn from softmax(logits / T) with a
        generator seeded by ``seed``. A sequence stops after ``max_new_tokens`` or after emitting one
        of ``stop_ids`` (None: the config's EOS ids; empty: never). ``reuse_prefix``: prompts start
        from the cached full blocks of earlier sequences (prefill computes only the rest).
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("every prompt needs at least one token", field="prompt")
        if max_new_tokens < 1:
            raise InputError(
                f"max_new_tokens must be at least 1, got {max_new_tokens}", field="max_new_tokens"
            )
        gen = torch.Generator(device="cpu").manual_seed(seed)
        if reuse_prefix:
            ids, cached = self.start_with_prefixes(prompts)
        else:
            ids, cached = self.start(len(prompts)), [0] * len(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        timing = StepTiming()
        eos = set(self.model.eos_ids if stop_ids is None else stop_ids)
        try:
            t0 = time.perf_counter()
            logits = self.step(ids, [p[c:] for p, c in zip(prompts, cached, strict=True)])
            timing.prefill_tokens = sum(len(p) - c for p, c in zip(prompts, cached, strict=True))
            timing.prefill_s = time.perf_counter() - t0
            if progress:
                progress("prefill", timing.prefill_tokens, timing.prefill_tokens, timing.prefill_s)
            live = list(range(len(prompts)))
            total = max_new_tokens * len(prompts)
            t0 = time.perf_counter()
            while True:
                nxt = [self._sample(logits[j], temperature, gen) for j in range(len(live))]
                for j, b in enumerate(live):
                    out[b].append(nxt[j])
                    if nxt[j] in eos:
                        finished[b] = True
                keep = [j for j, b in enumerate(live) if not finished[b] and len(out[b]) < max_new_tokens]
                timing.decode_tokens = sum(map(len, out))
                timing.decode_s = time.perf_counter() - t0
                if progress:
                    progress("decode", timing.decode_tokens, total, timing.decode_s)
                if not keep:
                    break
                live = [live[j] for j in keep]
                logits = self.step([ids[b] for b in live], [[out[b][-1]] for b in live])
        finally:
            self.release(ids)
        return Generation(out, finished, timing)

    def follow(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        *,
        keep_logits: bool = False,
    ) -> Followed:
        """Teacher forcing: prefill ``prompts``, then feed ``continuations`` one token per step.

        Prediction i of a sequence is the argmax after its prompt and continuation[:i]. Greedy
        generation reproduces a continuation exactly when ``follow`` predicts it, and two engines
        fed the same tokens this way can be compared step by step (``capture``) even where they
        would diverge if left to generate. keep_logits: also return fp32 logits
        [len(continuation), vocab] per sequence (vocab-sized rows: keep it for small models).
        """
        if len(prompts) != len(continuations) or any(len(c) == 0 for c in continuations):
            raise InputError("one non-empty continuation per prompt", field="continuations")
        ids = self.start(len(prompts))
        predictions: list[list[int]] = [[] for _ in prompts]
        kept: list[list[torch.Tensor]] = [[] for _ in prompts]
        try:
            logits = self.step(ids, prompts)
            live = list(range(len(prompts)))
            for i in range(max(map(len, continuations))):
                for j, b in enumerate(live):
                    predictions[b].append(int(torch.argmax(logits[j])))
                    if keep_logits:
                        kept[b].append(logits[j].cpu())
                live = [b for b in live if i + 1 < len(continuations[b])]
                if not live:
                    break
                logits = self.step([ids[b] for b in live], [[continuations[b][i]] for b in live])
        finally:
            self.release(ids)
        return Followed(predictions, [torch.stack(rows) for rows in kept] if keep_logits else None)

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))


def resolve_model_dir(model: str) -> Path:
    """A tiny model name (built on first use) or a checkpoint directory holding config.json."""
    from adapt.model.tiny import TINY_MODELS, tiny_path

    if model in TINY_MODELS:
        return tiny_path(model)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise InputError(
            "not a checkpoint directory (no config.json)",
            file=model,
            hint=f"pass a model directory with safetensors weights, or one of {', '.join(TINY_MODELS)}",
        )
    return path


def encode_prompts(
    directory: Path, prompts: Sequence[str], token_ids: Sequence[str]
) -> tuple[list[list[int]], object]:
    """Prompts as token ids: text through the directory's tokenizer, or comma lists of ids.

    Returns (token lists, tokenizer or None).
    """
    tokenizer = None
    encoded = []
    if prompts:
        if not (directory / "tokenizer.json").exists() and not (directory / "tokenizer_config.json").exists():
            raise InputError(
                "the model directory has no tokenizer",
                file=directory,
                hint="pass --token-ids 1,2,3 instead of --prompt",
            )
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
        encoded += [tokenizer(text, add_special_tokens=False).input_ids for text in prompts]
    for text in token_ids:
        try:
            encoded.append([int(part) for part in text.split(",") if part.strip()])
        except ValueError:
            raise InputError(
                f"expected comma-separated token ids, got {text!r}", field="--token-ids"
            ) from None
    if not encoded or any(not ids for ids in encoded):
        raise InputError(
            "nothing to run: give --prompt TEXT or --token-ids IDS (non-empty)", field="--prompt"
        )
    return encoded, tokenizer


def run_prompts(model: str, prompt: Sequence[str], token_ids: Sequence[str], *, max_new_tokens: int,
                layers: str | None = None, kernels: str = "none", dtype: str = "bfloat16", device: str = "cpu",
                temperature: float = 0.0, seed: int = 0, moe_workspace: int = 0,
                progress: Callable[[str, int, int, float], None] | None = None) -> dict:
    """`adapt run`: load the model at the depth asked, size the cache for every prompt plus its new
    tokens, generate, and return the summary the CLI renders (JSON-ready).

    dtype: "bfloat16" | "float32"; device: "cpu" | "cuda". Raises InputError for either when
    unusable. Summary: model, layers, kernels (paths per op family), kernel_refusals, dtype,
    sequences (prompt_tokens, tokens, text, stopped_at_eos), prefill/decode tokens and seconds.
    """
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in dtypes:
        raise InputError(f"expected bfloat16 or float32, got {dtype!r}", field="--dtype")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise InputError(f"device {device!r} is not available here", field="--device", hint="use cpu or cuda")
    directory = resolve_model_dir(model)
    prompts, tokenizer = encode_prompts(directory, list(prompt), list(token_ids))
    engine = Engine.load(directory, layers=layers, kernels=kernels, dtype=dtypes[dtype], device=device,
                         max_tokens=sum(len(p) + max_new_tokens for p in prompts) + 64,
                         moe_workspace=moe_workspace)
    result = engine.generate(prompts, max_new_tokens, temperature=temperature, seed=seed, progress=progress)
    rows = [{"prompt_tokens": len(p), "tokens": t, "text": tokenizer.decode(t) if tokenizer else None,
             "stopped_at_eos": f} for p, t, f in zip(prompts, result.tokens, result.finished, strict=True)]
    return {"model": str(directory), "layers": [layer.index for layer in engine.model.layers],
            "kernels": engine.model.paths, "kernel_refusals": engine.model.kernel_refusals,
            "dtype": dtype, "sequences": rows,
            "prefill": {"tokens": result.timing.prefill_tokens, "seconds": result.timing.prefill_s},
            "decode": {"tokens": result.timing.decode_tokens, "seconds": result.timing.decode_s}}
