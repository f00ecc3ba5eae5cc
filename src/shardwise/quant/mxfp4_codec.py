"""MXFP4 codec (OCP Microscaling Formats (MX) v1.0), numpy only.

A block holds BLOCK_SIZE (32) FP4 E2M1 elements (ELEMENT_BITS = 4 bits each) that
share one E8M0 scale byte (SCALE_BITS = 8 bits): value = element × 2^(byte − 127),
byte 0xFF is NaN. That is 4 + 8/32 = 4.25 bits per weight.

Blocks run along the last (input) dimension. Two elements share a byte: element 2i
sits in the low nibble, element 2i+1 in the high nibble (the gpt-oss and
compressed-tensors convention). A nibble is sign (bit 3) plus a 3-bit magnitude code
indexing E2M1_MAGNITUDES.

Scale choice when encoding:
- "ocp" (default): shared exponent = floor(log2(amax)) − 2, where 2 is the largest
  E2M1 exponent; elements are x / 2^e rounded to nearest, ties to even, and values
  beyond ±6 saturate to ±6 (OCP MX v1.0 §6.3). Up to one element per block can
  saturate, since amax / 2^e lies in [4, 8). torchao's mx_formats `ScaleCalculationMode.FLOOR`
  and triton_kernels' `DequantScaleRoundingMode.ROUND_DOWN` compute this exponent.
- "up": shared exponent = ceil(log2(amax / 6)), so |x| / 2^e ≤ 6 and nothing
  saturates, at the cost of a coarser grid for blocks whose amax lies in (4, 6]·2^k.
  This is the default of triton_kernels `downcast_to_mxfp` / `downcast_to_mxfp_torch`
  (`DequantScaleRoundingMode.ROUND_UP`, the Triton MoE kernels transformers uses to
  quantize gpt-oss experts) and of NVIDIA ModelOpt's `MXFP4QTensor.quantize`
  (ceil(log2(amax / 6))). ModelOpt also breaks element ties downwards (0.75 → 0.5);
  this codec rounds ties to even in both modes.

Both exponents are clamped to the E8M0 range [−127, 127]. An all-zero block gets
scale byte 0x00 and zero elements; a block holding NaN or ±inf gets scale byte 0xFF
(decodes to NaN), because E2M1 has no inf or NaN.
"""

import numpy as np

from shardwise.errors import ShardwiseError

