"""Numbers that must not change when code moves: engine greedy tokens and prefill logits on the
tiny models (torch and kernel paths, float32), and stage 3's metrics for the given presets.

    PYTHONPATH=. python benchmarks/one-source/measure_before_after.py out.json deepseek-v3.2 gpt-oss-120b
"""

import json
import sys
import tempfile
from pathlib import Path

from adapt.runtime.engine import prepare_triton

prepare_triton()

import torch  # noqa: E402

from adapt.model.tiny import build_tiny  # noqa: E402
from adapt.runtime.engine import Engine  # noqa: E402
from adapt.stages.kernels import run_kernel_tests  # noqa: E402


def main(out_path: str, models: list[str]) -> None:
    out = {}
    root = Path(tempfile.mkdtemp())
    for name in ("tiny-dsa", "tiny-oss", "tiny-qwen3"):
        directory = build_tiny(name, root / name)
        for kernels in ("none", "all"):
            engine = Engine.load(directory, kernels=kernels, dtype=torch.float32, max_tokens=512)
            tokens = engine.generate([[1, 5, 9, 17, 33, 65, 2, 4], [3, 7, 11]], 8).tokens
            fresh = Engine.load(directory, kernels=kernels, dtype=torch.float32, max_tokens=512)
            logits = fresh.step(fresh.start(1), [[1, 5, 9, 17, 33, 65, 2, 4]], all_logits=True)[0].double()
            out[f"{name}/{kernels}"] = {"tokens": tokens, "logits_sum": float(logits.sum()),
                                         "logits_abs_sum": float(logits.abs().sum())}
            print(name, kernels, out[f"{name}/{kernels}"], flush=True)
    for model in models:
        report = run_kernel_tests(model, "cpu", device="cpu")
        out[f"stage3/{model}"] = {"verdict": report.verdict, "metrics": report.metrics}
        print("stage3", model, report.verdict, json.dumps(report.metrics), flush=True)
    Path(out_path).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
