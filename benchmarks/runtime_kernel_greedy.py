"""Greedy generation with adapt's kernels on, against transformers and against the torch reference path.

For each tiny model: 32 greedy tokens from transformers (fp32, eager), from the runtime's torch
reference path and from the runtime with ``--kernels`` (default: all families); per-layer
hidden-state error of the kernel run against the reference run (max over steps of
||kernel - ref|| / ||ref||, both runs fed the same tokens while they agree), router top-k
agreement, DSA selection overlap, and wall time. On CPU the kernels run in the Triton interpreter
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


def _prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (30, 9)]


@torch.no_grad()
def _hf_greedy(directory, prompt, steps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").float().eval()
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
    return tokens


def compare(name: str, kernels: str, steps: int, device: str) -> dict:
    directory = tiny_path(name)
    prompts = _prompts()
    hf = [_hf_greedy(directory, p, steps) for p in prompts]
    ref = Engine.load(directory, dtype=torch.float32, device=device, max_tokens=512)
    ker = Engine.load(directory, dtype=torch.float32, device=device, kernels=kernels, max_tokens=512)
    with ref.capture(hidden_states=True, router=True, dsa_indices=True) as rc:
        t0 = time.perf_counter()
        ref_out = ref.generate(prompts, steps, stop_ids=())
        ref_s = time.perf_counter() - t0
    with ker.capture(hidden_states=True, router=True, dsa_indices=True) as kc:
        t0 = time.perf_counter()
        ker_out = ker.generate(prompts, steps, stop_ids=())
        ker_s = time.perf_counter() - t0
    agree_steps = 1 + next((i for i in range(steps) if any(ker_out.tokens[b][i] != ref_out.tokens[b][i]
                                                           for b in range(len(prompts)))), steps)
    layer_err = {}
    for layer, outs in rc.hidden_states.items():
        errs = [float((k.float() - r.float()).norm() / r.float().norm())
                for r, k in zip(outs[:agree_steps], kc.hidden_states[layer][:agree_steps], strict=True)]
        layer_err[layer] = max(errs)
    router = []
    for layer, outs in rc.router.items():
        for (ri, _), (ki, _) in zip(outs[:agree_steps], kc.router[layer][:agree_steps], strict=True):
            router.append(float((ri.sort(-1).values == ki.sort(-1).values).all(-1).float().mean()))
    overlap = []
    for layer, outs in rc.dsa_indices.items():
        for r, k in zip(outs[:agree_steps], kc.dsa_indices[layer][:agree_steps], strict=True):
            for row_r, row_k in zip(r.tolist(), k.tolist(), strict=True):
                a, b = {i for i in row_r if i >= 0}, {i for i in row_k if i >= 0}
                overlap.append(len(a & b) / max(len(a), 1))
    return {
        "model": name, "kernels": ker.model.paths, "refusals": ker.model.kernel_refusals,
        "hf_equals_reference": hf == ref_out.tokens, "kernel_equals_hf": hf == ker_out.tokens,
        "max_layer_error": max(layer_err.values()), "layer_error": layer_err,
        "router_rows_identical": min(router) if router else None,
        "dsa_overlap_min": min(overlap) if overlap else None,
        "dsa_overlap_mean": sum(overlap) / len(overlap) if overlap else None,
        "reference_s": ref_s, "kernel_s": ker_s,
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
        print(f"{name}: {args.tokens} greedy tokens kernel==transformers {r['kernel_equals_hf']}, "
              f"reference==transformers {r['hf_equals_reference']}; max layer error {r['max_layer_error']:.2e}; "
              f"router rows identical {r['router_rows_identical']}; DSA overlap min {r['dsa_overlap_min']} "
              f"mean {r['dsa_overlap_mean']}; time reference {r['reference_s']:.1f} s, kernels {r['kernel_s']:.1f} s; "
              f"refusals {r['refusals']}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device_name, "results": results}, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
