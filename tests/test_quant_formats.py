"""Quantization format registry: real bits per weight, scales included."""

import dataclasses

import pytest

from shardwise.errors import ShardwiseError
from shardwise.quant import mxfp4_codec as mxfp4, nvfp4_codec as nvfp4
from shardwise.quant.formats import FORMATS, QuantFormat, get_format

EXPECTED_BITS = {
    "bf16": 16.0,
    "fp16": 16.0,
    "fp32": 32.0,
    "fp8": 8 + 32 / 16384,
    "mxfp4": 4.25,
    "nvfp4": 4.5,
    "int8": 8.0,  # + 16/in of per-row scales, not counted (the format's description says so)
    "int4-g32": 4.5,
    "int4-g64": 4.25,
    "int4-g128": 4.125,
    "q4_0": 4.5,
    "q8_0": 8.5,
    "mxfp8": 8.25,
    "mlx-mixed-3.6": 3.578,  # stated by the model card it comes from (not derived: a per-tensor mix)
    # GGUF file types: the default type's bits (ggml-common.h); a model's own mix is quant.gguf_mix's
    "gguf-q2_k": 84 * 8 / 256, "gguf-q3_k_s": 110 * 8 / 256, "gguf-q3_k_m": 110 * 8 / 256,
    "gguf-q3_k_l": 110 * 8 / 256, "gguf-q4_0": 4.5, "gguf-q4_k_s": 4.5, "gguf-q4_k_m": 4.5, "gguf-q5_k_s": 5.5,
    "gguf-q5_k_m": 5.5, "gguf-q6_k": 210 * 8 / 256, "gguf-q8_0": 8.5, "gguf-mxfp4_moe": 4.25,
}


def test_registry_bits_per_weight():
    assert {name: f.bits_per_weight for name, f in FORMATS.items()} == pytest.approx(EXPECTED_BITS, abs=1e-12)
    assert get_format("fp8").bits_per_weight == pytest.approx(8.002, abs=1e-3)


def test_fp4_bits_come_from_the_codecs():
    assert get_format("mxfp4").bits_per_weight == mxfp4.ELEMENT_BITS + mxfp4.SCALE_BITS / mxfp4.BLOCK_SIZE == 4.25
    assert (get_format("mxfp4").block_size, get_format("mxfp4").scale_bits) == (mxfp4.BLOCK_SIZE, mxfp4.SCALE_BITS)
    assert get_format("nvfp4").bits_per_weight == nvfp4.ELEMENT_BITS + nvfp4.SCALE_BITS / nvfp4.BLOCK_SIZE == 4.5


def test_ggml_block_byte_sizes():
    # block_q4_0 = {ggml_half d; uint8_t qs[16]} = 18 bytes; block_q8_0 = {ggml_half d; int8_t qs[32]} = 34 bytes.
    assert get_format("q4_0").bits_per_weight * 32 / 8 == 18
    assert get_format("q8_0").bits_per_weight * 32 / 8 == 34


def test_every_format_is_documented_and_frozen():
    for name, f in FORMATS.items():
        assert f.name == name and f.description and f.source
        assert (f.block_size is None) == (f.scale_bits == 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        FORMATS["bf16"].bits_per_weight = 8  # type: ignore[misc]
    assert "8.25" in get_format("fp8").description and "4.25" in get_format("int4-g128").description


def test_weight_bytes():
    assert get_format("mxfp4").weight_bytes(1_000_000) == 531_250
    assert isinstance(get_format("bf16"), QuantFormat) and get_format("bf16").weight_bytes(3) == 6


def test_unknown_format_suggests_close_names():
    with pytest.raises(ShardwiseError, match=r"unknown quantization format 'mxfp': did you mean .*mxfp4") as err:
        get_format("mxfp")
    assert "\n" not in str(err.value)
