"""MXFP4 codec: OCP MX v1.0 vectors, transformers' decoder, numpy vs torch, error bounds."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from shardwise.errors import ShardwiseError
from shardwise.quant import mxfp4_codec as mxfp4
from shardwise.runtime import mxfp4_matmul as rt

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def codes_of(blocks: np.ndarray) -> np.ndarray:
    return mxfp4.unpack_nibbles(blocks).reshape(*blocks.shape[:-2], -1)


def block_with(values, fill_amax: float = 4.0, dtype=np.float32) -> np.ndarray:
    """One 32-element block holding values, padded with zeros; amax fixed by fill_amax."""
    x = np.zeros(32, dtype=dtype)
    x[: len(values)] = values
    x[-1] = fill_amax
    return x


def test_constants_give_4_25_bits():
    assert (mxfp4.BLOCK_SIZE, mxfp4.ELEMENT_BITS, mxfp4.SCALE_BITS) == (32, 4, 8)
    assert mxfp4.E2M1_VALUES.tolist() == FP4_VALUES


def test_every_grid_value_encodes_exactly():
    x = np.tile(np.concatenate([GRID, -GRID]), 2).astype(np.float32)
    blocks, scales = mxfp4.encode(x)
    assert scales.tolist() == [127]  # amax 6: floor(log2 6) - 2 = 0
    assert codes_of(blocks).tolist() == list(range(8)) + [0] + list(range(9, 16)) + list(range(8)) + [0] + list(
        range(9, 16)
    )
    np.testing.assert_array_equal(mxfp4.decode(blocks, scales), x)


@pytest.mark.parametrize("exponent", [-127, -20, -1, 0, 3, 100])
def test_ties_round_to_even(exponent):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = np.ldexp(block_with(ties + [-t for t in ties]).astype(np.float64), exponent)
    blocks, scales = mxfp4.encode(x)
    assert scales.tolist() == [127 + exponent]
    got = np.ldexp(mxfp4.decode(blocks, scales, np.float64)[:14], -exponent)
    assert got.tolist() == expected + [-e for e in expected]


def test_nearest_between_ties():
    x = block_with([0.2, 0.3, 0.74, 0.76, 2.49, 2.51, 4.99, 5.01])
    blocks, scales = mxfp4.encode(x)
    assert mxfp4.decode(blocks, scales)[:8].tolist() == [0.0, 0.5, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0]


def test_saturation_at_six():
    x = block_with([7.9, -7.0, 6.5, 5.9], fill_amax=1.0)  # amax 7.9: exponent 0, 7.9 > 6
    blocks, scales = mxfp4.encode(x)
    assert scales.tolist() == [127]
    assert mxfp4.decode(blocks, scales)[:4].tolist() == [6.0, -6.0, 6.0, 6.0]


def test_round_up_scale_never_saturates():
    x = block_with([7.9, -7.0, 6.5, 5.9], fill_amax=1.0)
    blocks, scales = mxfp4.encode(x, scale_rounding="up")
    assert scales.tolist() == [128]  # ceil(log2(7.9 / 6)) = 1
    assert mxfp4.decode(blocks, scales)[:4].tolist() == [8.0, -8.0, 6.0, 6.0]
    _, exact = mxfp4.encode(block_with([6.0], fill_amax=6.0), scale_rounding="up")
    assert exact.tolist() == [127]  # amax exactly 6·2^0 keeps exponent 0


def test_all_zero_block_has_zero_scale():
    x = np.concatenate([np.zeros(32), -np.zeros(32), np.ones(32)]).astype(np.float32)
    blocks, scales = mxfp4.encode(x)
    assert scales.tolist() == [0, 0, 125]
    assert not blocks[:2].any()
    np.testing.assert_array_equal(mxfp4.decode(blocks, scales), x)


def test_scale_ff_decodes_to_nan():
    blocks = np.full((2, 16), 0x21, dtype=np.uint8)
    scales = np.array([0xFF, 127], dtype=np.uint8)
    out = mxfp4.decode(blocks, scales)
    assert np.isnan(out[:32]).all() and out[32:34].tolist() == [0.5, 1.0]
    out_t = rt.decode(torch.from_numpy(blocks), torch.from_numpy(scales), torch.float32)
    assert torch.isnan(out_t[:32]).all()


def test_non_finite_block_encodes_as_nan():
    x = np.ones(64, dtype=np.float32)
    x[3], x[40] = np.nan, np.inf
    _, scales = mxfp4.encode(x)
    assert scales.tolist() == [0xFF, 0xFF]


def test_exponent_clamps_to_e8m0_range():
    _, tiny = mxfp4.encode(block_with([], fill_amax=2.0**-140))
    assert tiny.tolist() == [0]
    big_blocks, big = mxfp4.encode(block_with([], fill_amax=2.0**200, dtype=np.float64))
    assert big.tolist() == [254]
    assert mxfp4.decode(big_blocks, big, np.float64)[-1] == 6.0 * 2.0**127


def test_low_nibble_is_even_element():
    x = block_with([0.5, 6.0, -1.0, 2.0], fill_amax=4.0)
    blocks, _ = mxfp4.encode(x)
    assert blocks[0, 0] == 0x71 and blocks[0, 1] == 0x4A


def test_bad_inputs_raise_one_line_errors():
    with pytest.raises(ShardwiseError, match=r"multiple of 32") as err:
        mxfp4.encode(np.ones((4, 40), dtype=np.float32))
    assert "\n" not in str(err.value)
    with pytest.raises(ShardwiseError, match="dtype int64"):
        mxfp4.encode(np.ones(32, dtype=np.int64))
    with pytest.raises(ShardwiseError, match="scale_rounding 'down'"):
        mxfp4.encode(np.ones(32, dtype=np.float32), scale_rounding="down")
    with pytest.raises(ShardwiseError, match=r"scales have dtype float32"):
        mxfp4.decode(np.zeros((3, 16), np.uint8), np.zeros(3, np.float32))
    with pytest.raises(ShardwiseError, match=r"expected uint8 with shape \[..., G, 16\]"):
        mxfp4.decode(np.zeros((3, 32), np.uint8), np.zeros(3, np.uint8))


def test_round_trip_exact_on_grid():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(6, 8, 32))
    exps = rng.integers(-120, 120, size=(6, 8, 1))
    x = np.ldexp(mxfp4.E2M1_VALUES[codes].astype(np.float64), exps).astype(np.float32).reshape(6, 256)
    blocks, scales = mxfp4.encode(x)
    np.testing.assert_array_equal(mxfp4.decode(blocks, scales), x)


def random_packed(seed: int, shape=(3, 6, 5)):
    """Random blocks [*shape, 16] and scales [*shape] over the full byte range except 0xFF."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=shape + (16,), dtype=np.uint8), rng.integers(0, 255, size=shape, dtype=np.uint8)


