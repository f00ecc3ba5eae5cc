"""NVFP4 codec: E4M3 against torch.float8_e4m3fn, round trips, ModelOpt scale convention."""

import numpy as np
import pytest
import torch

from shardwise.errors import ShardwiseError
from shardwise.quant import mxfp4_codec as mxfp4, nvfp4_codec as nvfp4


def test_constants_give_4_5_bits():
    assert (nvfp4.BLOCK_SIZE, nvfp4.ELEMENT_BITS, nvfp4.SCALE_BITS) == (16, 4, 8)


def test_e4m3_decode_matches_torch_for_all_bytes():
    codes = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(nvfp4.e4m3_decode(codes), ref)
    assert nvfp4.e4m3_decode(np.array([0x7E, 0x01, 0x08, 0x38], np.uint8)).tolist() == [448.0, 2.0**-9, 2.0**-6, 1.0]


def test_e4m3_encode_round_trips_every_finite_code():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    np.testing.assert_array_equal(nvfp4.e4m3_encode(nvfp4.e4m3_decode(codes)), codes)  # 0x80 is −0.0


def test_e4m3_encode_matches_torch_cast():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20000) * np.exp2(rng.uniform(-12, 8.7, 20000))
    x = x[np.abs(x) <= 448]
    ref = torch.from_numpy(x.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(nvfp4.e4m3_encode(x.astype(np.float32)), ref)


def test_e4m3_ties_saturation_and_nan():
    # 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): the even code 0x38 wins;
    # 1.1875 between 1.125 (0x39) and 1.25 (0x3A): 0x3A wins; 2^-10 between 0 and 2^-9 → 0.
    ties = nvfp4.e4m3_encode(np.array([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10]))
    assert ties.tolist() == [0x38, 0x3A, 0x00, 0x02]
    sat = nvfp4.e4m3_encode(np.array([448.0, 460.0, 500.0, 1e9, np.inf, -1e9, -np.inf, np.nan]))
    assert sat.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]


def test_round_trip_exact_for_representable_values():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(8, 4, 16))
    codes[..., 0] = 7  # amax element 6, so block_amax / 6 is the block scale itself
    scale_codes = rng.integers(0x08, 0x7F, size=(8, 4, 1)).astype(np.uint8)  # normal E4M3 scales
    x = (mxfp4.E2M1_VALUES[codes] * nvfp4.e4m3_decode(scale_codes)).astype(np.float32).reshape(8, 64)
    blocks, scales, g = nvfp4.encode(x, global_scale=1.0)
    assert g == np.float32(1.0)
    np.testing.assert_array_equal(scales, scale_codes[..., 0])
    np.testing.assert_array_equal(nvfp4.decode(blocks, scales, g), x)


def test_modelopt_global_scale_and_error_bound():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((32, 128)) * np.exp2(rng.integers(-6, 6, size=(32, 8, 1))).repeat(16, -1).reshape(32, 128))
    x = x.astype(np.float32)
    blocks, scales, g = nvfp4.encode(x)
    assert g == np.float32(np.abs(x).max() / (6 * 448))
    assert blocks.shape == (32, 8, 8) and scales.shape == (32, 8) and scales.dtype == np.uint8
    assert nvfp4.e4m3_decode(scales).max() <= 448
    got = nvfp4.decode(blocks, scales, g).astype(np.float64)
    step = nvfp4.e4m3_decode(scales).astype(np.float64) * np.float64(g)
    q = x.astype(np.float64).reshape(32, 8, 16) / step[..., None]
    half = np.where(np.abs(q) < 2, 0.25, np.where(np.abs(q) < 4, 0.5, 1.0)) * step[..., None]
    err = np.abs(got.reshape(32, 8, 16) - x.reshape(32, 8, 16))
    saturated = np.abs(q) > 6
    slack = 1e-6 * np.abs(x.reshape(32, 8, 16))  # the final fp32 multiply by the global scale rounds once
    assert (err[~saturated] <= half[~saturated] + slack[~saturated]).all()
    assert np.abs(got - x).max() <= 0.25 * np.abs(x).max()


def test_zero_tensor_and_zero_block():
    blocks, scales, g = nvfp4.encode(np.zeros((2, 32), np.float32))
    assert g == np.float32(1.0) and not scales.any() and not blocks.any()
    x = np.concatenate([np.zeros(16), np.linspace(-3, 3, 16)]).astype(np.float32)
    blocks, scales, g = nvfp4.encode(x)
    assert scales[0] == 0 and nvfp4.decode(blocks, scales, g)[:16].tolist() == [0.0] * 16


def test_bad_inputs():
    with pytest.raises(ShardwiseError, match="multiple of 16"):
        nvfp4.encode(np.ones(20, np.float32))
    with pytest.raises(ShardwiseError, match="NaN or inf"):
        nvfp4.encode(np.full(16, np.nan, np.float32))
    with pytest.raises(ShardwiseError, match="global_scale is 0.0"):
        nvfp4.encode(np.ones(16, np.float32), global_scale=0.0)
    with pytest.raises(ShardwiseError, match=r"\[..., G, 8\]"):
        nvfp4.decode(np.zeros((2, 16), np.uint8), np.zeros(2, np.uint8), 1.0)
