"""Greedy generation with adapt's kernels on, against transformers and against the torch reference path.

For each tiny model: 32 greedy tokens from transformers (fp32, eager); the runtime's torch
reference path and the runtime with ``--kernels`` (default: all families) are fed those tokens
(teacher forcing, ``Engine.follow``), so greedy generation of the runtime equals transformers'
exactly when every prediction matches. Reported: matches, the first divergent token, per-layer
hidden-state error of the kernel run against the reference run (``compare_captures``: rows whose
routing agreed), router top-k agreement, DSA selection overlap, wall time. On CPU the kernels run in the
Triton interpreter
(slow: minutes for the MoE kernel); on a GPU they run compiled.

Usage: ``python benchmarks/runtime_kernel_greedy.py [--models tiny-dsa,tiny-oss] [--kernels all]
[--tokens 32] [--device cuda] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from adapt.model.tiny import tiny_path  # noqa: E402
from adapt.runtime.engine import Engine  # noqa: E402
from adapt.runtime.model import compare_captures  # noqa: E402


def _prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (30, 9)]


@torch.no_grad()
def _hf_greedy(directory, prompt, steps):
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
        .float()
        .eval()
    )
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
    return tokens


def compare(name: str, kernels: str, steps: int, device: str) -> dict:
    directory = tiny_path(name)
    prompts = _prompts()
    ref = Engine.load(directory, dtype=torch.float32, device=device, max_tokens=512)
    try:
        hf = [_hf_greedy(directory, p, steps) for p in prompts]
        source = "transformers"
    except (ImportError, KeyError, ValueError) as exc:  # this transformers lacks the model type
        print(f"{name}: transformers cannot run it here ({exc}); following the torch reference path's tokens")
        hf = ref.generate(prompts, steps, stop_ids=()).tokens
        source = "runtime reference"
    ker = Engine.load(directory, dtype=torch.float32, device=device, kernels=kernels, max_tokens=512)
    with ref.capture(hidden_states=True, router=True, dsa_indices=True) as rc:
        t0 = time.perf_counter()
        ref_pred = ref.follow(prompts, hf).predictions
        ref_s = time.perf_counter() - t0
    with ker.capture(hidden_states=True, router=True, dsa_indices=True) as kc:
        t0 = time.perf_counter()
        ker_pred = ker.follow(prompts, hf).predictions
        ker_s = time.perf_counter() - t0
    misses = [(b, i) for b in range(len(prompts)) for i in range(steps) if ker_pred[b][i] != hf[b][i]]
    comparison = compare_captures(rc, kc)
    overlap = list(comparison.dsa_overlap.values())
    return {
        "model": name,
        "tokens_from": source,
        "kernels": ker.model.paths,
        "refusals": ker.model.kernel_refusals,
        "hf_equals_reference": hf == ref_pred,
        "kernel_equals_hf": hf == ker_pred,
        "mismatched_predictions": len(misses),
        "first_divergent_token": min(i for _, i in misses) if misses else None,
        "max_layer_error": max(comparison.layer_error.values()),
        "layer_error": comparison.layer_error,
        "agreeing_rows_min": min(comparison.agreeing_rows.values()),
        "router_rows_identical": min(comparison.router_agreement.values())
        if comparison.router_agreement
        else None,
        "dsa_overlap_mean": min(overlap) if overlap else None,
        "reference_s": ref_s,
        "kernel_s": ker_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-dsa,tiny-oss,tiny-qwen3")
    parser.add_argument("--kernels", default="all")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(f"device: {device_name}; triton interpreter: {os.environ.get('TRITON_INTERPRET') == '1'}")
    results = []
    for name in args.models.split(","):
        r = compare(name, args.kernels, args.tokens, args.device)
        results.append(r)
        print(
            f"{name}: {args.tokens} greedy tokens kernel==transformers {r['kernel_equals_hf']}, "
            f"reference==transformers {r['hf_equals_reference']}; "
            f"first divergent token {r['first_divergent_token']}; "
            f"max layer error {r['max_layer_error']:.2e} (rows with equal routing, min share "
            f"{r['agreeing_rows_min']:.2f}); router rows identical {r['router_rows_identical']}; "
            f"DSA overlap (worst layer mean) {r['dsa_overlap_mean']}; "
            f"time reference {r['reference_s']:.1f} s, kernels {r['kernel_s']:.1f} s; "
            f"refusals {r['refusals']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device_name, "results": results}, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
