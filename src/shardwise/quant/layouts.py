"""On-disk MXFP4 layouts in Hugging Face checkpoints, numpy only.

gpt-oss (`quantization_config.quant_method == "mxfp4"`): each expert projection is
two tensors, `{prefix}_blocks` uint8 [E, out, in/32, 16] and `{prefix}_scales` uint8
[E, out, in/32] (E8M0 bytes), e.g. `model.layers.0.mlp.experts.gate_up_proj_blocks`.
gate_up_proj interleaves its output rows: row 2j is gate_j, row 2j+1 is up_j
(transformers' GptOssExperts takes `gate_up[..., ::2]` and `gate_up[..., 1::2]`).

compressed-tensors `mxfp4-pack-quantized` (Kimi K3): each quantized Linear stores
`weight_packed` uint8 [out, in/2] and `weight_scale` uint8 [out, in/32]. Checked
against vllm-project/compressed-tensors:
- `compressors/nvfp4/helpers.py` `pack_fp4_to_uint8` packs `indices[:, 0] |
  (indices[:, 1] << 4)`: element 2i in the low nibble, as in gpt-oss, with the same
  sign-magnitude E2M1 codes (`MXFP4PackedCompressor` subclasses the NVFP4 packer);
- `compressors/mx_utils.py` `compress_mx_scale` stores `127 + floor(log2(scale))` as
  uint8, i.e. an E8M0 exponent byte, and `decompress_mx_scale` returns
  `2 ** (byte - 127)` in bf16 (so 0xFF reads back as inf there, NaN in OCP and here).
- Its observer (`quantization/utils/mxfp4_utils.py` `generate_mxfp4_scales`) picks
  exponent floor(log2(amax')) − 2, where amax' is amax first rounded to the nearest
  power of two when its mantissa is ≥ 1.75 — neither our "ocp" nor our "up" rounding
  exactly, which matters only for re-encoding, not for decoding.
So `weight_packed.reshape(out, in/32, 16)` is exactly the gpt-oss/codec block layout
for one expert and `weight_scale` needs no conversion. tests/test_mxfp4_runtime.py has
the library itself (through transformers' loader) decompress checkpoints we write.

The validators accept numpy arrays or anything with `.shape` and `.dtype` (torch
tensors included), so the runtime loader can check tensors without this module
importing torch.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.quant.mxfp4_codec import BLOCK_SIZE

BYTES_PER_BLOCK = BLOCK_SIZE // 2
"""Packed bytes per MXFP4 block (two 4-bit elements per byte)."""

LAYOUT_NONE = "none"
LAYOUT_GPT_OSS = "gpt-oss-mxfp4"
LAYOUT_COMPRESSED_TENSORS = "compressed-tensors-mxfp4"
LAYOUT_CT_INT = "compressed-tensors-int"
"""compressed-tensors ``pack-quantized``: weight-only int8 per channel or int4 per group
(``shardwise.quant.int_codec``)."""
LAYOUTS = (LAYOUT_NONE, LAYOUT_GPT_OSS, LAYOUT_COMPRESSED_TENSORS, LAYOUT_CT_INT)

GPT_OSS_BLOCKS_SUFFIX = "_blocks"
GPT_OSS_SCALES_SUFFIX = "_scales"
CT_PACKED_NAME = "weight_packed"
CT_SCALE_NAME = "weight_scale"
CT_MXFP4_FORMAT = "mxfp4-pack-quantized"
CT_INT_FORMAT = "pack-quantized"


def detect_layout(quantization_config: Mapping[str, Any] | None) -> str:
    """Which packed layout a config.json `quantization_config` describes.

    Returns "none" (no config), "gpt-oss-mxfp4" (quant_method "mxfp4"),
    "compressed-tensors-mxfp4" (quant_method "compressed-tensors" whose format, and
    every config group's format, is "mxfp4-pack-quantized" with group_size 32) or
    "compressed-tensors-int" (every format "pack-quantized": see ``int_scheme``).
    Anything else raises ShardwiseError naming quant_method or format.
    """
    if not quantization_config:
        return LAYOUT_NONE
    method = quantization_config.get("quant_method")
    if method == "mxfp4":
        return LAYOUT_GPT_OSS
    if method != "compressed-tensors":
        raise ShardwiseError(
            f"quantization_config.quant_method '{method}' has no MXFP4 layout here, expected 'mxfp4' (gpt-oss) "
            f"or 'compressed-tensors' with format '{CT_MXFP4_FORMAT}': use a BF16 or MXFP4 checkpoint"
        )
    groups = quantization_config.get("config_groups") or {}
    formats = {quantization_config.get("format")} | {g.get("format") for g in groups.values()}
    formats.discard(None)
    if formats == {CT_INT_FORMAT}:
        int_scheme(quantization_config)
        return LAYOUT_CT_INT
    if formats != {CT_MXFP4_FORMAT}:
        raise ShardwiseError(
            f"compressed-tensors quantization_config.format {sorted(formats)} is unsupported, expected "
            f"'{CT_MXFP4_FORMAT}' in every config group: use an MXFP4 or BF16 checkpoint"
        )
    for name, group in groups.items():
        group_size = (group.get("weights") or {}).get("group_size", BLOCK_SIZE)
        if group_size != BLOCK_SIZE:
            raise ShardwiseError(
                f"compressed-tensors config_groups.{name}.weights.group_size is {group_size}, expected {BLOCK_SIZE} "
                f"for {CT_MXFP4_FORMAT}: the checkpoint is not MXFP4"
            )
    return LAYOUT_COMPRESSED_TENSORS


def int_scheme(quantization_config: Mapping[str, Any]) -> tuple[int, int | None]:
    """(bits, group size or None for per-channel) of a ``pack-quantized`` config: one scheme in
    every config group, integer, symmetric, 8 bits per channel or 4/8 bits per group; anything
    else is a one-line ShardwiseError naming the field."""
    schemes = set()
    for name, group in (quantization_config.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        field = f"quantization_config.config_groups.{name}.weights"
        if w.get("type", "int") != "int" or not w.get("symmetric", True) or w.get("num_bits") not in (4, 8):
            raise ShardwiseError(
                f"{field} is {w.get('num_bits')}-bit {w.get('type')}, symmetric={w.get('symmetric')}: the runtime reads "
                "symmetric int8 or int4 pack-quantized weights, use such a checkpoint or a BF16 one"
            )
        strategy = w.get("strategy")
        if strategy not in ("channel", "group") or (strategy == "group" and not isinstance(w.get("group_size"), int)):
            raise ShardwiseError(f"{field}.strategy is {strategy!r}: expected 'channel' or 'group' with a group_size")
        schemes.add((w["num_bits"], w["group_size"] if strategy == "group" else None))
    if len(schemes) != 1:
        raise ShardwiseError(
            f"quantization_config.config_groups hold {len(schemes)} weight schemes {sorted(schemes, key=str)}: "
            "the runtime reads exactly one pack-quantized scheme per checkpoint"
        )
    return schemes.pop()


def gpt_oss_tensor_names(prefix: str) -> tuple[str, str]:
    """(`{prefix}_blocks`, `{prefix}_scales`) for a gpt-oss expert projection prefix."""
    return prefix + GPT_OSS_BLOCKS_SUFFIX, prefix + GPT_OSS_SCALES_SUFFIX


def compressed_tensors_names(module: str) -> tuple[str, str]:
    """(`{module}.weight_packed`, `{module}.weight_scale`) for a compressed-tensors Linear."""
    return f"{module}.{CT_PACKED_NAME}", f"{module}.{CT_SCALE_NAME}"


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _shape_str(names: tuple[str, ...], sizes: tuple[int | None, ...]) -> str:
    """'[E, out, in/32]', followed by ' = [4, 64, 3]' with the sizes that are known."""
    symbolic = "[" + ", ".join(names) + "]"
    concrete = "[" + ", ".join(n if s is None else str(s) for n, s in zip(names, sizes, strict=True)) + "]"
    return symbolic if concrete == symbolic else f"{symbolic} = {concrete}"


def _check_tensor(name: str, tensor: Any, dims: tuple[str, ...], sizes: tuple[int | None, ...], fix: str) -> None:
    """Raise unless tensor is uint8 with len(dims) dims matching every known size."""
    expected = f"uint8 with shape {_shape_str(dims, sizes)}"
    if _dtype_name(tensor) != "uint8":
        raise ShardwiseError(f"tensor '{name}' has dtype {_dtype_name(tensor)}, expected {expected}: {fix}")
    shape = tuple(tensor.shape)
    if len(shape) != len(dims) or any(s is not None and s != got for s, got in zip(sizes, shape, strict=False)):
        raise ShardwiseError(f"tensor '{name}' has shape {list(shape)}, expected {expected}: {fix}")


def check_gpt_oss_pair(
    prefix: str,
    blocks: Any,
    scales: Any,
    experts: int | None = None,
    out_features: int | None = None,
    in_features: int | None = None,
) -> None:
    """Check a gpt-oss `{prefix}_blocks` / `{prefix}_scales` pair; raise a one-line ShardwiseError.

    blocks must be uint8 [E, out, in/32, 16] and scales uint8 [E, out, in/32], agreeing
    with each other and with the given E, out and in (elements, not bytes).
    """
    blocks_name, scales_name = gpt_oss_tensor_names(prefix)
    if in_features is not None and in_features % BLOCK_SIZE:
        raise ShardwiseError(
            f"in_features {in_features} of '{prefix}' is not a multiple of {BLOCK_SIZE}: MXFP4 needs whole blocks"
        )
    groups = None if in_features is None else in_features // BLOCK_SIZE
    fix = "read the checkpoint tensor as stored (raw uint8, no cast or transpose)"
    sizes = (experts, out_features, groups, BYTES_PER_BLOCK)
    _check_tensor(blocks_name, blocks, ("E", "out", "in/32", "16"), sizes, fix)
    e, out, g, _ = tuple(blocks.shape)
    _check_tensor(scales_name, scales, ("E", "out", "in/32"), (e, out, g), fix)


def check_compressed_tensors_pair(
    module: str,
    weight_packed: Any,
    weight_scale: Any,
    out_features: int | None = None,
    in_features: int | None = None,
) -> None:
    """Check a compressed-tensors MXFP4 Linear; raise a one-line ShardwiseError.

    weight_packed must be uint8 [out, in/2] and weight_scale uint8 [out, in/32],
    agreeing with each other and with the given out and in (elements, not bytes).
    """
    packed_name, scale_name = compressed_tensors_names(module)
    if in_features is not None and in_features % BLOCK_SIZE:
        raise ShardwiseError(
            f"in_features {in_features} of '{module}' is not a multiple of {BLOCK_SIZE}: MXFP4 needs whole blocks"
        )
    half = None if in_features is None else in_features // 2
    fix = "read the checkpoint tensor as stored (raw uint8, no cast or transpose)"
    _check_tensor(packed_name, weight_packed, ("out", "in/2"), (out_features, half), fix)
    out, packed_in = tuple(weight_packed.shape)
    if packed_in % BYTES_PER_BLOCK:
        raise ShardwiseError(
            f"tensor '{packed_name}' has shape {[out, packed_in]}, expected uint8 with shape [out, in/2] where in "
            f"is a multiple of {BLOCK_SIZE}: {fix}"
        )
    _check_tensor(scale_name, weight_scale, ("out", "in/32"), (out, packed_in // BYTES_PER_BLOCK), fix)


def packed_rows_to_blocks(weight_packed: np.ndarray) -> np.ndarray:
    """compressed-tensors weight_packed [..., in/2] as codec blocks [..., in/32, 16] (a view)."""
    return weight_packed.reshape(weight_packed.shape[:-1] + (-1, BYTES_PER_BLOCK))


def blocks_to_packed_rows(blocks: np.ndarray) -> np.ndarray:
    """Codec blocks [..., in/32, 16] as compressed-tensors weight_packed [..., in/2] (a view)."""
    return blocks.reshape(blocks.shape[:-2] + (-1,))


def interleave_gate_up(gate: np.ndarray, up: np.ndarray, axis: int = 1) -> np.ndarray:
    """Merge gate and up along axis into gpt-oss order: index 2j = gate_j, 2j+1 = up_j.

    axis is the output-row axis: 1 for `*_blocks` [E, out, in/32, 16], `*_scales`
    [E, out, in/32] and biases [E, out]; −1 for transformers' dequantized [E, in, out].
    """
    if gate.shape != up.shape:
        raise ShardwiseError(
            f"gate has shape {list(gate.shape)} but up has {list(up.shape)}, expected equal shapes: "
            "pass the two halves of one projection"
        )
    stacked = np.stack([gate, up], axis=(axis % gate.ndim) + 1)
    shape = list(gate.shape)
    shape[axis] *= 2
    return stacked.reshape(shape)


def deinterleave_gate_up(gate_up: np.ndarray, axis: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Split a gpt-oss gate_up tensor along axis into (gate, up): even and odd indices."""
    if gate_up.shape[axis] % 2:
        raise ShardwiseError(
            f"gate_up has {gate_up.shape[axis]} rows on axis {axis}, expected an even count: "
            "pass the fused gate_up projection"
        )
    index = [slice(None)] * gate_up.ndim
    index[axis] = slice(0, None, 2)
    gate = gate_up[tuple(index)]
    index[axis] = slice(1, None, 2)
    return gate, gate_up[tuple(index)]
