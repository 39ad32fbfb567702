"""The named FP8 scale rules against their definitions (golden values), and slot addressing."""

import math

import torch

from adapt.kernels.formats import FP8_E4M3_MAX, PAGE_SIZE, slots_of
from adapt.kernels.fp8 import amax_scale, pow2_scale, quantize_fp8_groups


def test_fp8_max_is_the_largest_finite_e4m3():
    assert FP8_E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max == 1.75 * 2**8


def test_pow2_scale_is_the_smallest_power_of_two_that_fits():
    amax = torch.tensor([448.0, 448.5, 896.0, 224.0, 1.0, 0.0, 3e38])
    # definition: smallest integer e with amax <= 448 * 2**e
    expected = [0, 1, 1, -1, math.ceil(math.log2(1 / 448)), -126, math.ceil(math.log2(3e38 / 448))]
    assert pow2_scale(amax).tolist() == [2.0**e for e in expected]


def test_amax_scale_maps_the_largest_element_to_448():
    expected = torch.tensor([448.0, 1.0, 1e-4]) / 448  # fp32, as the rule computes it; amax floored at 1e-4
    assert torch.equal(amax_scale(torch.tensor([448.0, 1.0, 0.0])), expected)


def test_group_quantiser_round_trips_within_e4m3_rounding():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for rule in (amax_scale, pow2_scale):
        values, scales = quantize_fp8_groups(x, 128, rule)
        back = (values.float().view(3, 2, 128) * scales.unsqueeze(-1)).view(3, 256)
        assert values.float().abs().max() <= FP8_E4M3_MAX
        assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-6).all()  # e4m3 keeps 3 mantissa bits


def test_slots_of_follows_the_block_table():
    table = torch.tensor([7, 2])
    positions = torch.tensor([0, 63, 64, 70])
    assert slots_of(table, positions).tolist() == [7 * PAGE_SIZE, 7 * PAGE_SIZE + 63, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 6]
