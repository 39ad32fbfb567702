"""``adapt bench runtime``: adapt's runtime at real widths and reduced depth, prefill and decode
tokens/s at several batch sizes beside the roofline of the layers that ran.

Models (synthetic weights, no checkpoint download): DeepSeek-V3.2's config (adapt/model/presets)
with decoder layers 0 (dense MLP) and 3 (MoE), and gpt-oss-120b's with layers 0 and 1 (sliding and
full attention, both MoE). Weights are drawn on the device and stored the way the real checkpoints
store them (fp8 e4m3 with 128x128 power-of-two block scales for DeepSeek's projections, MXFP4 experts
in the gpt-oss fused layout, bf16 elsewhere), written to a temporary directory and read back by
``Engine.load`` (the runtime's public entry point), so nothing here depends on its internals.

Per (model, batch B): prefill of B prompts of ``prompt_tokens`` tokens in one step, then
``decode_steps`` decode steps of B tokens; tokens/s from wall time around CUDA-synchronised
steps. Before the timed pass, one untimed pass at the same shapes (the prefill and two decode
steps) compiles the kernels for them; its seconds are kept in the row (``warmup_s``), as are the
engine's load and the twin check (``load_s``, ``twin_s``; the checkpoint's writing in the metrics), so
a run cut short shows where its time went. The checkpoint goes to /dev/shm when it has room (no disk
round trip). The report is rewritten after every batch, so a run killed from outside keeps the rows
it measured. Roofline per step from the bytes and FLOPs of those layers (below) and the same run's
ceilings (read bandwidth, bf16 matmul): decode reads the non-expert weights, the LM head and the
experts that B tokens activate (expected count E * (1 - (1 - k/E)^B) per MoE layer under uniform
routing); prefill reads every expert. FLOPs = 2 * tokens * (non-expert + k * per-expert parameters);
attention FLOPs are left out (small at these lengths), so the roofline is optimistic.
The twin error: the last-token logits of the kernel path against the torch reference path of the
same weights at batch 1 (||kernel - ref|| / ||ref||).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt.errors import InputError

LAYERS = {"deepseek-v3.2": (0, 3), "gpt-oss-120b": (0, 1)}
FP8_BLOCK = 128

# Width reductions for a CPU dry run of the same code path (every shape rule of the real model kept:
# fp8 blocks of 128, MXFP4 groups of 32, DeepSeek's rope 64 / index head 128).
TINY_WIDTH = {
    "deepseek-v3.2": {"hidden_size": 256, "q_lora_rank": 128, "kv_lora_rank": 128, "num_attention_heads": 4,
                      "num_key_value_heads": 4,
                      "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
                      "n_group": 1, "topk_group": 1, "moe_intermediate_size": 128, "intermediate_size": 256,
                      "vocab_size": 512, "index_n_heads": 4, "index_topk": 16},
    "gpt-oss-120b": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
                     "intermediate_size": 256, "vocab_size": 512},
}


@dataclass
class LayerBytes:
    """Bytes and parameters of the checkpoint written (the layers that run, embeddings, head).

    dense_*: every tensor of the decoder layers except routed experts (attention, indexer, dense
    and shared MLPs, router, norms); expert_*: one routed expert of one layer (all MoE layers alike);
    moe_layers: MoE layers among those written; embed_*/head_*: embedding table and LM head.
    """

    dense_bytes: int = 0
    dense_params: int = 0
    expert_bytes: int = 0
    expert_params: int = 0
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    embed_bytes: int = 0
    head_bytes: int = 0
    head_params: int = 0
    hidden: int = 0

    def decode_bytes(self, batch: int) -> float:
        active = self.experts * (1 - (1 - self.top_k / self.experts) ** batch) if self.experts else 0
        return (self.dense_bytes + self.head_bytes + self.moe_layers * active * self.expert_bytes
                + batch * self.hidden * 2)

    def prefill_bytes(self) -> float:
        return self.dense_bytes + self.head_bytes + self.moe_layers * self.experts * self.expert_bytes

    def flops(self, tokens: int) -> float:
        return 2.0 * tokens * (self.dense_params + self.head_params + self.moe_layers * self.top_k * self.expert_params)


def _config(model: str, tiny: bool) -> dict[str, Any]:
    from adapt.model.spec import PRESETS_DIR

    if model not in LAYERS:
        raise InputError(f"unknown model {model!r}", field="--model", hint=f"choose from {', '.join(LAYERS)}")
    config = json.loads((PRESETS_DIR / f"{model}.json").read_text())
    if tiny:
        config.update(TINY_WIDTH[model])
    return config


def write_checkpoint(model: str, directory: Path, *, device: str, tiny: bool = False, seed: int = 0) -> LayerBytes:
    """Write config.json and one safetensors shard per layer group of synthetic weights into ``directory``."""
    import torch
    from safetensors.torch import save_file

    config = _config(model, tiny)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    info = LayerBytes(hidden=hidden)
    weight_map: dict[str, str] = {}

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    def fp8(rows: int, cols: int) -> dict[str, torch.Tensor]:
        weight = torch.randn(rows, cols, generator=gen, device=device).to(torch.float8_e4m3fn)
        scale = 2.0 ** round(-0.5 * torch.log2(torch.tensor(float(cols))).item())
        scales = torch.full((-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), scale, device=device)
        return {"weight": weight, "weight_scale_inv": scales}

    def mxfp4(experts: int, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (experts, rows, k // 32, 16), dtype=torch.uint8, generator=gen, device=device)
        scales = torch.randint(120, 123, (experts, rows, k // 32), dtype=torch.uint8, generator=gen, device=device)
        return blocks, scales

    def save(shard: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, directory / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))

    def count(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        params = sum(t.numel() * (2 if k.endswith("_blocks") else 1) for k, t in tensors.items()
                     if not k.endswith(("weight_scale_inv", "_scales")))
        return nbytes, params

    embed, head = randn(vocab, hidden), randn(vocab, hidden, scale=hidden**-0.5)
    info.embed_bytes = embed.numel() * 2
    info.head_bytes, info.head_params = head.numel() * 2, head.numel()
    save("outer.safetensors", {"model.embed_tokens.weight": embed, "lm_head.weight": head,
                               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16, device=device)})
    del embed, head
    for layer in LAYERS[model]:
        p = f"model.layers.{layer}."
        dense: dict[str, torch.Tensor] = {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16, device=device),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16, device=device)}
        experts: dict[str, torch.Tensor] = {}
        if model == "deepseek-v3.2":
            _deepseek_layer(config, layer, p, dense, experts, randn, fp8, mxfp4, device)
        else:
            _gpt_oss_layer(config, p, dense, experts, randn, mxfp4)
        nbytes, params = count(dense)
        info.dense_bytes += nbytes
        info.dense_params += params
        if experts:
            n_exp = next(iter(experts.values())).shape[0]
            nbytes, params = count(experts)
            info.expert_bytes, info.expert_params = nbytes // n_exp, params // n_exp
            info.experts, info.moe_layers = n_exp, info.moe_layers + 1
            info.top_k = int(config.get("num_experts_per_tok") or config.get("experts_per_token"))
        save(f"layer-{layer}.safetensors", {**dense, **experts})
        del dense, experts
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return info


def _deepseek_layer(config, layer, p, dense, experts, randn, fp8, mxfp4, device) -> None:
    import torch

    hidden, a = config["hidden_size"], p + "self_attn."
    heads, nope, rope, v = (config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"],
                            config["v_head_dim"])
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    ih, idim = config["index_n_heads"], config["index_head_dim"]
    ones = {a + "q_a_layernorm.weight": q_lora, a + "kv_a_layernorm.weight": kv_lora, a + "indexer.k_norm.weight": idim}
    dense.update({name: torch.ones(n, dtype=torch.bfloat16, device=device) for name, n in ones.items()})
    dense[a + "indexer.k_norm.bias"] = torch.zeros(idim, dtype=torch.bfloat16, device=device)
    dense[a + "indexer.weights_proj.weight"] = randn(ih, hidden, scale=hidden**-0.5)
    linears = {a + "q_a_proj": (q_lora, hidden), a + "q_b_proj": (heads * (nope + rope), q_lora),
               a + "kv_a_proj_with_mqa": (kv_lora + rope, hidden), a + "kv_b_proj": (heads * (nope + v), kv_lora),
               a + "o_proj": (hidden, heads * v), a + "indexer.wq_b": (ih * idim, q_lora),
               a + "indexer.wk": (idim, hidden)}
    if layer < config["first_k_dense_replace"]:
        inter = config["intermediate_size"]
        linears.update({p + "mlp.gate_proj": (inter, hidden), p + "mlp.up_proj": (inter, hidden),
                        p + "mlp.down_proj": (hidden, inter)})
    else:
        width, n_exp = config["moe_intermediate_size"], config["n_routed_experts"]
        linears.update({p + "mlp.shared_experts.gate_proj": (width, hidden),
                        p + "mlp.shared_experts.up_proj": (width, hidden),
                        p + "mlp.shared_experts.down_proj": (hidden, width)})
        dense[p + "mlp.gate.weight"] = randn(n_exp, hidden, scale=hidden**-0.5)
        dense[p + "mlp.gate.e_score_correction_bias"] = (randn(n_exp, scale=0.01)).float()
        e = p + "mlp.experts."
        experts[e + "gate_up_proj_blocks"], experts[e + "gate_up_proj_scales"] = mxfp4(n_exp, 2 * width, hidden)
        experts[e + "down_proj_blocks"], experts[e + "down_proj_scales"] = mxfp4(n_exp, hidden, width)
    for name, (rows, cols) in linears.items():
        for suffix, tensor in fp8(rows, cols).items():
            dense[f"{name}.{suffix}"] = tensor


def _gpt_oss_layer(config, p, dense, experts, randn, mxfp4) -> None:
    hidden, a = config["hidden_size"], p + "self_attn."
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n_exp, inter = config["num_local_experts"], config["intermediate_size"]
    for name, rows, cols in (("q_proj", heads * hd, hidden), ("k_proj", kv * hd, hidden),
                             ("v_proj", kv * hd, hidden), ("o_proj", hidden, heads * hd)):
        dense[a + name + ".weight"] = randn(rows, cols, scale=cols**-0.5)
        dense[a + name + ".bias"] = randn(rows, scale=0.01)
    dense[a + "sinks"] = randn(heads, scale=0.1)
    dense[p + "mlp.router.weight"] = randn(n_exp, hidden, scale=hidden**-0.5)
    dense[p + "mlp.router.bias"] = randn(n_exp, scale=0.01)
    e = p + "mlp.experts."
    experts[e + "gate_up_proj_blocks"], experts[e + "gate_up_proj_scales"] = mxfp4(n_exp, 2 * inter, hidden)
    experts[e + "down_proj_blocks"], experts[e + "down_proj_scales"] = mxfp4(n_exp, hidden, inter)
    experts[e + "gate_up_proj_bias"] = randn(n_exp, 2 * inter, scale=0.01)
    experts[e + "down_proj_bias"] = randn(n_exp, hidden, scale=0.01)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


WARMUP_DECODE_STEPS = 2
"""Decode steps of the untimed pass: the first compiles the decode kernels, the second runs them
on a cache that already holds a decoded token."""


def measure_model(model: str, directory: Path, info: LayerBytes, *, batches: list[int], prompt_tokens: int,
                  decode_steps: int, kernels: str, device: str, deadline: float, ceilings: dict,
                  rows: list[dict] | None = None, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Rows for one model: twin error at batch 1, then prefill and decode rows per batch, appended to
    ``rows`` (returned); ``progress(message)`` is called after the load, the twin check and each batch."""
    import torch

    from adapt.kernels.formats import PAGE_SIZE
    from adapt.runtime.engine import Engine

    rows = [] if rows is None else rows
    progress = progress or (lambda message: None)
    # every sequence holds whole pages: batch * pages per sequence, plus the twin check's sequence
    max_tokens = (max(batches) + 1) * PAGE_SIZE * -(-(prompt_tokens + decode_steps + 4) // PAGE_SIZE)
    t0 = time.perf_counter()
    engine = Engine.load(directory, layers=list(LAYERS[model]), kernels=kernels, dtype=torch.bfloat16,
                         device=device, max_tokens=max_tokens)
    load_s = time.perf_counter() - t0
    progress(f"{model}: engine loaded in {load_s:.1f} s")
    vocab = engine.spec.vocab
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
    twin = None
    t0 = time.perf_counter()
    if kernels != "none":
        reference = Engine.load(directory, layers=list(LAYERS[model]), kernels="none", dtype=torch.bfloat16,
                                device=device, max_tokens=prompt_tokens + 64)
        ids = reference.start(1)
        ref = reference.step(ids, [prompt])[0].float()
        del reference
        ids = engine.start(1)
        got = engine.step(ids, [prompt])[0].float()
        engine.release(ids)
        twin = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
    twin_s = time.perf_counter() - t0
    progress(f"{model}: twin check {twin_s:.1f} s, error {twin}")
    common = {"model": model, "layers": list(LAYERS[model]), "kernels": kernels, "paths": dict(engine.model.paths),
              "load_s": round(load_s, 1), "twin_s": round(twin_s, 1)}

    def run_pass(engine, prompts: list[list[int]], steps: int) -> tuple[float, float]:
        """(prefill seconds, seconds of ``steps`` decode steps) of one pass over fresh sequences."""
        ids = engine.start(len(prompts))
        _sync(device)
        t0 = time.perf_counter()
        logits = engine.step(ids, prompts)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        logits = engine.step(ids, [[int(torch.argmax(x))] for x in logits])
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = engine.step(ids, [[int(torch.argmax(x))] for x in logits])
        _sync(device)
        decode_s = time.perf_counter() - t0
        engine.release(ids)
        return prefill_s, decode_s

    for batch in batches:
        if time.monotonic() > deadline:
            rows += [{**common, "batch": batch, "phase": ph, "skipped": "time budget spent"}
                     for ph in ("prefill", "decode")]
            continue
        prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
        try:
            t0 = time.perf_counter()
            run_pass(engine, prompts, min(WARMUP_DECODE_STEPS, decode_steps))  # compiles the kernels for these shapes
            warmup_s = time.perf_counter() - t0
            prefill_s, decode_s = run_pass(engine, prompts, decode_steps)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            rows += [{**common, "batch": batch, "phase": ph, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                     for ph in ("prefill", "decode")]
            progress(f"{model} batch {batch}: {rows[-1]['error']}")
            continue
        for phase, tokens_done, seconds, nbytes, flops in (
                ("prefill", batch * prompt_tokens, prefill_s, info.prefill_bytes(), info.flops(batch * prompt_tokens)),
                ("decode", batch * decode_steps, decode_s, decode_steps * info.decode_bytes(batch),
                 decode_steps * info.flops(batch))):
            floor_s = max(nbytes / (ceilings.get("read_tbps", 0) * 1e12 or float("inf")),
                          flops / (ceilings.get("bf16_matmul_tflops", 0) * 1e12 or float("inf")))
            rows.append({**common, "batch": batch, "phase": phase, "tokens": tokens_done,
                         "time_us": seconds * 1e6, "tokens_per_s": tokens_done / seconds,
                         "roofline_tokens_per_s": tokens_done / floor_s if floor_s else None,
                         "fraction_of_roofline": floor_s / seconds if floor_s else None,
                         "bytes": nbytes, "flops": flops, "twin_rel_error": twin, "twin_tolerance": 0.05,
                         "warmup_s": round(warmup_s, 1)})
        progress(f"{model} batch {batch}: warm-up {warmup_s:.1f} s, prefill {prefill_s * 1e3:.1f} ms, "
                 f"decode {decode_s * 1e3:.1f} ms for {decode_steps} steps")
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _scratch_directory(model: str, need_bytes: int) -> Path:
    """A fresh directory for the synthetic checkpoint: under /dev/shm when that has ``need_bytes`` free
    (the checkpoint is written and read back without touching a disk), else the default temp root."""
    shm = Path("/dev/shm")
    root = None
    if shm.is_dir():
        try:
            root = str(shm) if shutil.disk_usage(shm).free > need_bytes else None
        except OSError:
            root = None
    return Path(tempfile.mkdtemp(prefix=f"adapt-bench-{model}-", dir=root))


CHECKPOINT_BYTES = {"deepseek-v3.2": 11 << 30, "gpt-oss-120b": 6 << 30}
"""Upper bounds of the synthetic checkpoints at full width (measured 2026-11-30: 9.82 GiB and 5.2 GiB)."""


def run_runtime_bench(models: list[str], *, batches: list[int], prompt_tokens: int = 128, decode_steps: int = 16,
                      kernels: str = "all", device: str = "cuda", tiny: bool = False, budget_s: float = 150.0,
                      gates: dict | None = None, out_dir: Path | None = None,
                      progress: Callable[[str], None] | None = None):
    """Run every model; returns the StageReport (stage ``bench-runtime``). ``tiny``: the CPU dry run
    at reduced width (same code path). Rows missing for lack of time or memory are unmet lines. Each
    model gets an equal share of what is left of ``budget_s`` (a model that ends early leaves its time
    to the next). With ``out_dir`` the report is written there after every batch (and at the end)."""
    import torch

    from adapt.bench.provenance import provenance

    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("no CUDA device here", field="--device", hint="use --device cpu --tiny for a dry run")
    started = time.monotonic()
    say = progress or (lambda message: None)

    def note(message: str) -> None:
        say(f"[{time.monotonic() - started:5.1f} s] {message}")

    if device == "cuda":
        from adapt.bench.ceilings import measure_ceilings

        ceilings = measure_ceilings(copy_gib=2, reps=10, matmul_reps=5)
        note("ceilings measured")
    else:
        ceilings = {}
    rows: list[dict] = []
    layer_bytes: dict[str, dict] = {}
    prov = {**provenance(), "tiny_width": tiny, "kernels": kernels, "prompt_tokens": prompt_tokens,
            "decode_steps": decode_steps, "warmup_decode_steps": min(WARMUP_DECODE_STEPS, decode_steps)}
    floor = float((gates or {}).get("bench", {}).get("min_fraction_of_roofline", 0.0))

    def report_now():
        report = runtime_report(rows, models, batches, floor, prov, ceilings)
        report.metrics["layer_bytes"] = layer_bytes
        report.metrics["seconds"] = round(time.monotonic() - started, 1)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "runtime_bench.json").write_text(report.to_json())
            (out_dir / "runtime_bench.md").write_text(report.to_markdown())
        return report

    def batch_done(message: str) -> None:
        report_now()
        note(message)

    for number, model in enumerate(models):
        deadline = time.monotonic() + (started + budget_s - time.monotonic()) / (len(models) - number)
        directory = _scratch_directory(model, 0 if tiny else CHECKPOINT_BYTES[model])
        try:
            t0 = time.perf_counter()
            info = write_checkpoint(model, directory, device=device, tiny=tiny)
            layer_bytes[model] = {**info.__dict__, "write_s": round(time.perf_counter() - t0, 1),
                                  "directory": str(directory.parent)}
            note(f"{model}: checkpoint written in {layer_bytes[model]['write_s']} s under {directory.parent}")
            measure_model(model, directory, info, batches=batches, prompt_tokens=prompt_tokens,
                          decode_steps=decode_steps, kernels=kernels, device=device, deadline=deadline,
                          ceilings=ceilings, rows=rows, progress=batch_done)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return report_now()


def runtime_report(rows: list[dict], models: list[str], batches: list[int], floor: float, prov: dict,
                   ceilings: dict):
    """The StageReport of the rows so far: one line per (model, batch, phase), unmet while its row is missing."""
    from adapt.bench.acceptance import Criterion, benchmark_report, find_row

    def fraction(model: str, batch: int, phase: str):
        row = find_row(rows, model=model, batch=batch, phase=phase)
        return row["fraction_of_roofline"] if row else None

    criteria = [Criterion(f"{m} {ph} batch {b}: measured, fraction of roofline >= {floor:g}",
                          lambda rs, m=m, b=b, ph=ph: fraction(m, b, ph), ">=", floor)
                for m in models for b in batches for ph in ("prefill", "decode")]
    return benchmark_report("runtime", "Runtime at real width, reduced depth", rows, criteria,
                            provenance=prov, ceilings=ceilings)
