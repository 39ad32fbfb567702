"""Reduced-depth run of a synthetic checkpoint with DeepSeek-V3.2's widths: peak memory on this machine.

The checkpoint is generated on the fly into a temporary directory (removed afterwards) with
DeepSeek-V3.2's config.json (/work/shared/configs/DeepSeek-V3.2, real vocab 129,280, hidden 7,168,
256 routed experts of width 2,048) and two decoder layers only: layer 0 (dense MLP of width 18,432)
and layer 3 (MoE). Tensors are stored the way adapt's runtime must meet them:

- attention, indexer projections, dense and shared-expert MLPs: fp8 e4m3 with ue8m0 (power-of-two)
  ``weight_scale_inv`` per 128 x 128 block, as in the real checkpoint;
- routed experts: MXFP4 in the gpt-oss fused layout (``experts.gate_up_proj_blocks`` uint8
  [256, 4096, 224, 16] with gate rows then up rows, ``*_scales`` uint8 [256, 4096, 224],
  ``down_proj_blocks`` [256, 7168, 64, 16]), about 6.0 GB;
- embeddings, head, norms: bf16; router correction bias fp32.

The generator runs in a child process so that the measured process only loads and runs. The run:
``Engine.load(dir, layers=[0, 3])`` (torch reference paths, bf16 compute) and a greedy generation;
peak resident memory is ``getrusage(RUSAGE_SELF).ru_maxrss`` of that process.

Usage: ``.venv/bin/python benchmarks/runtime_reduced_depth.py [--prompt-tokens 32] [--new-tokens 4]``
(prints a table; the recorded result is in benchmarks/runtime/README.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

REAL_CONFIG = Path("/work/shared/configs/DeepSeek-V3.2/config.json")
LAYERS = (0, 3)
BLOCK = 128


def _fp8_linear(torch, out_features: int, in_features: int, gen) -> dict:
    """e4m3 weight with N(0, 1) entries and power-of-two block scales giving std ~ in_features**-0.5."""
    weight = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
    for row in range(0, out_features, 4096):  # chunks keep the fp32 temporary small
        chunk = torch.randn(min(4096, out_features - row), in_features, generator=gen)
        weight[row : row + chunk.shape[0]] = chunk.to(torch.float8_e4m3fn)
    scale = 2.0 ** round(-0.5 * torch.log2(torch.tensor(float(in_features))).item())
    scales = torch.full((-(-out_features // BLOCK), -(-in_features // BLOCK)), scale, dtype=torch.float32)
    return {"weight": weight, "weight_scale_inv": scales}


def _mxfp4(torch, experts: int, rows: int, k: int, gen) -> tuple:
    """Random E2M1 codes and E8M0 scales 2**-7 .. 2**-5 (weights of std ~0.01)."""
    blocks = torch.randint(0, 256, (experts, rows, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 123, (experts, rows, k // 32), dtype=torch.uint8, generator=gen)
    return blocks, scales


def generate_checkpoint(directory: Path) -> dict:
    """Write config.json and three shards; returns {shard: bytes}."""
    import torch
    from safetensors.torch import save_file

    config = json.loads(REAL_CONFIG.read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, nope, rope, v = (
        config["num_attention_heads"],
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
        config["v_head_dim"],
    )
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    experts, width = config["n_routed_experts"], config["moe_intermediate_size"]
    gen = torch.Generator().manual_seed(0)
    weight_map, sizes = {}, {}

    def save(shard: str, tensors: dict) -> None:
        save_file(tensors, directory / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        sizes[shard] = (directory / shard).stat().st_size

    save(
        "outer.safetensors",
        {
            "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen)).to(torch.bfloat16),
            "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(torch.bfloat16),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        },
    )
    for layer in LAYERS:
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        tensors = {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            a + "q_a_layernorm.weight": torch.ones(q_lora, dtype=torch.bfloat16),
            a + "kv_a_layernorm.weight": torch.ones(kv_lora, dtype=torch.bfloat16),
            a + "indexer.k_norm.weight": torch.ones(config["index_head_dim"], dtype=torch.bfloat16),
            a + "indexer.k_norm.bias": torch.zeros(config["index_head_dim"], dtype=torch.bfloat16),
            a + "indexer.weights_proj.weight": (
                torch.randn(config["index_n_heads"], hidden, generator=gen) * hidden**-0.5
            ).to(torch.bfloat16),
        }
        linears = {
            a + "q_a_proj": (q_lora, hidden),
            a + "q_b_proj": (heads * (nope + rope), q_lora),
            a + "kv_a_proj_with_mqa": (kv_lora + rope, hidden),
            a + "kv_b_proj": (heads * (nope + v), kv_lora),
            a + "o_proj": (hidden, heads * v),
            a + "indexer.wq_b": (config["index_n_heads"] * config["index_head_dim"], q_lora),
            a + "indexer.wk": (config["index_head_dim"], hidden),
        }
        if layer < config["first_k_dense_replace"]:
            inter = config["intermediate_size"]
            linears.update(
                {
                    p + "mlp.gate_proj": (inter, hidden),
                    p + "mlp.up_proj": (inter, hidden),
                    p + "mlp.down_proj": (hidden, inter),
                }
            )
        else:
            linears.update(
                {
                    p + "mlp.shared_experts.gate_proj": (width, hidden),
                    p + "mlp.shared_experts.up_proj": (width, hidden),
                    p + "mlp.shared_experts.down_proj": (hidden, width),
                }
            )
            tensors[p + "mlp.gate.weight"] = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(
                torch.bfloat16
            )
            tensors[p + "mlp.gate.e_score_correction_bias"] = torch.randn(experts, generator=gen) * 0.01
            e = p + "mlp.experts."
            tensors[e + "gate_up_proj_blocks"], tensors[e + "gate_up_proj_scales"] = _mxfp4(
                torch, experts, 2 * width, hidden, gen
            )
            tensors[e + "down_proj_blocks"], tensors[e + "down_proj_scales"] = _mxfp4(
                torch, experts, hidden, width, gen
            )
        for name, (rows, cols) in linears.items():
            for suffix, tensor in _fp8_linear(torch, rows, cols, gen).items():
                tensors[f"{name}.{suffix}"] = tensor
        save(f"layer-{layer}.safetensors", tensors)
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return sizes


def run_engine(directory: Path, prompt_tokens: int, new_tokens: int, out: dict) -> None:
    """Load layers 0 and 3, generate, and report timings and peak RSS (in the calling process)."""
    import torch

    from adapt.runtime.engine import Engine

    torch.manual_seed(0)
    t0 = time.perf_counter()
    engine = Engine.load(
        directory, layers=list(LAYERS), dtype=torch.bfloat16, max_tokens=prompt_tokens + new_tokens + 64
    )
    load_s = time.perf_counter() - t0
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    prompt = torch.randint(0, engine.spec.vocab, (prompt_tokens,)).tolist()
    with engine.capture(hidden_states=False, router=True) as cap:
        result = engine.generate([prompt], new_tokens, stop_ids=())
    experts_hit = sorted({int(e) for steps in cap.router.values() for ids, _ in steps for e in ids.flatten()})
    out.update(
        {
            "load_s": load_s,
            "bytes_read": engine.bytes_read,
            "peak_rss_after_load": rss_after_load,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "prefill_tokens": result.timing.prefill_tokens,
            "prefill_s": result.timing.prefill_s,
            "decode_tokens": result.timing.decode_tokens,
            "decode_s": result.timing.decode_s,
            "tokens": result.tokens[0],
            "experts_hit": len(experts_hit),
            "expert_bytes": sum(
                layer.ffn.experts.nbytes for layer in engine.model.layers if hasattr(layer.ffn, "experts")
            ),
            "cache_bytes": engine.cache.nbytes,
        }
    )


def _child(target, args, queue):
    result: dict = {}
    target(*args, result) if target is run_engine else result.update(sizes=target(*args))
    queue.put(result)


def _in_child(target, *args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    args = parser.parse_args()
    directory = args.keep or Path(tempfile.mkdtemp(prefix="adapt-v32-reduced-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        generated = _in_child(generate_checkpoint, directory)
        gen_s = time.perf_counter() - t0
        run = _in_child(run_engine, directory, args.prompt_tokens, args.new_tokens)
    finally:
        if args.keep is None:
            shutil.rmtree(directory, ignore_errors=True)
    gib = 2**30
    rows = [
        ("machine", f"{platform.machine()}, {multiprocessing.cpu_count()} CPUs"),
        (
            "checkpoint bytes (layers 0, 3 + embeddings/head)",
            f"{sum(generated['sizes'].values()) / gib:.2f} GiB",
        ),
        ("generation time", f"{gen_s:.0f} s (child process)"),
        ("tensor bytes read by the engine", f"{run['bytes_read'] / gib:.2f} GiB"),
        ("routed expert bytes held (MXFP4 packed)", f"{run['expert_bytes'] / gib:.2f} GiB"),
        ("KV cache bytes", f"{run['cache_bytes'] / 2**20:.1f} MiB"),
        ("load time", f"{run['load_s']:.1f} s"),
        ("peak RSS after load", f"{run['peak_rss_after_load'] / gib:.2f} GiB"),
        ("peak RSS (load + generate)", f"{run['peak_rss'] / gib:.2f} GiB"),
        ("prefill", f"{run['prefill_tokens']} tokens in {run['prefill_s']:.1f} s"),
        ("decode", f"{run['decode_tokens']} tokens in {run['decode_s']:.1f} s"),
        ("distinct experts used", str(run["experts_hit"])),
        ("generated tokens", str(run["tokens"])),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
