"""The fixed-order float32 product ``exact.row_blocked()`` runs on CPU (``csrc/row_linear.cpp``): every
row's result is the same bits whatever else shares the call (rows before it, after it, how many, how
many threads), within float32 rounding of the float64 product, for widths with and without a 16-lane
tail and row counts crossing the kernel's 4-row tiles and 64-row chunks; under ``row_blocked()`` float32
products run it (bias added after), other dtypes keep the padded ``F.linear``. The speculative and
serving tests hold the end-to-end consequence (verify passes equal single steps, bit for bit)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from shardwise.runtime import exact
from shardwise.runtime.exact import row_blocked


def _kernel():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "avx512f" not in flags:
        pytest.skip("this CPU has no AVX-512F: row_blocked() pads every product to whole row blocks")
    op = exact.fixed_order_linear(torch.zeros(1, 4), torch.zeros(4, 4))
    assert op is not None, "AVX-512F CPU but the fixed-order kernel did not build"
    return op


@pytest.mark.parametrize(("n", "k"), [(37, 2048), (130, 100), (5, 17), (1, 16), (64, 5635)])
def test_rows_do_not_depend_on_the_batch(n, k):
    op = _kernel()
    gen = torch.Generator().manual_seed(n * 31 + k)
    weight = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(70, k, generator=gen)
    many = op(x, weight)
    assert many.shape == (70, n) and many.dtype == torch.float32
    want = x.double() @ weight.double().T
    bound = 2.0**-20 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert bool(((many.double() - want).abs() <= bound).all())
    for i in (0, 1, 5, 63, 64, 69):
        assert torch.equal(op(x[i : i + 1].contiguous(), weight), many[i : i + 1]), (n, k, i)
    for lo, hi in ((3, 10), (60, 70), (0, 9)):
        assert torch.equal(op(x[lo:hi].contiguous(), weight), many[lo:hi]), (n, k, lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(x, weight), many)
    finally:
        torch.set_num_threads(threads)


def test_row_blocked_runs_it_for_float32_only():
    op = _kernel()
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(2, 3, 48, generator=gen)
    with row_blocked():
        got = F.linear(x, weight, bias)
    assert torch.equal(got, (op(x.reshape(6, 48), weight) + bias).view(2, 3, 96))
    x16, w16 = x.bfloat16(), weight.bfloat16()
    with row_blocked():
        got16 = F.linear(x16, w16)
    padded = F.linear(F.pad(x16.reshape(6, 48), (0, 0, 0, exact.ROW_BLOCK - 6)), w16)[:6]
    assert torch.equal(got16, padded.view(2, 3, 96))
    assert exact.fixed_order_linear(x.reshape(6, 48), weight.T) is None  # a transposed view: padded F.linear
