"""Time reading the safetensors headers of a Kimi-K2-sized checkpoint.

Writes a synthetic checkpoint into a temporary directory: real Kimi K2 tensor names and shapes
(adapt's expected-tensor generator applied to the Kimi K2 architecture), split over 200 shards
with an index. Each shard holds its header and a sparse data area (the file is extended to its
full length without writing data), so ~1 TB of tensors costs a few MB of disk. Then times
``Checkpoint.open`` and the grouping, selection and cross-check calls, prints the results and
removes the directory.

Layouts:
  kimi-k2-fp8   Kimi-K2-Instruct: every projection fp8 with a 128x128 weight_scale_inv
  kimi-k2-int4  Kimi-K2-Thinking: routed experts int4 (weight_packed, weight_scale, weight_shape)

Usage: .venv/bin/python benchmarks/bench_checkpoint_headers.py [--layout NAME] [--shards 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adapt.model.checkpoint import DTYPE_BITS, INDEX_FILE, Checkpoint, expected_tensors
from adapt.model.spec import AttentionSpec, FFNSpec, LayerSpec, ModelSpec, QuantFormat, QuantSpec, RopeSpec


def kimi_k2_spec(layout: str) -> ModelSpec:
    """Kimi K2 architecture. Values from moonshotai/Kimi-K2-Instruct config.json: hidden 7168,
    61 layers (first_k_dense_replace 1), 64 MLA heads, q_lora_rank 1536, kv_lora_rank 512,
    qk_nope/rope/v head dims 128/64/128, 384 routed experts of width 2048, 1 shared expert,
    dense width 18432, vocab 163840, no MTP layer."""
    att = AttentionSpec("mla", 64, 64, 192, 128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64)
    moe = FFNSpec("moe", num_experts=384, top_k=8, expert_intermediate=2048, num_shared_experts=1,
                  shared_intermediate=2048, correction_bias=True, scoring="sigmoid")
    dense = FFNSpec("dense", intermediate=18432)
    layers = tuple(LayerSpec(i, att, dense if i == 0 else moe) for i in range(61))
    if layout == "kimi-k2-fp8":
        fp8 = QuantFormat("fp8_block", (128, 128), "fp32")
        quant = QuantSpec(QuantFormat("bf16"), {c: fp8 for c in ("attention", "dense_mlp", "routed_experts",
                                                                 "shared_experts")}, source="fp8")
    else:
        quant = QuantSpec(QuantFormat("bf16"), {"routed_experts": QuantFormat("int4", (1, 32), "bf16")},
                          source="compressed-tensors")
    return ModelSpec("kimi_k2", layout, 7168, 163840, False, 262144, 1e-6, "bfloat16", RopeSpec("yarn", 5e4),
                     quant, layers)


def write_checkpoint(directory: Path, spec: ModelSpec, shards: int) -> tuple[int, int]:
    """Header-only shards plus an index; returns (tensors, tensor bytes)."""
    expected = expected_tensors(spec)
    names = list(expected)
    per_shard = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names[s * per_shard:(s + 1) * per_shard]:
            want = expected[name]
            dtype = want.dtype or "BF16"
            size = math.prod(want.shape) * DTYPE_BITS[dtype] // 8
            header[name] = {"dtype": dtype, "shape": list(want.shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = shard
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(directory / shard, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            fh.truncate(8 + len(raw) + offset)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index))
    return len(names), total


def timed(fn, repeat: int) -> tuple[float, object]:
    """Median wall time in seconds over ``repeat`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run(layout: str, shards: int, repeat: int) -> None:
    spec = kimi_k2_spec(layout)
    directory = Path(tempfile.mkdtemp(prefix="adapt-bench-ckpt-"))
    try:
        start = time.perf_counter()
        count, total = write_checkpoint(directory, spec, shards)
        written = time.perf_counter() - start
        open_s, ckpt = timed(lambda: Checkpoint.open(directory), repeat)
        component_s, by_component = timed(ckpt.bytes_by_component, repeat)
        layer_s, _ = timed(ckpt.bytes_by_layer, repeat)
        select_s, _ = timed(lambda: ckpt.select([0, 3, 60]), repeat)
        check_s, findings = timed(lambda: ckpt.check_against(spec), repeat)
        assert len(ckpt.tensors) == count and ckpt.total_bytes == total and findings == []
        print(f"layout {layout}: {count:,} tensors in {shards} shards, {total / 2**30:,.1f} GiB of (sparse) "
              f"tensor data; written in {written:.2f} s")
        print(f"  Checkpoint.open          {open_s:7.3f} s  (median of {repeat}, page cache warm)")
        print(f"  bytes_by_component       {component_s:7.3f} s")
        print(f"  bytes_by_layer           {layer_s:7.3f} s")
        print(f"  select([0, 3, 60])       {select_s:7.3f} s")
        print(f"  check_against(spec)      {check_s:7.3f} s  ({len(findings)} findings)")
        shares = ", ".join(f"{k} {v / 2**30:,.1f}" for k, v in by_component.items() if v)
        print(f"  GiB by component: {shares}")
    finally:
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("kimi-k2-fp8", "kimi-k2-int4", "both"), default="both")
    parser.add_argument("--shards", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"date {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}  "
          f"machine {platform.node()} {platform.processor() or platform.machine()} "
          f"{os.cpu_count()} CPUs  python {sys.version.split()[0]}")
    layouts = ("kimi-k2-fp8", "kimi-k2-int4") if args.layout == "both" else (args.layout,)
    for layout in layouts:
        run(layout, args.shards, args.repeat)


if __name__ == "__main__":
    main()