def transformers_decode(blocks: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """convert_moe_packed_tensors returns [E, in, out]; transpose back to [E, out, in]."""
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    return out.transpose(1, 2)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_matches_transformers_bit_for_bit(seed):
    blocks, scales = random_packed(seed)
    ref_bf16 = transformers_decode(blocks, scales, torch.bfloat16)
    ref_f32 = transformers_decode(blocks, scales, torch.float32)
    ours_f32 = torch.from_numpy(mxfp4.decode(blocks, scales, np.float32))
    assert torch.isinf(ref_f32).any()  # scale 254 with |element| ≥ 2 overflows, in both
    assert torch.equal(bits(ours_f32), bits(ref_f32))
    assert torch.equal(bits(ours_f32), bits(ref_bf16.float()))  # every MXFP4 value is exact in bf16
    ours_rt = rt.decode(torch.from_numpy(blocks), torch.from_numpy(scales), torch.bfloat16)
    assert torch.equal(bits(ours_rt), bits(ref_bf16))
    ref_f16 = transformers_decode(blocks, scales, torch.float16)
    assert torch.equal(bits(torch.from_numpy(mxfp4.decode(blocks, scales, np.float16))), bits(ref_f16))


@pytest.mark.parametrize(
    ("np_dtype", "torch_dtype"), [(np.float32, torch.float32), (np.float16, torch.float16), (np.float64, torch.float64)]
)
def test_torch_decode_equals_numpy_decode(np_dtype, torch_dtype):
    blocks, scales = random_packed(7, shape=(4, 9))
    scales[0, 0] = 0xFF
    ours = torch.from_numpy(mxfp4.decode(blocks, scales, np_dtype))
    got = rt.decode(torch.from_numpy(blocks), torch.from_numpy(scales), torch_dtype)
    assert got.shape == (4, 9 * 32) and got.dtype == torch_dtype
    assert torch.equal(bits(got), bits(ours))


def test_mxfp4_matmul_equals_dense_linear():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    blocks, scales = mxfp4.encode(w)
    dense = torch.from_numpy(mxfp4.decode(blocks, scales))
    x = torch.randn(4, 5, 96)  # 20 rows (>= GEMM_ROWS): one dense product
    bias = torch.randn(48)
    got = rt.mxfp4_matmul(x, torch.from_numpy(blocks), torch.from_numpy(scales), bias)
    assert torch.equal(got, torch.nn.functional.linear(x, dense, bias))
    got_bf16 = rt.mxfp4_matmul(x.bfloat16(), torch.from_numpy(blocks), torch.from_numpy(scales), bias)
    assert got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_bf16, torch.nn.functional.linear(x.bfloat16(), dense.bfloat16(), bias.bfloat16()))
    with pytest.raises(ShardwiseError, match=r"x of shape \[4, 5, 64\]"):
        rt.mxfp4_matmul(x[..., :64], torch.from_numpy(blocks), torch.from_numpy(scales))
    with pytest.raises(ShardwiseError, match="scales have dtype torch.float32"):
        rt.mxfp4_matmul(x, torch.from_numpy(blocks), torch.from_numpy(scales).float())


