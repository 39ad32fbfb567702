"""Kernel-vs-twin comparison with the output's last rounding forgiven."""

import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def twin_rel(got: torch.Tensor, twin: torch.Tensor, max_flip_share: float = 0.01) -> float:
    """||got - twin|| / ||twin|| for a kernel against its twin on the same arithmetic, where elements of a
    bf16 / fp16 output that differ by one unit in the last place count as equal, as long as they are at most
    ``max_flip_share`` of the elements (else the plain error is returned).

    Why: the interpreter computes exp with numpy and the twin with torch; the two differ in the last bit of
    fp32 for many inputs, and torch's result also depends on the CPU's vector ISA (AVX2 / AVX-512). Where a
    bf16 rounding boundary lies between them, one output element moves by one bf16 unit: that is the fp32
    rounding the twin tolerance allows, not a different computation. Anything larger still counts in full.
    """
    g, t = got.double().cpu(), twin.double().cpu()
    plain = float((g - t).norm() / t.norm())
    bits = MANTISSA_BITS.get(got.dtype)
    if bits is None or got.dtype != twin.dtype:
        return plain
    _, exp = torch.frexp(torch.maximum(g.abs(), t.abs()))
    ulp = torch.ldexp(torch.ones_like(g), exp - 1 - bits)
    diff = (g - t).abs()
    flips = (diff > 0) & (diff <= ulp)
    if flips.sum() > max_flip_share * g.numel():
        return plain
    return float(torch.where(flips, 0.0, g - t).norm() / t.norm())
