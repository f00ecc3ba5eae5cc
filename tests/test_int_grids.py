"""The int4 / MXFP4 / int8 kernel's integer grids (``csrc/int_matmul_grids.h``; the ``int16`` paths of bfloat16 rows,
the ``int24`` ones of float32 rows): each 32-block of a row on its power-of-two grid — bfloat16: every element within
2^6 of the block's largest held exactly, smaller ones off by at most 2^-14 of it; float32: every element off by at most
2^-22 of it (2^-21 against int8 weights) —; integer products; a row's bits its own whatever shares the call."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.runtime import int_matmul

pytestmark = pytest.mark.skipif(not int_matmul.int8_rows_here(), reason="the integer grids need AVX-512 VNNI")


def _weights(rows: int, width: int, group: int, mxfp4: bool, seed: int = 0, bits: int = 4):
    """(q uint8 [rows, width / 2] — int8 [rows, width] for 8 bits —, scale, the float64 weight they hold)."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (rows, width), dtype=torch.int8, generator=gen)
        scale = (torch.rand(rows, width // group, generator=gen) * 0.01 + 0.001).bfloat16()
        return q, scale, q.double() * scale.double().repeat_interleave(group, dim=1)
    q = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=gen)
    nibbles = torch.stack([q & 15, q >> 4], -1).reshape(rows, width).long()
    if mxfp4:
        scale = torch.randint(118, 130, (rows, width // group), dtype=torch.uint8, generator=gen)
        values = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
        steps = torch.pow(2.0, scale.double() - 127)
    else:
        scale = (torch.rand(rows, width // group, generator=gen) * 0.1 + 0.01).bfloat16()
        values, steps = torch.arange(-8, 8, dtype=torch.float64), scale.double()
    return q, scale, values[nibbles] * steps.repeat_interleave(group, dim=1)


def _grid_bound(x: torch.Tensor, w: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[M, N]: the most the grids can move each output (a share of a block's largest element per weight of the block:
    2^-14 for bfloat16 rows, 2^-22 for float32 ones, 2^-21 against int8 weights), plus float32 rounding of the weighted
    sums (2^-20 of the sum of the products' magnitudes)."""
    xd = x.double()
    block_max = xd.abs().reshape(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)
    share = 2.0**-14 if x.dtype == torch.bfloat16 else 2.0**-22 if bits == 4 else 2.0**-21
    return (block_max * share) @ w.abs().T + 2.0**-20 * (xd.abs() @ w.abs().T)


@pytest.mark.parametrize(("rows", "width", "group", "mxfp4", "bits"), [
    (40, 256, 32, False, 4), (33, 1024, 64, False, 4), (17, 512, 256, False, 4), (24, 384, 32, True, 4),
    (21, 384, 384, False, 8), (30, 512, 64, False, 8), (9, 256, 128, False, 8)])
def test_grid_rows_are_exact_where_a_block_spans_six_octaves_and_bounded_elsewhere(rows, width, group, mxfp4, bits):
    q, scale, w = _weights(rows, width, group, mxfp4, seed=rows, bits=bits)
    op = int_matmul.kernel()
    gen = torch.Generator().manual_seed(width)
    # every element within 2^6 of its block's largest: each held exactly, so only float32 rounding of the sums is left
    near = ((torch.rand(2, width, generator=gen) * 63 + 1) * torch.where(torch.rand(2, width, generator=gen) < .5, -1, 1)).bfloat16()
    exact = near.double() @ w.T
    sums = near.double().abs() @ w.abs().T
    assert bool(((op(near, q, scale, bits, group, grids=True).double() - exact).abs() <= 2.0**-20 * sums).all())
    # a normal row (and one reaching down to subnormals), bfloat16 or float32: off by no more than the grids allow
    for dtype in (torch.bfloat16, torch.float32):
        for x in (torch.randn(3, width, generator=gen).to(dtype),
                  (torch.randn(1, width, generator=gen) * torch.logspace(-40, 0, width)).to(dtype)):
            y = op(x, q, scale, bits, group, grids=True).double()
            assert bool(((y - x.double() @ w.T).abs() <= _grid_bound(x, w, bits)).all()), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grid_rows_hold_tiny_blocks_and_poison_inf_and_nan(dtype):
    q, scale, w = _weights(16, 256, 32, False)
    op = int_matmul.kernel()
    tiny = (torch.randn(1, 256, generator=torch.Generator().manual_seed(2)) * 1e-38).to(dtype)  # down to subnormals
    ref = tiny.double() @ w.T
    assert bool(((op(tiny, q, scale, 4, 32, grids=True).double() - ref).abs() <= _grid_bound(tiny, w)).all())
    assert torch.equal(op(torch.zeros(1, 256, dtype=dtype), q, scale, 4, 32, grids=True), torch.zeros(1, 16))
    for bad in (math.inf, -math.inf, math.nan):
        x = torch.ones(2, 256, dtype=dtype)
        x[1, 200] = bad  # one block of the second row
        y = op(x, q, scale, 4, 32, grids=True)
        assert bool(y[1].isnan().all()) and bool(y[0].isfinite().all()), bad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 512), (8, 128)])
def test_grid_rows_are_row_invariant(bits, group, dtype):
    """A k+1-row verify pass equals k+1 one-row steps bit for bit, and a row's bits do not depend on which weight rows
    share the call or whether they go two at a time."""
    q, scale, _ = _weights(70, 512, group, False, bits=bits)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    op = int_matmul.kernel()
    full = op(x, q, scale, bits, group, grids=True)
    assert torch.equal(torch.cat([op(x[i : i + 1], q, scale, bits, group, grids=True) for i in range(5)]), full)
    assert torch.equal(op(x, q[11:40], scale[11:40], bits, group, grids=True), full[:, 11:40])
    assert torch.equal(op(x, q, scale, bits, group, None, True, False, True), full)


@pytest.mark.parametrize(("x_dtype", "bits", "width", "q8"), [(torch.float32, 4, 96, False), (torch.bfloat16, 4, 96, False),
                                                               (torch.bfloat16, 8, 256, False), (torch.bfloat16, 4, 256, True)])
def test_grid_rows_refuse_what_they_do_not_take(x_dtype, bits, width, q8):
    q = torch.zeros(8, width * bits // 8, dtype=torch.uint8 if bits == 4 else torch.int8)
    scale = torch.ones(8, width // 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="grids take rows a multiple of 128 wide"):
        int_matmul.kernel()(torch.ones(1, width, dtype=x_dtype), q, scale, bits, 32, None, False, q8, True)


def test_grid_paths_reach_only_lines_weights(monkeypatch):
    monkeypatch.setenv("SHARDWISE_INT_ROWS", "int16_pairs")
    monkeypatch.setenv("SHARDWISE_INT_FLOAT_ROWS", "int24_pairs")
    monkeypatch.setattr(int_matmul, "_paths", {})
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.ones(1, 256, dtype=dtype)
        rows, flags = int_matmul.kernel_rows(x, 4, lines=True)
        assert rows.dtype == dtype and flags == (True, False, True)
        assert int_matmul.kernel_rows(x, 4, lines=False)[1] == (True, False, False)  # the bfloat16 / table path, pairs alike
    monkeypatch.setenv("SHARDWISE_INT_ROWS", "float32")  # bfloat16 rows widened: the table path, not int24 grids
    monkeypatch.setattr(int_matmul, "_paths", {})
    rows, flags = int_matmul.kernel_rows(torch.ones(1, 256, dtype=torch.bfloat16), 4, lines=True)
    assert rows.dtype == torch.float32 and flags == (False, False, False)
