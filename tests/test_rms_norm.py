"""The compiled RMSNorm (``csrc/rms_norm.cpp`` via ``runtime.rms_norm``): values against float64 and
against the torch expression it replaces, a row's bits independent of the batch and the thread count,
its three forms, refused inputs, and the ``RMSNorm`` module."""

from __future__ import annotations

import pytest
import torch

from shardwise.plan import ParallelPlan
from shardwise.runtime import cpp_ops
from shardwise.runtime.layers import Shard
from shardwise.runtime.rms_norm import RMSNorm, rms_norm, rms_norm_torch
from shardwise.spec.model import TensorSpec

EPS = 1e-6
FORMS = {"llama": (False, False), "cast_after_weight": (True, False), "offset": (False, True)}


@pytest.fixture(scope="module")
def op():
    op = cpp_ops.optional_op("rms_norm.cpp", "shardwise_norm", "rms_norm")
    if op is None:
        pytest.skip("csrc/rms_norm.cpp does not build here (no C++ compiler or ninja)")
    return op


def _inputs(rows: int, n: int, dtype: torch.dtype, wdtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * (torch.rand(rows, 1, generator=g) * 8 + 0.01)
    w = torch.randn(n, generator=g) * 0.3 + 1.0
    return x.to(dtype), w.to(wdtype)


def _reference64(x, w, form):
    """The form in float64 (no intermediate rounding)."""
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
    return h * (1.0 + w.double()) if form == "offset" else h * w.double()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 ulps (same-sign values; rms outputs of one element share the sign)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("n", [7, 64, 100, 2048, 2880])
@pytest.mark.parametrize("form", FORMS)
def test_float32_against_float64(op, n, form):
    x, w = _inputs(6, n, torch.float32, torch.float32)
    out = op(x, w, EPS, *FORMS[form])
    torch.testing.assert_close(out.double(), _reference64(x, w, form), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n", [64, 100, 2048, 5120])
@pytest.mark.parametrize("form", FORMS)
def test_float32_against_torch(op, n, form):
    x, w = _inputs(16, n, torch.float32, torch.float32, seed=1)
    out, ref = op(x, w, EPS, *FORMS[form]), rms_norm_torch(x, w, EPS, *FORMS[form])
    assert out.dtype == ref.dtype == torch.float32
    assert ((out - ref).abs() / ref.abs()).max().item() < 1e-6


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", FORMS)
def test_bfloat16_against_torch(op, form, wdtype):
    """Rounding mirrors torch's; only the sum's order differs, which moves r by an ulp of float32 now
    and then, and h across a bfloat16 rounding edge rarely: measured 0-3e-4 of elements differ, by one
    ulp of h (two of the output where the Llama form's weight, |w| > 1, spreads that ulp)."""
    x, w = _inputs(64, 2048, torch.bfloat16, wdtype, seed=2)
    out, ref = op(x, w, EPS, *FORMS[form]), rms_norm_torch(x, w, EPS, *FORMS[form])
    assert out.dtype == ref.dtype
    if out.dtype == torch.float32:  # Llama form with a float32 weight: w * float(bf16(h))
        rel = (out - ref).abs() / ref.abs()
        assert (rel > 1e-6).float().mean().item() < 1e-3 and rel.max().item() <= 2.0**-7
        return
    ulps = _ulps(out, ref)
    assert ulps.max().item() <= (2 if form == "llama" else 1)
    assert (ulps > 0).float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_bits_independent_of_batch_and_threads(op, dtype):
    x, w = _inputs(5, 2048, dtype, dtype, seed=3)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    threads = torch.get_num_threads()
    try:
        for form in FORMS.values():
            torch.set_num_threads(1)
            alone = torch.cat([op(x[i : i + 1], w, EPS, *form) for i in range(5)])
            torch.set_num_threads(2)
            batch = op(x, w, EPS, *form)
            big = op(x.repeat(40, 1), w, EPS, *form)[-5:]  # enough rows that two threads split them
            assert torch.equal(alone.view(bits), batch.view(bits)) and torch.equal(batch.view(bits), big.view(bits))
    finally:
        torch.set_num_threads(threads)


def test_leading_dims_and_strided_input(op):
    x, w = _inputs(12, 128, torch.bfloat16, torch.bfloat16, seed=4)
    x3 = x.view(3, 4, 128)
    assert op(x3, w, EPS, False, False).shape == (3, 4, 128)
    assert torch.equal(op(x3, w, EPS, False, False).view(12, 128), op(x, w, EPS, False, False))
    strided = x3.transpose(0, 1)  # not contiguous: copied first, same rows
    assert torch.equal(op(strided, w, EPS, False, False), op(x3, w, EPS, False, False).transpose(0, 1))


def test_bad_inputs_refused(op):
    x, w = _inputs(2, 64, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        op(x.half(), w, EPS, False, False)
    with pytest.raises(RuntimeError, match="weight must be float32 or bfloat16"):
        op(x, w.double(), EPS, False, False)
    with pytest.raises(RuntimeError, match="weight must be contiguous 1-D"):
        op(x, w[:32], EPS, False, False)
    with pytest.raises(RuntimeError, match="weight must be contiguous 1-D"):
        op(x, w.view(8, 8), EPS, False, False)


def test_dispatch_falls_back_to_torch():
    """float16 (no op) takes the torch expression; the values are the same function."""
    x, w = _inputs(3, 64, torch.float16, torch.float16)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cast_after_weight", [False, True])
def test_module_matches_old_expression(op, dtype, cast_after_weight):
    spec = TensorSpec("model.norm.weight", (2048,), "norm")
    norm = RMSNorm(spec, Shard(ParallelPlan()), dtype, EPS, cast_after_weight)
    x, w = _inputs(4, 2048, dtype, dtype, seed=5)
    norm.weight.data.copy_(w)
    x = x.view(4, 1, 2048)
    out = norm(x)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)  # layers.RMSNorm's expression
    old = (norm.weight * h).to(dtype) if cast_after_weight else norm.weight * h.to(dtype)
    assert out.dtype == old.dtype and out.shape == old.shape
    if dtype == torch.float32:
        assert ((out - old).abs() / old.abs()).max().item() < 1e-6
    else:
        ulps = _ulps(out, old)
        assert ulps.max().item() <= 2 and (ulps > 0).float().mean().item() < 1e-3
