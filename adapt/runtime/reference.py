"""What the torch reference paths of adapt.runtime.hybrid and adapt.runtime.multimodal share:
reading a model directory (ModelSpec from config.json, every tensor of its safetensors files)
and looking tensors up by checkpoint name with a one-line error when one is missing."""

from __future__ import annotations

from pathlib import Path

import torch

from adapt.errors import InputError
from adapt.model.spec import ModelSpec, load_spec


class ReferenceModel:
    """Base of the reference models: ``spec``, ``w`` (name -> tensor in the compute dtype) and
    ``layer_ids`` (the decoder layers that run; each keeps its own index)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], layers: list[int] | None,
                 dtype: torch.dtype):
        self.spec, self.dtype = spec, dtype
        self.w = {self._canonical(name): t.to(dtype) for name, t in weights.items()}
        self.layer_ids = list(range(spec.num_layers)) if layers is None else list(layers)
        self.captured: list[torch.Tensor] | None = None  # a list: forward appends each layer's output (fp32)

    @staticmethod
    def _canonical(name: str) -> str:
        """A checkpoint tensor name as this model looks it up (subclasses map aliases)."""
        return name

    @classmethod
    def from_dir(cls, model_dir: str | Path, layers: list[int] | None = None,
                 dtype: torch.dtype = torch.float32):
        """Spec from config.json, weights from every *.safetensors file of ``model_dir``."""
        from safetensors.torch import load_file

        directory = Path(model_dir)
        spec = load_spec(directory)
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(directory.glob("*.safetensors")):
            weights.update(load_file(str(path)))
        return cls(spec, weights, layers, dtype)

    def _get(self, name: str) -> torch.Tensor:
        tensor = self.w.get(name)
        if tensor is None:
            raise InputError(f"tensor {name!r} is missing", file=self.spec.source,
                             hint="the checkpoint does not match config.json")
        return tensor