BLOCK_SIZE = 32
"""Elements sharing one scale."""
ELEMENT_BITS = 4
"""Bits per E2M1 element."""
SCALE_BITS = 8
"""Bits per E8M0 block scale."""

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX = 2
"""Exponent of the largest E2M1 normal (4 = 2^2); OCP subtracts it from floor(log2 amax)."""
E2M1_MAX = 6.0
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""Value of magnitude codes 0..7; code | 0x8 is the negative."""
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)
"""Value of each 4-bit code 0..15 (code 8 is −0.0)."""

# Round-to-nearest-even thresholds between neighbouring magnitudes. At a midpoint the
# even code wins: 0.25→0, 0.75→1.0 (code 2), 1.25→1.0, 1.75→2.0, 2.5→2.0, 3.5→4.0,
# 5→4.0. So a midpoint moves up (>=) only where the upper neighbour has the even code.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

SCALE_ROUNDINGS = ("ocp", "up")


def check_scale_rounding(scale_rounding: str) -> None:
    """Raise ShardwiseError unless scale_rounding is one of SCALE_ROUNDINGS."""
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ShardwiseError(
            f"scale_rounding '{scale_rounding}' is unknown: expected one of {', '.join(SCALE_ROUNDINGS)}"
        )


def e2m1_codes(q: np.ndarray) -> np.ndarray:
    """4-bit E2M1 codes (uint8, 0..15) of already-scaled values, round to nearest even.

    Magnitudes above 6 saturate to 6. The sign bit is set for negative values, so a
    small negative value that rounds to zero becomes −0 (code 8), as IEEE rounding
    would; −0.0 itself stays +0.
    """
    a = np.abs(q)
    mag = np.zeros(q.shape, dtype=np.uint8)
    for mid, up_on_tie in _MIDPOINTS:
        mag += (a >= mid) if up_on_tie else (a > mid)
    return mag | ((q < 0).astype(np.uint8) << 3)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes [..., 2k] into bytes [..., k]: element 2i low, 2i+1 high."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Unpack bytes [..., k] into 4-bit codes [..., 2k] (inverse of pack_nibbles)."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def block_exponents(amax: np.ndarray, scale_rounding: str = "ocp") -> np.ndarray:
    """Shared exponent (int32, before the 127 bias) for finite, positive block maxima.

    "ocp": floor(log2 amax) − 2; "up": the smallest e with amax ≤ 6·2^e. Computed
    exactly with frexp (no log2 rounding), clamped to [−127, 127].
    """
    check_scale_rounding(scale_rounding)
    if scale_rounding == "ocp":
        _, exp = np.frexp(amax)  # amax = m·2^exp with m in [0.5, 1): floor(log2 amax) = exp − 1
        e = exp.astype(np.int64) - 1 - E2M1_EMAX
    else:
        # 2^(exp−1) ≤ amax/6 < 2^exp, so exp is the ceiling unless amax/6 is a power of
        # two; the exact comparison below steps down in that case (and corrects any
        # rounding of the division, since 6·2^k is exact in float64).
        _, exp = np.frexp(amax / E2M1_MAX)
        e = exp.astype(np.int64)
        e -= np.ldexp(E2M1_MAX, e - 1) >= amax
    return np.clip(e, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)


def check_float_input(x: np.ndarray, block: int, what: str) -> None:
    """Raise ShardwiseError unless x is a floating array [..., n] with n a multiple of block."""
    if not np.issubdtype(x.dtype, np.floating):
        raise ShardwiseError(
            f"{what} input has dtype {x.dtype}, expected float16/float32/float64 with shape [..., n]: cast it first"
        )
    if x.ndim == 0 or x.shape[-1] % block:
        raise ShardwiseError(
            f"{what} input has shape {list(x.shape)}, expected [..., n] with n a multiple of {block}: "
            f"pad the last dimension to a multiple of {block}"
        )


def encode(x: np.ndarray, scale_rounding: str = "ocp") -> tuple[np.ndarray, np.ndarray]:
    """Quantize x [..., n] to MXFP4 along the last dimension.

    Returns (blocks uint8 [..., n/32, 16], scales uint8 [..., n/32]); 4.25 bits per
    weight in total. See the module docstring for the two scale roundings.
    """
    x = np.asarray(x)
    check_float_input(x, BLOCK_SIZE, "MXFP4 encode")
    check_scale_rounding(scale_rounding)
    xb = x.astype(np.float64).reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    amax = np.max(np.abs(xb), axis=-1)
    finite = np.isfinite(amax)
    nonzero = finite & (amax > 0)
    e = block_exponents(np.where(nonzero, amax, 1.0), scale_rounding)
    e = np.where(nonzero, e, -E8M0_BIAS)
    q = np.ldexp(np.where(finite[..., None], xb, 0.0), -e[..., None])
    blocks = pack_nibbles(e2m1_codes(q))
    scales = np.where(finite, e + E8M0_BIAS, E8M0_NAN).astype(np.uint8)
    return blocks, scales


def e8m0_to_float(scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """2^(byte − 127) for each E8M0 scale byte, NaN for 0xFF, in dtype (float32 or float64)."""
    with np.errstate(over="ignore"):
        out = np.ldexp(np.ones(scales.shape, dtype=dtype), scales.astype(np.int32) - E8M0_BIAS)
    out[scales == E8M0_NAN] = np.nan
    return out


_DECODE_DTYPES = (np.float16, np.float32, np.float64)


def _is_uint8(array) -> bool:
    """True for a numpy array or a torch tensor of unsigned bytes."""
    return str(array.dtype).removeprefix("torch.") == "uint8"


def check_blocks_scales(blocks, scales, block_bytes: int = BLOCK_SIZE // 2) -> None:
    """Raise ShardwiseError unless blocks is uint8 [..., G, block_bytes] and scales uint8 [..., G]
    (numpy arrays or torch tensors)."""
    if not _is_uint8(blocks) or blocks.ndim < 2 or blocks.shape[-1] != block_bytes:
        raise ShardwiseError(
            f"blocks have dtype {blocks.dtype} and shape {list(blocks.shape)}, expected uint8 with shape "
            f"[..., G, {block_bytes}]: pass the packed bytes, {2 * block_bytes} elements per block"
        )
    if not _is_uint8(scales) or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ShardwiseError(
            f"scales have dtype {scales.dtype} and shape {list(scales.shape)}, expected uint8 with shape "
            f"{list(blocks.shape[:-1])} (blocks.shape[:-1]): pass one scale byte per block"
        )


def decode(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Dequantize MXFP4 blocks uint8 [..., G, 16] and scales uint8 [..., G] to [..., G·32].

    Each value is the exact product element × 2^(byte − 127) rounded once to dtype
    (float16, float32 or float64); values at or above 2^128 overflow to inf in float32
    exactly as `transformers.integrations.mxfp4.convert_moe_packed_tensors` does.
    Scale byte 0xFF decodes to NaN.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    check_blocks_scales(blocks, scales)
    dtype = np.dtype(dtype)
    if dtype not in _DECODE_DTYPES:
        raise ShardwiseError(f"decode dtype {dtype} is unsupported, expected float16, float32 or float64")
    # float32 holds every product exactly (or overflows to inf at ≥ 2^128), so one
    # rounding to float16 afterwards equals rounding the exact value.
    work = np.float64 if dtype == np.float64 else np.float32
    values = E2M1_VALUES.astype(work)[unpack_nibbles(blocks)]
    with np.errstate(over="ignore", invalid="ignore"):
        values *= e8m0_to_float(scales, work)[..., None]
        return values.reshape(blocks.shape[:-2] + (blocks.shape[-2] * BLOCK_SIZE,)).astype(dtype, copy=False)
