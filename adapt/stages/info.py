"""`adapt info`: what a model is: its spec, parameters, bytes by component, quantization.

Reads config.json and, for a directory with safetensors shards, their headers only.
Writes no report: it is a look, not a gate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapt.model.spec import COMPONENTS, ModelSpec, load_spec


def has_weights(model: str) -> bool:
    """True when ``model`` is a directory holding safetensors shards or an index."""
    path = Path(model)
    return path.is_dir() and (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists())


def describe_model(model: str, progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Spec, parameter counts (logical), checkpoint bytes by component and layer, cross-check findings.

    progress(done, total, shard_name) is called per shard while headers are read.
    """
    spec: ModelSpec = load_spec(model)
    counts = spec.param_counts()
    attention_kinds = sorted({layer.attention.kind for layer in spec.layers})
    out: dict[str, Any] = {
        "model": model,
        "model_type": spec.model_type,
        "spec_hash": spec.spec_hash(),
        "layers": spec.num_layers,
        "moe_layers": len(spec.moe_layers),
        "mtp_layers": len(spec.mtp_layers),
        "attention": attention_kinds,
        "parameters": {
            "total": counts.total, "active": counts.active,
            "total_with_mtp": counts.total_with_mtp, "active_with_mtp": counts.active_with_mtp,
            "per_component": {c: counts.per_component.get(c, 0) for c in COMPONENTS},
        },
        "quantization": {c: spec.quant.format_of(c).method if c != "mtp" else "as the decoder layers"
                         for c in COMPONENTS if counts.per_component.get(c)},
        "estimated_bytes": spec.weight_bytes(),
        "spec": spec.to_dict(),
    }
    if has_weights(model):
        from adapt.model.checkpoint import Checkpoint

        checkpoint = Checkpoint.open(model, progress=progress)
        findings = checkpoint.check_against(spec)
        out["checkpoint"] = {
            "shards": len(checkpoint.shards),
            "tensors": len(checkpoint.tensors),
            "total_bytes": checkpoint.total_bytes,
            "bytes_by_component": checkpoint.bytes_by_component(),
            "bytes_by_layer": {str(k): v for k, v in checkpoint.bytes_by_layer().items()},
            "findings": [{"severity": f.severity, "code": f.code, "message": f.message} for f in findings],
        }
    return out
