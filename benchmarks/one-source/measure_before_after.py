"""Numbers that must not change when code moves: engine greedy tokens and prefill logits on the
tiny models (torch and kernel paths, float32), and stage 3's metrics for the given models.

    PYTHONPATH=. python benchmarks/one-source/measure_before_after.py out.json deepseek-v3.2 gpt-oss-120b
    PYTHONPATH=<tree> python measure_before_after.py out.json --device cuda --target h200 \\
        deepseek-v3.2 gpt-oss-120b tiny-dsa tiny-oss

Stage-3 models are presets, model directories, or tiny model names (built here, then checked as
directories). Only APIs that every compared tree has are used (``build_tiny``, ``Engine.load``,
``Engine.generate``, ``Engine.step``, ``run_kernel_tests``), so the same file measures an export
of an older commit too.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from adapt.runtime.engine import prepare_triton

prepare_triton()

import torch  # noqa: E402

from adapt.model.tiny import build_tiny  # noqa: E402
from adapt.runtime.engine import Engine  # noqa: E402
from adapt.stages.kernels import run_kernel_tests  # noqa: E402

TINY = ("tiny-dsa", "tiny-oss", "tiny-qwen3")


def main(out_path: str, models: list[str], device: str, target: str, engine_models: list[str]) -> None:
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    root = Path(tempfile.mkdtemp())
    built = {name: build_tiny(name, root / name) for name in TINY}
    for name in engine_models:
        directory = built[name]
        for kernels in ("none", "all"):
            t0 = time.perf_counter()
            engine = Engine.load(directory, kernels=kernels, dtype=torch.float32, max_tokens=512, device=device)
            tokens = engine.generate([[1, 5, 9, 17, 33, 65, 2, 4], [3, 7, 11]], 8).tokens
            fresh = Engine.load(directory, kernels=kernels, dtype=torch.float32, max_tokens=512, device=device)
            logits = fresh.step(fresh.start(1), [[1, 5, 9, 17, 33, 65, 2, 4]], all_logits=True)[0].double()
            out[f"{name}/{kernels}"] = {"tokens": tokens, "logits_sum": float(logits.sum()),
                                         "logits_abs_sum": float(logits.abs().sum()),
                                         "seconds": round(time.perf_counter() - t0, 1)}
            print(name, kernels, out[f"{name}/{kernels}"], flush=True)
            Path(out_path).write_text(json.dumps(out, indent=1, default=str))
    for model in models:
        report = run_kernel_tests(str(built.get(model, model)), target, device=device)
        out[f"stage3/{model}"] = {"verdict": report.verdict, "metrics": report.metrics,
                                  "checks": report.tables.get("kernel checks")}
        print("stage3", model, report.verdict, json.dumps(report.metrics), flush=True)
        Path(out_path).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="*", help="stage-3 models: presets, directories or tiny model names")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--target", default="cpu", help="stage 3's target (cpu, h200, ...)")
    ap.add_argument("--engine", nargs="*", default=list(TINY), help="tiny models whose engine runs are measured")
    args = ap.parse_args()
    main(args.out, args.models, args.device, args.target, args.engine)
