"""Row-invariant linear layers, so a k+1-position verify pass equals k+1 single-token steps.

Greedy speculative decoding is exact only if verifying k+1 positions in one forward pass
gives, for every position, bit-identical logits to decoding that position alone. Three
things break that on CPU:

- **GEMM shape.** A linear layer over M rows does not return, for a given row, the same
  bits for every M: MKL uses different kernels for small M (M = 1 is a GEMV), and each
  kernel accumulates the K products in its own order. Measured here (torch 2.13, MKL
  2024.2, one thread): rows of an M-row ``F.linear`` differ in the last bits from the
  same rows computed with M = 1 … 5, but are identical for every M that is a multiple of
  16, whichever rows share the call and at whatever position a row sits.
- **Vector tails.** Elementwise transcendental functions (SiLU, sigmoid, rsqrt) run in
  vectorised chunks of 32 floats plus a scalar loop for the remainder, and the two round
  differently: element (r, c) of a [9, 16] SiLU input lands in a full chunk, the same
  element alone ([1, 16]) in the scalar tail. Measured: rows differ in the last bit.
- **Attention width.** A query at position p attending over more (masked) keys sums its
  softmax and its probabilities × values in a different order; ``attention.attend``
  therefore runs a verify pass row by row over exactly the keys ``0..p``.

``row_blocked()`` (or the decorator ``in_row_blocks``) handles the first two: while it is
active, every float32 or bfloat16 ``F.linear`` on CPU runs one of the runtime's row-invariant
kernels (``csrc/row_linear.cpp``; float32: each output one 16-lane dot product in ascending k,
whatever M, the other rows and the thread; bfloat16, on CPUs with AMX-BF16: each output one
element of a full 16 x 16 AMX tile product accumulated over k in ascending 32-wide steps, rounded
once to bfloat16; on AVX512-BF16 CPUs without AMX (AMD Zen 4): each output one 16-lane vdpbf16ps
chain over k in ascending 32-wide steps, rounded once — the product plain decode uses for one row
there, ``runtime.gemv``), any other ``F.linear`` (float16, GPU, a non-contiguous weight, no AVX-512 /
AVX512-BF16 or no compiler) pads its rows (all leading dimensions flattened) with zero rows
to a multiple of ``ROW_BLOCK`` = 16 and drops them afterwards, and SiLU / sigmoid / rsqrt
run on their input flattened and zero-padded to a multiple of ``VECTOR_BLOCK`` = 64
elements (every element on the vector path). ``speculative_generate`` runs under it, and
``generate(..., exact=True)`` does too — then the plain decode path computes its one row
through the same row-invariant product the verify pass uses for its k+1 rows, so plain and
speculative greedy outputs agree token for token (``tests/test_speculative.py`` checks the
logits bit for bit per architecture at tp 1 and 2). RMSNorm's reduction, softmax over the last
dimension, routing, expert dispatch and the all-reduces already work row by row (or
element by element with exact arithmetic) and need nothing.

Costs: the ``TorchFunctionMode`` dispatch, a Python call per torch operation, and where a
product is padded, a 16-row GEMM where a GEMV would do: a 2048x5632 float32 weight padded to 16
rows streams at ~10-11 GB/s here against 25-30 GB/s one row at a time. The fixed-order kernel
streams it at 25-30 GB/s for 1-4 rows, 23 at 8 and 13-17 at 16 (padded MKL: 10-12 at every
size), and reaches 60-80% of MKL's GFLOP/s on prefill-sized blocks (64-256 rows). In bfloat16
the padded product (oneDNN) streams a 5632x2048 or 2048x5632 weight at 13-19 GB/s for 1-16
rows, the AMX kernel at 20-30 GB/s (the one-row GEMV's speed), and at 64-256 rows the kernel
reaches 620-1090 GFLOP/s against oneDNN's 400-650; measured side by side in one process, two
threads. On an AMD EPYC (Zen 4) VM the vdpbf16ps kernel streams 23 GB/s for one row and 21 for
four (padded oneDNN 12 and 10), 183 vs 153 GFLOP/s at 16 rows, 249-266 vs 308-392 at 64-256.
Plain ``generate`` runs ``runtime.gemv``'s one-row products unless asked for ``exact``; its greedy tokens can then differ from a speculative run's only where two logits tie
to the last bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardwise.runtime import cpp_ops, gemv

ROW_BLOCK = 16
"""Rows of every GEMM under ``row_blocked()`` are padded to a multiple of this."""

VECTOR_BLOCK = 64
"""Elements of every transcendental elementwise op under ``row_blocked()`` are padded to a
multiple of this (a whole number of the vectorised loop's chunks: no scalar tail)."""

_ELEMENTWISE = frozenset({F.silu, torch.sigmoid, torch.Tensor.sigmoid, torch.rsqrt, torch.Tensor.rsqrt})


_KERNELS = {torch.float32: ("linear_f32",), torch.bfloat16: ("linear_bf16", "linear_bf16_dp")}
"""The row-invariant ops per dtype, in order of preference."""

VECTOR_KERNELS = frozenset({"linear_f32", "linear_bf16_dp"})
"""Kernels built on vector instructions (FMA, vdpbf16ps): as fast as a GEMV for 1-16 rows, slower than
the padded BLAS GEMM from ~64 rows (float32 120-150 vs MKL's 190-200 GFLOP/s on the Xeon; bfloat16
vdpbf16ps 249-266 vs oneDNN's 308-392 at 64-256 rows on the AMD EPYC VM), unlike AMX tiles."""


def fixed_order_linear(rows: torch.Tensor, weight: torch.Tensor, vector_kernels: bool = True):
    """The compiled ``shardwise_rows`` op for this product where one computes it (rows [M, K] and a
    contiguous weight [N, K] of one dtype on CPU: ``linear_f32`` for float32 on an AVX-512 build;
    for bfloat16 ``linear_bf16`` on an AMX-BF16 build that Linux lets use the tile registers, else
    ``linear_bf16_dp`` on an AVX512-BF16 one; for one row, a vector kernel's ``_pairs`` twin where this machine
    streams it faster, ``gemv.pairs_faster``: the same bits), else None; ``vector_kernels=False`` leaves out
    ``VECTOR_KERNELS``."""
    names = _KERNELS.get(rows.dtype, ())
    if rows.device.type != "cpu" or weight.dtype != rows.dtype or weight.dim() != 2 or not weight.is_contiguous():
        return None
    for name in names:
        op = cpp_ops.optional_op("row_linear.cpp", "shardwise_rows", name)
        if op is not None:
            if name not in VECTOR_KERNELS:
                return op
            if not vector_kernels:
                return None
            if rows.shape[0] == 1 and gemv.pairs_faster(rows.dtype):  # the same bits, the faster schedule here
                return cpp_ops.optional_op("row_linear.cpp", "shardwise_rows", name + "_pairs") or op
            return op
    return None


class row_blocked(TorchFunctionMode):  # lower case: used like a function, ``with row_blocked():``
    """Scope in which every ``F.linear`` computes each row independently of the others: the
    fixed-order kernel where it applies, else whole blocks of ``ROW_BLOCK`` rows.

    ``vector_kernels=False`` keeps the products whose kernel is one of ``VECTOR_KERNELS`` on the
    padded GEMM, which outruns them from ~64 rows. Both are row-invariant, but not equal to each
    other: use it only for forwards whose rows are never compared with the other kind's (serving's
    prefill forwards; decode steps and verify passes must share one kind).
    """

    def __init__(self, vector_kernels: bool = True):
        super().__init__()
        self.vector_kernels = vector_kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ELEMENTWISE:
            x, *rest = args
            flat = x.reshape(-1)
            pad = -flat.numel() % VECTOR_BLOCK
            if pad:
                flat = F.pad(flat, (0, pad))
            return func(flat, *rest, **kwargs)[: x.numel()].view(x.shape)
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, *rest = args
        bias = rest[0] if rest else kwargs.get("bias")
        rows = x.reshape(-1, x.shape[-1])
        op = fixed_order_linear(rows, weight, self.vector_kernels)
        if op is not None:
            out = op(rows.contiguous(), weight)
            out = out if bias is None else out + bias
            return out.reshape(*x.shape[:-1], out.shape[-1])
        m = rows.shape[0]
        pad = -m % ROW_BLOCK
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        out = F.linear(rows, weight, bias)[:m]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def in_row_blocks(fn):
    """Decorator: run ``fn`` under a fresh ``row_blocked()``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with row_blocked():
            return fn(*args, **kwargs)

    return wrapper
