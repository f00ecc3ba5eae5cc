"""The runtime's ``layers.linear``: a one-row product runs as ``torch.mv`` and must give exactly
F.linear's bits (plain decode, speculative verify and the reference all agree on them), in float32
and bfloat16, for the shapes a decoder has (odd sizes included); several rows, a bias, or
``row_blocked()`` keep F.linear itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.runtime.exact import row_blocked
from shardwise.runtime.layers import linear

SHAPES = [(5632, 2048), (2048, 5632), (640, 2048), (32000, 512), (193, 77), (1, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_one_row_equals_f_linear_bit_for_bit(dtype, out_features, in_features):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    for shape in [(1, in_features), (1, 1, in_features), (in_features,)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        got, want = linear(x, weight), F.linear(x, weight)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want), f"{dtype} {tuple(weight.shape)} x{shape}: {(got - want).abs().max()}"


def test_other_cases_are_f_linear():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    rows = torch.randn(3, 48, generator=gen)
    assert torch.equal(linear(rows, weight), F.linear(rows, weight))
    one = rows[:1]
    assert torch.equal(linear(one, weight, bias), F.linear(one, weight, bias))
    calls = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with row_blocked(), Spy():  # inside the exact mode one row goes through F.linear (padded to a block)
        linear(one, weight)
    assert F.linear in calls and torch.mv not in calls
