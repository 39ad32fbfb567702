"""MoE expert weights as a layer holds them: MXFP4 (gpt-oss tensor layout), the offline FP8 copy, and
the stacked bf16 / FP8-block experts of the other families (``StackedExperts``).

``MoEWeights``: w1 (gate + up) blocks uint8 [E, 2I, H/32, 16], scales uint8 [E, 2I, H/32];
w2 (down) blocks uint8 [E, H, I/32, 16], scales [E, H, I/32]; optional biases.
``FP8Weights.from_mxfp4``: every expert converted to e4m3 with a per-row exponent (the offline path).
The planar layout for the small-T MMA operand lives in ``moe_planar`` (``PlanarExperts``).
``StackedExperts``: w1 [E, 2I, H], w2 [E, H, I] either bf16 (Qwen3, Mixtral, GLM) or e4m3 with one
fp32 scale per 128 x 128 block (DeepSeek-V3/V3.2 and Kimi K2 ``weight_scale_inv``); the grouped
kernels read them as they are (``moe_gemm``, weight modes 3 and 4).

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


FP8_BLOCK = 128
"""Rows and columns of one FP8 weight scale block (DeepSeek-V3 ``weight_block_size`` [128, 128])."""


@dataclass
class StackedExperts:
    """One MoE layer's experts stored unquantized (bf16) or as FP8 with 128 x 128 block scales.

    w1 [E, 2I, H] (gate and up rows), w2 [E, H, I] (down): bfloat16, or float8_e4m3fn with
    w1_scale fp32 [E, ceil(2I/128), ceil(H/128)] and w2_scale fp32 [E, ceil(H/128), ceil(I/128)]
    (weight = e4m3 value * scale of its block, DeepSeek's ``weight_scale_inv``); w1_bias [E, 2I],
    w2_bias [E, H] or None; gate_up_interleaved as in ``MoEWeights``. The blocks tile the stacked
    [2I, H] matrix (a checkpoint's separate gate and up scales stack only when I is a multiple of 128:
    ``adapt.runtime.weights`` checks that at load).
    """

    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w1_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    gate_up_interleaved: bool = False

    def __post_init__(self):
        e, n1, h = self.w1.shape
        if self.w2.dim() != 3 or self.w2.shape[0] != e or self.w2.shape[1] != h or n1 != 2 * self.w2.shape[2]:
            raise InputError(
                f"w1 {tuple(self.w1.shape)} and w2 {tuple(self.w2.shape)} do not form an MoE layer",
                field="w2",
                hint="expect w1 [E, 2I, H] and w2 [E, H, I]",
            )
        fp8 = self.w1.dtype == torch.float8_e4m3fn
        if self.w1.dtype != self.w2.dtype or self.w1.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise InputError(
                f"stacked experts must be bfloat16 or float8_e4m3fn, got {self.w1.dtype} and {self.w2.dtype}",
                field="w1",
            )
        if fp8 != (self.w1_scale is not None) or fp8 != (self.w2_scale is not None):
            raise InputError("FP8 experts need block scales for w1 and w2 (bf16 experts none)", field="w1_scale")
        if fp8:
            for name, w, sc in (("w1_scale", self.w1, self.w1_scale), ("w2_scale", self.w2, self.w2_scale)):
                want = (e, -(-w.shape[1] // FP8_BLOCK), -(-w.shape[2] // FP8_BLOCK))
                if tuple(sc.shape) != want:
                    raise InputError(f"{name} {tuple(sc.shape)} does not match {want} blocks", field=name)

    @property
    def format(self) -> str:
        """'fp8_block' or 'bf16'."""
        return "fp8_block" if self.w1_scale is not None else "bf16"

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    def nbytes(self) -> int:
        ts = [self.w1, self.w2, self.w1_scale, self.w2_scale, self.w1_bias, self.w2_bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) as fp32 (FP8 values times their block scales)."""
        return _dequant_blocks(self.w1, self.w1_scale), _dequant_blocks(self.w2, self.w2_scale)


def fp8_block_copy(weights: StackedExperts, rule=None) -> StackedExperts:
    """bf16 experts -> an FP8-block copy: e4m3 values with one fp32 scale per 128 x 128 block by ``rule``
    (``adapt.kernels.fp8.amax_scale`` by default: amax / 448, an all-zero block 1e-4 / 448; or
    ``pow2_scale``: DeepSeek-V3.2's ue8m0 power-of-two scales). Made one expert at a time (transient:
    one expert in fp32)."""
    from adapt.kernels.fp8 import amax_scale

    rule = rule or amax_scale

    def quantize(w):
        e, n, k = w.shape
        q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty(e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK), dtype=torch.float32, device=w.device)
        for ex in range(e):
            wf = w[ex].float()
            pn, pk = scales.shape[1] * FP8_BLOCK - n, scales.shape[2] * FP8_BLOCK - k
            blocks = torch.nn.functional.pad(wf, (0, pk, 0, pn)).reshape(
                scales.shape[1], FP8_BLOCK, scales.shape[2], FP8_BLOCK)
            scales[ex] = rule(blocks.abs().amax(dim=(1, 3)))
            full = scales[ex].repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
            q[ex] = (wf / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q, scales

    q1, s1 = quantize(weights.w1)
    q2, s2 = quantize(weights.w2)
    return StackedExperts(q1, q2, s1, s2, weights.w1_bias, weights.w2_bias, weights.gate_up_interleaved)


def _dequant_blocks(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """e4m3 [E, N, K] times fp32 block scales [E, ceil(N/128), ceil(K/128)] -> fp32; bf16 -> fp32."""
    if scale is None:
        return w.float()
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)
    return w.float() * s[..., :k]


def moe_flops(tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """FLOPs of the routed expert GEMMs: 6 * T * k * H * I."""
    return 6 * tokens * top_k * hidden * intermediate


def mxfp4_expert_bytes(hidden: int, intermediate: int) -> int:
    """Bytes of one expert's three matrices in MXFP4 (codes + E8M0 scales): 3*H*I*17/32."""
    return math.ceil(3 * hidden * intermediate * 17 / 32)

