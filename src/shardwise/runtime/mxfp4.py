"""MXFP4 on the torch side: decode packed blocks and multiply while weights stay packed.

Weights stay in memory as uint8 blocks [out, in/32, 16] (4 bits per element) plus
uint8 E8M0 scales [out, in/32]: 4.25 bits per weight. Each call decodes them to the
activation dtype and runs one dense matmul, so nothing dequantized is kept.

Decoding uses two lookup tables gathered with `F.embedding` (the fastest eager CPU
variant measured; plain advanced indexing and `torch.ldexp` were 3–6× slower):
byte → its two E2M1 values (low nibble = even element) and scale byte →
2^(byte − 127) (NaN for 0xFF). The product of an E2M1 value and a power of two is
exact in float32 and bfloat16 (or overflows to inf at ≥ 2^128, like
`transformers.integrations.mxfp4.convert_moe_packed_tensors`), so the result is
bit-identical to `shardwise.quant.mxfp4.decode`. float16 cannot hold the scales, so
it is computed in float32 and rounded once.
"""

import torch
import torch.nn.functional as F

from shardwise.errors import ShardwiseError
from shardwise.quant.mxfp4 import BLOCK_SIZE, E2M1_VALUES, E8M0_BIAS, E8M0_NAN

_BYTES_PER_BLOCK = BLOCK_SIZE // 2
_LUTS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _luts(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair table [256, 2], scale table [256, 1]) in dtype on device, built once."""
    key = (device, dtype)
    if key not in _LUTS:
        values = torch.from_numpy(E2M1_VALUES).double()
        codes = torch.arange(256)
        pairs = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1)
        scales = torch.ldexp(torch.ones(256, dtype=torch.float64), codes - E8M0_BIAS)
        scales[E8M0_NAN] = float("nan")
        _LUTS[key] = (pairs.to(device=device, dtype=dtype), scales.to(device=device, dtype=dtype)[:, None])
    return _LUTS[key]


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != _BYTES_PER_BLOCK:
        raise ShardwiseError(
            f"MXFP4 blocks have dtype {blocks.dtype} and shape {list(blocks.shape)}, expected torch.uint8 with "
            f"shape [..., in/32, {_BYTES_PER_BLOCK}]: pass the packed checkpoint bytes"
        )
    if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
        raise ShardwiseError(
            f"MXFP4 scales have dtype {scales.dtype} and shape {list(scales.shape)}, expected torch.uint8 with "
            f"shape {list(blocks.shape[:-1])} (blocks.shape[:-1]): pass one E8M0 byte per block"
        )


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize blocks uint8 [..., G, 16] and scales uint8 [..., G] to [..., G·32] in dtype.

    dtype is bfloat16, float16, float32 or float64; scale byte 0xFF gives NaN.
    """
    _check(blocks, scales)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ShardwiseError(
            f"MXFP4 decode dtype {dtype} is unsupported, expected bfloat16, float16, float32 or float64"
        )
    work = torch.float32 if dtype == torch.float16 else dtype
    pairs, scale_lut = _luts(blocks.device, work)
    values = F.embedding(blocks.int(), pairs).reshape(*blocks.shape[:-1], BLOCK_SIZE)
    values = values * F.embedding(scales.int(), scale_lut)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE).to(dtype)


def mxfp4_matmul(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ Wᵀ (+ bias) for an MXFP4 weight W [out, in], in x's dtype.

    blocks uint8 [out, in/32, 16] and scales uint8 [out, in/32] stay packed; W is
    decoded to x.dtype for this call only. bias is [out] or None.
    """
    _check(blocks, scales)
    if blocks.dim() != 3 or x.shape[-1] != blocks.shape[1] * BLOCK_SIZE:
        raise ShardwiseError(
            f"MXFP4 matmul got x of shape {list(x.shape)} and blocks {list(blocks.shape)}, expected x [..., in] "
            f"and blocks [out, in/32, {_BYTES_PER_BLOCK}] with the same in: check the weight's input dimension"
        )
    return F.linear(x, decode(blocks, scales, x.dtype), None if bias is None else bias.to(x.dtype))
