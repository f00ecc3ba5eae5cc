"""The row-invariant products ``exact.row_blocked()`` runs on CPU (``csrc/row_linear.cpp``): float32 (fixed-order
AVX-512 kernel) and bfloat16 (AMX tiles, or vdpbf16ps on AVX512-BF16 CPUs without AMX). Every row's result
is the same bits whatever else shares the call (rows before it, after it, how many, how many threads), within float32 rounding (bfloat16: one bfloat16
rounding) of the float64 product, for widths with and without a tail (16 lanes; 32-wide AMX steps), weight row
counts with and without a 16-row tail, and row counts crossing the kernels' tiles, 64-row chunks and (bfloat16)
K blocks; under ``row_blocked()`` float32 and bfloat16 products run them (bias added after), other dtypes keep
the padded ``F.linear``. The speculative and serving tests hold the end-to-end consequence (verify passes equal
single steps, bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import cpu_has
from shardwise.runtime import exact
from shardwise.runtime.exact import row_blocked


def _kernel(dtype=torch.float32):
    flags = {torch.float32: ("avx512f",), torch.bfloat16: ("amx_bf16", "avx512_bf16")}[dtype]
    if not any(cpu_has(flag) for flag in flags):
        pytest.skip(f"this CPU has none of {flags}: row_blocked() pads {dtype} products to whole row blocks")
    op = exact.fixed_order_linear(torch.zeros(1, 4, dtype=dtype), torch.zeros(4, 4, dtype=dtype))
    assert op is not None, f"{flags} CPU but the {dtype} row-invariant kernel did not build (or load)"
    return op


def _assert_rows_alone(op, x, weight, many, rows, slices) -> None:
    """``many`` = op(x, weight): each of ``rows`` alone and each [lo, hi) of ``slices`` give the same bits,
    and so do one and two threads."""
    for i in rows:
        assert torch.equal(op(x[i : i + 1].contiguous(), weight), many[i : i + 1]), (tuple(weight.shape), i)
    for lo, hi in slices:
        assert torch.equal(op(x[lo:hi].contiguous(), weight), many[lo:hi]), (tuple(weight.shape), lo, hi)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(op(x, weight), many), n
    finally:
        torch.set_num_threads(threads)


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
    _assert_rows_alone(op, x, weight, many, (0, 1, 5, 63, 64, 69), ((3, 10), (60, 70), (0, 9)))


def test_row_blocked_runs_it_for_float32():
    op = _kernel()
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(2, 3, 48, generator=gen)
    with row_blocked():
        got = F.linear(x, weight, bias)
    assert torch.equal(got, (op(x.reshape(6, 48), weight) + bias).view(2, 3, 96))
    x16, w16 = x.half(), weight.half()
    with row_blocked():
        got16 = F.linear(x16, w16)
    padded = F.linear(F.pad(x16.reshape(6, 48), (0, 0, 0, exact.ROW_BLOCK - 6)), w16)[:6]
    assert torch.equal(got16, padded.view(2, 3, 96))
    assert exact.fixed_order_linear(x.reshape(6, 48), weight.T) is None  # a transposed view: padded F.linear
    assert exact.fixed_order_linear(x.reshape(6, 48), weight.bfloat16()) is None  # mixed dtypes
    with row_blocked(vector_kernels=False):  # serving's prefill forwards: float32 on the padded GEMM
        got_padded = F.linear(x, weight, bias)
    padded32 = F.linear(F.pad(x.reshape(6, 48), (0, 0, 0, exact.ROW_BLOCK - 6)), weight, bias)[:6]
    assert torch.equal(got_padded, padded32.view(2, 3, 96))


@pytest.mark.parametrize(("n", "k", "m"), [(37, 2048, 70), (130, 100, 70), (5, 17, 70), (1, 16, 40), (64, 5635, 70),
                                           (48, 64, 17), (37, 5635, 300)])
def test_bfloat16_rows_do_not_depend_on_the_batch(n, k, m):
    op = _kernel(torch.bfloat16)
    gen = torch.Generator().manual_seed(n * 31 + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    many = op(x, weight)
    assert many.shape == (m, n) and many.dtype == torch.bfloat16
    want = x.double() @ weight.double().T  # bfloat16 products are exact in float32: only the sums round
    bound = 2.0**-8 * want.abs() + (k + 1) * 2.0**-23 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert bool(((many.double() - want).abs() <= bound).all())
    _assert_rows_alone(op, x, weight, many, (0, 1, 5, 15, 16, 31, 32, m - 1),
                       ((3, 10), (m - 10, m), (0, 9), (0, 33), (17, m)))


def test_row_blocked_runs_it_for_bfloat16():
    op = _kernel(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(100, 80, generator=gen).bfloat16()
    bias = torch.randn(100, generator=gen).bfloat16()
    x = torch.randn(3, 7, 80, generator=gen).bfloat16()
    with row_blocked():
        got = F.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (op(x.reshape(21, 80), weight) + bias).view(3, 7, 100))
    with row_blocked():
        alone = F.linear(x[1:2, 4:5], weight, bias)
    assert torch.equal(alone, got[1:2, 4:5])


def test_bfloat16_without_amx_plain_and_exact_one_row_agree():
    """Without AMX the bfloat16 kernel is the vdpbf16ps one, which is also plain decode's one-row product where
    this machine measured it faster than torch.mv: a single row gives the same bits in plain decode
    (``layers.linear``) and under ``row_blocked()``, so ``generate(exact=True)`` and plain decode agree; serving's
    prefill (``vector_kernels=False``) leaves it for the padded GEMM."""
    from shardwise.runtime import gemv
    from shardwise.runtime.layers import linear

    op = gemv.rows_kernel(torch.bfloat16)
    if op is None or exact.fixed_order_linear(torch.zeros(1, 4).bfloat16(), torch.zeros(4, 4).bfloat16()) is not op:
        pytest.skip("AMX tiles, or no AVX512-BF16 build, here")
    if gemv.chosen_kernel(torch.bfloat16) is None:
        pytest.skip("this machine measured torch.mv faster: plain decode runs it")
    gen = torch.Generator().manual_seed(3)
    for n, k in [(37, 2048), (130, 100), (5, 17), (8, 5635)]:
        weight, x = (torch.randn(n, k, generator=gen) * 0.05).bfloat16(), torch.randn(1, k, generator=gen).bfloat16()
        with row_blocked():
            blocked = F.linear(x, weight)
        assert torch.equal(linear(x, weight), blocked), (n, k)
    assert exact.fixed_order_linear(x, weight, vector_kernels=False) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_twin_gives_the_same_bits(dtype):
    """The ``_pairs`` ops (one row of x against two weight rows at a time: ``runtime.gemv`` measures which a
    machine runs for decode) give the one-row ops' bits, odd weight row counts (a last row alone) included."""
    from shardwise.runtime import gemv

    single, pairs = gemv.rows_kernel(dtype), gemv.rows_kernel(dtype, pairs=True)
    if single is None:
        pytest.skip(f"no compiled {dtype} one-row product on this CPU")
    assert pairs is not None, "the one-row op built but its _pairs twin did not"
    gen = torch.Generator().manual_seed(11)
    for n, k in [(37, 2048), (1, 100), (6, 17), (129, 5635)]:
        weight, x = (torch.randn(n, k, generator=gen) * 0.05).to(dtype), torch.randn(1, k, generator=gen).to(dtype)
        assert torch.equal(pairs(x, weight), single(x, weight)), (n, k)
        three = torch.randn(3, k, generator=gen).to(dtype)  # several rows: the same tiles as the one-row op's
        assert torch.equal(pairs(three, weight), single(three, weight)), (n, k)


