"""e4m3 quantisers, one per scale rule, each rule named.

- ``amax_scale``: scale = max(amax, 1e-4) / 448 (fp32). The largest element maps to +-448; an
  all-zero group gets a tiny scale instead of a division by zero. Used by the DSA indexer
  (queries and keys, per token) and the fp8 MLA latent cache (per group of 128).
- ``pow2_scale``: scale = 2**e with the smallest integer e such that amax <= 448 * 2**e. A power
  of two makes ``x * 2**-e`` exact before the e4m3 rounding, and the scale fits an E8M0 byte
  (DeepSeek-V3's ue8m0 scales). Used by the MoE activation quantiser.
"""

from __future__ import annotations

import math

import torch

from adapt.kernels.formats import FP8_DTYPE, FP8_E4M3_MAX

AMAX_FLOOR = 1e-4


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """The amax rule: fp32 max(amax, 1e-4) / 448, same shape as ``amax``."""
    return amax.float().clamp_min(AMAX_FLOOR) / FP8_E4M3_MAX


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two rule: fp32 2**e, smallest integer e with amax <= 448 * 2**e (e in [-126, 127])."""
    ratio = amax.double() / FP8_E4M3_MAX
    exps = torch.where(ratio > 0, torch.ceil(torch.log2(ratio.clamp_min(math.ldexp(1.0, -149)))),
                       torch.full_like(ratio, -126.0)).clamp(-126, 127)
    return torch.pow(2.0, exps).float()


def quantize_fp8_groups(x: torch.Tensor, group: int, rule=amax_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last axis of ``x`` to e4m3 with one fp32 scale per ``group`` elements.

    x: [..., D] (D divisible by ``group``); rule: ``amax_scale`` or ``pow2_scale``. Returns
    (values e4m3 [..., D], scales fp32 [..., D // group]) with ``values * scale ~= x``.
    """
    *lead, dim = x.shape
    if dim % group:
        raise ValueError(f"last dimension {dim} is not a multiple of the scale group {group}")
    grouped = x.float().reshape(*lead, dim // group, group)
    scale = rule(grouped.abs().amax(dim=-1))
    values = (grouped / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return values.reshape(*lead, dim), scale
