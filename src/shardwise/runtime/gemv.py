"""One-row products on CPU (batch-1 decode): ``y = W x`` for a float weight ``W`` [out, in].

float32 (and float16) weights run ``torch.mv`` (MKL's GEMV streams them at the machine's read
bandwidth, and gives F.linear's own bits). bfloat16 weights run the runtime's compiled kernel
(``csrc/bf16_gemv.cpp``, built on first use by ``runtime.cpp_ops``) where the CPU has AVX512-BF16:
torch's bfloat16 GEMV streamed a decode step's small matrices at 8-13 GB/s here (a MoE expert's
256 × 1024, its 1024 × 256 down projection) against 19-22 GB/s for the kernel, large ones at 16-24
against 22-29 GB/s (two threads, side by side in one process). Both sum in float32 and round once,
in a different order: the kernel's outputs equal F.linear's bits for nearly every element and are
one bfloat16 step away for the rest (``tests/test_runtime_linear.py``). Elsewhere (no AVX512-BF16,
no compiler, a non-contiguous weight) bfloat16 keeps ``torch.mv``.
"""

from __future__ import annotations

import torch

__all__ = ["bf16_kernel", "mv"]

_op: list = []  # [the compiled op, or None where it is not available]: decided once per process


def bf16_kernel():
    """The compiled ``shardwise_gemv.bf16_mv(w, x)`` op, or None where this CPU or machine cannot run it."""
    if not _op:
        from shardwise.runtime import cpp_ops

        try:
            cpp_ops.load("bf16_gemv.cpp")
            _op.append(torch.ops.shardwise_gemv.bf16_mv)
        except (RuntimeError, OSError, ImportError, AttributeError):  # no compiler, or not built for this CPU
            _op.append(None)
    return _op[0]


def mv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] times the CPU vector ``x`` [in] of the same dtype → [out] in that dtype."""
    if weight.dtype == torch.bfloat16 and weight.is_contiguous():
        op = bf16_kernel()
        if op is not None:
            return op(weight, x.contiguous())
    return torch.mv(weight, x)
