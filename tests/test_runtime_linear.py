"""The runtime's ``layers.linear``: a one-row product runs as ``gemv.mv`` — in float32 ``torch.mv``,
exactly F.linear's bits (plain decode, speculative verify and the reference all agree on them); in
bfloat16 the compiled kernel where this CPU has one, F.linear's bits but for an element now and then one
bfloat16 step away (both sum in float32 and round once, in different orders) — for the shapes a
decoder has (odd sizes included); several rows, a bias, or ``row_blocked()`` keep F.linear itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import cpu_has
from shardwise.runtime import gemv
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
        if dtype == torch.float32:
            assert torch.equal(got, want), f"{dtype} {tuple(weight.shape)} x{shape}: {(got - want).abs().max()}"
            continue
        kernel = gemv.bf16_kernel()
        if kernel is not None:  # the product really is the kernel's
            assert torch.equal(got.reshape(-1), kernel(weight, x.reshape(-1)))
        step = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)  # one bfloat16 step
        step += 2.0**-20 * (x.float().abs() @ weight.float().abs().T)  # plus what float32 sums may differ by
        off = (got.float() - want.float()).abs()
        assert bool((off <= step).all()), f"{tuple(weight.shape)} x{shape}: {int((off > step).sum())} elements off"


def test_bfloat16_kernel_on_this_machine():
    """Where the CPU has AVX512-BF16 (this VM's Xeon) the compiled bfloat16 GEMV is built and used; its
    float32 sums rounded once agree with the float64 product of the same bfloat16 values to within
    one bfloat16 step."""
    if not cpu_has("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 one-row products stay torch.mv")
    kernel = gemv.bf16_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(300, 1000, generator=gen).bfloat16(), torch.randn(1000, generator=gen).bfloat16()
    exact = (weight.double() @ x.double())
    step = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7) + 2.0**-20 * (weight.double().abs() @ x.double().abs())
    assert bool(((kernel(weight, x).double() - exact).abs() <= step).all())


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

    with row_blocked(), Spy():  # inside the exact mode one row goes through F.linear (made row-invariant there)
        linear(one, weight)
    assert F.linear in calls and torch.mv not in calls