def test_exact_one_row_takes_the_faster_schedule(monkeypatch):
    """Under ``row_blocked()`` a one-row float32 product runs the ``_pairs`` twin where the machine measured it
    faster (here forced through ``SHARDWISE_GEMV=kernel_pairs``) and the one-row op otherwise; several rows keep
    the tiled op; every way gives the same bits."""
    from shardwise.runtime import gemv

    _kernel()
    weight = torch.randn(37, 300, generator=torch.Generator().manual_seed(2))
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    ops = {}
    for forced in ("kernel_pairs", "kernel"):
        monkeypatch.setenv("SHARDWISE_GEMV", forced)
        monkeypatch.setattr(gemv, "_chosen", {})
        ops[forced] = exact.fixed_order_linear(x[:1], weight)
        assert exact.fixed_order_linear(x, weight) is gemv.rows_kernel(torch.float32)
    assert ops["kernel_pairs"] is gemv.rows_kernel(torch.float32, pairs=True)
    assert ops["kernel"] is gemv.rows_kernel(torch.float32)
    many = ops["kernel"](x, weight)
    for i in range(4):
        assert torch.equal(ops["kernel_pairs"](x[i : i + 1], weight), many[i : i + 1])
        with row_blocked():
            assert torch.equal(F.linear(x[i : i + 1], weight), many[i : i + 1])
