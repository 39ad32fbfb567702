"""Precision variants of a loaded model: storage formats per component, and fault injection test hooks.

Stage 5 compares the adapted path with a reference and, when a gate fails, moves one component
back at a time. The kernel families are chosen at load (``Engine.load(kernels=...)``); the formats
and faults below are applied to a built ``DecoderModel`` by ``configure`` (attributes of its layer
objects, all None / off by default, so a model never configured runs exactly as before).

Formats (``Formats``):

- ``experts``: 'as-stored' (the checkpoint's experts, decoded to the compute dtype) or 'fp8'
  (the online conversion the MoE kernel's FP8 workspace performs: MXFP4 folded to e4m3 with one
  power-of-two exponent per row, or bf16/fp32 experts rounded to e4m3 with one fp32 scale per row;
  expert inputs and SwiGLU outputs rounded to e4m3 per token row). On the torch path this is the
  numerics of the workspace path computed in torch.
- ``indexer``: 'bf16' (scores from the compute-dtype q and k) or 'fp8' (DeepSeek's own reference
  quantizes the indexer: q and k rotated by an orthonormal Hadamard matrix and rounded to e4m3 with
  one fp32 scale per row). The Triton indexer is FP8 by design; the torch path with 'fp8' is the
  same-quantization reference that separates a kernel bug from the format's own effect.
- ``kv_cache``: 'bf16' (the compute dtype) or 'fp8': every cached row (GQA k and v, MLA latent and
  rope key) is rounded to e4m3 with one fp32 scale per token row before it is stored, so attention
  reads exactly the values an e4m3 cache with per-token scales returns. The pools keep the compute
  dtype (the bytes saved are stage 2's business; this runtime only validates).

Faults (``Faults``) are explicit test hooks, each living in one component's adapted implementation
and active only while that component is adapted, so moving the component back removes it:

- ``expert_scale`` (layer, expert, factor): the online FP8 expert conversion dequantizes one
  expert's down projection ``factor`` times too large (experts 'fp8' only; torch and kernel paths).
- ``indexer_sign`` (layer, head): the Triton indexer reads one head weight with the wrong sign
  (indexer kernel only).
- ``drop_yarn_mscale``: the sparse MLA kernel is called with the plain qk_head_dim**-0.5 softmax
  scale, without YaRN's mscale**2 (attention kernel on MLA layers only).
- ``kv_scale`` factor: the FP8 KV cache dequantizes with a scale ``factor`` times the one it
  quantized with (kv_cache 'fp8' only).

``Faults.parse('expert_scale=1:3:1.03,kv_scale=1.5')`` reads the ``ADAPT_TEST_FAULTS`` form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from adapt.errors import InputError

FAULTS_ENV = "ADAPT_TEST_FAULTS"
FP8_MAX = 448.0  # largest finite e4m3fn value
EXPERT_FORMATS = ("as-stored", "fp8")
INDEXER_FORMATS = ("bf16", "fp8")
KV_FORMATS = ("bf16", "fp8")


@dataclass(frozen=True)
class Formats:
    """Storage format per component (see the module docstring)."""

    experts: str = "as-stored"
    indexer: str = "bf16"
    kv_cache: str = "bf16"

    def __post_init__(self):
        for name, allowed in (("experts", EXPERT_FORMATS), ("indexer", INDEXER_FORMATS), ("kv_cache", KV_FORMATS)):
            if getattr(self, name) not in allowed:
                raise InputError(f"unknown {name} format {getattr(self, name)!r}", field=name,
                                 hint=f"choose one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Faults:
    """Injected errors (test hooks); every field None / False means none."""

    expert_scale: tuple[int, int, float] | None = None
    indexer_sign: tuple[int, int] | None = None
    drop_yarn_mscale: bool = False
    kv_scale: float | None = None

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) not in (None, False) for f in fields(self))

    def describe(self) -> str:
        parts = []
        if self.expert_scale:
            parts.append("expert_scale={}:{}:{}".format(*self.expert_scale))
        if self.indexer_sign:
            parts.append("indexer_sign={}:{}".format(*self.indexer_sign))
        if self.drop_yarn_mscale:
            parts.append("drop_yarn_mscale")
        if self.kv_scale is not None:
            parts.append(f"kv_scale={self.kv_scale}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str | None) -> Faults:
        """'expert_scale=L:E:F,indexer_sign=L:H,drop_yarn_mscale,kv_scale=F' -> Faults ('' -> none)."""
        found: dict = {}
        for part in (text or "").split(","):
            part = part.strip()
            if not part:
                continue
            key, _, value = part.partition("=")
            try:
                if key == "expert_scale":
                    layer, expert, factor = value.split(":")
                    found[key] = (int(layer), int(expert), float(factor))
                elif key == "indexer_sign":
                    layer, head = value.split(":")
                    found[key] = (int(layer), int(head))
                elif key == "drop_yarn_mscale":
                    found[key] = True
                elif key == "kv_scale":
                    found[key] = float(value)
                else:
                    raise ValueError
            except ValueError:
                raise InputError(f"cannot read fault {part!r}", field=FAULTS_ENV,
                                 hint="expert_scale=L:E:F, indexer_sign=L:H, drop_yarn_mscale, kv_scale=F") from None
        return cls(**found)

    @classmethod
    def from_env(cls) -> Faults:
        return cls.parse(os.environ.get(FAULTS_ENV))


def round_fp8_rows(x: torch.Tensor, dequant_factor: float = 1.0) -> torch.Tensor:
    """x [..., D] -> the values of its e4m3 encoding with one fp32 scale per row (amax / 448), in x's dtype.

    dequant_factor multiplies the scale on the way back (1.0: a correct round trip).
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * (scale * dequant_factor)).to(x.dtype)


def configure(model, formats: Formats, faults: Faults | None = None) -> None:
    """Apply ``formats`` and ``faults`` to the layers of a built ``DecoderModel`` (in place)."""
    from adapt.runtime.attention import MLAAttention
    from adapt.runtime.moe import MoE

    faults = faults or Faults()
    kv_round = None
    if formats.kv_cache == "fp8":
        factor = 1.0 if faults.kv_scale is None else faults.kv_scale

        def kv_round(x):
            return round_fp8_rows(x, factor)

    for layer in model.layers:
        attention = layer.attention
        attention.kv_round = kv_round
        if isinstance(attention, MLAAttention):
            attention.index_fp8 = formats.indexer == "fp8"
            if formats.indexer == "bf16" and attention.indexer_path == "kernel":
                attention.indexer_path = "torch"  # the Triton indexer is FP8 by design
            sign = faults.indexer_sign
            attention.fault_index_head = sign[1] if sign and sign[0] == layer.index else None
            attention.fault_plain_scale = faults.drop_yarn_mscale
        if isinstance(layer.ffn, MoE):
            layer.ffn.expert_fp8 = formats.experts == "fp8"
            scale = faults.expert_scale
            layer.ffn.fault_expert_scale = (
                {scale[1]: scale[2]} if scale and scale[0] == layer.index and formats.experts == "fp8" else None
            )
