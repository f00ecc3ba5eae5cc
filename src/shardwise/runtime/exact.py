"""Row-invariant linear layers, so a k+1-position verify pass equals k+1 single-token steps.

Greedy speculative decoding is exact only if verifying k+1 positions in one forward pass
gives, for every position, bit-identical logits to decoding that position alone. Two
things break that on CPU:

- **GEMM shape.** A linear layer over M rows does not return, for a given row, the same
  bits for every M: MKL uses different kernels for small M (M = 1 is a GEMV), and each
  kernel accumulates the K products in its own order. Measured here (torch 2.13, MKL
  2024.2, one thread): rows of an M-row ``F.linear`` differ in the last bits from the
  same rows computed with M = 1 … 5, but are identical for every M that is a multiple of
  16, whichever rows share the call and at whatever position a row sits.
- **Attention width.** A query at position p attending over more (masked) keys sums its
  softmax and its probabilities × values in a different order; ``attention.attend``
  therefore runs a verify pass row by row over exactly the keys ``0..p``.

``row_blocked()`` handles the first: while it is active, every ``F.linear`` pads its rows
(all leading dimensions flattened) with zero rows to a multiple of ``ROW_BLOCK`` = 16 and
drops them afterwards. ``generate`` and ``speculative_generate`` both run under it — the
plain decode path computes its one row through the same 16-row GEMM the verify pass uses
for its k+1 rows — so plain and speculative greedy outputs agree token for token
(``tests/test_speculative.py`` checks the logits bit for bit per architecture). The
price is a 16-row GEMM where a GEMV would do: at batch 1 both read the same weights, so
memory-bound decode costs about the same. RMSNorm, softmax, routing, expert dispatch
and the all-reduces already work row by row (or element by element) and need nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_BLOCK = 16
"""Rows of every GEMM under ``row_blocked()`` are padded to a multiple of this."""


class row_blocked(TorchFunctionMode):  # noqa: N801 - used like a function: ``with row_blocked():``
    """Context (or decorator-free scope) in which ``F.linear`` runs on row blocks of 16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, *rest = args
        bias = rest[0] if rest else kwargs.get("bias")
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        pad = -m % ROW_BLOCK
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        out = F.linear(rows, weight, bias)[:m]
        return out.reshape(*x.shape[:-1], out.shape[-1])
