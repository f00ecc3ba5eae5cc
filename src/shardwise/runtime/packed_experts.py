"""A MoE block's packed routed experts (int8 / int4 ``IntWeight`` or MXFP4 blocks) for one row of a decode step, in
one call: ``shardwise_gemv.experts_row_packed`` (``csrc/decode_gemv.cpp``) runs each picked expert's gate, up and
down products through the int kernel (``runtime.int_matmul``: the ops and flags the modules would use, so the
products' bits are theirs), the SwiGLU between them and the weighted sum, in place of ~15 module and torch calls per
expert (three products, the activation, the weighting, the sum), each of which runs with cold caches after a weight
stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from shardwise.runtime import cpp_ops, gemv, int_matmul
from shardwise.runtime.int_matmul import IntWeight, row_flags
from shardwise.runtime.mxfp4_matmul import packed_kernel, whole_lines

__all__ = ["Packed", "expert_parts", "kernel", "mxfp4", "packed", "run"]


class Packed(NamedTuple):
    """One packed projection as the int kernel reads it: q uint8 [N, K/2] (4 bits) or int8 [N, K], its scales
    [N, K / group] (bfloat16 / float32, or MXFP4's E8M0 bytes), bits, and whether its rows are whole 128-weight
    lines (int8 rows and the integer grids apply: ``IntWeight.takes_int8_rows``)."""

    q: torch.Tensor
    scale: torch.Tensor
    bits: int
    lines: bool


def packed(linear, x: torch.Tensor) -> Packed | None:
    """``linear``'s weight as ``Packed`` where the module would run one row ``x`` through the int kernel (an
    ``IntWeight``; MXFP4 blocks where ``mxfp4_matmul`` multiplies them packed), else None."""
    w = getattr(linear, "weight", None)
    if isinstance(w, IntWeight):
        return Packed(w.q, w.scale, w.bits, w.takes_int8_rows)
    if getattr(linear, "packed", False) and getattr(linear, "bias", None) is None:
        if packed_kernel(x, linear.weight_packed) is None:
            return None
        return mxfp4(linear.weight_packed, linear.weight_scale)
    return None


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> Packed:
    """One MXFP4 projection (blocks [out, in/32, 16] or [out, in/2] bytes, E8M0 scales [out, in/32]) as ``Packed``."""
    q = blocks.view(scales.shape[0], -1)
    return Packed(q, scales, 4, whole_lines(q.shape[1] * 2))


def expert_parts(expert, x: torch.Tensor) -> tuple[Packed, Packed | None, Packed] | None:
    """(gate, up, down) of a SwiGLU ``moe.Expert`` as ``Packed``, all of one bit width — (gate|up, None, down) where its
    gate and up are one stacked ``IntWeight`` (``layers.Stack``: one kernel call for both, the halves split after;
    Qwen3-MoE-shaped int4 model, 64 experts top-8, 2 threads: see ``csrc/decode_gemv.cpp``) —, or None."""
    stack = getattr(expert, "stack", None)
    if stack is not None and isinstance(stack.weight, IntWeight) and stack.rows[0] == stack.rows[1]:
        down = packed(getattr(expert, expert.parts[2]), x)
        w = stack.weight
        if down is not None and down.bits == w.bits:
            return Packed(w.q, w.scale, w.bits, w.takes_int8_rows), None, down
    parts = tuple(packed(getattr(expert, name), x) for name in expert.parts)
    if any(p is None for p in parts) or len({p.bits for p in parts}) != 1:
        return None
    return parts


def kernel(dtype: torch.dtype, act: tuple[int, float, float]) -> Callable | None:
    """``run`` below where ``shardwise_gemv.experts_row_packed`` builds here (and the int kernel it calls), for rows
    of ``dtype`` (float32 / bfloat16) and the experts' activation ``act`` (``moe.act_args``), else None."""
    # the int kernel first: experts_row_packed looks its op up in the dispatcher
    if dtype not in (torch.float32, torch.bfloat16) or cpp_ops.optional_op(int_matmul.SOURCE, "shardwise_int", "int_matmul") is None:
        return None
    op = cpp_ops.optional_op(gemv.SOURCE, "shardwise_gemv", "experts_row_packed")
    return None if op is None else lambda *args, **kw: run(op, *args, act=act, **kw)


def run(op, x: torch.Tensor, experts: list[tuple[Packed, Packed | None, Packed]], weights: torch.Tensor, slots: list[int],
        out: torch.Tensor, act: tuple[int, float, float], biases: tuple[list, list] = ([], [])) -> None:
    """``out`` [H] (x's dtype, or float32) += sum over ``experts`` (gate, up, down; up None where gate holds gpt-oss's
    interleaved gate|up rows) of ``weights[slots[i]]`` x expert i's output for the row ``x`` [H], each product plus
    its bias where ``biases`` (gate biases, down biases: one per expert, or none) has one, through ``op`` with the
    flags ``kernel_rows`` gives the modules now."""
    gate, _, down = experts[0]
    flags = [row_flags(x.dtype, part.bits, part.lines) for part in (gate, down)]  # as the modules' kernel_rows decides
    lists = [[e[k][field] for e in experts if e[k] is not None] for k in range(3) for field in (0, 1)]
    op(x, *lists, gate.bits, weights, slots, out, *flags, *act, *biases)
