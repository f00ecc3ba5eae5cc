"""Weight-only integer formats (int8 per output channel, int4 per group), numpy only, in the
layout compressed-tensors calls ``pack-quantized`` (what llm-compressor's W8A16 / W4A16
schemes write and vLLM's ``CompressedTensorsWNA16`` reads).

A weight [out, in] is stored as
- ``weight_packed`` int32 [out, in · bits / 32]: element i of a row sits at bits
  ``i · bits`` … ``i · bits + bits − 1`` of the row's int32 words, stored unsigned with the
  offset ``2^(bits − 1)`` (compressed-tensors ``pack_to_int32``); read as little-endian bytes
  that is one byte per element for int8 (value = byte − 128) and, for int4, element 2j in the
  low nibble of byte j and 2j+1 in the high one (value = nibble − 8);
- ``weight_scale`` [out, in / group] (``group`` = in for per-channel int8): value = q × scale;
- ``weight_shape`` int64 [2]: the logical shape.

Encoding is symmetric: scale = amax / qmax (127 or 7) rounded to the scale dtype (bfloat16
here, as llm-compressor writes for bfloat16 models), q = round-half-even(w / scale) clipped to
[−qmax − 1, qmax]. Bits per weight: ``bits + 16 / group`` with bfloat16 scales.
"""

from __future__ import annotations

import numpy as np

from shardwise.errors import ShardwiseError

SUPPORTED_BITS = (4, 8)
GROUP_MULTIPLE = 32
"""Groups (and per-channel rows) must be a multiple of this many inputs (the CPU kernel's chunk)."""


def qmax(bits: int) -> int:
    """Largest stored magnitude used by the symmetric encoder: 127 (int8) or 7 (int4)."""
    return (1 << (bits - 1)) - 1


def check_scheme(bits: int, group: int, in_features: int, name: str = "weight") -> None:
    """One-line ShardwiseError unless ``bits``/``group`` suit a weight with ``in_features`` inputs."""
    if bits not in SUPPORTED_BITS:
        raise ShardwiseError(f"num_bits {bits} is not supported: use 8 (per channel) or 4 (per group)")
    if group <= 0 or group % GROUP_MULTIPLE or in_features % group:
        raise ShardwiseError(
            f"tensor '{name}' has {in_features} inputs, expected a multiple of the group size {group} "
            f"(itself a multiple of {GROUP_MULTIPLE}): keep it float or pick another --group-size"
        )


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def encode(weight: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [out, in], scale float32 [out, in / group] holding bfloat16 values) of a float weight."""
    out, inp = weight.shape
    check_scheme(bits, group, inp)
    w = weight.astype(np.float32).reshape(out, inp // group, group)
    amax = np.abs(w).max(axis=-1)
    scale = _bf16_round(amax / qmax(bits))
    scale = np.where(scale == 0, np.float32(1.0), scale)  # an all-zero group: any scale, q = 0
    q = np.clip(np.rint(w / scale[..., None]), -qmax(bits) - 1, qmax(bits)).astype(np.int8)
    return q.reshape(out, inp), scale.astype(np.float32)


def decode(q: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Float weight [out, in] = q × its group's scale (computed in float64, then cast)."""
    out, inp = q.shape
    groups = scale.shape[-1]
    w = q.reshape(out, groups, inp // groups).astype(np.float64) * scale.astype(np.float64)[..., None]
    return w.reshape(out, inp).astype(dtype)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """int8 values [out, in] → compressed-tensors int32 words [out, in · bits / 32]."""
    out, inp = q.shape
    unsigned = (q.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(unsigned).view("<i4")
    pairs = unsigned.reshape(out, inp // 2, 2)
    return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view("<i4")


def packed_bytes(packed: np.ndarray) -> np.ndarray:
    """The int32 words as their little-endian bytes [out, in · bits / 8] (a view)."""
    return np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """compressed-tensors int32 words [out, in · bits / 32] → int8 values [out, in]."""
    raw = packed_bytes(packed)
    if bits == 8:
        return (raw.astype(np.int16) - 128).astype(np.int8)
    nibbles = np.stack([raw & 15, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    return (nibbles.astype(np.int16) - 8).astype(np.int8)
