"""On-disk MXFP4 layouts: detection from real configs, validation messages, gate/up order."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from shardwise.errors import ShardwiseError
from shardwise.quant import layouts
from shardwise.quant import mxfp4_codec as mxfp4

CATALOG = Path(__file__).resolve().parents[1] / "src" / "shardwise" / "spec" / "catalog" / "models"


def quantization_config(model: str) -> dict | None:
    config = json.loads((CATALOG / f"{model}.json").read_text())
    return config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("llama-3.1-8b", "none"),
        ("gpt-oss-20b", "gpt-oss-mxfp4"),
        ("gpt-oss-120b", "gpt-oss-mxfp4"),
        ("kimi-k3", "compressed-tensors-mxfp4"),
    ],
)
def test_detect_layout_on_catalog_configs(model, layout):
    assert layouts.detect_layout(quantization_config(model)) == layout


def test_detect_layout_rejects_other_methods_naming_them():
    with pytest.raises(ShardwiseError, match=r"quant_method 'fp8'") as err:
        layouts.detect_layout(quantization_config("deepseek-v3"))
    assert "\n" not in str(err.value)
    with pytest.raises(ShardwiseError, match=r"quant_method 'None'"):
        layouts.detect_layout({"bits": 4})
    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    with pytest.raises(ShardwiseError, match=r"format \['nvfp4-pack-quantized'\]"):
        layouts.detect_layout(nvfp4)
    kimi = quantization_config("kimi-k3")
    kimi["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(ShardwiseError, match=r"config_groups.group_0.weights.group_size is 16"):
        layouts.detect_layout(kimi)
    assert layouts.detect_layout({}) == "none"


def test_gpt_oss_pair_validation_messages():
    prefix = "model.layers.0.mlp.experts.gate_up_proj"
    blocks = np.zeros((4, 64, 3, 16), np.uint8)
    scales = np.zeros((4, 64, 3), np.uint8)
    layouts.check_gpt_oss_pair(prefix, blocks, scales, experts=4, out_features=64, in_features=96)
    layouts.check_gpt_oss_pair(prefix, torch.from_numpy(blocks), torch.from_numpy(scales))
    with pytest.raises(ShardwiseError) as err:
        layouts.check_gpt_oss_pair(prefix, blocks, scales.astype(np.float32))
    assert str(err.value).startswith(
        "tensor 'model.layers.0.mlp.experts.gate_up_proj_scales' has dtype float32, expected uint8 with shape "
        "[E, out, in/32] = [4, 64, 3]: "
    )
    with pytest.raises(ShardwiseError, match=r"has dtype float32, expected uint8 with shape \[E, out, in/32, 16\]"):
        layouts.check_gpt_oss_pair(prefix, torch.zeros(4, 64, 3, 16), torch.from_numpy(scales))
    with pytest.raises(ShardwiseError, match=r"'.*gate_up_proj_blocks' has shape \[4, 64, 3, 16\], expected uint8 "
                       r"with shape \[E, out, in/32, 16\] = \[E, out, 4, 16\]"):
        layouts.check_gpt_oss_pair(prefix, blocks, scales, in_features=128)
    with pytest.raises(ShardwiseError, match=r"'.*gate_up_proj_scales' has shape \[4, 64, 2\], expected uint8 with "
                       r"shape \[E, out, in/32\] = \[4, 64, 3\]"):
        layouts.check_gpt_oss_pair(prefix, blocks, scales[..., :2])
    with pytest.raises(ShardwiseError, match="not a multiple of 32"):
        layouts.check_gpt_oss_pair(prefix, blocks, scales, in_features=100)


def test_compressed_tensors_pair_validation_messages():
    module = "language_model.model.layers.1.mlp.experts.7.down_proj"
    packed = np.zeros((48, 64), np.uint8)
    scale = np.zeros((48, 4), np.uint8)
    layouts.check_compressed_tensors_pair(module, packed, scale, out_features=48, in_features=128)
    with pytest.raises(ShardwiseError, match=rf"tensor '{module}.weight_scale' has shape \[48, 2\], expected uint8 "
                       r"with shape \[out, in/32\] = \[48, 4\]"):
        layouts.check_compressed_tensors_pair(module, packed, scale[:, :2])
    with pytest.raises(
        ShardwiseError, match=r"weight_packed' has dtype int8, expected uint8 with shape \[out, in/2\] = \[48, 64\]"
    ):
        layouts.check_compressed_tensors_pair(module, packed.view(np.int8), scale, out_features=48, in_features=128)
    with pytest.raises(ShardwiseError, match=r"in is a multiple of 32"):
        layouts.check_compressed_tensors_pair(module, packed[:, :60], scale)


def test_compressed_tensors_rows_are_codec_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    blocks, scales = mxfp4.encode(w)
    packed = layouts.blocks_to_packed_rows(blocks)
    assert packed.shape == (8, 32) and np.shares_memory(packed, blocks)
    # compressed-tensors pack_fp4_to_uint8: byte k = code[2k] | code[2k+1] << 4
    codes = mxfp4.e2m1_codes(np.ldexp(w.astype(np.float64), -(scales.astype(int) - 127).repeat(32, axis=1)))
    np.testing.assert_array_equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
    np.testing.assert_array_equal(layouts.packed_rows_to_blocks(packed), blocks)


def test_gate_up_interleave_matches_transformers_split():
    rng = np.random.default_rng(1)
    e, inter, hidden = 2, 5, 64
    gate_w = rng.standard_normal((e, inter, hidden)).astype(np.float32)
    up_w = rng.standard_normal((e, inter, hidden)).astype(np.float32)
    gate_b, gate_s = mxfp4.encode(gate_w)
    up_b, up_s = mxfp4.encode(up_w)
    blocks = layouts.interleave_gate_up(gate_b, up_b)
    scales = layouts.interleave_gate_up(gate_s, up_s)
    assert blocks.shape == (e, 2 * inter, 2, 16) and scales.shape == (e, 2 * inter, 2)
    # transformers returns [E, in, 2·I] and GptOssExperts splits gate_up[..., ::2], gate_up[..., 1::2]
    fused = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert torch.equal(fused[..., ::2], torch.from_numpy(mxfp4.decode(gate_b, gate_s)).transpose(1, 2))
    assert torch.equal(fused[..., 1::2], torch.from_numpy(mxfp4.decode(up_b, up_s)).transpose(1, 2))
    g, u = layouts.deinterleave_gate_up(blocks)
    np.testing.assert_array_equal(g, gate_b)
    np.testing.assert_array_equal(u, up_b)
    dense = fused.numpy()
    g_dense, u_dense = layouts.deinterleave_gate_up(dense, axis=-1)
    np.testing.assert_array_equal(layouts.interleave_gate_up(g_dense, u_dense, axis=-1), dense)
    with pytest.raises(ShardwiseError, match="expected an even count"):
        layouts.deinterleave_gate_up(dense[..., :3], axis=-1)
    with pytest.raises(ShardwiseError, match="expected equal shapes"):
        layouts.interleave_gate_up(gate_b, up_b[:, :2])


def test_tensor_names():
    names = ("m.experts.down_proj_blocks", "m.experts.down_proj_scales")
    assert layouts.gpt_oss_tensor_names("m.experts.down_proj") == names
    assert layouts.compressed_tensors_names("m.w1") == ("m.w1.weight_packed", "m.w1.weight_scale")
