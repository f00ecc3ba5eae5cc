"""NVFP4 codec, numpy only.

Blocks of BLOCK_SIZE (16) FP4 E2M1 elements (4 bits each) share one FP8 E4M3 block
scale (8 bits), and the whole tensor shares one fp32 global scale:
value = element × e4m3(block byte) × global_scale. That is 4 + 8/16 = 4.5 bits per
weight plus 32 bits per tensor.

Scales follow NVIDIA TensorRT Model Optimizer (ModelOpt) `NVFP4QTensor`, also used by
TensorRT-LLM checkpoints: global_scale = amax / (6 · 448) (`weights_scaling_factor_2`),
block scale = block_amax / (6 · global_scale) rounded to E4M3
(`weights_scaling_factor`), elements = x / (e4m3(block scale) · global_scale) rounded
to E2M1. So the largest block scale is 448 and each block's amax maps near 6. An
all-zero tensor gets global_scale 1.0 (ModelOpt does the same in its ONNX export);
an all-zero block gets scale byte 0x00. Elements round to nearest with ties to even
(ModelOpt's searchsorted rounding breaks ties downwards) and saturate at ±6.

Packing is the MXFP4 one: element 2i in the low nibble, 2i+1 in the high nibble;
blocks are uint8 [..., n/16, 8] and block scales uint8 [..., n/16] holding E4M3 bytes.
"""

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.quant.mxfp4_codec import (
    E2M1_MAX,
    E2M1_VALUES,
    check_float_input,
    check_blocks_scales,
    e2m1_codes,
    pack_nibbles,
    unpack_nibbles,
)

BLOCK_SIZE = 16
"""Elements sharing one E4M3 block scale."""
ELEMENT_BITS = 4
"""Bits per E2M1 element."""
SCALE_BITS = 8
"""Bits per E4M3 block scale."""
GLOBAL_SCALE_BITS = 32
"""Bits of the per-tensor fp32 global scale."""

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
"""E4M3 (the "fn" variant) has no inf; 0x7F and 0xFF are NaN."""
_E4M3_MANTISSA_BITS = 3
_E4M3_MIN_NORMAL_EXP = -6

# Value of every non-negative finite E4M3 code 0x00..0x7E, increasing with the code.
_E4M3_POSITIVE = np.array(
    [
        np.ldexp(m / 8.0, -6) if e == 0 else np.ldexp(1.0 + m / 8.0, e - 7)
        for e in range(16)
        for m in range(8)
    ][:E4M3_NAN]
)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """Float32 value of each E4M3 byte (sign bit 7, 4 exponent bits with bias 7, 3 mantissa bits).

    Exponent field 0 is subnormal (m/8 · 2^−6); 0x7F and 0xFF are NaN; there is no inf.
    """
    codes = np.asarray(codes, dtype=np.uint8)
    table = np.concatenate([_E4M3_POSITIVE, [np.nan], -_E4M3_POSITIVE, [np.nan]]).astype(np.float32)
    return table[codes]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """E4M3 bytes (uint8) of x: round to nearest, ties to even, saturate at ±448, NaN → 0x7F.

    Infinities saturate to ±448 too, since E4M3 has no inf; −0.0 keeps its sign (0x80).
    """
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    _, exp = np.frexp(np.where(a > 0, a, 1.0))
    quantum_exp = np.maximum(exp - 1, _E4M3_MIN_NORMAL_EXP) - _E4M3_MANTISSA_BITS
    with np.errstate(invalid="ignore"):
        rounded = np.ldexp(np.rint(np.ldexp(np.where(np.isfinite(a), a, E4M3_MAX), -quantum_exp)), quantum_exp)
    rounded = np.minimum(rounded, E4M3_MAX)
    codes = np.searchsorted(_E4M3_POSITIVE, rounded).astype(np.uint8)
    codes |= np.signbit(x).astype(np.uint8) << 7
    return np.where(np.isnan(x), E4M3_NAN, codes).astype(np.uint8)


def global_scale_of(x: np.ndarray) -> np.float32:
    """Per-tensor fp32 scale amax / (6 · 448), or 1.0 for an all-zero tensor."""
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    return np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)


def encode(x: np.ndarray, global_scale: float | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Quantize x [..., n] (finite floats) to NVFP4 along the last dimension.

    Returns (blocks uint8 [..., n/16, 8], block scales uint8 E4M3 [..., n/16],
    global_scale fp32); 4.5 bits per weight plus 32 bits per tensor. global_scale
    defaults to global_scale_of(x); pass one to share it across tensors (e.g. the
    fused gate and up projections).
    """
    x = np.asarray(x)
    check_float_input(x, BLOCK_SIZE, "NVFP4 encode")
    if not np.all(np.isfinite(x)):
        raise ShardwiseError("NVFP4 encode input holds NaN or inf, expected finite floats: clean the tensor first")
    g = global_scale_of(x) if global_scale is None else np.float32(global_scale)
    if not (np.isfinite(g) and g > 0):
        raise ShardwiseError(f"NVFP4 global_scale is {g}, expected a finite positive fp32: use amax / (6 * 448)")
    xb = x.astype(np.float64).reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    amax = np.max(np.abs(xb), axis=-1)
    scales = e4m3_encode(amax / (E2M1_MAX * np.float64(g)))
    step = e4m3_decode(scales).astype(np.float64) * np.float64(g)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, xb / step[..., None], 0.0)
    return pack_nibbles(e2m1_codes(q)), scales, g


def decode(blocks: np.ndarray, scales: np.ndarray, global_scale: float, dtype=np.float32) -> np.ndarray:
    """Dequantize NVFP4 blocks uint8 [..., G, 8], E4M3 scales uint8 [..., G] to [..., G·16].

    Computes element × block scale exactly in float32, then multiplies by the fp32
    global scale (one rounding) and casts to dtype (float16 or float32).
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    check_blocks_scales(blocks, scales, BLOCK_SIZE // 2)
    dtype = np.dtype(dtype)
    if dtype not in (np.float16, np.float32):
        raise ShardwiseError(f"NVFP4 decode dtype {dtype} is unsupported, expected float16 or float32")
    values = E2M1_VALUES[unpack_nibbles(blocks)] * e4m3_decode(scales)[..., None]
    values *= np.float32(global_scale)
    return values.reshape(blocks.shape[:-2] + (blocks.shape[-2] * BLOCK_SIZE,)).astype(dtype, copy=False)
