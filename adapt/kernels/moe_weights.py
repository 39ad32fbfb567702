"""MoE expert weights as a layer holds them: MXFP4 (gpt-oss tensor layout) and the offline FP8 copy.

``MoEWeights``: w1 (gate + up) blocks uint8 [E, 2I, H/32, 16], scales uint8 [E, 2I, H/32];
w2 (down) blocks uint8 [E, H, I/32, 16], scales [E, H, I/32]; optional biases.
``FP8Weights.from_mxfp4``: every expert converted to e4m3 with a per-row exponent (the offline path).
The planar layout for the small-T MMA operand lives in ``moe_planar`` (``PlanarExperts``).

Sizes: ``mxfp4_expert_bytes`` (one expert, codes + scales) and ``moe_flops`` (the routed GEMMs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adapt.errors import InputError
from adapt.kernels.mxfp4 import check_scales, from_gpt_oss_blocks, mxfp4_to_fp8


@dataclass
class MoEWeights:
    """One MoE layer's expert weights in MXFP4 (gpt-oss tensor layout).

    w1_blocks uint8 [E, 2I, H/32, 16], w1_scales uint8 [E, 2I, H/32]  (gate and up rows)
    w2_blocks uint8 [E, H, I/32, 16],  w2_scales uint8 [E, H, I/32]   (down)
    w1_bias [E, 2I] | None, w2_bias [E, H] | None (float)
    gate_up_interleaved: True for gpt-oss (row 2i gate, 2i+1 up), False for gate rows then up rows.
    """

    w1_blocks: torch.Tensor
    w1_scales: torch.Tensor
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor
    w1_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    gate_up_interleaved: bool = False

    def __post_init__(self):
        e, n1, kb1, _ = self.w1_blocks.shape
        e2, h, kb2, _ = self.w2_blocks.shape
        if e2 != e or n1 % 2 or kb2 * 32 * 2 != n1 or kb1 * 32 != h:
            raise InputError(
                f"w1 blocks {tuple(self.w1_blocks.shape)} and w2 blocks {tuple(self.w2_blocks.shape)} do not "
                "form an MoE layer",
                field="w2_blocks",
                hint="expect w1 [E, 2I, H/32, 16] and w2 [E, H, I/32, 16]",
            )
        if tuple(self.w1_scales.shape) != (e, n1, kb1) or tuple(self.w2_scales.shape) != (e, h, kb2):
            raise InputError("MXFP4 scales do not match their blocks", field="w1_scales")

    @property
    def n_experts(self) -> int:
        return self.w1_blocks.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2_blocks.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1_blocks.shape[1] // 2

    @property
    def w1_packed(self) -> torch.Tensor:
        return from_gpt_oss_blocks(self.w1_blocks)

    @property
    def w2_packed(self) -> torch.Tensor:
        return from_gpt_oss_blocks(self.w2_blocks)

    def nbytes(self) -> int:
        """Bytes of the expert weights as stored (blocks, scales, biases)."""
        ts = [self.w1_blocks, self.w1_scales, self.w2_blocks, self.w2_scales, self.w1_bias, self.w2_bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def validate(self) -> None:
        """Reject NaN (0xFF) E8M0 scales with ``InputError``. Synchronises; call at load time."""
        check_scales(self.w1_scales, "w1_scales")
        check_scales(self.w2_scales, "w2_scales")


@dataclass
class FP8Weights:
    """One layer's experts converted to e4m3 ahead of time (the offline path).

    w1 e4m3 [E, 2I, H], w1_exp int32 [E, 2I]; w2 e4m3 [E, H, I], w2_exp int32 [E, H]:
    weight = w * 2**exp per row. lost: int64 [1], elements that lost bits in the conversion.
    """

    w1: torch.Tensor
    w1_exp: torch.Tensor
    w2: torch.Tensor
    w2_exp: torch.Tensor
    w1_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    gate_up_interleaved: bool
    lost: torch.Tensor

    @classmethod
    def from_mxfp4(cls, weights: MoEWeights, validate: bool = True) -> FP8Weights:
        """Convert every expert (per-row exponent fold, the same rule as the fused fp8 path)."""
        a = mxfp4_to_fp8(weights.w1_packed, weights.w1_scales, group_k=None, validate=validate)
        b = mxfp4_to_fp8(weights.w2_packed, weights.w2_scales, group_k=None, validate=validate)
        return cls(
            a.values,
            a.exponents[..., 0].contiguous(),
            b.values,
            b.exponents[..., 0].contiguous(),
            weights.w1_bias,
            weights.w2_bias,
            weights.gate_up_interleaved,
            a.lost + b.lost,
        )

    def nbytes(self) -> int:
        ts = [self.w1, self.w1_exp, self.w2, self.w2_exp, self.w1_bias, self.w2_bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)



def moe_flops(tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """FLOPs of the routed expert GEMMs: 6 * T * k * H * I."""
    return 6 * tokens * top_k * hidden * intermediate


def mxfp4_expert_bytes(hidden: int, intermediate: int) -> int:
    """Bytes of one expert's three matrices in MXFP4 (codes + E8M0 scales): 3*H*I*17/32."""
    return math.ceil(3 * hidden * intermediate * 17 / 32)

