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
active, every ``F.linear`` pads its rows (all leading dimensions flattened) with zero rows
to a multiple of ``ROW_BLOCK`` = 16 and drops them afterwards, and SiLU / sigmoid / rsqrt
run on their input flattened and zero-padded to a multiple of ``VECTOR_BLOCK`` = 64
elements (every element on the vector path). ``speculative_generate`` runs under it, and
``generate(..., exact=True)`` does too — then the plain decode path computes its one row
through the same 16-row GEMM the verify pass uses for its k+1 rows, so plain and speculative
greedy outputs agree token for token (``tests/test_speculative.py`` checks the logits bit
for bit per architecture at tp 1 and 2). RMSNorm's reduction, softmax over the last
dimension, routing, expert dispatch and the all-reduces already work row by row (or
element by element with exact arithmetic) and need nothing.

Costs: a 16-row GEMM where a GEMV would do, and the ``TorchFunctionMode`` dispatch, a Python
call per torch operation. On CPU the 16-row GEMM is not free: a 2048x5632 float32 weight
streams at ~17.9 GB/s as a GEMV but ~4.6 GB/s padded to 16 rows, and decode of a 3.4 GB
checkpoint ran 3.9x slower (benchmarks/bench_decode.py). So plain ``generate`` runs
one-row matmuls unless asked for ``exact``; its greedy tokens can then differ from a
speculative run's only where two logits tie to the last bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_BLOCK = 16
"""Rows of every GEMM under ``row_blocked()`` are padded to a multiple of this."""

VECTOR_BLOCK = 64
"""Elements of every transcendental elementwise op under ``row_blocked()`` are padded to a
multiple of this (a whole number of the vectorised loop's chunks: no scalar tail)."""

_ELEMENTWISE = frozenset({F.silu, torch.sigmoid, torch.Tensor.sigmoid, torch.rsqrt, torch.Tensor.rsqrt})


class row_blocked(TorchFunctionMode):  # lower case: used like a function, ``with row_blocked():``
    """Scope in which every ``F.linear`` runs on whole blocks of ``ROW_BLOCK`` rows."""

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
