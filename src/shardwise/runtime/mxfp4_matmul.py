"""MXFP4 on the torch side: decode packed blocks and multiply while weights stay packed.

Weights stay in memory as uint8 blocks [out, in/32, 16] (4 bits per element) plus
uint8 E8M0 scales [out, in/32]: 4.25 bits per weight. Each call decodes them to the
activation dtype and runs one dense matmul, so nothing dequantized is kept.

Decoding gathers from two 256-entry lookup tables with `torch.index_select`: byte →
its two E2M1 values (low nibble = even element) stored as *one* integer (the bit
pattern of two float32 values as an int64, or of two bfloat16 values as an int32), so
one gather writes both elements; then scale byte → 2^(byte − 127) (NaN for 0xFF)
multiplied in place. On one CPU thread this decodes a 2880×2880 weight 2–4× faster
than gathering float pairs with `F.embedding` (see benchmarks/bench_mxfp4.py). The
product of an E2M1 value and a power of two is exact in float32 and bfloat16 (or
overflows to inf at ≥ 2^128, like
`transformers.integrations.mxfp4.convert_moe_packed_tensors`), so the result is
bit-identical to `shardwise.quant.mxfp4_codec.decode`. float16 cannot hold the scales, so
it is computed in float32 and rounded once; float64 gathers float pairs.

On an AVX-512 CPU, float32 / bfloat16 passes of fewer than ``int_matmul.GEMM_ROWS`` rows (decode steps,
speculative verify) — and every pass under ``exact.row_blocked()`` — multiply the packed bytes directly
with ``int_matmul``'s compiled kernel (uint8 E8M0 scales select MXFP4: E2M1 values, exact products, each
row summed in one fixed order, nothing decoded to memory): in ``benchmarks/bench_mxfp4.py``'s decode the
dense decode-then-matmul made MXFP4 experts ~3x slower per token than BF16 ones. With
``SHARDWISE_INT_ACTIVATIONS=int8`` (``int_matmul.activations``) rows whose width is a multiple of 128 are rounded
to int8 per 32-block in the kernel and multiplied as integers (llama.cpp's MXFP4 x Q8_0).
"""

import torch
import torch.nn.functional as F

from shardwise.errors import ShardwiseError
from shardwise.runtime import cpp_ops
from shardwise.runtime.int_matmul import SOURCE, activations, kernel_rows, runs_as_gemm
from shardwise.quant.mxfp4_codec import BLOCK_SIZE, E2M1_VALUES, E8M0_BIAS, E8M0_NAN, check_blocks_scales

_BYTES_PER_BLOCK = BLOCK_SIZE // 2
_LUTS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
_PAIR_INT = {torch.float32: torch.int64, torch.bfloat16: torch.int32}
"""Integer type holding the bit patterns of two values of each float type."""


def _luts(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair table [256], or [256, 2] for float64; scale table [256]) on device, built once.

    The pair table holds byte b's two values (low nibble first) as one integer for
    float32 / bfloat16, so a gather writes both.
    """
    key = (device, dtype)
    if key not in _LUTS:
        values = torch.from_numpy(E2M1_VALUES).double()
        codes = torch.arange(256)
        pairs = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1).to(dtype).contiguous()
        if dtype in _PAIR_INT:
            pairs = pairs.view(_PAIR_INT[dtype]).reshape(256)
        scales = torch.ldexp(torch.ones(256, dtype=torch.float64), codes - E8M0_BIAS)
        scales[E8M0_NAN] = float("nan")
        _LUTS[key] = (pairs.to(device), scales.to(device=device, dtype=dtype))
    return _LUTS[key]


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize blocks uint8 [..., G, 16] and scales uint8 [..., G] to [..., G·32] in dtype.

    dtype is bfloat16, float16, float32 or float64; scale byte 0xFF gives NaN.
    """
    check_blocks_scales(blocks, scales)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ShardwiseError(
            f"MXFP4 decode dtype {dtype} is unsupported, expected bfloat16, float16, float32 or float64"
        )
    work = torch.float32 if dtype == torch.float16 else dtype
    pairs, scale_lut = _luts(blocks.device, work)
    values = torch.index_select(pairs, 0, blocks.reshape(-1).int()).view(work)
    values = values.view(-1, BLOCK_SIZE).mul_(torch.index_select(scale_lut, 0, scales.reshape(-1).int())[:, None])
    return values.view(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE).to(dtype)


def mxfp4_matmul(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ Wᵀ (+ bias) for an MXFP4 weight W [out, in], in x's dtype.

    blocks uint8 [out, in/32, 16] and scales uint8 [out, in/32] stay packed; W is
    decoded to x.dtype for this call only. bias is [out] or None.
    """
    check_blocks_scales(blocks, scales)
    if blocks.dim() != 3 or x.shape[-1] != blocks.shape[1] * BLOCK_SIZE:
        raise ShardwiseError(
            f"MXFP4 matmul got x of shape {list(x.shape)} and blocks {list(blocks.shape)}, expected x [..., in] "
            f"and blocks [out, in/32, {_BYTES_PER_BLOCK}] with the same in: check the weight's input dimension"
        )
    rows = x.reshape(-1, x.shape[-1])
    op = packed_kernel(rows, blocks)
    if op is None:
        return F.linear(x, decode(blocks, scales, x.dtype), None if bias is None else bias.to(x.dtype))
    lines = whole_lines(rows.shape[1])
    rows, flags = kernel_rows(rows, 4, lines and activations() == "int8", lines)
    y = op(rows, blocks.reshape(blocks.shape[0], -1), scales.contiguous(), 4, BLOCK_SIZE, x.dtype, *flags)
    y = y.view(*x.shape[:-1], blocks.shape[0])
    return y if bias is None else y + bias.to(x.dtype)


def whole_lines(in_features: int) -> bool:
    """Whether MXFP4 rows of ``in_features`` are whole 128-weight lines: the int kernel's int8 rows and integer grids
    take them (``int_matmul.kernel_rows``' ``lines``)."""
    return in_features % 128 == 0


def packed_kernel(rows: torch.Tensor, blocks: torch.Tensor):
    """``int_matmul``'s compiled op where it runs these rows on the packed bytes (see the module docstring),
    else None: not an AVX-512 CPU or no compiler, another device or dtype, non-contiguous blocks, or a pass of
    ``GEMM_ROWS`` or more rows outside ``exact.row_blocked()`` (one dense product is faster there)."""
    if (rows.device.type != "cpu" or rows.dtype not in (torch.float32, torch.bfloat16) or not blocks.is_contiguous()
            or runs_as_gemm(rows)
            or torch.backends.cpu.get_cpu_capability() != "AVX512"):
        return None
    return cpp_ops.optional_op(SOURCE, "shardwise_int", "int_matmul")