def test_mxfp4_matmul_of_few_rows_reads_the_packed_bytes():
    """Fewer than GEMM_ROWS rows run int_matmul's kernel on the packed bytes (AVX-512 CPUs): within float32
    rounding of the dense product (bfloat16: of its one rounding), E8M0's subnormal byte 0 and NaN byte 255
    included, and each row the same bits alone as among others (speculative verify = single steps)."""
    rng = np.random.default_rng(4)
    blocks, scales = mxfp4.encode(rng.standard_normal((48, 256)).astype(np.float32))
    scales[1, 2], scales[2, 0] = 0, 0xFF
    dense = torch.from_numpy(mxfp4.decode(blocks, scales)).double()
    blocks, scales = torch.from_numpy(blocks), torch.from_numpy(scales)
    x, bias = torch.randn(7, 256), torch.randn(48)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert rt.packed_kernel(x, blocks) is not None
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        got = rt.mxfp4_matmul(x.to(dtype), blocks, scales, bias)
        ref = torch.nn.functional.linear(x.to(dtype).double(), dense, bias.to(dtype).double())
        assert got.dtype == dtype and bool(got[:, 2].isnan().all()) and not bool(got[:, [0, 1, 3]].isnan().any())
        keep = [i for i in range(48) if i != 2]
        torch.testing.assert_close(got[:, keep].double(), ref[:, keep], rtol=tol, atol=tol)
        for i in range(7):
            one = rt.mxfp4_matmul(x[i : i + 1].to(dtype), blocks, scales, bias)
            assert torch.equal(one[:, keep], got[i : i + 1, keep]) and bool(one[0, 2].isnan())


def half_step(q: np.ndarray) -> np.ndarray:
    """Half the E2M1 grid spacing around |q|: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]."""
    a = np.abs(q)
    return np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))


finite_f32 = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, width=32)


@settings(max_examples=100, deadline=None)
@given(
    x=arrays(np.float32, st.integers(1, 4).map(lambda k: 32 * k), elements=finite_f32),
    shift=st.integers(-100, 27),  # |x| ≤ 2^100, so |x|·2^shift stays below float32 overflow
    rounding=st.sampled_from(mxfp4.SCALE_ROUNDINGS),
)
def test_round_trip_error_within_half_step(x, shift, rounding):
    x = np.ldexp(x.astype(np.float64), shift).astype(np.float32)  # reach tiny and subnormal magnitudes too
    blocks, scales = mxfp4.encode(x, scale_rounding=rounding)
    got = mxfp4.decode(blocks, scales, np.float64).reshape(-1, 32)
    xb = x.astype(np.float64).reshape(-1, 32)
    e = scales.astype(np.int64)[:, None] - 127
    amax = np.abs(xb).max(axis=1)
    nonzero = amax > 0
    en = e[nonzero, 0]
    if rounding == "ocp":  # floor(log2 amax) − 2, clamped
        assert (en == np.clip(np.frexp(amax[nonzero])[1] - 3, -127, 127)).all()
    else:  # the smallest e with amax ≤ 6·2^e, clamped
        assert (amax[nonzero] <= np.ldexp(6.0, en)).all()
        assert ((en == -127) | (amax[nonzero] > np.ldexp(6.0, en - 1))).all()
    q = np.ldexp(xb, -e)
    saturated = np.abs(q) > 6
    if rounding == "up":
        assert not saturated.any()
    bound = np.ldexp(half_step(q), e)
    err = np.abs(got - xb)
    assert (err[~saturated] <= bound[~saturated]).all()
    assert (got[saturated] == np.sign(xb[saturated]) * np.ldexp(6.0, e.repeat(32, axis=1)[saturated])).all()
